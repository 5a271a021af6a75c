//! Outlier detection: the discipline that keeps ordinary faults from becoming outages.
//!
//! The rules (the model is Envoy's outlier detection):
//! - a worker that cannot be reached is ejected at once;
//! - 5xx answers and timeouts count toward `consecutive_failures` in a row before an
//!   ejection (a success or a 4xx resets the run); the proxy counts a request's 5xx only
//!   once the request is known not to be at fault (see `http/proxy.rs`);
//! - 429 and 503 mean *busy*: the worker is skipped for its `Retry-After`, never ejected;
//! - never more than `max_ejection_share` of an endpoint is out at once (at least one may
//!   always be); below `panic_threshold` available, every discovered worker that is not
//!   known to be unreachable is routed to;
//! - an ejection lasts `base_ejection × n` (capped at `max_ejection`), where `n` counts
//!   the worker's ejections and falls by one per `base_ejection × decay_factor` of
//!   healthy service; re-admission needs a passing health probe, and the re-admitted
//!   worker is on probation: its next failure ejects it again at once, its next success
//!   ends the probation.
//!
//! Pure bookkeeping: no I/O, no tasks.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// When failing instances leave, and for how long.
#[derive(Debug, Clone)]
pub struct OutlierConfig {
    /// 5xx answers and timeouts in a row that eject a worker.
    pub consecutive_failures: u32,
    /// Most of an endpoint that may be out at once (0.0–1.0); at least one instance may
    /// always be ejected.
    pub max_ejection_share: f64,
    /// Below this share of available instances, route over every discovered instance
    /// that is not known to be unreachable (panic mode). 0 turns panic mode off.
    pub panic_threshold: f64,
    /// First ejection's length; the n-th lasts n times this.
    pub base_ejection: Duration,
    /// Longest ejection.
    pub max_ejection: Duration,
    /// A busy answer (429/503) without `Retry-After` skips the worker this long.
    pub busy_default: Duration,
    /// Longest `Retry-After` honoured.
    pub busy_max: Duration,
    /// How long an instance that discovery removed while it was serving keeps serving
    /// (unless it fails, deregisters gracefully or registers again).
    pub discovery_grace: Duration,
    /// Active health checks of available instances: the interval (`None`: off).
    pub health_interval: Option<Duration>,
    /// Failed active health checks in a row that eject an instance.
    pub unhealthy_threshold: u32,
}

impl Default for OutlierConfig {
    fn default() -> Self {
        OutlierConfig {
            consecutive_failures: 3,
            max_ejection_share: 0.5,
            panic_threshold: 0.5,
            base_ejection: Duration::from_secs(2),
            max_ejection: Duration::from_secs(120),
            busy_default: Duration::from_secs(1),
            busy_max: Duration::from_secs(60),
            discovery_grace: Duration::from_secs(60),
            health_interval: Some(Duration::from_secs(5)),
            unhealthy_threshold: 2,
        }
    }
}

impl OutlierConfig {
    /// How many of `discovered` instances may be out at once.
    pub fn max_ejected(&self, discovered: usize) -> usize {
        let share = self.max_ejection_share.clamp(0.0, 1.0);
        if share == 0.0 {
            return 0;
        }
        ((discovered as f64 * share).floor() as usize).max(1)
    }

    /// True when `available` of `discovered` is below the panic threshold.
    pub fn panics(&self, available: usize, discovered: usize) -> bool {
        discovered > 0 && (available as f64) < self.panic_threshold * discovered as f64
    }

    /// The length of an ejection that is the worker's `n`-th (n ≥ 1) in recent memory.
    pub fn ejection_time(&self, n: u32) -> Duration {
        self.base_ejection
            .saturating_mul(n.max(1))
            .min(self.max_ejection)
    }

    /// How long a `Retry-After` of `given` skips a worker.
    pub fn busy_time(&self, given: Option<Duration>) -> Duration {
        given.unwrap_or(self.busy_default).min(self.busy_max)
    }
}

/// Why an instance is out of the available set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DownKind {
    /// It could not be reached (refused, reset, connect timeout). Panic mode does not
    /// route to it.
    Unreachable,
    /// A run of 5xx answers or timeouts, or a failure on probation.
    Failing,
    /// Its active health checks failed.
    Unhealthy,
}

/// One instance's failure memory. Shared (`Arc`) across snapshots, so that recording
/// an outcome, the common case, never rebuilds the snapshot.
#[derive(Debug, Default)]
pub struct InstanceHealth {
    /// 5xx answers and timeouts in a row.
    consecutive: AtomicU32,
    /// Failed active health checks in a row.
    failed_checks: AtomicU32,
    /// Re-admitted by a probe and not yet confirmed by a successful request.
    probation: AtomicBool,
    /// Ejection count and when it was last updated, for growth and decay.
    ejections: Mutex<(u32, Option<Instant>)>,
}

impl InstanceHealth {
    /// A success (or a 4xx: the worker answered sensibly). Returns true when it ended a
    /// probation.
    pub fn success(&self) -> bool {
        self.consecutive.store(0, Ordering::Relaxed);
        self.probation.swap(false, Ordering::Relaxed)
    }

    /// A counted failure; true when it should eject (the run is long enough, or the
    /// instance is on probation).
    pub fn failure(&self, config: &OutlierConfig) -> bool {
        let run = self.consecutive.fetch_add(1, Ordering::Relaxed) + 1;
        run >= config.consecutive_failures.max(1) || self.probation.load(Ordering::Relaxed)
    }

    /// A failed active health check; true when it should eject.
    pub fn failed_check(&self, config: &OutlierConfig) -> bool {
        let run = self.failed_checks.fetch_add(1, Ordering::Relaxed) + 1;
        run >= config.unhealthy_threshold.max(1)
    }

    /// A passing active health check.
    pub fn passed_check(&self) {
        self.failed_checks.store(0, Ordering::Relaxed);
    }

    /// Records an ejection at `now`; returns how long it lasts. The count decays by one
    /// per `base_ejection × 4` since the last ejection or re-admission.
    pub fn ejected(&self, config: &OutlierConfig, now: Instant) -> Duration {
        let mut e = self.ejections.lock();
        let decay = config
            .base_ejection
            .saturating_mul(4)
            .max(Duration::from_millis(1));
        let decayed = e.1.map_or(0, |t| {
            (now.saturating_duration_since(t).as_millis() / decay.as_millis()) as u32
        });
        e.0 = e.0.saturating_sub(decayed) + 1;
        e.1 = Some(now);
        self.consecutive.store(0, Ordering::Relaxed);
        self.failed_checks.store(0, Ordering::Relaxed);
        self.probation.store(false, Ordering::Relaxed);
        config.ejection_time(e.0)
    }

    /// Re-admitted by a probe at `now`: on probation until its next request.
    pub fn readmitted(&self, now: Instant) {
        self.probation.store(true, Ordering::Relaxed);
        self.consecutive.store(0, Ordering::Relaxed);
        self.ejections.lock().1 = Some(now);
    }

    /// Re-admitted by a new registration (a restarted worker): no probation.
    pub fn fresh(&self) {
        self.probation.store(false, Ordering::Relaxed);
        self.consecutive.store(0, Ordering::Relaxed);
        self.failed_checks.store(0, Ordering::Relaxed);
    }

    /// On probation.
    pub fn on_probation(&self) -> bool {
        self.probation.load(Ordering::Relaxed)
    }

    /// Ejections in recent memory.
    pub fn ejections(&self) -> u32 {
        self.ejections.lock().0
    }

    /// Failures in the current run.
    pub fn consecutive_failures(&self) -> u32 {
        self.consecutive.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_share_cap_always_allows_one_and_panic_needs_a_minority() {
        let c = OutlierConfig::default();
        assert_eq!(c.max_ejected(1), 1);
        assert_eq!(c.max_ejected(3), 1);
        assert_eq!(c.max_ejected(4), 2);
        assert_eq!(
            OutlierConfig {
                max_ejection_share: 0.0,
                ..c.clone()
            }
            .max_ejected(10),
            0
        );
        assert!(!c.panics(2, 4));
        assert!(c.panics(1, 4));
        assert!(c.panics(0, 1));
        assert!(!c.panics(0, 0));
    }

    #[test]
    fn ejections_grow_with_repeats_are_capped_and_decay_with_healthy_time() {
        let c = OutlierConfig {
            base_ejection: Duration::from_secs(1),
            max_ejection: Duration::from_secs(3),
            ..Default::default()
        };
        let h = InstanceHealth::default();
        let t0 = Instant::now();
        assert_eq!(h.ejected(&c, t0), Duration::from_secs(1));
        h.readmitted(t0 + Duration::from_secs(1));
        assert_eq!(
            h.ejected(&c, t0 + Duration::from_secs(2)),
            Duration::from_secs(2)
        );
        assert_eq!(
            h.ejected(&c, t0 + Duration::from_secs(3)),
            Duration::from_secs(3)
        );
        assert_eq!(
            h.ejected(&c, t0 + Duration::from_secs(4)),
            Duration::from_secs(3),
            "capped"
        );
        // 8 s of good service (two decay steps of 4 s) brings it from 4 down to 2.
        assert_eq!(
            h.ejected(&c, t0 + Duration::from_secs(12)),
            Duration::from_secs(3)
        );
        assert_eq!(h.ejections(), 3);
    }

    #[test]
    fn a_run_ejects_a_success_resets_it_and_probation_ejects_at_once() {
        let c = OutlierConfig::default();
        let h = InstanceHealth::default();
        assert!(!h.failure(&c));
        assert!(!h.failure(&c));
        assert!(!h.success());
        assert!(!h.failure(&c));
        assert!(!h.failure(&c));
        assert!(h.failure(&c), "the third in a row ejects");
        h.ejected(&c, Instant::now());
        h.readmitted(Instant::now());
        assert!(h.on_probation());
        assert!(h.failure(&c), "a failure on probation ejects at once");
        h.readmitted(Instant::now());
        assert!(h.success(), "a success ends the probation");
        assert!(!h.failure(&c));
    }
}
