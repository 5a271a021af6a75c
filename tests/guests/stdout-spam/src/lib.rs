#![doc = "A hostile test policy; see the body of `choose`."]

include!("../../hostile.rs");

hostile_choose! {
    /// Floods stdout and stderr, then decides correctly (the first candidate).
    fn choose(req: Request, candidates: Candidates) -> Result<u64, Rejection> {
        if !misbehave(&req) {
            return Ok(candidates.worker_ids[0]);
        }
        for i in 0..200 {
            println!("spam line {i} of decision {}", req.sequence);
            eprintln!("more spam {i}");
        }
        Ok(candidates.worker_ids[0])
    }
}
