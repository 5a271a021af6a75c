//! What the admin API, the queue and the metrics read of a [`KvRouter`]: saturation,
//! loads, the cache views and the router's counters.

use std::sync::Arc;
use std::time::Instant;

use switchyard_ids::{BlockHash, InstanceId};

use super::KvRouter;
use crate::{CacheView, ViewStatus, central_events, metrics_scraper};

/// What a placement is for: which saturated workers it leaves out, and whether it may
/// answer [`RouteError::Saturated`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Admit {
    /// A request the router forwards whatever the load (no queue, a retry): the
    /// avoided workers are left out while another has room.
    Route,
    /// A request arriving: Saturated when every worker is, else as `Route`.
    Arrive,
    /// A request leaving the queue: only workers below every signal.
    Dispatch,
}

/// A candidate's saturation: by any signal, and by one that keeps new requests away
/// ([`crate::Saturation::avoided`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Saturated {
    pub(super) any: bool,
    pub(super) avoided: bool,
    /// Predicted to miss the request's objectives, which it would meet with nothing
    /// ahead: avoided while a candidate is not, refused when every one is.
    pub(super) late: bool,
}

impl Saturated {
    pub(super) fn is_some(&self) -> bool {
        self.any
    }

    pub(super) fn is_none(&self) -> bool {
        !self.any
    }
}

impl KvRouter {
    /// The routable workers now saturated, and why (see [`crate::Saturation`]).
    pub fn saturated(&self) -> Vec<(InstanceId, &'static str)> {
        let routable = self.client.routable();
        let now = Instant::now();
        let load = self.load.lock();
        routable
            .iter()
            .filter_map(|id| {
                let why = self.config.saturation.reason(&load.load(*id, now))?;
                Some((*id, why))
            })
            .collect()
    }

    /// Why `worker` is saturated, if it is.
    pub fn saturation_of(&self, worker: InstanceId) -> Option<&'static str> {
        let l = self.load.lock().load(worker, Instant::now());
        self.config.saturation.reason(&l)
    }

    /// The longest cached prefix of `hashes` among the workers that are not saturated
    /// (`None`: every worker is): what a queued request would find where it can go now.
    pub fn overlap_with_room(&self, hashes: &[BlockHash]) -> Option<u32> {
        let g = self.gather(&crate::Ask::new(0, hashes), &[]);
        (0..g.candidates.len())
            .filter(|i| g.saturation[*i].is_none())
            .map(|i| g.candidates.row(i).overlap_blocks)
            .max()
    }

    /// Current load of `worker`.
    pub fn load_of(&self, worker: InstanceId) -> switchyard_kv::load::WorkerLoad {
        self.load.lock().load(worker, Instant::now())
    }

    /// `worker`'s latest predictions beside what happened, oldest first.
    pub fn recent_predictions(&self, worker: InstanceId) -> Vec<switchyard_kv::load::Compared> {
        self.load.lock().recent(worker)
    }

    /// Blocks the index says `worker` holds.
    pub fn cached_blocks(&self, worker: InstanceId) -> usize {
        self.index.read().worker_blocks(worker)
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

    /// `worker`'s KV cache size in blocks, if its reports said.
    pub fn known_capacity(&self, worker: InstanceId) -> Option<u64> {
        self.capacities.lock().get(&worker).copied()
    }

    /// Whether clients' `Authorization` header goes on to this endpoint's workers.
    pub fn forwards_authorization(&self) -> bool {
        self.config.forward_authorization
    }

    /// The process's budget for engines' KV event input (shared by every endpoint).
    pub fn event_budget(&self) -> &switchyard_bounded::budget::Budget {
        &self.config.event_budget
    }

    /// The bound sockets engines connect to (central mode), if any.
    pub fn central_events(&self) -> Option<&Arc<central_events::CentralEvents>> {
        self.config.central_events.as_ref()
    }

    /// Counters of the engine-metrics scrapes.
    pub fn scrape_stats(&self) -> &metrics_scraper::ScrapeStats {
        &self.scrape_stats
    }
}
