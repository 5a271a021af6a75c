#![doc = "A hostile test policy; see the body of `choose`."]

include!("../../hostile.rs");

hostile_choose! {
    /// After `after` decisions, sleeps before answering: it waits on a clock, which a
    /// policy may not do.
    fn choose(req: Request, candidates: Candidates) -> Result<u64, Rejection> {
        if misbehave(&req) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        Ok(candidates.worker_ids[0])
    }
}
