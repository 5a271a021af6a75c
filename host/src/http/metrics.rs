//! Prometheus metrics: counters kept by the front door, plus gauges read from the
//! routers, clients and policies at scrape time.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::client::Availability;
use crate::policy::{CallFailure, PolicyError};
use crate::router::KvRouter;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointLabel {
    endpoint: String,
}

type ByEndpoint = Family<EndpointLabel, Histogram, fn() -> Histogram>;

/// Latency histograms (prometheus-client), so that a live median and tail are visible,
/// not only a mean.
pub struct Timings {
    registry: Registry,
    decision: ByEndpoint,
    policy_call: ByEndpoint,
    tokenize: Histogram,
    first_byte: ByEndpoint,
    duration: ByEndpoint,
}

/// 1 µs to ~0.5 s, doubling.
fn micro_buckets() -> Histogram {
    Histogram::new(exponential_buckets(1e-6, 2.0, 20))
}

/// 1 ms to ~9 min, doubling.
fn request_buckets() -> Histogram {
    Histogram::new(exponential_buckets(1e-3, 2.0, 20))
}

impl Default for Timings {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("switchyard");
        let decision = ByEndpoint::new_with_constructor(micro_buckets as fn() -> Histogram);
        let policy_call = ByEndpoint::new_with_constructor(micro_buckets as fn() -> Histogram);
        let tokenize = Histogram::new(exponential_buckets(1e-6, 2.0, 24));
        let first_byte = ByEndpoint::new_with_constructor(request_buckets as fn() -> Histogram);
        let duration = ByEndpoint::new_with_constructor(request_buckets as fn() -> Histogram);
        registry.register(
            "decision_seconds",
            "Routing decisions: candidates, overlaps, the policy call and the booking",
            decision.clone(),
        );
        registry.register(
            "policy_call_seconds",
            "The policy's own call alone (failed calls included, the native fallback not)",
            policy_call.clone(),
        );
        registry.register(
            "tokenize_seconds",
            "Tokenizing a text or chat prompt",
            tokenize.clone(),
        );
        registry.register(
            "time_to_first_byte_seconds",
            "From the request's arrival to the worker's first bytes (the first token of a stream)",
            first_byte.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "From the request's arrival to the end of a complete response",
            duration.clone(),
        );
        Timings {
            registry,
            decision,
            policy_call,
            tokenize,
            first_byte,
            duration,
        }
    }
}

impl std::fmt::Debug for Timings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Timings")
    }
}

fn label(endpoint: &str) -> EndpointLabel {
    EndpointLabel {
        endpoint: endpoint.to_string(),
    }
}

impl Timings {
    /// One routing decision and its policy call.
    pub fn decision(&self, endpoint: &str, decision: Duration, policy: Duration) {
        let l = label(endpoint);
        self.decision
            .get_or_create(&l)
            .observe(decision.as_secs_f64());
        self.policy_call
            .get_or_create(&l)
            .observe(policy.as_secs_f64());
    }

    /// One tokenization.
    pub fn tokenize(&self, took: Duration) {
        self.tokenize.observe(took.as_secs_f64());
    }

    /// A response's first bytes arrived.
    pub fn first_byte(&self, endpoint: &str, after: Duration) {
        self.first_byte
            .get_or_create(&label(endpoint))
            .observe(after.as_secs_f64());
    }

    /// A response ended complete.
    pub fn request_duration(&self, endpoint: &str, took: Duration) {
        self.duration
            .get_or_create(&label(endpoint))
            .observe(took.as_secs_f64());
    }

    fn render(&self, out: &mut String) {
        let _ = prometheus_client::encoding::text::encode_registry(out, &self.registry);
    }

    /// Drops the series of an endpoint the router let go of.
    pub fn forget(&self, endpoint: &str) {
        let l = label(endpoint);
        for family in [
            &self.decision,
            &self.policy_call,
            &self.first_byte,
            &self.duration,
        ] {
            family.remove(&l);
        }
    }
}

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
    /// Failed upstream attempts per instance.
    pub failures_by_instance:
        parking_lot::Mutex<std::collections::BTreeMap<crate::ids::InstanceId, u64>>,
}

impl Metrics {
    /// Counts a response by status.
    pub fn count_status(&self, status: u16) {
        let c = match status {
            200..=299 => &self.responses_2xx,
            400..=499 => &self.responses_4xx,
            _ => &self.responses_5xx,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Renders everything in the Prometheus text format.
    pub fn render(
        &self,
        routers: &[std::sync::Arc<KvRouter>],
        prefix: crate::tokens::prefix::PrefixStats,
    ) -> String {
        let mut s = String::new();
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let _ = writeln!(s, "# TYPE switchyard_responses_total counter");
        for (class, c) in [
            ("2xx", &self.responses_2xx),
            ("4xx", &self.responses_4xx),
            ("5xx", &self.responses_5xx),
        ] {
            let _ = writeln!(
                s,
                "switchyard_responses_total{{class=\"{class}\"}} {}",
                load(c)
            );
        }
        for (name, help, c) in [
            (
                "switchyard_retries_total",
                "attempts on another worker after a failure",
                &self.retries,
            ),
            (
                "switchyard_upstream_failures_total",
                "upstream attempts failed before the first byte",
                &self.upstream_failures,
            ),
            (
                "switchyard_stream_errors_total",
                "streams broken after they started",
                &self.stream_errors,
            ),
            (
                "switchyard_busy_answers_total",
                "attempts a worker answered 429 or 503 (skipped for its Retry-After, not ejected)",
                &self.busy,
            ),
            (
                "switchyard_poison_requests_total",
                "requests that failed on two workers, treated as their own fault",
                &self.poison,
            ),
            (
                "switchyard_stream_stalls_total",
                "streams ended because the worker was silent for the idle timeout",
                &self.stalls,
            ),
            (
                "switchyard_local_failures_total",
                "attempts that failed because the router ran out of a resource (not blamed on the worker)",
                &self.local_failures,
            ),
            (
                "switchyard_shed_requests_total",
                "requests answered 503 at the in-flight limit",
                &self.shed,
            ),
            (
                "switchyard_accept_errors_total",
                "failed accepts on the listening socket",
                &self.accept_errors,
            ),
            (
                "switchyard_refused_connections_total",
                "client connections refused at the connection limit",
                &self.refused_connections,
            ),
            (
                "switchyard_prompt_tokens_total",
                "prompt tokens reported by workers",
                &self.prompt_tokens,
            ),
            (
                "switchyard_cached_prompt_tokens_total",
                "prompt tokens the workers found cached",
                &self.cached_tokens,
            ),
        ] {
            let _ = writeln!(
                s,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                load(c)
            );
        }
        // Per-endpoint and per-instance series: each family's samples written together
        // under its TYPE line, as the text format requires.
        let mut f = Families::default();
        f.declare("switchyard_instance_upstream_failures_total", "counter");
        for (id, n) in self.failures_by_instance.lock().iter() {
            f.sample(
                "switchyard_instance_upstream_failures_total",
                format!("instance=\"{id}\""),
                n,
            );
        }
        for (name, kind) in [
            ("switchyard_decisions_total", "counter"),
            ("switchyard_policy_failures_total", "counter"),
            ("switchyard_policy_fallbacks_total", "counter"),
            ("switchyard_policy_refusals_total", "counter"),
            ("switchyard_policy_rejections_total", "counter"),
            ("switchyard_policy_rollbacks_total", "counter"),
            ("switchyard_policy_info", "gauge"),
            ("switchyard_instance_down_reports_total", "counter"),
            ("switchyard_ejections_total", "counter"),
            ("switchyard_ejections_refused_total", "counter"),
            ("switchyard_held_removals_total", "counter"),
            ("switchyard_panic_mode", "gauge"),
            ("switchyard_expired_bookings_total", "counter"),
            ("switchyard_unpredicted_cache_hits_total", "counter"),
            ("switchyard_instance_available", "gauge"),
            ("switchyard_instance_in_flight", "gauge"),
        ] {
            f.declare(name, kind);
        }
        f.help(
            "switchyard_instance_in_flight",
            "requests this router has in flight on the instance (the policy sees the worker's own report plus these)",
        );
        f.help(
            "switchyard_unpredicted_cache_hits_total",
            "responses whose worker reported a cached prefix the router had not predicted on that worker (many: tokenization differs)",
        );
        for r in routers {
            let ep = r.endpoint().to_string();
            let on = format!("endpoint=\"{ep}\"");
            let st = r.policy().status();
            // Totals over every policy the endpoint has had: counters never go down.
            let t = r.policy().totals();
            f.sample("switchyard_decisions_total", on.clone(), t.decisions);
            f.sample("switchyard_policy_failures_total", on.clone(), t.failures);
            for (reason, n) in CallFailure::REASONS.iter().zip(t.fallbacks) {
                f.sample(
                    "switchyard_policy_fallbacks_total",
                    format!("{on},reason=\"{reason}\""),
                    n,
                );
            }
            for (reason, n) in PolicyError::REASONS.iter().zip(t.refusals) {
                f.sample(
                    "switchyard_policy_refusals_total",
                    format!("{on},reason=\"{reason}\""),
                    n,
                );
            }
            f.sample(
                "switchyard_policy_rejections_total",
                on.clone(),
                t.rejections,
            );
            for (reason, n) in [
                ("operator", t.manual_rollbacks),
                ("failures", t.automatic_rollbacks),
                ("failure_rate", t.rate_rollbacks),
            ] {
                f.sample(
                    "switchyard_policy_rollbacks_total",
                    format!("{on},reason=\"{reason}\""),
                    n,
                );
            }
            // Which policy serves now (name and version are label-safe: see
            // `policy::guest_label`).
            f.sample(
                "switchyard_policy_info",
                format!(
                    "{on},policy=\"{}\",version=\"{}\",generation=\"{}\"",
                    st.info.name, st.info.version, st.generation
                ),
                1,
            );
            let counters = r.client().counters();
            f.sample(
                "switchyard_instance_down_reports_total",
                on.clone(),
                counters.reported_down.load(Ordering::Relaxed),
            );
            for (kind, c) in [
                ("unreachable", &counters.ejected_unreachable),
                ("failing", &counters.ejected_failing),
                ("unhealthy", &counters.ejected_unhealthy),
            ] {
                f.sample(
                    "switchyard_ejections_total",
                    format!("{on},kind=\"{kind}\""),
                    c.load(Ordering::Relaxed),
                );
            }
            f.sample(
                "switchyard_ejections_refused_total",
                on.clone(),
                counters.ejections_refused.load(Ordering::Relaxed),
            );
            f.sample(
                "switchyard_held_removals_total",
                on.clone(),
                counters.held_removals.load(Ordering::Relaxed),
            );
            f.sample(
                "switchyard_expired_bookings_total",
                on.clone(),
                r.expired_bookings(),
            );
            f.sample(
                "switchyard_unpredicted_cache_hits_total",
                on.clone(),
                r.unpredicted_cache_hits(),
            );
            let snapshot = r.client().snapshot();
            f.sample(
                "switchyard_panic_mode",
                on.clone(),
                u8::from(snapshot.panic),
            );
            for (id, state) in &snapshot.instances {
                let up = u8::from(state.availability == Availability::Available);
                let labels = format!("{on},instance=\"{id}\"");
                f.sample("switchyard_instance_available", labels.clone(), up);
                f.sample(
                    "switchyard_instance_in_flight",
                    labels,
                    r.load_of(*id).booked,
                );
            }
        }
        f.write(&mut s);
        for (name, help, v) in [
            (
                "switchyard_token_prefix_hits_total",
                "text prompts that reused the tokens of an earlier prompt's prefix",
                prefix.hits,
            ),
            (
                "switchyard_token_prefix_misses_total",
                "long text prompts tokenized from the start",
                prefix.misses,
            ),
            (
                "switchyard_token_prefix_mismatches_total",
                "audits that found reused tokens wrong (reuse is then off)",
                prefix.mismatches,
            ),
        ] {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        }
        let _ = writeln!(
            s,
            "# HELP switchyard_token_prefix_cached_tokens tokens held for reuse\n# TYPE switchyard_token_prefix_cached_tokens gauge\nswitchyard_token_prefix_cached_tokens {}",
            prefix.tokens
        );
        // Central mode's sockets are shared by every endpoint: said once.
        if let Some(hub) = routers.iter().find_map(|r| r.central_events()) {
            for (name, help, c) in [
                (
                    "switchyard_kv_events_unrouted_total",
                    "engine KV event batches on the bound sockets under a topic no worker names",
                    &hub.unrouted,
                ),
                (
                    "switchyard_kv_events_dropped_total",
                    "engine KV event batches on the bound sockets dropped at a full worker queue (seen as gaps)",
                    &hub.dropped,
                ),
                (
                    "switchyard_kv_events_malformed_frames_total",
                    "messages on the bound sockets that were not [topic, seq, payload]",
                    &hub.malformed,
                ),
            ] {
                let _ = writeln!(
                    s,
                    "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                    load(c)
                );
            }
        }
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
        self.timings.render(&mut s);
        s
    }
}

/// Metric families written by hand: each family's HELP and TYPE, then all its samples
/// together (the text format allows a family only once), in the order declared.
#[derive(Default)]
struct Families {
    order: Vec<&'static str>,
    by_name: std::collections::HashMap<&'static str, HandFamily>,
}

#[derive(Default)]
struct HandFamily {
    kind: &'static str,
    help: Option<&'static str>,
    samples: String,
}

impl Families {
    fn declare(&mut self, name: &'static str, kind: &'static str) {
        self.order.push(name);
        self.by_name.insert(
            name,
            HandFamily {
                kind,
                ..HandFamily::default()
            },
        );
    }

    fn help(&mut self, name: &'static str, help: &'static str) {
        if let Some(f) = self.by_name.get_mut(name) {
            f.help = Some(help);
        }
    }

    fn sample(&mut self, name: &'static str, labels: String, value: impl std::fmt::Display) {
        let f = self
            .by_name
            .get_mut(name)
            .expect("a metric family is declared before its samples");
        let _ = writeln!(f.samples, "{name}{{{labels}}} {value}");
    }

    fn write(mut self, out: &mut String) {
        for name in self.order {
            let f = self.by_name.remove(name).expect("declared");
            if let Some(help) = f.help {
                let _ = writeln!(out, "# HELP {name} {help}");
            }
            let _ = writeln!(out, "# TYPE {name} {}", f.kind);
            out.push_str(&f.samples);
        }
    }
}
