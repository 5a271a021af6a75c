//! The policy runtime against real `.wasm` components: the built-ins and the example
//! policy deciding, instances made and recycled off the request path.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::policy::*;
use common::{Rng, guest, runtime};
use switchyard::ids::InstanceId;
use switchyard::policy::{
    CallFailure, CandidateRow, Candidates, Decider, DecisionOutcome, PolicyEngine, PolicyError,
    PolicyHandle, Request, RuntimeConfig, native,
};

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
fn a_policy_built_against_the_previous_contract_still_loads_and_decides() {
    let engine = engine();
    let old = engine.load_file(&guest("built_for_0_1"), "{}").unwrap();
    assert_eq!(old.info().world, "switchyard:policy@0.1.0");
    assert_eq!(
        handle(&engine, "kv-cost", "{}").current().info().world,
        "switchyard:policy@0.4.0"
    );
    let h = PolicyHandle::new(engine.clone(), old).unwrap();
    // It reads the fields 0.1.0 has: the lowest reported usage wins.
    let with = |id, usage, fullness| CandidateRow {
        kv_usage: usage,
        cache_fullness: fullness,
        ..row(id, 0, 0, 0)
    };
    let candidates: Candidates = [
        with(1, Some(0.7), Some(0.1)),
        with(2, Some(0.2), Some(1.0)),
        with(3, None, Some(0.0)),
    ]
    .into_iter()
    .collect();
    let d = h.decide(request(16, 1), &candidates);
    assert_eq!(d.decider, Decider::Policy);
    assert_eq!(chosen(&d.outcome), InstanceId(2));
    // Its rejection arrives as a rejection, with its reason.
    let unreported: Candidates = [with(1, None, Some(0.5))].into_iter().collect();
    match h.decide(request(16, 1), &unreported).outcome {
        DecisionOutcome::Rejected(r) => assert!(r.reason.contains("16-block prompt"), "{r:?}"),
        other => panic!("expected a rejection, got {other:?}"),
    }
}

/// A 0.2.0 component knows no roles: on an aggregated fleet it decides as before; on a
/// split fleet the host asks it among the prefill workers, then among the decode workers,
/// and the pair is the decision; a lone prefill worker is no placement at all.
#[test]
fn a_policy_built_before_disaggregation_is_asked_once_per_role() {
    use switchyard::ids::Role;
    let engine = engine();
    let old = engine.load_file(&guest("built_for_0_2"), "{}").unwrap();
    assert_eq!(old.info().world, "switchyard:policy@0.2.0");
    let h = PolicyHandle::new(engine.clone(), old).unwrap();
    let with = |id, fullness, role| CandidateRow {
        cache_fullness: Some(fullness),
        role,
        ..row(id, 0, 0, 0)
    };
    let both: Candidates = [with(1, 0.9, Role::Both), with(2, 0.3, Role::Both)]
        .into_iter()
        .collect();
    let d = h.decide(request(16, 1), &both);
    assert_eq!((chosen(&d.outcome), d.prefill), (InstanceId(2), None));
    let split: Candidates = [
        with(1, 0.9, Role::Prefill),
        with(2, 0.3, Role::Decode),
        with(3, 0.1, Role::Prefill),
        with(4, 0.8, Role::Decode),
    ]
    .into_iter()
    .collect();
    let d = h.decide(request(16, 1), &split);
    assert_eq!(d.decider, Decider::Policy);
    assert_eq!(
        (d.prefill, chosen(&d.outcome)),
        (Some(InstanceId(3)), InstanceId(2)),
        "the least full prefill worker, then the least full decode worker"
    );
    let lone: Candidates = [with(1, 0.5, Role::Prefill)].into_iter().collect();
    match h.decide(request(16, 1), &lone).outcome {
        DecisionOutcome::Rejected(r) => assert!(r.reason.contains("no decode worker"), "{r:?}"),
        other => panic!("expected a rejection, got {other:?}"),
    }
}

/// A 0.3.0 component knows neither predictions nor objectives: the host hands it the
/// request and candidates it knows, whatever the router predicted, and its placements
/// (one worker, or a pair) come back as decisions.
#[test]
fn a_policy_built_before_predicted_latency_loads_and_decides() {
    use switchyard::ids::Role;
    let engine = engine();
    let old = engine.load_file(&guest("built_for_0_3"), "{}").unwrap();
    assert_eq!(old.info().world, "switchyard:policy@0.3.0");
    old.canary().unwrap();
    let h = PolicyHandle::new(engine.clone(), old).unwrap();
    let with = |id, overlap, role, ttft| CandidateRow {
        role,
        predicted_ttft_ms: Some(ttft),
        predicted_tpot_ms: Some(12.0),
        ..row(id, overlap, 0, 0)
    };
    let both: Candidates = [with(1, 3, Role::Both, 5.0), with(2, 9, Role::Both, 900.0)]
        .into_iter()
        .collect();
    let req = Request {
        max_tokens: Some(64),
        ttft_objective_ms: Some(100),
        ..request(16, 1)
    };
    let d = h.decide(req, &both);
    assert_eq!(d.decider, Decider::Policy);
    assert_eq!(
        chosen(&d.outcome),
        InstanceId(2),
        "the most cached, predictions unseen"
    );
    let split: Candidates = [
        with(3, 0, Role::Prefill, 1.0),
        with(4, 0, Role::Decode, 1.0),
    ]
    .into_iter()
    .collect();
    let d = h.decide(req, &split);
    assert_eq!(
        (d.prefill, chosen(&d.outcome)),
        (Some(InstanceId(3)), InstanceId(4))
    );
}

/// A current policy whose placement the fleet cannot take (a pair of two decode workers,
/// a lone prefill worker under SGLang's handoff) is decided for by the fallback.
#[test]
fn a_placement_the_fleet_cannot_take_is_a_policy_failure() {
    use switchyard::ids::Role;
    let engine = engine();
    // picks-first answers the first candidate: a prefill worker.
    let h = PolicyHandle::new(
        engine.clone(),
        engine.load_file(&guest("picks_first"), "{}").unwrap(),
    )
    .unwrap();
    let split: Candidates = [
        CandidateRow {
            role: Role::Prefill,
            ..row(1, 0, 0, 0)
        },
        CandidateRow {
            role: Role::Decode,
            ..row(2, 0, 0, 0)
        },
    ]
    .into_iter()
    .collect();
    let sglang = Request {
        decode_alone: false,
        ..request(16, 1)
    };
    let d = h.decide(sglang, &split);
    assert_eq!(d.decider, Decider::Fallback);
    assert!(
        matches!(&d.failure, Some(CallFailure::BadPlacement(why)) if why.contains("prefill worker")),
        "{:?}",
        d.failure
    );
    assert_eq!(
        (d.prefill, chosen(&d.outcome)),
        (Some(InstanceId(1)), InstanceId(2)),
        "the fallback splits it"
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
        r#"{"pressure_weight": 3}"#,
    ];
    let mut rng = Rng(42);
    for config in configs {
        let policy = engine.load_spec("kv-cost", config).unwrap();
        let native_config = native::Config::from_json(config).unwrap();
        for case in 0..1000 {
            let n = 1 + rng.below(64) as usize;
            let blocks = rng.below(80) as u32;
            // Predicted latency on every candidate or none, as a router's models give it.
            let predicted = rng.below(2) == 0;
            // Small value ranges so that ties are common.
            let candidates: Candidates = (0..n)
                .map(|i| CandidateRow {
                    id: InstanceId(1000 + i as u64),
                    overlap_blocks: rng.below(blocks as u64 + 5) as u32,
                    active_blocks: rng.below(40) as u32,
                    pending_prefill_tokens: rng.below(4) as u32 * 16,
                    in_flight: rng.below(5) as u32,
                    kv_usage: (rng.below(3) > 0).then(|| rng.below(5) as f32 / 4.0),
                    cache_fullness: (rng.below(3) > 0).then(|| rng.below(5) as f32 / 4.0),
                    role: switchyard::ids::Role::Both,
                    predicted_ttft_ms: predicted.then(|| rng.below(8) as f32 * 25.0),
                    predicted_tpot_ms: predicted.then(|| rng.below(4) as f32 * 5.0),
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
