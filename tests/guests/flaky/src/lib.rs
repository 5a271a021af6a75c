#![doc = "A hostile test policy; see the body of `choose`."]

include!("../../hostile.rs");

thread_local! {
    static EVERY: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

#[allow(unused_variables)]
impl Guest for Hostile {
    /// `{"every": N}`: fail the requests whose seed is a multiple of N.
    fn configure(config: String) -> Result<(), String> {
        let digits: String = config.chars().filter(|c| c.is_ascii_digit()).collect();
        EVERY.set(digits.parse().unwrap_or(0));
        Ok(())
    }

    fn describe() -> Info {
        describe_self()
    }

    /// Panics on one request in N (by seed); canary decisions (sequence 0) pass.
    fn choose(req: Request, candidates: Candidates) -> Result<u64, Rejection> {
        let every = EVERY.get();
        if req.sequence > 0 && every > 0 && req.seed % every == 0 {
            panic!("flaky: failing seed {}", req.seed);
        }
        Ok(candidates.worker_ids[0])
    }
}
