#![doc = "A hostile test policy; see the body of `choose`."]

include!("../../hostile.rs");

#[allow(unused_variables)]
impl Guest for Hostile {
    fn configure(config: String) -> Result<(), String> {
        configure_after(&config)
    }

    /// A name that would forge a metrics line and a version far too long.
    fn describe() -> Info {
        Info {
            name: "loud\"} 1\nforged_metric{x=\"".to_string(),
            version: "9".repeat(10_000),
        }
    }

    /// After `after` decisions, refuses every request with a 4 MB reason full of newlines.
    fn choose(req: Request, candidates: Candidates) -> Result<Placement, Rejection> {
        if misbehave(&req) {
            return Err(reject(&"too loud\n".repeat(450_000)));
        }
        Ok(Placement::Worker(candidates.worker_ids[0]))
    }
}
