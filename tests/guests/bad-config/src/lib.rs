#![doc = "A hostile test policy; see the body of `choose`."]
use switchyard::policy::types::RejectionKind;

wit_bindgen::generate!({ path: "../../../wit", world: "policy" });

thread_local! {
    static AFTER: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// True when this decision should misbehave (see `configure`).
fn misbehave(req: &Request) -> bool {
    req.sequence >= AFTER.get()
}

struct Hostile;

#[allow(unused_variables)]
impl Guest for Hostile {
    /// Refuses every configuration, so it can never load.
    fn configure(config: String) -> Result<(), String> {
        Err(format!("bad-config refuses {config:?}"))
    }
    fn describe() -> Info {
        Info { name: env!("CARGO_PKG_NAME").to_string(), version: "0.1.0".to_string() }
    }

    fn choose(req: Request, candidates: Candidates) -> Result<u64, Rejection> {
        if !misbehave(&req) {
            return Ok(candidates.worker_ids[0]);
        }
        Ok(candidates.worker_ids[0])
    }
}

#[allow(dead_code)]
fn reject(reason: &str) -> Rejection {
    Rejection { kind: RejectionKind::Refused, reason: reason.to_string() }
}

export!(Hostile);
