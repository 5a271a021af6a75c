//! `random`: a uniformly random available worker, from the host's per-decision seed. A
//! baseline for comparing policies.

use switchyard::policy::types::RejectionKind;

wit_bindgen::generate!({ path: "../../wit", world: "policy" });

struct Random;

impl Guest for Random {
    fn configure(config: String) -> Result<(), String> {
        match config.trim() {
            "" | "{}" => Ok(()),
            other => Err(format!("random takes no configuration, got {other}")),
        }
    }

    fn describe() -> Info {
        Info {
            name: "random".to_string(),
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
        // The seed is already uniformly random; multiply-shift maps it to 0..n.
        let i = ((u128::from(req.seed) * u128::from(n)) >> 64) as usize;
        Ok(candidates.worker_ids[i])
    }
}

export!(Random);
