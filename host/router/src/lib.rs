//! `KvRouter`: one per endpoint. Builds the candidates of a request — the endpoint's
//! available instances (from the shared `Client`), each with its KV overlap (from the
//! index) and load (from the tracker) — asks the endpoint's policy, validates the
//! answer, and books the request's load on the chosen worker.
//!
//! The router core, embeddable by any front door: [`client`] (an endpoint's available
//! instances, instance-down reports, outlier detection and re-admission), `KvRouter`,
//! and the subscribers that keep its view of the workers' caches and load current.
//!
//! Must not know: wasmtime (it sees `PolicyHandle`), etcd (it sees `Discovery`), HTTP
//! serving.

pub mod central_events;
pub mod client;
pub mod engine_subscriber;
pub mod metrics_scraper;
pub mod quality;
pub mod shadow;
pub mod subscriber;
pub mod zmtp;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use parking_lot::{Mutex, RwLock};

use crate::client::Client;
use quality::DecisionQuality;
use shadow::{Shadow, ShadowSeries, ShadowStatus};
use switchyard_discovery::EndpointPath;
use switchyard_ids::{BlockHash, InstanceId, RequestId};
use switchyard_kv::approx::ApproxIndex;
use switchyard_kv::engine_view::{IndexOp, ViewCounts};
use switchyard_kv::events::KvEvent;
use switchyard_kv::hash::BlockHasher;
use switchyard_kv::index::OverlapIndex;
use switchyard_kv::load::{LoadTracker, ReportedLoad};
use switchyard_policy::{
    CandidateRow, Candidates, Decider, Decision, DecisionOutcome, LoadedPolicy, PolicyError,
    PolicyHandle, PolicyStatus, Rejection, Request, policy_label,
};

/// Approximate mode, for workers that publish no KV events: the router's decisions
/// become predicted cache contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Approximate {
    /// How long a prediction lives.
    pub ttl: Duration,
    /// Most (worker, block) predictions kept.
    pub max_blocks: usize,
}

impl Default for Approximate {
    fn default() -> Self {
        Approximate {
            ttl: Duration::from_secs(120),
            max_blocks: 1 << 20,
        }
    }
}

/// One endpoint's routing configuration.
#[derive(Debug, Clone)]
pub struct KvRouterConfig {
    /// Tokens per KV block (must match the workers').
    pub block_size: u32,
    /// Seed of the block hash chain (must match the workers').
    pub hash_seed: u64,
    /// Predictions for the workers without an event stream (workers with one are
    /// mirrored exactly from their events).
    pub approximate: Approximate,
    /// A booked request still open after this long is released anyway.
    pub load_expiry: Duration,
    /// The trust put in `https://` workers' certificates (event streams, metrics pages).
    pub tls: switchyard_net::upstream::Tls,
    /// The bound sockets engines connect to (central mode), if any.
    pub central_events: Option<Arc<central_events::CentralEvents>>,
    /// Pass clients' `Authorization` header on to this endpoint's workers.
    pub forward_authorization: bool,
    /// How long a worker's load report counts towards its requests in flight.
    pub report_ttl: Duration,
}

impl KvRouterConfig {
    /// Defaults for `block_size`: hash seed 0, predictions for 2 minutes, 10-minute
    /// load expiry.
    pub fn new(block_size: u32) -> KvRouterConfig {
        KvRouterConfig {
            block_size,
            hash_seed: 0,
            approximate: Approximate::default(),
            load_expiry: Duration::from_secs(600),
            tls: switchyard_net::upstream::Tls::default(),
            central_events: None,
            forward_authorization: false,
            report_ttl: switchyard_kv::load::REPORT_TTL,
        }
    }
}

/// Why a request could not be routed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// The endpoint has no available instance (or all were excluded by retries).
    #[error("no available instance for endpoint {endpoint} ({excluded} excluded after failures)")]
    NoInstances {
        /// The endpoint.
        endpoint: String,
        /// Instances excluded by the caller.
        excluded: usize,
    },
    /// Every remaining instance asked for a pause (429/503 with `Retry-After`).
    #[error("every available instance of endpoint {endpoint} is busy; retry after {}s", .retry_after.as_secs().max(1))]
    Busy {
        /// The endpoint.
        endpoint: String,
        /// The shortest pause left.
        retry_after: Duration,
    },
    /// The policy refused the request.
    #[error("the routing policy rejected the request: {}", .0.reason)]
    Rejected(Rejection),
}

/// A routed request. Call [`KvRouter::prefill_done`] at its first token and
/// [`KvRouter::finish`] when it ends, fails or is cancelled.
#[derive(Debug, Clone)]
pub struct Routed {
    /// The chosen worker.
    pub worker: InstanceId,
    /// The load booking.
    pub request: RequestId,
    /// Leading prompt blocks the worker already holds.
    pub overlap_blocks: u32,
    /// Full prompt blocks.
    pub prompt_blocks: u32,
    /// How the policy decided.
    pub decision: Decision,
    /// How long the whole decision took (candidates, overlaps, policy, booking); the
    /// policy's own call is `decision.call_time`.
    pub decision_time: Duration,
}

/// Exact caches of the workers with event streams, predicted caches of the others. A
/// worker is only ever in one of them.
struct Index {
    events: OverlapIndex,
    predicted: ApproxIndex,
}

impl Index {
    fn overlaps(&self, hashes: &[BlockHash], mut f: impl FnMut(InstanceId, u32)) {
        self.events.overlaps(hashes, &mut f);
        self.predicted.index().overlaps(hashes, f);
    }

    fn worker_block_list(&self, worker: InstanceId) -> Vec<BlockHash> {
        let mut v = self.events.worker_block_list(worker);
        v.extend(self.predicted.index().worker_block_list(worker));
        v.sort_unstable();
        v
    }
}

/// The client of the router's background readers (event streams, metrics pages), for
/// `http://` and `https://` workers alike.
fn background_http(
    tls: &switchyard_net::upstream::Tls,
    connect_timeout: Duration,
) -> hyper_util::client::legacy::Client<
    switchyard_net::upstream::Connector,
    http_body_util::Empty<bytes::Bytes>,
> {
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(tls.connector(connect_timeout))
}

/// Where the router's idea of a worker's cache comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheView {
    /// The worker's own events, followed without a gap: exact.
    Events,
    /// Its events, but with a gap not yet refilled (or not yet in sync): the router
    /// blends in its own predictions.
    Incomplete,
    /// No events: predicted from the router's own decisions.
    Approximate,
}

/// A worker's event-fed view, as the subscriber last reported it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ViewStatus {
    /// Every rank in sync, no unfilled gap.
    pub complete: bool,
    /// The engine view's counters (zero for the NDJSON stream).
    pub counts: ViewCounts,
    /// Batches that could not be decoded.
    pub malformed: u64,
    /// Replay requests that failed (each silences replay requests for a while).
    pub replay_failures: u64,
}

/// The KV-aware router of one endpoint.
pub struct KvRouter {
    endpoint: EndpointPath,
    client: Arc<Client>,
    policy: Arc<PolicyHandle>,
    hasher: BlockHasher,
    config: KvRouterConfig,
    /// Read by every decision; written by event subscribers, and by decisions for
    /// workers without events.
    index: RwLock<Index>,
    /// Short critical sections only: read candidates' loads, book, release.
    load: Mutex<LoadTracker>,
    next_request: AtomicU64,
    /// Bookings released by the hard expiry: every path of a request releases its own,
    /// so each one here is a leak.
    expired_bookings: AtomicU64,
    event_stats: subscriber::EventStats,
    cache_reports: CacheReports,
    /// Workers with an event-fed view, and its state; the others are approximate.
    views: RwLock<std::collections::HashMap<InstanceId, ViewStatus>>,
    /// Workers' KV cache sizes in blocks, where their load reports say.
    capacities: Mutex<std::collections::HashMap<InstanceId, u64>>,
    /// Workers' context lengths (`max_model_len` of their `/v1/models`), and the
    /// longest of them (0: none known), read by every request.
    context_lens: Mutex<std::collections::HashMap<InstanceId, u64>>,
    context_len: AtomicU64,
    scrape_stats: metrics_scraper::ScrapeStats,
    quality: DecisionQuality,
    /// The candidate policy deciding beside the live one, if any.
    shadow: ArcSwapOption<Shadow>,
    /// Serialises attaching, removing and promoting shadows.
    shadow_lock: Mutex<()>,
    shadow_series: ShadowSeries,
}

/// Responses in a row whose worker reported a cached prefix that the router had not
/// predicted on that worker, before the router says its tokenization must differ from the workers'.
pub const UNPREDICTED_STREAK: u32 = 32;

/// The warning about it is repeated at most this often.
const UNPREDICTED_WARNING_EVERY: Duration = Duration::from_secs(600);

/// What the workers say they had cached, against what the router predicted: a router
/// whose tokenizer or chat template differs from the workers' hashes other blocks than
/// theirs, so its index never matches a prompt, and KV-aware routing is blind without
/// any error. That shows as workers reporting cached prefixes the router never predicted.
#[derive(Debug, Default)]
struct CacheReports {
    /// Such responses in a row (a predicted hit resets it).
    streak: std::sync::atomic::AtomicU32,
    /// Such responses in all.
    unpredicted: AtomicU64,
    /// Warnings logged.
    warnings: AtomicU64,
    last_warning: Mutex<Option<Instant>>,
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
            context_lens: Mutex::new(std::collections::HashMap::new()),
            context_len: AtomicU64::new(0),
            scrape_stats: metrics_scraper::ScrapeStats::default(),
            quality: DecisionQuality::default(),
            shadow: ArcSwapOption::empty(),
            shadow_lock: Mutex::new(()),
            shadow_series: ShadowSeries::default(),
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

    /// A worker answered: `predicted_blocks` is the overlap the router saw for it when
    /// routing, `cached_tokens` what the worker reports it found cached (`usage`).
    /// Logs a warning (at most every 10 minutes) after [`UNPREDICTED_STREAK`] responses
    /// in a row with a cached prefix of two blocks or more that the router had not predicted on that worker.
    pub fn note_cache_report(&self, predicted_blocks: u32, cached_tokens: u64) {
        let r = &self.cache_reports;
        let block = u64::from(self.config.block_size.max(1));
        self.quality
            .cache_report(u64::from(predicted_blocks) * block, cached_tokens);
        if predicted_blocks > 0 && cached_tokens > 0 {
            r.streak.store(0, Ordering::Relaxed);
            return;
        }
        if predicted_blocks > 0 || cached_tokens < 2 * block {
            return;
        }
        r.unpredicted.fetch_add(1, Ordering::Relaxed);
        if r.streak.fetch_add(1, Ordering::Relaxed) + 1 < UNPREDICTED_STREAK {
            return;
        }
        r.streak.store(0, Ordering::Relaxed);
        let mut last = r.last_warning.lock();
        if last.is_none_or(|t| t.elapsed() >= UNPREDICTED_WARNING_EVERY) {
            *last = Some(Instant::now());
            r.warnings.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                endpoint = %self.endpoint,
                responses = UNPREDICTED_STREAK,
                "workers keep reporting cached prefixes the router had not predicted on them: its \
                 tokenization (tokenizer.json, chat template) or block size evidently differs \
                 from the workers', so KV-aware routing sees no cache; give the router the \
                 workers' tokenizer (--tokenizer) and block size"
            );
        }
    }

    /// Responses whose worker reported a cached prefix the router had not predicted on that worker.
    pub fn unpredicted_cache_hits(&self) -> u64 {
        self.cache_reports.unpredicted.load(Ordering::Relaxed)
    }

    /// Warnings logged about unpredicted cache hits (at most one per 10 minutes).
    pub fn unpredicted_cache_warnings(&self) -> u64 {
        self.cache_reports.warnings.load(Ordering::Relaxed)
    }

    /// Bookings the hard expiry released (leaks).
    pub fn expired_bookings(&self) -> u64 {
        self.expired_bookings.load(Ordering::Relaxed)
    }

    /// Counters of the KV event subscriptions.
    pub fn event_stats(&self) -> &subscriber::EventStats {
        &self.event_stats
    }

    /// Routes a request given its token IDs, avoiding `exclude` (workers that already
    /// failed this request).
    pub fn route(
        &self,
        tokens: &[u32],
        session_key: Option<u64>,
        exclude: &[InstanceId],
    ) -> Result<Routed, RouteError> {
        let hashes = self.hasher.hashes(tokens);
        self.route_blocks(
            tokens.len() as u32,
            &hashes,
            session_key,
            exclude,
            Instant::now(),
        )
    }

    /// Routes a request given its block hashes (`prompt_tokens` may exceed the hashed
    /// blocks by a partial block).
    pub fn route_blocks(
        &self,
        prompt_tokens: u32,
        hashes: &[BlockHash],
        session_key: Option<u64>,
        exclude: &[InstanceId],
        now: Instant,
    ) -> Result<Routed, RouteError> {
        let started = Instant::now();
        let busy = self.client.busy(now);
        let (candidates, _) = if busy.is_empty() {
            self.candidates(hashes, exclude)
        } else {
            let mut skip = exclude.to_vec();
            skip.extend(busy.iter().map(|(id, _)| *id));
            self.candidates(hashes, &skip)
        };
        if candidates.is_empty() {
            let routable = self.client.routable();
            if let Some(retry_after) = busy
                .iter()
                .filter(|(id, _)| routable.contains(id) && !exclude.contains(id))
                .map(|(_, left)| *left)
                .min()
            {
                self.quality.unrouted(1);
                return Err(RouteError::Busy {
                    endpoint: self.endpoint.to_string(),
                    retry_after,
                });
            }
            self.quality.unrouted(0);
            return Err(RouteError::NoInstances {
                endpoint: self.endpoint.to_string(),
                excluded: exclude.len(),
            });
        }
        let prompt_blocks = hashes.len() as u32;
        let request = self.request(prompt_tokens, hashes, session_key);
        let decision = self.policy.decide(request, &candidates);
        if let Some(shadow) = &*self.shadow.load() {
            let live = match &decision.outcome {
                DecisionOutcome::Chosen(id) => Some(*id),
                _ => None,
            };
            let seen = Request {
                sequence: decision.sequence,
                seed: decision.seed,
                ..request
            };
            shadow.offer(decision.sequence, &seen, &candidates, live);
        }
        let worker = match &decision.outcome {
            DecisionOutcome::Chosen(id) => *id,
            DecisionOutcome::Rejected(r) => {
                self.quality.unrouted(quality::rejection_index(r.kind));
                return Err(RouteError::Rejected(r.clone()));
            }
            DecisionOutcome::NoCandidates => {
                self.quality.unrouted(0);
                return Err(RouteError::NoInstances {
                    endpoint: self.endpoint.to_string(),
                    excluded: exclude.len(),
                });
            }
        };
        debug_assert!(decision.decider == Decider::Fallback || candidates.contains(worker));
        let overlap_blocks = candidates.overlap_of(worker).unwrap_or(0);
        self.quality
            .routed(worker, overlap_blocks, candidates.best_overlap());
        let request = RequestId(self.next_request.fetch_add(1, Ordering::Relaxed));
        let uncached = u64::from(prompt_tokens)
            .saturating_sub(u64::from(overlap_blocks) * u64::from(self.config.block_size));
        let expired = {
            let mut load = self.load.lock();
            let expired = load.maybe_expire(now, self.config.load_expiry);
            load.book(request, worker, hashes, uncached, now);
            expired
        };
        if expired > 0 {
            self.expired_bookings
                .fetch_add(expired as u64, Ordering::Relaxed);
            tracing::warn!(endpoint = %self.endpoint, expired, "load bookings leaked and were released by the hard expiry");
        }
        if !self.is_exact(worker) {
            self.index.write().predicted.record(worker, hashes, now);
        }
        let decision_time = started.elapsed();
        self.quality.record_latency(decision_time);
        Ok(Routed {
            worker,
            request,
            overlap_blocks,
            prompt_blocks,
            decision,
            decision_time,
        })
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
        let available = self.client.routable();
        let mut overlaps = Vec::new();
        self.index
            .read()
            .overlaps(hashes, |w, n| overlaps.push((w, n)));
        overlaps.sort_unstable();
        // A worker whose event view is incomplete may have predictions too: the longer wins.
        overlaps.dedup_by(|later, kept| {
            if later.0 == kept.0 {
                kept.1 = kept.1.max(later.1);
                true
            } else {
                false
            }
        });
        let mut candidates = Candidates::with_capacity(available.len());
        let now = Instant::now();
        let load = self.load.lock();
        for &id in available.iter().filter(|id| !exclude.contains(id)) {
            let l = load.load(id, now);
            let cached = overlaps
                .binary_search_by_key(&id, |(w, _)| *w)
                .map_or(0, |i| overlaps[i].1);
            let overlap = load.extend_overlap(id, hashes, cached);
            candidates.push(CandidateRow {
                id,
                overlap_blocks: overlap,
                active_blocks: l.active_blocks,
                pending_prefill_tokens: l.pending_prefill_tokens.min(u64::from(u32::MAX)) as u32,
                in_flight: l.in_flight,
                kv_usage: l.reported.and_then(|r| r.kv_usage()),
            });
        }
        (candidates, overlaps)
    }

    /// What the router would do with a request, without routing it: the candidates as
    /// the policy would see them and the policy's decision (nothing is booked or
    /// predicted; the policy's decision counters do count it).
    pub fn explain(&self, prompt_tokens: u32, hashes: &[BlockHash]) -> (Candidates, Decision) {
        let (candidates, _) = self.candidates(hashes, &[]);
        let decision = self
            .policy
            .decide(self.request(prompt_tokens, hashes, None), &candidates);
        (candidates, decision)
    }

    /// The policy's view of a request with these block hashes.
    fn request(
        &self,
        prompt_tokens: u32,
        hashes: &[BlockHash],
        session_key: Option<u64>,
    ) -> Request {
        Request {
            prompt_tokens,
            prompt_blocks: hashes.len() as u32,
            block_size: self.config.block_size,
            session_key,
            seed: 0,
            sequence: 0,
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
        self.load.lock().prefill_done(request);
    }

    /// The request is alive (its response is still relaying): its booking is not a leak.
    pub fn touch(&self, request: RequestId) {
        self.load.lock().touch(request, Instant::now());
    }

    /// The request ended, failed or was cancelled.
    pub fn finish(&self, request: RequestId) {
        self.load.lock().finish(request);
    }

    /// Current load of `worker`.
    pub fn load_of(&self, worker: InstanceId) -> switchyard_kv::load::WorkerLoad {
        self.load.lock().load(worker, Instant::now())
    }

    /// Blocks the index says `worker` holds.
    pub fn cached_blocks(&self, worker: InstanceId) -> usize {
        let index = self.index.read();
        index.events.worker_blocks(worker) + index.predicted.index().worker_blocks(worker)
    }

    /// Every block the index says `worker` holds, sorted.
    pub fn cached_block_list(&self, worker: InstanceId) -> Vec<BlockHash> {
        self.index.read().worker_block_list(worker)
    }

    /// Whether the router's view of `worker`'s cache is exact (event-fed, in sync).
    pub fn is_exact(&self, worker: InstanceId) -> bool {
        self.views.read().get(&worker).is_some_and(|v| v.complete)
    }

    /// Where the router's view of `worker`'s cache comes from.
    pub fn cache_view(&self, worker: InstanceId) -> CacheView {
        match self.views.read().get(&worker) {
            Some(v) if v.complete => CacheView::Events,
            Some(_) => CacheView::Incomplete,
            None => CacheView::Approximate,
        }
    }

    /// The state of `worker`'s event-fed view, if it has one.
    pub fn view_status(&self, worker: InstanceId) -> Option<ViewStatus> {
        self.views.read().get(&worker).copied()
    }

    /// Whether discovery still lists `worker`: what its event feeds write is kept only
    /// while it does.
    fn is_member(&self, worker: InstanceId) -> bool {
        self.client.snapshot().instances.contains_key(&worker)
    }

    /// The membership fence of every write a worker's feed makes: called *after* the
    /// write. Discovery removes a worker from the snapshot before the subscriber calls
    /// [`KvRouter::drop_worker`], so a write that began before the removal is undone by
    /// that call, and one that ends after it finds the worker gone here and undoes itself.
    /// Racing: a feed task aborted by the subscriber may still be inside a write.
    fn fence(&self, worker: InstanceId) {
        if !self.is_member(worker) {
            self.drop_worker(worker);
        }
    }

    /// Applies changes from `worker`'s events, and the view's new state. A view that
    /// becomes complete drops the worker's predictions.
    pub(crate) fn apply_engine_ops(&self, worker: InstanceId, ops: &[IndexOp], status: ViewStatus) {
        self.apply_engine_ops_unfenced(worker, ops, status);
        self.fence(worker);
    }

    fn apply_engine_ops_unfenced(&self, worker: InstanceId, ops: &[IndexOp], status: ViewStatus) {
        let was_exact = self.is_exact(worker);
        if !ops.is_empty() || (status.complete && !was_exact) {
            let mut index = self.index.write();
            for op in ops {
                match op {
                    IndexOp::Stored(b) => index.events.stored(worker, b),
                    IndexOp::Removed(b) => index.events.removed(worker, b),
                }
            }
            if status.complete && !was_exact {
                index.predicted.remove_worker(worker);
            }
        }
        self.views.write().insert(worker, status);
    }

    /// The worker's NDJSON stream delivered a snapshot: its view is exact.
    fn mark_snapshot(&self, worker: InstanceId) {
        if !self.is_exact(worker) {
            let exact = ViewStatus {
                complete: true,
                ..ViewStatus::default()
            };
            self.apply_engine_ops_unfenced(worker, &[], exact);
        }
    }

    /// Applies one event from `worker`'s stream (the subscriber checks sequence numbers).
    pub(crate) fn apply_event(&self, worker: InstanceId, event: &KvEvent) {
        if matches!(event, KvEvent::Snapshot { .. }) {
            self.mark_snapshot(worker);
        }
        let mut guard = self.index.write();
        let index = &mut guard.events;
        let hashes = |v: &[u64]| v.iter().map(|&h| BlockHash(h)).collect::<Vec<_>>();
        match event {
            KvEvent::Snapshot { blocks, .. } => {
                index.cleared(worker);
                index.stored(worker, &hashes(blocks));
            }
            KvEvent::Stored { blocks, .. } => index.stored(worker, &hashes(blocks)),
            KvEvent::Removed { blocks, .. } => index.removed(worker, &hashes(blocks)),
            KvEvent::Cleared { .. } => index.cleared(worker),
            KvEvent::Load { .. } => {}
        }
        drop(guard);
        self.fence(worker);
    }

    pub(crate) fn report_load(&self, worker: InstanceId, load: ReportedLoad) {
        self.capacities.lock().insert(worker, load.kv_total_blocks);
        self.load.lock().report(worker, load, Instant::now());
        self.fence(worker);
    }

    /// Load read from the worker's engine metrics; `size_known` when they gave the cache
    /// size (not only a usage fraction).
    pub(crate) fn report_engine_load(
        &self,
        worker: InstanceId,
        load: ReportedLoad,
        size_known: bool,
    ) {
        if size_known {
            self.capacities.lock().insert(worker, load.kv_total_blocks);
        }
        self.load.lock().report(worker, load, Instant::now());
        self.fence(worker);
    }

    /// The longest context any of the endpoint's workers takes, in tokens, when their
    /// `/v1/models` said: a longer prompt fits none of them.
    pub fn context_len(&self) -> Option<u64> {
        Some(self.context_len.load(Ordering::Relaxed)).filter(|n| *n > 0)
    }

    /// `worker`'s `/v1/models` gave its context length.
    pub(crate) fn note_context_len(&self, worker: InstanceId, tokens: u64) {
        self.set_context_len(worker, Some(tokens));
        self.fence(worker);
    }

    /// Records (or, with `None`, forgets) `worker`'s context length and the longest.
    fn set_context_len(&self, worker: InstanceId, tokens: Option<u64>) {
        let mut lens = self.context_lens.lock();
        match tokens {
            Some(n) => lens.insert(worker, n),
            None => lens.remove(&worker),
        };
        self.context_len
            .store(lens.values().copied().max().unwrap_or(0), Ordering::Relaxed);
    }

    /// `worker`'s KV cache size in blocks, if its reports said.
    pub fn known_capacity(&self, worker: InstanceId) -> Option<u64> {
        self.capacities.lock().get(&worker).copied()
    }

    /// Whether clients' `Authorization` header goes on to this endpoint's workers.
    pub fn forwards_authorization(&self) -> bool {
        self.config.forward_authorization
    }

    /// The bound sockets engines connect to (central mode), if any.
    pub fn central_events(&self) -> Option<&Arc<central_events::CentralEvents>> {
        self.config.central_events.as_ref()
    }

    /// Counters of the engine-metrics scrapes.
    pub fn scrape_stats(&self) -> &metrics_scraper::ScrapeStats {
        &self.scrape_stats
    }

    /// Forgets a worker that discovery removed.
    pub(crate) fn drop_worker(&self, worker: InstanceId) {
        let mut index = self.index.write();
        index.events.remove_worker(worker);
        index.predicted.remove_worker(worker);
        drop(index);
        self.views.write().remove(&worker);
        self.capacities.lock().remove(&worker);
        self.set_context_len(worker, None);
        self.load.lock().forget_report(worker);
        self.quality.forget(worker);
    }
}
