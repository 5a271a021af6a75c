//! What the router is told about its workers: cache views and events from the
//! subscribers, load reports, context lengths, and the cached prefixes workers report in
//! their answers (which show a tokenizer that differs from theirs).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::{KvRouter, ViewStatus};
use switchyard_ids::{BlockHash, InstanceId};
use switchyard_kv::engine_metrics::Models;
use switchyard_kv::engine_view::IndexOp;
use switchyard_kv::events::KvEvent;
use switchyard_kv::load::ReportedLoad;

/// Responses in a row whose worker reported a cached prefix that the router had not
/// predicted on that worker, before the router says its tokenization must differ from the workers'.
pub const UNPREDICTED_STREAK: u32 = 32;

/// The warning about it is repeated at most this often.
pub(crate) const UNPREDICTED_WARNING_EVERY: Duration = Duration::from_secs(600);

/// What the workers say they had cached, against what the router predicted: a router
/// whose tokenizer or chat template differs from the workers' hashes other blocks than
/// theirs, so its index never matches a prompt, and KV-aware routing is blind without
/// any error. That shows as workers reporting cached prefixes the router never predicted.
#[derive(Debug, Default)]
pub(crate) struct CacheReports {
    /// Such responses in a row (a predicted hit resets it).
    streak: std::sync::atomic::AtomicU32,
    /// Such responses in all.
    unpredicted: AtomicU64,
    /// Warnings logged.
    warnings: AtomicU64,
    last_warning: Mutex<Option<Instant>>,
}

impl KvRouter {
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

    /// Whether discovery still lists `worker`: what its event feeds write is kept only
    /// while it does.
    pub(crate) fn is_member(&self, worker: InstanceId) -> bool {
        self.client.snapshot().instances.contains_key(&worker)
    }

    /// The membership fence of every write a worker's feed makes: called *after* the
    /// write. Discovery removes a worker from the snapshot before the subscriber calls
    /// [`KvRouter::drop_worker`], so a write that began before the removal is undone by
    /// that call, and one that ends after it finds the worker gone here and undoes itself.
    /// Racing: a feed task aborted by the subscriber may still be inside a write.
    pub(crate) fn fence(&self, worker: InstanceId) {
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

    pub(crate) fn apply_engine_ops_unfenced(
        &self,
        worker: InstanceId,
        ops: &[IndexOp],
        status: ViewStatus,
    ) {
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
    pub(crate) fn mark_snapshot(&self, worker: InstanceId) {
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
        self.load_changed.notify_one();
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
        self.load_changed.notify_one();
        self.fence(worker);
    }

    /// The longest context any of the endpoint's workers takes, in tokens, when their
    /// `/v1/models` said: a longer prompt fits none of them.
    pub fn context_len(&self) -> Option<u64> {
        Some(self.context_len.load(Ordering::Relaxed)).filter(|n| *n > 0)
    }

    /// `worker`'s `/v1/models` answer: its context length (an answer without one keeps
    /// the last known), and whether it is vLLM.
    pub(crate) fn note_models(&self, worker: InstanceId, models: Models) {
        let mut all = self.models.lock();
        let known = all.entry(worker).or_default();
        known.context = models.context.or(known.context);
        known.vllm = models.vllm;
        self.store_longest_context(&all);
        drop(all);
        self.fence(worker);
    }

    /// `worker` is vLLM, by its `/v1/models`: it streams token IDs when asked
    /// (`return_token_ids`).
    pub fn streams_token_ids(&self, worker: InstanceId) -> bool {
        self.models.lock().get(&worker).is_some_and(|m| m.vllm)
    }

    /// The longest context of the workers' `/v1/models`, for every request to read.
    fn store_longest_context(&self, all: &HashMap<InstanceId, Models>) {
        let longest = all.values().filter_map(|m| m.context).max().unwrap_or(0);
        self.context_len.store(longest, Ordering::Relaxed);
    }

    /// Forgets a worker that discovery removed.
    pub(crate) fn drop_worker(&self, worker: InstanceId) {
        let mut index = self.index.write();
        index.events.remove_worker(worker);
        index.predicted.remove_worker(worker);
        drop(index);
        self.views.write().remove(&worker);
        self.capacities.lock().remove(&worker);
        let mut models = self.models.lock();
        models.remove(&worker);
        self.store_longest_context(&models);
        drop(models);
        self.load.lock().forget_report(worker);
        self.quality.forget(worker);
    }
}
