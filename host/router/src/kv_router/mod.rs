//! [`KvRouter`]: one per endpoint — candidates from the shared `Client`, the index and
//! the load tracker, decided by the endpoint's policy, booked on the chosen worker.

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
use switchyard_kv::events::KvEvent;
use switchyard_kv::hash::BlockHasher;
use switchyard_kv::index::OverlapIndex;
use switchyard_kv::load::LoadTracker;
use switchyard_policy::{
    CandidateRow, Candidates, Decider, Decision, DecisionOutcome, LoadedPolicy, PolicyError,
    PolicyHandle, PolicyStatus, Request, policy_label,
};

use crate::feeds::CacheReports;
use crate::{
    Index, KvRouterConfig, Placing, PrefillLeg, RouteError, Routed, ViewStatus, metrics_scraper,
    quality, shadow, subscriber, unsaturated,
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
    /// Workers' context lengths (`max_model_len` of their `/v1/models`), and the
    /// longest of them (0: none known), read by every request.
    pub(crate) context_lens: Mutex<std::collections::HashMap<InstanceId, u64>>,
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

mod views;

use views::{Admit, Saturated};

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
        self.place(
            prompt_tokens,
            hashes,
            session_key,
            exclude,
            now,
            Placing::Any,
        )
    }

    /// [`KvRouter::route_blocks`] on the workers `placing` allows. Saturated workers are
    /// left out while a worker of their role is not; when every one is, the request is
    /// placed among them all.
    pub fn place(
        &self,
        prompt_tokens: u32,
        hashes: &[BlockHash],
        session_key: Option<u64>,
        exclude: &[InstanceId],
        now: Instant,
        placing: Placing,
    ) -> Result<Routed, RouteError> {
        self.place_as(
            prompt_tokens,
            hashes,
            session_key,
            exclude,
            now,
            placing,
            Admit::Route,
        )
    }

    /// [`KvRouter::place`] for a request arriving, but [`RouteError::Saturated`] when
    /// every candidate is saturated: the caller queues the request and places it with
    /// [`KvRouter::dispatch`] when [`KvRouter::load_changed`] says so.
    pub fn try_place(
        &self,
        prompt_tokens: u32,
        hashes: &[BlockHash],
        session_key: Option<u64>,
        now: Instant,
    ) -> Result<Routed, RouteError> {
        self.place_as(
            prompt_tokens,
            hashes,
            session_key,
            &[],
            now,
            Placing::Any,
            Admit::Arrive,
        )
    }

    /// [`KvRouter::try_place`] for a request leaving the router's queue: only workers
    /// below every saturation signal, the expected wait included, are offered to the
    /// policy (the queue would otherwise empty itself onto saturated workers while one
    /// had room).
    pub fn dispatch(
        &self,
        prompt_tokens: u32,
        hashes: &[BlockHash],
        session_key: Option<u64>,
        now: Instant,
    ) -> Result<Routed, RouteError> {
        self.place_as(
            prompt_tokens,
            hashes,
            session_key,
            &[],
            now,
            Placing::Any,
            Admit::Dispatch,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn place_as(
        &self,
        prompt_tokens: u32,
        hashes: &[BlockHash],
        session_key: Option<u64>,
        exclude: &[InstanceId],
        now: Instant,
        placing: Placing,
        admit: Admit,
    ) -> Result<Routed, RouteError> {
        let started = Instant::now();
        let busy = self.client.busy(now);
        let (mut candidates, _, saturation) = if busy.is_empty() {
            self.gather(hashes, exclude)
        } else {
            let mut skip = exclude.to_vec();
            skip.extend(busy.iter().map(|(id, _)| *id));
            self.gather(hashes, &skip)
        };
        let saturated: Vec<bool> = saturation.iter().map(|s| s.is_some()).collect();
        if admit != Admit::Route && !saturated.is_empty() && saturated.iter().all(|s| *s) {
            return Err(RouteError::Saturated {
                endpoint: self.endpoint.to_string(),
                workers: saturated.len(),
            });
        }
        let left_out: Vec<bool> = if admit == Admit::Dispatch {
            saturated
        } else {
            saturation.iter().map(|s| s.avoided).collect()
        };
        if left_out.iter().any(|s| *s) {
            candidates = unsaturated(candidates, &left_out);
        }
        let mut decode_alone = true;
        if candidates.disaggregated() {
            decode_alone = self.decode_alone();
            let keep = |role: Role| match placing {
                Placing::Any => true,
                Placing::Alone => role == Role::Both || (decode_alone && role == Role::Decode),
                Placing::Decode => role == Role::Decode,
            };
            if placing != Placing::Any {
                candidates = (0..candidates.len())
                    .map(|i| candidates.row(i))
                    .filter(|r| keep(r.role))
                    .collect();
            }
            if placing == Placing::Decode {
                decode_alone = true;
            }
        }
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
        let request = Request {
            decode_alone,
            ..self.request(prompt_tokens, hashes, session_key)
        };
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
        let block_size = u64::from(self.config.block_size);
        let prefill = decision.prefill.map(|p| PrefillLeg {
            worker: p,
            request: RequestId(self.next_request.fetch_add(1, Ordering::Relaxed)),
            overlap_blocks: candidates.overlap_of(p).unwrap_or(0),
        });
        // The prompt's blocks are computed where its prefill runs.
        let (computes, computed_overlap) =
            prefill.map_or((worker, overlap_blocks), |p| (p.worker, p.overlap_blocks));
        self.quality
            .routed(computes, computed_overlap, candidates.best_overlap());
        let request = RequestId(self.next_request.fetch_add(1, Ordering::Relaxed));
        let uncached =
            |overlap: u32| u64::from(prompt_tokens).saturating_sub(u64::from(overlap) * block_size);
        let expired = {
            let mut load = self.load.lock();
            let expired = load.maybe_expire(now, self.config.load_expiry);
            match prefill {
                None => load.book(request, worker, hashes, uncached(overlap_blocks), now),
                Some(p) => {
                    load.book(p.request, p.worker, hashes, uncached(p.overlap_blocks), now);
                    // The decode worker receives the full blocks: it computes the rest.
                    load.book(request, worker, hashes, uncached(prompt_blocks), now);
                }
            }
            expired
        };
        if expired > 0 {
            self.expired_bookings
                .fetch_add(expired as u64, Ordering::Relaxed);
            tracing::warn!(endpoint = %self.endpoint, expired, "load bookings leaked and were released by the hard expiry");
        }
        // Both workers of a split hold the prompt's blocks after it.
        for w in std::iter::once(worker).chain(prefill.map(|p| p.worker)) {
            if !self.is_exact(w) {
                self.index.write().predicted.record(w, hashes, now);
            }
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
            prefill,
        })
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
        let (candidates, overlaps, _) = self.gather(hashes, exclude);
        (candidates, overlaps)
    }

    /// Woken (one waiter, or the next to wait) whenever a worker's load may have
    /// dropped: a request ended, or a worker reported its load.
    pub fn load_changed(&self) -> &tokio::sync::Notify {
        &self.load_changed
    }

    /// [`KvRouter::candidates`], and whether each candidate is saturated.
    #[allow(clippy::type_complexity)]
    fn gather(
        &self,
        hashes: &[BlockHash],
        exclude: &[InstanceId],
    ) -> (Candidates, Vec<(InstanceId, u32)>, Vec<Saturated>) {
        let snapshot = self.client.snapshot();
        let available = snapshot.routable.clone();
        let mut overlaps = Vec::new();
        // Each candidate's cache fullness: the blocks the index holds for it over its
        // cache size, where its reports gave one.
        let fullness: Vec<Option<f32>> = {
            let index = self.index.read();
            index.overlaps(hashes, |w, n| overlaps.push((w, n)));
            let capacities = self.capacities.lock();
            available
                .iter()
                .map(|id| {
                    let capacity = *capacities.get(id).filter(|c| **c > 0)?;
                    Some((index.worker_blocks(*id) as f64 / capacity as f64).min(1.0) as f32)
                })
                .collect()
        };
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
        let mut saturated = Vec::with_capacity(available.len());
        let now = Instant::now();
        let load = self.load.lock();
        for (&id, &cache_fullness) in available.iter().zip(&fullness) {
            if exclude.contains(&id) {
                continue;
            }
            let l = load.load(id, now);
            let cached = overlaps
                .binary_search_by_key(&id, |(w, _)| *w)
                .map_or(0, |i| overlaps[i].1);
            let overlap = load.extend_overlap(id, hashes, cached);
            let sat = &self.config.saturation;
            saturated.push(Saturated {
                any: sat.reason(&l).is_some(),
                avoided: sat.avoided(&l).is_some(),
            });
            candidates.push(CandidateRow {
                id,
                overlap_blocks: overlap,
                active_blocks: l.active_blocks,
                pending_prefill_tokens: l.pending_prefill_tokens.min(u64::from(u32::MAX)) as u32,
                in_flight: l.in_flight,
                kv_usage: l.reported.and_then(|r| r.kv_usage()),
                cache_fullness,
                role: snapshot
                    .instances
                    .get(&id)
                    .map_or(Role::Both, |s| s.info.role),
            });
        }
        (candidates, overlaps, saturated)
    }

    /// What the router would do with a request, without routing it: the candidates as
    /// the policy would see them and the policy's decision (nothing is booked or
    /// predicted, and it is not counted among the decisions made).
    /// Saturated workers are shown but, as in [`KvRouter::place`], not offered to the
    /// policy while a worker of their role has room.
    pub fn explain(&self, prompt_tokens: u32, hashes: &[BlockHash]) -> (Candidates, Decision) {
        let (candidates, _, saturation) = self.gather(hashes, &[]);
        let saturated: Vec<bool> = saturation.iter().map(|s| s.avoided).collect();
        let request = Request {
            decode_alone: !candidates.disaggregated() || self.decode_alone(),
            ..self.request(prompt_tokens, hashes, None)
        };
        let decision = if saturated.iter().any(|s| *s) {
            self.policy
                .dry_run(request, &unsaturated(candidates.clone(), &saturated))
        } else {
            self.policy.dry_run(request, &candidates)
        };
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
            decode_alone: true,
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

    /// The request ended, failed or was cancelled.
    pub fn finish(&self, request: RequestId) {
        if self.load.lock().finish(request) {
            self.load_changed.notify_one();
        }
    }
}
