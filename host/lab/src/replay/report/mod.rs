//! The replay's table, JSON and SVG chart.

use std::fmt::Write;

use serde_json::json;

use super::{Bounds, PolicyRun, Slo};

use super::stats::percentile;

/// Summary figures of one run.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed.
    pub failed: usize,
    /// TTFT mean, p50, p90, p99 (seconds).
    pub ttft: [f64; 4],
    /// End-to-end mean and p90 (seconds).
    pub e2e: [f64; 2],
    /// Inter-token latency (the gaps between a stream's chunks) mean and p99 (seconds).
    pub itl: [f64; 2],
    /// Completed requests per simulated second.
    pub throughput: f64,
    /// Cached prompt tokens / prompt tokens.
    pub hit_rate: f64,
    /// Requests that met the SLO (TTFT and E2E), over those sent.
    pub goodput: f64,
    /// Requests the router refused (408 — the peers' queue timeouts —, 429 or 503).
    pub refused: usize,
    /// The busiest worker's requests over the mean worker's (1: even; NaN: unknown).
    pub skew: f64,
    /// TTFT over the oracle floor of the requests served: mean over mean, p99 over p99
    /// (`None`: the run has no floors).
    pub floor: Option<[f64; 2]>,
}

/// The busiest worker's requests over the mean worker's.
pub fn skew(per_worker: &[u64]) -> f64 {
    let total: u64 = per_worker.iter().sum();
    match per_worker.iter().max() {
        Some(&max) if total > 0 => max as f64 * per_worker.len() as f64 / total as f64,
        _ => f64::NAN,
    }
}

/// Summarises a run against `slo`.
pub fn summarise(run: &PolicyRun, slo: Slo) -> Summary {
    let ok: Vec<_> = run.outcomes.iter().filter(|o| o.ok).collect();
    let mut ttft: Vec<f64> = ok.iter().map(|o| o.ttft).collect();
    let mut e2e: Vec<f64> = ok.iter().map(|o| o.e2e).collect();
    ttft.sort_by(f64::total_cmp);
    e2e.sort_by(f64::total_cmp);
    let mean = |v: &[f64]| {
        if v.is_empty() {
            f64::NAN
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    let mut itl: Vec<f64> = ok
        .iter()
        .flat_map(|o| o.itl.iter().map(|&g| f64::from(g)))
        .collect();
    itl.sort_by(f64::total_cmp);
    let good = ok.iter().filter(|o| slo.met(o)).count();
    let refused = run.outcomes.iter().filter(|o| refused(o.status)).count();
    let prompt: u64 = ok.iter().map(|o| o.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|o| o.cached_tokens).sum();
    Summary {
        requests: run.outcomes.len(),
        failed: run.outcomes.len() - ok.len(),
        ttft: [
            mean(&ttft),
            percentile(&ttft, 0.5),
            percentile(&ttft, 0.9),
            percentile(&ttft, 0.99),
        ],
        e2e: [mean(&e2e), percentile(&e2e, 0.9)],
        itl: [mean(&itl), percentile(&itl, 0.99)],
        throughput: if run.span > 0.0 {
            ok.len() as f64 / run.span
        } else {
            0.0
        },
        hit_rate: match run.fleet_hit_rate {
            Some(h) => h,
            None if prompt == 0 => 0.0,
            None => cached as f64 / prompt as f64,
        },
        skew: skew(&run.worker_requests),
        goodput: good as f64 / run.outcomes.len().max(1) as f64,
        refused,
        floor: (run.floors.len() == run.outcomes.len())
            .then(|| {
                let served: Vec<(f64, f64)> = run
                    .outcomes
                    .iter()
                    .zip(run.floors.iter())
                    .filter(|(o, _)| o.ok)
                    .map(|(o, f)| (o.ttft, *f))
                    .collect();
                super::floor::ratios(&served)
            })
            .flatten(),
    }
}

/// The Markdown table; goodput against `slo`.
pub fn table(runs: &[PolicyRun], bound: Bounds, slo: Slo) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| policy | requests | failed | refused | goodput (TTFT ≤ {} s, E2E ≤ {} s) | TTFT mean | p50 | p90 | p99 | TTFT / floor: mean, p99 | ITL mean | ITL p99 | E2E mean | p90 | throughput | hit rate | bound: fleet capacity | bound: infinite | load skew | prediction error: TTFT, TPOT, E2E | router CPU: start + serving (per request) | router peak RSS |",
        slo.ttft, slo.e2e
    );
    let _ = writeln!(
        s,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for r in runs {
        let m = summarise(r, slo);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {:.1} % | {:.3} s | {:.3} s | {:.3} s | {:.3} s | {} | {:.1} ms | {:.1} ms | {:.2} s | {:.2} s | {:.2} req/s | {:.1} % | {:.1} % | {:.1} % | {:.2} | {} | {} | {} |",
            r.policy,
            m.requests,
            m.failed,
            m.refused,
            m.goodput * 100.0,
            m.ttft[0],
            m.ttft[1],
            m.ttft[2],
            m.ttft[3],
            m.floor.map_or("-".to_string(), |[mean, p99]| format!(
                "{mean:.2}×, {p99:.2}×"
            )),
            m.itl[0] * 1e3,
            m.itl[1] * 1e3,
            m.e2e[0],
            m.e2e[1],
            m.throughput,
            m.hit_rate * 100.0,
            bound.capacity * 100.0,
            bound.infinite * 100.0,
            m.skew,
            r.live
                .as_ref()
                .map_or("-".to_string(), |l| l.prediction_errors()),
            r.router.map_or("in process".to_string(), |c| {
                let serving = (c.cpu_secs - c.start_cpu_secs).max(0.0);
                format!(
                    "{:.1} + {:.1} s ({:.1} ms/req)",
                    c.start_cpu_secs,
                    serving,
                    1e3 * serving / m.requests.max(1) as f64
                )
            }),
            r.router
                .map_or("-".to_string(), |c| format!("{:.0} MiB", c.peak_rss_mib)),
        );
    }
    s
}

/// For routers run more than once (`--rounds`): each figure's median over the runs,
/// with its range, so that a lead can be read against the spread.
pub fn spread_table(runs: &[PolicyRun], slo: Slo) -> Option<String> {
    // Each router's summaries, in the order of its first run.
    let mut groups: Vec<(&str, Vec<Summary>)> = Vec::new();
    for r in runs {
        let m = summarise(r, slo);
        match groups.iter_mut().find(|(n, _)| *n == r.policy) {
            Some((_, g)) => g.push(m),
            None => groups.push((&r.policy, vec![m])),
        }
    }
    if groups.iter().all(|(_, g)| g.len() < 2) {
        return None;
    }
    // Median (min–max) of one figure over the runs, scaled and with its unit.
    let spread = |v: &mut Vec<f64>, scale: f64, digits: usize, unit: &str| {
        v.sort_by(f64::total_cmp);
        let (lo, hi) = (v[0] * scale, v[v.len() - 1] * scale);
        let mid = percentile(v, 0.5) * scale;
        format!("{mid:.digits$} ({lo:.digits$}–{hi:.digits$}) {unit}")
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| router | runs | failed | goodput | TTFT mean | TTFT p90 | TTFT p99 | TTFT / floor: mean, p99 | E2E mean | throughput | hit rate |"
    );
    let _ = writeln!(
        s,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for (name, m) in groups {
        let pick = |f: &dyn Fn(&Summary) -> f64| m.iter().map(f).collect::<Vec<f64>>();
        let floor = if m.iter().all(|x| x.floor.is_some()) {
            let at = |k: usize| pick(&|x| x.floor.map_or(f64::NAN, |f| f[k]));
            format!(
                "{}, {}",
                spread(&mut at(0), 1.0, 2, "×"),
                spread(&mut at(1), 1.0, 2, "×")
            )
        } else {
            "-".to_string()
        };
        let _ = writeln!(
            s,
            "| {name} | {} | {} | {} | {} | {} | {} | {floor} | {} | {} | {} |",
            m.len(),
            m.iter().map(|x| x.failed).sum::<usize>(),
            spread(&mut pick(&|x| x.goodput), 100.0, 1, "%"),
            spread(&mut pick(&|x| x.ttft[0]), 1e3, 0, "ms"),
            spread(&mut pick(&|x| x.ttft[2]), 1e3, 0, "ms"),
            spread(&mut pick(&|x| x.ttft[3]), 1e3, 0, "ms"),
            spread(&mut pick(&|x| x.e2e[0]), 1.0, 2, "s"),
            spread(&mut pick(&|x| x.throughput), 1.0, 2, "req/s"),
            spread(&mut pick(&|x| x.hit_rate), 100.0, 1, "%"),
        );
    }
    Some(s)
}

/// One class's figures in one run.
#[derive(Debug, Clone, PartialEq)]
pub struct ClassSummary {
    /// The class.
    pub class: &'static str,
    /// Requests of it sent.
    pub requests: usize,
    /// Met the SLO, over those sent.
    pub goodput: f64,
    /// Refused with 429 (a tenant over its share).
    pub refused_429: usize,
    /// Refused with 503 (a full fleet, a deadline) or 408 (the peers' queue timeout).
    pub refused_503: usize,
    /// Failed otherwise.
    pub failed: usize,
    /// TTFT mean, median and p99 of those served (seconds).
    pub ttft: [f64; 3],
}

/// The figures per class, for runs whose requests were marked with one.
pub fn by_class(run: &PolicyRun, slo: Slo) -> Vec<ClassSummary> {
    let mut classes: Vec<&'static str> = run.outcomes.iter().filter_map(|o| o.class).collect();
    classes.sort_unstable();
    classes.dedup();
    classes
        .into_iter()
        .map(|class| {
            let all: Vec<_> = run
                .outcomes
                .iter()
                .filter(|o| o.class == Some(class))
                .collect();
            let mut ttft: Vec<f64> = all.iter().filter(|o| o.ok).map(|o| o.ttft).collect();
            ttft.sort_by(f64::total_cmp);
            let good = all.iter().filter(|o| o.ok && slo.met(o)).count();
            let status = |s: &[u16]| {
                all.iter()
                    .filter(|o| o.status.is_some_and(|x| s.contains(&x)))
                    .count()
            };
            ClassSummary {
                class,
                requests: all.len(),
                goodput: good as f64 / all.len().max(1) as f64,
                refused_429: status(&[429]),
                refused_503: status(&[408, 503]),
                failed: all.iter().filter(|o| !o.ok && !refused(o.status)).count(),
                ttft: [
                    if ttft.is_empty() {
                        f64::NAN
                    } else {
                        ttft.iter().sum::<f64>() / ttft.len() as f64
                    },
                    percentile(&ttft, 0.5),
                    percentile(&ttft, 0.99),
                ],
            }
        })
        .collect()
}

/// Whether a router's answer refused the request: 429 (a tenant over its share), 503 (a
/// full fleet, a deadline) or 408 (the peers' queue timeout).
fn refused(status: Option<u16>) -> bool {
    matches!(status, Some(408 | 429 | 503))
}

/// Why a run's requests were refused: the error code of the router's answer (OpenAI's
/// `error.code`, e.g. `fleet_full`, `queue_deadline`, `tenant_over_share`), or its status
/// where the answer has none (the peers' 408), with counts, most first.
pub fn refusal_reasons(run: &PolicyRun) -> Vec<(String, usize)> {
    let mut counts: std::collections::BTreeMap<String, usize> = Default::default();
    for o in &run.outcomes {
        let Some(status) = o.status.filter(|s| refused(Some(*s))) else {
            continue;
        };
        let code = o
            .error
            .as_deref()
            .and_then(|e| e.split_once("\"code\":\""))
            .and_then(|(_, rest)| rest.split_once('"'))
            .map(|(code, _)| code.to_string())
            .unwrap_or_else(|| status.to_string());
        *counts.entry(code).or_default() += 1;
    }
    let mut v: Vec<_> = counts.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    v
}

/// The per-class table (goodput, refusals by status, TTFT of those served), when the
/// requests were marked with classes; then each router's refusals by reason.
pub fn class_table(runs: &[PolicyRun], slo: Slo) -> Option<String> {
    if !runs
        .iter()
        .any(|r| r.outcomes.iter().any(|o| o.class.is_some()))
    {
        return None;
    }
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| router | class | requests | goodput | refused 429 | refused 503/408 | failed | TTFT mean (served) | TTFT p50 (served) | TTFT p99 (served) |"
    );
    let _ = writeln!(
        s,
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for r in runs {
        for c in by_class(r, slo) {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.1} % | {} | {} | {} | {:.3} s | {:.3} s | {:.3} s |",
                r.policy,
                c.class,
                c.requests,
                c.goodput * 100.0,
                c.refused_429,
                c.refused_503,
                c.failed,
                c.ttft[0],
                c.ttft[1],
                c.ttft[2]
            );
        }
    }
    for r in runs {
        let reasons = refusal_reasons(r);
        if !reasons.is_empty() {
            let list: Vec<String> = reasons.iter().map(|(c, n)| format!("{c} {n}")).collect();
            let _ = writeln!(s, "\n{} refused: {}", r.policy, list.join(", "));
        }
    }
    Some(s)
}

/// The routers' own latency quantiles (from their `/metrics`), when any exposes them.
pub fn live_table(runs: &[PolicyRun]) -> Option<String> {
    let live: Vec<_> = runs
        .iter()
        .filter_map(|r| r.live.map(|l| (&r.policy, l)))
        .collect();
    if live.is_empty() {
        return None;
    }
    let us = |s: f64| format!("{:.1} µs", s * 1e6);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| router (its /metrics) | decisions | decision p50 | p99 | policy call p50 | p99 | tokenize p50 | p99 |"
    );
    let _ = writeln!(
        s,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for (name, l) in live {
        let _ = writeln!(
            s,
            "| {name} | {} | {} | {} | {} | {} | {} | {} |",
            l.decisions,
            us(l.decision[0]),
            us(l.decision[1]),
            us(l.policy_call[0]),
            us(l.policy_call[1]),
            us(l.tokenize[0]),
            us(l.tokenize[1]),
        );
    }
    Some(s)
}

/// What Switchyard's routers said about each run's decisions, and the shadow beside
/// each policy, when any run has it.
pub fn telemetry_table(runs: &[PolicyRun]) -> Option<String> {
    let rows: Vec<_> = runs
        .iter()
        .filter_map(|r| r.telemetry.as_ref().map(|t| (&r.policy, t)))
        .collect();
    if rows.is_empty() {
        return None;
    }
    let pct = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{:.1} %", 100.0 * x));
    let shadows = rows.iter().any(|(_, t)| t.shadow.is_some());
    let mut s = String::new();
    let _ = write!(
        s,
        "| policy (decision telemetry) | routed | overlap / best | predicted cached | reported cached | not routed |"
    );
    if shadows {
        let _ = write!(
            s,
            " shadow | agreement | shadow overlap / best | live overlap / best | shadow cost | live cost | dropped | failed |"
        );
    }
    let _ = writeln!(s);
    let _ = write!(s, "| --- | ---: | ---: | ---: | ---: | ---: |");
    if shadows {
        let _ = write!(s, " --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    }
    let _ = writeln!(s);
    for (name, t) in rows {
        let _ = write!(
            s,
            "| {name} | {} | {} | {} | {} | {} |",
            t.routed,
            pct(t.overlap_ratio()),
            t.predicted_cached_tokens,
            t.reported_cached_tokens,
            t.unrouted
        );
        if shadows {
            match &t.shadow {
                Some(sh) => {
                    let t = &sh.tally;
                    let cost = |c: Option<f64>| c.map_or("-".to_string(), |c| format!("{c:.2}"));
                    let _ = write!(
                        s,
                        " {} | {} | {} | {} | {} | {} | {} | {} |",
                        sh.name,
                        pct(t.agreement()),
                        pct(t.shadow_overlap_ratio()),
                        pct(t.live_overlap_ratio()),
                        cost(t.shadow_mean_cost()),
                        cost(t.live_mean_cost()),
                        t.dropped,
                        t.failures
                    );
                }
                None => {
                    let _ = write!(s, " - | - | - | - | - | - | - | - |");
                }
            }
        }
        let _ = writeln!(s);
    }
    Some(s)
}

/// Everything, as JSON.
pub fn json(runs: &[PolicyRun], bound: Bounds, slo: Slo) -> serde_json::Value {
    let summaries: Vec<_> = runs
        .iter()
        .map(|r| {
            let m = summarise(r, slo);
            json!({
                "policy": r.policy, "requests": m.requests, "failed": m.failed,
                "ttft_mean_s": m.ttft[0], "ttft_p50_s": m.ttft[1], "ttft_p90_s": m.ttft[2], "ttft_p99_s": m.ttft[3], "itl_mean_s": m.itl[0], "itl_p99_s": m.itl[1],
                "e2e_mean_s": m.e2e[0], "e2e_p90_s": m.e2e[1], "throughput_rps": m.throughput, "hit_rate": m.hit_rate,
                "goodput": m.goodput, "refused": m.refused,
                "load_skew": (!m.skew.is_nan()).then_some(m.skew),
                "router_cpu_s": r.router.map(|c| c.cpu_secs), "router_start_cpu_s": r.router.map(|c| c.start_cpu_secs), "router_peak_rss_mib": r.router.map(|c| c.peak_rss_mib),
                "overlap_ratio": r.telemetry.as_ref().and_then(super::telemetry::Telemetry::overlap_ratio),
                "shadow_agreement": r.telemetry.as_ref().and_then(|t| t.shadow.as_ref())
                    .and_then(|s| s.tally.agreement()),
                "classes": by_class(r, slo).iter().map(|c| json!({
                    "class": c.class, "requests": c.requests, "goodput": c.goodput,
                    "refused_429": c.refused_429, "refused_503": c.refused_503, "failed": c.failed,
                    "ttft_mean_s": c.ttft[0], "ttft_p50_s": c.ttft[1], "ttft_p99_s": c.ttft[2],
                })).collect::<Vec<_>>(),
                "refusals": refusal_reasons(r).into_iter().map(|(k, v)| (k, json!(v))).collect::<serde_json::Map<_, _>>(),
            })
        })
        .collect();
    json!({"infinite_cache_bound": bound.infinite, "capacity_bound": bound.capacity, "slo": {"ttft_s": slo.ttft, "e2e_s": slo.e2e}, "summary": summaries, "runs": runs})
}

/// The TTFT distribution of each policy as cumulative curves (log-scaled time axis).
pub fn svg(runs: &[PolicyRun]) -> String {
    const W: f64 = 720.0;
    const H: f64 = 420.0;
    const PAD: f64 = 60.0;
    const COLOURS: [&str; 6] = [
        "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
    ];
    let all: Vec<f64> = runs
        .iter()
        .flat_map(|r| r.outcomes.iter().filter(|o| o.ok).map(|o| o.ttft.max(1e-4)))
        .collect();
    let lo = all
        .iter()
        .copied()
        .fold(f64::INFINITY, f64::min)
        .max(1e-4)
        .log10()
        .floor();
    let hi = all
        .iter()
        .copied()
        .fold(1e-3, f64::max)
        .log10()
        .ceil()
        .max(lo + 1.0);
    let x = |t: f64| PAD + (t.max(1e-4).log10() - lo) / (hi - lo) * (W - 2.0 * PAD);
    let y = |q: f64| H - PAD - q * (H - 2.0 * PAD);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="20" text-anchor="middle" font-size="14">Time to first token (CDF, simulated seconds)</text>"#,
        W / 2.0
    );
    let _ = writeln!(
        s,
        r#"<line x1="{PAD}" y1="{}" x2="{}" y2="{}" stroke="black"/>"#,
        H - PAD,
        W - PAD,
        H - PAD
    );
    let _ = writeln!(
        s,
        r#"<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{}" stroke="black"/>"#,
        H - PAD
    );
    let mut decade = lo;
    while decade <= hi {
        let t = 10f64.powf(decade);
        let _ = writeln!(
            s,
            r##"<line x1="{0}" y1="{PAD}" x2="{0}" y2="{1}" stroke="#dddddd"/><text x="{0}" y="{2}" text-anchor="middle">{3}</text>"##,
            x(t),
            H - PAD,
            H - PAD + 16.0,
            format_seconds(t)
        );
        decade += 1.0;
    }
    for q in [0.0, 0.5, 0.9, 1.0] {
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{q}</text>"#,
            PAD - 6.0,
            y(q) + 4.0
        );
    }
    for (i, r) in runs.iter().enumerate() {
        let mut t: Vec<f64> = r.outcomes.iter().filter(|o| o.ok).map(|o| o.ttft).collect();
        t.sort_by(f64::total_cmp);
        let n = t.len().max(1) as f64;
        let points: Vec<String> = t
            .iter()
            .enumerate()
            .map(|(k, v)| format!("{:.1},{:.1}", x(*v), y((k + 1) as f64 / n)))
            .collect();
        let c = COLOURS[i % COLOURS.len()];
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#,
            points.join(" ")
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" fill="{c}">{}</text>"#,
            W - PAD - 120.0,
            PAD + 16.0 * (i as f64 + 1.0),
            r.policy
        );
    }
    s.push_str("</svg>\n");
    s
}

fn format_seconds(t: f64) -> String {
    if t < 1.0 {
        format!("{} ms", (t * 1000.0).round())
    } else {
        format!("{t} s")
    }
}

#[cfg(test)]
mod tests;
