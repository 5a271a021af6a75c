//! `kv-cost`: Switchyard's default policy. Sends each request where its prefill plus
//! decode cost is lowest, so requests go to the worker that already caches their prefix
//! unless that worker is much busier. The decision itself lives in
//! `switchyard-cost-model`, shared with the host's native fallback.

use std::cell::Cell;
use switchyard::policy::types::RejectionKind;
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

    fn choose(req: Request, candidates: Candidates) -> Result<u64, Rejection> {
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
        };
        match switchyard_cost_model::choose(&CONFIG.get(), &shape, &view) {
            Some(i) => Ok(candidates.worker_ids[i]),
            None => Err(Rejection {
                kind: RejectionKind::NoFit,
                reason: "no candidates".to_string(),
            }),
        }
    }
}

export!(KvCost);
