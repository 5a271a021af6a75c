//! A policy built against the contract before predicted latency, `switchyard:policy@0.3.0`:
//! the host must still load it and hand it the request and candidates it knows (no
//! predictions, no objectives). It places a request on the candidate with the most of
//! its prompt cached (the lowest ID among equals), and a split fleet's request on the
//! first prefill worker and the first decode worker.

wit_bindgen::generate!({ path: "../../../wit/v0.3.0", world: "policy" });

use switchyard::policy::types::{Pair, RejectionKind, Role};

struct Old;

impl Guest for Old {
    fn configure(_config: String) -> Result<(), String> {
        Ok(())
    }

    fn describe() -> Info {
        Info {
            name: "built-for-0-3".to_string(),
            version: "0.1.0".to_string(),
        }
    }

    fn choose(_req: Request, c: Candidates) -> Result<Placement, Rejection> {
        let first = |role: Role| {
            c.roles
                .iter()
                .position(|r| *r == role)
                .map(|i| c.worker_ids[i])
        };
        if let (Some(prefill), Some(decode)) = (first(Role::Prefill), first(Role::Decode)) {
            return Ok(Placement::Pair(Pair { prefill, decode }));
        }
        c.worker_ids
            .iter()
            .zip(&c.overlap_blocks)
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
            .map(|(id, _)| Placement::Worker(*id))
            .ok_or(Rejection {
                kind: RejectionKind::NoFit,
                reason: "no candidates".to_string(),
            })
    }
}

export!(Old);
