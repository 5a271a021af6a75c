//! `kv-cost`: Switchyard's default policy. Sends each request where its prefill plus
//! decode cost is lowest, so requests go to the worker that already caches their prefix
//! unless that worker is much busier; on a fleet that splits prefill from decode, to the
//! prefill and decode pair that does so (or one worker, for a prompt whose uncached
//! part is short). A request's own wait is each worker's predicted time to its first
//! token where the router predicts it. The decision itself lives in
//! `switchyard-cost-model`, shared with the host's native fallback.

use std::cell::Cell;
use switchyard::policy::types::{Pair, RejectionKind, Role};
use switchyard_cost_model as cost;
use switchyard_cost_model::{CandidateView, KvCostConfig, RequestShape};

wit_bindgen::generate!({ path: "../../wit", world: "policy" });

struct KvCost;

thread_local! {
    static CONFIG: Cell<KvCostConfig> = Cell::new(KvCostConfig::default());
}

impl Guest for KvCost {
    fn configure(config: String) -> Result<(), String> {
        let parsed = KvCostConfig::from_json(&config)?;
        CONFIG.set(parsed);
        Ok(())
    }

    fn describe() -> Info {
        Info {
            name: "kv-cost".to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }

    fn choose(req: Request, candidates: Candidates) -> Result<Placement, Rejection> {
        let shape = RequestShape {
            prompt_blocks: req.prompt_blocks,
            block_size: req.block_size,
            seed: req.seed,
        };
        let view = CandidateView {
            overlap_blocks: &candidates.overlap_blocks,
            active_blocks: &candidates.active_blocks,
            pending_prefill_tokens: &candidates.pending_prefill_tokens,
            in_flight: &candidates.in_flight,
            kv_usage: &candidates.kv_usage,
            cache_fullness: &candidates.cache_fullness,
            predicted_ttft_ms: &candidates.predicted_ttft_ms,
        };
        let role = |i: usize| match candidates.roles.get(i) {
            Some(Role::Prefill) => cost::Role::Prefill,
            Some(Role::Decode) => cost::Role::Decode,
            _ => cost::Role::Both,
        };
        let id = |i: usize| candidates.worker_ids[i];
        match switchyard_cost_model::place(&CONFIG.get(), &shape, &view, role, req.decode_alone) {
            Some(cost::Placement::Worker(i)) => Ok(Placement::Worker(id(i))),
            Some(cost::Placement::Pair { prefill, decode }) => Ok(Placement::Pair(Pair {
                prefill: id(prefill),
                decode: id(decode),
            })),
            None => Err(Rejection {
                kind: RejectionKind::NoFit,
                reason: "no worker, nor prefill and decode pair, is available".to_string(),
            }),
        }
    }
}

export!(KvCost);
