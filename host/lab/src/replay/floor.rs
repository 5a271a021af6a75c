//! The oracle floor of a run's time to first token: each request alone on a worker that
//! holds every block any earlier request of the trace left there, so that only its
//! never-seen tokens are prefilled, with no queue ahead of it — what no router can beat
//! on this fleet. Routers are read as a ratio to it: how close to the limit, not only how
//! far ahead of one another (peers at the same hit-rate bound can all be far from it).

use switchyard_worker::EngineConfig;

/// The floor of one request whose prompt has `never_seen` tokens no earlier request had,
/// on a mock engine of `engine`'s timing, in simulated seconds: its prefill chunks, each
/// a step of the engine alone (the step's fixed cost and one sequence), as the mock times
/// them (a prompt found whole still computes its last token).
pub fn oracle_ttft(never_seen: u64, engine: &EngineConfig) -> f64 {
    let t = &engine.timing;
    let tokens = never_seen.max(1);
    let steps = match engine.max_batched_tokens {
        0 => 1,
        budget => tokens.div_ceil(budget),
    };
    let us = t.prefill_us_per_token * tokens as f64
        + steps as f64 * (t.decode_base_us + t.decode_us_per_seq);
    us / 1e6
}

/// Real engines' floor, from their measured timing (`tools/engine-stage.py`, idle, one
/// request at a time): a request whose prompt was all seen before costs `fixed_s` (the
/// cached prefill, its last token computed), and every never-seen token `per_token_s`
/// more (the cold prefill's cost over the cached one's, per token).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measured {
    /// A request whose prompt was all seen before, seconds.
    pub fixed_s: f64,
    /// Each never-seen token, seconds.
    pub per_token_s: f64,
}

impl Measured {
    /// Reads `FIXED_MS,MS_PER_1K_TOKENS` (both finite, not negative).
    pub fn parse(text: &str) -> Result<Measured, String> {
        let bad =
            || format!("--engine-floor {text:?}: want FIXED_MS,MS_PER_1K_TOKENS (e.g. 9.4,9.5)");
        let (a, b) = text.split_once(',').ok_or_else(bad)?;
        let num = |s: &str| {
            s.trim()
                .parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(bad)
        };
        Ok(Measured {
            fixed_s: num(a)? / 1e3,
            per_token_s: num(b)? / 1e6,
        })
    }

    /// The floor of a request with `never_seen` tokens no earlier request had, seconds.
    pub fn ttft(&self, never_seen: u64) -> f64 {
        self.fixed_s + self.per_token_s * never_seen as f64
    }
}

/// A run's time to first token over its floor: the mean of the requests served over the
/// mean of their floors, and the same for the 99th percentiles; `None` without floors
/// (engines whose timing the lab does not know).
pub fn ratios(served: &[(f64, f64)]) -> Option<[f64; 2]> {
    if served.is_empty() {
        return None;
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (mut ttft, mut floor): (Vec<f64>, Vec<f64>) = served.iter().copied().unzip();
    ttft.sort_by(f64::total_cmp);
    floor.sort_by(f64::total_cmp);
    let p99 = |v: &[f64]| super::stats::percentile(v, 0.99);
    let ratio = |a: f64, b: f64| (b > 0.0).then_some(a / b);
    Some([
        ratio(mean(&ttft), mean(&floor))?,
        ratio(p99(&ttft), p99(&floor))?,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_worker::TimingModel;

    fn engine(budget: u64) -> EngineConfig {
        EngineConfig {
            block_size: 64,
            kv_blocks: 1024,
            max_batch: 8,
            speedup: 10.0,
            max_batched_tokens: budget,
            timing: TimingModel {
                prefill_us_per_token: 60.0,
                decode_base_us: 10_000.0,
                decode_us_per_seq: 150.0,
            },
            max_model_len: None,
            eos_period: 0,
            stream_interval: 1,
        }
    }

    #[test]
    fn a_measured_floor_reads_and_prices_never_seen_tokens() {
        let m = Measured::parse("9.5, 10").unwrap();
        assert!((m.ttft(0) - 0.0095).abs() < 1e-12);
        assert!((m.ttft(2000) - 0.0295).abs() < 1e-12);
        for bad in ["", "9", "a,1", "1,-1", "NaN,1", "1,inf"] {
            assert!(Measured::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_floor_is_the_never_seen_prefill_in_the_engines_own_steps() {
        // 20,000 tokens in three chunks of 8,192: 1.2 s of prefill and three steps.
        let f = oracle_ttft(20_000, &engine(8192));
        assert!((f - (1.2 + 3.0 * 0.01015)).abs() < 1e-9, "{f}");
        // A prompt found whole computes its last token, in one step.
        assert!((oracle_ttft(0, &engine(8192)) - (60e-6 + 0.01015)).abs() < 1e-9);
        assert!((oracle_ttft(20_000, &engine(0)) - (1.2 + 0.01015)).abs() < 1e-9);
    }

    #[test]
    fn a_run_is_read_as_a_ratio_to_its_floor() {
        let served: Vec<(f64, f64)> = (1..=100)
            .map(|i| (2.0 * f64::from(i), f64::from(i)))
            .collect();
        let r = ratios(&served).unwrap();
        assert!(
            (r[0] - 2.0).abs() < 1e-9 && (r[1] - 2.0).abs() < 1e-9,
            "{r:?}"
        );
        assert_eq!(ratios(&[]), None);
        assert_eq!(ratios(&[(1.0, 0.0)]), None);
    }
}
