//! A policy built against the contract before disaggregation, `switchyard:policy@0.2.0`:
//! the host must still load it, hand it the candidates it knows, and on a fleet that
//! splits prefill from decode ask it once per role. It picks the candidate whose prefix
//! cache is least full (a field 0.2.0 added), the lowest ID among equals.

wit_bindgen::generate!({ path: "../../../wit/v0.2.0", world: "policy" });

struct Old;

impl Guest for Old {
    fn configure(_config: String) -> Result<(), String> {
        Ok(())
    }

    fn describe() -> Info {
        Info {
            name: "built-for-0-2".to_string(),
            version: "0.1.0".to_string(),
        }
    }

    fn choose(_req: Request, candidates: Candidates) -> Result<u64, Rejection> {
        let best = candidates
            .worker_ids
            .iter()
            .zip(&candidates.cache_fullness)
            .min_by(|a, b| a.1.total_cmp(b.1).then(a.0.cmp(b.0)))
            .map(|(id, _)| *id);
        best.ok_or(Rejection {
            kind: switchyard::policy::types::RejectionKind::NoFit,
            reason: "no candidates".to_string(),
        })
    }
}

export!(Old);
