#![doc = "A test policy that always answers with the first candidate (see `picks-last`)."]

include!("../../hostile.rs");

hostile_choose! {
    /// Answers with the first candidate.
    fn choose(req: Request, candidates: Candidates) -> Result<u64, Rejection> {
        Ok(candidates.worker_ids.first().copied().unwrap_or(0))
    }
}
