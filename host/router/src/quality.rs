//! How good the live policy's decisions are: the overlap it achieved against the best
//! available, what it predicted cached against what the workers then reported, where
//! it sent requests and why it could not route others. Counted per endpoint for its
//! whole life (a swap does not reset anything).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use switchyard_ids::InstanceId;
use switchyard_policy::RejectionKind;

/// The kinds of requests not routed, in [`DecisionQuality::unrouted`] order.
pub const UNROUTED: [&str; 6] = [
    "no_instances",
    "busy",
    "all_busy",
    "no_fit",
    "refused",
    "objectives",
];

/// The index in [`UNROUTED`] of a request no worker was predicted to meet the
/// objectives of.
pub const UNROUTED_OBJECTIVES: usize = 5;

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
    /// Of the routed requests, continuations of streams that broke on another worker.
    pub continuations: AtomicU64,
    by_instance: Mutex<BTreeMap<InstanceId, u64>>,
    /// Decision times: bucket 0 under 1 µs, bucket `i` under 2^i µs, the last one the rest.
    latency: [AtomicU64; LATENCY_BUCKETS],
}

/// Buckets of [`DecisionQuality`]'s decision-time histogram (the last is unbounded).
pub const LATENCY_BUCKETS: usize = 24;

/// The upper bound of latency bucket `i`, µs (infinite for the last).
pub fn latency_bound_us(i: usize) -> f64 {
    if i + 1 >= LATENCY_BUCKETS {
        f64::INFINITY
    } else {
        (1u64 << i) as f64
    }
}

/// The `q` quantile, µs, of the decisions counted between two readings of the latency
/// buckets (`None` when there were none); interpolated within its bucket.
pub fn latency_quantile(
    q: f64,
    now: &[u64; LATENCY_BUCKETS],
    then: &[u64; LATENCY_BUCKETS],
) -> Option<f64> {
    let d: Vec<u64> = now
        .iter()
        .zip(then)
        .map(|(a, b)| a.saturating_sub(*b))
        .collect();
    let total: u64 = d.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = q * total as f64;
    let mut seen = 0.0;
    for (i, n) in d.iter().enumerate() {
        let n = *n as f64;
        if seen + n >= rank && n > 0.0 {
            let low = if i == 0 { 0.0 } else { latency_bound_us(i - 1) };
            let high = latency_bound_us(i);
            if !high.is_finite() {
                return Some(low);
            }
            return Some(low + (high - low) * ((rank - seen) / n).clamp(0.0, 1.0));
        }
        seen += n;
    }
    None
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

    /// One decision took `took`.
    pub fn record_latency(&self, took: std::time::Duration) {
        let us = took.as_micros();
        let i = if us == 0 {
            0
        } else {
            ((128 - us.leading_zeros()) as usize).min(LATENCY_BUCKETS - 1)
        };
        self.latency[i].fetch_add(1, Ordering::Relaxed);
    }

    /// The decision-time buckets now.
    pub fn latency_counts(&self) -> [u64; LATENCY_BUCKETS] {
        self.latency.each_ref().map(|c| c.load(Ordering::Relaxed))
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn latency_quantiles_come_from_the_decisions_between_two_readings() {
        let q = DecisionQuality::default();
        for _ in 0..90 {
            q.record_latency(Duration::from_micros(3)); // bucket (2, 4]
        }
        let then = q.latency_counts();
        for _ in 0..99 {
            q.record_latency(Duration::from_micros(20)); // (16, 32]
        }
        q.record_latency(Duration::from_millis(3)); // (2048, 4096]
        let now = q.latency_counts();
        let p50 = latency_quantile(0.5, &now, &then).unwrap();
        assert!((16.0..=32.0).contains(&p50), "{p50}");
        let p999 = latency_quantile(0.999, &now, &then).unwrap();
        assert!((2048.0..=4096.0).contains(&p999), "{p999}");
        assert_eq!(latency_quantile(0.5, &then, &then), None);
        q.record_latency(Duration::from_secs(100_000));
        assert_eq!(q.latency_counts()[LATENCY_BUCKETS - 1], 1);
    }
}
