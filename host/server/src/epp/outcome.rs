//! What a gateway's answer teaches the router, with the front door's discipline: a
//! worker that answered is counted well; a 5xx counts toward its run of failures
//! (outlier detection ejects after a run, never past its share); a 429/503 is busy,
//! not failing; a pick the gateway moved to a fallback is checked by a health probe,
//! and counts against the worker only if the probe fails (a bad request is not a bad
//! worker).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::Gateway;
use crate::proxy::pick::{Picked, authority};
use crate::verdict::{self, Verdict};
use switchyard_ids::InstanceId;

/// Health probes the answers asked for, at most one per worker per [`Probes::EVERY`]:
/// a gateway that reports every answer as served elsewhere (misconfigured, or hostile)
/// costs a worker one probe a second, not one per request.
#[derive(Default)]
pub(super) struct Probes {
    last: parking_lot::Mutex<HashMap<InstanceId, Instant>>,
    /// The last 503-without-Retry-After probe's verdict on each worker: it answered.
    answered: parking_lot::Mutex<HashMap<InstanceId, bool>>,
}

impl Probes {
    /// Least time between two probes of one worker.
    pub(super) const EVERY: Duration = Duration::from_secs(1);
    /// Most workers remembered (the oldest are forgotten past it).
    const MAX: usize = 4096;

    /// Whether `worker` may be probed at `now` (and, if so, that it was).
    fn take(&self, worker: InstanceId, now: Instant) -> bool {
        let mut last = self.last.lock();
        if last
            .get(&worker)
            .is_some_and(|t| now.saturating_duration_since(*t) < Self::EVERY)
        {
            return false;
        }
        if last.len() >= Self::MAX {
            last.retain(|_, t| now.saturating_duration_since(*t) < Self::EVERY);
        }
        last.insert(worker, now);
        true
    }

    /// Records what a probe found of `worker`.
    fn found(&self, worker: InstanceId, answered: bool) {
        let mut all = self.answered.lock();
        if all.len() >= Self::MAX && !all.contains_key(&worker) {
            all.clear();
        }
        all.insert(worker, answered);
    }

    /// Whether the last probe found `worker` answering (`None`: no verdict yet).
    fn answering(&self, worker: InstanceId) -> Option<bool> {
        self.answered.lock().get(&worker).copied()
    }
}

/// What the gateway's response headers say about the answer.
pub(super) struct Answer {
    /// Its status.
    pub(super) status: Option<u16>,
    /// Its `Retry-After`, if any.
    pub(super) retry_after: Option<Duration>,
    /// The endpoint that answered, if the gateway says.
    pub(super) served: Option<String>,
}

/// Learns from the response headers: once per exchange (a gateway that sends headers
/// again, or a peer replaying them, cannot count one answer's 5xx twice towards a
/// worker's ejection, nor reset its run with repeated successes).
pub(super) fn learn(gw: &Arc<Gateway>, probes: &Arc<Probes>, p: &mut Picked, answer: Answer) {
    if !p.first_answer() {
        return;
    }
    let Answer {
        status,
        retry_after,
        served,
    } = answer;
    let client = p.router.client().clone();
    let served_id = served.as_deref().and_then(|s| {
        client
            .snapshot()
            .instances
            .iter()
            .find(|(_, i)| authority(&i.info.url) == Some(s))
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
            probes,
            &client,
            p.worker,
            "the gateway could not use it and went elsewhere",
        );
    }
    let Some(answered) = answered else {
        return;
    };
    match status {
        // A 503 that gives no `Retry-After` may be the gateway's own answer when it
        // could not reach the pick (Envoy's local reply to a connection failure, with no
        // fallback to go to): busy only once a probe finds it answering; one that does
        // not is reported down (a dead pool is 503 at the client, never "busy, retry").
        // Probed a moment ago: that probe's verdict stands.
        Some(503) if retry_after.is_none() => {
            if !gw.config.availability {
                verdict::apply(gw, &client, answered, Verdict::Busy(None));
            } else if probes.take(answered, Instant::now()) {
                let (gw, c, probes) = (gw.clone(), client.clone(), probes.clone());
                tokio::spawn(async move {
                    let alive = match c.health_of(answered).await {
                        Some(Err(e)) => {
                            let why = format!(
                                "503 without Retry-After through the gateway; and its health check failed: {e}"
                            );
                            verdict::apply(&gw, &c, answered, Verdict::Unreachable(&why));
                            false
                        }
                        Some(Ok(())) | None => {
                            verdict::apply(&gw, &c, answered, Verdict::Busy(None));
                            true
                        }
                    };
                    probes.found(answered, alive);
                });
            } else if probes.answering(answered) == Some(true) {
                verdict::apply(gw, &client, answered, Verdict::Busy(None));
            }
        }
        Some(429 | 503) => {
            verdict::apply(gw, &client, answered, Verdict::Busy(retry_after));
        }
        // Not known to come from the pick (the gateway's own answer when it could not
        // reach it looks the same): only a failed probe counts.
        Some(s) if s >= 500 && !known => {
            probe(
                gw,
                probes,
                &client,
                answered,
                &format!("{s} through the gateway"),
            );
        }
        Some(s) if s >= 500 => {
            gw.metrics.upstream_failure(answered);
            let why = format!("answered {s} through the gateway");
            verdict::apply(gw, &client, answered, Verdict::Failing(&why));
        }
        Some(_) => {
            verdict::apply(gw, &client, answered, Verdict::Answered);
        }
        None => {}
    }
}

/// Checks `worker` with a health probe now (unless it was a moment ago); a failed
/// probe counts against it.
fn probe(
    gw: &Gateway,
    probes: &Probes,
    client: &Arc<switchyard_router::client::Client>,
    worker: InstanceId,
    why: &str,
) {
    if gw.config.outlier_detection && !probes.take(worker, Instant::now()) {
        return;
    }
    verdict::apply(gw, client, worker, Verdict::Doubtful(why));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_is_probed_at_most_once_a_second_however_many_answers_ask() {
        let probes = Probes::default();
        let (a, b) = (InstanceId(1), InstanceId(2));
        let t0 = Instant::now();
        assert!(probes.take(a, t0));
        let asked = (1..1000)
            .filter(|i| probes.take(a, t0 + Duration::from_micros(*i)))
            .count();
        assert_eq!(asked, 0, "every answer probed the worker");
        assert!(probes.take(b, t0), "another worker waits for no one");
        assert!(probes.take(a, t0 + Probes::EVERY));
    }
}
