//! `round-robin`: spreads requests evenly over the available workers, ignoring the KV
//! cache. It indexes the candidate list with the host's per-endpoint decision sequence
//! number, not a counter of its own, so the spread stays even when many warm instances
//! decide in parallel. On a fleet that splits prefill from decode it spreads the pairs
//! the same way: the prefill worker over the prefill workers, the decode worker over
//! the decode workers.

use switchyard::policy::types::{Pair, RejectionKind, Role};

wit_bindgen::generate!({ path: "../../wit", world: "policy" });

struct RoundRobin;

impl Guest for RoundRobin {
    fn configure(config: String) -> Result<(), String> {
        match config.trim() {
            "" | "{}" => Ok(()),
            other => Err(format!("round-robin takes no configuration, got {other}")),
        }
    }

    fn describe() -> Info {
        Info {
            name: "round-robin".to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }

    fn choose(req: Request, candidates: Candidates) -> Result<Placement, Rejection> {
        let spread = |ids: &[u64]| ids[(req.sequence % ids.len() as u64) as usize];
        if !candidates.worker_ids.is_empty() && candidates.roles.iter().all(|r| *r == Role::Both) {
            // An aggregated fleet: no copy of the list.
            return Ok(Placement::Worker(spread(&candidates.worker_ids)));
        }
        place(&candidates, req.decode_alone, spread)
    }
}

/// The workers of `role`.
fn of(c: &Candidates, role: Role) -> Vec<u64> {
    (0..c.worker_ids.len())
        .filter(|&i| c.roles[i] == role)
        .map(|i| c.worker_ids[i])
        .collect()
}

/// A `both` worker if there is one; else a prefill and decode pair; else a decode worker
/// alone where the protocol allows it. `pick(ids)` picks one of `ids`.
fn place(
    c: &Candidates,
    decode_alone: bool,
    pick: impl Fn(&[u64]) -> u64,
) -> Result<Placement, Rejection> {
    let both = of(c, Role::Both);
    if !both.is_empty() {
        return Ok(Placement::Worker(pick(&both)));
    }
    let (prefill, decode) = (of(c, Role::Prefill), of(c, Role::Decode));
    match (prefill.is_empty(), decode.is_empty()) {
        (false, false) => Ok(Placement::Pair(Pair {
            prefill: pick(&prefill),
            decode: pick(&decode),
        })),
        (true, false) if decode_alone => Ok(Placement::Worker(pick(&decode))),
        _ => Err(Rejection {
            kind: RejectionKind::NoFit,
            reason: "no worker, nor prefill and decode pair, is available".to_string(),
        }),
    }
}

export!(RoundRobin);
