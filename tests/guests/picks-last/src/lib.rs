#![doc = "A test policy that always answers with the last candidate: with the `rounds-ids` policy (the first) live, a shadow that never agrees."]

include!("../../hostile.rs");

hostile_choose! {
    /// Answers with the last candidate.
    fn choose(req: Request, candidates: Candidates) -> Result<u64, Rejection> {
        Ok(candidates.worker_ids.last().copied().unwrap_or(0))
    }
}
