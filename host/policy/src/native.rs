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

/// Places the request: [`choose`] on an aggregated fleet; on one that splits prefill
/// from decode, one worker or a prefill and decode pair (`switchyard_cost_model::place`).
/// `None` when no placement is possible.
pub fn place(
    config: &KvCostConfig,
    req: &Request,
    candidates: &Candidates,
) -> Option<super::CallOutcome> {
    use super::CallOutcome;
    if !candidates.disaggregated() {
        return choose(config, req, candidates).map(CallOutcome::Chosen);
    }
    let shape = RequestShape {
        prompt_blocks: req.prompt_blocks,
        block_size: req.block_size,
        seed: req.seed,
    };
    let role = |i| match candidates.role(i) {
        switchyard_ids::Role::Both => switchyard_cost_model::Role::Both,
        switchyard_ids::Role::Prefill => switchyard_cost_model::Role::Prefill,
        switchyard_ids::Role::Decode => switchyard_cost_model::Role::Decode,
    };
    let id = |i: usize| InstanceId(candidates.cols.worker_ids[i]);
    Some(
        match switchyard_cost_model::place(
            config,
            &shape,
            &candidates.view(),
            role,
            req.decode_alone,
        )? {
            switchyard_cost_model::Placement::Worker(i) => CallOutcome::Chosen(id(i)),
            switchyard_cost_model::Placement::Pair { prefill, decode } => CallOutcome::Pair {
                prefill: id(prefill),
                decode: id(decode),
            },
        },
    )
}
