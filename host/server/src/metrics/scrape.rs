//! Families read at scrape time from the routers, their clients and policies, so that
//! nothing is counted twice.

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use switchyard_policy::{CallFailure, PolicyError};
use switchyard_router::KvRouter;
use switchyard_router::client::Availability;

pub(super) type Labels = Vec<(&'static str, String)>;

/// One family's samples: its labels (empty for a single unlabelled sample) and value.
pub(super) type Samples<V> = Vec<(Labels, V)>;

/// Everything read at scrape time, encoded by `prometheus-client`.
pub(super) struct Scrape {
    pub(super) responses: [(&'static str, u64); 3],
    pub(super) front: Vec<(&'static str, &'static str, u64)>,
    pub(super) failures_by_instance: Vec<(switchyard_ids::InstanceId, u64)>,
    pub(super) migrations: Vec<((&'static str, &'static str), u64)>,
    pub(super) routers: Vec<std::sync::Arc<KvRouter>>,
    pub(super) prefix: switchyard_tokens::prefix::PrefixStats,
    pub(super) queues: Vec<(
        switchyard_discovery::EndpointPath,
        std::sync::Arc<crate::queue::Queue>,
    )>,
    /// Bytes of request bodies held now (the body budget's).
    pub(super) bodies_held: usize,
}

impl std::fmt::Debug for Scrape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Scrape")
    }
}

pub(super) fn family<M: EncodeMetric>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    samples: &[(Labels, M)],
) -> std::fmt::Result {
    // Declared even with no series yet: a dashboard or an alert on `absent()` tells a
    // metric nothing has counted from one the router does not export.
    let mut m = enc.encode_descriptor(name, help, None, kind)?;
    if samples.is_empty() {
        return Ok(());
    }
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

pub(super) fn counters(
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

pub(super) fn gauges(
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
pub(super) fn by<K: ToString, V>(
    key: &'static str,
    rows: impl IntoIterator<Item = (K, V)>,
) -> Samples<V> {
    rows.into_iter()
        .map(|(k, v)| (vec![(key, k.to_string())], v))
        .collect()
}

/// Per-router samples of one family: `f` gives each router's rows (labels after
/// `endpoint`, value).
pub(super) fn per_router<V>(
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

impl Scrape {
    /// Requests answered, retried and shed; decisions and the policies that made them.
    fn encode_requests(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        let rs = &self.routers;
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
        counters(
            e,
            "migrations",
            "Streams that broke mid-answer, by reason (reset, stall, error_event; continuation: the continuation failed) and outcome (continued, completed, failed, limit, poison, not_continuable)",
            self.migrations
                .iter()
                .map(|((reason, outcome), n)| {
                    (
                        vec![
                            ("reason", reason.to_string()),
                            ("outcome", outcome.to_string()),
                        ],
                        *n,
                    )
                })
                .collect(),
        )?;
        self.encode_queues(e)?;
        gauges(
            e,
            "saturated_instances",
            "Routable workers now saturated (their engine queue, KV cache or requests in flight at the threshold): they get no new request while another worker has room",
            per_router(rs, |r| vec![(vec![], r.saturated().len() as i64)]),
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
        Ok(())
    }

    /// What each endpoint's client knows of its instances: availability, ejections, roles, load.
    fn encode_instances(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        let rs = &self.routers;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
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
            "engine_pages",
            "Engines' /metrics pages read for their load, by result: read, or failed (not read in time, an error status, no engine gauges on it)",
            per_router(rs, |r| {
                let s = r.scrape_stats();
                by(
                    "result",
                    [("read", load(&s.ok)), ("failed", load(&s.failed))],
                )
            }),
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
            "instance_role",
            "1 for the instance's role in a fleet that splits prefill from decode (both, prefill, decode)",
            per_router(rs, |r| {
                r.client()
                    .snapshot()
                    .instances
                    .iter()
                    .map(|(id, st)| {
                        let labels = vec![
                            ("instance", id.to_string()),
                            ("role", st.info.role.to_string()),
                        ];
                        (labels, 1i64)
                    })
                    .collect()
            }),
        )?;
        gauges(
            e,
            "instance_in_flight",
            "Requests this router has in flight on the instance (the policy sees the worker's own report plus these)",
            instances(|r, id, _| i64::from(r.load_of(id).booked)),
        )?;
        Ok(())
    }

    /// The tokenizer's prefix reuse.
    fn encode_tokens(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
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
        Ok(())
    }

    /// Engine KV event input: its memory and the bound sockets.
    fn encode_events(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        let rs = &self.routers;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        gauges(
            e,
            "request_body_bytes_held",
            "Bytes of request bodies held now (being read, waiting or kept for retries, and the endpoint picker's messages being received), of --max-body-bytes-total",
            vec![(vec![], i64::try_from(self.bodies_held).unwrap_or(i64::MAX))],
        )?;
        // One budget for every engine's event input, whichever endpoint it feeds.
        if let Some(r) = rs.first() {
            let budget = r.event_budget();
            gauges(
                e,
                "kv_events_memory_bytes",
                "Bytes of engine KV event input held now (read, queued or replayed, not yet handled), of --kv-events-memory-mib",
                vec![(vec![], i64::try_from(budget.used()).unwrap_or(i64::MAX))],
            )?;
        }
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

    /// The overload queues' families.
    fn encode_queues(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        use crate::queue::ShedReason;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let each = |f: &dyn Fn(&crate::queue::Queue) -> Vec<(Labels, u64)>| {
            let mut out = Vec::new();
            for (ep, q) in &self.queues {
                for (labels, v) in f(q) {
                    let mut all = vec![("endpoint", ep.to_string())];
                    all.extend(labels);
                    out.push((all, v));
                }
            }
            out
        };
        let depth = each(&|q| {
            let (classes, _) = q.depth();
            q.classes()
                .iter()
                .zip(classes)
                .map(|(c, n)| (vec![("class", c.name.clone())], n as u64))
                .collect()
        });
        gauges(
            e,
            "queue_depth",
            "Requests waiting in the router's queue (every worker saturated), per priority class",
            depth.into_iter().map(|(l, v)| (l, v as i64)).collect(),
        )?;
        gauges(
            e,
            "queue_bytes",
            "Bytes of request bodies waiting in the router's queue",
            each(&|q| vec![(vec![], q.depth().1 as u64)])
                .into_iter()
                .map(|(l, v)| (l, v as i64))
                .collect(),
        )?;
        counters(
            e,
            "queued_requests",
            "Requests that waited in the router's queue",
            each(&|q| vec![(vec![], load(&q.stats().queued))]),
        )?;
        counters(
            e,
            "queue_dispatched",
            "Requests placed from the router's queue when a worker had room",
            each(&|q| vec![(vec![], load(&q.stats().dispatched))]),
        )?;
        counters(
            e,
            "queue_shed",
            "Requests refused by the queue, by reason: tenant_over_share (429), fleet_full (503: queue full, displaced by a more urgent class, or a wait ahead longer than the deadline), queue_deadline (503: waited its deadline)",
            each(&|q| {
                ShedReason::ALL
                    .iter()
                    .zip(&q.stats().shed)
                    .map(|(r, n)| (vec![("reason", r.code().to_string())], load(n)))
                    .collect()
            }),
        )?;
        counters(
            e,
            "queue_left",
            "Queued requests whose client left before a worker had room",
            each(&|q| vec![(vec![], load(&q.stats().left))]),
        )
    }
}

impl Collector for Scrape {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let e = &mut enc;
        self.encode_requests(e)?;
        self.encode_instances(e)?;
        self.prediction_errors(e)?;
        self.quality(e)?;
        self.shadows(e)?;
        self.encode_tokens(e)?;
        self.encode_events(e)
    }
}
