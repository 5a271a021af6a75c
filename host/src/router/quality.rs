//! How good the live policy's decisions are: the overlap it achieved against the best
//! available, what it predicted cached against what the workers then reported, where
//! it sent requests and why it could not route others. Counted per endpoint for its
//! whole life (a swap does not reset anything).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::ids::InstanceId;
use crate::policy::RejectionKind;

/// The kinds of requests not routed, in [`DecisionQuality::unrouted`] order.
pub const UNROUTED: [&str; 5] = ["no_instances", "busy", "all_busy", "no_fit", "refused"];

/// The index in [`UNROUTED`] of a policy's rejection.
pub fn rejection_index(kind: RejectionKind) -> usize {
    match kind {
        RejectionKind::AllBusy => 2,
        RejectionKind::NoFit => 3,
        RejectionKind::Refused => 4,
    }
}

/// One endpoint's decision-quality counters.
#[derive(Debug, Default)]
pub struct DecisionQuality {
    /// Requests routed to a worker.
    pub routed: AtomicU64,
    /// Over routed requests, the leading prompt blocks cached on the chosen worker.
    pub chosen_overlap_blocks: AtomicU64,
    /// ... on the candidate holding the most.
    pub best_overlap_blocks: AtomicU64,
    /// Requests not routed, by [`UNROUTED`] index.
    pub unrouted: [AtomicU64; UNROUTED.len()],
    /// Responses that reported their cached prompt tokens.
    pub cache_reports: AtomicU64,
    /// Over those, the prompt tokens the router predicted cached on the worker.
    pub predicted_cached_tokens: AtomicU64,
    /// ... and the tokens the worker reported cached.
    pub reported_cached_tokens: AtomicU64,
    by_instance: Mutex<BTreeMap<InstanceId, u64>>,
}

impl DecisionQuality {
    /// A request was routed to `worker`, whose overlap was `chosen` blocks when the best
    /// candidate's was `best`.
    pub fn routed(&self, worker: InstanceId, chosen: u32, best: u32) {
        self.routed.fetch_add(1, Ordering::Relaxed);
        self.chosen_overlap_blocks
            .fetch_add(u64::from(chosen), Ordering::Relaxed);
        self.best_overlap_blocks
            .fetch_add(u64::from(best), Ordering::Relaxed);
        *self.by_instance.lock().entry(worker).or_default() += 1;
    }

    /// A request was not routed.
    pub fn unrouted(&self, kind: usize) {
        self.unrouted[kind].fetch_add(1, Ordering::Relaxed);
    }

    /// A worker reported `reported` cached prompt tokens where the router predicted
    /// `predicted`.
    pub fn cache_report(&self, predicted: u64, reported: u64) {
        self.cache_reports.fetch_add(1, Ordering::Relaxed);
        self.predicted_cached_tokens
            .fetch_add(predicted, Ordering::Relaxed);
        self.reported_cached_tokens
            .fetch_add(reported, Ordering::Relaxed);
    }

    /// Requests routed to each worker so far.
    pub fn by_instance(&self) -> Vec<(InstanceId, u64)> {
        self.by_instance
            .lock()
            .iter()
            .map(|(id, n)| (*id, *n))
            .collect()
    }

    /// Forgets a worker that left.
    pub fn forget(&self, worker: InstanceId) {
        self.by_instance.lock().remove(&worker);
    }

    /// Block-weighted achieved over best overlap (1 when no candidate held anything).
    pub fn overlap_ratio(&self) -> Option<f64> {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        super::shadow::ratio(
            l(&self.chosen_overlap_blocks),
            l(&self.best_overlap_blocks),
            l(&self.routed),
        )
    }
}
