#![doc = "A hostile test policy; see the body of `choose`."]

include!("../../hostile.rs");

hostile_choose! {
    /// Panics on every decision (the guest aborts, the host sees a trap).
    fn choose(req: Request, candidates: Candidates) -> Result<u64, Rejection> {
        if !misbehave(&req) {
            return Ok(candidates.worker_ids[0]);
        }
        panic!("policy bug on decision {}", req.sequence);
    }
}
