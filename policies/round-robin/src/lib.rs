//! `round-robin`: spreads requests evenly over the available workers, ignoring the KV
//! cache. It indexes the candidate list with the host's per-endpoint decision sequence
//! number, not a counter of its own, so the spread stays even when many warm instances
//! decide in parallel.

use switchyard::policy::types::RejectionKind;

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

    fn choose(req: Request, candidates: Candidates) -> Result<u64, Rejection> {
        let n = candidates.worker_ids.len() as u64;
        if n == 0 {
            return Err(Rejection {
                kind: RejectionKind::NoFit,
                reason: "no candidates".to_string(),
            });
        }
        Ok(candidates.worker_ids[(req.sequence % n) as usize])
    }
}

export!(RoundRobin);
