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

/// Waits (bounded) until the current policy has `n` idle instances: the warmer replaces
/// trapped and recycled ones in the background, and decisions never wait for it.
fn settle(h: &PolicyHandle, n: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while h.current().idle_instances() < n {
        assert!(
            std::time::Instant::now() < deadline,
            "the warmer did not make {n} instances"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
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
    settle(&h, engine.config().warm_instances);
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
fn the_epoch_ticker_sleeps_while_idle_and_still_stops_a_loop_after() {
    let engine = no_rollback(64 << 20, 20);
    let h = hostile(&engine, "spin_forever");
    // No policy code runs now: the ticker stops advancing (a ticker that never sleeps
    // advances every millisecond, and two readings 50 ms apart never agree).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let before = engine.epoch_ticks();
        std::thread::sleep(Duration::from_millis(50));
        if engine.epoch_ticks() == before {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the ticker kept ticking with nothing to time"
        );
    }
    // The next call wakes it: the loop is still interrupted at its budget.
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
    // Each trapped instance was discarded; the warmer (not the request) makes fresh ones.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while h.current().instances_created() < before + 3 {
        assert!(
            std::time::Instant::now() < deadline,
            "the warmer did not replace the trapped instances"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
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
    settle(&h, 4);
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
        // Enough warm instances that the 20 trapped ones never empty the pool (an empty
        // pool is a fallback that is not the policy's failure, and not in the window).
        warm_instances: 32,
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
    settle(&h, 32);
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
    assert_eq!(
        (h.totals().rate_rollbacks, h.totals().automatic_rollbacks),
        (1, 0)
    );
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

/// Compiled code is native code the router runs outside the sandbox: the cache gives
/// back only entries this router wrote (their HMAC verifies under its key). A truncated
/// entry, and a forged one (another policy's valid compiled code under this one's name,
/// with the old format's checksum or a tag under another key), are recompiled, never
/// run; a key file that others can read turns the cache off.
#[test]
fn a_cache_entry_this_router_did_not_write_is_never_executed() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("policies");
    let config = || RuntimeConfig {
        cache_dir: Some(cache.clone()),
        ..Default::default()
    };
    let load = |spec: &str| {
        let info = PolicyEngine::new(config())
            .unwrap()
            .load_spec(spec, "")
            .unwrap()
            .info()
            .clone();
        (info.name, info.cache)
    };
    let entries = || -> Vec<std::path::PathBuf> {
        let mut v: Vec<_> = std::fs::read_dir(&cache)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "cwasm"))
            .collect();
        v.sort();
        v
    };
    let kv = ("kv-cost".to_string(), CacheOutcome::Compiled);
    assert_eq!(load("kv-cost"), kv);
    assert_eq!(load("kv-cost").1, CacheOutcome::Disk);
    let kv_entry = entries()[0].clone();
    let key = cache.join("key");
    assert_eq!(
        std::fs::metadata(&key).unwrap().permissions().mode() & 0o777,
        0o600
    );
    assert_eq!(load("round-robin").1, CacheOutcome::Compiled);
    let rr_entry = entries().into_iter().find(|p| *p != kv_entry).unwrap();
    let rr_artifact = std::fs::read(&rr_entry).unwrap()[32..].to_vec();

    // Truncated.
    let whole = std::fs::read(&kv_entry).unwrap();
    std::fs::write(&kv_entry, &whole[..whole.len() - 1]).unwrap();
    assert_eq!(load("kv-cost"), kv);
    // Round-robin's code under kv-cost's name, tagged with another key.
    let other = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &[7u8; 32]);
    let mut forged = ring::hmac::sign(&other, &rr_artifact).as_ref().to_vec();
    forged.extend_from_slice(&rr_artifact);
    std::fs::write(&kv_entry, &forged).unwrap();
    assert_eq!(load("kv-cost"), kv, "a forged entry was executed");
    // The same with a checksum anyone can compute (the old format).
    let mut forged = sha256_hex(&rr_artifact).into_bytes();
    forged.extend_from_slice(&rr_artifact);
    std::fs::write(&kv_entry, &forged).unwrap();
    assert_eq!(load("kv-cost"), kv, "a forged entry was executed");
    assert_eq!(load("kv-cost").1, CacheOutcome::Disk);
    // Two entries this router wrote, swapped: each tag covers the policy it was compiled
    // from, so both are recompiled and neither runs the other's code.
    let (kv_whole, rr_whole) = (
        std::fs::read(&kv_entry).unwrap(),
        std::fs::read(&rr_entry).unwrap(),
    );
    std::fs::write(&kv_entry, &rr_whole).unwrap();
    std::fs::write(&rr_entry, &kv_whole).unwrap();
    assert_eq!(load("kv-cost"), kv, "round-robin's entry ran as kv-cost");
    assert_eq!(
        load("round-robin"),
        ("round-robin".to_string(), CacheOutcome::Compiled),
        "kv-cost's entry ran as round-robin"
    );
    assert_eq!(load("kv-cost").1, CacheOutcome::Disk);
    // An entry replaced by a link to a file elsewhere is not followed.
    let elsewhere = dir.path().join("elsewhere.cwasm");
    std::fs::rename(&kv_entry, &elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &kv_entry).unwrap();
    assert_eq!(load("kv-cost"), kv, "a linked entry was read");
    assert!(
        !std::fs::symlink_metadata(&kv_entry)
            .unwrap()
            .file_type()
            .is_symlink(),
        "the fresh entry replaced the link"
    );
    // A cache directory others can write is not used.
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o777)).unwrap();
    assert_eq!(load("kv-cost"), kv);
    assert_eq!(load("kv-cost"), kv);
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o700)).unwrap();
    assert_eq!(load("kv-cost").1, CacheOutcome::Disk);

    // A key others can read is not trusted: the cache is not used.
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert_eq!(load("kv-cost"), kv);
    assert_eq!(load("kv-cost"), kv);
}

fn sha256_hex(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Compiles run one at a time: the same policy uploaded four times at once is compiled
/// once. A compile past its budget refuses the load (the work finishes in the background
/// and is kept).
#[test]
fn compiles_are_serialised_deduplicated_and_bounded_in_time() {
    let bytes = std::fs::read(guest("session_affinity")).unwrap();
    let engine = PolicyEngine::new(RuntimeConfig {
        cache_dir: None,
        ..runtime()
    })
    .unwrap();
    let outcomes: Vec<CacheOutcome> = std::thread::scope(|s| {
        let loads: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    engine
                        .load(PolicySource::Uploaded("test".into()), &bytes, "{}")
                        .unwrap()
                        .info()
                        .cache
                })
            })
            .collect();
        loads.into_iter().map(|l| l.join().unwrap()).collect()
    });
    let compiled = outcomes
        .iter()
        .filter(|o| **o == CacheOutcome::Compiled)
        .count();
    assert_eq!(compiled, 1, "{outcomes:?}");

    let hurried = PolicyEngine::new(RuntimeConfig {
        cache_dir: None,
        compile_budget: Duration::from_nanos(1),
        ..runtime()
    })
    .unwrap();
    let err = hurried
        .load(PolicySource::Uploaded("test".into()), &bytes, "{}")
        .err()
        .expect("a compile cannot finish in a nanosecond");
    assert!(matches!(err, PolicyError::Busy(_)), "{err}");
    assert!(err.to_string().contains("longer than"), "{err}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match hurried.load(PolicySource::Uploaded("test".into()), &bytes, "{}") {
            Ok(p) => {
                assert_eq!(p.info().cache, CacheOutcome::Memory);
                break;
            }
            Err(PolicyError::Busy(_)) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("the background compile was not kept: {e}"),
        }
    }
}

/// `bytes` with a custom section appended: the same policy, another sha256 (a compile
/// of its own).
fn variant(bytes: &[u8], n: u8) -> Vec<u8> {
    let name = b"variant";
    let body_len = 1 + name.len() + 1;
    let mut out = bytes.to_vec();
    out.extend_from_slice(&[0, body_len as u8, name.len() as u8]);
    out.extend_from_slice(name);
    out.push(n);
    out
}

/// The worst case of the compile queue: eight different policies uploaded at once. At
/// most four compile or wait; the rest are answered `busy` at once (never queued without
/// bound), and a refused one loads when tried again: nothing is lost.
#[test]
fn compiles_beyond_the_queue_are_refused_as_busy_and_load_when_retried() {
    let bytes = std::fs::read(guest("session_affinity")).unwrap();
    let engine = PolicyEngine::new(RuntimeConfig {
        cache_dir: None,
        ..runtime()
    })
    .unwrap();
    let variants: Vec<Vec<u8>> = (0..8).map(|n| variant(&bytes, n)).collect();
    let start = std::sync::Barrier::new(variants.len());
    let results: Vec<Result<(), PolicyError>> = std::thread::scope(|s| {
        let loads: Vec<_> = variants
            .iter()
            .map(|v| {
                let (engine, start) = (&engine, &start);
                s.spawn(move || {
                    start.wait();
                    engine
                        .load(PolicySource::Uploaded("test".into()), v, "{}")
                        .map(|_| ())
                })
            })
            .collect();
        loads.into_iter().map(|l| l.join().unwrap()).collect()
    });
    let busy: Vec<usize> = (0..results.len())
        .filter(|&i| matches!(results[i], Err(PolicyError::Busy(_))))
        .collect();
    let loaded = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(busy.len() + loaded, 8, "{results:?}");
    assert!(!busy.is_empty() && loaded >= 4, "{results:?}");
    for &i in &busy {
        let msg = results[i].as_ref().unwrap_err().to_string();
        assert!(msg.contains("already compiling"), "{msg}");
        engine
            .load(PolicySource::Uploaded("test".into()), &variants[i], "{}")
            .unwrap_or_else(|e| panic!("variant {i} refused when tried alone: {e}"));
    }
}

/// A request never waits for an instance to be made. This policy takes a long time to
/// configure; once its only warm instance is discarded (the policy trapped), the next
/// decision is made at once by the fallback, counted as `no_warm_instance`, and not held
/// against the policy; the warmer brings the policy back.
#[test]
fn a_decision_never_waits_for_a_new_instance() {
    let engine = PolicyEngine::new(RuntimeConfig {
        warm_instances: 1,
        load_budget: Duration::from_secs(10),
        rollback_after_failures: u32::MAX,
        rollback_failure_rate: 0.0,
        ..runtime()
    })
    .unwrap();
    let h = handle(&engine, "kv-cost", "{}");
    h.swap(
        engine
            .load_file(&guest("flaky"), r#"{"every": 2, "spin": 150}"#)
            .unwrap(),
    )
    .unwrap();
    // Sequence 0 is well-behaved in these guests.
    assert_eq!(h.decide(request(4, 2), &four()).decider, Decider::Policy);
    let trapped = h.decide(request(4, 2), &four());
    assert!(
        matches!(trapped.failure, Some(CallFailure::Trap(_))),
        "{trapped:?}"
    );
    let next = h.decide(request(4, 1), &four());
    assert_eq!(next.decider, Decider::Fallback);
    assert_eq!(next.failure, Some(CallFailure::NoWarmInstance));
    let no_warm = CallFailure::REASONS
        .iter()
        .position(|r| *r == "no_warm_instance")
        .unwrap();
    let totals = h.totals();
    assert_eq!(totals.failures, 1, "only the trap is the policy's failure");
    assert_eq!(totals.fallbacks[no_warm], 1);
    assert_eq!(h.status().failures, 1);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while h.decide(request(4, 1), &four()).decider != Decider::Policy {
        assert!(
            std::time::Instant::now() < deadline,
            "the warmer never made an instance"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The memory of all instances together is capped: a guest that would take them past the
/// cap traps (before its own cap), what it held is given back, and a policy whose
/// instances cannot fit is refused at load with the reason.
#[test]
fn all_instances_together_stay_under_a_memory_cap() {
    let engine = PolicyEngine::new(RuntimeConfig {
        memory_cap: 64 << 20,
        total_memory_cap: 24 << 20,
        warm_instances: 2,
        rollback_after_failures: u32::MAX,
        rollback_failure_rate: 0.0,
        ..runtime()
    })
    .unwrap();
    let h = hostile(&engine, "memory_bomb");
    settle(&h, 2);
    let resting = engine.instance_memory();
    assert!(resting > 0 && resting < 24 << 20, "{resting}");
    let d = h.decide(request(4, 1), &four());
    assert_eq!(d.decider, Decider::Fallback);
    assert_eq!(d.failure, Some(CallFailure::TotalMemory(24 << 20)), "{d:?}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while engine.instance_memory() > resting {
        assert!(
            std::time::Instant::now() < deadline,
            "the trapped instance's memory was not given back: {} > {resting}",
            engine.instance_memory()
        );
        std::thread::sleep(Duration::from_millis(5));
    }

    let tiny = PolicyEngine::new(RuntimeConfig {
        total_memory_cap: 4096,
        ..runtime()
    })
    .unwrap();
    let err = tiny.load_spec("kv-cost", "{}").err().unwrap().to_string();
    assert!(
        err.contains("together would pass the memory limit of 4096"),
        "{err}"
    );
    assert_eq!(tiny.instance_memory(), 0);
}

/// An automatic rollback returns to the most recent policy that served a whole window
/// without a failure (a built-in from the start), never merely to the previous one: a
/// policy that was itself failing is skipped, and with no good policy to return to the
/// failing one stays, decided for by the fallback.
#[test]
fn an_automatic_rollback_returns_to_the_last_policy_that_served_a_clean_window() {
    let engine = PolicyEngine::new(RuntimeConfig {
        rollback_after_failures: 3,
        rollback_failure_rate: 0.5,
        rollback_window: 20,
        warm_instances: 8,
        ..runtime()
    })
    .unwrap();
    let flaky = |every: u32| {
        engine
            .load_file(&guest("flaky"), &format!(r#"{{"every": {every}}}"#))
            .unwrap()
    };
    let panics = || {
        engine
            .load_file(&guest("panics"), r#"{"after": 1}"#)
            .unwrap()
    };
    let h = handle(&engine, "round-robin", "{}");
    assert!(h.status().proven, "a built-in is good from the start");

    // A policy failing one call in three, never three in a row nor half a window.
    h.swap(flaky(3)).unwrap();
    settle(&h, 8);
    for seed in 1..=10 {
        h.decide(request(4, seed), &four());
    }
    let status = h.status();
    assert_eq!((status.info.name.as_str(), status.proven), ("flaky", false));
    h.swap(panics()).unwrap();
    settle(&h, 8);
    let status = h.status();
    assert_eq!(status.previous.unwrap().name, "flaky");
    assert_eq!(status.last_good.unwrap().name, "round-robin");
    for _ in 0..3 {
        assert_eq!(h.decide(request(4, 1), &four()).decider, Decider::Fallback);
    }
    assert_eq!(
        h.status().info.name,
        "round-robin",
        "rolled back past the flaky policy"
    );

    // A custom policy that served a clean window is good.
    h.swap(flaky(0)).unwrap();
    settle(&h, 8);
    for seed in 1..=20 {
        assert_eq!(h.decide(request(4, seed), &four()).decider, Decider::Policy);
    }
    assert!(h.status().proven);
    h.swap(panics()).unwrap();
    settle(&h, 8);
    for _ in 0..3 {
        h.decide(request(4, 1), &four());
    }
    assert_eq!(h.status().info.name, "flaky");
    assert_eq!(h.totals().automatic_rollbacks, 2);

    // Nothing good to return to: the failing policy stays, the fallback decides.
    let alone = PolicyHandle::new(engine.clone(), flaky(3)).unwrap();
    alone.swap(panics()).unwrap();
    settle(&alone, 8);
    // Sequence 0 is well-behaved in these guests.
    assert_eq!(
        alone.decide(request(4, 1), &four()).decider,
        Decider::Policy
    );
    for _ in 0..6 {
        assert_eq!(
            alone.decide(request(4, 1), &four()).decider,
            Decider::Fallback
        );
    }
    assert_eq!(alone.status().info.name, "panics");
    assert_eq!(alone.totals().automatic_rollbacks, 0);
}

#[test]
fn instances_are_recycled_after_their_call_quota() {
    let engine = PolicyEngine::new(RuntimeConfig {
        recycle_after_calls: 3,
        // The canary's 9 calls and these 12 retire 7 instances: none has to wait for
        // the warmer.
        warm_instances: 16,
        ..runtime()
    })
    .unwrap();
    let h = handle(&engine, "kv-cost", "{}");
    settle(&h, 16);
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

/// Every change of an endpoint's policy is kept for the admin page, but at most CHANGES:
/// a push refused on every reconciliation (or an upload loop) cannot grow it.
#[test]
fn the_policy_history_keeps_the_latest_changes_only() {
    let engine = engine();
    let h = handle(&engine, "kv-cost", "{}");
    assert_eq!(h.changes()[0].kind, "loaded");
    for _ in 0..3 * switchyard::policy::CHANGES {
        let _ = h.swap_spec("no-such-builtin", "{}");
    }
    h.swap_spec("round-robin", "{}").unwrap();
    let changes = h.changes();
    assert_eq!(changes.len(), switchyard::policy::CHANGES);
    assert!(
        changes[..changes.len() - 1]
            .iter()
            .all(|c| c.kind == "refused")
    );
    let last = changes.last().unwrap();
    assert_eq!(
        (last.kind, last.policy.as_str()),
        ("swap", "round-robin@0.1.0")
    );
    assert!(last.detail.contains("kv-cost@0.2.0"), "{}", last.detail);
}
