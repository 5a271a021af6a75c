//! The per-endpoint `Client`: which instances are discovered, and which of them are
//! *available* — the only ones anything routes to.
//!
//! Rules of the available set (the only code that changes it is in this file):
//! - an instance enters it when discovery announces it (a new ID, or a known ID with a
//!   new registration);
//! - [`Client::report_instance_down`] removes it at once, although discovery still lists
//!   it, and starts probing its health endpoint with exponential backoff;
//! - it returns when a probe succeeds, or when discovery announces a new registration;
//! - an instance removed by discovery leaves both sets and its probing stops.
//!
//! State is an immutable [`Snapshot`] behind `ArcSwap`, replaced whole by writers that
//! hold one mutex, so readers never lock and never see a torn state; every change to the
//! available set is published on a `watch` channel before the writer returns.
//!
//! Must not know: etcd, HTTP serving, policies.

mod health;
mod registry;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use tokio::sync::watch;

use crate::discovery::{DiscoveryUpdate, EndpointPath, InstanceInfo};
use crate::ids::InstanceId;
pub use health::{HealthCheck, HttpHealthCheck};
pub use registry::ClientRegistry;

/// Re-admission probing.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Delay before the first probe of a reported-down instance.
    pub probe_initial: Duration,
    /// Longest delay between probes (the delay doubles up to this).
    pub probe_max: Duration,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            probe_initial: Duration::from_millis(500),
            probe_max: Duration::from_secs(30),
        }
    }
}

/// Whether an instance takes traffic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Availability {
    /// Routable.
    Available,
    /// Reported down; being probed.
    Down {
        /// When it was reported down.
        since: SystemTime,
        /// Why (from the report).
        reason: String,
        /// Failed probes so far.
        failed_probes: u32,
    },
}

/// One discovered instance and its availability.
#[derive(Debug, Clone)]
pub struct InstanceState {
    /// What discovery says about it.
    pub info: Arc<InstanceInfo>,
    /// Whether it is routable.
    pub availability: Availability,
}

/// The endpoint's state at one moment. Never modified once published.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// Increases by one per change.
    pub version: u64,
    /// Every discovered instance.
    pub instances: BTreeMap<InstanceId, InstanceState>,
    /// The available instances, ascending.
    pub available: Arc<[InstanceId]>,
}

/// How the available set has changed over the client's life.
#[derive(Debug, Default)]
pub struct ClientCounters {
    /// Effective `report_instance_down` calls.
    pub reported_down: AtomicU64,
    /// Instances re-admitted by a successful health probe.
    pub readmitted_by_probe: AtomicU64,
    /// Instances re-admitted because discovery announced a new registration.
    pub readmitted_by_discovery: AtomicU64,
    /// Health probes that failed.
    pub failed_probes: AtomicU64,
}

/// One endpoint's instances. Create through [`ClientRegistry`] so that it is shared.
pub struct Client {
    endpoint: EndpointPath,
    config: ClientConfig,
    health: Arc<dyn HealthCheck>,
    /// The published state; readers load it without locking.
    current: ArcSwap<Snapshot>,
    /// The available IDs, sent under `writer` after each change so that every receiver
    /// sees changes in the order they were made.
    available_tx: watch::Sender<Arc<[InstanceId]>>,
    /// The snapshot version, sent after every change (also those that leave the
    /// available set alone, e.g. discovery removing a down instance).
    version_tx: watch::Sender<u64>,
    /// Serialises writers (discovery updates, reports, re-admissions) and owns the
    /// probe tasks. Never held across an await.
    writer: Mutex<HashMap<InstanceId, tokio::task::AbortHandle>>,
    counters: ClientCounters,
    runtime: tokio::runtime::Handle,
    me: Weak<Client>,
}

impl Client {
    /// An empty client for `endpoint`. Must be called inside a Tokio runtime (probes are
    /// spawned on it).
    pub fn new(
        endpoint: EndpointPath,
        config: ClientConfig,
        health: Arc<dyn HealthCheck>,
    ) -> Arc<Client> {
        let empty: Arc<[InstanceId]> = Arc::from(Vec::new());
        let (available_tx, _) = watch::channel(empty);
        let (version_tx, _) = watch::channel(0);
        Arc::new_cyclic(|me| Client {
            endpoint,
            config,
            health,
            current: ArcSwap::from_pointee(Snapshot::default()),
            available_tx,
            version_tx,
            writer: Mutex::new(HashMap::new()),
            counters: ClientCounters::default(),
            runtime: tokio::runtime::Handle::current(),
            me: me.clone(),
        })
    }

    /// The endpoint this client serves.
    pub fn endpoint(&self) -> &EndpointPath {
        &self.endpoint
    }

    /// The available instance IDs, ascending.
    pub fn available(&self) -> Arc<[InstanceId]> {
        self.current.load().available.clone()
    }

    /// The whole current state.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }

    /// A receiver of the available IDs, updated on every change.
    pub fn subscribe(&self) -> watch::Receiver<Arc<[InstanceId]>> {
        self.available_tx.subscribe()
    }

    /// A receiver of the snapshot version, updated on every change of any kind.
    pub fn subscribe_changes(&self) -> watch::Receiver<u64> {
        self.version_tx.subscribe()
    }

    /// What discovery says about `id`, if it is discovered.
    pub fn instance(&self, id: InstanceId) -> Option<Arc<InstanceInfo>> {
        self.current
            .load()
            .instances
            .get(&id)
            .map(|s| s.info.clone())
    }

    /// Counters of availability changes.
    pub fn counters(&self) -> &ClientCounters {
        &self.counters
    }

    /// Takes `id` out of the available set at once (every watch receiver sees the
    /// smaller set before this returns) and starts probing it. Returns `false` when it
    /// was not available (unknown, or already down).
    pub fn report_instance_down(&self, id: InstanceId, reason: &str) -> bool {
        self.report_down_at(id, reason).0
    }

    /// `report_instance_down`, also returning the snapshot version the report produced.
    fn report_down_at(&self, id: InstanceId, reason: &str) -> (bool, u64) {
        let mut changed = false;
        let version = self.write(|instances, probes| {
            let Some(state) = instances.get_mut(&id) else {
                return;
            };
            if state.availability != Availability::Available {
                return;
            }
            state.availability = Availability::Down {
                since: SystemTime::now(),
                reason: reason.to_string(),
                failed_probes: 0,
            };
            let registration = state.info.registration;
            let task = self.runtime.spawn(probe(self.me.clone(), id, registration));
            if let Some(old) = probes.insert(id, task.abort_handle()) {
                old.abort();
            }
            changed = true;
            // Counted before the change is published, so that whoever sees the change
            // also sees it counted.
            self.counters.reported_down.fetch_add(1, Ordering::Relaxed);
        });
        if changed {
            tracing::warn!(endpoint = %self.endpoint, instance = %id, reason, "instance reported down");
        }
        (changed, version)
    }

    /// Applies one discovery update; returns the resulting snapshot version.
    pub fn apply(&self, update: DiscoveryUpdate) -> u64 {
        self.write(|instances, probes| match update {
            DiscoveryUpdate::Reset(list) => {
                let mut next = BTreeMap::new();
                for info in list {
                    let id = info.id;
                    let state = self.admit(instances.remove(&id), info, probes);
                    next.insert(id, state);
                }
                for gone in instances.keys() {
                    if let Some(p) = probes.remove(gone) {
                        p.abort();
                    }
                }
                *instances = next;
            }
            DiscoveryUpdate::Insert(info) => {
                let id = info.id;
                let state = self.admit(instances.remove(&id), info, probes);
                instances.insert(id, state);
            }
            DiscoveryUpdate::Remove(id) => {
                instances.remove(&id);
                if let Some(p) = probes.remove(&id) {
                    p.abort();
                }
            }
        })
    }

    /// The state of an announced instance: its old availability if this is the same
    /// registration, available otherwise (a new registration re-admits it).
    fn admit(
        &self,
        old: Option<InstanceState>,
        info: InstanceInfo,
        probes: &mut HashMap<InstanceId, tokio::task::AbortHandle>,
    ) -> InstanceState {
        let availability = match old {
            Some(old) if old.info.registration == info.registration => old.availability,
            Some(old) => {
                if old.availability != Availability::Available {
                    if let Some(p) = probes.remove(&info.id) {
                        p.abort();
                    }
                    self.counters
                        .readmitted_by_discovery
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::info!(endpoint = %self.endpoint, instance = %info.id, "instance registered again; available");
                }
                Availability::Available
            }
            None => Availability::Available,
        };
        InstanceState {
            info: Arc::new(info),
            availability,
        }
    }

    /// Runs one writer step on a copy of the state and publishes the result.
    fn write(
        &self,
        f: impl FnOnce(
            &mut BTreeMap<InstanceId, InstanceState>,
            &mut HashMap<InstanceId, tokio::task::AbortHandle>,
        ),
    ) -> u64 {
        let mut probes = self.writer.lock();
        let old = self.current.load_full();
        let mut instances = old.instances.clone();
        f(&mut instances, &mut probes);
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
        let version = old.version + 1;
        self.current.store(Arc::new(Snapshot {
            version,
            instances,
            available: available.clone(),
        }));
        if available_changed {
            self.available_tx.send_replace(available);
        }
        self.version_tx.send_replace(version);
        version
    }

    /// The instance's info if it is still down under `registration` (else probing stops).
    fn still_down(&self, id: InstanceId, registration: u64) -> Option<Arc<InstanceInfo>> {
        let snap = self.current.load();
        let state = snap.instances.get(&id)?;
        (state.info.registration == registration && state.availability != Availability::Available)
            .then(|| state.info.clone())
    }

    fn probe_result(&self, id: InstanceId, registration: u64, result: Result<(), String>) -> bool {
        let mut readmitted = false;
        self.write(|instances, probes| {
            let Some(state) = instances.get_mut(&id) else {
                return;
            };
            if state.info.registration != registration {
                return;
            }
            match (&result, &mut state.availability) {
                (Ok(()), Availability::Down { .. }) => {
                    state.availability = Availability::Available;
                    probes.remove(&id);
                    readmitted = true;
                    self.counters
                        .readmitted_by_probe
                        .fetch_add(1, Ordering::Relaxed);
                }
                (Err(_), Availability::Down { failed_probes, .. }) => {
                    *failed_probes += 1;
                    self.counters.failed_probes.fetch_add(1, Ordering::Relaxed);
                }
                _ => {}
            }
        });
        match result {
            Ok(()) if readmitted => {
                tracing::info!(endpoint = %self.endpoint, instance = %id, "instance healthy again; available");
            }
            Err(e) => {
                tracing::debug!(endpoint = %self.endpoint, instance = %id, error = %e, "health probe failed");
            }
            _ => {}
        }
        readmitted
    }
}

/// Probes a reported-down instance until it is healthy, re-registered or gone.
async fn probe(client: Weak<Client>, id: InstanceId, registration: u64) {
    let Some(mut delay) = client.upgrade().map(|c| c.config.probe_initial) else {
        return;
    };
    loop {
        tokio::time::sleep(delay).await;
        let Some(c) = client.upgrade() else { return };
        let Some(info) = c.still_down(id, registration) else {
            return;
        };
        let result = c.health.check(&info).await;
        if c.probe_result(id, registration, result) {
            return;
        }
        delay = (delay * 2).min(c.config.probe_max);
    }
}

#[cfg(test)]
mod tests;
