//! The native `kv-cost`: the same decision as the built-in policy component (both call
//! `switchyard-cost-model`), used whenever a policy call fails.

use super::types::{Candidates, Request};
use switchyard_cost_model::{KvCostConfig, RequestShape};
use switchyard_ids::InstanceId;

pub use switchyard_cost_model::KvCostConfig as Config;

/// Picks the cheapest candidate (ties and softmax sampling driven by `req.seed`), or
/// `None` when there is no candidate.
pub fn choose(config: &KvCostConfig, req: &Request, candidates: &Candidates) -> Option<InstanceId> {
    let shape = RequestShape {
        prompt_blocks: req.prompt_blocks,
        block_size: req.block_size,
        seed: req.seed,
    };
    switchyard_cost_model::choose(config, &shape, &candidates.view())
        .map(|i| InstanceId(candidates.cols.worker_ids[i]))
}
