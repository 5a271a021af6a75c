use super::*;

fn ms(v: f64) -> Duration {
    Duration::from_secs_f64(v / 1e3)
}

/// A worker prefilling 10,000 tokens a second with 20 ms per request on top:
/// requests alone and behind others, long prompts and fully cached ones.
fn worker_at_10k_tokens_a_second() -> LatencyModel {
    let mut m = LatencyModel::default();
    for i in 0..40u32 {
        let f = Features {
            ahead_requests: i % 4,
            ahead_tokens: u64::from(i % 4) * 1500,
            uncached: [0, 300, 2000, 8000][(i % 3) as usize],
            in_flight: 1 + i % 4,
        };
        let [x1, x2, _] = f.ttft_x();
        m.learn_ttft(f, ms(20.0 * x1 + 0.1 * x2), None);
    }
    m
}

#[test]
fn unknown_until_enough_samples_then_known_for_good() {
    let mut m = LatencyModel::default();
    let f = Features {
        uncached: 1000,
        in_flight: 1,
        ..Features::default()
    };
    for i in 0..MIN_SAMPLES {
        assert_eq!(m.predict(f).ttft, None, "after {i} samples");
        m.learn_ttft(f, ms(120.0), None);
    }
    let p = m.predict(f).ttft.expect("known after MIN_SAMPLES");
    assert!((p.as_secs_f64() - 0.12).abs() < 1e-9, "{p:?}");
    assert_eq!(m.predict(f).tpot, None, "no stream seen: TPOT unknown");
    assert_eq!(
        m.wait(Features::default()),
        Some(Duration::ZERO),
        "nothing ahead: no wait"
    );
}

/// First tokens inferred from whole answers teach only a worker that has seen none.
/// Alone, estimates that average below zero (their decode predicted long) leave the
/// TTFT unknown, not zero; beside first tokens seen they change nothing, however
/// many.
#[test]
fn first_tokens_inferred_never_pull_the_ones_seen() {
    let f = Features {
        uncached: 1000,
        in_flight: 1,
        ..Features::default()
    };
    let mut m = LatencyModel::default();
    for _ in 0..8 {
        m.learn_inferred_ttft(f, ms(1000.0), ms(1200.0));
    }
    assert_eq!(m.predict(f).ttft, None, "below zero on average: unknown");
    for _ in 0..16 {
        m.learn_inferred_ttft(f, ms(1000.0), ms(900.0));
    }
    let inferred = m.predict(f).ttft.expect("above zero now").as_secs_f64();
    assert!(inferred > 0.0 && inferred < 0.1, "{inferred}");
    for _ in 0..4 {
        m.learn_ttft(f, ms(100.0), None);
    }
    for _ in 0..40 {
        m.learn_inferred_ttft(f, ms(1000.0), ms(1500.0));
    }
    let seen = m.predict(f).ttft.unwrap().as_secs_f64();
    assert!((seen - 0.1).abs() < 1e-6, "{seen}");
    assert_eq!(m.samples().0, 4);
}

/// Concurrent requests (others ahead) and cached ones (no uncached tokens): both
/// coefficients are found, and a request's TTFT follows what is ahead of it.
#[test]
fn ttft_is_learned_from_concurrent_and_cached_requests() {
    let m = worker_at_10k_tokens_a_second();
    let (a, s) = m.ttft_coefficients().unwrap();
    assert!(
        (a - 0.020).abs() < 1e-6 && (s - 1e-4).abs() < 1e-9,
        "{a} {s}"
    );
    let cached_alone = Features {
        in_flight: 1,
        ..Features::default()
    };
    assert_eq!(m.predict(cached_alone).ttft, Some(ms(20.0)));
    let behind = Features {
        ahead_requests: 3,
        ahead_tokens: 20_000,
        uncached: 1000,
        in_flight: 4,
    };
    let p = m.predict(behind).ttft.unwrap().as_secs_f64();
    assert!((p - (0.080 + 2.1)).abs() < 1e-6, "{p}");
    let w = m.wait(behind).unwrap().as_secs_f64();
    assert!((w - 2.06).abs() < 1e-6, "the queue ahead alone: {w}");
}

/// Every request alone and every prompt the same size: the two features cannot be
/// told apart; the fit still predicts such requests right.
#[test]
fn one_kind_of_request_is_predicted_from_one_feature() {
    let mut m = LatencyModel::default();
    let f = Features {
        uncached: 500,
        in_flight: 1,
        ..Features::default()
    };
    for _ in 0..20 {
        m.learn_ttft(f, ms(70.0), None);
    }
    let p = m.predict(f).ttft.unwrap().as_secs_f64();
    assert!((p - 0.070).abs() < 1e-9, "{p}");
}

/// A worker whose batch is full serves one waiting request per slot freed, whatever
/// its prompt: the per-request coefficient carries the slot's turnover, so a queue of
/// short prompts predicts a long wait (the decode-bound overload).
#[test]
fn a_full_batch_shows_as_time_per_request_ahead() {
    let mut m = LatencyModel::default();
    // 2 slots, 600 ms per answer: a request's turn every 300 ms; prompts of 20 tokens.
    for i in 0..30u32 {
        let ahead = i % 6;
        let f = Features {
            ahead_requests: ahead,
            ahead_tokens: u64::from(ahead) * 20,
            uncached: 20,
            in_flight: 2 + ahead,
        };
        m.learn_ttft(f, ms(300.0 * f64::from(ahead + 1)), None);
    }
    let five = Features {
        ahead_requests: 5,
        ahead_tokens: 100,
        ..Features::default()
    };
    let w = m.wait(five).unwrap().as_secs_f64();
    assert!((w - 1.5).abs() < 0.01, "five ahead at 300 ms each: {w}");
}

#[test]
fn tpot_grows_with_the_batch_and_the_prefill_beside_it() {
    let mut m = LatencyModel::default();
    for b in [1.0, 4.0, 8.0, 16.0] {
        for p in [0.0, 4000.0, 16000.0] {
            let beside = Beside {
                in_flight: b,
                pending_tokens: p,
            };
            m.learn_tpot(beside, ms(10.0 + 0.5 * b + 0.002 * p), None);
        }
    }
    let at = |n, p| {
        m.predict(Features {
            in_flight: n,
            ahead_tokens: p,
            ..Features::default()
        })
        .tpot
        .unwrap()
        .as_secs_f64()
    };
    assert!((at(1, 0) - 0.0105).abs() < 1e-9, "{}", at(1, 0));
    assert!((at(32, 10_000) - 0.046).abs() < 1e-9, "{}", at(32, 10_000));
    // From an engine's counters alone: the first page is a start, each later one a
    // sample; a counter going back (a restarted engine) teaches nothing.
    let mut e = LatencyModel::default();
    let mut page = EngineLatency::default();
    let beside = Beside {
        in_flight: 2.0,
        pending_tokens: 0.0,
    };
    for i in 0..=MIN_SAMPLES {
        page.itl_sum += 0.012 * 100.0;
        page.itl_count += 100.0;
        e.engine_report(page, beside);
        let known = e.predict(Features::default()).tpot.is_some();
        assert_eq!(known, i == MIN_SAMPLES, "after {i} pages");
    }
    e.engine_report(EngineLatency::default(), beside);
    assert_eq!(e.samples().1, MIN_SAMPLES);
    let t = e.predict(Features::default()).tpot.unwrap().as_secs_f64();
    assert!((t - 0.012).abs() < 1e-9, "{t}");
}

/// Samples from outside that are not latencies (negative, not finite, longer than an
/// hour) are not learned from, and predictions never come out negative or infinite.
#[test]
fn nonsense_is_not_learned() {
    let mut m = worker_at_10k_tokens_a_second();
    let before = m.clone();
    m.learn_ttft(Features::default(), Duration::from_secs(7200), None);
    let bad = |in_flight, pending_tokens| Beside {
        in_flight,
        pending_tokens,
    };
    m.learn_tpot(bad(f64::NAN, 0.0), ms(10.0), None);
    m.learn_tpot(bad(-3.0, 0.0), ms(10.0), None);
    m.learn_tpot(bad(1.0, f64::INFINITY), ms(10.0), None);
    m.engine_report(
        EngineLatency {
            itl_sum: f64::INFINITY,
            itl_count: 1e9,
        },
        bad(1.0, 0.0),
    );
    assert_eq!(m.ttft_coefficients(), before.ttft_coefficients());
    assert_eq!(m.samples().1, 0);
    let huge = Features {
        ahead_requests: u32::MAX,
        ahead_tokens: u64::MAX,
        uncached: u64::MAX,
        in_flight: u32::MAX,
    };
    let p = m.predict(huge).ttft.unwrap();
    assert!(p > Duration::from_secs(3600), "{p:?}");
}

#[test]
fn errors_are_the_mean_absolute_percentage() {
    let mut m = LatencyModel::default();
    let f = Features::default();
    m.learn_ttft(f, ms(100.0), Some(ms(150.0)));
    m.learn_ttft(f, ms(200.0), Some(ms(180.0)));
    m.learn_ttft(f, ms(1.0), Some(ms(2.0)));
    m.learn_ttft(f, ms(1.0), None);
    let e = m.errors().ttft;
    assert_eq!(e.count, 3);
    // 50 %, 10 %, and 1 ms against the 5 ms floor: 20 %.
    assert!((e.mean().unwrap() - (0.5 + 0.1 + 0.2) / 3.0).abs() < 1e-9);
    assert_eq!(m.errors().tpot.mean(), None);
    let p = Prediction {
        ttft: Some(ms(100.0)),
        tpot: Some(ms(10.0)),
    };
    assert_eq!(p.e2e(101), Some(ms(1100.0)));
    assert_eq!(Prediction::default().e2e(5), None);
}
