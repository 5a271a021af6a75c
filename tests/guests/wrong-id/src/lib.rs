#![doc = "A hostile test policy; see the body of `choose`."]

include!("../../hostile.rs");

hostile_choose! {
    /// Answers with a worker that is not among the candidates.
    fn choose(req: Request, candidates: Candidates) -> Result<u64, Rejection> {
        if !misbehave(&req) {
            return Ok(candidates.worker_ids[0]);
        }
        Ok(candidates.worker_ids.iter().max().copied().unwrap_or(0) + 1)
    }
}
