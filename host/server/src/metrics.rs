//! Prometheus metrics: counters kept by the front door, plus gauges read from the
//! routers, clients and policies at scrape time.

use std::sync::atomic::{AtomicU64, Ordering};

use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use switchyard_policy::{CallFailure, PolicyError};
use switchyard_router::KvRouter;
use switchyard_router::client::Availability;
use switchyard_router::shadow::ShadowCounters;

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
    /// Each endpoint's last minutes, for the admin page.
    pub trends: Trends,
    /// Failed upstream attempts per instance.
    pub failures_by_instance:
        parking_lot::Mutex<std::collections::BTreeMap<switchyard_ids::InstanceId, u64>>,
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

    /// Renders everything in the Prometheus text format (version 0.0.4), through the
    /// `prometheus-client` encoder: the histograms are its own metrics, every other
    /// value is read at scrape time by a collector, and every family has its HELP.
    pub fn render(
        &self,
        routers: &[std::sync::Arc<KvRouter>],
        prefix: switchyard_tokens::prefix::PrefixStats,
        fleet: Vec<(&'static str, &'static str, u64)>,
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
            routers: routers.to_vec(),
            prefix,
        };
        let mut registry = Registry::with_prefix("switchyard");
        registry.register_collector(Box::new(scrape));
        let mut s = String::new();
        let _ = prometheus_text::encode(&mut s, &registry);
        let _ = prometheus_text::encode(&mut s, &self.timings.registry);
        s
    }

    fn front_door(&self) -> [&AtomicU64; FRONT_DOOR.len()] {
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
        ]
    }
}

/// The front door's unlabelled counters: name (without `switchyard_` and `_total`) and
/// help, in [`Metrics::front_door`] order.
const FRONT_DOOR: [(&str, &str); 12] = [
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
];

type Labels = Vec<(&'static str, String)>;

/// One family's samples: its labels (empty for a single unlabelled sample) and value.
type Samples<V> = Vec<(Labels, V)>;

/// Everything read at scrape time, encoded by `prometheus-client`.
struct Scrape {
    responses: [(&'static str, u64); 3],
    front: Vec<(&'static str, &'static str, u64)>,
    failures_by_instance: Vec<(switchyard_ids::InstanceId, u64)>,
    routers: Vec<std::sync::Arc<KvRouter>>,
    prefix: switchyard_tokens::prefix::PrefixStats,
}

impl std::fmt::Debug for Scrape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Scrape")
    }
}

fn family<M: EncodeMetric>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    samples: &[(Labels, M)],
) -> std::fmt::Result {
    if samples.is_empty() {
        return Ok(());
    }
    let mut m = enc.encode_descriptor(name, help, None, kind)?;
    if let [(labels, metric)] = samples
        && labels.is_empty()
    {
        return metric.encode(m);
    }
    for (labels, metric) in samples {
        metric.encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

fn counters(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: Samples<u64>,
) -> std::fmt::Result {
    let s: Vec<_> = samples
        .into_iter()
        .map(|(l, v)| (l, ConstCounter::new(v)))
        .collect();
    family(enc, name, help, MetricType::Counter, &s)
}

fn gauges(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: Samples<i64>,
) -> std::fmt::Result {
    let s: Vec<_> = samples
        .into_iter()
        .map(|(l, v)| (l, ConstGauge::new(v)))
        .collect();
    family(enc, name, help, MetricType::Gauge, &s)
}

/// One sample per (value of label `key`, count).
fn by<K: ToString, V>(key: &'static str, rows: impl IntoIterator<Item = (K, V)>) -> Samples<V> {
    rows.into_iter()
        .map(|(k, v)| (vec![(key, k.to_string())], v))
        .collect()
}

/// Per-router samples of one family: `f` gives each router's rows (labels after
/// `endpoint`, value).
fn per_router<V>(
    routers: &[std::sync::Arc<KvRouter>],
    mut f: impl FnMut(&KvRouter) -> Vec<(Labels, V)>,
) -> Samples<V> {
    let mut out = Vec::new();
    for r in routers {
        let ep = r.endpoint().to_string();
        for (labels, v) in f(r) {
            let mut all = vec![("endpoint", ep.clone())];
            all.extend(labels);
            out.push((all, v));
        }
    }
    out
}

impl Collector for Scrape {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let e = &mut enc;
        let rs = &self.routers;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        counters(
            e,
            "responses",
            "Requests answered, by status class",
            by("class", self.responses),
        )?;
        for (name, help, v) in &self.front {
            counters(e, name, help, vec![(vec![], *v)])?;
        }
        counters(
            e,
            "instance_upstream_failures",
            "Failed upstream attempts per instance",
            by("instance", self.failures_by_instance.iter().copied()),
        )?;
        // Totals over every policy the endpoint has had: counters never go down.
        counters(
            e,
            "decisions",
            "Routing decisions made, whichever policy was live",
            per_router(rs, |r| vec![(vec![], r.policy().totals().decisions)]),
        )?;
        counters(
            e,
            "policy_failures",
            "Policy calls that failed by the policy's fault (the native kv-cost decided)",
            per_router(rs, |r| vec![(vec![], r.policy().totals().failures)]),
        )?;
        counters(
            e,
            "policy_fallbacks",
            "Decisions the native kv-cost made because the policy call failed, by reason",
            per_router(rs, |r| {
                by(
                    "reason",
                    CallFailure::REASONS
                        .into_iter()
                        .zip(r.policy().totals().fallbacks),
                )
            }),
        )?;
        counters(
            e,
            "policy_refusals",
            "Policies refused on their way in (not loaded, the live one kept serving), by reason",
            per_router(rs, |r| {
                by(
                    "reason",
                    PolicyError::REASONS
                        .into_iter()
                        .zip(r.policy().totals().refusals),
                )
            }),
        )?;
        counters(
            e,
            "policy_rejections",
            "Requests a policy rejected on purpose",
            per_router(rs, |r| vec![(vec![], r.policy().totals().rejections)]),
        )?;
        counters(
            e,
            "policy_rollbacks",
            "Policy rollbacks, by who asked: the operator, a run of failures, a failure rate",
            per_router(rs, |r| {
                let t = r.policy().totals();
                by(
                    "reason",
                    [
                        ("operator", t.manual_rollbacks),
                        ("failures", t.automatic_rollbacks),
                        ("failure_rate", t.rate_rollbacks),
                    ],
                )
            }),
        )?;
        gauges(
            e,
            "policy_info",
            "The live policy of each endpoint: its name, version and generation (always 1)",
            per_router(rs, |r| {
                let st = r.policy().status();
                vec![(
                    vec![
                        ("policy", st.info.name.clone()),
                        ("version", st.info.version.clone()),
                        ("generation", st.generation.to_string()),
                    ],
                    1,
                )]
            }),
        )?;
        let client = |f: fn(&switchyard_router::client::ClientCounters) -> &AtomicU64| {
            per_router(rs, move |r| vec![(vec![], load(f(r.client().counters())))])
        };
        counters(
            e,
            "instance_down_reports",
            "Instances reported down by the proxy or the health checks",
            client(|c| &c.reported_down),
        )?;
        counters(
            e,
            "ejections",
            "Instances ejected, by kind: unreachable, failing (outlier detection), unhealthy (probes)",
            per_router(rs, |r| {
                let c = r.client().counters();
                by(
                    "kind",
                    [
                        ("unreachable", load(&c.ejected_unreachable)),
                        ("failing", load(&c.ejected_failing)),
                        ("unhealthy", load(&c.ejected_unhealthy)),
                    ],
                )
            }),
        )?;
        counters(
            e,
            "ejections_refused",
            "Ejections refused because too many instances were out already",
            client(|c| &c.ejections_refused),
        )?;
        counters(
            e,
            "held_removals",
            "Instances kept routable after discovery removed them, while requests were in flight",
            client(|c| &c.held_removals),
        )?;
        gauges(
            e,
            "panic_mode",
            "1 while too few instances are available and every instance not known unreachable is routed to",
            per_router(rs, |r| {
                vec![(vec![], i64::from(r.client().snapshot().panic))]
            }),
        )?;
        counters(
            e,
            "expired_bookings",
            "Load bookings released by the hard expiry (each one a leak)",
            per_router(rs, |r| vec![(vec![], r.expired_bookings())]),
        )?;
        counters(
            e,
            "unpredicted_cache_hits",
            "Responses whose worker reported a cached prefix the router had not predicted on that worker (many: tokenization differs)",
            per_router(rs, |r| vec![(vec![], r.unpredicted_cache_hits())]),
        )?;
        let instances = |f: fn(
            &KvRouter,
            switchyard_ids::InstanceId,
            &switchyard_router::client::InstanceState,
        ) -> i64| {
            per_router(rs, move |r| {
                r.client()
                    .snapshot()
                    .instances
                    .iter()
                    .map(|(id, st)| (vec![("instance", id.to_string())], f(r, *id, st)))
                    .collect()
            })
        };
        gauges(
            e,
            "instance_available",
            "1 while the instance is available (routed to)",
            instances(|_, _, st| i64::from(st.availability == Availability::Available)),
        )?;
        gauges(
            e,
            "instance_in_flight",
            "Requests this router has in flight on the instance (the policy sees the worker's own report plus these)",
            instances(|r, id, _| i64::from(r.load_of(id).booked)),
        )?;
        self.quality(e)?;
        self.shadows(e)?;
        let p = &self.prefix;
        counters(
            e,
            "token_prefix_hits",
            "Text prompts that reused the tokens of an earlier prompt's prefix",
            vec![(vec![], p.hits)],
        )?;
        counters(
            e,
            "token_prefix_misses",
            "Long text prompts tokenized from the start",
            vec![(vec![], p.misses)],
        )?;
        counters(
            e,
            "token_prefix_mismatches",
            "Audits that found reused tokens wrong (reuse is then off)",
            vec![(vec![], p.mismatches)],
        )?;
        counters(
            e,
            "tokenizer_lean_mismatches",
            "Audits that found the lean byte-level tokenizer's IDs wrong (it is then off)",
            vec![(vec![], p.lean_mismatches)],
        )?;
        gauges(
            e,
            "token_prefix_cached_tokens",
            "Tokens held for reuse",
            vec![(vec![], i64::try_from(p.tokens).unwrap_or(i64::MAX))],
        )?;
        // Central mode's sockets are shared by every endpoint: said once.
        if let Some(hub) = rs.iter().find_map(|r| r.central_events()) {
            for (name, help, c) in [
                (
                    "kv_events_unrouted",
                    "Engine KV event batches on the bound sockets under a topic no worker names",
                    &hub.unrouted,
                ),
                (
                    "kv_events_dropped",
                    "Engine KV event batches on the bound sockets dropped at a full worker queue (seen as gaps)",
                    &hub.dropped,
                ),
                (
                    "kv_events_malformed_frames",
                    "Messages on the bound sockets that were not [topic, seq, payload]",
                    &hub.malformed,
                ),
                (
                    "kv_events_refused_connections",
                    "Connections to the bound sockets closed for breaking ZMTP or its bounds, or past the peer limit",
                    &hub.refused,
                ),
            ] {
                counters(e, name, help, vec![(vec![], load(c))])?;
            }
        }
        Ok(())
    }
}

impl Scrape {
    /// The live policy's decision quality.
    fn quality(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        let rs = &self.routers;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        counters(
            e,
            "decision_overlap_blocks",
            "Over routed requests, leading prompt blocks cached on the chosen worker (of=chosen) and on the candidate holding the most (of=best); chosen/best is the block-weighted share of the available cache the decisions used",
            per_router(rs, |r| {
                let q = r.quality();
                vec![
                    (
                        vec![("of", "chosen".into())],
                        load(&q.chosen_overlap_blocks),
                    ),
                    (vec![("of", "best".into())], load(&q.best_overlap_blocks)),
                ]
            }),
        )?;
        counters(
            e,
            "instance_decisions",
            "Requests routed to each instance",
            per_router(rs, |r| by("instance", r.quality().by_instance())),
        )?;
        counters(
            e,
            "unrouted_requests",
            "Requests not routed, by kind: no_instances, busy (every worker asked for a pause), or the policy's rejection (all_busy, no_fit, refused)",
            per_router(rs, |r| {
                let counts = r.quality().unrouted.each_ref().map(load);
                by(
                    "kind",
                    switchyard_router::quality::UNROUTED.into_iter().zip(counts),
                )
            }),
        )?;
        counters(
            e,
            "cache_reports",
            "Responses whose worker reported its cached prompt tokens",
            per_router(rs, |r| vec![(vec![], load(&r.quality().cache_reports))]),
        )?;
        counters(
            e,
            "predicted_cached_tokens",
            "Over those responses, the prompt tokens the router predicted cached on the worker it chose",
            per_router(rs, |r| {
                vec![(vec![], load(&r.quality().predicted_cached_tokens))]
            }),
        )?;
        counters(
            e,
            "reported_cached_tokens",
            "Over those responses, the prompt tokens the worker reported cached",
            per_router(rs, |r| {
                vec![(vec![], load(&r.quality().reported_cached_tokens))]
            }),
        )
    }

    /// Every shadow identity each endpoint has run (the attached one marked by
    /// `shadow_info`).
    fn shadows(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        let rs = &self.routers;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        gauges(
            e,
            "shadow_info",
            "The shadow policy attached to each endpoint (always 1)",
            per_router(rs, |r| {
                r.shadow_status()
                    .map(|s| {
                        (
                            vec![
                                ("shadow", switchyard_policy::policy_label(&s.info)),
                                ("sample", s.sample.to_string()),
                            ],
                            1,
                        )
                    })
                    .into_iter()
                    .collect()
            }),
        )?;
        let each = |f: &dyn Fn(&ShadowCounters) -> Vec<(Labels, u64)>| {
            per_router(rs, |r| {
                let mut rows = Vec::new();
                for (label, c) in r.shadow_series().all() {
                    for (mut labels, v) in f(&c) {
                        labels.insert(0, ("shadow", label.clone()));
                        rows.push((labels, v));
                    }
                }
                rows
            })
        };
        for (name, help, pick) in [
            (
                "shadow_offered",
                "Live decisions offered to the shadow",
                (|c: &ShadowCounters| &c.offered) as fn(&ShadowCounters) -> &AtomicU64,
            ),
            (
                "shadow_dropped",
                "Live decisions dropped because the shadow's queue was full (the live path never waits)",
                |c| &c.dropped,
            ),
            (
                "shadow_compared",
                "Decisions where both the live policy and the shadow chose a worker",
                |c| &c.compared,
            ),
            (
                "shadow_agreements",
                "Compared decisions where the shadow chose the live policy's worker",
                |c| &c.agreed,
            ),
            ("shadow_rejections", "Requests the shadow rejected", |c| {
                &c.rejected
            }),
        ] {
            counters(e, name, help, each(&|c| vec![(vec![], load(pick(c)))]))?;
        }
        counters(
            e,
            "shadow_failures",
            "Shadow calls that failed, by reason (contained: the live path is not touched)",
            each(&|c| {
                by(
                    "reason",
                    CallFailure::REASONS
                        .into_iter()
                        .zip(c.failures.each_ref().map(load)),
                )
            }),
        )?;
        counters(
            e,
            "shadow_overlap_blocks",
            "Over compared decisions, leading prompt blocks cached on the shadow's choice, the live choice and the best candidate",
            each(&|c| {
                vec![
                    (
                        vec![("of", "shadow".into())],
                        load(&c.shadow_overlap_blocks),
                    ),
                    (vec![("of", "live".into())], load(&c.live_overlap_blocks)),
                    (vec![("of", "best".into())], load(&c.best_overlap_blocks)),
                ]
            }),
        )?;
        let costs: Samples<ConstCounter<f64>> = per_router(rs, |r| {
            let mut rows = Vec::new();
            for (label, c) in r.shadow_series().all() {
                for (of, v) in [("shadow", c.shadow_cost()), ("live", c.live_cost())] {
                    rows.push((
                        vec![("shadow", label.clone()), ("of", of.to_string())],
                        ConstCounter::new(v),
                    ));
                }
            }
            rows
        });
        family(
            e,
            "shadow_predicted_cost",
            "Over compared decisions, the kv-cost model's predicted cost (default weights) of the shadow's and the live choices",
            MetricType::Counter,
            &costs,
        )?;
        let calls: Samples<Histogram> = per_router(rs, |r| {
            r.shadow_series()
                .all()
                .into_iter()
                .map(|(label, c)| (vec![("shadow", label)], c.call_seconds.clone()))
                .collect()
        });
        family(
            e,
            "shadow_call_seconds",
            "The shadow's own call time, on its own thread",
            MetricType::Histogram,
            &calls,
        )
    }
}

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
struct Reading {
    at: std::time::Instant,
    routed: u64,
    chosen: u64,
    best: u64,
    latency: [u64; switchyard_router::quality::LATENCY_BUCKETS],
    compared: u64,
    agreed: u64,
}

fn reading(r: &KvRouter) -> Reading {
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
