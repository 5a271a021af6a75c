//! The per-endpoint `Client`: which instances are discovered, and which of them are
//! *available* — the only ones anything routes to.
//!
//! Rules of the available set (the only code that changes it is in this file; the
//! discipline behind ejections is in [`outlier`]):
//! - an instance enters it when discovery announces it (a new ID, or a known ID with a
//!   new registration);
//! - [`Client::report_instance_down`] (the worker cannot be reached) ejects it at once;
//!   [`Client::record_failure`] (a 5xx or a timeout the request was not to blame for)
//!   ejects it after a run; failed active health checks eject it; every ejection is
//!   refused when the endpoint already has its share out;
//! - an ejected instance is probed once its ejection time has passed, and returns on
//!   probation when a probe succeeds, or at once when discovery announces a new
//!   registration;
//! - a busy instance ([`Client::report_busy`]) stays available but is skipped by routing
//!   until its `Retry-After` has passed;
//! - discovery removing an instance that is down, or that left gracefully, removes it
//!   from both sets; an instance that was serving is held for a grace period (a mass
//!   lease expiry after an etcd outage must not empty the fleet) if a health probe says
//!   it still answers, and leaves when it fails, the grace ends, or it deregisters.
//!
//! State is an immutable [`Snapshot`] behind `ArcSwap`, replaced whole by writers that
//! hold one mutex, so readers never lock and never see a torn state; every change to the
//! available set is published on a `watch` channel before the writer returns.
//!
//! Must not know: etcd, HTTP serving, policies.

mod health;
mod membership;
pub mod outlier;
mod recovery;
mod registry;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use tokio::sync::watch;

pub use health::{HealthCheck, HealthError, HttpHealthCheck, local_exhaustion};
pub use outlier::{DownKind, InstanceHealth, OutlierConfig};
pub use registry::ClientRegistry;
use switchyard_discovery::{EndpointPath, InstanceInfo};
use switchyard_ids::InstanceId;

use recovery::{active_checks, probe};

/// Re-admission probing and outlier detection.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Delay between the end of an ejection and the next probe after a failed one
    /// (doubling up to `probe_max`).
    pub probe_initial: Duration,
    /// Longest delay between probes.
    pub probe_max: Duration,
    /// Ejection rules.
    pub outlier: OutlierConfig,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            probe_initial: Duration::from_millis(500),
            probe_max: Duration::from_secs(30),
            outlier: OutlierConfig::default(),
        }
    }
}

/// Whether an instance takes traffic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Availability {
    /// Routable.
    Available,
    /// Ejected; probed once `ejected_for` has passed.
    Down {
        /// When it was ejected.
        since: SystemTime,
        /// Why (from the report).
        reason: String,
        /// Failed probes so far.
        failed_probes: u32,
        /// What kind of failure.
        kind: DownKind,
        /// How long the ejection lasts before probing starts.
        ejected_for: Duration,
    },
}

impl Availability {
    pub(super) fn is_unreachable(&self) -> bool {
        matches!(
            self,
            Availability::Down {
                kind: DownKind::Unreachable,
                ..
            }
        )
    }
}

/// One discovered instance and its availability.
#[derive(Debug, Clone)]
pub struct InstanceState {
    /// What discovery says about it.
    pub info: Arc<InstanceInfo>,
    /// Whether it is routable.
    pub availability: Availability,
    /// Its failure memory (shared across snapshots).
    pub health: Arc<InstanceHealth>,
    /// Discovery removed it while it was serving: it serves until then unless it fails.
    pub held_until: Option<SystemTime>,
}

/// The endpoint's state at one moment. Never modified once published.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// Increases by one per change.
    pub version: u64,
    /// Every discovered instance (and those held after discovery removed them).
    pub instances: BTreeMap<InstanceId, InstanceState>,
    /// The available instances, ascending.
    pub available: Arc<[InstanceId]>,
    /// What routing uses: `available`, or in panic mode every instance not known to be
    /// unreachable.
    pub routable: Arc<[InstanceId]>,
    /// Fewer instances are available than the panic threshold.
    pub panic: bool,
}

/// How the available set has changed over the client's life.
#[derive(Debug, Default)]
pub struct ClientCounters {
    /// Effective ejections (of every kind).
    pub reported_down: AtomicU64,
    /// Ejections because the instance could not be reached.
    pub ejected_unreachable: AtomicU64,
    /// Ejections after a run of failures (or one on probation).
    pub ejected_failing: AtomicU64,
    /// Ejections after failed active health checks.
    pub ejected_unhealthy: AtomicU64,
    /// Ejections refused because the endpoint already had its share out.
    pub ejections_refused: AtomicU64,
    /// Busy answers (429/503) recorded.
    pub busy: AtomicU64,
    /// Instances re-admitted by a successful health probe.
    pub readmitted_by_probe: AtomicU64,
    /// Instances re-admitted because discovery announced a new registration.
    pub readmitted_by_discovery: AtomicU64,
    /// Health probes that failed.
    pub failed_probes: AtomicU64,
    /// Removals by discovery that were held because the instance still answered.
    pub held_removals: AtomicU64,
    /// Times the endpoint entered panic mode.
    pub panics: AtomicU64,
}

/// One endpoint's instances. Create through [`ClientRegistry`] so that it is shared.
pub struct Client {
    pub(crate) endpoint: EndpointPath,
    pub(crate) config: ClientConfig,
    pub(crate) health: Arc<dyn HealthCheck>,
    /// The published state; readers load it without locking.
    pub(crate) current: ArcSwap<Snapshot>,
    /// The available IDs, sent under `writer` after each change so that every receiver
    /// sees changes in the order they were made.
    pub(crate) available_tx: watch::Sender<Arc<[InstanceId]>>,
    /// The snapshot version, sent after every change (also those that leave the
    /// available set alone, e.g. discovery removing a down instance).
    pub(crate) version_tx: watch::Sender<u64>,
    /// Serialises writers (discovery updates, reports, re-admissions) and owns the
    /// per-instance tasks (a probe, or a hold). Never held across an await.
    pub(crate) writer: Mutex<HashMap<InstanceId, tokio::task::AbortHandle>>,
    /// Busy instances and when they may take traffic again. Usually empty; `any_busy`
    /// lets routing skip the lock then.
    pub(crate) busy: Mutex<Vec<(InstanceId, Instant)>>,
    pub(crate) any_busy: AtomicBool,
    pub(crate) counters: ClientCounters,
    pub(crate) runtime: tokio::runtime::Handle,
    pub(crate) me: Weak<Client>,
}

impl Client {
    /// An empty client for `endpoint`. Must be called inside a Tokio runtime (probes and
    /// active health checks are spawned on it).
    pub fn new(
        endpoint: EndpointPath,
        config: ClientConfig,
        health: Arc<dyn HealthCheck>,
    ) -> Arc<Client> {
        let empty: Arc<[InstanceId]> = Arc::from(Vec::new());
        let (available_tx, _) = watch::channel(empty);
        let (version_tx, _) = watch::channel(0);
        let client = Arc::new_cyclic(|me| Client {
            endpoint,
            config,
            health,
            current: ArcSwap::from_pointee(Snapshot::default()),
            available_tx,
            version_tx,
            writer: Mutex::new(HashMap::new()),
            busy: Mutex::new(Vec::new()),
            any_busy: AtomicBool::new(false),
            counters: ClientCounters::default(),
            runtime: tokio::runtime::Handle::current(),
            me: me.clone(),
        });
        if let Some(every) = client.config.outlier.health_interval {
            client
                .runtime
                .spawn(active_checks(Arc::downgrade(&client), every));
        }
        client
    }

    /// The endpoint this client serves.
    pub fn endpoint(&self) -> &EndpointPath {
        &self.endpoint
    }

    /// The rules this client applies.
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// The available instance IDs, ascending.
    pub fn available(&self) -> Arc<[InstanceId]> {
        self.current.load().available.clone()
    }

    /// The IDs routing may use, ascending: the available ones, or in panic mode every
    /// discovered instance not known to be unreachable.
    pub fn routable(&self) -> Arc<[InstanceId]> {
        self.current.load().routable.clone()
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

    /// The worker could not be reached: ejects it at once (every watch receiver sees the
    /// smaller set before this returns) unless the endpoint already has its share out.
    /// Returns `false` when nothing changed (unknown, already down, or refused).
    pub fn report_instance_down(&self, id: InstanceId, reason: &str) -> bool {
        self.eject(id, reason, DownKind::Unreachable).0
    }

    /// A request the worker answered well (or refused as the client's fault).
    pub fn record_success(&self, id: InstanceId) {
        let snap = self.current.load();
        if let Some(state) = snap.instances.get(&id)
            && state.health.success()
        {
            tracing::info!(endpoint = %self.endpoint, instance = %id, "instance passed its probation");
        }
    }

    /// A 5xx answer or a timeout that was the worker's fault; ejects it after a run (or
    /// at once on probation). Returns true when it was ejected.
    pub fn record_failure(&self, id: InstanceId, reason: &str) -> bool {
        let eject = {
            let snap = self.current.load();
            let Some(state) = snap.instances.get(&id) else {
                return false;
            };
            state.health.failure(&self.config.outlier)
        };
        eject && self.eject(id, reason, DownKind::Failing).0
    }

    /// A request timed out on `id` without being its fault unless the worker is silent:
    /// probes its health now and counts a failure only if the probe fails.
    pub async fn check_now(&self, id: InstanceId, reason: &str) {
        let Some(info) = self.instance(id) else {
            return;
        };
        if let Err(HealthError::Unhealthy(e)) = self.health.check(&info).await {
            self.record_failure(id, &format!("{reason}; and its health check failed: {e}"));
        }
    }

    /// A health check of `id` now: `Ok` when it answers, the reason when it does not;
    /// `None` when it is not known, or the check could not be made (the router is out of
    /// resources).
    pub async fn health_of(&self, id: InstanceId) -> Option<Result<(), String>> {
        let info = self.instance(id)?;
        match self.health.check(&info).await {
            Ok(()) => Some(Ok(())),
            Err(HealthError::Unhealthy(e)) => Some(Err(e)),
            Err(HealthError::Local(_)) => None,
        }
    }

    /// The worker said it is busy (429/503): skip it for `retry_after` (or the default),
    /// without counting a failure.
    pub fn report_busy(&self, id: InstanceId, retry_after: Option<Duration>) -> Duration {
        let skip = self.config.outlier.busy_time(retry_after);
        let until = Instant::now() + skip;
        let mut busy = self.busy.lock();
        match busy.iter_mut().find(|(b, _)| *b == id) {
            Some(entry) => entry.1 = entry.1.max(until),
            None => busy.push((id, until)),
        }
        self.any_busy.store(true, Ordering::Release);
        self.counters.busy.fetch_add(1, Ordering::Relaxed);
        skip
    }

    /// Instances that asked not to get traffic until after `now`, with how long is left.
    pub fn busy(&self, now: Instant) -> Vec<(InstanceId, Duration)> {
        if !self.any_busy.load(Ordering::Acquire) {
            return Vec::new();
        }
        let mut busy = self.busy.lock();
        busy.retain(|(_, until)| *until > now);
        if busy.is_empty() {
            self.any_busy.store(false, Ordering::Release);
        }
        busy.iter().map(|(id, until)| (*id, *until - now)).collect()
    }

    /// Takes `id` out of the available set, subject to the share cap. Returns whether it
    /// changed anything, and the snapshot version.
    pub(super) fn eject(&self, id: InstanceId, reason: &str, kind: DownKind) -> (bool, u64) {
        let mut changed = false;
        let mut refused = false;
        let mut removed_held = false;
        let mut ejected_for = Duration::ZERO;
        let version = self.write(|instances, tasks| {
            let Some(state) = instances.get(&id) else {
                return;
            };
            if state.availability != Availability::Available {
                return;
            }
            if state.held_until.is_some() {
                // Discovery already removed it; failing ends the hold.
                instances.remove(&id);
                if let Some(t) = tasks.remove(&id) {
                    t.abort();
                }
                removed_held = true;
                changed = true;
                return;
            }
            let out = instances
                .values()
                .filter(|s| s.availability != Availability::Available)
                .count();
            if out + 1 > self.config.outlier.max_ejected(instances.len()) {
                refused = true;
                self.counters
                    .ejections_refused
                    .fetch_add(1, Ordering::Relaxed);
                return;
            }
            let state = instances.get_mut(&id).expect("checked above");
            ejected_for = state.health.ejected(&self.config.outlier, Instant::now());
            state.availability = Availability::Down {
                since: SystemTime::now(),
                reason: reason.to_string(),
                failed_probes: 0,
                kind,
                ejected_for,
            };
            let registration = state.info.registration;
            let task = self
                .runtime
                .spawn(probe(self.me.clone(), id, registration, ejected_for));
            if let Some(old) = tasks.insert(id, task.abort_handle()) {
                old.abort();
            }
            changed = true;
            // Counted before the change is published, so that whoever sees the change
            // also sees it counted.
            self.counters.reported_down.fetch_add(1, Ordering::Relaxed);
            let by_kind = match kind {
                DownKind::Unreachable => &self.counters.ejected_unreachable,
                DownKind::Failing => &self.counters.ejected_failing,
                DownKind::Unhealthy => &self.counters.ejected_unhealthy,
            };
            by_kind.fetch_add(1, Ordering::Relaxed);
        });
        if removed_held {
            tracing::warn!(endpoint = %self.endpoint, instance = %id, reason, "instance held after discovery removed it has failed; removed");
        } else if changed {
            tracing::warn!(endpoint = %self.endpoint, instance = %id, reason, kind = ?kind, ejected_for = ?ejected_for, "instance ejected");
        } else if refused {
            tracing::warn!(endpoint = %self.endpoint, instance = %id, reason, "ejection refused: the endpoint already has its share of instances out");
        }
        (changed, version)
    }
}

#[cfg(test)]
mod tests;
