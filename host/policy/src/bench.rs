//! `switchyard policy bench`: what one `choose` call costs a policy, at several candidate
//! counts, measured the way the router calls it (warm instance, time budget armed).

use std::time::{Duration, Instant};

use super::loaded::LoadedPolicy;
use super::types::{CandidateRow, Candidates, Request};
use switchyard_ids::InstanceId;

/// Per-call wall times of one policy at one candidate count.
#[derive(Debug, Clone, Copy)]
pub struct CallCost {
    /// Candidates per call.
    pub candidates: usize,
    /// Calls timed.
    pub calls: usize,
    /// Median.
    pub p50: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// Mean.
    pub mean: Duration,
    /// Calls that failed (trap, timeout, bad answer): each is decided by the fallback.
    pub failures: usize,
}

/// Calls `policy` `calls` times (after a tenth as many untimed) on random requests and
/// `candidates` random workers (a new set every 64 calls), and reports the times.
pub fn call_cost(policy: &LoadedPolicy, candidates: usize, calls: usize) -> CallCost {
    let calls = calls.max(1);
    let mut rng = 0x5eed_u64;
    let mut next = move || {
        rng = rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        switchyard_cost_model::mix(rng)
    };
    let sets: Vec<(Request, Candidates)> = (0..(calls / 64).clamp(1, 64))
        .map(|_| {
            let blocks = 1 + (next() % 512) as u32;
            let req = Request {
                prompt_tokens: blocks * 16,
                prompt_blocks: blocks,
                block_size: 16,
                session_key: Some(next()),
                seed: next() | 1,
                sequence: 1,
                decode_alone: false,
                max_tokens: Some(256),
                ttft_objective_ms: None,
                tpot_objective_ms: None,
            };
            let mut rows: Vec<CandidateRow> = (0..candidates)
                .map(|_| CandidateRow {
                    id: InstanceId(next()),
                    overlap_blocks: (next() % u64::from(blocks + 1)) as u32,
                    active_blocks: (next() % 4096) as u32,
                    pending_prefill_tokens: (next() % 8192) as u32,
                    in_flight: (next() % 16) as u32,
                    kv_usage: Some((next() % 1000) as f32 / 1000.0),
                    cache_fullness: Some((next() % 1000) as f32 / 1000.0),
                    role: switchyard_ids::Role::Both,
                    predicted_ttft_ms: Some((next() % 10_000) as f32 / 10.0),
                    predicted_tpot_ms: Some((next() % 500) as f32 / 10.0),
                })
                .collect();
            rows.sort_by_key(|r| r.id);
            (req, rows.into_iter().collect())
        })
        .collect();
    for i in 0..calls / 10 {
        let (req, c) = &sets[i % sets.len()];
        let _ = policy.call(req, c);
    }
    let mut times = Vec::with_capacity(calls);
    let mut failures = 0;
    for i in 0..calls {
        let (req, c) = &sets[(i / 64) % sets.len()];
        let started = Instant::now();
        let result = policy.call(req, c);
        times.push(started.elapsed());
        failures += usize::from(result.is_err());
    }
    times.sort_unstable();
    let at = |q: f64| times[((times.len() as f64 * q) as usize).min(times.len() - 1)];
    CallCost {
        candidates,
        calls,
        p50: at(0.50),
        p99: at(0.99),
        mean: times.iter().sum::<Duration>() / calls.max(1) as u32,
        failures,
    }
}
