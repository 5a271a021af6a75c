//! One point a second per endpoint, five minutes of them, for the admin page's charts.

use std::sync::atomic::{AtomicU64, Ordering};

use switchyard_router::KvRouter;

/// Points of each endpoint's trend kept (one a second: five minutes).
pub const TREND_POINTS: usize = 300;

/// One second of an endpoint's life, for the admin page's charts.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct TrendPoint {
    /// Unix milliseconds at the end of the interval.
    pub at_ms: u64,
    /// Requests routed per second.
    pub decisions_per_s: f64,
    /// Block-weighted overlap achieved against the best available, over the interval.
    pub overlap_ratio: Option<f64>,
    /// Median decision time, µs.
    pub p50_us: Option<f64>,
    /// 99th percentile decision time, µs.
    pub p99_us: Option<f64>,
    /// Share of the shadow's compared decisions that agreed with the live policy.
    pub shadow_agreement: Option<f64>,
    /// Requests this router has in flight on the endpoint.
    pub in_flight: u64,
}

/// The counters a trend point is the difference of.
#[derive(Debug, Clone, Copy)]
pub(super) struct Reading {
    at: std::time::Instant,
    routed: u64,
    chosen: u64,
    best: u64,
    latency: [u64; switchyard_router::quality::LATENCY_BUCKETS],
    compared: u64,
    agreed: u64,
}

pub(super) fn reading(r: &KvRouter) -> Reading {
    let q = r.quality();
    let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let (compared, agreed) = r
        .shadow_series()
        .all()
        .iter()
        .fold((0, 0), |(c, a), (_, s)| {
            (c + load(&s.compared), a + load(&s.agreed))
        });
    Reading {
        at: std::time::Instant::now(),
        routed: load(&q.routed),
        chosen: load(&q.chosen_overlap_blocks),
        best: load(&q.best_overlap_blocks),
        latency: q.latency_counts(),
        compared,
        agreed,
    }
}

/// Every endpoint's recent trend, sampled once a second while the router runs, so that
/// the admin page draws the last minutes as soon as it opens.
#[derive(Debug, Default)]
pub struct Trends {
    by_endpoint: parking_lot::Mutex<
        std::collections::HashMap<String, (Reading, std::collections::VecDeque<TrendPoint>)>,
    >,
}

impl Trends {
    /// Takes one point per endpoint (the first sample of an endpoint only sets its base).
    pub fn sample(&self, routers: &[std::sync::Arc<KvRouter>]) {
        use switchyard_router::quality::latency_quantile;
        let at_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let mut all = self.by_endpoint.lock();
        all.retain(|ep, _| routers.iter().any(|r| r.endpoint().to_string() == *ep));
        for r in routers {
            let now = reading(r);
            let Some((last, points)) = all.get_mut(&r.endpoint().to_string()) else {
                all.insert(
                    r.endpoint().to_string(),
                    (now, std::collections::VecDeque::new()),
                );
                continue;
            };
            let secs = now.at.duration_since(last.at).as_secs_f64().max(1e-3);
            let routed = now.routed.saturating_sub(last.routed);
            let best = now.best.saturating_sub(last.best);
            let chosen = now.chosen.saturating_sub(last.chosen);
            let compared = now.compared.saturating_sub(last.compared);
            let agreed = now.agreed.saturating_sub(last.agreed);
            let in_flight = r
                .client()
                .snapshot()
                .instances
                .keys()
                .map(|id| u64::from(r.load_of(*id).booked))
                .sum();
            points.push_back(TrendPoint {
                at_ms,
                decisions_per_s: routed as f64 / secs,
                overlap_ratio: switchyard_router::shadow::ratio(chosen, best, routed),
                p50_us: latency_quantile(0.5, &now.latency, &last.latency),
                p99_us: latency_quantile(0.99, &now.latency, &last.latency),
                shadow_agreement: (compared > 0).then(|| agreed as f64 / compared as f64),
                in_flight,
            });
            while points.len() > TREND_POINTS {
                points.pop_front();
            }
            *last = now;
        }
    }

    /// An endpoint's points, oldest first.
    pub fn points(&self, endpoint: &str) -> Vec<TrendPoint> {
        self.by_endpoint
            .lock()
            .get(endpoint)
            .map(|(_, p)| p.iter().copied().collect())
            .unwrap_or_default()
    }
}
