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
//!
//! Each worker has a [`LatencyModel`] learned from what its requests show: a request
//! whose first token the router sees teaches the time to first token when it comes and
//! the time per output token when it ends; a whole (non-streamed) answer shows no first
//! token, so its prompt counts as pending until its *predicted* first token, and when it
//! ends its first token is inferred from its duration and tokens (see [`Watch`]).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::Keyed;
use super::latency::{Beside, EngineLatency, Errors, Features, LatencyModel, Prediction};
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
    /// The engine's latency counters, where its report has them.
    pub latency: Option<EngineLatency>,
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
    /// With a fresh report: the engine queues requests (it reported some waiting) while
    /// as many are in flight on it (its report and this router's requests since) as it
    /// was ever seen running, its batch limit once reached: a request sent now would
    /// wait there for a slot. A queue beside fewer is one a long prompt's token budget
    /// makes, with slots free. The engine's own queue gates it, so the router's holds
    /// never cap the peak it learns; an engine restarted with a smaller batch shows
    /// full later than it is (its old peak stays): it errs towards not holding.
    pub batch_full: bool,
    /// This router's requests on the worker still awaiting their first token (seen, or
    /// for whole answers predicted).
    pub awaiting_first: u32,
    /// How long the requests ahead would keep a request sent now from its own prefill,
    /// by the worker's latency model (unknown until the model is).
    pub expected_wait: Option<Duration>,
    /// The worker's latency model, summed up.
    pub latency: LatencySummary,
}

impl WorkerLoad {
    /// The worker's prefill rate, uncached prompt tokens a second, once measured.
    pub fn prefill_rate(&self) -> Option<f64> {
        let (_, per_token) = self.latency.ttft?;
        (per_token > 0.0).then(|| 1.0 / per_token)
    }
}

/// A worker's latency model, for views and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LatencySummary {
    /// Time to first token: seconds per request ahead (its own included), seconds per
    /// uncached token ahead (its own included).
    pub ttft: Option<(f64, f64)>,
    /// Time per output token: seconds per step, seconds per request in flight, seconds
    /// per uncached prompt token pending.
    pub tpot: Option<(f64, f64, f64)>,
    /// Samples each fit has taken (TTFT, TPOT).
    pub samples: (u64, u64),
    /// Output tokens per answer, recently.
    pub output_tokens: Option<f64>,
    /// Prediction errors.
    pub errors: Errors,
}

impl LatencySummary {
    fn of(m: &LatencyModel) -> LatencySummary {
        LatencySummary {
            ttft: m.ttft_coefficients(),
            tpot: m.tpot_coefficients(),
            samples: m.samples(),
            output_tokens: m.expected_output(),
            errors: m.errors(),
        }
    }
}

/// How the router sees a request's answer, which says what it can learn from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Watch {
    /// Its first token (a stream's first chunk, a prefill leg's answer) and its end: it
    /// teaches the time to first token and, with its output tokens, the time per token.
    FirstToken,
    /// Only the whole answer: its prompt counts as pending until its predicted first
    /// token; at its end, with its output tokens, its first token is inferred (its
    /// duration less its later tokens at the predicted time per token).
    WholeAnswer,
}

/// A split request's legs: the decode leg's time to first token counts from its prefill
/// leg's answer (the handoff), so that each worker learns its own part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Handoff {
    /// Not split, or handed off: its clock runs from its booking (or the handoff).
    None,
    /// A prefill leg: its answer starts this decode leg's clock.
    Leads(RequestId),
    /// A decode leg before the handoff: no clock yet (it teaches no time to first token
    /// if its first token somehow comes first).
    Awaits,
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
    /// The most requests the engine was ever seen running: its batch limit
    /// (`max_num_seqs`, or what its KV cache holds) once it has been reached.
    peak_running: u32,
    /// Requests booked whose first token has not come (or, for whole answers, is not
    /// yet predicted to have come).
    awaiting: u32,
    model: LatencyModel,
    /// The last [`RECENT`] predictions beside what happened.
    recent: VecDeque<Compared>,
}

impl Worker {
    /// Keeps a prediction beside what happened, forgetting the oldest past [`RECENT`].
    fn compared(
        &mut self,
        of: &'static str,
        b: &Booking,
        predicted: Option<Duration>,
        observed: Duration,
    ) {
        if self.recent.len() >= RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(Compared {
            of,
            features: b.features,
            predicted,
            observed,
        });
    }

    /// What a decode on the worker runs beside now.
    fn beside(&self, now: Instant, report_ttl: Duration) -> Beside {
        Beside {
            in_flight: f64::from(self.in_flight(now, report_ttl)),
            pending_tokens: self.pending_prefill_tokens as f64,
        }
    }

    /// What a request with `uncached` prompt tokens sent now would find ahead of it.
    fn features(&self, uncached: u64, now: Instant, report_ttl: Duration) -> Features {
        Features {
            ahead_requests: self.awaiting,
            ahead_tokens: self.pending_prefill_tokens,
            uncached,
            in_flight: self.in_flight(now, report_ttl).saturating_add(1),
        }
    }

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

    /// Whether the engine's batch is full (see [`WorkerLoad::batch_full`]).
    fn batch_full(&self, now: Instant, report_ttl: Duration) -> bool {
        let queueing = |(r, at): (ReportedLoad, Instant)| {
            r.waiting > 0 && now.saturating_duration_since(at) <= report_ttl
        };
        self.reported.is_some_and(queueing)
            && self.peak_running > 0
            && self.in_flight(now, report_ttl) >= self.peak_running
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
    watch: Watch,
    /// What was ahead of it when booked, and what was predicted from it.
    features: Features,
    predicted: Prediction,
    /// Whether its first token is still to come (see [`Worker::awaiting`]).
    awaiting: bool,
    /// Its first token, seen, and what its decode began beside.
    first: Option<(Instant, Beside)>,
    handoff: Handoff,
}

/// Longest a whole answer's prompt counts as pending after its booking when its first
/// token is predicted later still: past it the prediction is taken to be wrong.
const MAX_DUE: Duration = Duration::from_secs(60);

/// Predictions each worker keeps beside what happened, for its view.
pub const RECENT: usize = 16;

/// A prediction beside what happened.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Compared {
    /// What was predicted: `ttft` (a first token seen), `tpot` (a stream's time per
    /// token), `e2e` (a whole answer's duration).
    pub of: &'static str,
    /// What the router knew of the worker when it booked the request.
    pub features: Features,
    /// The prediction then (`None`: unknown).
    pub predicted: Option<Duration>,
    /// What happened.
    pub observed: Duration,
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
    /// Whole answers' predicted first tokens, soonest first (entries of requests that
    /// ended meanwhile are skipped when they come up; the heap is rebuilt when they
    /// outnumber the live bookings).
    due: BinaryHeap<Reverse<(Instant, RequestId)>>,
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
            due: BinaryHeap::new(),
        }
    }

    /// Books a request routed to `worker`, whose answer the router watches as `watch`.
    /// Booking the same request twice replaces the first booking. Returns what the
    /// worker's model predicts for it.
    pub fn book(
        &mut self,
        req: RequestId,
        worker: InstanceId,
        blocks: &[BlockHash],
        uncached_tokens: u64,
        now: Instant,
        watch: Watch,
    ) -> Prediction {
        self.finish(req);
        self.settle(now);
        let report_ttl = self.report_ttl;
        let w = self.workers.entry(worker).or_default();
        let features = w.features(uncached_tokens, now, report_ttl);
        let predicted = w.model.predict(features);
        for &b in blocks {
            *w.blocks.entry(b).or_insert(0) += 1;
        }
        w.pending_prefill_tokens += uncached_tokens;
        w.in_flight += 1;
        w.since_report += 1;
        w.awaiting += 1;
        self.schedule(req, watch, predicted, now);
        self.requests.insert(
            req,
            Booking {
                worker,
                blocks: blocks.to_vec(),
                pending: uncached_tokens,
                seen_at: now,
                booked_at: now,
                watch,
                features,
                predicted,
                awaiting: true,
                first: None,
                handoff: Handoff::None,
            },
        );
        predicted
    }

    /// `decode` is the decode leg of the split whose prefill leg is `prefill` (both
    /// booked): its time to first token counts from the prefill leg's answer.
    pub fn link(&mut self, prefill: RequestId, decode: RequestId) {
        if !(self.requests.contains_key(&prefill) && self.requests.contains_key(&decode)) {
            return;
        }
        if let Some(p) = self.requests.get_mut(&prefill) {
            p.handoff = Handoff::Leads(decode);
        }
        if let Some(d) = self.requests.get_mut(&decode) {
            d.handoff = Handoff::Awaits;
        }
    }

    /// The prefill leg handed `decode` its prompt at `now`: its clock starts, from what
    /// is ahead of it on its worker now.
    fn hand_off(&mut self, decode: RequestId, now: Instant) {
        let report_ttl = self.report_ttl;
        let Some(d) = self.requests.get_mut(&decode) else {
            return;
        };
        if d.handoff != Handoff::Awaits || !d.awaiting {
            return;
        }
        d.handoff = Handoff::None;
        let Some(w) = self.workers.get(&d.worker) else {
            return;
        };
        // What is ahead of it: the worker's awaited requests and pending tokens but its own.
        let mut features = w.features(d.pending, now, report_ttl);
        features.ahead_requests = features.ahead_requests.saturating_sub(1);
        features.ahead_tokens = features.ahead_tokens.saturating_sub(d.pending);
        features.in_flight = features.in_flight.saturating_sub(1).max(1);
        d.features = features;
        d.predicted = w.model.predict(features);
        d.booked_at = now;
        let (watch, predicted) = (d.watch, d.predicted);
        self.schedule(decode, watch, predicted, now);
    }

    /// A whole answer's prompt stops counting as pending at its predicted first token
    /// (from `now`, within [`MAX_DUE`]); see [`LoadTracker::settle`].
    fn schedule(&mut self, req: RequestId, watch: Watch, predicted: Prediction, now: Instant) {
        if watch == Watch::WholeAnswer
            && let Some(ttft) = predicted.ttft
        {
            self.due.push(Reverse((now + ttft.min(MAX_DUE), req)));
        }
    }

    /// What `worker`'s model predicts for a request with `uncached_tokens` sent now.
    pub fn predict(&self, worker: InstanceId, uncached_tokens: u64, now: Instant) -> Prediction {
        self.workers
            .get(&worker)
            .map_or_else(Prediction::default, |w| {
                w.model
                    .predict(w.features(uncached_tokens, now, self.report_ttl))
            })
    }

    /// What `worker`'s model predicts for a request with `uncached_tokens` alone on it:
    /// nothing ahead, nothing else in flight.
    pub fn predict_alone(&self, worker: InstanceId, uncached_tokens: u64) -> Prediction {
        self.workers
            .get(&worker)
            .map_or_else(Prediction::default, |w| {
                w.model.predict(Features {
                    uncached: uncached_tokens,
                    in_flight: 1,
                    ..Features::default()
                })
            })
    }

    /// Whole answers whose predicted first token has come by `now`: their prompts are
    /// no longer pending. Cheap when nothing is due (a look at the heap's top).
    pub fn settle(&mut self, now: Instant) {
        while let Some(Reverse((at, req))) = self.due.peek().copied() {
            if at > now {
                break;
            }
            self.due.pop();
            if let Some(b) = self.requests.get_mut(&req)
                && b.watch == Watch::WholeAnswer
                && b.handoff != Handoff::Awaits
            {
                Self::first_token_came(&mut self.workers, b);
            }
        }
        if self.due.len() > 64 && self.due.len() > 4 * self.requests.len() {
            let requests = &self.requests;
            self.due.retain(|Reverse((_, r))| requests.contains_key(r));
        }
    }

    /// The booking's prompt is prefilled (or its request gone): no longer pending nor
    /// awaited.
    fn first_token_came(workers: &mut HashMap<InstanceId, Worker>, b: &mut Booking) {
        let pending = std::mem::take(&mut b.pending);
        let awaiting = std::mem::take(&mut b.awaiting);
        if let Some(w) = workers.get_mut(&b.worker) {
            w.pending_prefill_tokens -= pending;
            w.awaiting -= u32::from(awaiting);
        }
    }

    /// The request's first token arrived at `now`: its prompt is no longer pending, and
    /// the worker's model learns its time to first token. A whole answer's first byte is
    /// not its first token and changes nothing (see [`Watch`]). Returns whether it was
    /// awaited.
    pub fn prefill_done(&mut self, req: RequestId, now: Instant) -> bool {
        let report_ttl = self.report_ttl;
        let Some(b) = self.requests.get_mut(&req) else {
            return false;
        };
        if b.watch != Watch::FirstToken || !b.awaiting {
            return false;
        }
        Self::first_token_came(&mut self.workers, b);
        if let Some(w) = self.workers.get_mut(&b.worker) {
            b.first = Some((now, w.beside(now, report_ttl)));
            if b.handoff != Handoff::Awaits {
                let ttft = now.saturating_duration_since(b.booked_at);
                w.model.learn_ttft(b.features, ttft, b.predicted.ttft);
                w.compared("ttft", b, b.predicted.ttft, ttft);
            }
        }
        if let Handoff::Leads(decode) = b.handoff {
            self.hand_off(decode, now);
        }
        true
    }

    /// The request's answer ended complete at `now` with `output_tokens` tokens (when
    /// its usage or its stream said): the worker's model learns from it (see [`Watch`]),
    /// then everything it holds is released. Returns false if it was not booked.
    pub fn complete(&mut self, req: RequestId, now: Instant, output_tokens: Option<u32>) -> bool {
        let report_ttl = self.report_ttl;
        if let (Some(b), Some(n)) = (self.requests.get(&req), output_tokens)
            && let Some(w) = self.workers.get_mut(&b.worker)
        {
            w.model.learn_output(n);
            let beside = w.beside(now, report_ttl);
            match (b.watch, b.first) {
                (Watch::FirstToken, Some((first, then))) if n >= 2 => {
                    let tpot = now.saturating_duration_since(first) / (n - 1);
                    w.model
                        .learn_tpot(Beside::mean(then, beside), tpot, b.predicted.tpot);
                    w.compared("tpot", b, b.predicted.tpot, tpot);
                }
                (Watch::WholeAnswer, _) if b.handoff != Handoff::Awaits => {
                    let e2e = now.saturating_duration_since(b.booked_at);
                    w.model.learn_e2e(e2e, b.predicted.e2e(n));
                    w.compared("e2e", b, b.predicted.e2e(n), e2e);
                    let at = w.model.predict(Features {
                        in_flight: beside.in_flight as u32,
                        ..b.features
                    });
                    // Its first token, inferred: its end less its later tokens.
                    if let Some(rest) = at.tpot.and_then(|t| t.checked_mul(n.saturating_sub(1))) {
                        w.model.learn_inferred_ttft(b.features, e2e, rest);
                    }
                }
                _ => {}
            }
        }
        self.finish(req)
    }

    /// The request ended, failed or was cancelled: release everything it holds.
    /// Returns false if it was not booked (already released).
    pub fn finish(&mut self, req: RequestId) -> bool {
        let Some(mut b) = self.requests.remove(&req) else {
            return false;
        };
        Self::first_token_came(&mut self.workers, &mut b);
        if let Some(w) = self.workers.get_mut(&b.worker) {
            for block in &b.blocks {
                if let Some(n) = w.blocks.get_mut(block) {
                    *n -= 1;
                    if *n == 0 {
                        w.blocks.remove(block);
                    }
                }
            }
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
        if let Some(latency) = load.latency {
            let beside = w.beside(now, self.report_ttl);
            w.model.engine_report(latency, beside);
        }
        w.peak_running = w.peak_running.max(load.running);
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
                batch_full: w.batch_full(now, self.report_ttl),
                awaiting_first: w.awaiting,
                expected_wait: w.model.wait(w.features(0, now, self.report_ttl)),
                latency: LatencySummary::of(&w.model),
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

    /// `worker`'s last [`RECENT`] predictions beside what happened, oldest first.
    pub fn recent(&self, worker: InstanceId) -> Vec<Compared> {
        self.workers
            .get(&worker)
            .map(|w| w.recent.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Requests currently booked.
    pub fn in_flight(&self) -> usize {
        self.requests.len()
    }
}

#[cfg(test)]
mod tests;
