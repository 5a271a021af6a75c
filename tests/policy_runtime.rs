//! The policy runtime against real `.wasm` components: the built-ins, the example
//! policy, and hostile guests built by the workspace.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{Rng, guest, runtime};
use switchyard::ids::InstanceId;
use switchyard::policy::{
    CacheOutcome, CallFailure, CandidateRow, Candidates, Decider, DecisionOutcome, PolicyEngine,
    PolicyError, PolicyHandle, PolicySource, Request, RuntimeConfig, native,
};

fn engine() -> PolicyEngine {
    PolicyEngine::new(runtime()).unwrap()
}

fn row(id: u64, overlap: u32, active: u32, in_flight: u32) -> CandidateRow {
    CandidateRow {
        id: InstanceId(id),
        overlap_blocks: overlap,
        active_blocks: active,
        pending_prefill_tokens: 0,
        in_flight,
        kv_usage: None,
    }
}

fn request(blocks: u32, seed: u64) -> Request {
    Request {
        prompt_tokens: blocks * 16,
        prompt_blocks: blocks,
        block_size: 16,
        seed,
        ..Default::default()
    }
}

fn handle(engine: &PolicyEngine, spec: &str, config: &str) -> PolicyHandle {
    PolicyHandle::new(engine.clone(), engine.load_spec(spec, config).unwrap()).unwrap()
}

fn chosen(outcome: &DecisionOutcome) -> InstanceId {
    match outcome {
        DecisionOutcome::Chosen(id) => *id,
        other => panic!("expected a chosen worker, got {other:?}"),
    }
}

#[test]
fn kv_cost_sends_a_request_to_the_worker_holding_its_prefix() {
    let engine = engine();
    let h = handle(&engine, "kv-cost", "{}");
    let candidates: Candidates = [row(1, 0, 10, 1), row(2, 30, 10, 1), row(3, 2, 10, 1)]
        .into_iter()
        .collect();
    let d = h.decide(request(32, 1), &candidates);
    assert_eq!(d.decider, Decider::Policy);
    assert_eq!(chosen(&d.outcome), InstanceId(2));

    // A heavily loaded cache holder loses to an idle worker.
    let candidates: Candidates = [row(1, 0, 0, 0), row(2, 4, 500, 9)].into_iter().collect();
    assert_eq!(
        chosen(&h.decide(request(32, 1), &candidates).outcome),
        InstanceId(1)
    );
}

#[test]
fn kv_cost_configuration_is_applied_and_validated() {
    let engine = engine();
    // With overlap_weight 0 the cache is ignored and the lighter worker wins.
    let h = handle(&engine, "kv-cost", r#"{"overlap_weight": 0}"#);
    let candidates: Candidates = [row(1, 32, 6, 2), row(2, 0, 5, 1)].into_iter().collect();
    assert_eq!(
        chosen(&h.decide(request(32, 1), &candidates).outcome),
        InstanceId(2)
    );
    // The default chases the cache over one extra request in flight.
    let h = handle(&engine, "kv-cost", "{}");
    assert_eq!(
        chosen(&h.decide(request(32, 1), &candidates).outcome),
        InstanceId(1)
    );
    // The old memory-priced model is one configuration away: 500 blocks held lose.
    let h = handle(
        &engine,
        "kv-cost",
        r#"{"active_weight": 1, "in_flight_weight": 0, "stall_weight": 0, "eviction_weight": 0}"#,
    );
    let candidates: Candidates = [row(1, 4, 500, 1), row(2, 0, 0, 1)].into_iter().collect();
    assert_eq!(
        chosen(&h.decide(request(32, 1), &candidates).outcome),
        InstanceId(2)
    );

    let err = engine
        .load_spec("kv-cost", r#"{"overlap_wieght": 2}"#)
        .err()
        .unwrap();
    assert!(matches!(err, PolicyError::BadConfig(_)), "{err}");
    assert!(err.to_string().contains("unknown field"), "{err}");
}

#[test]
fn round_robin_spreads_evenly_across_threads() {
    let engine = engine();
    let h = Arc::new(handle(&engine, "round-robin", ""));
    let candidates: Candidates = (1..=4).map(|i| row(i, 0, 0, 0)).collect();
    let per_thread = 200;
    let counts: Vec<HashMap<InstanceId, u32>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    let mut seen = HashMap::new();
                    for _ in 0..per_thread {
                        let d = h.decide(request(4, 0), &candidates);
                        assert_eq!(d.decider, Decider::Policy, "{:?}", d.failure);
                        *seen.entry(chosen(&d.outcome)).or_insert(0) += 1;
                    }
                    seen
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    let mut total: HashMap<InstanceId, u32> = HashMap::new();
    for c in counts {
        for (id, n) in c {
            *total.entry(id).or_insert(0) += n;
        }
    }
    // 800 decisions over 4 workers, by sequence number: exactly 200 each.
    for id in 1..=4 {
        assert_eq!(total[&InstanceId(id)], 200, "uneven spread: {total:?}");
    }
}

#[test]
fn random_picks_every_worker_about_equally() {
    let engine = engine();
    let h = handle(&engine, "random", "");
    let candidates: Candidates = (1..=4).map(|i| row(i, 0, 0, 0)).collect();
    let mut seen: HashMap<InstanceId, u32> = HashMap::new();
    for _ in 0..2000 {
        let d = h.decide(request(4, 0), &candidates);
        assert_eq!(d.decider, Decider::Policy);
        *seen.entry(chosen(&d.outcome)).or_insert(0) += 1;
    }
    for id in 1..=4 {
        let n = seen[&InstanceId(id)];
        assert!((400..600).contains(&n), "uneven: {seen:?}");
    }
}

#[test]
fn session_affinity_example_keeps_sessions_and_spills_over_when_full() {
    let engine = engine();
    let loaded = engine
        .load_file(&guest("session_affinity"), r#"{"max_in_flight": 3}"#)
        .unwrap();
    assert_eq!(loaded.info().name, "session-affinity");
    let h = PolicyHandle::new(engine.clone(), loaded).unwrap();
    let candidates: Candidates = (1..=5).map(|i| row(i, 0, 0, 0)).collect();
    let with_session = |key| Request {
        session_key: Some(key),
        ..request(8, 9)
    };

    // Every session sticks to one worker, and sessions spread over several workers.
    let mut homes = HashMap::new();
    for key in 0..50u64 {
        let first = chosen(&h.decide(with_session(key), &candidates).outcome);
        for _ in 0..3 {
            assert_eq!(
                chosen(&h.decide(with_session(key), &candidates).outcome),
                first
            );
        }
        homes.insert(key, first);
    }
    let distinct: std::collections::HashSet<_> = homes.values().collect();
    assert!(distinct.len() >= 4, "sessions all landed on {distinct:?}");

    // When the home worker is at the cap, the request spills to the least loaded one.
    let home = homes[&7];
    let loaded_candidates: Candidates = (1..=5)
        .map(|i| {
            if InstanceId(i) == home {
                row(i, 0, 0, 3)
            } else {
                row(i, 0, 0, 1 + (i as u32 % 2))
            }
        })
        .collect();
    let spilled = chosen(&h.decide(with_session(7), &loaded_candidates).outcome);
    assert_ne!(spilled, home);
    assert_eq!(
        loaded_candidates
            .row(loaded_candidates.ids().position(|x| x == spilled).unwrap())
            .in_flight,
        1
    );

    // A bad config is refused with the policy's own message.
    let err = engine
        .load_file(&guest("session_affinity"), r#"{"max_in_flight": 0}"#)
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("max_in_flight must be at least 1"),
        "{err}"
    );
}

#[test]
fn wasm_and_native_kv_cost_agree_on_random_candidate_sets() {
    let engine = engine();
    let configs = [
        r#"{}"#,
        r#"{"overlap_weight": 0}"#,
        r#"{"overlap_weight": 2.5}"#,
        r#"{"overlap_weight": 1, "temperature": 0.7}"#,
    ];
    let mut rng = Rng(42);
    for config in configs {
        let policy = engine.load_spec("kv-cost", config).unwrap();
        let native_config = native::Config::from_json(config).unwrap();
        for case in 0..1000 {
            let n = 1 + rng.below(64) as usize;
            let blocks = rng.below(80) as u32;
            // Small value ranges so that ties are common.
            let candidates: Candidates = (0..n)
                .map(|i| CandidateRow {
                    id: InstanceId(1000 + i as u64),
                    overlap_blocks: rng.below(blocks as u64 + 5) as u32,
                    active_blocks: rng.below(40) as u32,
                    pending_prefill_tokens: rng.below(4) as u32 * 16,
                    in_flight: rng.below(5) as u32,
                    kv_usage: None,
                })
                .collect();
            let req = Request {
                sequence: case,
                ..request(blocks, rng.next())
            };
            let wasm = match policy.call(&req, &candidates).unwrap() {
                switchyard::policy::CallOutcome::Chosen(id) => id,
                other => panic!("kv-cost rejected: {other:?}"),
            };
            let native = native::choose(&native_config, &req, &candidates).unwrap();
            assert_eq!(wasm, native, "config {config}, case {case}, {n} candidates");
        }
    }
}

/// A handle running a hostile guest that behaves on its canary (sequence 0) and
/// misbehaves from the next decision on.
fn hostile(engine: &PolicyEngine, name: &str) -> PolicyHandle {
    let loaded = engine.load_file(&guest(name), r#"{"after": 1}"#).unwrap();
    let h = PolicyHandle::new(engine.clone(), loaded).unwrap();
    // Sequence 0 is the canary's; the handle's first decision is well-behaved.
    let first = h.decide(request(4, 1), &four());
    assert_eq!(first.decider, Decider::Policy);
    h
}

fn four() -> Candidates {
    [
        row(1, 0, 9, 0),
        row(2, 4, 0, 0),
        row(3, 0, 5, 0),
        row(4, 0, 7, 0),
    ]
    .into_iter()
    .collect()
}

fn no_rollback(memory_cap: usize, budget_ms: u64) -> PolicyEngine {
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
fn assert_contained(h: &PolicyHandle, expect: impl Fn(&CallFailure) -> bool) {
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

#[test]
fn an_infinite_loop_is_interrupted_at_its_budget() {
    let h = hostile(&no_rollback(64 << 20, 20), "spin_forever");
    assert_contained(&h, |f| matches!(f, CallFailure::Timeout(_)));
}

#[test]
fn a_memory_bomb_hits_the_memory_cap() {
    let h = hostile(&no_rollback(8 << 20, 2000), "memory_bomb");
    assert_contained(
        &h,
        |f| matches!(f, CallFailure::OutOfMemory(cap) if *cap == 8 << 20),
    );
}

#[test]
fn a_panicking_policy_traps_and_is_replaced_by_a_fresh_instance() {
    let h = hostile(&no_rollback(64 << 20, 1000), "panics");
    let before = h.current().instances_created();
    assert_contained(
        &h,
        |f| matches!(f, CallFailure::Trap(msg) if msg.contains("unreachable")),
    );
    // Each trapped instance was discarded and a fresh one made for the next call.
    assert!(h.current().instances_created() >= before + 2);
}

/// Waiting on a clock is blocking, which a policy may not do: stopped at once, wherever it
/// runs (no host timer is armed, so no runtime is needed).
#[test]
fn a_sleeping_policy_is_stopped_as_blocking() {
    let h = hostile(&no_rollback(64 << 20, 1000), "sleeps");
    assert_contained(
        &h,
        |f| matches!(f, CallFailure::Trap(why) if why.contains("would block")),
    );
}

#[test]
fn an_answer_outside_the_candidates_is_refused() {
    let h = hostile(&no_rollback(64 << 20, 1000), "wrong_id");
    assert_contained(&h, |f| {
        matches!(f, CallFailure::NotACandidate(InstanceId(5)))
    });
}

/// Whatever text a policy hands the host is bounded and cannot forge lines: a 4 MB
/// rejection reason full of newlines, a name that would close a metrics label and start
/// a line of its own, a 10,000-character version, a configuration error as long.
#[test]
fn text_from_a_policy_is_bounded_and_cannot_forge_lines() {
    let engine = no_rollback(64 << 20, 1000);
    let h = hostile(&engine, "loud");
    let d = h.decide(request(4, 2), &four());
    let switchyard::policy::DecisionOutcome::Rejected(r) = &d.outcome else {
        panic!("{d:?}")
    };
    assert!(r.reason.len() <= 520, "{} bytes", r.reason.len());
    assert!(
        r.reason.starts_with("too loud too loud"),
        "{}",
        &r.reason[..40]
    );
    assert!(!r.reason.contains('\n'));
    let info = h.status().info;
    assert!(
        !info.name.contains(['"', '\n', '}', '{', ' ']),
        "{:?}",
        info.name
    );
    assert!(info.name.starts_with("loud"), "{:?}", info.name);
    assert_eq!(info.version.len(), 64);
    let long = format!("{{\"x\": \"{}\"}}", "y\n".repeat(100_000));
    let Err(err) = engine.load_file(&guest("bad_config"), &long) else {
        panic!("bad-config loaded")
    };
    let err = err.to_string();
    assert!(
        err.len() < 1_000 && !err.contains('\n'),
        "{} bytes",
        err.len()
    );
}

/// The canary is a fixed set and eight random ones (1 to 64 workers, random IDs and
/// loads, one idle worker each): a policy that rejects them all is refused unless the
/// operator says such a policy is wanted.
#[test]
fn a_policy_rejecting_every_canary_request_is_refused_unless_allowed() {
    let engine = no_rollback(64 << 20, 1000);
    let always = engine.load_file(&guest("loud"), r#"{"after": 0}"#).unwrap();
    let err = always.canary().unwrap_err().to_string();
    assert!(err.contains("rejected all 9 canary requests"), "{err}");
    let lenient = PolicyEngine::new(RuntimeConfig {
        allow_reject_all: true,
        ..runtime()
    })
    .unwrap();
    let always = lenient
        .load_file(&guest("loud"), r#"{"after": 0}"#)
        .unwrap();
    assert!(always.canary().is_ok());
    // Every built-in and the example pass the random sets.
    for spec in ["kv-cost", "round-robin", "random"] {
        engine.load_spec(spec, "{}").unwrap().canary().unwrap();
    }
    engine
        .load_file(
            &guest("session_affinity"),
            r#"{"max_in_flight": 1, "reject_when_full": true}"#,
        )
        .unwrap()
        .canary()
        .unwrap();
}

#[test]
fn a_huge_candidate_list_cannot_blow_the_memory_cap_while_lowering() {
    let engine = no_rollback(2 << 20, 1000);
    let h = handle(&engine, "kv-cost", "{}");
    // 200k candidates are ~4.8 MB of lists: more than the 2 MiB cap allows the guest
    // to allocate for them.
    let huge: Candidates = (0..200_000)
        .map(|i| row(i + 1, 0, (i % 7) as u32, 0))
        .collect();
    let d = h.decide(request(4, 3), &huge);
    assert_eq!(d.decider, Decider::Fallback);
    assert!(
        matches!(
            d.failure,
            Some(CallFailure::OutOfMemory(_)) | Some(CallFailure::Trap(_))
        ),
        "{:?}",
        d.failure
    );
    assert_eq!(
        chosen(&d.outcome),
        native::choose(&Default::default(), &request(4, 3), &huge).unwrap()
    );
    // A normal decision right after is made by the policy again.
    let d = h.decide(request(4, 1), &four());
    assert_eq!(d.decider, Decider::Policy);
}

#[test]
fn guest_output_reaches_the_log_rate_limited_and_decisions_still_work() {
    let h = hostile(&no_rollback(64 << 20, 2000), "stdout_spam");
    for _ in 0..5 {
        let d = h.decide(request(4, 1), &four());
        assert_eq!(d.decider, Decider::Policy, "{:?}", d.failure);
        assert_eq!(chosen(&d.outcome), InstanceId(1));
    }
    let (logged, suppressed) = h.status().guest_log_lines;
    // 5 decisions x 400 lines; the limit is 20 lines per second (burst 20).
    assert!((1..=60).contains(&logged), "logged {logged}");
    assert!(
        logged + suppressed >= 2000,
        "lines lost: {logged} + {suppressed}"
    );
}

#[test]
fn the_sandbox_grants_no_files_environment_network_or_clock() {
    let h = Arc::new(hostile(&no_rollback(64 << 20, 1000), "reads_host"));
    let d = h.decide(request(4, 1), &four());
    match d.outcome {
        DecisionOutcome::Chosen(id) => assert_eq!(id, InstanceId(1)),
        DecisionOutcome::Rejected(r) => panic!("{}", r.reason),
        other => panic!("{other:?}"),
    }
    assert_eq!(d.decider, Decider::Policy);
    // The same on a Tokio worker thread, where the router decides: every denial is an
    // error the guest sees, never a host panic (wasmtime-wasi's blocking helpers would
    // start a nested runtime there).
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build()
        .unwrap();
    let task = rt.spawn(async move { h.decide(request(4, 1), &four()) });
    let d = rt.block_on(task).unwrap();
    assert_eq!(d.decider, Decider::Policy, "{d:?}");
    assert!(matches!(d.outcome, DecisionOutcome::Chosen(_)), "{d:?}");
}

#[test]
fn a_run_of_failures_rolls_back_to_the_last_good_policy() {
    let engine = PolicyEngine::new(RuntimeConfig {
        rollback_after_failures: 3,
        ..runtime()
    })
    .unwrap();
    let h = handle(&engine, "kv-cost", "{}");
    let bad = engine
        .load_file(&guest("panics"), r#"{"after": 1}"#)
        .unwrap();
    let status = h.swap(bad).unwrap();
    assert_eq!(status.info.name, "panics");
    assert_eq!(status.previous.as_ref().unwrap().name, "kv-cost");
    // Decision with sequence 0 was... the handle's sequence is 0 here: well-behaved.
    assert_eq!(h.decide(request(4, 1), &four()).decider, Decider::Policy);
    for _ in 0..3 {
        assert_eq!(h.decide(request(4, 1), &four()).decider, Decider::Fallback);
    }
    let status = h.status();
    assert_eq!(status.info.name, "kv-cost", "rolled back");
    assert_eq!(status.rollbacks, 1);
    assert_eq!(h.decide(request(4, 1), &four()).decider, Decider::Policy);
    // The current policy's own counters start again; the handle's totals never go down.
    assert_eq!(h.status().decisions, 1);
    let totals = h.totals();
    assert_eq!((totals.decisions, totals.failures), (5, 3));
    assert_eq!(
        (totals.automatic_rollbacks, totals.manual_rollbacks),
        (1, 0)
    );
    let good = engine.load_spec("round-robin", "{}").unwrap();
    h.swap(good).unwrap();
    h.rollback().unwrap();
    let after = h.totals();
    assert!(after.decisions >= totals.decisions, "{after:?}");
    assert_eq!((after.automatic_rollbacks, after.manual_rollbacks), (1, 1));
}

/// A policy failing one call in three never fails five in a row, but the failure rate
/// rolls it back within one window of calls; one that fails less than the threshold stays.
#[test]
fn a_policy_failing_a_third_of_its_calls_is_rolled_back_by_rate() {
    let engine = PolicyEngine::new(RuntimeConfig {
        rollback_after_failures: 5,
        rollback_failure_rate: 0.2,
        rollback_window: 60,
        ..runtime()
    })
    .unwrap();
    let h = handle(&engine, "kv-cost", "{}");
    h.swap(
        engine
            .load_file(&guest("flaky"), r#"{"every": 3}"#)
            .unwrap(),
    )
    .unwrap();
    // Seeds 1, 2, 3, ...: every third call panics.
    for seed in 1..60 {
        h.decide(request(4, seed), &four());
        assert_eq!(
            h.status().info.name,
            "flaky",
            "rolled back early, at {seed}"
        );
    }
    h.decide(request(4, 60), &four());
    let status = h.status();
    assert_eq!(
        status.info.name, "kv-cost",
        "rolled back at the end of the window"
    );
    assert_eq!(h.totals().automatic_rollbacks, 1);
    // One failure in ten stays under a 20 % threshold.
    h.swap(
        engine
            .load_file(&guest("flaky"), r#"{"every": 10}"#)
            .unwrap(),
    )
    .unwrap();
    for seed in 1..=180 {
        h.decide(request(4, seed), &four());
    }
    assert_eq!(h.status().info.name, "flaky");
}

#[test]
fn broken_replacements_are_refused_and_the_current_policy_keeps_serving() {
    let engine = engine();
    let h = handle(&engine, "kv-cost", "{}");
    let before = h.status();

    // A file over the size limit (sparse: nothing is written) is refused unread.
    let dir = tempfile::tempdir().unwrap();
    let huge = dir.path().join("huge.wasm");
    std::fs::File::create(&huge)
        .unwrap()
        .set_len(switchyard::policy::MAX_POLICY_BYTES as u64 + 4096)
        .unwrap();
    let refusals: Vec<(PolicyError, &str)> = vec![
        (
            engine.load_file(&huge, "{}").err().unwrap(),
            "over the limit",
        ),
        (
            engine.load_file(&guest("wrong_world"), "{}").err().unwrap(),
            "does not implement",
        ),
        (
            engine.load_file(&guest("bad_config"), "{}").err().unwrap(),
            "bad-config refuses",
        ),
        (
            h.swap(engine.load_file(&guest("spin_forever"), "{}").unwrap())
                .err()
                .unwrap(),
            "time budget",
        ),
        (
            h.swap(engine.load_file(&guest("panics"), "{}").unwrap())
                .err()
                .unwrap(),
            "trapped",
        ),
        (
            engine
                .load(
                    PolicySource::Uploaded("test".into()),
                    b"not wasm at all",
                    "{}",
                )
                .err()
                .unwrap(),
            "magic bytes",
        ),
        (
            engine
                .load(
                    PolicySource::Uploaded("test".into()),
                    b"\0asm\x01\0\0\0",
                    "{}",
                )
                .err()
                .unwrap(),
            "core WebAssembly module",
        ),
        (
            engine
                .load(
                    PolicySource::Uploaded("test".into()),
                    b"\0asm\x0d\0\x01\0garbage",
                    "{}",
                )
                .err()
                .unwrap(),
            "not a WebAssembly component",
        ),
    ];
    for (err, needle) in refusals {
        assert!(
            err.to_string().contains(needle),
            "`{err}` should mention `{needle}`"
        );
    }
    let after = h.status();
    assert_eq!(after.info.sha256, before.info.sha256);
    assert_eq!(after.generation, before.generation);
    assert_eq!(h.decide(request(4, 1), &four()).decider, Decider::Policy);
}

#[test]
fn hot_swaps_under_concurrent_decisions_never_fail_or_mix_policies() {
    let engine = engine();
    let h = Arc::new(handle(&engine, "kv-cost", "{}"));
    let kv = engine.load_spec("kv-cost", "{}").unwrap();
    let rr = engine.load_spec("round-robin", "").unwrap();
    let candidates: Candidates = (1..=6)
        .map(|i| row(i, (i as u32 * 3) % 7, (i as u32 * 5) % 11, 0))
        .collect();

    let stop = AtomicBool::new(false);
    let mut names: HashMap<u64, String> = HashMap::from([(1, "kv-cost".to_string())]);
    let decisions = std::thread::scope(|s| {
        let deciders: Vec<_> = (0..3u64)
            .map(|t| {
                let (h, candidates, stop) = (&h, &candidates, &stop);
                s.spawn(move || {
                    let mut out = Vec::new();
                    let mut rng = Rng(t);
                    // Bounded: at most 20k decisions per thread.
                    while !stop.load(Ordering::Relaxed) && out.len() < 20_000 {
                        let req = request(8, rng.next() | 1);
                        out.push((req, h.decide(req, candidates)));
                    }
                    out
                })
            })
            .collect();
        for i in 0..100 {
            let next = if i % 2 == 0 { rr.clone() } else { kv.clone() };
            let status = h.swap(next).unwrap();
            names.insert(status.generation, status.info.name.clone());
            std::thread::sleep(Duration::from_millis(1));
        }
        stop.store(true, Ordering::Relaxed);
        deciders
            .into_iter()
            .flat_map(|d| d.join().unwrap())
            .collect::<Vec<_>>()
    });

    let mut by_policy: HashMap<&str, usize> = HashMap::new();
    for (req, d) in &decisions {
        assert_eq!(
            d.decider,
            Decider::Policy,
            "a decision failed: {:?}",
            d.failure
        );
        let name = names[&d.generation].as_str();
        let expected = match name {
            "round-robin" => InstanceId(1 + d.sequence % 6),
            _ => native::choose(&Default::default(), req, &candidates).unwrap(),
        };
        assert_eq!(
            chosen(&d.outcome),
            expected,
            "generation {} ({name})",
            d.generation
        );
        *by_policy.entry(name).or_insert(0) += 1;
    }
    assert!(by_policy.len() == 2, "both policies decided: {by_policy:?}");
}

#[test]
fn compiled_policies_are_cached_on_disk_and_a_corrupt_entry_is_recompiled() {
    let dir = tempfile::tempdir().unwrap();
    let config = || RuntimeConfig {
        cache_dir: Some(dir.path().to_path_buf()),
        ..Default::default()
    };
    let load = || {
        PolicyEngine::new(config())
            .unwrap()
            .load_spec("round-robin", "")
            .unwrap()
            .info()
            .cache
    };
    assert_eq!(load(), CacheOutcome::Compiled);
    assert_eq!(load(), CacheOutcome::Disk);
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        std::fs::write(&path, bytes).unwrap();
    }
    assert_eq!(load(), CacheOutcome::Compiled);
    assert_eq!(load(), CacheOutcome::Disk);
}

#[test]
fn instances_are_recycled_after_their_call_quota() {
    let engine = PolicyEngine::new(RuntimeConfig {
        recycle_after_calls: 3,
        ..runtime()
    })
    .unwrap();
    let h = handle(&engine, "kv-cost", "{}");
    for _ in 0..12 {
        assert_eq!(h.decide(request(4, 1), &four()).decider, Decider::Policy);
    }
    // 1 canary + 12 decisions at 3 calls per instance: at least 4 instances.
    assert!(
        h.current().instances_created() >= 4,
        "{}",
        h.current().instances_created()
    );
}

#[test]
fn no_candidates_is_an_answer_not_a_failure() {
    let h = handle(&engine(), "kv-cost", "{}");
    let d = h.decide(request(4, 1), &Candidates::default());
    assert_eq!(d.outcome, DecisionOutcome::NoCandidates);
    assert_eq!(h.status().failures, 0);
}
