//! Load tracking per worker, from the router's own bookkeeping plus what workers report.
//!
//! A request is booked when routed: its prompt blocks count as the worker's active
//! blocks (a block shared by several in-flight requests counts once) and its uncached
//! prompt tokens as pending prefill. Its prefill is marked done at its first token, and
//! everything is released when it ends, fails or is cancelled — or, as a backstop, when
//! it is older than a hard expiry, so nothing can leak.
//!
//! Requests in flight agree across router replicas: a worker's report (its engine's
//! running + waiting requests) counts every replica's requests and other clients' too, so
//! the in-flight count a policy sees is that report plus this router's bookings since it
//! (requests booked since count +1, requests ended since count −1, so one that started
//! and ended in between counts 0), never less than this router's own bookings. Replicas
//! that read the same report differ only by their own requests since it: within one
//! report interval. A report older than its lifetime is ignored (the count falls back to
//! this router's own bookings), so a worker whose metrics stop cannot freeze its load.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::Keyed;
use switchyard_ids::{BlockHash, InstanceId, RequestId};

/// What a worker last reported about itself.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ReportedLoad {
    /// KV blocks in use.
    pub kv_used_blocks: u64,
    /// KV blocks in total.
    pub kv_total_blocks: u64,
    /// Requests running.
    pub running: u32,
    /// Requests queued.
    pub waiting: u32,
}

impl ReportedLoad {
    /// KV usage in [0, 1], if the total is known.
    pub fn kv_usage(&self) -> Option<f32> {
        (self.kv_total_blocks > 0)
            .then(|| (self.kv_used_blocks as f64 / self.kv_total_blocks as f64).min(1.0) as f32)
    }
}

/// One worker's load as the policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct WorkerLoad {
    /// Distinct blocks of in-flight requests.
    pub active_blocks: u32,
    /// Prompt tokens routed and not yet prefilled.
    pub pending_prefill_tokens: u64,
    /// Requests in flight on the worker: its fresh report plus this router's bookings
    /// since, or this router's bookings alone (see the module's documentation).
    pub in_flight: u32,
    /// Requests this router has in flight on the worker.
    pub booked: u32,
    /// The worker's own report, if any (fresh or not).
    pub reported: Option<ReportedLoad>,
    /// Requests waiting in the worker's engine queue, estimated: with a fresh report,
    /// those in flight beyond the most the engine has been seen running while it had a
    /// queue (its batch limit, `max_num_seqs` or its KV cache), at least the reported
    /// queue plus this router's bookings since it when the queue was not empty; 0 while
    /// the engine has never been seen queueing; without a fresh report, 0.
    pub queued: u32,
    /// The worker's prefill rate as this router measured it (uncached prompt tokens a
    /// second of busy time, see [`PrefillRate`]), once measured.
    pub prefill_rate: Option<f64>,
}

impl WorkerLoad {
    /// How long a request sent now would wait for the prefill already routed to the
    /// worker: its pending prefill at its measured rate (unknown until measured).
    pub fn prefill_wait(&self) -> Option<Duration> {
        let rate = self.prefill_rate?;
        Duration::try_from_secs_f64(self.pending_prefill_tokens as f64 / rate).ok()
    }
}

/// A worker's prefill rate, measured from its first tokens: each first token closes an
/// interval that began at the later of the request's booking and the worker's previous
/// first token, during which the worker had this request's prompt to prefill. Those
/// intervals tile the time the worker had prefill pending, so tokens over their sum is
/// the rate it served prompts at while busy, decode steps and engine queueing included
/// (what a request waiting behind them sees). Recent intervals weigh most (each one
/// discounts the past by 1/16).
#[derive(Debug, Default, Clone, Copy)]
struct PrefillRate {
    tokens: f64,
    secs: f64,
    last_first_token: Option<Instant>,
}

/// Tokens the rate must have seen before it counts: a few prompts, not one request's
/// overhead.
const RATE_MIN_TOKENS: f64 = 1024.0;

impl PrefillRate {
    fn sample(&mut self, tokens: u64, booked_at: Instant, now: Instant) {
        let from = self
            .last_first_token
            .map_or(booked_at, |t| t.max(booked_at));
        self.last_first_token = Some(now);
        if tokens == 0 {
            return;
        }
        let dt = now.saturating_duration_since(from).as_secs_f64();
        self.tokens = self.tokens * (15.0 / 16.0) + tokens as f64;
        self.secs = self.secs * (15.0 / 16.0) + dt;
    }

    fn rate(&self) -> Option<f64> {
        (self.tokens >= RATE_MIN_TOKENS && self.secs > 0.0).then(|| self.tokens / self.secs)
    }
}

#[derive(Debug, Default)]
struct Worker {
    /// Block → number of in-flight requests using it.
    blocks: HashMap<BlockHash, u32, Keyed>,
    pending_prefill_tokens: u64,
    in_flight: u32,
    /// The worker's last report and when it arrived.
    reported: Option<(ReportedLoad, Instant)>,
    /// Bookings made minus bookings released since `reported` arrived.
    since_report: i64,
    /// The most requests the engine was seen running while others waited: its batch
    /// limit as it shows (see [`WorkerLoad::queued`]).
    batch: Option<u32>,
    prefill_rate: PrefillRate,
}

impl Worker {
    /// Requests in flight on the worker as a whole (see the module's documentation).
    fn in_flight(&self, now: Instant, report_ttl: Duration) -> u32 {
        match self.reported {
            Some((r, at)) if now.saturating_duration_since(at) <= report_ttl => {
                let seen = i64::from(r.running) + i64::from(r.waiting) + self.since_report;
                seen.clamp(i64::from(self.in_flight), i64::from(u32::MAX)) as u32
            }
            _ => self.in_flight,
        }
    }

    /// The engine's queue, estimated (see [`WorkerLoad::queued`]).
    fn queued(&self, now: Instant, report_ttl: Duration) -> u32 {
        let Some((r, at)) = self.reported else {
            return 0;
        };
        if now.saturating_duration_since(at) > report_ttl {
            return 0;
        }
        let beyond = self
            .batch
            .map_or(0, |b| self.in_flight(now, report_ttl).saturating_sub(b));
        let since = if r.waiting > 0 {
            (i64::from(r.waiting) + self.since_report).clamp(0, i64::from(u32::MAX)) as u32
        } else {
            0
        };
        beyond.max(since)
    }
}

#[derive(Debug)]
struct Booking {
    worker: InstanceId,
    blocks: Vec<BlockHash>,
    /// Uncached prompt tokens still counted as pending prefill (0 once done).
    pending: u64,
    /// When it was booked or last showed life ([`LoadTracker::touch`]): the hard expiry
    /// counts from here, so a stream that is still relaying is never taken for a leak.
    seen_at: Instant,
    booked_at: Instant,
}

/// How long a worker's report counts by default.
pub const REPORT_TTL: Duration = Duration::from_secs(5);

/// Per-worker load. Pure; the caller serialises access.
#[derive(Debug)]
pub struct LoadTracker {
    workers: HashMap<InstanceId, Worker>,
    requests: HashMap<RequestId, Booking>,
    /// When [`LoadTracker::maybe_expire`] sweeps next.
    next_sweep: Option<Instant>,
    /// How long a report counts towards the in-flight count.
    report_ttl: Duration,
}

impl Default for LoadTracker {
    fn default() -> LoadTracker {
        LoadTracker::new(REPORT_TTL)
    }
}

impl LoadTracker {
    /// No load; workers' reports count for `report_ttl` after they arrive.
    pub fn new(report_ttl: Duration) -> LoadTracker {
        LoadTracker {
            workers: HashMap::new(),
            requests: HashMap::new(),
            next_sweep: None,
            report_ttl,
        }
    }

    /// Books a request routed to `worker`. Booking the same request twice replaces the
    /// first booking.
    pub fn book(
        &mut self,
        req: RequestId,
        worker: InstanceId,
        blocks: &[BlockHash],
        uncached_tokens: u64,
        now: Instant,
    ) {
        self.finish(req);
        let w = self.workers.entry(worker).or_default();
        for &b in blocks {
            *w.blocks.entry(b).or_insert(0) += 1;
        }
        w.pending_prefill_tokens += uncached_tokens;
        w.in_flight += 1;
        w.since_report += 1;
        self.requests.insert(
            req,
            Booking {
                worker,
                blocks: blocks.to_vec(),
                pending: uncached_tokens,
                seen_at: now,
                booked_at: now,
            },
        );
    }

    /// The request's first token arrived at `now`: its prompt is no longer pending
    /// prefill, and the worker's prefill rate learns from it. Returns whether it was
    /// pending.
    pub fn prefill_done(&mut self, req: RequestId, now: Instant) -> bool {
        let Some(b) = self.requests.get_mut(&req) else {
            return false;
        };
        let pending = std::mem::take(&mut b.pending);
        if let Some(w) = self.workers.get_mut(&b.worker) {
            w.pending_prefill_tokens -= pending;
            w.prefill_rate.sample(pending, b.booked_at, now);
        }
        pending > 0
    }

    /// The request ended, failed or was cancelled: release everything it holds.
    /// Returns false if it was not booked (already released).
    pub fn finish(&mut self, req: RequestId) -> bool {
        let Some(b) = self.requests.remove(&req) else {
            return false;
        };
        if let Some(w) = self.workers.get_mut(&b.worker) {
            for block in &b.blocks {
                if let Some(n) = w.blocks.get_mut(block) {
                    *n -= 1;
                    if *n == 0 {
                        w.blocks.remove(block);
                    }
                }
            }
            w.pending_prefill_tokens -= b.pending;
            w.in_flight -= 1;
            w.since_report -= 1;
        }
        true
    }

    /// The request is still alive at `now` (its response is relaying).
    pub fn touch(&mut self, req: RequestId, now: Instant) {
        if let Some(b) = self.requests.get_mut(&req) {
            b.seen_at = b.seen_at.max(now);
        }
    }

    /// Releases every request that showed no life for more than `max_age` before `now`;
    /// returns how many.
    pub fn expire(&mut self, now: Instant, max_age: Duration) -> usize {
        let old: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, b)| now.saturating_duration_since(b.seen_at) > max_age)
            .map(|(id, _)| *id)
            .collect();
        for id in &old {
            self.finish(*id);
        }
        old.len()
    }

    /// [`LoadTracker::expire`], at most once per second: a sweep looks at every booked
    /// request, too much work for every routing decision.
    pub fn maybe_expire(&mut self, now: Instant, max_age: Duration) -> usize {
        if self.next_sweep.is_some_and(|next| now < next) {
            return 0;
        }
        self.next_sweep = Some(now + Duration::from_secs(1));
        self.expire(now, max_age)
    }

    /// Records what `worker` reported about itself at `now`.
    pub fn report(&mut self, worker: InstanceId, load: ReportedLoad, now: Instant) {
        let w = self.workers.entry(worker).or_default();
        w.reported = Some((load, now));
        w.since_report = 0;
        // A queue beside a running batch shows the batch's limit; a larger batch later
        // (more memory free, shorter requests) raises it.
        if load.running > 0 && (load.waiting > 0 || w.batch.is_some_and(|b| load.running > b)) {
            w.batch = Some(if load.waiting > 0 {
                load.running
            } else {
                load.running.max(w.batch.unwrap_or(0))
            });
        }
    }

    /// Forgets `worker`'s report (its bookings stay until their requests end).
    pub fn forget_report(&mut self, worker: InstanceId) {
        if let Some(w) = self.workers.get_mut(&worker) {
            w.reported = None;
        }
    }

    /// `worker`'s load at `now`.
    pub fn load(&self, worker: InstanceId, now: Instant) -> WorkerLoad {
        self.workers
            .get(&worker)
            .map_or_else(WorkerLoad::default, |w| WorkerLoad {
                active_blocks: w.blocks.len() as u32,
                pending_prefill_tokens: w.pending_prefill_tokens,
                in_flight: w.in_flight(now, self.report_ttl),
                booked: w.in_flight,
                reported: w.reported.map(|(r, _)| r),
                queued: w.queued(now, self.report_ttl),
                prefill_rate: w.prefill_rate.rate(),
            })
    }

    /// How far `worker`'s in-flight requests extend a cached prefix of `hashes`: the
    /// leading blocks from `from` on that some booked request on `worker` also has. A
    /// request routed there is prefilled after them, so it finds these blocks cached even
    /// though no KV event has said so yet (a burst of requests sharing a new prefix).
    /// Hashes are chained, so a booked block at position `j` implies its whole prefix:
    /// one lookup per block past `from`.
    pub fn extend_overlap(&self, worker: InstanceId, hashes: &[BlockHash], from: u32) -> u32 {
        let Some(w) = self.workers.get(&worker) else {
            return from;
        };
        let mut n = from as usize;
        while n < hashes.len() && w.blocks.contains_key(&hashes[n]) {
            n += 1;
        }
        n as u32
    }

    /// Requests currently booked.
    pub fn in_flight(&self) -> usize {
        self.requests.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn b(v: &[u64]) -> Vec<BlockHash> {
        v.iter().map(|&x| BlockHash(x)).collect()
    }

    /// The rate is the tokens of the prompts served over the time the worker had one
    /// pending: requests queued together are served one after another, and a spell of
    /// idleness between them does not count.
    #[test]
    fn the_prefill_rate_is_learned_from_first_tokens_over_busy_time() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut t = LoadTracker::default();
        let w = InstanceId(3);
        for r in 1..=3 {
            t.book(RequestId(r), w, &b(&[r]), 1000, t0);
        }
        assert_eq!(t.load(w, t0).prefill_wait(), None, "not measured yet");
        t.prefill_done(RequestId(1), t0 + s(1));
        t.prefill_done(RequestId(2), t0 + s(2));
        let l = t.load(w, t0 + s(2));
        let rate = l.prefill_rate.expect("2,000 tokens seen");
        assert!((rate - 1000.0).abs() < 1.0, "{rate}");
        assert_eq!(
            l.prefill_wait(),
            Some(s(1)),
            "1,000 tokens left at 1,000 a second"
        );
        t.prefill_done(RequestId(3), t0 + s(3));
        for r in 1..=3 {
            t.finish(RequestId(r));
        }
        // Idle for a minute, then one prompt served in half a second.
        t.book(RequestId(4), w, &b(&[4]), 500, t0 + s(60));
        t.prefill_done(RequestId(4), t0 + s(60) + Duration::from_millis(500));
        let rate = t.load(w, t0 + s(61)).prefill_rate.unwrap();
        assert!(
            (rate - 1000.0).abs() < 1.0,
            "idle time is not counted: {rate}"
        );
        assert_eq!(t.load(w, t0 + s(61)).prefill_wait(), Some(Duration::ZERO));
    }

    #[test]
    fn shared_prefixes_count_once_and_prefill_clears_at_first_token() {
        let now = Instant::now();
        let mut t = LoadTracker::default();
        t.book(RequestId(1), InstanceId(7), &b(&[1, 2, 3]), 48, now);
        t.book(RequestId(2), InstanceId(7), &b(&[1, 2, 4]), 16, now);
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
        };
        // Never seen queueing: nothing is estimated to wait, however many are booked.
        t.report(w, report(3, 0), now);
        for i in 0..10 {
            t.book(RequestId(i), w, &[], 0, now);
        }
        assert_eq!(t.load(w, now).queued, 0);
        // A queue beside 8 running: 8 is the batch; 8 + 2 + 10 booked since = 12 wait.
        t.report(w, report(8, 2), now);
        assert_eq!(t.load(w, now).queued, 2);
        t.book(RequestId(10), w, &[], 0, now);
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
            t.book(RequestId(i), w, &[], 0, now);
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
    fn booked_blocks_extend_a_cached_prefix() {
        let now = Instant::now();
        let mut t = LoadTracker::default();
        t.book(RequestId(1), InstanceId(7), &b(&[1, 2, 3]), 48, now);
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
        t.book(RequestId(1), InstanceId(1), &b(&[1]), 10, now);
        t.book(
            RequestId(2),
            InstanceId(1),
            &b(&[2]),
            10,
            now + Duration::from_secs(50),
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
        t.book(RequestId(1), InstanceId(1), &b(&[1, 2]), 10, now);
        t.book(RequestId(2), InstanceId(1), &b(&[3]), 10, now);
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
        t.book(RequestId(1), InstanceId(1), &b(&[1]), 10, now);
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
            a.book(RequestId(r), w, &[], 0, now);
        }
        for r in 1..=2 {
            b.book(RequestId(r), w, &[], 0, now);
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
        a.book(RequestId(4), w, &[], 0, later);
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
            t.book(RequestId(r), w, &[], 0, now);
        }
        // A scrape that left before these requests reached the worker says 0.
        t.report(w, report(0, 0), now);
        for r in 1..=4 {
            t.finish(RequestId(r));
            t.book(RequestId(10 + r), w, &[], 0, now);
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
        Book(u64, u64, Vec<u64>, u64),
        Prefill(u64),
        Finish(u64),
    }

    proptest! {
        #[test]
        fn every_counter_returns_to_zero_once_all_requests_end(
            ops in proptest::collection::vec(prop_oneof![
                3 => (0u64..20, 0u64..4, proptest::collection::vec(0u64..10, 0..8), 0u64..500)
                    .prop_map(|(r, w, bl, t)| Op::Book(r, w, bl, t)),
                2 => (0u64..20).prop_map(Op::Prefill),
                2 => (0u64..20).prop_map(Op::Finish),
            ], 0..200)
        ) {
            let now = Instant::now();
            let mut t = LoadTracker::default();
            for op in ops {
                match op {
                    Op::Book(r, w, bl, tok) => t.book(RequestId(r), InstanceId(w), &b(&bl), tok, now),
                    Op::Prefill(r) => {
                        t.prefill_done(RequestId(r), now);
                    }
                    Op::Finish(r) => { t.finish(RequestId(r)); }
                }
            }
            for r in 0..20 {
                t.finish(RequestId(r));
            }
            prop_assert_eq!(t.in_flight(), 0);
            for w in 0..4 {
                prop_assert_eq!(t.load(InstanceId(w), now), WorkerLoad::default());
            }
        }
    }
}
