//! Discovery's updates applied to a Client: instances admitted, replaced, held through a
//! discovery removal's grace, and each change published as a new snapshot.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::SystemTime;

use switchyard_discovery::{DiscoveryUpdate, InstanceInfo};
use switchyard_ids::InstanceId;

use super::recovery::hold;
use super::{Availability, Client, InstanceState, Snapshot};

impl Client {
    /// Applies one discovery update; returns the resulting snapshot version.
    pub fn apply(&self, update: DiscoveryUpdate) -> u64 {
        let mut to_hold = Vec::new();
        let version = self.write(|instances, tasks| match update {
            DiscoveryUpdate::Reset(list) => {
                let mut next = BTreeMap::new();
                for info in list {
                    let id = info.id;
                    let state = self.admit(instances.remove(&id), info, tasks);
                    next.insert(id, state);
                }
                for (id, state) in std::mem::take(instances) {
                    if let Some(state) = self.removed(id, state, tasks, &mut to_hold) {
                        next.insert(id, state);
                    }
                }
                *instances = next;
            }
            DiscoveryUpdate::Insert(info) => {
                let id = info.id;
                let state = self.admit(instances.remove(&id), info, tasks);
                instances.insert(id, state);
            }
            DiscoveryUpdate::Remove(id) => {
                if let Some(state) = instances.remove(&id)
                    && let Some(state) = self.removed(id, state, tasks, &mut to_hold)
                {
                    instances.insert(id, state);
                }
            }
            DiscoveryUpdate::Leave(id) => {
                instances.remove(&id);
                if let Some(t) = tasks.remove(&id) {
                    t.abort();
                }
            }
        });
        for id in to_hold {
            tracing::warn!(endpoint = %self.endpoint, instance = %id, grace = ?self.config.outlier.discovery_grace, "discovery removed a serving instance; it keeps serving while it answers, for the grace period");
        }
        version
    }

    /// What becomes of an instance that discovery no longer lists: gone, unless it was
    /// serving and a grace period applies; then it is held (and checked at once).
    pub(super) fn removed(
        &self,
        id: InstanceId,
        mut state: InstanceState,
        tasks: &mut HashMap<InstanceId, tokio::task::AbortHandle>,
        held: &mut Vec<InstanceId>,
    ) -> Option<InstanceState> {
        let grace = self.config.outlier.discovery_grace;
        if state.held_until.is_some() {
            return Some(state);
        }
        if state.availability != Availability::Available || grace.is_zero() {
            if let Some(t) = tasks.remove(&id) {
                t.abort();
            }
            return None;
        }
        state.held_until = Some(SystemTime::now() + grace);
        let task = self
            .runtime
            .spawn(hold(self.me.clone(), id, state.info.registration, grace));
        if let Some(old) = tasks.insert(id, task.abort_handle()) {
            old.abort();
        }
        self.counters.held_removals.fetch_add(1, Ordering::Relaxed);
        held.push(id);
        Some(state)
    }

    /// The state of an announced instance: its old availability if this is the same
    /// registration, available otherwise (a new registration re-admits it). Either way
    /// discovery lists it, so a hold ends.
    pub(super) fn admit(
        &self,
        old: Option<InstanceState>,
        info: InstanceInfo,
        tasks: &mut HashMap<InstanceId, tokio::task::AbortHandle>,
    ) -> InstanceState {
        let Some(old) = old else {
            return InstanceState {
                info: Arc::new(info),
                availability: Availability::Available,
                health: Arc::default(),
                held_until: None,
            };
        };
        if old.held_until.is_some()
            && let Some(t) = tasks.remove(&info.id)
        {
            t.abort();
        }
        let availability = if old.info.registration == info.registration {
            old.availability
        } else {
            if old.availability != Availability::Available {
                if let Some(t) = tasks.remove(&info.id) {
                    t.abort();
                }
                self.counters
                    .readmitted_by_discovery
                    .fetch_add(1, Ordering::Relaxed);
                tracing::info!(endpoint = %self.endpoint, instance = %info.id, "instance registered again; available");
            }
            old.health.fresh();
            Availability::Available
        };
        InstanceState {
            info: Arc::new(info),
            availability,
            health: old.health,
            held_until: None,
        }
    }

    /// Runs one writer step on a copy of the state and publishes the result.
    pub(super) fn write(
        &self,
        f: impl FnOnce(
            &mut BTreeMap<InstanceId, InstanceState>,
            &mut HashMap<InstanceId, tokio::task::AbortHandle>,
        ),
    ) -> u64 {
        let mut tasks = self.writer.lock();
        let old = self.current.load_full();
        let mut instances = old.instances.clone();
        f(&mut instances, &mut tasks);
        let available: Vec<InstanceId> = instances
            .iter()
            .filter(|(_, s)| s.availability == Availability::Available)
            .map(|(id, _)| *id)
            .collect();
        let available_changed = *available != *old.available;
        let available: Arc<[InstanceId]> = if available_changed {
            Arc::from(available)
        } else {
            old.available.clone()
        };
        let panic = self.config.outlier.panics(available.len(), instances.len());
        let routable: Arc<[InstanceId]> = if panic {
            instances
                .iter()
                .filter(|(_, s)| !s.availability.is_unreachable())
                .map(|(id, _)| *id)
                .collect()
        } else {
            available.clone()
        };
        if panic != old.panic {
            if panic {
                self.counters.panics.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(endpoint = %self.endpoint, available = available.len(), discovered = instances.len(), "panic mode: too few instances available; routing over every instance not known to be unreachable");
            } else {
                tracing::info!(endpoint = %self.endpoint, available = available.len(), "panic mode over");
            }
        }
        let version = old.version + 1;
        self.current.store(Arc::new(Snapshot {
            version,
            instances,
            available: available.clone(),
            routable,
            panic,
        }));
        if available_changed {
            self.available_tx.send_replace(available);
        }
        self.version_tx.send_replace(version);
        version
    }
}
