//! The proxy: route a completion request, forward it to the chosen worker, pass the
//! response through unchanged (streaming included), and fail over.
//!
//! Each failed attempt is classified (see ARCHITECTURE.md, "Failover"):
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
//! - this module: the attempts and their failover (`completion`);
//! - `tokenize`: prompts to token IDs, off the async threads when long;
//! - `forward`: one attempt on one worker, its failure classified;
//! - `relay`: the answer streamed to the client, the booking kept and released;
//! - `migrate`: a broken stream continued on another worker.

mod chunk;
mod forward;
mod handoff;
mod migrate;
mod relay;
mod split;
mod tokenize;

pub use chunk::view_agrees;
pub use forward::parse_retry_after;
pub use migrate::{MAX_KEPT_TEXT, continuation_of, relay_events};

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
use hyper::header::{ACCEPT, AUTHORIZATION};

use crate::{ApiError, Body, Gateway};
use switchyard_ids::{InstanceId, RequestId};
use switchyard_router::client::Client;
use switchyard_router::{KvRouter, Placing, RouteError};
use switchyard_tokens::openai::{self, Api};

use forward::{forward, set_retry_after};
use relay::Relay;
use tokenize::BLOCKING_TOKENIZE_BYTES;

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

/// Routes and forwards a completion whose body has been read whole (`super::body`).
pub(crate) async fn completion(
    gw: &Arc<Gateway>,
    api: Api,
    req: &hyper::http::request::Parts,
    body: Bytes,
    request_started: Instant,
) -> Result<Response<Body>, ApiError> {
    let path = req.uri.path().to_string();
    let accept = req.headers.get(ACCEPT).cloned();
    // Kept only for endpoints whose workers may see clients' credentials.
    let auth = req.headers.get(AUTHORIZATION).cloned();
    let parsed = if body.len() > BLOCKING_TOKENIZE_BYTES {
        // A large body is parsed off the async workers.
        let b = body.clone();
        tokio::task::spawn_blocking(move || openai::parse(api, &b))
            .await
            .map_err(|e| ApiError::Upstream(format!("the request parser failed: {e}")))?
    } else {
        openai::parse(api, &body)
    }
    .map_err(ApiError::BadRequest)?;
    let router = gw.fleet.router_for_model(&parsed.model).ok_or_else(|| {
        if gw.fleet.model_known(&parsed.model) {
            ApiError::ModelUnavailable(parsed.model.clone())
        } else {
            ApiError::UnknownModel(parsed.model.clone())
        }
    })?;
    let headers = forward::Outbound {
        accept,
        auth: auth.filter(|_| router.forwards_authorization()),
        request_id: None,
    };
    let tokens = tokenize(gw, &parsed.prompt, parsed.continue_final_message).await?;
    // Refused before anything is booked or predicted: a prompt no worker can take must
    // not cost the router its locks or its prediction budget.
    let context = router
        .context_len()
        .map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX));
    if tokens.len() > gw.config.max_prompt_tokens.min(context) {
        let limit = if context < gw.config.max_prompt_tokens {
            format!("the model's context is {context} tokens (its workers' max_model_len)")
        } else {
            format!(
                "this router takes at most {} (--max-prompt-tokens)",
                gw.config.max_prompt_tokens
            )
        };
        return Err(ApiError::BadRequest(openai::BadRequest {
            message: format!("the prompt has {} tokens; {limit}", tokens.len()),
            param: Some(
                if api == Api::Chat {
                    "messages"
                } else {
                    "prompt"
                }
                .into(),
            ),
        }));
    }
    let session_key = parsed
        .user
        .as_deref()
        .map(|u| xxhash_rust::xxh3::xxh3_64(u.as_bytes()));
    let hashes = router
        .hasher()
        .salted_hashes(&tokens, parsed.cache_salt.as_deref());
    let prompt_tokens = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
    // A stream's first bytes come at its first token; a plain answer's only at its end.
    let limit = if parsed.stream {
        gw.config.first_byte_timeout
    } else {
        gw.config.request_timeout
    };
    let client = router.client().clone();
    let endpoint = router.endpoint().to_string();

    // Past the fleet's capacity the request waits in the router's queue, and is placed
    // when a worker has room (`crate::queue`).
    let mut queued: Option<switchyard_router::Routed> = None;
    if let Some(queue) = gw.queue_for(&router) {
        let who = gw
            .config
            .overload
            .identify(&req.headers, gw.config.request_timeout)
            .map_err(|message| {
                ApiError::BadRequest(openai::BadRequest {
                    message,
                    param: None,
                })
            })?;
        let job = crate::queue::Job {
            prompt_tokens,
            hashes: hashes.clone(),
            session_key,
        };
        use crate::queue::{Admission, Outcome};
        let outcome = match queue.admit(&who, job, body.len()) {
            Admission::Now(outcome) => outcome,
            Admission::Queued(ticket) => ticket.wait().await,
        };
        match outcome {
            Outcome::Placed(p) => queued = Some(p.take()),
            Outcome::Route => {}
            Outcome::Shed(s) => return Err(ApiError::Shed(s)),
        }
    }

    let mut a = Attempts::default();
    let mut attempt = 0;
    // vLLM's handoff: a prefill done, and the decode request carrying it (with the
    // split's request ID), kept for the next decode worker when one fails before its
    // first byte.
    let mut kept: Option<(Bytes, forward::Outbound)> = None;
    while attempt < gw.config.max_attempts.max(1) {
        let placing = if kept.is_some() {
            Placing::Decode
        } else {
            Placing::Any
        };
        let placed = match queued.take() {
            Some(r) => Ok(r),
            None => router.place(
                prompt_tokens,
                &hashes,
                session_key,
                &a.exclude,
                Instant::now(),
                placing,
            ),
        };
        let routed = match placed {
            Ok(r) => {
                gw.metrics
                    .timings
                    .decision(&endpoint, r.decision_time, r.decision.call_time);
                r
            }
            Err(_) if kept.is_some() => {
                // No decode worker is left for the prefill kept: place it anew.
                kept = None;
                continue;
            }
            // A retry the policy refuses is refused for the workers it left out (a split
            // fleet with its only decode worker excluded): the client hears what failed.
            Err(e @ RouteError::Rejected(_)) if attempt == 0 => return Err(e.into()),
            Err(e) => return give_up(&client, a, Some(e)),
        };
        if attempt > 0 {
            gw.metrics.retries.fetch_add(1, Ordering::Relaxed);
        }
        attempt += 1;
        let this = Attempt {
            stream: parsed.stream,
            limit,
            number: attempt,
        };
        let booking = Booking {
            router: router.clone(),
            request: routed.request,
        };
        let worker = routed.worker;
        let Some(instance) = client.instance(worker) else {
            a.exclude.push(worker);
            continue;
        };
        // A split request's prefill leg: done first (vLLM), or running beside the
        // decode leg (SGLang).
        let mut beside = None;
        let (send_body, send_headers) = match routed.prefill {
            None => kept
                .clone()
                .unwrap_or_else(|| (body.clone(), headers.clone())),
            Some(leg) => {
                let prefill_booking = Booking {
                    router: router.clone(),
                    request: leg.request,
                };
                let Some(p) = client.instance(leg.worker) else {
                    a.exclude.push(leg.worker);
                    continue;
                };
                gw.metrics.splits.fetch_add(1, Ordering::Relaxed);
                match handoff::Protocol::of(&p) {
                    handoff::Protocol::Vllm => {
                        // One request ID for both legs, as vLLM's own proxy sends.
                        let both = headers.with_fresh_id();
                        match split::vllm_prefill(gw, &p.url, &path, &both, &body).await {
                            Ok(decode_body) => {
                                client.record_success(leg.worker);
                                kept = Some((decode_body.clone(), both.clone()));
                                (decode_body, both)
                            }
                            Err(split::LegEnd::Refused(ans)) => return Ok(answer(ans)),
                            Err(split::LegEnd::Failed(f)) => {
                                drop(booking);
                                drop(prefill_booking);
                                let failed = Failed {
                                    worker: leg.worker,
                                    url: &p.url,
                                    attempt: this,
                                    prefill: true,
                                };
                                match settle(gw, &router, &mut a, failed, f) {
                                    Some(done) => return done,
                                    None => continue,
                                }
                            }
                        }
                    }
                    handoff::Protocol::Sglang { host, port } => {
                        let both = handoff::sglang_body(&body, &host, port, handoff::fresh_room())
                            .map_err(|m| {
                                ApiError::BadRequest(openai::BadRequest {
                                    message: m,
                                    param: None,
                                })
                            })?;
                        let task = tokio::spawn(split::prefill_beside(
                            gw.clone(),
                            p.url.clone(),
                            path.clone(),
                            headers.clone(),
                            both.clone(),
                            gw.config.request_timeout,
                            prefill_booking,
                        ));
                        beside = Some((leg.worker, p.url.clone(), task));
                        (both, headers.clone())
                    }
                }
            }
        };
        let send = || {
            forward(
                gw,
                &instance.url,
                &path,
                &send_headers,
                send_body.clone(),
                limit,
            )
        };
        // The prefill leg beside has answered (its task is done and not polled again).
        let mut prefill_answered = false;
        let mut sent = match &mut beside {
            None => send().await,
            Some((pw, purl, task)) => {
                // The decode worker waits for its prefill: a prefill leg that fails
                // first ends the wait, and both legs are placed again.
                let decode = send();
                tokio::pin!(decode);
                tokio::select! {
                    s = &mut decode => s,
                    r = &mut *task => match r {
                        Ok(Ok(())) => {
                            prefill_answered = true;
                            decode.await
                        }
                        Ok(Err(split::LegEnd::Refused(ans))) => return Ok(answer(ans)),
                        Ok(Err(split::LegEnd::Failed(f))) => {
                            drop(booking);
                            let failed = Failed {
                                worker: *pw,
                                url: purl,
                                attempt: this,
                                prefill: true,
                            };
                            match settle(gw, &router, &mut a, failed, f) {
                                Some(done) => return done,
                                None => continue,
                            }
                        }
                        Err(e) => Err(Failure::Local(format!("the prefill leg ended: {e}"))),
                    },
                }
            }
        };
        if gw.config.outlier_detection
            && a.reconnects == 0
            && let Err(closed @ Failure::Closed(_)) = &sent
        {
            // Once, on a fresh connection, to the same worker with the same booking
            // (its prefix is there), not counted against it.
            a.reconnects += 1;
            count_failed_attempt(gw, &router, worker, &instance.url, closed, attempt);
            sent = send().await;
        }
        let failure = match sent {
            Ok(Forwarded::Ok(parts, first, rest)) => {
                gw.metrics
                    .timings
                    .first_byte(&endpoint, request_started.elapsed());
                router.prefill_done(routed.request);
                client.record_success(worker);
                // Served here: the earlier 5xx answers were those workers' own faults.
                for (w, reason) in a.pending.drain(..) {
                    client.record_failure(w, &reason);
                }
                let migration = migrate::Migration::new(
                    gw,
                    api,
                    migrate::Resend::new(&path, &headers, &parsed, session_key),
                    &body,
                    &parsed,
                    prompt_tokens,
                    router
                        .context_len()
                        .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
                );
                let relay = Relay {
                    gw: gw.clone(),
                    client: client.clone(),
                    worker,
                    router: router.clone(),
                    booking: Some(booking),
                    started: request_started,
                    endpoint: endpoint.clone(),
                    predicted_blocks: routed.overlap_blocks,
                    migration,
                };
                return Ok(relay.stream(parts, first, rest));
            }
            Ok(Forwarded::ClientError((parts, bytes))) => {
                // The request's own fault, so any earlier 5xx most likely was too.
                client.record_success(worker);
                return Ok(answer((parts, bytes)));
            }
            Err(f) => f,
        };
        drop(booking);
        if let Some((pw, purl, mut task)) = beside.filter(|_| !prefill_answered) {
            // A decode worker fails when its prefill worker does (the KV never comes):
            // a prefill leg that failed too, or fails within a moment, is the cause.
            let prefill = tokio::time::timeout(PREFILL_VERDICT, &mut task).await;
            // A room serves one handoff: the next attempt runs both legs again.
            task.abort();
            if let Ok(Ok(Err(split::LegEnd::Failed(f)))) = prefill {
                let failed = Failed {
                    worker: pw,
                    url: &purl,
                    attempt: this,
                    prefill: true,
                };
                match settle(gw, &router, &mut a, failed, f) {
                    Some(done) => return done,
                    None => continue,
                }
            }
        }
        let failed = Failed {
            worker,
            url: &instance.url,
            attempt: this,
            prefill: false,
        };
        if let Some(done) = settle(gw, &router, &mut a, failed, failure) {
            return done;
        }
    }
    give_up(&client, a, None)
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
        if gw.config.availability {
            client.report_instance_down(worker, &reason);
        }
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
            if gw.config.availability {
                client.report_instance_down(worker, &reason);
            }
        }
        Failure::Busy(ans, retry_after) => {
            let skip = client.report_busy(worker, *retry_after);
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
            let c = client.clone();
            tokio::spawn(async move { c.check_now(worker, &reason).await });
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
        return Some(give_up(client, std::mem::take(a), None));
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
        gw.metrics.upstream_failures.fetch_add(1, Ordering::Relaxed);
        *gw.metrics
            .failures_by_instance
            .lock()
            .entry(worker)
            .or_insert(0) += 1;
    }
}

/// The answer when no attempt succeeded: the worker's own answer if there is one (a
/// 5xx or busy answer), else the routing error (503) or the last failure (502/504).
/// A single pending 5xx with no worker left to confirm it counts against its worker.
pub(super) fn give_up(
    client: &Client,
    a: Attempts,
    route: Option<RouteError>,
) -> Result<Response<Body>, ApiError> {
    for (w, reason) in &a.pending {
        client.record_failure(*w, reason);
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
