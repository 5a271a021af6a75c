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
//! Once bytes have reached the client, an upstream failure or a stall longer than the
//! idle timeout ends the stream (with an SSE error event for event streams). The load
//! booking is released on every path: end, failure, retry, stall, client gone.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Frame, Incoming};
use hyper::header::{ACCEPT, AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use hyper::{Request, Response, StatusCode};

use super::{ApiError, Body, Gateway};
use switchyard_ids::{InstanceId, RequestId};
use switchyard_router::client::{Client, local_exhaustion};
use switchyard_router::{KvRouter, RouteError};
use switchyard_tokens::openai::{self, Api, Prompt};
use switchyard_tokens::{PrefixTokenizer, TokenizerError};

/// Releases a request's load booking when dropped.
struct Booking {
    router: Arc<KvRouter>,
    request: RequestId,
}

impl Drop for Booking {
    fn drop(&mut self) {
        self.router.finish(self.request);
    }
}

/// A worker's own answer, kept to pass on to the client.
type Answer = (hyper::http::response::Parts, Bytes);

/// Why one attempt failed before the first byte reached the client.
#[derive(Debug)]
enum Failure {
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

enum Forwarded {
    /// A 2xx head and its first data frame (or none: an empty body).
    Ok(hyper::http::response::Parts, Option<Bytes>, Incoming),
    /// A 4xx other than 429: the worker refused the request itself; passed through.
    ClientError(Answer),
}

/// What the request has done so far, across attempts.
#[derive(Default)]
struct Attempts {
    /// Workers not to try again for this request.
    exclude: Vec<InstanceId>,
    /// 5xx answers and timeouts, counted against their workers only if another worker
    /// then serves the request.
    pending: Vec<(InstanceId, String)>,
    /// The last worker answer worth passing on (a 5xx or a busy answer).
    answer: Option<Answer>,
    /// The last failure.
    last: Option<Failure>,
    /// Fresh-connection retries used (one per request).
    reconnects: u32,
}

/// Texts longer than this are tokenized on a blocking thread, off the async workers.
const BLOCKING_TOKENIZE_BYTES: usize = 8 << 10;

/// The prompt's token IDs (text reuses a conversation's earlier tokens, see
/// [`PrefixTokenizer`](switchyard_tokens::PrefixTokenizer)); a prompt that cannot be
/// tokenized is the client's error (400).
pub(crate) async fn tokenize(gw: &Arc<Gateway>, prompt: &Prompt) -> Result<Vec<u32>, ApiError> {
    tokenize_prompt(gw, prompt).await.map_err(|e| {
        ApiError::BadRequest(openai::BadRequest {
            message: e.to_string(),
            param: Some("prompt".into()),
        })
    })
}

async fn tokenize_prompt(gw: &Arc<Gateway>, prompt: &Prompt) -> Result<Vec<u32>, TokenizerError> {
    let size = match prompt {
        Prompt::Tokens(t) => return Ok(t.clone()),
        Prompt::Text(t) => t.len(),
        Prompt::Chat(m) => m.iter().map(|m| m.content.len()).sum(),
    };
    let started = Instant::now();
    let tokens = if size > BLOCKING_TOKENIZE_BYTES {
        // Copied only to hand it to the blocking thread (a conversation is rendered
        // there too).
        let (tokenizer, prompt) = (gw.tokenizer.clone(), prompt.clone());
        tokio::task::spawn_blocking(move || encode(&tokenizer, &prompt))
            .await
            .unwrap_or_else(|e| Err(TokenizerError::from_panic(e)))
    } else {
        encode(&gw.tokenizer, prompt)
    };
    gw.metrics.timings.tokenize(started.elapsed());
    tokens
}

/// A prompt's token IDs: a conversation rendered with the chat template first.
fn encode(tokenizer: &PrefixTokenizer, prompt: &Prompt) -> Result<Vec<u32>, TokenizerError> {
    match prompt {
        Prompt::Tokens(t) => Ok(t.clone()),
        Prompt::Text(t) => tokenizer.encode(t),
        Prompt::Chat(m) => tokenizer.encode(&tokenizer.render_chat(m)?),
    }
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
    let auth = auth.filter(|_| router.forwards_authorization());
    let tokens = tokenize(gw, &parsed.prompt).await?;
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

    let mut a = Attempts::default();
    let mut attempt = 0;
    while attempt < gw.config.max_attempts.max(1) {
        let routed = match router.route_blocks(
            prompt_tokens,
            &hashes,
            session_key,
            &a.exclude,
            Instant::now(),
        ) {
            Ok(r) => {
                gw.metrics
                    .timings
                    .decision(&endpoint, r.decision_time, r.decision.call_time);
                r
            }
            Err(e @ RouteError::Rejected(_)) => return Err(e.into()),
            Err(e) => return give_up(&client, a, Some(e)),
        };
        if attempt > 0 {
            gw.metrics.retries.fetch_add(1, Ordering::Relaxed);
        }
        attempt += 1;
        let booking = Booking {
            router: router.clone(),
            request: routed.request,
        };
        let worker = routed.worker;
        let Some(instance) = client.instance(worker) else {
            a.exclude.push(worker);
            continue;
        };
        let sent = forward(
            gw,
            &instance.url,
            &path,
            accept.as_ref(),
            auth.as_ref(),
            body.clone(),
            limit,
        )
        .await;
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
                let relay = Relay {
                    gw: gw.clone(),
                    client: client.clone(),
                    worker,
                    booking,
                    started: request_started,
                    endpoint: endpoint.clone(),
                    predicted_blocks: routed.overlap_blocks,
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
        let reason = failure.reason();
        tracing::warn!(endpoint = %router.endpoint(), instance = %worker, url = %instance.url, reason, attempt, "upstream attempt failed");
        if !matches!(failure, Failure::Busy(..) | Failure::Local(_)) {
            gw.metrics.upstream_failures.fetch_add(1, Ordering::Relaxed);
            *gw.metrics
                .failures_by_instance
                .lock()
                .entry(worker)
                .or_insert(0) += 1;
        }
        if !gw.config.outlier_detection {
            // The baseline: every failure ejects at once, and the request moves on.
            if gw.config.availability {
                client.report_instance_down(worker, &reason);
            }
            a.exclude.push(worker);
            a.last = Some(failure);
            continue;
        }
        match &failure {
            Failure::Local(e) => {
                gw.metrics.local_failures.fetch_add(1, Ordering::Relaxed);
                return Err(ApiError::Overloaded(format!(
                    "the router cannot open a connection to a worker: {e}"
                )));
            }
            Failure::Closed(_) if a.reconnects == 0 => {
                // Once, on a fresh connection, to the same worker, uncounted.
                a.reconnects += 1;
                attempt -= 1;
                continue;
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
            Failure::Timeout(_) if !parsed.stream => {
                // Not retried: it would take as long elsewhere. Counted against the
                // worker only if it is silent.
                let c = client.clone();
                tokio::spawn(async move { c.check_now(worker, &reason).await });
                return Err(ApiError::UpstreamTimeout(format!(
                    "no answer within the request timeout of {limit:?}"
                )));
            }
            Failure::Timeout(_) => a.pending.push((worker, reason.clone())),
        }
        a.exclude.push(worker);
        a.last = Some(failure);
        let failed_workers = a.pending.len();
        if failed_workers >= 2 {
            // Failed on two workers: the request's fault. Eject no one, stop here.
            gw.metrics.poison.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(endpoint = %router.endpoint(), workers = failed_workers, "request failed on several workers; treated as its own fault (poison), not retried");
            a.pending.clear();
            return give_up(&client, a, None);
        }
    }
    give_up(&client, a, None)
}

/// The answer when no attempt succeeded: the worker's own answer if there is one (a
/// 5xx or busy answer), else the routing error (503) or the last failure (502/504).
/// A single pending 5xx with no worker left to confirm it counts against its worker.
fn give_up(
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

fn answer((parts, bytes): Answer) -> Response<Body> {
    Response::from_parts(parts, Full::new(bytes).map_err(|e| match e {}).boxed())
}

fn set_retry_after(headers: &mut hyper::HeaderMap, d: Duration) {
    // Saturating: a float past `u64::MAX` converts to `u64::MAX`.
    let secs = d.as_secs_f64().ceil().max(1.0) as u64;
    headers.insert(RETRY_AFTER, HeaderValue::from(secs));
}

/// A `Retry-After` in seconds (the HTTP-date form is not used by inference servers).
/// A value too large for a `Duration` saturates (the client's `busy_max` caps it next);
/// a negative, non-finite or unreadable one is no value at all.
fn retry_after(headers: &hyper::HeaderMap) -> Option<Duration> {
    let v = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    parse_retry_after(v)
}

/// The seconds of a `Retry-After` value; see [`retry_after`].
pub fn parse_retry_after(v: &str) -> Option<Duration> {
    if v.len() > 32 {
        return None;
    }
    let secs = v
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s >= 0.0)?;
    Some(Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX))
}

/// Classifies a failed upstream request.
fn classify(e: &hyper_util::client::legacy::Error) -> Failure {
    if let Some(why) = local_exhaustion(e) {
        return Failure::Local(why);
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    let mut closed = false;
    while let Some(err) = source {
        if let Some(h) = err.downcast_ref::<hyper::Error>()
            && (h.is_incomplete_message() || h.is_canceled())
        {
            closed = true;
        }
        source = err.source();
    }
    if closed && !e.is_connect() {
        Failure::Closed(switchyard_net::error_chain(e))
    } else {
        Failure::Unreachable(switchyard_net::error_chain(e))
    }
}

/// Removes what described the worker's connection to the router rather than the answer
/// (RFC 9110 §7.6.1): the framing (re-done for the client), `Connection` and every header
/// it names, and the other hop-by-hop fields. A worker cannot close, upgrade or re-frame
/// the client's connection through its answer.
fn strip_hop_by_hop(headers: &mut hyper::HeaderMap) {
    use hyper::header::{CONNECTION, CONTENT_LENGTH, TE, TRAILER, TRANSFER_ENCODING, UPGRADE};
    let named: Vec<hyper::header::HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| hyper::header::HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .take(32)
        .collect();
    for n in named {
        headers.remove(n);
    }
    for n in [
        CONNECTION,
        CONTENT_LENGTH,
        TE,
        TRAILER,
        TRANSFER_ENCODING,
        UPGRADE,
    ] {
        headers.remove(n);
    }
    for n in ["keep-alive", "proxy-connection"] {
        headers.remove(n);
    }
}

async fn forward(
    gw: &Gateway,
    base: &str,
    path: &str,
    accept: Option<&HeaderValue>,
    auth: Option<&HeaderValue>,
    body: Bytes,
    limit: Duration,
) -> Result<Forwarded, Failure> {
    let uri: hyper::Uri = format!("{base}{path}")
        .parse()
        .map_err(|e| Failure::Unreachable(format!("bad worker URL: {e}")))?;
    let mut req = Request::post(uri).header(CONTENT_TYPE, "application/json");
    if let Some(a) = accept {
        req = req.header(ACCEPT, a);
    }
    if let Some(a) = auth {
        req = req.header(AUTHORIZATION, a);
    }
    let req = req
        .body(Full::new(body))
        .map_err(|e| Failure::Unreachable(e.to_string()))?;
    let started = Instant::now();
    let response = match tokio::time::timeout(limit, gw.http.request(req)).await {
        Err(_) => return Err(Failure::Timeout(format!("no response within {limit:?}"))),
        Ok(Err(e)) => return Err(classify(&e)),
        Ok(Ok(r)) => r,
    };
    let (parts, mut body) = response.into_parts();
    let status = parts.status;
    if !status.is_success() {
        let left = limit
            .saturating_sub(started.elapsed())
            .max(Duration::from_secs(1));
        let bytes = tokio::time::timeout(left, Limited::new(body, 1 << 20).collect())
            .await
            .ok()
            .and_then(Result::ok)
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let mut parts = parts;
        strip_hop_by_hop(&mut parts.headers);
        if status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE {
            let after = retry_after(&parts.headers);
            return Err(Failure::Busy((parts, bytes), after));
        }
        if status.is_server_error() {
            return Err(Failure::Status((parts, bytes)));
        }
        return Ok(Forwarded::ClientError((parts, bytes)));
    }
    // Wait for the first body bytes before answering the client, so that a worker that
    // fails now can still be failed over.
    loop {
        let left = limit.saturating_sub(started.elapsed());
        match tokio::time::timeout(left, body.frame()).await {
            Err(_) => return Err(Failure::Timeout(format!("no body within {limit:?}"))),
            Ok(None) => return Ok(Forwarded::Ok(parts, None, body)),
            Ok(Some(Err(e))) => {
                return Err(Failure::Unreachable(format!(
                    "response broke before its first byte: {e}"
                )));
            }
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data()
                    && !data.is_empty()
                {
                    return Ok(Forwarded::Ok(parts, Some(data), body));
                }
            }
        }
    }
}

/// The relay of one response that has started: where to report a stall, and the load
/// booking it releases when it ends, however it ends.
struct Relay {
    gw: Arc<Gateway>,
    client: Arc<Client>,
    worker: InstanceId,
    /// Released when the relay is dropped: at the end, on a break, or when the client
    /// leaves.
    booking: Booking,
    /// When the request arrived, and its endpoint: a complete response is timed.
    started: Instant,
    endpoint: String,
    /// The prompt blocks the router saw cached on this worker when routing.
    predicted_blocks: u32,
}

impl Relay {
    /// Passes the rest of the worker's response through, byte for byte. Ends early, with
    /// an error event on event streams, when the worker breaks the stream or is silent
    /// for longer than the idle timeout (the worker is then counted as failing); stops
    /// reading from the worker as soon as the client is gone.
    fn stream(
        self,
        mut parts: hyper::http::response::Parts,
        first: Option<Bytes>,
        upstream: Incoming,
    ) -> Response<Body> {
        let is_sse = parts
            .headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        // The body is re-framed; its length may be unknown now.
        strip_hop_by_hop(&mut parts.headers);
        if is_sse && !parts.headers.contains_key(CACHE_CONTROL) {
            parts
                .headers
                .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        }
        let idle = self.gw.config.stream_idle_timeout;
        let body = RelayBody {
            relay: self,
            first,
            upstream,
            idle,
            timer: Box::pin(tokio::time::sleep(idle)),
            is_sse,
            tail: Vec::new(),
            done: false,
            touched: tokio::time::Instant::now(),
        };
        Response::from_parts(parts, body.boxed())
    }
}

/// The relayed body: polls the worker's body directly from the client's connection (no
/// task or channel between them, so a chunk costs one poll, not two wake-ups). Dropped
/// when the client is gone, which drops the worker's body (the worker sees the close)
/// and the load booking.
struct RelayBody {
    relay: Relay,
    first: Option<Bytes>,
    upstream: Incoming,
    idle: Duration,
    /// Fires when the worker has been silent for `idle`; reset by each chunk.
    timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    is_sse: bool,
    tail: Vec<u8>,
    done: bool,
    /// When the booking was last told the stream is alive.
    touched: tokio::time::Instant,
}

/// How often a relaying stream tells its booking it is alive (a lock per touch; the
/// hard expiry is minutes).
const TOUCH_EVERY: Duration = Duration::from_secs(10);

impl RelayBody {
    fn data(&mut self, data: Bytes) -> Frame<Bytes> {
        note_usage_tail(&mut self.tail, &data);
        let now = tokio::time::Instant::now();
        self.timer.as_mut().reset(now + self.idle);
        if now.duration_since(self.touched) >= TOUCH_EVERY {
            self.touched = now;
            let b = &self.relay.booking;
            b.router.touch(b.request);
        }
        Frame::data(data)
    }

    /// The stream ended complete.
    fn finish(&mut self) {
        let r = &self.relay;
        if let Some((prompt, cached)) = openai::scan_usage(&self.tail) {
            let m = &r.gw.metrics;
            m.prompt_tokens.fetch_add(prompt, Ordering::Relaxed);
            m.cached_tokens.fetch_add(cached, Ordering::Relaxed);
            r.booking
                .router
                .note_cache_report(r.predicted_blocks, cached);
        }
        r.gw.metrics
            .timings
            .request_duration(&r.endpoint, r.started.elapsed());
    }

    /// The stream broke or stalled: an error event on event streams, an error otherwise.
    fn broke(&mut self, why: String) -> Result<Frame<Bytes>, std::io::Error> {
        self.relay
            .gw
            .metrics
            .stream_errors
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(instance = %self.relay.worker, error = %why, "upstream stream ended early");
        if self.is_sse {
            let event = format!(
                "data: {}\n\n",
                serde_json::json!({"error": {"message": why, "type": "server_error", "param": null, "code": "upstream_stream_error"}})
            );
            Ok(Frame::data(Bytes::from(event)))
        } else {
            Err(std::io::Error::other(why))
        }
    }
}

impl hyper::body::Body for RelayBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        use std::task::Poll;
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        if let Some(first) = this.first.take() {
            return Poll::Ready(Some(Ok(this.data(first))));
        }
        loop {
            match std::pin::Pin::new(&mut this.upstream).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        return Poll::Ready(Some(Ok(this.data(data))));
                    }
                }
                Poll::Ready(None) => {
                    this.done = true;
                    this.finish();
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Err(e))) => {
                    this.done = true;
                    return Poll::Ready(Some(
                        this.broke(format!("the worker's stream broke: {e}")),
                    ));
                }
                Poll::Pending => {
                    if this.timer.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    this.done = true;
                    let why = format!("the worker sent nothing for {:?}", this.idle);
                    let r = &this.relay;
                    r.client.record_failure(r.worker, &why);
                    r.gw.metrics.stalls.fetch_add(1, Ordering::Relaxed);
                    return Poll::Ready(Some(this.broke(why)));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

/// Keeps at least the last 4 KiB of a response (`usage` comes at its end). Trimmed only
/// once it passes 16 KiB, so a stream of small chunks moves memory once per ~12 KiB
/// instead of once per chunk.
fn note_usage_tail(tail: &mut Vec<u8>, bytes: &[u8]) {
    const KEEP: usize = 4096;
    if bytes.len() >= KEEP {
        tail.clear();
        tail.extend_from_slice(&bytes[bytes.len() - KEEP..]);
        return;
    }
    tail.extend_from_slice(bytes);
    if tail.len() > 4 * KEEP {
        tail.drain(..tail.len() - KEEP);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workers_connection_headers_do_not_reach_the_client() {
        let mut h = hyper::HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("close, x-secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("upgrade", HeaderValue::from_static("websocket"));
        h.insert(
            "content-type",
            HeaderValue::from_static("text/event-stream"),
        );
        h.insert("x-request-id", HeaderValue::from_static("r1"));
        strip_hop_by_hop(&mut h);
        let mut left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        left.sort();
        assert_eq!(left, ["content-type", "x-request-id"]);
    }
}
