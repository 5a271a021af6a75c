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
    /// `{"after": N}`: behave (pick the first candidate) for decisions with a sequence
    /// number below N, so the policy passes its canary and misbehaves later.
    fn configure(config: String) -> Result<(), String> {
        let digits: String = config.chars().filter(|c| c.is_ascii_digit()).collect();
        AFTER.set(digits.parse().unwrap_or(0));
        Ok(())
    }
    fn describe() -> Info {
        Info { name: env!("CARGO_PKG_NAME").to_string(), version: "0.1.0".to_string() }
    }

    /// Panics on every decision (the guest aborts, the host sees a trap).
    fn choose(req: Request, candidates: Candidates) -> Result<u64, Rejection> {
        if !misbehave(&req) {
            return Ok(candidates.worker_ids[0]);
        }
        panic!("policy bug on decision {}", req.sequence);
    }
}

#[allow(dead_code)]
fn reject(reason: &str) -> Rejection {
    Rejection { kind: RejectionKind::Refused, reason: reason.to_string() }
}

export!(Hostile);
