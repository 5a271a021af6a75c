//! A policy built against the previous contract, `switchyard:policy@0.1.0`: the host must
//! still load it and hand it the candidates it knows. It picks the candidate with the
//! lowest reported KV usage (a field 0.1.0 has), the lowest ID among equals, and refuses
//! with `no-fit` when none reported one, so that a test sees each field arrive.

use switchyard::policy::types::RejectionKind;

wit_bindgen::generate!({ path: "../../../wit/v0.1.0", world: "policy" });

struct Old;

impl Guest for Old {
    fn configure(_config: String) -> Result<(), String> {
        Ok(())
    }

    fn describe() -> Info {
        Info {
            name: "built-for-0-1".to_string(),
            version: "0.1.0".to_string(),
        }
    }

    fn choose(req: Request, candidates: Candidates) -> Result<u64, Rejection> {
        let best = candidates
            .worker_ids
            .iter()
            .zip(&candidates.kv_usage)
            .filter(|(_, u)| **u >= 0.0)
            .min_by(|a, b| a.1.total_cmp(b.1).then(a.0.cmp(b.0)));
        match best {
            Some((id, _)) => Ok(*id),
            None => Err(Rejection {
                kind: RejectionKind::NoFit,
                reason: format!("no usage reported for a {}-block prompt", req.prompt_blocks),
            }),
        }
    }
}

export!(Old);
