//! The proxy: route a completion request, forward it to the chosen worker, pass the
//! response through unchanged (streaming included), and fail over.
//!
//! Each failed attempt is classified (docs/architecture/availability.md, "Failover"; what each does to the
//! worker: `crate::verdict`):
//! - unreachable (refused, reset, connect timeout): the worker is ejected at once and the
//!   request tried elsewhere; a connection the worker closed before answering is retried
//!   once on a fresh connection first, and the router's own resource exhaustion (out of
//!   file descriptors or ports) is never blamed on a worker;
//! - 429 or 503: the worker is busy: skipped for its `Retry-After`, never ejected;
//! - another 5xx, or no first byte of a stream within the first-byte timeout: tried
//!   elsewhere; the failure is counted against the worker only once another worker has
//!   served the request, and a request that failed on two workers is the request's fault
//!   (poison): it is not retried further, counts against no one, and the client gets the
//!   worker's own answer;
//! - a non-streaming request that exceeds the request timeout gets 504 and is not
//!   retried (it would take as long elsewhere); the worker is counted only if its health
//!   check fails too.
//!
//! Once bytes have reached the client, an upstream failure, a server-error event or a
//! stall longer than the idle timeout moves the stream to another worker, which
//! continues the answer (`migrate`, up to `--migration-limit` times); a stream that
//! cannot be continued ends (with an SSE error event for event streams). The load
//! booking is released on every path: end, failure, retry, stall, client gone, and
//! moves with a migrated stream.
//!
//! - this module: a completion's stages (`completion`), and each failed attempt settled;
//! - `prepare`: the request parsed, tokenized and hashed on its model's router, then
//!   admitted by the overload queue;
//! - `attempt`: the attempts: placed, booked, both legs of a split sent, the answer
//!   relayed or the failure settled;
//! - `tokenize`: prompts to token IDs, off the async threads when long;
//! - `forward`: one attempt on one worker, its failure classified;
//! - `relay`: the answer streamed to the client, the booking kept and released;
//! - `migrate`: a broken stream continued on another worker.

mod attempt;
mod chunk;
mod forward;
mod handoff;
mod migrate;
pub(crate) mod pick;
mod prepare;
mod relay;
mod split;
mod tokenize;

pub use chunk::view_agrees;
pub use forward::parse_retry_after;
pub use migrate::{MAX_KEPT_TEXT, continuation_of, relay_events, strip_token_ids};

/// vLLM's handoff as the router reads it: the decode worker's request, from the client's
/// `body` and the prefill worker's `answer` (exported for the fuzz targets).
pub fn vllm_handoff(body: &[u8], answer: &[u8]) -> Result<Bytes, String> {
    let params = handoff::vllm_transfer_params(answer)?;
    Ok(handoff::vllm_decode_body(handoff::object(body)?, params))
}
pub(crate) use tokenize::tokenize;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Response;
use hyper::body::Incoming;

use crate::verdict::{self, Verdict};
use crate::{ApiError, Body, Gateway};
use switchyard_ids::{InstanceId, RequestId};
use switchyard_router::client::Client;
use switchyard_router::{KvRouter, PrefillLeg, RouteError, Routed};
use switchyard_tokens::openai::Api;

use forward::{forward, set_retry_after};

/// Releases a request's load booking when dropped.
pub(super) struct Booking {
    pub(super) router: Arc<KvRouter>,
    pub(super) request: RequestId,
}

impl Drop for Booking {
    fn drop(&mut self) {
        self.router.finish(self.request);
    }
}

/// A placement with both legs' bookings as guards: whatever path the attempt then takes
/// (a worker gone from discovery, a failed leg, the client leaving), dropping them
/// releases the load booked.
pub(super) struct Booked {
    pub(super) routed: Routed,
    pub(super) booking: Booking,
    pub(super) prefill: Option<(PrefillLeg, Booking)>,
}

/// A decision the router made: counted in the endpoint's decision timings, and booked
/// as guards.
pub(super) fn decided(
    gw: &Gateway,
    endpoint: &str,
    router: &Arc<KvRouter>,
    routed: Routed,
) -> Booked {
    gw.metrics
        .timings
        .decision(endpoint, routed.decision_time, routed.decision.call_time);
    book(router, routed)
}

pub(super) fn book(router: &Arc<KvRouter>, routed: Routed) -> Booked {
    let guard = |request| Booking {
        router: router.clone(),
        request,
    };
    Booked {
        booking: guard(routed.request),
        prefill: routed.prefill.map(|leg| (leg, guard(leg.request))),
        routed,
    }
}

/// A worker's own answer, kept to pass on to the client.
pub(super) type Answer = (hyper::http::response::Parts, Bytes);

/// Why one attempt failed before the first byte reached the client.
#[derive(Debug)]
pub(super) enum Failure {
    /// Refused, reset, connect timeout, or the response broke before its first byte.
    Unreachable(String),
    /// The worker closed the connection before answering (e.g. an idle keep-alive
    /// connection it had just closed); worth one retry on a fresh connection.
    Closed(String),
    /// The router itself is out of a resource (file descriptors, ports).
    Local(String),
    /// No answer within the timeout.
    Timeout(String),
    /// 429 or 503: busy, with the worker's `Retry-After`.
    Busy(Answer, Option<Duration>),
    /// Another 5xx.
    Status(Answer),
}

impl Failure {
    fn reason(&self) -> String {
        match self {
            Failure::Unreachable(e) => format!("unreachable: {e}"),
            Failure::Closed(e) => format!("connection closed before an answer: {e}"),
            Failure::Local(e) => format!("the router is out of resources: {e}"),
            Failure::Timeout(e) => format!("timed out: {e}"),
            Failure::Busy((p, _), _) => format!("busy: answered {}", p.status),
            Failure::Status((p, _)) => format!("answered {}", p.status),
        }
    }
}

pub(super) enum Forwarded {
    /// A 2xx head and its first data frame (or none: an empty body).
    Ok(hyper::http::response::Parts, Option<Bytes>, Incoming),
    /// A 4xx other than 429: the worker refused the request itself; passed through.
    ClientError(Answer),
}

/// What the request has done so far, across attempts.
#[derive(Default)]
pub(super) struct Attempts {
    /// Workers not to try again for this request.
    pub(super) exclude: Vec<InstanceId>,
    /// 5xx answers and timeouts, counted against their workers only if another worker
    /// then serves the request.
    pub(super) pending: Vec<(InstanceId, String)>,
    /// The last worker answer worth passing on (a 5xx or a busy answer).
    pub(super) answer: Option<Answer>,
    /// The last failure.
    pub(super) last: Option<Failure>,
    /// Fresh-connection retries used (one per request).
    pub(super) reconnects: u32,
}

/// Routes and forwards a completion whose body has been read whole (`super::body`), in
/// three stages: the request prepared (`prepare`), admitted by the overload queue
/// (`admit`), then its attempts (`attempt`).
pub(crate) async fn completion(
    gw: &Arc<Gateway>,
    api: Api,
    req: &hyper::http::request::Parts,
    body: Bytes,
    request_started: Instant,
    slot: &mut Option<switchyard_bounded::slot::Slot>,
) -> Result<Response<Body>, ApiError> {
    let prepared = prepare::prepare(gw, api, req, &body).await?;
    let queued = prepare::admit(gw, &prepared, body.len(), slot).await?;
    attempt::attempts(gw, &prepared, body, queued, request_started).await
}

/// How long a failed decode leg waits to hear whether its prefill leg failed first
/// (SGLang's handoff, both legs at once).
const PREFILL_VERDICT: Duration = Duration::from_secs(2);

/// One attempt of a request.
#[derive(Clone, Copy)]
struct Attempt {
    /// The client's request streams.
    stream: bool,
    /// Its first-byte or request timeout.
    limit: Duration,
    /// Its number, from 1.
    number: usize,
}

/// The worker of a failed attempt.
struct Failed<'a> {
    worker: InstanceId,
    url: &'a str,
    attempt: Attempt,
    /// It ran a split request's prefill leg.
    prefill: bool,
}

/// Records a failed attempt (either leg of a split one too) and decides what follows:
/// `None` to try again elsewhere, or the client's answer. Busy workers are skipped,
/// unreachable ones ejected, 5xx answers and stalls counted against their workers only
/// once another worker serves the request, and a request that failed on two workers of
/// the same role is the request's fault (poison).
fn settle(
    gw: &Arc<Gateway>,
    router: &Arc<KvRouter>,
    a: &mut Attempts,
    at: Failed<'_>,
    failure: Failure,
) -> Option<Result<Response<Body>, ApiError>> {
    let client = router.client();
    let worker = at.worker;
    if at.prefill {
        gw.metrics.prefill_failures.fetch_add(1, Ordering::Relaxed);
    }
    let reason = failure.reason();
    count_failed_attempt(gw, router, worker, at.url, &failure, at.attempt.number);
    if !gw.config.outlier_detection {
        // The baseline: every failure ejects at once, and the request moves on.
        verdict::apply(gw, client, worker, Verdict::Unreachable(&reason));
        a.exclude.push(worker);
        a.last = Some(failure);
        return None;
    }
    match &failure {
        Failure::Local(e) => {
            gw.metrics.local_failures.fetch_add(1, Ordering::Relaxed);
            return Some(Err(ApiError::Overloaded(format!(
                "the router cannot open a connection to a worker: {e}"
            ))));
        }
        Failure::Closed(_) | Failure::Unreachable(_) => {
            verdict::apply(gw, client, worker, Verdict::Unreachable(&reason));
        }
        Failure::Busy(ans, retry_after) => {
            let skip = verdict::apply(gw, client, worker, Verdict::Busy(*retry_after));
            gw.metrics.busy.fetch_add(1, Ordering::Relaxed);
            let mut ans = (ans.0.clone(), ans.1.clone());
            set_retry_after(&mut ans.0.headers, skip);
            a.answer = Some(ans);
        }
        Failure::Status(ans) => {
            a.answer = Some((ans.0.clone(), ans.1.clone()));
            a.pending.push((worker, reason.clone()));
        }
        Failure::Timeout(_) if !at.attempt.stream => {
            // Not retried: it would take as long elsewhere. Counted against the
            // worker only if it is silent.
            verdict::apply(gw, client, worker, Verdict::Doubtful(&reason));
            return Some(Err(ApiError::UpstreamTimeout(format!(
                "no answer within the request timeout of {:?}",
                at.attempt.limit
            ))));
        }
        Failure::Timeout(_) => a.pending.push((worker, reason.clone())),
    }
    a.exclude.push(worker);
    a.last = Some(failure);
    // Poison is judged per leg: two prefill workers, or two workers that decode.
    let role_of = |w: InstanceId| client.instance(w).map(|i| i.role);
    let role = role_of(worker);
    let failed_workers = a
        .pending
        .iter()
        .filter(|(w, _)| role_of(*w) == role)
        .count();
    if failed_workers >= 2 {
        // Failed on two workers: the request's fault. Eject no one, stop here.
        gw.metrics.poison.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(endpoint = %router.endpoint(), workers = failed_workers, "request failed on several workers; treated as its own fault (poison), not retried");
        a.pending.clear();
        return Some(give_up(gw, client, std::mem::take(a), None));
    }
    None
}

/// A failed attempt in the log and the front door's counters (busy answers and the
/// router's own exhaustion are not upstream failures).
fn count_failed_attempt(
    gw: &Gateway,
    router: &KvRouter,
    worker: InstanceId,
    url: &str,
    failure: &Failure,
    attempt: usize,
) {
    let reason = failure.reason();
    tracing::warn!(endpoint = %router.endpoint(), instance = %worker, url, reason, attempt, "upstream attempt failed");
    if !matches!(failure, Failure::Busy(..) | Failure::Local(_)) {
        gw.metrics.upstream_failure(worker);
    }
}

/// The answer when no attempt succeeded: the worker's own answer if there is one (a
/// 5xx or busy answer), else the routing error (503) or the last failure (502/504).
/// A single pending 5xx with no worker left to confirm it counts against its worker.
pub(super) fn give_up(
    gw: &Gateway,
    client: &Arc<Client>,
    a: Attempts,
    route: Option<RouteError>,
) -> Result<Response<Body>, ApiError> {
    for (w, reason) in &a.pending {
        verdict::apply(gw, client, *w, Verdict::Failing(reason));
    }
    if let Some(ans) = a.answer {
        return Ok(answer(ans));
    }
    match (a.last, route) {
        (None, Some(e)) => Err(e.into()),
        (Some(Failure::Timeout(t)), Some(e)) => {
            Err(ApiError::UpstreamTimeout(format!("{t}; and then {e}")))
        }
        (Some(f), Some(e)) => Err(ApiError::Upstream(format!("{}; and then {e}", f.reason()))),
        (Some(Failure::Timeout(t)), None) => Err(ApiError::UpstreamTimeout(t)),
        (Some(f), None) => Err(ApiError::Upstream(f.reason())),
        (None, None) => Err(ApiError::Upstream("no attempt was made".into())),
    }
}

pub(super) fn answer((parts, bytes): Answer) -> Response<Body> {
    Response::from_parts(parts, Full::new(bytes).map_err(|e| match e {}).boxed())
}
