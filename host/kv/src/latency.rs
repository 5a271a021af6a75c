//! Predicted latency, per worker, learned online: for a request sent to a worker now,
//! how long until its first token (TTFT) and how long each token after it takes (TPOT).
//!
//! Both are two-feature linear fits through the origin with non-negative coefficients,
//! over samples discounted by 1/32 each (recent traffic weighs most):
//!
//! - **TTFT** `= a × (requests ahead + 1) + s × (uncached tokens ahead + its own)`: the
//!   requests ahead are this router's requests on the worker still awaiting their first
//!   token, the tokens ahead their uncached prompt tokens. `s` is the worker's time per
//!   prefilled token; `a` what each request costs besides its tokens: a scheduler step,
//!   the HTTP round trip, and, on a worker whose batch is full, the wait for a slot (a
//!   request's turn comes when one ends, whatever its prompt). Learned from every first
//!   token the router sees (a stream's first chunk, a prefill leg's answer) and from the
//!   ones it infers (a whole answer's duration less its tokens at the predicted TPOT).
//! - **TPOT** `= α + β × requests in flight`: a decode step grows with the batch it
//!   runs. Learned from streams (their time from first to last token over their tokens
//!   after the first) and from what engines report (the mean inter-token latency
//!   between two scrapes of their `/metrics`, at the load they reported).
//!
//! A fit predicts only after [`MIN_SAMPLES`] samples: unknown stays unknown (never
//! zero, never infinite), and a fit, once known, stays known. With too little spread in
//! one feature to tell the two apart (every request alone on the worker, or every
//! prompt the same size) the fit falls back to the one feature that explains the samples
//! best, which predicts right for requests like them.
//!
//! Pure: time is passed in as durations, and nothing here reads a clock.

use std::time::Duration;

/// Weight left to the past by each sample.
const DECAY: f64 = 1.0 - 1.0 / 32.0;
/// Samples a fit needs before it predicts.
pub const MIN_SAMPLES: u64 = 8;
/// Longest a latency sample may be: anything longer is not a latency (a stuck request
/// released by the hard expiry, a clock jump) and is not learned from.
const MAX_SAMPLE_SECS: f64 = 3600.0;
/// How much less spread than magnitude a feature may have before the two features are
/// taken to be one (the determinant relative to the product of the diagonal).
const COLLINEAR: f64 = 1e-4;

/// `y ≈ c1 × x1 + c2 × x2` with `c1, c2 ≥ 0`, least squares over discounted samples.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Fit {
    s11: f64,
    s12: f64,
    s22: f64,
    s1y: f64,
    s2y: f64,
    syy: f64,
    /// Samples taken, undiscounted.
    seen: u64,
    /// The coefficients, solved at each sample (so that a prediction is two products).
    coef: Option<(f64, f64)>,
}

impl Fit {
    /// Learns one sample; one with a negative or non-finite value is ignored.
    pub fn add(&mut self, x1: f64, x2: f64, y: f64) {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        if !(ok(x1) && ok(x2) && ok(y)) || x1 + x2 == 0.0 {
            return;
        }
        self.s11 = self.s11 * DECAY + x1 * x1;
        self.s12 = self.s12 * DECAY + x1 * x2;
        self.s22 = self.s22 * DECAY + x2 * x2;
        self.s1y = self.s1y * DECAY + x1 * y;
        self.s2y = self.s2y * DECAY + x2 * y;
        self.syy = self.syy * DECAY + y * y;
        self.seen = self.seen.saturating_add(1);
        self.coef = self.solve();
    }

    fn solve(&self) -> Option<(f64, f64)> {
        let det = self.s11 * self.s22 - self.s12 * self.s12;
        if self.s11 > 0.0 && self.s22 > 0.0 && det > COLLINEAR * self.s11 * self.s22 {
            let c1 = (self.s1y * self.s22 - self.s2y * self.s12) / det;
            let c2 = (self.s2y * self.s11 - self.s1y * self.s12) / det;
            if c1 >= 0.0 && c2 >= 0.0 && c1.is_finite() && c2.is_finite() {
                return Some((c1, c2));
            }
        }
        // One feature alone: the one whose fit leaves the smaller residual.
        let one = |sxx: f64, sxy: f64| (sxx > 0.0).then(|| (sxy / sxx, self.syy - sxy * sxy / sxx));
        match (one(self.s11, self.s1y), one(self.s22, self.s2y)) {
            (Some((c1, r1)), Some((c2, r2))) => Some(if r1 <= r2 { (c1, 0.0) } else { (0.0, c2) }),
            (Some((c1, _)), None) => Some((c1, 0.0)),
            (None, Some((c2, _))) => Some((0.0, c2)),
            (None, None) => None,
        }
    }

    /// `c1 × x1 + c2 × x2`, once the fit has seen [`MIN_SAMPLES`] samples.
    pub fn eval(&self, x1: f64, x2: f64) -> Option<f64> {
        let (c1, c2) = self.coefficients()?;
        Some(c1 * x1 + c2 * x2)
    }

    /// The coefficients, once the fit has seen [`MIN_SAMPLES`] samples.
    pub fn coefficients(&self) -> Option<(f64, f64)> {
        self.coef.filter(|_| self.seen >= MIN_SAMPLES)
    }

    /// Samples taken.
    pub fn seen(&self) -> u64 {
        self.seen
    }
}

/// The mean absolute percentage error of predictions, as a sum and a count (what the
/// router exports; their ratio is the error).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ErrorSum {
    /// Sum of `|predicted − observed| / observed`.
    pub sum: f64,
    /// Predictions compared.
    pub count: u64,
}

/// Observed latencies shorter than this count as this long in the error's denominator,
/// so that a cached prompt's 2 ms first token predicted at 4 ms is not a 100 % miss.
const ERROR_FLOOR_SECS: f64 = 0.005;

impl ErrorSum {
    fn add(&mut self, predicted: Duration, observed: Duration) {
        let (p, o) = (predicted.as_secs_f64(), observed.as_secs_f64());
        if !(o.is_finite() && p.is_finite()) || o > MAX_SAMPLE_SECS {
            return;
        }
        self.sum += (p - o).abs() / o.max(ERROR_FLOOR_SECS);
        self.count += 1;
    }

    /// The mean, once anything was compared.
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum / self.count as f64)
    }
}

/// The prediction errors of one worker, by what was predicted.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Errors {
    /// Time to first token, against each first token the router saw.
    pub ttft: ErrorSum,
    /// Time per output token, against each stream's.
    pub tpot: ErrorSum,
    /// A whole answer's duration (TTFT and its tokens at the TPOT), against each
    /// non-streamed answer's.
    pub e2e: ErrorSum,
}

/// What the router knows about a request on a worker when it predicts its latency.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Features {
    /// This router's requests on the worker still awaiting their first token.
    pub ahead_requests: u32,
    /// Their uncached prompt tokens.
    pub ahead_tokens: u64,
    /// The request's own uncached prompt tokens.
    pub uncached: u64,
    /// Requests in flight on the worker, the request itself included.
    pub in_flight: u32,
}

impl Features {
    fn ttft_x(&self) -> (f64, f64) {
        (
            f64::from(self.ahead_requests) + 1.0,
            self.ahead_tokens.saturating_add(self.uncached) as f64,
        )
    }
}

/// What a worker would give a request: its predicted time to first token and time per
/// output token, each `None` while unknown.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Prediction {
    /// Time to first token.
    pub ttft: Option<Duration>,
    /// Time per output token after the first.
    pub tpot: Option<Duration>,
}

impl Prediction {
    /// The whole answer of `output_tokens` tokens: its first token, then the rest at the
    /// TPOT; `None` while either is unknown.
    pub fn e2e(&self, output_tokens: u32) -> Option<Duration> {
        let rest = self.tpot?.checked_mul(output_tokens.saturating_sub(1))?;
        self.ttft?.checked_add(rest)
    }
}

/// What an engine's `/metrics` page says of its latency, as cumulative counters (the
/// router learns from their growth between two pages).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineLatency {
    /// Sum of its inter-token latencies, seconds (a histogram's `_sum`).
    pub itl_sum: f64,
    /// How many there were (the histogram's `_count`).
    pub itl_count: f64,
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn duration(s: f64) -> Option<Duration> {
    Duration::try_from_secs_f64(s).ok()
}

/// One worker's latency model (see the module's documentation).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LatencyModel {
    ttft: Fit,
    tpot: Fit,
    /// Output tokens per answer: a discounted sum and weight.
    output: (f64, f64),
    errors: Errors,
    /// The engine's counters on its last page.
    engine: Option<EngineLatency>,
}

impl LatencyModel {
    /// What a request with `f` would see on this worker.
    pub fn predict(&self, f: Features) -> Prediction {
        let (x1, x2) = f.ttft_x();
        Prediction {
            ttft: self.ttft.eval(x1, x2).and_then(duration),
            tpot: self
                .tpot
                .eval(1.0, f64::from(f.in_flight.max(1)))
                .and_then(duration),
        }
    }

    /// How long the requests ahead keep a new request from its own prefill: the TTFT
    /// model over what is ahead alone (zero on a worker with nothing pending).
    pub fn wait(&self, ahead_requests: u32, ahead_tokens: u64) -> Option<Duration> {
        self.ttft
            .eval(f64::from(ahead_requests), ahead_tokens as f64)
            .and_then(duration)
    }

    /// A request predicted with `f` got its first token after `ttft`; `predicted`, what
    /// was predicted for it then, counts towards the error.
    pub fn learn_ttft(&mut self, f: Features, ttft: Duration, predicted: Option<Duration>) {
        if secs(ttft) > MAX_SAMPLE_SECS {
            return;
        }
        if let Some(p) = predicted {
            self.errors.ttft.add(p, ttft);
        }
        let (x1, x2) = f.ttft_x();
        self.ttft.add(x1, x2, secs(ttft));
    }

    /// A stream's tokens after its first came `tpot` apart, at `in_flight` requests on
    /// the worker (the mean over its decode).
    pub fn learn_tpot(&mut self, in_flight: f64, tpot: Duration, predicted: Option<Duration>) {
        if secs(tpot) > MAX_SAMPLE_SECS || !(in_flight.is_finite() && in_flight >= 0.0) {
            return;
        }
        if let Some(p) = predicted {
            self.errors.tpot.add(p, tpot);
        }
        self.tpot.add(1.0, in_flight.max(1.0), secs(tpot));
    }

    /// A whole answer took `e2e`, `predicted` was its prediction.
    pub fn learn_e2e(&mut self, e2e: Duration, predicted: Option<Duration>) {
        if let Some(p) = predicted {
            self.errors.e2e.add(p, e2e);
        }
    }

    /// An answer had `tokens` output tokens.
    pub fn learn_output(&mut self, tokens: u32) {
        self.output.0 = self.output.0 * DECAY + f64::from(tokens);
        self.output.1 = self.output.1 * DECAY + 1.0;
    }

    /// Output tokens an answer has, on recent answers' mean.
    pub fn expected_output(&self) -> Option<f64> {
        (self.output.1 > 0.0).then(|| self.output.0 / self.output.1)
    }

    /// The engine's page at `in_flight` requests on the worker: the inter-token latency
    /// since its last page is a TPOT sample (a counter that went back is a restarted
    /// engine: a new start, nothing learned).
    pub fn engine_report(&mut self, now: EngineLatency, in_flight: u32) {
        if let Some(before) = self.engine.replace(now) {
            let n = now.itl_count - before.itl_count;
            let sum = now.itl_sum - before.itl_sum;
            if n >= 1.0 && sum >= 0.0 && n.is_finite() && sum.is_finite() {
                self.tpot.add(1.0, f64::from(in_flight.max(1)), sum / n);
            }
        }
    }

    /// The prediction errors so far.
    pub fn errors(&self) -> Errors {
        self.errors
    }

    /// The TTFT fit's coefficients: seconds per request, seconds per uncached token.
    pub fn ttft_coefficients(&self) -> Option<(f64, f64)> {
        self.ttft.coefficients()
    }

    /// The TPOT fit's coefficients: seconds per step, seconds per request in flight.
    pub fn tpot_coefficients(&self) -> Option<(f64, f64)> {
        self.tpot.coefficients()
    }

    /// Samples each fit has taken: TTFT, TPOT.
    pub fn samples(&self) -> (u64, u64) {
        (self.ttft.seen(), self.tpot.seen())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1e3)
    }

    /// A worker prefilling 10,000 tokens a second with 20 ms per request on top: requests
    /// alone and behind others, long prompts and fully cached ones.
    fn worker_at_10k_tokens_a_second() -> LatencyModel {
        let mut m = LatencyModel::default();
        let truth = |f: Features| {
            let (x1, x2) = f.ttft_x();
            ms(20.0 * x1 + 0.1 * x2)
        };
        for i in 0..40u32 {
            let f = Features {
                ahead_requests: i % 4,
                ahead_tokens: u64::from(i % 4) * 1500,
                uncached: [0, 300, 2000, 8000][(i % 3) as usize],
                in_flight: 1 + i % 4,
            };
            m.learn_ttft(f, truth(f), None);
        }
        m
    }

    #[test]
    fn unknown_until_enough_samples_then_known_for_good() {
        let mut m = LatencyModel::default();
        let f = Features {
            uncached: 1000,
            in_flight: 1,
            ..Features::default()
        };
        for i in 0..MIN_SAMPLES {
            assert_eq!(m.predict(f).ttft, None, "after {i} samples");
            m.learn_ttft(f, ms(120.0), None);
        }
        let p = m.predict(f).ttft.expect("known after MIN_SAMPLES");
        assert!((p.as_secs_f64() - 0.12).abs() < 1e-9, "{p:?}");
        assert_eq!(m.predict(f).tpot, None, "no stream seen: TPOT unknown");
        assert_eq!(m.wait(0, 0), Some(Duration::ZERO), "nothing ahead: no wait");
    }

    /// Concurrent requests (others ahead) and cached ones (no uncached tokens): both
    /// coefficients are found, and a request's TTFT follows what is ahead of it.
    #[test]
    fn ttft_is_learned_from_concurrent_and_cached_requests() {
        let m = worker_at_10k_tokens_a_second();
        let (a, s) = m.ttft_coefficients().unwrap();
        assert!(
            (a - 0.020).abs() < 1e-6 && (s - 1e-4).abs() < 1e-9,
            "{a} {s}"
        );
        let cached_alone = Features {
            in_flight: 1,
            ..Features::default()
        };
        assert_eq!(m.predict(cached_alone).ttft, Some(ms(20.0)));
        let behind = Features {
            ahead_requests: 3,
            ahead_tokens: 20_000,
            uncached: 1000,
            in_flight: 4,
        };
        let p = m.predict(behind).ttft.unwrap().as_secs_f64();
        assert!((p - (0.080 + 2.1)).abs() < 1e-6, "{p}");
        let w = m.wait(3, 20_000).unwrap().as_secs_f64();
        assert!((w - 2.06).abs() < 1e-6, "the queue ahead alone: {w}");
    }

    /// Every request alone and every prompt the same size: the two features cannot be
    /// told apart; the fit still predicts such requests right.
    #[test]
    fn one_kind_of_request_is_predicted_from_one_feature() {
        let mut m = LatencyModel::default();
        let f = Features {
            uncached: 500,
            in_flight: 1,
            ..Features::default()
        };
        for _ in 0..20 {
            m.learn_ttft(f, ms(70.0), None);
        }
        let p = m.predict(f).ttft.unwrap().as_secs_f64();
        assert!((p - 0.070).abs() < 1e-9, "{p}");
    }

    /// A worker whose batch is full serves one waiting request per slot freed, whatever
    /// its prompt: the per-request coefficient carries the slot's turnover, so a queue of
    /// short prompts predicts a long wait (the decode-bound overload).
    #[test]
    fn a_full_batch_shows_as_time_per_request_ahead() {
        let mut m = LatencyModel::default();
        // 2 slots, 600 ms per answer: a request's turn every 300 ms; prompts of 20 tokens.
        for i in 0..30u32 {
            let ahead = i % 6;
            let f = Features {
                ahead_requests: ahead,
                ahead_tokens: u64::from(ahead) * 20,
                uncached: 20,
                in_flight: 2 + ahead,
            };
            m.learn_ttft(f, ms(300.0 * f64::from(ahead + 1)), None);
        }
        let w = m.wait(5, 100).unwrap().as_secs_f64();
        assert!((w - 1.5).abs() < 0.01, "five ahead at 300 ms each: {w}");
    }

    #[test]
    fn tpot_grows_with_the_batch_and_engines_teach_it_too() {
        let mut m = LatencyModel::default();
        for b in [1.0, 4.0, 8.0, 16.0] {
            for _ in 0..3 {
                m.learn_tpot(b, ms(10.0 + 0.5 * b), None);
            }
        }
        let at = |n| {
            m.predict(Features {
                in_flight: n,
                ..Features::default()
            })
            .tpot
            .unwrap()
            .as_secs_f64()
        };
        assert!((at(1) - 0.0105).abs() < 1e-9 && (at(32) - 0.026).abs() < 1e-9);
        // From an engine's counters alone: the first page is a start, each later one a
        // sample; a counter going back (a restarted engine) teaches nothing.
        let mut e = LatencyModel::default();
        let mut page = EngineLatency::default();
        for i in 0..=MIN_SAMPLES {
            page.itl_sum += 0.012 * 100.0;
            page.itl_count += 100.0;
            e.engine_report(page, 2);
            let known = e.predict(Features::default()).tpot.is_some();
            assert_eq!(known, i == MIN_SAMPLES, "after {i} pages");
        }
        e.engine_report(EngineLatency::default(), 2);
        assert_eq!(e.samples().1, MIN_SAMPLES);
        let t = e.predict(Features::default()).tpot.unwrap().as_secs_f64();
        assert!((t - 0.012).abs() < 1e-9, "{t}");
    }

    /// Samples from outside that are not latencies (negative, not finite, longer than an
    /// hour) are not learned from, and predictions never come out negative or infinite.
    #[test]
    fn nonsense_is_not_learned() {
        let mut m = worker_at_10k_tokens_a_second();
        let before = m.clone();
        m.learn_ttft(Features::default(), Duration::from_secs(7200), None);
        m.learn_tpot(f64::NAN, ms(10.0), None);
        m.learn_tpot(-3.0, ms(10.0), None);
        m.engine_report(
            EngineLatency {
                itl_sum: f64::INFINITY,
                itl_count: 1e9,
            },
            1,
        );
        assert_eq!(m.ttft_coefficients(), before.ttft_coefficients());
        assert_eq!(m.samples().1, 0);
        let huge = Features {
            ahead_requests: u32::MAX,
            ahead_tokens: u64::MAX,
            uncached: u64::MAX,
            in_flight: u32::MAX,
        };
        let p = m.predict(huge).ttft.unwrap();
        assert!(p > Duration::from_secs(3600), "{p:?}");
    }

    #[test]
    fn errors_are_the_mean_absolute_percentage() {
        let mut m = LatencyModel::default();
        let f = Features::default();
        m.learn_ttft(f, ms(100.0), Some(ms(150.0)));
        m.learn_ttft(f, ms(200.0), Some(ms(180.0)));
        m.learn_ttft(f, ms(1.0), Some(ms(2.0)));
        let e = m.errors().ttft;
        assert_eq!(e.count, 3);
        // 50 %, 10 %, and 1 ms against the 5 ms floor: 20 %.
        assert!((e.mean().unwrap() - (0.5 + 0.1 + 0.2) / 3.0).abs() < 1e-9);
        assert_eq!(m.errors().tpot.mean(), None);
        let p = Prediction {
            ttft: Some(ms(100.0)),
            tpot: Some(ms(10.0)),
        };
        assert_eq!(p.e2e(101), Some(ms(1100.0)));
        assert_eq!(Prediction::default().e2e(5), None);
    }
}
