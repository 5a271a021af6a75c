//! `PolicyHandle`: an endpoint's current policy, the decisions made through it, hot
//! swaps, and rollback.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::SystemTime;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use super::loaded::{CallFailure, CallOutcome, LoadedPolicy, PolicyInfo};
use super::native;
use super::types::{Candidates, Rejection, RejectionKind, Request};
use super::{PolicyEngine, PolicyError};
use switchyard_ids::InstanceId;

/// Who made a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decider {
    /// The current policy component.
    Policy,
    /// The native `kv-cost`, because the policy call failed.
    Fallback,
}

/// The result of one decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecisionOutcome {
    /// Route to this worker.
    Chosen(InstanceId),
    /// The policy refused the request on purpose.
    Rejected(Rejection),
    /// There was no candidate to choose from.
    NoCandidates,
}

/// One routing decision and how it was made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// What was decided.
    pub outcome: DecisionOutcome,
    /// Whether the policy or the fallback decided.
    pub decider: Decider,
    /// Which loaded policy was current for this decision (increases by one per swap or
    /// rollback). A decision is made entirely by that one policy.
    pub generation: u64,
    /// The request's sequence number on this handle.
    pub sequence: u64,
    /// The random number the policy was given (`Request::seed`).
    pub seed: u64,
    /// Why the policy call failed, when the fallback decided.
    pub failure: Option<CallFailure>,
    /// How long the policy's own call took (zero when there were no candidates).
    pub call_time: std::time::Duration,
    /// A split request's prefill worker (`outcome` names its decode worker).
    pub prefill: Option<InstanceId>,
}

/// Counters and identity of the current policy, for the admin API and metrics.
#[derive(Debug, Clone)]
pub struct PolicyStatus {
    /// Name, version, sha256, source, config, load time.
    pub info: PolicyInfo,
    /// Generation number of the current policy.
    pub generation: u64,
    /// Decisions made since it became current (by it or by the fallback).
    pub decisions: u64,
    /// Calls to it that failed.
    pub failures: u64,
    /// Decisions the native fallback made for it.
    pub fallbacks: u64,
    /// Requests it rejected on purpose.
    pub rejections: u64,
    /// When it became current.
    pub active_since: SystemTime,
    /// The policy a rollback by the operator returns to (the one replaced last), if any.
    pub previous: Option<PolicyInfo>,
    /// The policy an automatic rollback returns to: the most recent earlier policy that
    /// served a whole window of calls without a failure (or a built-in), if any.
    pub last_good: Option<PolicyInfo>,
    /// Whether the current policy has served such a window.
    pub proven: bool,
    /// Rollbacks on this handle so far (automatic and manual).
    pub rollbacks: u64,
    /// Guest output lines logged and suppressed.
    pub guest_log_lines: (u64, u64),
}

/// Counters of everything decided through a handle, whichever policy was current: they
/// never go down (a swap or a rollback does not reset them), as Prometheus counters must.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PolicyTotals {
    /// Decisions made.
    pub decisions: u64,
    /// Policy calls that failed by the policy's fault (each decided by the native
    /// fallback; `no_warm_instance` is not one).
    pub failures: u64,
    /// Decisions the native fallback made, by [`CallFailure::REASONS`] index.
    pub fallbacks: [u64; CallFailure::REASONS.len()],
    /// Requests a policy rejected on purpose.
    pub rejections: u64,
    /// Rollbacks the operator asked for.
    pub manual_rollbacks: u64,
    /// Rollbacks after a run of failures.
    pub automatic_rollbacks: u64,
    /// Rollbacks after too high a failure rate.
    pub rate_rollbacks: u64,
    /// Policies refused on the way in, by [`PolicyError::REASONS`] index.
    pub refusals: [u64; PolicyError::REASONS.len()],
}

#[derive(Default)]
struct Totals {
    decisions: AtomicU64,
    failures: AtomicU64,
    fallbacks: [AtomicU64; CallFailure::REASONS.len()],
    rejections: AtomicU64,
    manual_rollbacks: AtomicU64,
    automatic_rollbacks: AtomicU64,
    rate_rollbacks: AtomicU64,
    refusals: [AtomicU64; PolicyError::REASONS.len()],
}

/// Earlier policies kept for rollbacks (with a few warm instances each).
const HISTORY: usize = 4;

/// Changes of an endpoint's policy kept for the admin API and page, at most.
pub const CHANGES: usize = 64;

/// One change of an endpoint's policy: a swap, a refusal, a rollback, a shadow attached,
/// removed or promoted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyChange {
    /// When.
    pub at: SystemTime,
    /// `loaded`, `swap`, `refused`, `rollback`, `auto_rollback`, `shadow`,
    /// `shadow_removed` or `promote`.
    pub kind: &'static str,
    /// The policy concerned (`name@version`; empty for a refusal before it loaded).
    pub policy: String,
    /// Its sha256 (empty when unknown).
    pub sha256: String,
    /// What happened, in words.
    pub detail: String,
}

struct Active {
    policy: LoadedPolicy,
    /// The native fallback's configuration: the policy's own if it is `kv-cost`.
    fallback: native::Config,
    generation: u64,
    active_since: SystemTime,
    decisions: AtomicU64,
    failures: AtomicU64,
    fallbacks: AtomicU64,
    rejections: AtomicU64,
    /// Calls and failures in the current rate window.
    window_calls: AtomicU32,
    window_failures: AtomicU32,
}

impl Active {
    fn new(policy: LoadedPolicy, generation: u64) -> Arc<Active> {
        let fallback = if policy.info().name == "kv-cost" {
            native::Config::from_json(&policy.info().config).unwrap_or_default()
        } else {
            native::Config::default()
        };
        Arc::new(Active {
            policy,
            fallback,
            generation,
            active_since: SystemTime::now(),
            decisions: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
            rejections: AtomicU64::new(0),
            window_calls: AtomicU32::new(0),
            window_failures: AtomicU32::new(0),
        })
    }
}

/// Why a policy was rolled back automatically.
#[derive(Debug, Clone, Copy)]
enum Rollback {
    /// A run of consecutive failures.
    Run,
    /// Too high a failure rate over a window.
    Rate,
}

/// An endpoint's policy: decide through it, swap it, roll it back.
pub struct PolicyHandle {
    engine: PolicyEngine,
    /// The current policy. Each decision loads it once and uses only that one;
    /// a swap replaces it whole, so in-flight decisions finish on the old one.
    current: ArcSwap<Active>,
    /// Earlier policies, the most recent last. Only touched by swaps and rollbacks,
    /// which `swap_lock` serialises.
    history: Mutex<VecDeque<LoadedPolicy>>,
    /// Serialises swaps and rollbacks (never taken by a decision).
    swap_lock: Mutex<()>,
    next_generation: AtomicU64,
    sequence: AtomicU64,
    consecutive_failures: AtomicU32,
    rollbacks: AtomicU64,
    totals: Totals,
    seed_base: u64,
    /// The most recent changes, oldest first (at most [`CHANGES`]).
    changes: Mutex<VecDeque<PolicyChange>>,
}

/// `name@version` of a policy.
pub fn policy_label(info: &PolicyInfo) -> String {
    format!("{}@{}", info.name, info.version)
}

impl PolicyHandle {
    /// A handle serving `initial`, which must pass its canary first.
    pub fn new(engine: PolicyEngine, initial: LoadedPolicy) -> Result<PolicyHandle, PolicyError> {
        initial.canary()?;
        let loaded = PolicyChange {
            at: SystemTime::now(),
            kind: "loaded",
            policy: policy_label(initial.info()),
            sha256: initial.info().sha256.clone(),
            detail: format!("serving from {}", initial.info().source),
        };
        let seed_base = {
            use std::hash::{BuildHasher, RandomState};
            RandomState::new().hash_one(SystemTime::now())
        };
        Ok(PolicyHandle {
            engine,
            current: ArcSwap::new(Active::new(initial, 1)),
            history: Mutex::new(VecDeque::new()),
            swap_lock: Mutex::new(()),
            next_generation: AtomicU64::new(2),
            sequence: AtomicU64::new(0),
            consecutive_failures: AtomicU32::new(0),
            rollbacks: AtomicU64::new(0),
            totals: Totals::default(),
            seed_base,
            changes: Mutex::new(VecDeque::from([loaded])),
        })
    }

    /// The engine this handle loads replacements with.
    pub fn engine(&self) -> &PolicyEngine {
        &self.engine
    }

    /// Makes one decision. Never fails: a failed policy call falls back to the native
    /// `kv-cost`. Fills in `req.sequence`, and `req.seed` when it is 0.
    pub fn decide(&self, req: Request, candidates: &Candidates) -> Decision {
        self.decide_counted(req, candidates, true)
    }

    /// A decision nothing is routed on (the admin API's `explain`): made as
    /// [`PolicyHandle::decide`] makes one, but not counted among the decisions made.
    pub fn dry_run(&self, req: Request, candidates: &Candidates) -> Decision {
        self.decide_counted(req, candidates, false)
    }

    fn decide_counted(&self, mut req: Request, candidates: &Candidates, counted: bool) -> Decision {
        let sequence = self.sequence.fetch_add(1, Ordering::Relaxed);
        req.sequence = sequence;
        if req.seed == 0 {
            req.seed = switchyard_cost_model::mix(sequence ^ self.seed_base);
        }
        let active = self.current.load_full();
        if counted {
            active.decisions.fetch_add(1, Ordering::Relaxed);
            self.totals.decisions.fetch_add(1, Ordering::Relaxed);
        }
        let mut decision = Decision {
            outcome: DecisionOutcome::NoCandidates,
            decider: Decider::Policy,
            generation: active.generation,
            sequence,
            seed: req.seed,
            failure: None,
            call_time: std::time::Duration::ZERO,
            prefill: None,
        };
        if candidates.is_empty() {
            return decision;
        }
        let started = std::time::Instant::now();
        let result = active.policy.call(&req, candidates);
        decision.call_time = started.elapsed();
        match result {
            Ok(outcome) => {
                self.consecutive_failures.store(0, Ordering::Relaxed);
                decision.outcome = match outcome {
                    CallOutcome::Chosen(id) => DecisionOutcome::Chosen(id),
                    CallOutcome::Pair { prefill, decode } => {
                        decision.prefill = Some(prefill);
                        DecisionOutcome::Chosen(decode)
                    }
                    CallOutcome::Rejected(r) => {
                        active.rejections.fetch_add(1, Ordering::Relaxed);
                        self.totals.rejections.fetch_add(1, Ordering::Relaxed);
                        DecisionOutcome::Rejected(r)
                    }
                };
            }
            Err(failure) => {
                active.fallbacks.fetch_add(1, Ordering::Relaxed);
                self.totals.fallbacks[failure.reason_index()].fetch_add(1, Ordering::Relaxed);
                decision.outcome = match native::place(&active.fallback, &req, candidates) {
                    Some(CallOutcome::Pair { prefill, decode }) => {
                        decision.prefill = Some(prefill);
                        DecisionOutcome::Chosen(decode)
                    }
                    Some(CallOutcome::Chosen(id)) => DecisionOutcome::Chosen(id),
                    // No placement the fleet allows (a prefill worker but no decode one).
                    Some(CallOutcome::Rejected(r)) => DecisionOutcome::Rejected(r),
                    None => DecisionOutcome::Rejected(Rejection {
                        kind: RejectionKind::NoFit,
                        reason: "no worker, nor prefill and decode pair, can serve this request"
                            .into(),
                    }),
                };
                decision.decider = Decider::Fallback;
                let policys = failure.is_policys();
                decision.failure = Some(failure);
                if !policys {
                    // No idle instance: the host's shortfall, not the policy's failure
                    // (counted as a fallback; the warmer adds an instance).
                    return decision;
                }
                let failures = active.failures.fetch_add(1, Ordering::Relaxed) + 1;
                self.totals.failures.fetch_add(1, Ordering::Relaxed);
                // Log the first failures and then one in a thousand: a broken policy
                // under load must not flood the log.
                if failures <= 10 || failures.is_multiple_of(1000) {
                    tracing::warn!(
                        policy = %active.policy.info().name,
                        sha256 = %active.policy.info().sha256,
                        failures,
                        error = %decision.failure.as_ref().expect("set above"),
                        "policy call failed; native kv-cost decided"
                    );
                }
                active.window_failures.fetch_add(1, Ordering::Relaxed);
                let run = self.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
                let limit = self.engine.config().rollback_after_failures;
                if run >= limit {
                    self.auto_rollback(
                        &active,
                        &format!("failed {run} times in a row"),
                        run == limit,
                        Rollback::Run,
                    );
                }
            }
        }
        // Failures by rate: a policy failing a share of its calls, never five in a row,
        // still costs a fallback and more than its budget on each failure. A window
        // without a failure proves the policy: a later rollback may return to it.
        let cfg = self.engine.config();
        let window = cfg.rollback_window.max(1);
        let calls = active.window_calls.fetch_add(1, Ordering::Relaxed) + 1;
        if calls.is_multiple_of(window) {
            let failures = active.window_failures.swap(0, Ordering::Relaxed);
            if failures == 0 {
                active.policy.mark_proven();
            } else if f64::from(failures) >= cfg.rollback_failure_rate * f64::from(window)
                && cfg.rollback_failure_rate > 0.0
            {
                self.auto_rollback(
                    &active,
                    &format!("failed {failures} of its last {window} calls"),
                    true,
                    Rollback::Rate,
                );
            }
        }
        decision
    }

    /// Validates `new` (canary decision) and makes it current. The replaced policy
    /// becomes the operator's rollback target. A policy that fails its canary is refused
    /// (and counted) and the current one keeps serving.
    pub fn swap(&self, new: LoadedPolicy) -> Result<PolicyStatus, PolicyError> {
        if let Err(e) = new.canary() {
            self.refused(&e);
            return Err(e);
        }
        // Its warm instances are made here, before any request can reach it.
        new.prepare();
        let _guard = self.swap_lock.lock();
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let old = self.current.swap(Active::new(new, generation));
        self.remember(old.policy.clone());
        self.consecutive_failures.store(0, Ordering::Relaxed);
        self.note(
            "swap",
            self.current.load().policy.info(),
            format!("replaced {}", policy_label(old.policy.info())),
        );
        tracing::info!(
            from = %old.policy.info().name,
            to = %self.current.load().policy.info().name,
            generation,
            "policy swapped"
        );
        drop(_guard);
        Ok(self.status())
    }

    /// Loads a policy from `.wasm` bytes and swaps it in (see [`PolicyHandle::swap`]).
    pub fn swap_bytes(
        &self,
        source: super::loaded::PolicySource,
        bytes: &[u8],
        config_json: &str,
    ) -> Result<PolicyStatus, PolicyError> {
        let loaded = self
            .engine
            .load(source, bytes, config_json)
            .inspect_err(|e| self.refused(e))?;
        self.swap(loaded)
    }

    /// Loads a built-in policy or a `.wasm` file by spec and swaps it in.
    pub fn swap_spec(&self, spec: &str, config_json: &str) -> Result<PolicyStatus, PolicyError> {
        let loaded = self
            .engine
            .load_spec(spec, config_json)
            .inspect_err(|e| self.refused(e))?;
        self.swap(loaded)
    }

    /// Counts a policy refused on its way in.
    pub fn refused(&self, e: &PolicyError) {
        self.totals.refusals[e.reason_index()].fetch_add(1, Ordering::Relaxed);
        self.push_change(PolicyChange {
            at: SystemTime::now(),
            kind: "refused",
            policy: String::new(),
            sha256: String::new(),
            detail: e.to_string(),
        });
    }

    /// Records a change of this endpoint's policy (or of its shadow).
    pub fn note(&self, kind: &'static str, policy: &PolicyInfo, detail: String) {
        self.push_change(PolicyChange {
            at: SystemTime::now(),
            kind,
            policy: policy_label(policy),
            sha256: policy.sha256.clone(),
            detail,
        });
    }

    fn push_change(&self, change: PolicyChange) {
        let mut changes = self.changes.lock();
        changes.push_back(change);
        while changes.len() > CHANGES {
            changes.pop_front();
        }
    }

    /// The most recent changes, oldest first.
    pub fn changes(&self) -> Vec<PolicyChange> {
        self.changes.lock().iter().cloned().collect()
    }

    /// Keeps a replaced policy for rollbacks (once, most recent last, at most
    /// [`HISTORY`]), with only a few warm instances.
    fn remember(&self, policy: LoadedPolicy) {
        policy.retire();
        let mut history = self.history.lock();
        history.retain(|p| !p.ptr_eq(&policy));
        history.push_back(policy);
        while history.len() > HISTORY {
            history.pop_front();
        }
    }

    /// Returns to the policy replaced last; the current one becomes the next rollback
    /// target. `None` when there is nothing to return to.
    pub fn rollback(&self) -> Option<PolicyStatus> {
        // Its warm instances are made before the lock is taken: instantiating is slow,
        // and the lock serialises every swap of the endpoint.
        let candidate = self.history.lock().back().cloned()?;
        candidate.prepare();
        let _guard = self.swap_lock.lock();
        let previous = self.history.lock().pop_back()?;
        if !previous.ptr_eq(&candidate) {
            // Racing: a swap or rollback changed the history while the candidate was
            // being prepared; the target now is another policy, prepared here.
            previous.prepare();
        }
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let old = self.current.swap(Active::new(previous, generation));
        self.remember(old.policy.clone());
        self.consecutive_failures.store(0, Ordering::Relaxed);
        self.rollbacks.fetch_add(1, Ordering::Relaxed);
        self.totals.manual_rollbacks.fetch_add(1, Ordering::Relaxed);
        self.note(
            "rollback",
            self.current.load().policy.info(),
            format!(
                "the operator rolled back from {}",
                policy_label(old.policy.info())
            ),
        );
        tracing::warn!(from = %old.policy.info().name, generation, "policy rolled back");
        drop(_guard);
        Some(self.status())
    }

    /// Rolls a failing policy back to the last good one: the most recent earlier policy
    /// that served a clean window (never merely the previous one, which may be failing
    /// too). Runs on a request's thread: it only swaps pointers (the target kept warm
    /// instances; the warmer tops them up), and never waits for the swap lock: when a
    /// swap or another rollback holds it, this decision goes on, and the next failing one
    /// tries again (the failure count is not reset).
    fn auto_rollback(&self, failing: &Arc<Active>, why: &str, log_if_stuck: bool, kind: Rollback) {
        let Some(_guard) = self.swap_lock.try_lock() else {
            return;
        };
        // Racing: another thread may have rolled back or swapped already; only the
        // thread that still sees the failing policy current acts.
        if !Arc::ptr_eq(&self.current.load(), failing) {
            return;
        }
        let target = {
            let mut history = self.history.lock();
            history
                .iter()
                .rposition(LoadedPolicy::proven)
                .and_then(|i| history.remove(i))
        };
        let Some(target) = target else {
            if log_if_stuck {
                tracing::error!(
                    policy = %failing.policy.info().name,
                    why,
                    "policy keeps failing and no earlier policy served a clean window to \
                     roll back to; the native fallback is deciding"
                );
            }
            return;
        };
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        tracing::error!(
            from = %failing.policy.info().name,
            to = %target.info().name,
            why,
            generation,
            "policy rolled back to the last good policy"
        );
        target.refill_soon();
        self.note(
            "auto_rollback",
            target.info(),
            format!("{} {why}", policy_label(failing.policy.info())),
        );
        // The failing policy is dropped, not kept as a rollback target.
        self.current.store(Active::new(target, generation));
        self.consecutive_failures.store(0, Ordering::Relaxed);
        self.rollbacks.fetch_add(1, Ordering::Relaxed);
        match kind {
            Rollback::Run => &self.totals.automatic_rollbacks,
            Rollback::Rate => &self.totals.rate_rollbacks,
        }
        .fetch_add(1, Ordering::Relaxed);
    }

    /// Everything decided through this handle so far, across swaps and rollbacks.
    pub fn totals(&self) -> PolicyTotals {
        let t = &self.totals;
        PolicyTotals {
            decisions: t.decisions.load(Ordering::Relaxed),
            failures: t.failures.load(Ordering::Relaxed),
            fallbacks: t.fallbacks.each_ref().map(|n| n.load(Ordering::Relaxed)),
            rejections: t.rejections.load(Ordering::Relaxed),
            manual_rollbacks: t.manual_rollbacks.load(Ordering::Relaxed),
            automatic_rollbacks: t.automatic_rollbacks.load(Ordering::Relaxed),
            rate_rollbacks: t.rate_rollbacks.load(Ordering::Relaxed),
            refusals: t.refusals.each_ref().map(|n| n.load(Ordering::Relaxed)),
        }
    }

    /// The current policy.
    pub fn current(&self) -> LoadedPolicy {
        self.current.load().policy.clone()
    }

    /// Identity and counters of the current policy.
    pub fn status(&self) -> PolicyStatus {
        let a = self.current.load_full();
        let history = self.history.lock();
        PolicyStatus {
            info: a.policy.info().clone(),
            generation: a.generation,
            decisions: a.decisions.load(Ordering::Relaxed),
            failures: a.failures.load(Ordering::Relaxed),
            fallbacks: a.fallbacks.load(Ordering::Relaxed),
            rejections: a.rejections.load(Ordering::Relaxed),
            active_since: a.active_since,
            previous: history.back().map(|p| p.info().clone()),
            last_good: history
                .iter()
                .rev()
                .find(|p| p.proven())
                .map(|p| p.info().clone()),
            proven: a.policy.proven(),
            rollbacks: self.rollbacks.load(Ordering::Relaxed),
            guest_log_lines: a.policy.guest_log_counts(),
        }
    }
}
