//! The canary a policy must pass before it serves: one fixed candidate set whose worker
//! IDs are above 2^53 (like real lease IDs), and eight random ones seeded by the
//! policy's sha256, so that they differ between policies but not between loads of one.

use super::types::{CandidateRow, Candidates, Request};
use switchyard_ids::InstanceId;

/// Random candidate sets a policy must handle at load time, besides the fixed one.
pub(super) const RANDOM_CANARIES: usize = 8;

/// SplitMix64, for the random canaries.
pub(super) struct CanaryRng(u64);

impl CanaryRng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        switchyard_cost_model::mix(self.0)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The random canary sets of one load: a fresh seed each time (std's `RandomState` keys
/// are random per process and differ for every instance), so a policy cannot learn them.
pub(super) fn random_canaries(sha256: &str) -> Vec<(Request, Candidates)> {
    use std::hash::BuildHasher;
    let mut rng = CanaryRng(std::collections::hash_map::RandomState::new().hash_one(sha256));
    (0..RANDOM_CANARIES)
        .map(|set| {
            let size = match set {
                0 => 1,
                1 => 64,
                _ => 2 + rng.below(63) as usize,
            };
            random_canary(&mut rng, size)
        })
        .collect()
}

/// A random request and `size` random candidates, one of them idle (so that a policy
/// that rejects only when every worker is busy has no reason to reject).
pub(super) fn random_canary(rng: &mut CanaryRng, size: usize) -> (Request, Candidates) {
    let prompt_blocks = 1 + rng.below(2048) as u32;
    let req = Request {
        prompt_tokens: prompt_blocks * 16 + rng.below(16) as u32,
        prompt_blocks,
        block_size: 16,
        session_key: (rng.below(2) == 0).then(|| rng.next()),
        seed: rng.next() | 1,
        sequence: 0,
        decode_alone: false,
        max_tokens: (rng.below(2) == 0).then(|| 1 + rng.below(4096) as u32),
        ttft_objective_ms: (rng.below(4) == 0).then(|| 1 + rng.below(10_000) as u32),
        tpot_objective_ms: (rng.below(4) == 0).then(|| 1 + rng.below(500) as u32),
    };
    let idle = rng.below(size as u64) as usize;
    // Predictions known on every candidate or on none, as a router's models give them.
    let predicted = rng.below(2) == 0;
    let candidates = (0..size)
        .map(|i| {
            let busy = i != idle;
            CandidateRow {
                id: InstanceId(rng.next()),
                overlap_blocks: rng.below(u64::from(prompt_blocks) + 1) as u32,
                active_blocks: if busy { rng.below(4096) as u32 } else { 0 },
                pending_prefill_tokens: if busy { rng.below(65_536) as u32 } else { 0 },
                in_flight: if busy { rng.below(16) as u32 } else { 0 },
                kv_usage: (rng.below(4) != 0).then(|| rng.below(1001) as f32 / 1000.0),
                cache_fullness: (rng.below(4) != 0).then(|| rng.below(1001) as f32 / 1000.0),
                role: switchyard_ids::Role::Both,
                predicted_ttft_ms: predicted.then(|| rng.below(60_000) as f32 / 10.0),
                predicted_tpot_ms: predicted.then(|| rng.below(2_000) as f32 / 10.0),
            }
        })
        .collect();
    (req, candidates)
}

pub(super) fn canary_request() -> Request {
    Request {
        prompt_tokens: 1000,
        prompt_blocks: 62,
        block_size: 16,
        session_key: Some(0x5eed),
        seed: 0x00c0_ffee,
        sequence: 0,
        decode_alone: false,
        max_tokens: Some(256),
        ttft_objective_ms: None,
        tpot_objective_ms: None,
    }
}

/// Four synthetic workers with varied overlap and load. Their IDs are above 2^53, as
/// etcd lease IDs often are, so a policy that passes IDs through a double (a JavaScript
/// `Number`) answers a rounded ID that is not a candidate, and is refused.
pub(crate) fn canary_candidates() -> Candidates {
    [
        (0x0769_ba5e_0000_00a1, 0, 40, 0, 2),
        (0x0769_ba5e_0000_00b2, 30, 10, 512, 1),
        (0x0769_ba5e_0000_00c3, 62, 120, 0, 6),
        (0x0769_ba5e_0000_00d4, 5, 0, 0, 0),
    ]
    .into_iter()
    .map(|(id, overlap, active, pending, in_flight)| CandidateRow {
        id: InstanceId(id),
        overlap_blocks: overlap,
        active_blocks: active,
        pending_prefill_tokens: pending,
        in_flight,
        kv_usage: Some(0.5),
        cache_fullness: Some(0.9),
        role: switchyard_ids::Role::Both,
        predicted_ttft_ms: Some(40.0 + 0.5 * pending as f32),
        predicted_tpot_ms: Some(10.0 + in_flight as f32),
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The random canaries of two loads of the same policy differ (IDs, sizes, loads), so
    /// a policy cannot behave on a set it has seen and misbehave on real traffic; each
    /// set has an idle worker, and sizes 1 and 64 are always among them.
    #[test]
    fn the_canary_sets_differ_between_loads() {
        let sha = "0".repeat(64);
        let (a, b) = (random_canaries(&sha), random_canaries(&sha));
        assert_eq!(a.len(), RANDOM_CANARIES);
        let ids = |sets: &[(Request, Candidates)]| -> Vec<u64> {
            sets.iter()
                .flat_map(|(_, c)| c.cols.worker_ids.clone())
                .collect()
        };
        assert!(
            ids(&a).iter().all(|id| !ids(&b).contains(id)),
            "two loads shared a canary worker ID"
        );
        assert_ne!(
            a.iter().map(|(r, _)| r.seed).collect::<Vec<_>>(),
            b.iter().map(|(r, _)| r.seed).collect::<Vec<_>>()
        );
        for sets in [&a, &b] {
            assert_eq!(sets[0].1.len(), 1);
            assert_eq!(sets[1].1.len(), 64);
            for (_, c) in sets.iter() {
                assert!(
                    (0..c.len()).any(|i| c.cols.in_flight[i] == 0 && c.cols.active_blocks[i] == 0),
                    "a canary set without an idle worker"
                );
            }
        }
    }
}
