//! The sandbox against hostile guests built by the workspace: loops, memory bombs,
//! panics, blocking, forged answers and text, and what WASI grants.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::policy::*;
use common::{guest, runtime};
use switchyard::ids::InstanceId;
use switchyard::policy::{
    CallFailure, Candidates, Decider, DecisionOutcome, PolicyEngine, RuntimeConfig, native,
};

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
