#![doc = "A hostile test policy; see the body of `choose`."]

include!("../../hostile.rs");

hostile_choose! {
    /// Allocates without bound: only the host's memory cap stops it.
    fn choose(req: Request, candidates: Candidates) -> Result<u64, Rejection> {
        if !misbehave(&req) {
            return Ok(candidates.worker_ids[0]);
        }
        let mut hoard: Vec<Vec<u8>> = Vec::new();
        loop {
            hoard.push(vec![1u8; 1 << 20]);
            std::hint::black_box(&hoard);
        }
    }
}
