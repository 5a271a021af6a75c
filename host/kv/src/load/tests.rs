//! The load tracker's tests.

use super::*;
use crate::latency::EngineLatency;
use proptest::prelude::*;

fn b(v: &[u64]) -> Vec<BlockHash> {
    v.iter().map(|&x| BlockHash(x)).collect()
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

/// Requests queued together on one worker get their first tokens one after another:
/// the model learns what each request and token ahead costs, and a worker's expected
/// wait is the requests routed ahead of a new one, not the requests' whole answers.
#[test]
fn the_time_to_first_token_is_learned_from_streams_queued_together() {
    let t0 = Instant::now();
    let mut t = LoadTracker::default();
    let w = InstanceId(3);
    let mut now = t0;
    // Rounds of three prompts at once, prefilled at 1,000 tokens a second with 50 ms a
    // request on top.
    for round in 0..4u64 {
        let sizes = [[500, 1000, 2000], [2000, 500, 1000], [1000, 2000, 500]][round as usize % 3];
        for (r, size) in (1..=3).zip(sizes) {
            t.book(
                RequestId(round * 10 + r),
                w,
                &b(&[r]),
                size,
                now,
                Watch::FirstToken,
            );
        }
        if round == 0 {
            assert_eq!(t.load(w, now).expected_wait, None, "not measured yet");
        }
        let mut at = now;
        for (r, size) in (1..=3).zip(sizes) {
            at += ms(50 + size);
            t.prefill_done(RequestId(round * 10 + r), at);
        }
        for r in 1..=3 {
            t.complete(RequestId(round * 10 + r), at, Some(1));
        }
        now = at + Duration::from_secs(60);
    }
    let l = t.load(w, now);
    assert_eq!(l.expected_wait, Some(Duration::ZERO), "nothing ahead");
    let rate = l.prefill_rate().expect("measured");
    let (per_request, _) = l.latency.ttft.unwrap();
    assert!((per_request - 0.05).abs() < 1e-6, "{per_request}");
    assert!((rate - 1000.0).abs() < 0.01, "{rate}");
    t.book(RequestId(100), w, &b(&[9]), 2000, now, Watch::FirstToken);
    let wait = t.load(w, now).expected_wait.unwrap();
    assert_eq!(wait.as_millis(), 2050, "one request of 2,000 tokens ahead");
    let p = t.predict(w, 500, now).ttft.unwrap();
    assert_eq!(
        p.as_millis(),
        2050 + 550,
        "behind it, 500 tokens of its own"
    );
    // The view keeps the predictions beside what happened: the first request's was
    // unknown, the last round's right.
    let recent = t.recent(w);
    assert_eq!(recent.len(), 12);
    assert!(recent.iter().all(|c| c.of == "ttft"));
    assert_eq!(recent[0].predicted, None);
    for c in &recent[9..] {
        let p = c.predicted.expect("known by the last round");
        assert!(p.abs_diff(c.observed) < ms(1), "{c:?}");
    }
}

/// A worker keeps its latest predictions beside what happened, and no more.
#[test]
fn a_worker_keeps_only_its_latest_predictions() {
    let mut t = LoadTracker::default();
    let w = InstanceId(1);
    let mut now = Instant::now();
    for r in 0..(RECENT as u64 + 5) {
        t.book(RequestId(r), w, &b(&[r]), 100, now, Watch::FirstToken);
        now += ms(10 + r);
        t.prefill_done(RequestId(r), now);
        t.complete(RequestId(r), now, Some(1));
    }
    let recent = t.recent(w);
    assert_eq!(recent.len(), RECENT);
    assert_eq!(recent[0].observed, ms(15), "the oldest five forgotten");
    assert_eq!(recent[RECENT - 1].observed, ms(10 + RECENT as u64 + 4));
    assert!(t.recent(InstanceId(2)).is_empty());
}

/// An engine's load report after `n` tokens at an inter-token latency of 20 ms.
fn itl_20ms(n: u64) -> ReportedLoad {
    ReportedLoad {
        running: 1,
        latency: Some(EngineLatency {
            itl_sum: 0.02 * n as f64,
            itl_count: n as f64,
        }),
        ..ReportedLoad::default()
    }
}

/// A whole (non-streamed) answer's first byte is its end: it is not taken for its first
/// token. Its prompt counts as pending until its predicted first token, and from its
/// duration the model infers when that came (the engine's inter-token latency, from its
/// load reports, gives the time its tokens took).
#[test]
fn whole_answers_are_pending_until_their_predicted_first_token_and_teach_it() {
    let t0 = Instant::now();
    let mut t = LoadTracker::default();
    let w = InstanceId(1);
    let mut now = t0;
    for i in 0..20u64 {
        t.report(w, itl_20ms(100 * i), now);
        // A 1,000-token prompt prefilled in 100 ms, then 150 tokens at 20 ms: 3.08 s.
        t.book(RequestId(i), w, &b(&[i]), 1000, now, Watch::WholeAnswer);
        let first_byte = now + ms(3080);
        assert!(
            !t.prefill_done(RequestId(i), first_byte),
            "not a first token"
        );
        t.complete(RequestId(i), first_byte, Some(150));
        now += Duration::from_secs(4);
    }
    let l = t.load(w, now);
    assert!(l.latency.tpot.is_some(), "the engine's reports teach TPOT");
    let p = t.predict(w, 1000, now);
    let ttft = p.ttft.expect("inferred from whole answers").as_secs_f64();
    assert!((ttft - 0.1).abs() < 0.005, "{ttft}");
    assert_eq!(p.e2e(150).map(|d| d.as_millis()), Some(3080));
    // Six whole answers at once: each prompt is pending until its predicted first token,
    // then only the answers' decodes are left: the wait is the prefill, not the answers.
    for r in 100..106 {
        t.book(RequestId(r), w, &b(&[r]), 1000, now, Watch::WholeAnswer);
    }
    let l = t.load(w, now);
    assert_eq!((l.pending_prefill_tokens, l.awaiting_first), (6000, 6));
    let wait = l.expected_wait.unwrap().as_secs_f64();
    assert!((wait - 0.6).abs() < 0.03, "six prefills ahead: {wait}");
    let later = now + ms(1000);
    t.settle(later);
    let l = t.load(w, later);
    assert_eq!(
        (l.pending_prefill_tokens, l.awaiting_first),
        (0, 0),
        "past every predicted first token"
    );
    assert_eq!(l.expected_wait, Some(Duration::ZERO));
    assert_eq!(l.booked, 6, "still decoding");
    // Errors are counted against whole answers' durations, not as first tokens.
    assert_eq!(l.latency.errors.ttft.count, 0);
    assert!(l.latency.errors.e2e.count >= 1);
}

/// A whole answer's first token is inferred from its duration less its tokens at the
/// predicted time per token; when the tokens' real pace varies about the prediction the
/// inferred first token is as often before its booking as it is late, and the model
/// keeps both: it learns the prefill, not the positive half of the decode's noise.
#[test]
fn a_whole_answers_first_token_inferred_from_a_noisy_decode_is_learned_unbiased() {
    let t0 = Instant::now();
    let mut t = LoadTracker::default();
    let w = InstanceId(1);
    let mut now = t0;
    for i in 0..40u64 {
        t.report(w, itl_20ms(100 * i), now);
        // A 1,000-token prompt prefilled in 100 ms, then 149 tokens at 15 or 25 ms.
        let tpot = if i % 2 == 0 { 15 } else { 25 };
        t.book(RequestId(i), w, &b(&[i]), 1000, now, Watch::WholeAnswer);
        t.complete(RequestId(i), now + ms(100 + 149 * tpot), Some(150));
        now += Duration::from_secs(4);
    }
    let ttft = t
        .predict(w, 1000, now)
        .ttft
        .expect("inferred")
        .as_secs_f64();
    // Dropping the early ones would learn the late ones' 845 ms.
    assert!((ttft - 0.1).abs() < 0.03, "{ttft}");
}

/// A split request: the prefill worker learns from its leg's answer (its prefill), and
/// the decode worker's first token counts from that handoff, not from the booking, so
/// each learns its own part.
#[test]
fn each_leg_of_a_split_teaches_its_own_worker() {
    let t0 = Instant::now();
    let mut t = LoadTracker::default();
    let (p, d) = (InstanceId(1), InstanceId(2));
    for i in 0..10u64 {
        let at = t0 + Duration::from_secs(10 * i);
        let (leg, req) = (RequestId(100 + i), RequestId(i));
        t.book(leg, p, &b(&[i]), 2000 + 100 * i, at, Watch::FirstToken);
        t.book(req, d, &b(&[i]), 16, at, Watch::FirstToken);
        t.link(leg, req);
        let handoff = at + ms(900 + 10 * i);
        assert!(t.prefill_done(leg, handoff));
        t.finish(leg);
        assert!(t.prefill_done(req, handoff + ms(40)));
        t.complete(req, handoff + ms(40 + 99 * 15), Some(100));
    }
    let later = t0 + Duration::from_secs(100);
    assert_eq!(t.load(p, later).latency.samples, (10, 0));
    assert_eq!(t.load(d, later).latency.samples, (10, 10));
    let on_decode = t.predict(d, 16, later).ttft.unwrap();
    assert_eq!(on_decode.as_millis(), 40, "from the handoff: {on_decode:?}");
    let on_prefill = t.predict(p, 2500, later).ttft.unwrap();
    assert_eq!(on_prefill.as_millis(), 950, "{on_prefill:?}");
    assert_eq!(t.predict(d, 0, later).tpot.unwrap().as_millis(), 15);
    // A decode leg whose prefill leg never answers learns nothing of its first token.
    t.book(RequestId(200), p, &[], 100, later, Watch::FirstToken);
    t.book(RequestId(201), d, &[], 16, later, Watch::FirstToken);
    t.link(RequestId(200), RequestId(201));
    t.finish(RequestId(200));
    assert!(t.prefill_done(RequestId(201), later + ms(5000)));
    assert_eq!(t.load(d, later).latency.samples.0, 10);
}

/// Every whole answer predicted to take longer than the bound is released at the
/// bound, and entries of requests that ended are dropped from the schedule: it stays
/// the size of the requests in flight, however many come and go.
#[test]
fn the_schedule_of_predicted_first_tokens_stays_bounded() {
    let t0 = Instant::now();
    let mut t = LoadTracker::default();
    let w = InstanceId(1);
    // A worker taking ten minutes a prompt.
    let minutes = |n: u64| t0 + Duration::from_secs(600 * n);
    for i in 0..10u64 {
        t.book(RequestId(i), w, &[], 100, minutes(i), Watch::FirstToken);
        t.prefill_done(RequestId(i), minutes(i + 1));
        t.finish(RequestId(i));
    }
    for i in 0..10_000u64 {
        t.book(RequestId(100 + i), w, &[], 100, t0, Watch::WholeAnswer);
        t.finish(RequestId(100 + i));
    }
    assert!(t.due.len() <= 64, "{} entries", t.due.len());
    t.book(RequestId(1), w, &[], 100, t0, Watch::WholeAnswer);
    t.settle(t0 + MAX_DUE - ms(1));
    assert_eq!(t.load(w, t0).awaiting_first, 1);
    t.settle(t0 + MAX_DUE);
    assert_eq!(t.load(w, t0).awaiting_first, 0);
}

#[test]
fn shared_prefixes_count_once_and_prefill_clears_at_first_token() {
    let now = Instant::now();
    let mut t = LoadTracker::default();
    t.book(
        RequestId(1),
        InstanceId(7),
        &b(&[1, 2, 3]),
        48,
        now,
        Watch::FirstToken,
    );
    t.book(
        RequestId(2),
        InstanceId(7),
        &b(&[1, 2, 4]),
        16,
        now,
        Watch::FirstToken,
    );
    let l = t.load(InstanceId(7), now);
    assert_eq!(
        (l.active_blocks, l.pending_prefill_tokens, l.in_flight),
        (4, 64, 2)
    );
    t.prefill_done(RequestId(1), now);
    assert_eq!(t.load(InstanceId(7), now).pending_prefill_tokens, 16);
    t.finish(RequestId(1));
    let l = t.load(InstanceId(7), now);
    assert_eq!(
        (l.active_blocks, l.pending_prefill_tokens, l.in_flight),
        (3, 16, 1)
    );
    assert!(!t.finish(RequestId(1)), "double release is a no-op");
}

#[test]
fn the_engine_queue_is_estimated_from_the_batch_it_was_seen_running() {
    let now = Instant::now();
    let w = InstanceId(7);
    let mut t = LoadTracker::default();
    let report = |running, waiting| ReportedLoad {
        kv_used_blocks: 10,
        kv_total_blocks: 100,
        running,
        waiting,
        latency: None,
    };
    // Never seen queueing: nothing is estimated to wait, however many are booked.
    t.report(w, report(3, 0), now);
    for i in 0..10 {
        t.book(RequestId(i), w, &[], 0, now, Watch::FirstToken);
    }
    assert_eq!(t.load(w, now).queued, 0);
    // A queue beside 8 running: 8 is the batch; 8 + 2 + 10 booked since = 12 wait.
    t.report(w, report(8, 2), now);
    assert_eq!(t.load(w, now).queued, 2);
    t.book(RequestId(10), w, &[], 0, now, Watch::FirstToken);
    assert_eq!(t.load(w, now).queued, 3, "a booking since the report waits");
    for i in 0..5 {
        t.finish(RequestId(i));
    }
    assert_eq!(t.load(w, now).queued, 0, "requests ending free the queue");
    // The batch is kept while the queue empties, and raised by a larger one.
    t.report(w, report(6, 0), now);
    assert_eq!(t.load(w, now).queued, 0);
    t.report(w, report(12, 0), now);
    for i in 20..30 {
        t.book(RequestId(i), w, &[], 0, now, Watch::FirstToken);
    }
    assert_eq!(
        t.load(w, now).queued,
        10,
        "12 + 10 in flight over a batch of 12"
    );
    // A stale report estimates nothing (the router's bookings alone say no queue).
    let later = now + REPORT_TTL + Duration::from_secs(1);
    assert_eq!(t.load(w, later).queued, 0);
}

#[test]
fn a_full_batch_is_a_queue_beside_as_many_in_flight_as_the_engine_ever_ran() {
    let now = Instant::now();
    let w = InstanceId(7);
    let mut t = LoadTracker::default();
    // Its batch filling up, and at its peak: everything in flight runs.
    t.report(w, report(2, 0), now);
    assert!(!t.load(w, now).batch_full);
    t.report(w, report(8, 0), now);
    for i in 0..4 {
        t.book(RequestId(i), w, &[], 0, now, Watch::WholeAnswer);
    }
    assert!(
        !t.load(w, now).batch_full,
        "no queue: the engine has not refused one"
    );
    // The engine queues beside the most it ever ran: full.
    t.report(w, report(8, 3), now);
    assert!(t.load(w, now).batch_full);
    // Requests end (booked before the report): a slot frees once fewer than 8 remain.
    t.finish(RequestId(0));
    t.finish(RequestId(1));
    t.finish(RequestId(2));
    assert!(t.load(w, now).batch_full, "8 in flight");
    t.finish(RequestId(3));
    assert!(!t.load(w, now).batch_full, "7 in flight, a slot free");
    // A queue beside fewer than the peak (a long prompt holding the step's token
    // budget, slots free) is not a full batch; beside as many in flight, it is.
    t.report(w, report(5, 2), now);
    assert!(!t.load(w, now).batch_full);
    t.book(RequestId(9), w, &[], 0, now, Watch::FirstToken);
    assert!(t.load(w, now).batch_full);
    // A stale report says nothing; an engine that reports nothing is never full.
    t.report(w, report(8, 3), now);
    assert!(!t.load(w, now + REPORT_TTL + ms(1)).batch_full);
    let mut silent = LoadTracker::default();
    for i in 0..100 {
        silent.book(RequestId(i), w, &[], 0, now, Watch::WholeAnswer);
    }
    assert!(!silent.load(w, now).batch_full);
}

#[test]
fn booked_blocks_extend_a_cached_prefix() {
    let now = Instant::now();
    let mut t = LoadTracker::default();
    t.book(
        RequestId(1),
        InstanceId(7),
        &b(&[1, 2, 3]),
        48,
        now,
        Watch::FirstToken,
    );
    let prompt = b(&[1, 2, 3, 9]);
    assert_eq!(t.extend_overlap(InstanceId(7), &prompt, 0), 3);
    assert_eq!(t.extend_overlap(InstanceId(7), &prompt, 1), 3);
    assert_eq!(
        t.extend_overlap(InstanceId(8), &prompt, 2),
        2,
        "another worker"
    );
    t.finish(RequestId(1));
    assert_eq!(t.extend_overlap(InstanceId(7), &prompt, 0), 0, "released");
}

#[test]
fn a_hard_expiry_frees_what_was_left_behind() {
    let now = Instant::now();
    let mut t = LoadTracker::default();
    t.book(
        RequestId(1),
        InstanceId(1),
        &b(&[1]),
        10,
        now,
        Watch::FirstToken,
    );
    t.book(
        RequestId(2),
        InstanceId(1),
        &b(&[2]),
        10,
        now + Duration::from_secs(50),
        Watch::FirstToken,
    );
    assert_eq!(
        t.expire(now + Duration::from_secs(61), Duration::from_secs(60)),
        1
    );
    assert_eq!(t.load(InstanceId(1), now).in_flight, 1);
}

/// An 18-minute reasoning stream under a 10-minute expiry: touched by its relay, it
/// keeps its booking; one that stops showing life is released 10 minutes later.
#[test]
fn a_stream_that_keeps_relaying_outlives_the_hard_expiry() {
    let mut t = LoadTracker::default();
    let now = Instant::now();
    let max_age = Duration::from_secs(600);
    t.book(
        RequestId(1),
        InstanceId(1),
        &b(&[1, 2]),
        10,
        now,
        Watch::FirstToken,
    );
    t.book(
        RequestId(2),
        InstanceId(1),
        &b(&[3]),
        10,
        now,
        Watch::FirstToken,
    );
    for minute in 1..=18u64 {
        let at = now + Duration::from_secs(60 * minute);
        t.touch(RequestId(1), at);
        assert_eq!(
            t.expire(at, max_age),
            usize::from(minute == 11),
            "minute {minute}"
        );
    }
    assert_eq!(t.in_flight(), 1, "the live stream was released");
    let silent = now + Duration::from_secs(60 * 18 + 601);
    assert_eq!(t.expire(silent, max_age), 1);
    assert_eq!(t.in_flight(), 0);
}

#[test]
fn sweeps_run_at_most_once_a_second() {
    let now = Instant::now();
    let max_age = Duration::from_secs(60);
    let mut t = LoadTracker::default();
    t.book(
        RequestId(1),
        InstanceId(1),
        &b(&[1]),
        10,
        now,
        Watch::FirstToken,
    );
    assert_eq!(
        t.maybe_expire(now + Duration::from_millis(59_500), max_age),
        0
    );
    // Past its age, but within a second of the last sweep: left for the next one.
    assert_eq!(
        t.maybe_expire(now + Duration::from_millis(60_200), max_age),
        0
    );
    assert_eq!(t.in_flight(), 1);
    assert_eq!(
        t.maybe_expire(now + Duration::from_millis(60_600), max_age),
        1
    );
    assert_eq!(t.in_flight(), 0);
}

fn report(running: u32, waiting: u32) -> ReportedLoad {
    ReportedLoad {
        running,
        waiting,
        ..ReportedLoad::default()
    }
}

#[test]
fn replicas_reading_the_same_report_agree_within_their_own_requests() {
    let now = Instant::now();
    let w = InstanceId(7);
    let (mut a, mut b) = (LoadTracker::default(), LoadTracker::default());
    for r in 1..=3 {
        a.book(RequestId(r), w, &[], 0, now, Watch::FirstToken);
    }
    for r in 1..=2 {
        b.book(RequestId(r), w, &[], 0, now, Watch::FirstToken);
    }
    // Before any report each replica sees only its own requests.
    assert_eq!((a.load(w, now).in_flight, b.load(w, now).in_flight), (3, 2));
    // The engine counts both replicas' five requests and one from elsewhere.
    let later = now + Duration::from_millis(10);
    a.report(w, report(4, 2), later);
    b.report(w, report(4, 2), later);
    assert_eq!(
        (a.load(w, later).in_flight, b.load(w, later).in_flight),
        (6, 6)
    );
    // A request booked since the report counts on the replica that booked it only.
    a.book(RequestId(4), w, &[], 0, later, Watch::FirstToken);
    assert_eq!(
        (a.load(w, later).in_flight, b.load(w, later).in_flight),
        (7, 6)
    );
    // One that ended since the report no longer counts; one that started and ended
    // since it never did.
    b.finish(RequestId(1));
    a.finish(RequestId(4));
    assert_eq!(
        (a.load(w, later).in_flight, b.load(w, later).in_flight),
        (6, 5)
    );
    let l = a.load(w, later);
    assert_eq!((l.booked, l.reported.map(|r| r.running)), (3, Some(4)));
}

#[test]
fn a_report_never_hides_this_routers_own_requests_and_expires() {
    let now = Instant::now();
    let w = InstanceId(1);
    let mut t = LoadTracker::new(Duration::from_secs(3));
    for r in 1..=4 {
        t.book(RequestId(r), w, &[], 0, now, Watch::FirstToken);
    }
    // A scrape that left before these requests reached the worker says 0.
    t.report(w, report(0, 0), now);
    for r in 1..=4 {
        t.finish(RequestId(r));
        t.book(RequestId(10 + r), w, &[], 0, now, Watch::FirstToken);
    }
    assert_eq!(t.load(w, now).in_flight, 4, "at least this router's own");
    // A report of absurd size saturates instead of wrapping.
    t.report(w, report(u32::MAX, u32::MAX), now);
    assert_eq!(t.load(w, now).in_flight, u32::MAX);
    // A worker whose reports stop: after the lifetime, this router's own count.
    t.report(w, report(40, 0), now);
    assert_eq!(t.load(w, now + Duration::from_secs(3)).in_flight, 40);
    assert_eq!(t.load(w, now + Duration::from_secs(4)).in_flight, 4);
    t.forget_report(w);
    assert_eq!(t.load(w, now).in_flight, 4);
}

#[derive(Debug, Clone)]
enum Op {
    Book(u64, u64, Vec<u64>, u64, u8),
    Prefill(u64),
    Complete(u64, Option<u32>),
    Finish(u64),
    Settle,
    Report(u64, u32),
    Link(u64, u64),
}

const WATCHES: [Watch; 2] = [Watch::FirstToken, Watch::WholeAnswer];

proptest! {
    #[test]
    fn every_counter_returns_to_zero_once_all_requests_end(
        ops in proptest::collection::vec(prop_oneof![
            3 => (0u64..20, 0u64..4, proptest::collection::vec(0u64..10, 0..8), 0u64..500, 0u8..2)
                .prop_map(|(r, w, bl, t, k)| Op::Book(r, w, bl, t, k)),
            2 => (0u64..20).prop_map(Op::Prefill),
            2 => (0u64..20, proptest::option::of(0u32..300)).prop_map(|(r, n)| Op::Complete(r, n)),
            2 => (0u64..20).prop_map(Op::Finish),
            1 => Just(Op::Settle),
            1 => (0u64..20, 0u64..20).prop_map(|(a, b)| Op::Link(a, b)),
            1 => (0u64..4, 0u32..64).prop_map(|(w, n)| Op::Report(w, n)),
        ], 0..300)
    ) {
        let t0 = Instant::now();
        let mut now = t0;
        let mut t = LoadTracker::default();
        let mut itl = 0.0;
        for op in ops {
            now += Duration::from_millis(7);
            match op {
                Op::Book(r, w, bl, tok, k) => {
                    t.book(RequestId(r), InstanceId(w), &b(&bl), tok, now, WATCHES[usize::from(k)]);
                }
                Op::Prefill(r) => {
                    t.prefill_done(RequestId(r), now);
                }
                Op::Complete(r, n) => {
                    t.complete(RequestId(r), now, n);
                }
                Op::Finish(r) => {
                    t.finish(RequestId(r));
                }
                Op::Settle => t.settle(now),
                Op::Link(a, b) => t.link(RequestId(a), RequestId(b)),
                Op::Report(w, n) => {
                    itl += 0.01 * f64::from(n);
                    let load = ReportedLoad {
                        running: n,
                        latency: Some(EngineLatency { itl_sum: itl, itl_count: itl * 100.0 }),
                        ..ReportedLoad::default()
                    };
                    t.report(InstanceId(w), load, now);
                }
            }
            for w in 0..4 {
                let l = t.load(InstanceId(w), now);
                prop_assert!(l.awaiting_first <= l.booked);
                if let Some(wait) = l.expected_wait {
                    prop_assert!(wait.as_secs_f64().is_finite());
                }
            }
        }
        for r in 0..20 {
            t.finish(RequestId(r));
        }
        prop_assert_eq!(t.in_flight(), 0);
        for w in 0..4 {
            let l = t.load(InstanceId(w), now);
            prop_assert_eq!(
                (l.active_blocks, l.pending_prefill_tokens, l.booked, l.awaiting_first),
                (0, 0, 0, 0)
            );
        }
    }
}
