//! Prometheus metrics: counters kept by the front door, plus gauges read from the
//! routers, clients and policies at scrape time.
//!
//! - this module: the front door's counters and the page's assembly ([`Metrics`]);
//! - `timings`: the latency histograms ([`Timings`]);
//! - `scrape`: the families read from routers, clients and policies at scrape time;
//! - `decisions`: the live policy's decision quality and the shadows' comparison;
//! - `trends`: one point a second per endpoint for the admin page ([`Trends`]).

mod decisions;
mod predictions;
mod scrape;
mod timings;
mod trends;

pub use timings::Timings;
pub use trends::{TREND_POINTS, TrendPoint, Trends};

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::prometheus_text;
use prometheus_client::registry::Registry;

use switchyard_router::KvRouter;

use scrape::Scrape;

/// The front door's own counters.
#[derive(Debug, Default)]
pub struct Metrics {
    /// The endpoints routed at the last scrape: the timing series of those gone since
    /// are dropped.
    timed_endpoints: parking_lot::Mutex<std::collections::HashSet<String>>,
    /// Requests answered, by class: 2xx, 4xx, 5xx.
    pub responses_2xx: AtomicU64,
    /// 4xx answers.
    pub responses_4xx: AtomicU64,
    /// 5xx answers.
    pub responses_5xx: AtomicU64,
    /// Attempts on another worker after a failed one.
    pub retries: AtomicU64,
    /// Upstream attempts that failed before the first byte.
    pub upstream_failures: AtomicU64,
    /// Streams that broke after they started.
    pub stream_errors: AtomicU64,
    /// Prompt tokens, from the workers' `usage`.
    pub prompt_tokens: AtomicU64,
    /// Cached prompt tokens, from `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: AtomicU64,
    /// Attempts that found the worker busy (429/503).
    pub busy: AtomicU64,
    /// Requests that failed on two workers and were treated as their own fault.
    pub poison: AtomicU64,
    /// Streams ended because the worker went silent for the idle timeout.
    pub stalls: AtomicU64,
    /// Attempts that failed because the router itself ran out of a resource.
    pub local_failures: AtomicU64,
    /// Requests answered 503 because `max_in_flight` were already in flight.
    pub shed: AtomicU64,
    /// Failed `accept` calls (e.g. out of file descriptors).
    pub accept_errors: AtomicU64,
    /// Connections refused at the connection limit.
    pub refused_connections: AtomicU64,
    /// Latency histograms.
    pub timings: Timings,
    /// Each endpoint's last minutes, for the admin page.
    pub trends: Trends,
    /// Streams that broke mid-answer, by why and what became of them.
    pub migrations:
        parking_lot::Mutex<std::collections::BTreeMap<(&'static str, &'static str), u64>>,
    /// Migrated streams that then ended complete.
    pub migrated_streams_completed: AtomicU64,
    /// Prompt tokens prefilled again (not found cached) by continuations that completed.
    pub migration_prefill_tokens: AtomicU64,
    /// Continuations sent as token IDs (exact), not as text.
    pub token_level_migrations: AtomicU64,
    /// Requests split between a prefill worker and a decode worker (per attempt).
    pub splits: AtomicU64,
    /// Prefill legs of split requests that failed.
    pub prefill_failures: AtomicU64,
    /// Picks answered to a gateway (the endpoint picker).
    pub epp_picks: AtomicU64,
    /// Picks a gateway served somewhere else (a fallback, after the pick failed).
    pub epp_moved: AtomicU64,
    /// Failed upstream attempts per instance.
    pub failures_by_instance:
        parking_lot::Mutex<std::collections::BTreeMap<switchyard_ids::InstanceId, u64>>,
}

impl Metrics {
    /// Counts an upstream attempt that failed on `worker` (a busy answer or the router's
    /// own exhaustion is not one).
    pub fn upstream_failure(&self, worker: switchyard_ids::InstanceId) {
        self.upstream_failures.fetch_add(1, Ordering::Relaxed);
        *self.failures_by_instance.lock().entry(worker).or_insert(0) += 1;
    }

    /// Counts a broken stream: why it broke, and what became of it.
    pub fn migration(&self, reason: &'static str, outcome: &'static str) {
        *self.migrations.lock().entry((reason, outcome)).or_insert(0) += 1;
    }

    /// Counts a response by status.
    pub fn count_status(&self, status: u16) {
        let c = match status {
            200..=299 => &self.responses_2xx,
            400..=499 => &self.responses_4xx,
            _ => &self.responses_5xx,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Renders everything in the Prometheus text format (version 0.0.4), through the
    /// `prometheus-client` encoder: the histograms are its own metrics, every other
    /// value is read at scrape time by a collector, and every family has its HELP.
    pub fn render(
        &self,
        routers: &[std::sync::Arc<KvRouter>],
        prefix: switchyard_tokens::prefix::PrefixStats,
        fleet: Vec<(&'static str, &'static str, u64)>,
        queues: Vec<(
            switchyard_discovery::EndpointPath,
            std::sync::Arc<crate::queue::Queue>,
        )>,
        bodies_held: usize,
    ) -> String {
        // Endpoints released since the last scrape leave no series behind.
        let live: std::collections::HashSet<String> =
            routers.iter().map(|r| r.endpoint().to_string()).collect();
        {
            let mut seen = self.timed_endpoints.lock();
            for gone in seen.difference(&live) {
                self.timings.forget(gone);
            }
            *seen = live;
        }
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let front = FRONT_DOOR
            .iter()
            .zip(self.front_door())
            .map(|((name, help), c)| (*name, *help, load(c)))
            .chain(fleet)
            .collect();
        let scrape = Scrape {
            responses: [
                ("2xx", load(&self.responses_2xx)),
                ("4xx", load(&self.responses_4xx)),
                ("5xx", load(&self.responses_5xx)),
            ],
            front,
            failures_by_instance: self
                .failures_by_instance
                .lock()
                .iter()
                .map(|(id, n)| (*id, *n))
                .collect(),
            migrations: self
                .migrations
                .lock()
                .iter()
                .map(|(k, n)| (*k, *n))
                .collect(),
            routers: routers.to_vec(),
            prefix,
            queues,
            bodies_held,
        };
        let mut registry = Registry::with_prefix("switchyard");
        registry.register_collector(Box::new(scrape));
        let mut s = String::new();
        let _ = prometheus_text::encode(&mut s, &registry);
        let _ = prometheus_text::encode(&mut s, &self.timings.registry);
        s
    }

    pub(super) fn front_door(&self) -> [&AtomicU64; FRONT_DOOR.len()] {
        [
            &self.retries,
            &self.upstream_failures,
            &self.stream_errors,
            &self.busy,
            &self.poison,
            &self.stalls,
            &self.local_failures,
            &self.shed,
            &self.accept_errors,
            &self.refused_connections,
            &self.prompt_tokens,
            &self.cached_tokens,
            &self.migrated_streams_completed,
            &self.migration_prefill_tokens,
            &self.token_level_migrations,
            &self.splits,
            &self.prefill_failures,
            &self.epp_picks,
            &self.epp_moved,
        ]
    }
}

/// The front door's unlabelled counters: name (without `switchyard_` and `_total`) and
/// help, in [`Metrics::front_door`] order.
pub(super) const FRONT_DOOR: [(&str, &str); 19] = [
    ("retries", "Attempts on another worker after a failure"),
    (
        "upstream_failures",
        "Upstream attempts failed before the first byte",
    ),
    ("stream_errors", "Streams broken after they started"),
    (
        "busy_answers",
        "Attempts a worker answered 429 or 503 (skipped for its Retry-After, not ejected)",
    ),
    (
        "poison_requests",
        "Requests that failed on two workers, treated as their own fault",
    ),
    (
        "stream_stalls",
        "Streams ended because the worker was silent for the idle timeout",
    ),
    (
        "local_failures",
        "Attempts that failed because the router ran out of a resource (not blamed on the worker)",
    ),
    (
        "shed_requests",
        "Requests answered 503 at the in-flight limit",
    ),
    ("accept_errors", "Failed accepts on the listening socket"),
    (
        "refused_connections",
        "Client connections refused at the connection limit",
    ),
    ("prompt_tokens", "Prompt tokens reported by workers"),
    (
        "cached_prompt_tokens",
        "Prompt tokens the workers found cached",
    ),
    (
        "migrated_streams_completed",
        "Streams continued on another worker that then ended complete",
    ),
    (
        "migration_prefill_tokens",
        "Prompt tokens the continuations of completed migrated streams prefilled (not found cached)",
    ),
    (
        "token_level_migrations",
        "Continuations sent as token IDs (the stream carried them: vLLM's return_token_ids), exact",
    ),
    (
        "split_requests",
        "Attempts split between a prefill worker and a decode worker (disaggregated fleets)",
    ),
    (
        "prefill_leg_failures",
        "Prefill legs of split attempts that failed (the request was placed again)",
    ),
    (
        "epp_picks",
        "Picks answered to a gateway (the endpoint picker)",
    ),
    (
        "epp_moved",
        "Picks a gateway served elsewhere (a fallback endpoint, after the pick failed)",
    ),
];
