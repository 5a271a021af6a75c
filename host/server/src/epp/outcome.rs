//! What a gateway's answer teaches the router, with the front door's discipline: a
//! worker that answered is counted well; a 5xx counts toward its run of failures
//! (outlier detection ejects after a run, never past its share); a 429/503 is busy,
//! not failing; a pick the gateway moved to a fallback is checked by a health probe,
//! and counts against the worker only if the probe fails (a bad request is not a bad
//! worker).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::Gateway;
use crate::proxy::pick::{Picked, host_port};
use switchyard_ids::InstanceId;

/// Learns from the response headers: `status` as the gateway reports it, `served` the
/// endpoint that answered, if the gateway says.
pub(super) fn learn(
    gw: &Arc<Gateway>,
    p: &mut Picked,
    status: Option<u16>,
    served: Option<String>,
) {
    let client = p.router.client().clone();
    let served_id = served.as_deref().and_then(|s| {
        client
            .snapshot()
            .instances
            .iter()
            .find(|(_, i)| host_port(&i.info.url) == Some(s))
            .map(|(id, _)| *id)
    });
    // Who answered, and whether the gateway said so.
    let (answered, known) = match (&served, served_id) {
        (Some(_), Some(id)) => (Some(id), true),
        // An endpoint the router does not know answered.
        (Some(_), None) => (None, true),
        (None, _) => (Some(p.worker), false),
    };
    if known && answered != Some(p.worker) {
        gw.metrics.epp_moved.fetch_add(1, Ordering::Relaxed);
        // The booking was for the pick; the request's load is elsewhere.
        p.finish();
        probe(
            gw,
            &client,
            p.worker,
            "the gateway could not use it and went elsewhere",
        );
    }
    let Some(answered) = answered else {
        return;
    };
    match status {
        Some(429 | 503) => {
            client.report_busy(answered, None);
        }
        // Not known to come from the pick (the gateway's own answer when it could not
        // reach it looks the same): only a failed probe counts.
        Some(s) if s >= 500 && !known => {
            probe(gw, &client, answered, &format!("{s} through the gateway"));
        }
        Some(s) if s >= 500 => count_failure(gw, &client, answered, s),
        Some(_) => client.record_success(answered),
        None => {}
    }
}

/// Checks `worker` with a health probe now; a failed probe counts against it.
fn probe(
    gw: &Gateway,
    client: &Arc<switchyard_router::client::Client>,
    worker: InstanceId,
    why: &str,
) {
    if gw.config.outlier_detection {
        let (c, why) = (client.clone(), why.to_string());
        tokio::spawn(async move { c.check_now(worker, &why).await });
    } else if gw.config.availability {
        client.report_instance_down(worker, why);
    }
}

fn count_failure(
    gw: &Gateway,
    client: &switchyard_router::client::Client,
    id: InstanceId,
    status: u16,
) {
    gw.metrics.upstream_failures.fetch_add(1, Ordering::Relaxed);
    *gw.metrics
        .failures_by_instance
        .lock()
        .entry(id)
        .or_insert(0) += 1;
    if gw.config.outlier_detection {
        client.record_failure(id, &format!("answered {status} through the gateway"));
    } else if gw.config.availability {
        client.report_instance_down(id, &format!("answered {status} through the gateway"));
    }
}
