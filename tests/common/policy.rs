//! Policy runtime scaffolding: engines, candidates, requests and handles for the tests
//! that call policies directly.

use std::time::Duration;

use super::{guest, runtime};
use switchyard::ids::InstanceId;
use switchyard::policy::{
    CallFailure, CandidateRow, Candidates, Decider, DecisionOutcome, PolicyEngine, PolicyHandle,
    Request, RuntimeConfig, native,
};

pub fn engine() -> PolicyEngine {
    PolicyEngine::new(runtime()).unwrap()
}

pub fn row(id: u64, overlap: u32, active: u32, in_flight: u32) -> CandidateRow {
    CandidateRow {
        id: InstanceId(id),
        overlap_blocks: overlap,
        active_blocks: active,
        pending_prefill_tokens: 0,
        in_flight,
        kv_usage: None,
        cache_fullness: None,
        role: switchyard::ids::Role::Both,
        predicted_ttft_ms: None,
        predicted_tpot_ms: None,
    }
}

pub fn request(blocks: u32, seed: u64) -> Request {
    Request {
        prompt_tokens: blocks * 16,
        prompt_blocks: blocks,
        block_size: 16,
        seed,
        ..Default::default()
    }
}

pub fn handle(engine: &PolicyEngine, spec: &str, config: &str) -> PolicyHandle {
    PolicyHandle::new(engine.clone(), engine.load_spec(spec, config).unwrap()).unwrap()
}

/// Waits (bounded) until the current policy has `n` idle instances: the warmer replaces
/// trapped and recycled ones in the background, and decisions never wait for it.
pub fn settle(h: &PolicyHandle, n: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while h.current().idle_instances() < n {
        assert!(
            std::time::Instant::now() < deadline,
            "the warmer did not make {n} instances"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub fn chosen(outcome: &DecisionOutcome) -> InstanceId {
    match outcome {
        DecisionOutcome::Chosen(id) => *id,
        other => panic!("expected a chosen worker, got {other:?}"),
    }
}

/// A handle running a hostile guest that behaves on its canary (sequence 0) and
/// misbehaves from the next decision on.
pub fn hostile(engine: &PolicyEngine, name: &str) -> PolicyHandle {
    let loaded = engine.load_file(&guest(name), r#"{"after": 1}"#).unwrap();
    let h = PolicyHandle::new(engine.clone(), loaded).unwrap();
    settle(&h, engine.config().warm_instances);
    // Sequence 0 is the canary's; the handle's first decision is well-behaved.
    let first = h.decide(request(4, 1), &four());
    assert_eq!(first.decider, Decider::Policy);
    h
}

pub fn four() -> Candidates {
    [
        row(1, 0, 9, 0),
        row(2, 4, 0, 0),
        row(3, 0, 5, 0),
        row(4, 0, 7, 0),
    ]
    .into_iter()
    .collect()
}

pub fn no_rollback(memory_cap: usize, budget_ms: u64) -> PolicyEngine {
    PolicyEngine::new(RuntimeConfig {
        rollback_after_failures: u32::MAX,
        rollback_failure_rate: 0.0,
        memory_cap,
        call_budget: Duration::from_millis(budget_ms),
        ..runtime()
    })
    .unwrap()
}

/// Decides three times through a misbehaving policy: every decision is made by the
/// fallback (the same answer native kv-cost gives), each failure is counted, and the
/// policy's failure is the expected kind.
pub fn assert_contained(h: &PolicyHandle, expect: impl Fn(&CallFailure) -> bool) {
    let native_choice =
        native::choose(&native::Config::default(), &request(4, 1), &four()).unwrap();
    for i in 1..=3u64 {
        let d = h.decide(request(4, 1), &four());
        assert_eq!(d.decider, Decider::Fallback);
        let failure = d.failure.clone().expect("a failure is reported");
        assert!(expect(&failure), "unexpected failure: {failure}");
        assert_eq!(chosen(&d.outcome), native_choice);
        let status = h.status();
        assert_eq!(status.failures, i);
        assert_eq!(status.fallbacks, i);
    }
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `bytes` with a custom section appended: the same policy, another sha256 (a compile
/// of its own).
pub fn variant(bytes: &[u8], n: u8) -> Vec<u8> {
    let name = b"variant";
    let body_len = 1 + name.len() + 1;
    let mut out = bytes.to_vec();
    out.extend_from_slice(&[0, body_len as u8, name.len() as u8]);
    out.extend_from_slice(name);
    out.push(n);
    out
}
