#![doc = "A hostile test policy; see the body of `choose`."]

include!("../../hostile.rs");

thread_local! {
    static EVERY: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The number after `"key":` in a flat JSON object, if any.
fn number(config: &str, key: &str) -> Option<u64> {
    let at = config.find(&format!("\"{key}\""))? + key.len() + 2;
    let digits: String = config[at..]
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse().ok()
}

#[allow(unused_variables)]
impl Guest for Hostile {
    /// `{"every": N}`: fail the requests whose seed is a multiple of N. `"spin": K`: spend
    /// K million loop iterations in `configure` (a slow instance to make; the guest has
    /// no clock to wait on).
    fn configure(config: String) -> Result<(), String> {
        EVERY.set(number(&config, "every").unwrap_or(0));
        let mut x = 0u64;
        for i in 0..number(&config, "spin").unwrap_or(0) * 1_000_000 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        std::hint::black_box(x);
        Ok(())
    }

    fn describe() -> Info {
        describe_self()
    }

    /// Panics on one request in N (by seed); canary decisions (sequence 0) pass.
    fn choose(req: Request, candidates: Candidates) -> Result<Placement, Rejection> {
        let every = EVERY.get();
        if req.sequence > 0 && every > 0 && req.seed % every == 0 {
            panic!("flaky: failing seed {}", req.seed);
        }
        Ok(Placement::Worker(candidates.worker_ids[0]))
    }
}
