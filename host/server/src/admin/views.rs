//! The admin API's answers: policies, instances, endpoints, history, shadows and decision
//! quality as JSON.

use std::time::UNIX_EPOCH;

use serde_json::{Value, json};

use switchyard_policy::{PolicyInfo, PolicyStatus};
use switchyard_router::KvRouter;
use switchyard_router::client::Availability;
use switchyard_router::shadow::ShadowStatus;

pub(super) fn secs(t: std::time::SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A policy's identity — name, version, sha256, source, configuration — with `rest`.
pub(super) fn identified(info: &PolicyInfo, rest: Value) -> Value {
    let mut all = json!({
        "name": info.name,
        "version": info.version,
        "sha256": info.sha256,
        "source": info.source.to_string(),
        "config": info.config,
    });
    if let (Value::Object(all), Value::Object(rest)) = (&mut all, rest) {
        all.extend(rest);
    }
    all
}

/// The admin API's view of a policy's status.
pub fn status_json(s: &PolicyStatus) -> Value {
    identified(
        &s.info,
        json!({
            "loaded_at": secs(s.info.loaded_at),
            "load_ms": s.info.load_time.as_secs_f64() * 1e3,
            "compiled": format!("{:?}", s.info.cache),
            "world": s.info.world,
            "generation": s.generation,
            "active_since": secs(s.active_since),
            "decisions": s.decisions,
            "failures": s.failures,
            "fallbacks": s.fallbacks,
            "rejections": s.rejections,
            "rollbacks": s.rollbacks,
            "previous": s.previous.as_ref().map(|p| json!({"name": p.name, "version": p.version, "sha256": p.sha256})),
            "last_good": s.last_good.as_ref().map(|p| json!({"name": p.name, "version": p.version, "sha256": p.sha256})),
            "proven": s.proven,
            "guest_log": {"logged": s.guest_log_lines.0, "suppressed": s.guest_log_lines.1},
        }),
    )
}

pub(super) fn instances_json(r: &KvRouter) -> Value {
    let snap = r.client().snapshot();
    let list: Vec<Value> = snap
        .instances
        .iter()
        .map(|(id, st)| {
            let load = r.load_of(*id);
            let (available, down) = match &st.availability {
                Availability::Available => (true, Value::Null),
                Availability::Down { since, reason, failed_probes, kind, ejected_for } => (
                    false,
                    json!({"since": secs(*since), "reason": reason, "failed_probes": failed_probes, "kind": format!("{kind:?}").to_lowercase(), "ejected_for_secs": ejected_for.as_secs_f64()}),
                ),
            };
            json!({
                "id": id.to_string(),
                "url": st.info.url,
                "model": st.info.model,
                "role": st.info.role.as_str(),
                "bootstrap_port": st.info.bootstrap_port,
                "events": st.info.events_url.is_some() || st.info.engine_events.is_some(),
                "kv_events": st.info.engine_events.as_ref().map(|e| &e.endpoint),
                "cache_view": r.cache_view(*id),
                "cache_view_counts": r.view_status(*id).map(|v| json!({
                    "stored_blocks": v.counts.stored_blocks,
                    "removed_blocks": v.counts.removed_blocks,
                    "wrong_block_size": v.counts.wrong_block_size,
                    "unknown_parent": v.counts.unknown_parent,
                    "bad_tokens": v.counts.bad_tokens,
                    "other_tier": v.counts.other_tier,
                    "unknown_type": v.counts.unknown_type,
                    "lost_gaps": v.counts.lost_gaps,
                    "restarts": v.counts.restarts,
                    "malformed": v.malformed,
                    "replay_failures": v.replay_failures,
                })),
                "available": available,
                "down": down,
                "probation": st.health.on_probation(),
                "ejections": st.health.ejections(),
                "consecutive_failures": st.health.consecutive_failures(),
                "held_until": st.held_until.map(secs),
                "in_flight": load.in_flight,
                "booked": load.booked,
                "engine_queue_estimate": load.queued,
                "batch_full": load.batch_full,
                "saturated": r.saturation_of(*id),
                "reported_running": load.reported.map(|l| l.running),
                "reported_waiting": load.reported.map(|l| l.waiting),
                "active_blocks": load.active_blocks,
                "pending_prefill_tokens": load.pending_prefill_tokens,
                "prefill_rate_tokens_per_s": load.prefill_rate().map(|r| r.round()),
                "expected_wait_ms": load.expected_wait.map(|w| w.as_millis() as u64),
                "awaiting_first_token": load.awaiting_first,
                "latency_model": latency_json(&load.latency, &r.recent_predictions(*id)),
                "kv_usage": load.reported.and_then(|l| l.kv_usage()),
                "cached_blocks": r.cached_blocks(*id),
                "cache_blocks": r.known_capacity(*id),
                // vLLM by its `/v1/models`: asked for token IDs, a stream of it migrates
                // exactly.
                "streams_token_ids": r.streams_token_ids(*id),
            })
        })
        .collect();
    json!({"endpoint": r.endpoint().to_string(), "panic": snap.panic, "instances": list})
}

/// A worker's latency model: its coefficients, samples and prediction errors (mean
/// absolute percentage, with how many predictions each was over).
fn latency_json(
    l: &switchyard_kv::load::LatencySummary,
    recent: &[switchyard_kv::load::Compared],
) -> Value {
    let ms = |s: f64| (s * 1e6).round() / 1e3;
    let error = |e: &switchyard_kv::latency::ErrorSum| json!({"mean_abs_pct": e.mean().map(|m| (m * 1e3).round() / 10.0), "predictions": e.count});
    json!({
        "ttft_ms_per_request": l.ttft.map(|(a, _)| ms(a)),
        "ttft_ms_per_1k_tokens": l.ttft.map(|(_, s)| ms(s * 1e3)),
        "tpot_ms_base": l.tpot.map(|(a, _, _)| ms(a)),
        "tpot_ms_per_request": l.tpot.map(|(_, b, _)| ms(b)),
        "tpot_ms_per_1k_pending_tokens": l.tpot.map(|(_, _, c)| ms(c * 1e3)),
        "samples": {"ttft": l.samples.0, "tpot": l.samples.1},
        "output_tokens": l.output_tokens.map(|n| n.round()),
        "error": {
            "ttft": error(&l.errors.ttft),
            "tpot": error(&l.errors.tpot),
            "e2e": error(&l.errors.e2e),
        },
        // The latest predictions beside what happened, with what was known at booking.
        "recent": recent.iter().map(|c| json!({
            "of": c.of,
            "predicted_ms": c.predicted.map(|d| ms(d.as_secs_f64())),
            "observed_ms": ms(c.observed.as_secs_f64()),
            "ahead_requests": c.features.ahead_requests,
            "ahead_tokens": c.features.ahead_tokens,
            "uncached_tokens": c.features.uncached,
            "in_flight": c.features.in_flight,
        })).collect::<Vec<_>>(),
    })
}

pub(super) fn endpoint_json(r: &KvRouter, queue: Option<&crate::queue::Queue>) -> Value {
    json!({
        "endpoint": r.endpoint().to_string(),
        "queue": queue.map_or(Value::Null, queue_json),
        "policy": status_json(&r.policy().status()),
        "history": history_json(r),
        "shadow": r.shadow_status().map_or(Value::Null, |s| shadow_json(&s)),
        "quality": quality_json(r),
        "instances": instances_json(r)["instances"],
    })
}

/// The endpoint's policy changes, oldest first.
pub(super) fn history_json(r: &KvRouter) -> Value {
    r.policy()
        .changes()
        .iter()
        .map(|c| {
            json!({
                "at": secs(c.at),
                "kind": c.kind,
                "policy": c.policy,
                "sha256": c.sha256,
                "detail": c.detail,
            })
        })
        .collect()
}

/// A shadow: its identity and what it did since it was attached.
pub fn shadow_json(s: &ShadowStatus) -> Value {
    let t = &s.tally;
    identified(
        &s.info,
        json!({
            "sample": s.sample,
            "attached_at": secs(s.attached_at),
            "offered": t.offered,
            "dropped": t.dropped,
            "compared": t.compared,
            "agreed": t.agreed,
            "agreement": t.agreement(),
            "rejected": t.rejected,
            "live_rejected": t.live_rejected,
            "failures": t.failures,
            "overlap_ratio": {"shadow": t.shadow_overlap_ratio(), "live": t.live_overlap_ratio()},
            "overlap_blocks": {"shadow": t.shadow_overlap_blocks, "live": t.live_overlap_blocks, "best": t.best_overlap_blocks},
            "predicted_cost_total": {"shadow": t.shadow_cost, "live": t.live_cost},
            "mean_predicted_cost": {"shadow": t.shadow_mean_cost(), "live": t.live_mean_cost()},
            "calls": t.calls,
            "call_seconds": t.call_seconds,
            "mean_call_us": t.mean_call().map(|d| d.as_secs_f64() * 1e6),
        }),
    )
}

/// The live policy's decision quality over the endpoint's life.
pub(super) fn quality_json(r: &KvRouter) -> Value {
    use std::sync::atomic::Ordering::Relaxed;
    let q = r.quality();
    let unrouted: serde_json::Map<String, Value> = switchyard_router::quality::UNROUTED
        .iter()
        .zip(&q.unrouted)
        .map(|(k, n)| ((*k).to_string(), json!(n.load(Relaxed))))
        .collect();
    let by_instance: serde_json::Map<String, Value> = q
        .by_instance()
        .into_iter()
        .map(|(id, n)| (id.to_string(), json!(n)))
        .collect();
    json!({
        "routed": q.routed.load(Relaxed),
        "continuations": q.continuations.load(Relaxed),
        "chosen_overlap_blocks": q.chosen_overlap_blocks.load(Relaxed),
        "best_overlap_blocks": q.best_overlap_blocks.load(Relaxed),
        "overlap_ratio": q.overlap_ratio(),
        "cache_reports": q.cache_reports.load(Relaxed),
        "predicted_cached_tokens": q.predicted_cached_tokens.load(Relaxed),
        "reported_cached_tokens": q.reported_cached_tokens.load(Relaxed),
        "unrouted": unrouted,
        "decisions_by_instance": by_instance,
        "decisions": r.policy().totals().decisions,
    })
}

/// The endpoint's overload queue: what waits per class and tenant, what was refused.
pub(super) fn queue_json(q: &crate::queue::Queue) -> Value {
    use std::sync::atomic::Ordering::Relaxed;
    let (depth, bytes) = q.depth();
    let stats = q.stats();
    let classes: Vec<Value> = q
        .classes()
        .iter()
        .zip(depth)
        .map(|(c, n)| json!({"class": c.name, "rank": c.rank, "deadline_secs": c.deadline.as_secs_f64(), "waiting": n}))
        .collect();
    let tenants: Vec<Value> = q
        .tenants(20)
        .into_iter()
        .map(|(t, n)| json!({"tenant": &*t, "waiting": n}))
        .collect();
    let shed: serde_json::Map<String, Value> = crate::queue::ShedReason::ALL
        .iter()
        .zip(&stats.shed)
        .map(|(r, n)| (r.code().to_string(), json!(n.load(Relaxed))))
        .collect();
    json!({
        "classes": classes,
        "bytes": bytes,
        "full": q.is_full(),
        "tenants": tenants,
        "queued_total": stats.queued.load(Relaxed),
        "dispatched_total": stats.dispatched.load(Relaxed),
        "left_total": stats.left.load(Relaxed),
        "shed_total": shed,
    })
}
