//! Predicted latency, per worker, learned online: for a request sent to a worker now,
//! how long until its first token (TTFT) and how long each token after it takes (TPOT).
//!
//! Both are linear fits through the origin with non-negative coefficients, over samples
//! discounted by 1/32 each (recent traffic weighs most):
//!
//! - **TTFT** `= a × (requests ahead + 1) + s × (uncached tokens ahead + its own)`: the
//!   requests ahead are this router's requests on the worker still awaiting their first
//!   token, the tokens ahead their uncached prompt tokens. `s` is the worker's time per
//!   prefilled token; `a` what each request costs besides its tokens: a scheduler step,
//!   the round trip, and, on a worker whose batch is full, the wait for a slot (a
//!   request's turn comes when one ends, whatever its prompt). Learned from every first
//!   token the router sees (a stream's first chunk, a prefill leg's answer), with what
//!   was ahead of its request when it was booked, and from the ones it infers (a whole
//!   answer's duration less its tokens at the predicted TPOT).
//! - **TPOT** `= α + β × requests in flight + γ × uncached tokens pending`: a decode step
//!   grows with the batch it runs, and with the prefill chunks the engine schedules beside
//!   it (vLLM V1 and SGLang compute prompts in chunks within each step's token budget, so
//!   a worker with prefill to do decodes slower). Learned from streams (their time from
//!   first to last token over their tokens after the first) and from what engines report
//!   (the mean inter-token latency between two reads of their `/metrics`).
//!
//! A fit predicts only after [`MIN_SAMPLES`] samples: unknown stays unknown (never
//! zero, never infinite), and a fit of measured samples, once known, stays known (one of
//! estimates that may be negative, whole answers' first tokens, may not). With too
//! little spread in a feature to tell it apart from another (every request alone on the
//! worker, or every prompt the same size) the fit is the best one over fewer features,
//! which predicts right for requests like the ones seen.
//!
//! Pure: time is passed in as durations, and nothing here reads a clock.

use std::time::Duration;

/// Weight left to the past by each sample.
const DECAY: f64 = 1.0 - 1.0 / 32.0;
/// Samples a fit needs before it predicts.
pub const MIN_SAMPLES: u64 = 2;
/// Longest a latency sample may be: anything longer is not a latency (a stuck request
/// released by the hard expiry, a clock jump) and is not learned from.
const MAX_SAMPLE_SECS: f64 = 3600.0;
/// How much less spread than magnitude a feature may have before the two features are
/// taken to be one (the determinant relative to the product of the diagonal).
const COLLINEAR: f64 = 1e-3;

/// Features a fit can take.
const N: usize = 3;

/// `y ≈ c · x` over up to three features with every `c ≥ 0`, least squares over
/// discounted samples. Where the samples cannot tell features apart, or the best fit of
/// all of them has a negative coefficient, the fit is the best over fewer of them: of
/// the subsets whose solution is non-negative, the one leaving the smallest residual
/// (the smaller subset on a tie).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Fit {
    /// `Σ x xᵀ`, `Σ x y` and `Σ y²`, discounted.
    sxx: [[f64; N]; N],
    sxy: [f64; N],
    syy: f64,
    /// Samples taken, undiscounted.
    seen: u64,
    /// The coefficients, solved at each sample (so that a prediction is three products).
    coef: Option<[f64; N]>,
}

impl Fit {
    /// Learns one sample; one with a negative or non-finite value is ignored.
    pub fn add(&mut self, x: [f64; N], y: f64) {
        if y >= 0.0 {
            self.add_estimate(x, y);
        }
    }

    /// Learns one estimated sample, kept whatever its sign (an estimate's noise cut at
    /// zero would bias the fit upwards); one that is not finite is ignored.
    pub fn add_estimate(&mut self, x: [f64; N], y: f64) {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        if !(x.iter().all(|v| ok(*v)) && y.is_finite()) || x.iter().sum::<f64>() == 0.0 {
            return;
        }
        for i in 0..N {
            for j in 0..N {
                self.sxx[i][j] = self.sxx[i][j] * DECAY + x[i] * x[j];
            }
            self.sxy[i] = self.sxy[i] * DECAY + x[i] * y;
        }
        self.syy = self.syy * DECAY + y * y;
        self.seen = self.seen.saturating_add(1);
        self.coef = self.solve();
    }

    fn solve(&self) -> Option<[f64; N]> {
        let mut best: Option<([f64; N], f64, u32)> = None;
        for mask in 1u32..(1 << N) {
            let Some(c) = self.solve_subset(mask) else {
                continue;
            };
            let rss = (self.syy - (0..N).map(|i| c[i] * self.sxy[i]).sum::<f64>()).max(0.0);
            let size = mask.count_ones();
            let better = match best {
                None => true,
                Some((_, r, n)) => {
                    let tol = 1e-9 * self.syy.abs().max(1e-30);
                    rss < r - tol || (rss <= r + tol && size < n)
                }
            };
            if better {
                best = Some((c, rss, size));
            }
        }
        best.map(|(c, _, _)| c)
    }

    /// The least-squares coefficients over the features in `mask` (the others 0), if
    /// each has been seen, the system is well conditioned and every coefficient is
    /// non-negative.
    fn solve_subset(&self, mask: u32) -> Option<[f64; N]> {
        let (mut idx, mut n) = ([0usize; N], 0);
        for i in (0..N).filter(|i| mask & (1 << i) != 0) {
            if self.sxx[i][i] <= 0.0 {
                return None;
            }
            idx[n] = i;
            n += 1;
        }
        // Normalised so that the diagonal is 1: the conditioning test is then scale-free.
        // The right-hand side is the last column.
        let d = idx.map(|i| self.sxx[i][i].sqrt());
        let mut a = [[0.0; N + 1]; N];
        for r in 0..n {
            for c in 0..n {
                a[r][c] = self.sxx[idx[r]][idx[c]] / (d[r] * d[c]);
            }
            a[r][N] = self.sxy[idx[r]] / d[r];
        }
        // Gaussian elimination with partial pivoting.
        let mut det = 1.0;
        for col in 0..n {
            let pivot = (col..n).max_by(|x, y| a[*x][col].abs().total_cmp(&a[*y][col].abs()))?;
            a.swap(col, pivot);
            let p = a[col][col];
            det *= p.abs();
            if p.abs() < 1e-12 {
                return None;
            }
            let pivot_row = a[col];
            for (r, row) in a.iter_mut().enumerate().take(n) {
                if r != col {
                    let f = row[col] / p;
                    for (v, pv) in row.iter_mut().zip(pivot_row).skip(col) {
                        *v -= f * pv;
                    }
                }
            }
        }
        if det < COLLINEAR {
            return None;
        }
        let mut full = [0.0; N];
        for r in 0..n {
            let c = a[r][N] / a[r][r] / d[r];
            if !(c.is_finite() && c >= 0.0) {
                return None;
            }
            full[idx[r]] = c;
        }
        Some(full)
    }

    /// `c · x`, once the fit has seen [`MIN_SAMPLES`] samples.
    pub fn eval(&self, x: [f64; N]) -> Option<f64> {
        let c = self.coefficients()?;
        Some((0..N).map(|i| c[i] * x[i]).sum())
    }

    /// The coefficients, once the fit has seen [`MIN_SAMPLES`] samples.
    pub fn coefficients(&self) -> Option<[f64; N]> {
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
    /// The TTFT fit's features: requests (its own included), then tokens.
    fn ttft_x(&self) -> [f64; N] {
        [
            f64::from(self.ahead_requests) + 1.0,
            self.ahead_tokens.saturating_add(self.uncached) as f64,
            0.0,
        ]
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

/// What a decode ran beside: the requests in flight on its worker and the uncached
/// prompt tokens pending there.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Beside {
    /// Requests in flight.
    pub in_flight: f64,
    /// Uncached prompt tokens pending.
    pub pending_tokens: f64,
}

impl Beside {
    fn ok(&self) -> bool {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        ok(self.in_flight) && ok(self.pending_tokens)
    }

    fn tpot_x(&self) -> [f64; 3] {
        [1.0, self.in_flight.max(1.0), self.pending_tokens]
    }

    /// The mean of two (a decode's start and end).
    pub fn mean(a: Beside, b: Beside) -> Beside {
        Beside {
            in_flight: (a.in_flight + b.in_flight) / 2.0,
            pending_tokens: (a.pending_tokens + b.pending_tokens) / 2.0,
        }
    }
}

/// One worker's latency model (see the module's documentation).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LatencyModel {
    /// TTFT from first tokens seen.
    ttft: Fit,
    /// TTFT from whole answers' first tokens inferred: used only while no first token
    /// seen has taught `ttft` (see [`LatencyModel::learn_inferred_ttft`]).
    ttft_inferred: Fit,
    tpot: Fit,
    /// Output tokens per answer: a discounted sum and weight.
    output: (f64, f64),
    errors: Errors,
    /// The engine's counters on its last page.
    engine: Option<EngineLatency>,
}

impl LatencyModel {
    /// The TTFT fit that predicts: the one of first tokens seen once it is known, else
    /// the one of first tokens inferred.
    fn ttft_fit(&self) -> &Fit {
        if self.ttft.coefficients().is_some() {
            &self.ttft
        } else {
            &self.ttft_inferred
        }
    }

    /// What a request with `f` would see on this worker.
    pub fn predict(&self, f: Features) -> Prediction {
        let beside = Beside {
            in_flight: f64::from(f.in_flight),
            pending_tokens: f.ahead_tokens as f64,
        };
        Prediction {
            ttft: self.ttft_fit().eval(f.ttft_x()).and_then(duration),
            tpot: self.tpot.eval(beside.tpot_x()).and_then(duration),
        }
    }

    /// How long the requests ahead keep a new request from its own prefill: the TTFT
    /// model over what is ahead alone (zero on a worker with nothing pending).
    pub fn wait(&self, f: Features) -> Option<Duration> {
        self.ttft_fit()
            .eval([f64::from(f.ahead_requests), f.ahead_tokens as f64, 0.0])
            .and_then(duration)
    }

    /// A request booked with `f` ahead of it got its first token after `ttft`;
    /// `predicted`, what was predicted for it then, counts towards the error (`None` for
    /// a first token inferred, not seen).
    pub fn learn_ttft(&mut self, f: Features, ttft: Duration, predicted: Option<Duration>) {
        if secs(ttft) > MAX_SAMPLE_SECS {
            return;
        }
        if let Some(p) = predicted {
            self.errors.ttft.add(p, ttft);
        }
        self.ttft.add(f.ttft_x(), secs(ttft));
    }

    /// A whole answer booked with `f` ahead of it took `e2e`, its tokens after the first
    /// `rest` at the predicted time per token: its first token is inferred at their
    /// difference, kept when negative, and teaches a fit of its own that predicts only
    /// while no first token seen has taught one. The inferred first token's error is the
    /// decode's (seconds of it beside a fraction of a second of prefill on B7's mock
    /// fleet): differences dropped below zero kept only the positive half of that noise
    /// and, on that fleet at half its capacity, taught a cost of 46–218 ms a request
    /// where the first tokens of streams teach 0–6 ms, holding whole answers that had
    /// room; and the same estimates beside seen first tokens would pull their fit. Where
    /// they average below zero (the decode predicted long), no non-negative fit exists
    /// and the TTFT stays unknown.
    pub fn learn_inferred_ttft(&mut self, f: Features, e2e: Duration, rest: Duration) {
        let ttft = secs(e2e) - secs(rest);
        if ttft.abs() <= MAX_SAMPLE_SECS {
            self.ttft_inferred.add_estimate(f.ttft_x(), ttft);
        }
    }

    /// A stream's tokens after its first came `tpot` apart, beside `beside` (the mean
    /// over its decode).
    pub fn learn_tpot(&mut self, beside: Beside, tpot: Duration, predicted: Option<Duration>) {
        if secs(tpot) > MAX_SAMPLE_SECS || !beside.ok() {
            return;
        }
        if let Some(p) = predicted {
            self.errors.tpot.add(p, tpot);
        }
        self.tpot.add(beside.tpot_x(), secs(tpot));
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

    /// The engine's page, read beside `beside`: the inter-token latency since its last
    /// page is a TPOT sample (a counter that went back is a restarted engine: a new
    /// start, nothing learned).
    pub fn engine_report(&mut self, now: EngineLatency, beside: Beside) {
        if let Some(before) = self.engine.replace(now) {
            let n = now.itl_count - before.itl_count;
            let sum = now.itl_sum - before.itl_sum;
            if n >= 1.0 && sum >= 0.0 && n.is_finite() && sum.is_finite() && beside.ok() {
                self.tpot.add(beside.tpot_x(), sum / n);
            }
        }
    }

    /// The prediction errors so far.
    pub fn errors(&self) -> Errors {
        self.errors
    }

    /// The TTFT fit's coefficients: seconds per request, seconds per uncached token.
    pub fn ttft_coefficients(&self) -> Option<(f64, f64)> {
        self.ttft_fit().coefficients().map(|c| (c[0], c[1]))
    }

    /// The TPOT fit's coefficients: seconds per step, seconds per request in flight,
    /// seconds per uncached token pending.
    pub fn tpot_coefficients(&self) -> Option<(f64, f64, f64)> {
        self.tpot.coefficients().map(|c| (c[0], c[1], c[2]))
    }

    /// Samples each fit that predicts has taken: TTFT, TPOT.
    pub fn samples(&self) -> (u64, u64) {
        (self.ttft_fit().seen(), self.tpot.seen())
    }
}

#[cfg(test)]
mod tests;
