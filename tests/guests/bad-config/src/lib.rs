#![doc = "A hostile test policy; see the body of `choose`."]

include!("../../hostile.rs");

#[allow(unused_variables)]
impl Guest for Hostile {
    /// Refuses every configuration, so it can never load.
    fn configure(config: String) -> Result<(), String> {
        Err(format!("bad-config refuses {config:?}"))
    }

    fn describe() -> Info {
        describe_self()
    }

    fn choose(req: Request, candidates: Candidates) -> Result<Placement, Rejection> {
        Ok(Placement::Worker(candidates.worker_ids[0]))
    }
}
