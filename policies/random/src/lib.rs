//! `random`: a uniformly random available worker, from the host's per-decision seed. A
//! baseline for comparing policies.

use switchyard::policy::types::{Pair, RejectionKind, Role};

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

    fn choose(req: Request, candidates: Candidates) -> Result<Placement, Rejection> {
        // The seed is already uniformly random; multiply-shift maps it to 0..n (the
        // decode worker from other bits than the prefill worker).
        let pick = |ids: &[u64], salt: u32| {
            let bits = req.seed.rotate_left(salt);
            ids[((u128::from(bits) * ids.len() as u128) >> 64) as usize]
        };
        if !candidates.worker_ids.is_empty() && candidates.roles.iter().all(|r| *r == Role::Both) {
            // An aggregated fleet: no copy of the list.
            return Ok(Placement::Worker(pick(&candidates.worker_ids, 0)));
        }
        let of = |role: Role| -> Vec<u64> {
            (0..candidates.worker_ids.len())
                .filter(|&i| candidates.roles[i] == role)
                .map(|i| candidates.worker_ids[i])
                .collect()
        };
        let both = of(Role::Both);
        if !both.is_empty() {
            return Ok(Placement::Worker(pick(&both, 0)));
        }
        let (prefill, decode) = (of(Role::Prefill), of(Role::Decode));
        match (prefill.is_empty(), decode.is_empty()) {
            (false, false) => Ok(Placement::Pair(Pair {
                prefill: pick(&prefill, 0),
                decode: pick(&decode, 32),
            })),
            (true, false) if req.decode_alone => Ok(Placement::Worker(pick(&decode, 0))),
            _ => Err(Rejection {
                kind: RejectionKind::NoFit,
                reason: "no worker, nor prefill and decode pair, is available".to_string(),
            }),
        }
    }
}

export!(Random);
