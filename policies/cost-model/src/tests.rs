//! The cost model against hand-worked cases and its documented properties.

use super::*;

fn view<'a>(o: &'a [u32], a: &'a [u32], p: &'a [u32]) -> CandidateView<'a> {
    const ZEROS: [u32; 8] = [0; 8];
    const UNKNOWN: [f32; 8] = [-1.0; 8];
    CandidateView {
        overlap_blocks: o,
        active_blocks: a,
        pending_prefill_tokens: p,
        in_flight: &ZEROS[..o.len()],
        kv_usage: &UNKNOWN[..o.len()],
        cache_fullness: &UNKNOWN[..o.len()],
        predicted_ttft_ms: &UNKNOWN[..o.len()],
    }
}

fn roles(r: &'static [Role]) -> impl Fn(usize) -> Role {
    move |i| r[i]
}

#[test]
fn an_aggregated_fleet_is_placed_as_chosen() {
    let req = RequestShape {
        prompt_blocks: 10,
        block_size: 16,
        seed: 7,
    };
    let c = view(&[0, 8, 2], &[5, 5, 5], &[0, 0, 0]);
    let k = KvCostConfig::default();
    assert_eq!(
        place(&k, &req, &c, |_| Role::Both, true),
        Some(Placement::Worker(1))
    );
}

#[test]
fn a_long_uncached_prompt_is_split_and_a_short_one_stays_on_the_decode_worker() {
    let k = KvCostConfig::default();
    // Candidates: 0, 1 prefill (1 holds the prefix), 2, 3 decode (3 less loaded).
    const R: &[Role] = &[Role::Prefill, Role::Prefill, Role::Decode, Role::Decode];
    let long = RequestShape {
        prompt_blocks: 200,
        block_size: 16,
        seed: 1,
    };
    let mut c = view(&[0, 150, 0, 0], &[0; 4], &[0; 4]);
    c.in_flight = &[0, 0, 6, 1];
    assert_eq!(
        place(&k, &long, &c, roles(R), true),
        Some(Placement::Pair {
            prefill: 1,
            decode: 3
        })
    );
    // 40 uncached tokens: not worth a handoff, when the protocol allows it.
    let short = RequestShape {
        prompt_blocks: 200,
        block_size: 16,
        seed: 1,
    };
    let c = view(&[0, 0, 0, 198], &[0; 4], &[0; 4]);
    assert_eq!(
        place(&k, &short, &c, roles(R), true),
        Some(Placement::Worker(3))
    );
    // SGLang's protocol: every request needs both workers.
    assert!(matches!(
        place(&k, &short, &c, roles(R), false),
        Some(Placement::Pair { decode: 3, .. })
    ));
    // 0 leaves only the queue rule: a decode worker busy enough splits even this.
    let always = KvCostConfig {
        max_local_prefill_tokens: 0.0,
        ..k
    };
    let mut busy = c;
    busy.in_flight = &[0, 0, 900, 900];
    assert!(matches!(
        place(&always, &short, &busy, roles(R), true),
        Some(Placement::Pair { .. })
    ));
}

#[test]
fn a_queued_prefill_pool_does_not_hold_what_an_idle_decode_worker_can_start() {
    let k = KvCostConfig::default();
    const R: &[Role] = &[Role::Prefill, Role::Decode];
    let req = RequestShape {
        prompt_blocks: 100,
        block_size: 16,
        seed: 1,
    };
    // The prefill worker has 20k tokens queued; the decode worker runs 4 requests:
    // its 1,600-token prefill stalls them for less (6,400) than the queue would wait.
    let queued = [20_000, 0];
    let mut c = view(&[0, 0], &[0; 2], &queued);
    c.in_flight = &[0, 4];
    assert_eq!(
        place(&k, &req, &c, roles(R), true),
        Some(Placement::Worker(1))
    );
    // With 16 decoding there, the stall outweighs the queue: split.
    c.in_flight = &[0, 16];
    assert!(matches!(
        place(&k, &req, &c, roles(R), true),
        Some(Placement::Pair { .. })
    ));
    // An idle prefill pool: split.
    let c = view(&[0, 0], &[0; 2], &[0, 0]);
    assert!(matches!(
        place(&k, &req, &c, roles(R), true),
        Some(Placement::Pair { .. })
    ));
}

#[test]
fn without_a_pair_a_worker_that_may_serve_alone_does() {
    let k = KvCostConfig::default();
    let req = RequestShape {
        prompt_blocks: 100,
        block_size: 16,
        seed: 3,
    };
    let c = view(&[0, 0], &[0; 2], &[0; 2]);
    const ONLY_DECODE: &[Role] = &[Role::Decode, Role::Decode];
    assert!(matches!(
        place(&k, &req, &c, roles(ONLY_DECODE), true),
        Some(Placement::Worker(_))
    ));
    assert_eq!(place(&k, &req, &c, roles(ONLY_DECODE), false), None);
    const ONLY_PREFILL: &[Role] = &[Role::Prefill, Role::Prefill];
    assert_eq!(place(&k, &req, &c, roles(ONLY_PREFILL), true), None);
}

#[test]
fn cached_prefix_wins_when_load_is_equal() {
    let req = RequestShape {
        prompt_blocks: 10,
        block_size: 16,
        seed: 7,
    };
    let c = view(&[0, 8, 2], &[5, 5, 5], &[0, 0, 0]);
    assert_eq!(choose(&KvCostConfig::default(), &req, &c), Some(1));
}

#[test]
fn load_outweighs_a_small_overlap() {
    let req = RequestShape {
        prompt_blocks: 10,
        block_size: 16,
        seed: 7,
    };
    let mut c = view(&[2, 0], &[0, 0], &[0, 0]);
    c.in_flight = &[12, 0];
    assert_eq!(choose(&KvCostConfig::default(), &req, &c), Some(1));
    // The same overlap on an idle worker wins.
    c.in_flight = &[0, 0];
    assert_eq!(choose(&KvCostConfig::default(), &req, &c), Some(0));
}

#[test]
fn a_long_cached_prefix_stays_put_until_its_worker_is_much_busier() {
    let req = RequestShape {
        prompt_blocks: 200,
        block_size: 64,
        seed: 7,
    };
    let mut c = view(&[200, 0], &[0, 0], &[0, 0]);
    c.in_flight = &[8, 2];
    assert_eq!(choose(&KvCostConfig::default(), &req, &c), Some(0));
    // A deep prefill queue on the holder (the request would wait behind it) moves it.
    c.pending_prefill_tokens = &[200 * 64 * 10, 0];
    assert_eq!(choose(&KvCostConfig::default(), &req, &c), Some(1));
}

#[test]
fn a_long_uncached_prompt_joins_the_shorter_queue_not_the_emptier_batch() {
    // Saturation: worker 0's cache is full of long prompts, so it runs fewer requests
    // but has the longest prefill queue. A 128k-token prompt cached nowhere must not
    // go there because its prefill would stall fewer requests: it would wait behind
    // 480k tokens instead of 200k.
    let req = RequestShape {
        prompt_blocks: 2000,
        block_size: 64,
        seed: 7,
    };
    let mut c = view(&[0, 0], &[0, 0], &[480_000, 200_000]);
    c.in_flight = &[25, 37];
    c.cache_fullness = &[1.0, 1.0];
    assert_eq!(choose(&KvCostConfig::default(), &req, &c), Some(1));
    // The same fleet still keeps a cached prompt on its worker: a busy fleet makes
    // every uncached block dearer, wherever it goes.
    c.overlap_blocks = &[1900, 0];
    assert_eq!(choose(&KvCostConfig::default(), &req, &c), Some(0));
}

#[test]
fn a_new_prefix_goes_where_it_evicts_least() {
    let req = RequestShape {
        prompt_blocks: 50,
        block_size: 64,
        seed: 7,
    };
    let mut c = view(&[0, 0, 0], &[0, 0, 0], &[0, 0, 0]);
    c.in_flight = &[1, 1, 1];
    c.cache_fullness = &[1.0, 0.2, 0.9];
    assert_eq!(choose(&KvCostConfig::default(), &req, &c), Some(1));
    // The engines' usage counts only running requests' blocks: an idle worker whose
    // cache is full reads 0 there, and it is the fullness that keeps the new prefix
    // off it.
    c.kv_usage = &[0.0, 0.9, 0.0];
    assert_eq!(choose(&KvCostConfig::default(), &req, &c), Some(1));
}

#[test]
fn the_local_stall_counts_each_workers_own_decodes_only_while_the_fleet_has_room() {
    let req = RequestShape {
        prompt_blocks: 100,
        block_size: 64,
        seed: 7,
    };
    // Uncached everywhere; worker 0 runs 20 requests, worker 1 runs 12 and has 3,200
    // tokens (half a prompt) more prefill queued.
    let mut c = view(&[0, 0], &[0, 0], &[0, 3200]);
    c.in_flight = &[20, 12];
    let local = KvCostConfig::from_json(r#"{"stall_local": 1, "in_flight_weight": 0}"#).unwrap();
    let least = KvCostConfig::from_json(r#"{"in_flight_weight": 0}"#).unwrap();
    // Priced at the least loaded count, the shorter queue wins; at each worker's own,
    // the 8 more decodes a prefill on worker 0 would stall (0.25 × 8 × 100 blocks)
    // outweigh the 50 blocks of queue.
    assert_eq!(choose(&least, &req, &c), Some(0));
    assert_eq!(choose(&local, &req, &c), Some(1));
    // When every worker has a deep queue (here 20 prompts' worth), the local share
    // fades and the queue decides again.
    c.pending_prefill_tokens = &[128_000, 131_200];
    assert_eq!(choose(&local, &req, &c), Some(0));
}

#[test]
fn memory_pressure_is_priced_only_when_asked() {
    let req = RequestShape {
        prompt_blocks: 40,
        block_size: 64,
        seed: 7,
    };
    // Equal in everything but the engines' usage: running requests hold 95 % of
    // worker 0's memory and 10 % of worker 1's. Worker 0 holds a few prompt blocks.
    let mut c = view(&[4, 0], &[0, 0], &[0, 0]);
    c.in_flight = &[3, 3];
    c.kv_usage = &[0.95, 0.1];
    assert_eq!(choose(&KvCostConfig::default(), &req, &c), Some(0));
    let pressure = KvCostConfig::from_json(r#"{"pressure_weight": 2}"#).unwrap();
    assert_eq!(choose(&pressure, &req, &c), Some(1));
}

#[test]
fn the_old_memory_model_is_still_one_config_away() {
    let config = KvCostConfig::from_json(
        r#"{"active_weight": 1, "in_flight_weight": 0, "stall_weight": 0, "eviction_weight": 0}"#,
    )
    .unwrap();
    let req = RequestShape {
        prompt_blocks: 10,
        block_size: 16,
        seed: 7,
    };
    let c = view(&[2, 0], &[100, 0], &[0, 0]);
    assert_eq!(choose(&config, &req, &c), Some(1));
    assert_eq!(
        choose(&KvCostConfig::default(), &req, &c),
        Some(0),
        "blocks held no longer count"
    );
}

#[test]
fn a_queued_fleet_keeps_a_request_on_its_cache() {
    let req = RequestShape {
        prompt_blocks: 8,
        block_size: 16,
        seed: 3,
    };
    // Worker 0 holds the prompt but runs two more requests than worker 1.
    let mut c = view(&[8, 0], &[0, 0], &[0, 0]);
    c.in_flight = &[6, 4];
    let off = KvCostConfig {
        overload_weight: 0.0,
        ..KvCostConfig::default()
    };
    // Idle queues: the load decides, with or without the term.
    assert_eq!(choose(&off, &req, &c), Some(1));
    assert_eq!(choose(&KvCostConfig::default(), &req, &c), Some(1));
    // Both have prefill queued (two prompts' worth at least): the cache decides.
    c.pending_prefill_tokens = &[512, 256];
    assert_eq!(choose(&off, &req, &c), Some(1));
    assert_eq!(choose(&KvCostConfig::default(), &req, &c), Some(0));
}

#[test]
fn zero_weight_ignores_the_cache() {
    let config = KvCostConfig {
        overlap_weight: 0.0,
        ..KvCostConfig::default()
    };
    let req = RequestShape {
        prompt_blocks: 10,
        block_size: 16,
        seed: 7,
    };
    let c = view(&[10, 0], &[3, 2], &[0, 0]);
    assert_eq!(choose(&config, &req, &c), Some(1));
}

#[test]
fn ties_spread_over_all_tied_candidates() {
    let req = |seed| RequestShape {
        prompt_blocks: 4,
        block_size: 16,
        seed,
    };
    let mut c = view(&[0, 0, 0, 9], &[0, 0, 0, 0], &[0, 0, 0, 0]);
    c.in_flight = &[0, 0, 0, 50];
    let mut seen = [0u32; 4];
    for seed in 0..3000 {
        seen[choose(&KvCostConfig::default(), &req(seed), &c).unwrap()] += 1;
    }
    assert_eq!(seen[3], 0);
    for count in &seen[..3] {
        assert!((800..1200).contains(count), "uneven tie-breaking: {seen:?}");
    }
}

#[test]
fn temperature_prefers_cheap_but_samples_others() {
    let config = KvCostConfig {
        temperature: 0.5,
        ..KvCostConfig::default()
    };
    let req = |seed| RequestShape {
        prompt_blocks: 8,
        block_size: 16,
        seed,
    };
    let c = view(&[8, 0], &[0, 0], &[0, 0]);
    let mut seen = [0u32; 2];
    for seed in 0..2000 {
        seen[choose(&config, &req(seed), &c).unwrap()] += 1;
    }
    assert!(seen[0] > seen[1] && seen[1] > 0, "{seen:?}");
}

#[test]
fn config_rejects_unknown_keys_and_bad_values() {
    assert_eq!(KvCostConfig::from_json("{}"), Ok(KvCostConfig::default()));
    assert!(KvCostConfig::from_json(r#"{"overlap_weight": 2.5}"#).is_ok());
    assert!(
        KvCostConfig::from_json(r#"{"overlap_wieght": 1}"#)
            .unwrap_err()
            .contains("unknown field")
    );
    assert!(KvCostConfig::from_json(r#"{"temperature": -1}"#).is_err());
    assert!(KvCostConfig::from_json("[").is_err());
    assert!(
        KvCostConfig::from_json(r#"{"stall_weight": -0.5}"#)
            .unwrap_err()
            .contains("stall_weight")
    );
}

#[test]
fn empty_candidates_give_none() {
    let req = RequestShape {
        prompt_blocks: 1,
        block_size: 16,
        seed: 0,
    };
    assert_eq!(
        choose(&KvCostConfig::default(), &req, &view(&[], &[], &[])),
        None
    );
}

/// With every candidate's time to first token predicted, the request's own wait is the
/// prediction (in blocks of the fleet's average): a worker whose queue of requests costs
/// more than its blocks say (a full batch turning over slowly) loses to one that costs
/// less, where the blocks alone call them even; with `latency_weight` 0, or a prediction
/// missing, the blocks decide as before.
#[test]
fn the_predicted_time_to_first_token_is_the_requests_own_wait() {
    let req = RequestShape {
        prompt_blocks: 4,
        block_size: 16,
        seed: 3,
    };
    // Equal blocks queued and cached; worker 0 predicted 900 ms, worker 1 90 ms.
    let predicted = [900.0, 90.0];
    let mut c = view(&[2, 2], &[0, 0], &[64, 64]);
    c.predicted_ttft_ms = &predicted;
    let k = KvCostConfig::default();
    assert_eq!(choose(&k, &req, &c), Some(1));
    let (c0, c1) = (cost(&k, &req, &c, 0), cost(&k, &req, &c, 1));
    // tau = 990 ms over (4 + 2 + 1) * 2 blocks: 70.7 ms a block; 12.7 against 1.3 blocks
    // (and the same 2 uncached blocks each).
    assert!((c0 - c1 - 810.0 / (990.0 / 14.0)).abs() < 1e-9, "{c0} {c1}");
    let off = KvCostConfig {
        latency_weight: 0.0,
        ..k
    };
    assert_eq!(cost(&off, &req, &c, 0), cost(&off, &req, &c, 1));
    let partial = [900.0, -1.0];
    c.predicted_ttft_ms = &partial;
    assert_eq!(
        cost(&k, &req, &c, 0),
        cost(&k, &req, &c, 1),
        "one unknown: blocks"
    );
    assert!(KvCostConfig::from_json(r#"{"latency_weight": 1.5}"#).is_err());
}

/// A prediction that sees no worth in the cache (a fleet whose requests cost more than
/// their tokens: every candidate predicted alike) still leaves each uncached block its
/// price as the prefill the request adds: the worker holding the prompt wins by its
/// blocks, as without predictions.
#[test]
fn a_prediction_blind_to_the_cache_keeps_the_cache_s_price() {
    let req = RequestShape {
        prompt_blocks: 8,
        block_size: 16,
        seed: 3,
    };
    let predicted = [500.0, 500.0];
    let mut c = view(&[8, 0], &[0, 0], &[0, 0]);
    c.predicted_ttft_ms = &predicted;
    let k = KvCostConfig::default();
    for seed in 0..16 {
        let req = RequestShape { seed, ..req };
        assert_eq!(choose(&k, &req, &c), Some(0), "seed {seed}");
    }
    let (c0, c1) = (cost(&k, &req, &c, 0), cost(&k, &req, &c, 1));
    assert!((c1 - c0 - 8.0).abs() < 1e-9, "{c0} {c1}");
}
