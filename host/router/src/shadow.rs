//! Shadow policies: a candidate policy decides beside the live one, on the same requests
//! and candidates, without ever serving. The live path only clones the candidate list
//! into a bounded lock-free queue (when the shadow falls behind, decisions are dropped
//! and counted, never waited for) and makes no system call: the shadow's thread is not
//! woken per decision but polls, every millisecond while there is work and backing off
//! to every 50 ms when idle (woken early only when a quarter of the queue is waiting).
//! It calls the shadow and records how its choices compare with the live policy's.
//!
//! Counters live in [`ShadowCounters`], one set per shadow identity (`name@version`) on
//! an endpoint, so that re-attaching the same shadow continues its series (Prometheus
//! counters never go back) while the admin API reports the current attachment alone
//! (its counters minus those at attach time).

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

use switchyard_ids::InstanceId;
use switchyard_policy::{CallFailure, CallOutcome, Candidates, LoadedPolicy, Request};

/// Decisions waiting for the shadow, at most; past that they are dropped.
pub const SHADOW_QUEUE: usize = 1024;

/// Shadow identities (`name@version`) whose counters an endpoint keeps, at most; the
/// oldest one not attached is forgotten past that.
pub const SHADOW_SERIES: usize = 8;

/// Times the shadow's thread waits 1 ms for a warm instance before it counts the call
/// as failed.
const NO_INSTANCE_RETRIES: u32 = 100;

/// What the live path hands the shadow: the request as the live policy saw it, its
/// candidates, and what the live policy chose (`None`: it rejected the request).
struct Job {
    request: Request,
    candidates: Candidates,
    live: Option<InstanceId>,
}

/// Everything recorded about one shadow identity on one endpoint. Only its thread
/// writes (dropped decisions are counted by the live path).
#[derive(Debug)]
pub struct ShadowCounters {
    /// Decisions handed to the shadow's queue.
    pub offered: AtomicU64,
    /// Decisions dropped at a full queue.
    pub dropped: AtomicU64,
    /// Decisions where both the live policy and the shadow chose a worker.
    pub compared: AtomicU64,
    /// Of those, the decisions where both chose the same worker.
    pub agreed: AtomicU64,
    /// Requests the shadow rejected.
    pub rejected: AtomicU64,
    /// Requests the live policy rejected (not compared).
    pub live_rejected: AtomicU64,
    /// Failed shadow calls, by [`CallFailure::REASONS`] index.
    pub failures: [AtomicU64; CallFailure::REASONS.len()],
    /// Over compared decisions: leading prompt blocks cached on the shadow's choice.
    pub shadow_overlap_blocks: AtomicU64,
    /// ... on the live choice.
    pub live_overlap_blocks: AtomicU64,
    /// ... on the best candidate.
    pub best_overlap_blocks: AtomicU64,
    /// Over compared decisions, the kv-cost model's predicted cost of the shadow's
    /// choice (f64 bits; one writer).
    shadow_cost: AtomicU64,
    /// ... of the live choice.
    live_cost: AtomicU64,
    /// Shadow calls made.
    pub calls: AtomicU64,
    /// Their summed time, nanoseconds.
    pub call_nanos: AtomicU64,
    /// The shadow's own call time.
    pub call_seconds: Histogram,
}

impl Default for ShadowCounters {
    fn default() -> Self {
        ShadowCounters {
            offered: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            compared: AtomicU64::new(0),
            agreed: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            live_rejected: AtomicU64::new(0),
            failures: Default::default(),
            shadow_overlap_blocks: AtomicU64::new(0),
            live_overlap_blocks: AtomicU64::new(0),
            best_overlap_blocks: AtomicU64::new(0),
            shadow_cost: AtomicU64::new(0f64.to_bits()),
            live_cost: AtomicU64::new(0f64.to_bits()),
            calls: AtomicU64::new(0),
            call_nanos: AtomicU64::new(0),
            call_seconds: Histogram::new(exponential_buckets(1e-6, 2.0, 20)),
        }
    }
}

fn add_f64(cell: &AtomicU64, v: f64) {
    // One writer (the shadow's thread): load and store cannot lose an update.
    let now = f64::from_bits(cell.load(Ordering::Relaxed)) + v;
    cell.store(now.to_bits(), Ordering::Relaxed);
}

/// A point-in-time copy of [`ShadowCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct ShadowTally {
    /// See [`ShadowCounters::offered`].
    pub offered: u64,
    /// See [`ShadowCounters::dropped`].
    pub dropped: u64,
    /// See [`ShadowCounters::compared`].
    pub compared: u64,
    /// See [`ShadowCounters::agreed`].
    pub agreed: u64,
    /// See [`ShadowCounters::rejected`].
    pub rejected: u64,
    /// See [`ShadowCounters::live_rejected`].
    pub live_rejected: u64,
    /// Failed calls of every kind.
    pub failures: u64,
    /// See [`ShadowCounters::shadow_overlap_blocks`].
    pub shadow_overlap_blocks: u64,
    /// See [`ShadowCounters::live_overlap_blocks`].
    pub live_overlap_blocks: u64,
    /// See [`ShadowCounters::best_overlap_blocks`].
    pub best_overlap_blocks: u64,
    /// Summed predicted cost of the shadow's choices.
    pub shadow_cost: f64,
    /// Summed predicted cost of the live choices.
    pub live_cost: f64,
    /// Calls made and their summed time, seconds.
    pub calls: u64,
    /// Summed call time, seconds.
    pub call_seconds: f64,
}

impl ShadowCounters {
    /// The shadow's predicted cost sum.
    pub fn shadow_cost(&self) -> f64 {
        f64::from_bits(self.shadow_cost.load(Ordering::Relaxed))
    }

    /// The live policy's predicted cost sum.
    pub fn live_cost(&self) -> f64 {
        f64::from_bits(self.live_cost.load(Ordering::Relaxed))
    }

    /// The counters now.
    pub fn tally(&self) -> ShadowTally {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ShadowTally {
            offered: l(&self.offered),
            dropped: l(&self.dropped),
            compared: l(&self.compared),
            agreed: l(&self.agreed),
            rejected: l(&self.rejected),
            live_rejected: l(&self.live_rejected),
            failures: self.failures.iter().map(l).sum(),
            shadow_overlap_blocks: l(&self.shadow_overlap_blocks),
            live_overlap_blocks: l(&self.live_overlap_blocks),
            best_overlap_blocks: l(&self.best_overlap_blocks),
            shadow_cost: self.shadow_cost(),
            live_cost: self.live_cost(),
            calls: l(&self.calls),
            call_seconds: l(&self.call_nanos) as f64 * 1e-9,
        }
    }
}

impl ShadowTally {
    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &ShadowTally) -> ShadowTally {
        ShadowTally {
            offered: self.offered - earlier.offered,
            dropped: self.dropped - earlier.dropped,
            compared: self.compared - earlier.compared,
            agreed: self.agreed - earlier.agreed,
            rejected: self.rejected - earlier.rejected,
            live_rejected: self.live_rejected - earlier.live_rejected,
            failures: self.failures - earlier.failures,
            shadow_overlap_blocks: self.shadow_overlap_blocks - earlier.shadow_overlap_blocks,
            live_overlap_blocks: self.live_overlap_blocks - earlier.live_overlap_blocks,
            best_overlap_blocks: self.best_overlap_blocks - earlier.best_overlap_blocks,
            shadow_cost: self.shadow_cost - earlier.shadow_cost,
            live_cost: self.live_cost - earlier.live_cost,
            calls: self.calls - earlier.calls,
            call_seconds: self.call_seconds - earlier.call_seconds,
        }
    }

    /// Whether every decision offered has been dealt with (compared, dropped, failed or
    /// rejected on either side): nothing is queued or in the shadow's hands.
    pub fn settled(&self) -> bool {
        self.offered
            == self.compared + self.dropped + self.failures + self.rejected + self.live_rejected
    }

    /// Adds another tally (another replica's) to this one.
    pub fn add(&mut self, o: &ShadowTally) {
        self.offered += o.offered;
        self.dropped += o.dropped;
        self.compared += o.compared;
        self.agreed += o.agreed;
        self.rejected += o.rejected;
        self.live_rejected += o.live_rejected;
        self.failures += o.failures;
        self.shadow_overlap_blocks += o.shadow_overlap_blocks;
        self.live_overlap_blocks += o.live_overlap_blocks;
        self.best_overlap_blocks += o.best_overlap_blocks;
        self.shadow_cost += o.shadow_cost;
        self.live_cost += o.live_cost;
        self.calls += o.calls;
        self.call_seconds += o.call_seconds;
    }

    /// Share of compared decisions where the shadow chose the live policy's worker.
    pub fn agreement(&self) -> Option<f64> {
        (self.compared > 0).then(|| self.agreed as f64 / self.compared as f64)
    }

    /// Block-weighted overlap of the shadow's choices against the best available (1 when
    /// no candidate held any of the prompts).
    pub fn shadow_overlap_ratio(&self) -> Option<f64> {
        ratio(
            self.shadow_overlap_blocks,
            self.best_overlap_blocks,
            self.compared,
        )
    }

    /// The same for the live policy's choices.
    pub fn live_overlap_ratio(&self) -> Option<f64> {
        ratio(
            self.live_overlap_blocks,
            self.best_overlap_blocks,
            self.compared,
        )
    }

    /// Mean predicted cost of the shadow's choices (kv-cost model, default weights).
    pub fn shadow_mean_cost(&self) -> Option<f64> {
        (self.compared > 0).then(|| self.shadow_cost / self.compared as f64)
    }

    /// Mean predicted cost of the live choices.
    pub fn live_mean_cost(&self) -> Option<f64> {
        (self.compared > 0).then(|| self.live_cost / self.compared as f64)
    }

    /// Mean shadow call time.
    pub fn mean_call(&self) -> Option<Duration> {
        (self.calls > 0).then(|| Duration::from_secs_f64(self.call_seconds / self.calls as f64))
    }
}

/// Achieved over best blocks: 1 when nothing was available to achieve.
pub fn ratio(achieved: u64, best: u64, decisions: u64) -> Option<f64> {
    (decisions > 0).then(|| {
        if best == 0 {
            1.0
        } else {
            achieved as f64 / best as f64
        }
    })
}

/// The live path's hand-off to the shadow's thread.
struct Queue {
    jobs: crossbeam_queue::ArrayQueue<Job>,
    /// Candidate lists the thread is done with, for the live path to fill again: in the
    /// steady state the live path allocates nothing, and no allocation made on one
    /// thread is freed on the other.
    spare: crossbeam_queue::ArrayQueue<Candidates>,
    /// Set when the shadow is removed: the thread ends after its call in progress.
    closed: AtomicBool,
}

/// Candidate lists kept for reuse.
const SPARE_LISTS: usize = 64;

/// The shadow thread's longest sleep when there is nothing to do.
const IDLE_POLL_MAX: Duration = Duration::from_millis(50);

/// A shadow attached to an endpoint. Dropping it closes the queue: its thread finishes
/// the call in progress and ends, leaving the rest undecided.
pub struct Shadow {
    policy: LoadedPolicy,
    /// One decision in this many is offered (1: every one).
    every: u64,
    queue: Arc<Queue>,
    thread: std::thread::Thread,
    counters: Arc<ShadowCounters>,
    baseline: ShadowTally,
    attached_at: SystemTime,
}

impl std::fmt::Debug for Shadow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shadow")
            .field("policy", &self.policy.info().name)
            .field("every", &self.every)
            .finish()
    }
}

/// What the admin API shows of an attached shadow.
#[derive(Debug, Clone)]
pub struct ShadowStatus {
    /// The shadow's identity.
    pub info: switchyard_policy::PolicyInfo,
    /// The share of decisions offered to it.
    pub sample: f64,
    /// When it was attached.
    pub attached_at: SystemTime,
    /// What it did since.
    pub tally: ShadowTally,
}

/// The kv-cost model's weights used to price every choice a shadow is compared on.
fn pricing() -> switchyard_cost_model::KvCostConfig {
    switchyard_cost_model::KvCostConfig::default()
}

impl Shadow {
    /// Attaches `policy` (already validated) as a shadow offered a `sample` share of the
    /// decisions (clamped to (0, 1]), recording into `counters`.
    pub fn start(
        policy: LoadedPolicy,
        sample: f64,
        counters: Arc<ShadowCounters>,
        endpoint: &str,
    ) -> std::io::Result<Shadow> {
        let sample = if sample.is_finite() && sample > 0.0 {
            sample.min(1.0)
        } else {
            1.0
        };
        let every = (1.0 / sample).round().max(1.0) as u64;
        let queue = Arc::new(Queue {
            jobs: crossbeam_queue::ArrayQueue::new(SHADOW_QUEUE),
            spare: crossbeam_queue::ArrayQueue::new(SPARE_LISTS),
            closed: AtomicBool::new(false),
        });
        policy.prepare();
        let (p, c, q) = (policy.clone(), counters.clone(), queue.clone());
        let thread = std::thread::Builder::new()
            .name(format!("shadow {endpoint}"))
            .spawn(move || drain(&p, &c, &q))?
            .thread()
            .clone();
        Ok(Shadow {
            baseline: counters.tally(),
            policy,
            every,
            queue,
            thread,
            counters,
            attached_at: SystemTime::now(),
        })
    }

    /// The shadow policy.
    pub fn policy(&self) -> &LoadedPolicy {
        &self.policy
    }

    /// Offers one live decision (decision number `sequence`); never blocks.
    pub fn offer(
        &self,
        sequence: u64,
        request: &Request,
        candidates: &Candidates,
        live: Option<InstanceId>,
    ) {
        if !sequence.is_multiple_of(self.every) {
            return;
        }
        self.counters.offered.fetch_add(1, Ordering::Relaxed);
        let mut copy = self.queue.spare.pop().unwrap_or_default();
        copy.copy_from(candidates);
        let job = Job {
            request: *request,
            candidates: copy,
            live,
        };
        if self.queue.jobs.push(job).is_err() {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
        } else if self.queue.jobs.len() == SHADOW_QUEUE / 4 {
            self.thread.unpark();
        }
    }

    /// Identity and what it did since it was attached.
    pub fn status(&self) -> ShadowStatus {
        ShadowStatus {
            info: self.policy.info().clone(),
            sample: 1.0 / self.every as f64,
            attached_at: self.attached_at,
            tally: self.counters.tally().since(&self.baseline),
        }
    }
}

impl Drop for Shadow {
    fn drop(&mut self) {
        self.queue.closed.store(true, Ordering::Release);
        self.thread.unpark();
    }
}

/// The shadow's thread: decide every queued request and compare; ends when the shadow
/// is removed (after the call in progress, if any).
fn drain(policy: &LoadedPolicy, counters: &ShadowCounters, queue: &Queue) {
    let mut idle = Duration::from_millis(1);
    loop {
        let mut worked = false;
        while !queue.closed.load(Ordering::Acquire)
            && let Some(job) = queue.jobs.pop()
        {
            worked = true;
            let spare = decide(policy, counters, job);
            let _ = queue.spare.push(spare);
        }
        if queue.closed.load(Ordering::Acquire) {
            // Removed: what is still queued is dropped with the queue, not decided (a
            // slow shadow would otherwise go on working long after it was removed).
            return;
        }
        idle = if worked {
            Duration::from_millis(1)
        } else {
            (idle * 2).min(IDLE_POLL_MAX)
        };
        std::thread::park_timeout(idle);
    }
}

/// One shadow decision, compared with the live one; gives back the job's candidate list.
fn decide(policy: &LoadedPolicy, counters: &ShadowCounters, job: Job) -> Candidates {
    let pricing = pricing();
    let started = Instant::now();
    let mut result = policy.call(&job.request, &job.candidates);
    // Off the request path a missing instance is worth a short wait (the warmer is
    // making one after a trap): bounded, then counted like any failure.
    for _ in 0..NO_INSTANCE_RETRIES {
        if !matches!(result, Err(CallFailure::NoWarmInstance)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
        result = policy.call(&job.request, &job.candidates);
    }
    let took = started.elapsed();
    counters.call_seconds.observe(took.as_secs_f64());
    counters.calls.fetch_add(1, Ordering::Relaxed);
    counters.call_nanos.fetch_add(
        u64::try_from(took.as_nanos()).unwrap_or(u64::MAX),
        Ordering::Relaxed,
    );
    let shadow = match result {
        // A split is compared by the worker that answers (its decode worker).
        Ok(CallOutcome::Chosen(id) | CallOutcome::Pair { decode: id, .. }) => id,
        Ok(CallOutcome::Rejected(_)) => {
            counters.rejected.fetch_add(1, Ordering::Relaxed);
            return job.candidates;
        }
        Err(failure) => {
            counters.failures[failure.reason_index()].fetch_add(1, Ordering::Relaxed);
            let failures = counters.tally().failures;
            // The first failures and then one in a thousand: a shadow failing every
            // call must not flood the log (the counters have them all).
            if failures <= 3 || failures.is_multiple_of(1000) {
                tracing::warn!(
                    shadow = %policy.info().name,
                    failures,
                    error = %failure,
                    "shadow policy call failed (the live policy is not affected)"
                );
            }
            return job.candidates;
        }
    };
    let Some(live) = job.live else {
        counters.live_rejected.fetch_add(1, Ordering::Relaxed);
        return job.candidates;
    };
    let c = &job.candidates;
    let best = c.best_overlap();
    let shape = switchyard_cost_model::RequestShape {
        prompt_blocks: job.request.prompt_blocks,
        block_size: job.request.block_size,
        seed: job.request.seed,
    };
    let price = |id: InstanceId| {
        c.position(id).map_or(0.0, |i| {
            switchyard_cost_model::cost(&pricing, &shape, &c.view(), i)
        })
    };
    let add = |cell: &AtomicU64, v: u32| cell.fetch_add(u64::from(v), Ordering::Relaxed);
    counters.compared.fetch_add(1, Ordering::Relaxed);
    if shadow == live {
        counters.agreed.fetch_add(1, Ordering::Relaxed);
    }
    add(
        &counters.shadow_overlap_blocks,
        c.overlap_of(shadow).unwrap_or(0),
    );
    add(
        &counters.live_overlap_blocks,
        c.overlap_of(live).unwrap_or(0),
    );
    add(&counters.best_overlap_blocks, best);
    add_f64(&counters.shadow_cost, price(shadow));
    add_f64(&counters.live_cost, price(live));
    job.candidates
}

/// The shadow counters an endpoint keeps, by shadow identity (`name@version`).
#[derive(Debug, Default)]
pub struct ShadowSeries {
    by_label: parking_lot::Mutex<Vec<(String, Arc<ShadowCounters>)>>,
}

impl ShadowSeries {
    /// The counters of `label`, made if new; past [`SHADOW_SERIES`] the oldest
    /// identity is forgotten.
    pub fn counters(&self, label: &str) -> Arc<ShadowCounters> {
        let mut all = self.by_label.lock();
        if let Some((_, c)) = all.iter().find(|(l, _)| l == label) {
            return c.clone();
        }
        let c = Arc::new(ShadowCounters::default());
        all.push((label.to_string(), c.clone()));
        if all.len() > SHADOW_SERIES {
            all.remove(0);
        }
        c
    }

    /// Every identity's counters, oldest first.
    pub fn all(&self) -> Vec<(String, Arc<ShadowCounters>)> {
        self.by_label.lock().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_keeps_the_newest_shadow_identities_and_continues_a_returning_one() {
        let series = ShadowSeries::default();
        series
            .counters("first@1")
            .offered
            .fetch_add(5, Ordering::Relaxed);
        // Every attachment a new identity: the oldest go, at most SHADOW_SERIES stay.
        for i in 0..3 * SHADOW_SERIES {
            series.counters(&format!("s{i}@1"));
        }
        let all = series.all();
        assert_eq!(all.len(), SHADOW_SERIES);
        assert_eq!(all[0].0, format!("s{}@1", 2 * SHADOW_SERIES));
        assert!(all.iter().all(|(l, _)| l != "first@1"));
        // A returning identity continues its counters (a Prometheus series never goes back).
        let last = format!("s{}@1", 3 * SHADOW_SERIES - 1);
        series
            .counters(&last)
            .offered
            .fetch_add(2, Ordering::Relaxed);
        assert_eq!(series.counters(&last).offered.load(Ordering::Relaxed), 2);
        assert_eq!(series.all().len(), SHADOW_SERIES);
        // One forgotten and attached again starts afresh.
        assert_eq!(
            series.counters("first@1").offered.load(Ordering::Relaxed),
            0
        );
    }
}
