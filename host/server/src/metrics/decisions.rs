//! The live policy's decision quality and each shadow's comparison with it.

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::histogram::Histogram;

use switchyard_policy::CallFailure;
use switchyard_router::shadow::ShadowCounters;

use super::scrape::{Labels, Samples, Scrape, by, counters, family, gauges, per_router};

impl Scrape {
    /// The live policy's decision quality.
    pub(super) fn quality(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
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
    pub(super) fn shadows(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
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
