#![doc = "A test policy that passes worker IDs through a double, as a JavaScript policy would."]

include!("../../hostile.rs");

hostile_choose! {
    /// Answers with the first candidate, through an `f64`: exact below 2^53, rounded
    /// (to an ID that is not a candidate) above.
    fn choose(req: Request, candidates: Candidates) -> Result<u64, Rejection> {
        let id = candidates.worker_ids.first().copied().unwrap_or(0);
        Ok(id as f64 as u64)
    }
}
