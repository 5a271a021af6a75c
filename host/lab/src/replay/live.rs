//! What a router reports about itself on its `/metrics` (Switchyard's own histograms and
//! prediction errors), read after a run.

/// Latency quantiles a router reports about itself in Prometheus histograms (Switchyard's
/// `/metrics`), seconds.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct LiveTimings {
    /// Routing decisions observed.
    pub decisions: u64,
    /// Decision latency (candidates, overlaps, policy call, booking): p50, p99.
    pub decision: [f64; 2],
    /// The policy call alone: p50, p99.
    pub policy_call: [f64; 2],
    /// Tokenizing a text prompt: p50, p99.
    pub tokenize: [f64; 2],
    /// The routers' latency models against what happened: the mean absolute percentage
    /// error of the time to first token, per output token, and whole answers' duration
    /// (`None`: nothing of that kind compared).
    pub prediction_error: [Option<f64>; 3],
}

impl LiveTimings {
    /// Reads the histograms from a Prometheus text exposition; `None` when it has none.
    pub fn parse(metrics: &str) -> Option<LiveTimings> {
        let decision = Histogram::parse(metrics, "switchyard_decision_seconds")?;
        let policy_call = Histogram::parse(metrics, "switchyard_policy_call_seconds")?;
        let tokenize = Histogram::parse(metrics, "switchyard_tokenize_seconds").unwrap_or_default();
        let sum = |name: &str, of: &str| -> f64 {
            let label = format!("of=\"{of}\"");
            metrics
                .lines()
                .filter(|l| l.starts_with(name) && l.contains(&label))
                .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
                .sum()
        };
        let mape = |of: &str| {
            let n = sum("switchyard_predictions_compared_total{", of);
            (n > 0.0).then(|| sum("switchyard_prediction_error_total{", of) / n)
        };
        Some(LiveTimings {
            decisions: decision.count(),
            decision: [decision.quantile(0.5), decision.quantile(0.99)],
            policy_call: [policy_call.quantile(0.5), policy_call.quantile(0.99)],
            tokenize: [tokenize.quantile(0.5), tokenize.quantile(0.99)],
            prediction_error: [mape("ttft"), mape("tpot"), mape("e2e")],
        })
    }

    /// The prediction errors as a table cell: `TTFT %, TPOT %, E2E %` (`-` where none).
    pub fn prediction_errors(&self) -> String {
        let cell = |e: Option<f64>| e.map_or("-".to_string(), |e| format!("{:.0} %", e * 100.0));
        let [ttft, tpot, e2e] = self.prediction_error;
        format!("{}, {}, {}", cell(ttft), cell(tpot), cell(e2e))
    }
}

/// A histogram's cumulative buckets, summed over its label sets.
#[derive(Debug, Default)]
struct Histogram {
    /// (upper bound, cumulative count), by bound.
    buckets: Vec<(f64, u64)>,
}

impl Histogram {
    fn parse(text: &str, name: &str) -> Option<Histogram> {
        let prefix = format!("{name}_bucket{{");
        let mut by_bound: Vec<(f64, u64)> = Vec::new();
        for line in text.lines().filter(|l| l.starts_with(&prefix)) {
            let le = line.split("le=\"").nth(1).and_then(|r| r.split('"').next());
            let bound = match le {
                Some("+Inf") => f64::INFINITY,
                Some(v) => match v.parse::<f64>() {
                    Ok(b) => b,
                    Err(_) => continue,
                },
                None => continue,
            };
            let Some(count) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else {
                continue;
            };
            match by_bound.iter_mut().find(|(b, _)| *b == bound) {
                Some((_, c)) => *c += count as u64,
                None => by_bound.push((bound, count as u64)),
            }
        }
        if by_bound.is_empty() {
            return None;
        }
        by_bound.sort_by(|a, b| a.0.total_cmp(&b.0));
        Some(Histogram { buckets: by_bound })
    }

    fn count(&self) -> u64 {
        self.buckets.last().map_or(0, |b| b.1)
    }

    /// The `q` quantile, interpolated linearly inside its bucket as Prometheus'
    /// `histogram_quantile` does; the last finite bound when it falls in `+Inf`.
    fn quantile(&self, q: f64) -> f64 {
        let total = self.count();
        if total == 0 {
            return 0.0;
        }
        let rank = q * total as f64;
        let mut lower = (0.0, 0u64);
        for &(bound, cumulative) in &self.buckets {
            if cumulative as f64 >= rank {
                if bound.is_infinite() {
                    return lower.0;
                }
                let inside = (cumulative - lower.1) as f64;
                let into = if inside > 0.0 {
                    (rank - lower.1 as f64) / inside
                } else {
                    1.0
                };
                return lower.0 + (bound - lower.0) * into;
            }
            lower = (bound, cumulative);
        }
        lower.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_timings_come_from_prometheus_histograms() {
        let text = "\
# TYPE switchyard_decision_seconds histogram
switchyard_decision_seconds_sum{endpoint=\"a\"} 0.1
switchyard_decision_seconds_count{endpoint=\"a\"} 100
switchyard_decision_seconds_bucket{le=\"0.00001\",endpoint=\"a\"} 0
switchyard_decision_seconds_bucket{le=\"0.00002\",endpoint=\"a\"} 60
switchyard_decision_seconds_bucket{le=\"+Inf\",endpoint=\"a\"} 100
switchyard_decision_seconds_bucket{le=\"0.00001\",endpoint=\"b\"} 0
switchyard_decision_seconds_bucket{le=\"0.00002\",endpoint=\"b\"} 40
switchyard_decision_seconds_bucket{le=\"+Inf\",endpoint=\"b\"} 100
switchyard_policy_call_seconds_bucket{le=\"0.000001\",endpoint=\"a\"} 50
switchyard_policy_call_seconds_bucket{le=\"0.000002\",endpoint=\"a\"} 100
switchyard_policy_call_seconds_bucket{le=\"+Inf\",endpoint=\"a\"} 100
";
        let live = LiveTimings::parse(text).unwrap();
        assert_eq!(live.decisions, 200, "summed over endpoints");
        // 100 of 200 at or below 20 µs, none below 10 µs: the median is 20 µs.
        assert!(
            (live.decision[0] - 20e-6).abs() < 1e-9,
            "{:?}",
            live.decision
        );
        // p99 falls in +Inf: reported as the last finite bound.
        assert!(
            (live.decision[1] - 20e-6).abs() < 1e-9,
            "{:?}",
            live.decision
        );
        assert!(
            (live.policy_call[0] - 1e-6).abs() < 1e-9,
            "{:?}",
            live.policy_call
        );
        assert_eq!(live.tokenize, [0.0, 0.0], "no tokenizations");
        assert!(LiveTimings::parse("# a peer's metrics\nrequests_total 5\n").is_none());
    }
}
