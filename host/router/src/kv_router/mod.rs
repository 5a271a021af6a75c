//! [`KvRouter`]: one per endpoint — candidates from the shared `Client`, the index and
//! the load tracker, decided by the endpoint's policy, booked on the chosen worker.
//!
//! - this module: the router, its shadows, and what answers tell its load tracker
//!   (first tokens, completions, releases);
//! - `place`: one decision (candidates, saturation and predicted latency, the request's
//!   objectives, the policy, the booking);
//! - `views`: what the admin API, the queue and the metrics read.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use arc_swap::ArcSwapOption;
use parking_lot::{Mutex, RwLock};

use crate::client::Client;
use quality::DecisionQuality;
use shadow::{Shadow, ShadowSeries, ShadowStatus};
use switchyard_discovery::EndpointPath;
use switchyard_ids::{BlockHash, InstanceId, RequestId, Role};
use switchyard_kv::approx::ApproxIndex;
use switchyard_kv::engine_metrics::Models;
use switchyard_kv::events::KvEvent;
use switchyard_kv::hash::BlockHasher;
use switchyard_kv::index::OverlapIndex;
use switchyard_kv::load::LoadTracker;
use switchyard_policy::{
    Candidates, Decision, LoadedPolicy, PolicyError, PolicyHandle, PolicyStatus, Request,
    policy_label,
};

use crate::feeds::CacheReports;
use crate::{
    Ask, Index, KvRouterConfig, Prediction, ViewStatus, metrics_scraper, quality, shadow,
    subscriber, unsaturated,
};

/// The KV-aware router of one endpoint.
pub struct KvRouter {
    pub(crate) endpoint: EndpointPath,
    pub(crate) client: Arc<Client>,
    pub(crate) policy: Arc<PolicyHandle>,
    pub(crate) hasher: BlockHasher,
    pub(crate) config: KvRouterConfig,
    /// Read by every decision; written by event subscribers, and by decisions for
    /// workers without events.
    pub(crate) index: RwLock<Index>,
    /// Short critical sections only: read candidates' loads, book, release.
    pub(crate) load: Mutex<LoadTracker>,
    pub(crate) next_request: AtomicU64,
    /// Bookings released by the hard expiry: every path of a request releases its own,
    /// so each one here is a leak.
    pub(crate) expired_bookings: AtomicU64,
    pub(crate) event_stats: subscriber::EventStats,
    pub(crate) cache_reports: CacheReports,
    /// Workers with an event-fed view, and its state; the others are approximate.
    pub(crate) views: RwLock<std::collections::HashMap<InstanceId, ViewStatus>>,
    /// Workers' KV cache sizes in blocks, where their load reports say.
    pub(crate) capacities: Mutex<std::collections::HashMap<InstanceId, u64>>,
    /// What each worker's `/v1/models` said (its context length, whether it is vLLM),
    /// and the longest context of them (0: none known), read by every request.
    pub(crate) models: Mutex<std::collections::HashMap<InstanceId, Models>>,
    pub(crate) context_len: AtomicU64,
    pub(crate) scrape_stats: metrics_scraper::ScrapeStats,
    pub(crate) quality: DecisionQuality,
    /// The candidate policy deciding beside the live one, if any.
    pub(crate) shadow: ArcSwapOption<Shadow>,
    /// Serialises attaching, removing and promoting shadows.
    pub(crate) shadow_lock: Mutex<()>,
    pub(crate) shadow_series: ShadowSeries,
    /// See [`KvRouter::load_changed`].
    pub(crate) load_changed: tokio::sync::Notify,
}

mod place;
mod views;

use views::Saturated;

/// What a decision starts from: the candidates, each one's overlap (sorted by worker),
/// saturation and predicted latency.
struct Gathered {
    candidates: Candidates,
    overlaps: Vec<(InstanceId, u32)>,
    saturation: Vec<Saturated>,
    predictions: Vec<(InstanceId, Prediction)>,
}

impl KvRouter {
    /// A router for `client`'s endpoint deciding with `policy`.
    pub fn new(client: Arc<Client>, policy: Arc<PolicyHandle>, config: KvRouterConfig) -> KvRouter {
        let index = Index {
            events: OverlapIndex::new(),
            predicted: ApproxIndex::new(config.approximate.ttl, config.approximate.max_blocks),
        };
        let load = Mutex::new(LoadTracker::new(config.report_ttl));
        KvRouter {
            endpoint: client.endpoint().clone(),
            hasher: BlockHasher::new(config.block_size, config.hash_seed),
            client,
            policy,
            config,
            index: RwLock::new(index),
            load,
            next_request: AtomicU64::new(1),
            expired_bookings: AtomicU64::new(0),
            cache_reports: CacheReports::default(),
            event_stats: subscriber::EventStats::default(),
            views: RwLock::new(std::collections::HashMap::new()),
            capacities: Mutex::new(std::collections::HashMap::new()),
            models: Mutex::new(std::collections::HashMap::new()),
            context_len: AtomicU64::new(0),
            scrape_stats: metrics_scraper::ScrapeStats::default(),
            quality: DecisionQuality::default(),
            shadow: ArcSwapOption::empty(),
            shadow_lock: Mutex::new(()),
            shadow_series: ShadowSeries::default(),
            load_changed: tokio::sync::Notify::new(),
        }
    }

    /// How good the live decisions have been.
    pub fn quality(&self) -> &DecisionQuality {
        &self.quality
    }

    /// The counters of every shadow identity this endpoint has run.
    pub fn shadow_series(&self) -> &ShadowSeries {
        &self.shadow_series
    }

    /// Attaches `policy` (loaded by the caller; it must pass its canary here) as the
    /// endpoint's shadow, offered a `sample` share of the decisions. Replaces any
    /// shadow attached before.
    pub fn attach_shadow(
        &self,
        policy: LoadedPolicy,
        sample: f64,
    ) -> Result<ShadowStatus, PolicyError> {
        if let Err(e) = policy.canary() {
            self.policy.refused(&e);
            return Err(e);
        }
        let _guard = self.shadow_lock.lock();
        let label = policy_label(policy.info());
        let counters = self.shadow_series.counters(&label);
        let info = policy.info().clone();
        let shadow = Shadow::start(policy, sample, counters, &self.endpoint.to_string())
            .map_err(|e| PolicyError::Runtime(format!("cannot start the shadow's thread: {e}")))?;
        let status = shadow.status();
        self.shadow.store(Some(Arc::new(shadow)));
        self.policy.note(
            "shadow",
            &info,
            format!(
                "deciding beside the live policy on {:.0} % of requests",
                status.sample * 100.0
            ),
        );
        Ok(status)
    }

    /// Removes the shadow; what it did is returned. Its thread ends after the call in
    /// progress; decisions still queued are dropped undecided.
    pub fn detach_shadow(&self) -> Option<ShadowStatus> {
        let _guard = self.shadow_lock.lock();
        let old = self.shadow.swap(None)?;
        let status = old.status();
        self.policy
            .note("shadow_removed", &status.info, "shadow removed".into());
        Some(status)
    }

    /// The shadow now, if one is attached.
    pub fn shadow_status(&self) -> Option<ShadowStatus> {
        self.shadow.load().as_ref().map(|s| s.status())
    }

    /// Makes the shadow the live policy in one step (a swap: the live one becomes the
    /// rollback target) and removes it as a shadow. `None` when there is no shadow; a
    /// swap refused (its canary, run again) leaves the shadow attached.
    pub fn promote_shadow(&self) -> Option<Result<PolicyStatus, PolicyError>> {
        let _guard = self.shadow_lock.lock();
        let shadow = self.shadow.load_full()?;
        let was = shadow.status();
        let status = match self.policy.swap(shadow.policy().clone()) {
            Ok(status) => status,
            Err(e) => return Some(Err(e)),
        };
        self.shadow.store(None);
        self.policy.note(
            "promote",
            &was.info,
            format!(
                "shadow promoted after {} compared decisions ({} agreed)",
                was.tally.compared, was.tally.agreed
            ),
        );
        Some(Ok(status))
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &EndpointPath {
        &self.endpoint
    }

    /// The shared client (the same `Arc` the proxy uses).
    pub fn client(&self) -> &Arc<Client> {
        &self.client
    }

    /// The endpoint's policy.
    pub fn policy(&self) -> &Arc<PolicyHandle> {
        &self.policy
    }

    /// The block hasher (the same chain the workers use).
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// Bookings the hard expiry released (leaks).
    pub fn expired_bookings(&self) -> u64 {
        self.expired_bookings.load(Ordering::Relaxed)
    }

    /// Counters of the KV event subscriptions.
    pub fn event_stats(&self) -> &subscriber::EventStats {
        &self.event_stats
    }

    /// Whether this endpoint's `decode` workers may serve a request alone: true unless
    /// a prefill worker hands over SGLang's way (a bootstrap port), whose decode
    /// workers always need one.
    pub fn decode_alone(&self) -> bool {
        !self
            .client
            .snapshot()
            .instances
            .values()
            .any(|s| s.info.role == Role::Prefill && s.info.bootstrap_port.is_some())
    }

    /// The candidates for a request with these block hashes: every routable instance
    /// (available, or in panic mode every one not known to be unreachable) not in
    /// `exclude`, ascending, with its overlap and load; and the overlaps found (sorted by
    /// worker).
    pub fn candidates(
        &self,
        hashes: &[BlockHash],
        exclude: &[InstanceId],
    ) -> (Candidates, Vec<(InstanceId, u32)>) {
        let g = self.gather(&Ask::new(0, hashes), exclude);
        (g.candidates, g.overlaps)
    }

    /// Woken (one waiter, or the next to wait) whenever a worker's load may have
    /// dropped: a request ended, or a worker reported its load.
    pub fn load_changed(&self) -> &tokio::sync::Notify {
        &self.load_changed
    }

    /// What the router would do with a request, without routing it: the candidates as
    /// the policy would see them (each worker's predicted latency for it among them), and
    /// the policy's decision (nothing is booked or predicted, and it is not counted
    /// among the decisions made). Saturated workers are shown but, as in
    /// [`KvRouter::place`], not offered to the policy while a worker of their role has
    /// room.
    pub fn explain(&self, prompt_tokens: u32, hashes: &[BlockHash]) -> (Candidates, Decision) {
        let ask = Ask::new(prompt_tokens, hashes);
        let Gathered {
            candidates,
            saturation,
            ..
        } = self.gather(&ask, &[]);
        let saturated: Vec<bool> = saturation.iter().map(|s| s.avoided).collect();
        let request = Request {
            decode_alone: !candidates.disaggregated() || self.decode_alone(),
            ..self.request(&ask)
        };
        let decision = if saturated.iter().any(|s| *s) {
            self.policy
                .dry_run(request, &unsaturated(candidates.clone(), &saturated))
        } else {
            self.policy.dry_run(request, &candidates)
        };
        (candidates, decision)
    }

    /// The policy's view of a request.
    fn request(&self, ask: &Ask<'_>) -> Request {
        let ms = |d: std::time::Duration| u32::try_from(d.as_millis()).unwrap_or(u32::MAX);
        Request {
            prompt_tokens: ask.prompt_tokens,
            prompt_blocks: ask.hashes.len() as u32,
            block_size: self.config.block_size,
            session_key: ask.session_key,
            seed: 0,
            sequence: 0,
            decode_alone: true,
            max_tokens: ask.max_tokens,
            ttft_objective_ms: ask.objectives.ttft.map(ms),
            tpot_objective_ms: ask.objectives.tpot.map(ms),
        }
    }

    /// Applies a cache event as if `worker` had sent it (for benchmarks and tools that
    /// feed the index directly).
    pub fn apply_cache_event(&self, worker: InstanceId, event: &KvEvent) {
        self.mark_snapshot(worker);
        self.apply_event(worker, event);
    }

    /// The request's first token arrived.
    pub fn prefill_done(&self, request: RequestId) {
        // A worker's expected wait shrinks with each first token: the queue may place.
        if self.load.lock().prefill_done(request, Instant::now()) {
            self.load_changed.notify_one();
        }
    }

    /// The request is alive (its response is still relaying): its booking is not a leak.
    pub fn touch(&self, request: RequestId) {
        self.load.lock().touch(request, Instant::now());
    }

    /// The request's answer ended complete, with `output_tokens` tokens when its usage
    /// or its stream said: the worker's latency model learns from it, then its booking
    /// is released.
    pub fn complete(&self, request: RequestId, output_tokens: Option<u32>) {
        if self
            .load
            .lock()
            .complete(request, Instant::now(), output_tokens)
        {
            self.load_changed.notify_one();
        }
    }

    /// The request ended, failed or was cancelled.
    pub fn finish(&self, request: RequestId) {
        if self.load.lock().finish(request) {
            self.load_changed.notify_one();
        }
    }
}
