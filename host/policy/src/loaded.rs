//! A loaded policy: compiled code, its pre-linked instance template, and a pool of warm
//! instances that decisions check out, use, and give back.

use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

use crossbeam_queue::ArrayQueue;
use parking_lot::Mutex;
use wasmtime::Store;

use super::bindings::{Policy, PolicyPre, wit};
use super::cache::CacheOutcome;
use super::canary::{RANDOM_CANARIES, canary_candidates, canary_request, random_canaries};
use super::engine::PolicyEngine;
use super::sandbox::{GuestLog, HostState, InstanceLimits};
use super::types::{Candidates, Rejection, Request};
use super::warmer::Warmer;
use super::{PolicyError, describe_error};
use switchyard_ids::InstanceId;

/// Where a policy's bytes came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicySource {
    /// A built-in policy, by name.
    Builtin(&'static str),
    /// A `.wasm` file.
    File(PathBuf),
    /// Bytes uploaded through the admin API or fetched from etcd.
    Uploaded(String),
}

impl std::fmt::Display for PolicySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PolicySource::Builtin(name) => write!(f, "builtin:{name}"),
            PolicySource::File(path) => write!(f, "file:{}", path.display()),
            PolicySource::Uploaded(origin) => write!(f, "uploaded:{origin}"),
        }
    }
}

/// What a policy says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyInfo {
    /// Its name, from `describe`.
    pub name: String,
    /// Its version, from `describe`.
    pub version: String,
    /// sha256 of its `.wasm` bytes, hex.
    pub sha256: String,
    /// Where it was loaded from.
    pub source: PolicySource,
    /// The operator configuration it was given.
    pub config: String,
    /// When it was loaded.
    pub loaded_at: SystemTime,
    /// How long compile + instantiate + configure took.
    pub load_time: Duration,
    /// Whether the compiled code came from a cache.
    pub cache: CacheOutcome,
    /// The world version it implements (`switchyard:policy@0.4.0`, or `@0.3.0`, `@0.2.0` or
    /// `@0.1.0` for a component built against an earlier WIT).
    pub world: &'static str,
}

/// Why one `choose` call did not produce a valid answer. The decision itself still
/// succeeds, through the native fallback.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallFailure {
    /// The call ran past its time budget and was interrupted.
    #[error("policy exceeded its time budget of {0:?} (--policy-budget-ms sets it)")]
    Timeout(Duration),
    /// The guest tried to grow its memory past the cap.
    #[error("policy exceeded its memory cap of {0} bytes (--policy-memory-mb raises it)")]
    OutOfMemory(usize),
    /// The guest trapped (a panic, an unreachable, a bad canonical-ABI value...).
    #[error("policy trapped: {0}")]
    Trap(String),
    /// The guest answered with a worker that is not one of the candidates.
    #[error("policy chose worker {0}, which is not a candidate")]
    NotACandidate(InstanceId),
    /// The guest's growth would take all policy instances together past their limit.
    #[error(
        "policy instances together reached their memory limit of {0} bytes \
         (--policy-memory-total-mb raises it)"
    )]
    TotalMemory(usize),
    /// A fresh instance could not be created or configured.
    #[error("policy instance could not be created: {0}")]
    Instantiate(String),
    /// No warm instance was idle (more concurrent decisions than instances, or the
    /// warmer had not yet replaced a discarded one). Not the policy's fault: not counted
    /// towards a rollback.
    #[error("no warm policy instance was idle")]
    NoWarmInstance,
    /// The guest answered with a placement the candidates do not allow (a pair whose
    /// prefill worker is not a `prefill` candidate, a lone `decode` worker where the
    /// protocol needs both, ...).
    #[error("policy placed the request where it cannot go: {0}")]
    BadPlacement(String),
}

impl CallFailure {
    /// Every [`CallFailure::reason`], in a fixed order.
    pub const REASONS: [&'static str; 8] = [
        "timeout",
        "out_of_memory",
        "trap",
        "not_a_candidate",
        "total_memory",
        "instantiate",
        "no_warm_instance",
        "bad_placement",
    ];

    /// A short label naming the kind of failure (for metrics).
    pub fn reason(&self) -> &'static str {
        Self::REASONS[self.reason_index()]
    }

    /// The position of this failure's reason in `REASONS` (for counters indexed by it).
    pub fn reason_index(&self) -> usize {
        match self {
            CallFailure::Timeout(_) => 0,
            CallFailure::OutOfMemory(_) => 1,
            CallFailure::Trap(_) => 2,
            CallFailure::NotACandidate(_) => 3,
            CallFailure::TotalMemory(_) => 4,
            CallFailure::Instantiate(_) => 5,
            CallFailure::NoWarmInstance => 6,
            CallFailure::BadPlacement(_) => 7,
        }
    }

    /// Whether the failure is the policy's own (it counts towards a rollback).
    pub fn is_policys(&self) -> bool {
        !matches!(self, CallFailure::NoWarmInstance)
    }
}

/// The answer of one successful call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallOutcome {
    /// The policy chose this worker (a candidate) for the whole request.
    Chosen(InstanceId),
    /// The policy split the request: prefill on one candidate, decode on another.
    Pair {
        /// A `prefill` candidate.
        prefill: InstanceId,
        /// A `decode` candidate.
        decode: InstanceId,
    },
    /// The policy refused on purpose.
    Rejected(Rejection),
}

/// A policy's placement, checked against the candidates: every worker named is one, a
/// lone worker is a `both` worker (or any, when `decode_alone`), a pair is a `prefill`
/// and a `decode` worker.
fn check_placement(
    req: &Request,
    candidates: &Candidates,
    placement: wit::Placement,
) -> Result<CallOutcome, CallFailure> {
    use switchyard_ids::Role;
    let role = |id: u64| {
        candidates
            .role_of(InstanceId(id))
            .ok_or(CallFailure::NotACandidate(InstanceId(id)))
    };
    match placement {
        wit::Placement::Worker(id) => match role(id)? {
            Role::Both => Ok(CallOutcome::Chosen(InstanceId(id))),
            _ if req.decode_alone => Ok(CallOutcome::Chosen(InstanceId(id))),
            r => Err(CallFailure::BadPlacement(format!(
                "worker {} is a {r} worker, and this fleet's handoff needs both a prefill and a decode worker",
                InstanceId(id)
            ))),
        },
        wit::Placement::Pair(p) => match (role(p.prefill)?, role(p.decode)?) {
            (Role::Prefill, Role::Decode) => Ok(CallOutcome::Pair {
                prefill: InstanceId(p.prefill),
                decode: InstanceId(p.decode),
            }),
            (a, b) => Err(CallFailure::BadPlacement(format!(
                "a pair needs a prefill and a decode worker, got {} ({a}) and {} ({b})",
                InstanceId(p.prefill),
                InstanceId(p.decode)
            ))),
        },
    }
}

/// A compiled, configured policy. Cheap to clone; clones share the instance pool.
#[derive(Clone)]
pub struct LoadedPolicy {
    shared: Arc<Shared>,
}

struct Shared {
    engine: PolicyEngine,
    pre: PolicyPre,
    info: PolicyInfo,
    log: Arc<GuestLog>,
    /// Idle warm instances. A decision pops one, calls it, and pushes it back: no lock
    /// is held across a call, and a trapped instance is simply not returned. Only the
    /// warmer (and loads, swaps and canaries, off the request path) create instances.
    pool: ArrayQueue<Warm>,
    instances_created: AtomicU64,
    /// Idle instances the warmer keeps ready: `warm_instances`, grown by one per
    /// decision that found none, up to the pool's capacity.
    target: AtomicUsize,
    /// A refill is queued with the warmer.
    refill_queued: AtomicBool,
    /// Why the warmer's last attempt failed, and when it may try again (doubling
    /// back-off): a policy that cannot be instantiated does not keep a core busy.
    warm_failure: Mutex<Option<WarmFailure>>,
    /// Served a whole rate window without a failed call (built-ins from the start): a
    /// rollback may return to it.
    proven: AtomicBool,
    warmer: Warmer,
}

struct WarmFailure {
    error: String,
    retry_at: Instant,
    backoff: Duration,
}

struct Warm {
    store: Store<HostState>,
    policy: Policy,
    calls: u64,
}

impl LoadedPolicy {
    pub(crate) fn new(
        engine: PolicyEngine,
        pre: PolicyPre,
        source: PolicySource,
        sha256: String,
        config: &str,
        cache: CacheOutcome,
        started: Instant,
    ) -> Result<LoadedPolicy, PolicyError> {
        let label = match &source {
            PolicySource::Builtin(name) => name.to_string(),
            _ => sha256[..12].to_string(),
        };
        let log = GuestLog::new(&label, engine.config().guest_log_lines_per_sec);
        let max_warm = engine.config().max_warm_instances.max(1);
        let warm_target = engine.config().warm_instances.clamp(1, max_warm);
        let warmer = engine.inner.warmer.clone();
        let proven = matches!(source, PolicySource::Builtin(_));
        let world = pre.world();
        let mut shared = Shared {
            engine,
            pre,
            info: PolicyInfo {
                name: String::new(),
                version: String::new(),
                sha256,
                source,
                config: if config.trim().is_empty() {
                    "{}".into()
                } else {
                    config.to_string()
                },
                loaded_at: SystemTime::now(),
                load_time: Duration::ZERO,
                cache,
                world,
            },
            log,
            pool: ArrayQueue::new(max_warm),
            instances_created: AtomicU64::new(0),
            target: AtomicUsize::new(warm_target),
            refill_queued: AtomicBool::new(false),
            warm_failure: Mutex::new(None),
            proven: AtomicBool::new(proven),
            warmer,
        };
        let mut first = shared.instantiate().map_err(|e| match e {
            InstantiateError::Config(msg) => PolicyError::BadConfig(msg),
            InstantiateError::Trap(msg) => PolicyError::Trap(msg),
        })?;
        let running = shared.engine.inner.ticker.running();
        let info = first
            .policy
            .call_describe(&mut first.store)
            .map_err(|e| PolicyError::Trap(format!("in describe: {}", describe_error(&e))))?;
        drop(running);
        shared.info.name = super::types::guest_label(&info.name);
        shared.info.version = super::types::guest_label(&info.version);
        shared.info.load_time = started.elapsed();
        let _ = shared.pool.push(first);
        let loaded = LoadedPolicy {
            shared: Arc::new(shared),
        };
        // The other warm instances, made now: loading is off the request path.
        loaded.prepare();
        Ok(loaded)
    }

    /// Brings the idle instances up to the warm target on this thread (loads, swaps and
    /// rollbacks by the operator: never on a request's path).
    pub fn prepare(&self) {
        self.shared.refill();
    }

    /// Asks the warmer to bring the idle instances up to the warm target.
    pub(crate) fn refill_soon(&self) {
        let s = &*self.shared;
        if s.refill_queued.swap(true, Ordering::AcqRel) {
            return;
        }
        // The warmer holds only a weak reference: a dropped policy is not kept alive.
        let weak = Arc::downgrade(&self.shared);
        s.warmer.queue(move || {
            if let Some(shared) = weak.upgrade() {
                shared.refill_queued.store(false, Ordering::Release);
                shared.refill();
            }
        });
    }

    /// A decision found no idle instance: the target grows (up to the pool's capacity),
    /// the warmer is asked to refill, and the failure says whether instances can be
    /// made at all.
    fn missed(&self) -> CallFailure {
        let s = &*self.shared;
        let cap = s.pool.capacity();
        let _ = s
            .target
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                (t < cap).then_some(t + 1)
            });
        self.refill_soon();
        match &*s.warm_failure.lock() {
            Some(f) => CallFailure::Instantiate(f.error.clone()),
            None => CallFailure::NoWarmInstance,
        }
    }

    /// Drops idle instances past the configured warm count (a policy that is no longer
    /// current keeps a few, so that a rollback to it is served at once).
    pub(crate) fn retire(&self) {
        let s = &*self.shared;
        let keep = s.engine.config().warm_instances.max(1);
        s.target.store(keep, Ordering::Relaxed);
        while s.pool.len() > keep {
            drop(s.pool.pop());
        }
    }

    /// Idle warm instances now.
    pub fn idle_instances(&self) -> usize {
        self.shared.pool.len()
    }

    /// Whether the policy has served a whole window of calls without a failure (or is
    /// built in): what a rollback may return to.
    pub fn proven(&self) -> bool {
        self.shared.proven.load(Ordering::Relaxed)
    }

    pub(crate) fn mark_proven(&self) {
        self.shared.proven.store(true, Ordering::Relaxed);
    }

    /// The policy's identity and load facts.
    pub fn info(&self) -> &PolicyInfo {
        &self.shared.info
    }

    /// Instances created so far (the first one, plus one per trap, recycle or
    /// concurrency peak).
    pub fn instances_created(&self) -> u64 {
        self.shared.instances_created.load(Ordering::Relaxed)
    }

    /// Guest output lines logged, and lines dropped by the rate limit.
    pub fn guest_log_counts(&self) -> (u64, u64) {
        (self.shared.log.logged(), self.shared.log.suppressed())
    }

    /// True when both handles share the same loaded policy.
    pub fn ptr_eq(&self, other: &LoadedPolicy) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// Calls `choose` once on a warm instance and validates the answer.
    pub fn call(&self, req: &Request, candidates: &Candidates) -> Result<CallOutcome, CallFailure> {
        let budget = self.shared.engine.config().call_budget;
        self.call_within(
            req,
            candidates,
            self.shared.engine.inner.deadline_ticks,
            budget,
            false,
        )
    }

    /// One call. On the request path (`inline` false) an empty pool is a failure of its
    /// own, never a wait for a new instance; the canary and `policy check` (off the
    /// request path) may make one.
    fn call_within(
        &self,
        req: &Request,
        candidates: &Candidates,
        ticks: u64,
        budget: Duration,
        inline: bool,
    ) -> Result<CallOutcome, CallFailure> {
        let s = &*self.shared;
        let mut warm = match s.pool.pop() {
            Some(w) => w,
            None if inline => s
                .instantiate()
                .map_err(|e| CallFailure::Instantiate(e.to_string()))?,
            None => return Err(self.missed()),
        };
        let _running = s.engine.inner.ticker.running();
        warm.store.set_epoch_deadline(ticks);
        let wit_req = req.to_wit();
        // A panic in a host function (a WASI shim) must not take the router down: it is
        // caught here and the instance, possibly left inconsistent, is discarded.
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            warm.policy
                .call_choose(&mut warm.store, wit_req, &candidates.cols)
        }));
        warm.calls += 1;
        let answer = match result {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => {
                // The instance is discarded (its state is suspect): the warmer replaces it.
                self.refill_soon();
                return Err(s.classify(&e, budget));
            }
            Err(_) => {
                self.refill_soon();
                return Err(CallFailure::Trap("a host function panicked".into()));
            }
        };
        // The instance is healthy: give it back unless it is due for recycling (or
        // the pool is full), in which case the warmer makes a fresh one.
        if warm.calls < s.engine.config().recycle_after_calls {
            let _ = s.pool.push(warm);
        } else {
            drop(warm);
            self.refill_soon();
        }
        match answer {
            Ok(placement) => check_placement(req, candidates, placement),
            Err(rejection) => Ok(CallOutcome::Rejected(rejection.into())),
        }
    }

    /// The self-test run before a policy may serve: one decision on a synthetic
    /// candidate list, which must produce a candidate or a rejection within the load
    /// budget (generous, so that a busy host does not refuse a good policy).
    pub fn canary(&self) -> Result<CallOutcome, PolicyError> {
        let cfg = self.shared.engine.config();
        let budget = cfg.load_budget.max(cfg.call_budget);
        let ticks = self.shared.engine.inner.load_deadline_ticks;
        let first = self
            .call_within(&canary_request(), &canary_candidates(), ticks, budget, true)
            .map_err(|e| PolicyError::Canary(e.to_string()))?;
        // Then sets a policy cannot recognise: random sizes (1 and 64 among them), IDs,
        // seeds, sessions and loads, from a seed of this load.
        let mut all_rejected = matches!(first, CallOutcome::Rejected(_));
        for (set, (req, candidates)) in random_canaries(&self.shared.info.sha256).iter().enumerate()
        {
            let outcome = self
                .call_within(req, candidates, ticks, budget, true)
                .map_err(|e| {
                    PolicyError::Canary(format!(
                        "random candidate set {set} ({} workers): {e}",
                        candidates.len()
                    ))
                })?;
            all_rejected &= matches!(outcome, CallOutcome::Rejected(_));
        }
        if all_rejected && !cfg.allow_reject_all {
            return Err(PolicyError::Canary(format!(
                "it rejected all {} canary requests, though every set had an idle worker: \
                 serving it would answer every request 503 (start the router with \
                 --policy-may-reject-all if that is what it is for)",
                RANDOM_CANARIES + 1
            )));
        }
        Ok(first)
    }

    /// The canary's decision again, as a serving router would make it: within the call
    /// budget (not the load budget). Its wall time, or why it failed.
    pub fn timed_call(&self) -> Result<std::time::Duration, CallFailure> {
        let (req, candidates) = (canary_request(), canary_candidates());
        let started = std::time::Instant::now();
        let s = &*self.shared;
        self.call_within(
            &req,
            &candidates,
            s.engine.inner.deadline_ticks,
            s.engine.config().call_budget,
            true,
        )?;
        Ok(started.elapsed())
    }
}

#[derive(Debug, thiserror::Error)]
enum InstantiateError {
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Trap(String),
}

impl Shared {
    /// A fresh instance, configured with the operator's config.
    fn instantiate(&self) -> Result<Warm, InstantiateError> {
        let cfg = self.engine.config();
        let limits = InstanceLimits::new(cfg.memory_cap, self.engine.inner.memory.clone());
        let mut store = Store::new(&self.engine.inner.engine, HostState::new(&self.log, limits));
        store.limiter(|s| &mut s.limits);
        let _running = self.engine.inner.ticker.running();
        store.epoch_deadline_trap();
        store.set_epoch_deadline(self.engine.inner.load_deadline_ticks);
        let policy = self.pre.instantiate(&mut store).map_err(|e| {
            InstantiateError::Trap(format!("instantiation failed: {}", describe_error(&e)))
        })?;
        store.set_epoch_deadline(self.engine.inner.load_deadline_ticks);
        policy
            .call_configure(&mut store, &self.info.config)
            .map_err(|e| InstantiateError::Trap(format!("in configure: {}", describe_error(&e))))?
            .map_err(|msg| InstantiateError::Config(super::types::guest_text(&msg)))?;
        self.instances_created.fetch_add(1, Ordering::Relaxed);
        Ok(Warm {
            store,
            policy,
            calls: 0,
        })
    }

    /// Creates instances until the idle ones reach the target; on a failure, records it
    /// and backs off (10 ms, doubling to 5 s).
    fn refill(&self) {
        let target = self.target.load(Ordering::Relaxed);
        while self.pool.len() < target {
            if let Some(f) = &*self.warm_failure.lock()
                && Instant::now() < f.retry_at
            {
                return;
            }
            match self.instantiate() {
                Ok(warm) => {
                    *self.warm_failure.lock() = None;
                    if self.pool.push(warm).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let mut failure = self.warm_failure.lock();
                    let backoff = failure.as_ref().map_or(Duration::from_millis(10), |f| {
                        (f.backoff * 2).min(Duration::from_secs(5))
                    });
                    if failure.is_none() || backoff == Duration::from_secs(5) {
                        tracing::warn!(
                            policy = %self.info.name,
                            sha256 = %self.info.sha256,
                            error = %e,
                            "cannot create a warm policy instance; decisions without one \
                             are made by the native fallback"
                        );
                    }
                    *failure = Some(WarmFailure {
                        error: e.to_string(),
                        retry_at: Instant::now() + backoff,
                        backoff,
                    });
                    return;
                }
            }
        }
    }

    fn classify(&self, e: &wasmtime::Error, budget: Duration) -> CallFailure {
        let cfg = self.engine.config();
        if let Some(wasmtime::Trap::Interrupt) = e.downcast_ref::<wasmtime::Trap>() {
            return CallFailure::Timeout(budget);
        }
        let text = describe_error(e);
        if text.contains("all policy instances together") {
            return CallFailure::TotalMemory(cfg.total_memory_cap);
        }
        if text.contains("growing memory") || text.contains("memory") && text.contains("limit") {
            return CallFailure::OutOfMemory(cfg.memory_cap);
        }
        CallFailure::Trap(text)
    }
}
