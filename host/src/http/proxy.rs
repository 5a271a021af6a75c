//! The proxy: route a completion request, forward it to the chosen worker, pass the
//! response through unchanged (streaming included), and fail over.
//!
//! A worker that cannot be reached, times out, answers 5xx, or breaks its response before
//! the first body byte is reported down on the shared Client (unless availability
//! tracking is off) and the request is routed again over the remaining workers, up to
//! `max_attempts`; the client sees one response. Once bytes have reached the client, an
//! upstream failure ends the stream (with an SSE error event for event streams) and is
//! counted. The request's load booking is released whenever the response ends, fails,
//! or the client goes away.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{ACCEPT, AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE, HeaderValue};
use hyper::{Request, Response, StatusCode};
use tokio::sync::mpsc;

use super::{ApiError, Body, Gateway};
use crate::ids::{InstanceId, RequestId};
use crate::openai::{self, Api, Prompt};
use crate::router::{KvRouter, RouteError};
use crate::tokens::render_chat;

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

/// Why one attempt failed before the first byte reached the client.
#[derive(Debug)]
enum Failure {
    Connect(String),
    Timeout(String),
    Status(StatusCode),
    Body(String),
}

impl Failure {
    fn reason(&self) -> String {
        match self {
            Failure::Connect(e) => format!("unreachable: {e}"),
            Failure::Timeout(e) => format!("timed out: {e}"),
            Failure::Status(s) => format!("answered {s}"),
            Failure::Body(e) => format!("response failed before its first byte: {e}"),
        }
    }
}

enum Forwarded {
    /// A 2xx head and its first data frame (or none: an empty body).
    Ok(hyper::http::response::Parts, Option<Bytes>, Incoming),
    /// A 4xx: the worker refused the request itself; passed through.
    ClientError(hyper::http::response::Parts, Bytes),
}

pub(crate) async fn completion(
    gw: &Arc<Gateway>,
    api: Api,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let path = req.uri().path().to_string();
    let accept = req.headers().get(ACCEPT).cloned();
    let auth = req.headers().get(AUTHORIZATION).cloned();
    let max = gw.config.max_body_bytes;
    let body = match Limited::new(req.into_body(), max).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            return Err(ApiError::TooLarge(max));
        }
        Err(e) => {
            return Err(ApiError::BadRequest(openai::BadRequest {
                message: format!("cannot read the request body: {e}"),
                param: None,
            }));
        }
    };
    let parsed = openai::parse(api, &body).map_err(ApiError::BadRequest)?;
    let router = gw
        .fleet
        .router_for_model(&parsed.model)
        .ok_or_else(|| ApiError::UnknownModel(parsed.model.clone()))?;
    let tokens = match &parsed.prompt {
        Prompt::Tokens(t) => Ok(t.clone()),
        Prompt::Text(t) => gw.tokenizer.encode(t),
        Prompt::Chat(m) => gw.tokenizer.encode(&render_chat(m)),
    }
    .map_err(|e| {
        ApiError::BadRequest(openai::BadRequest {
            message: e.to_string(),
            param: Some("prompt".into()),
        })
    })?;
    let session_key = parsed
        .user
        .as_deref()
        .map(|u| xxhash_rust::xxh3::xxh3_64(u.as_bytes()));
    let hashes = router.hasher().hashes(&tokens);
    let prompt_tokens = u32::try_from(tokens.len()).unwrap_or(u32::MAX);

    let mut exclude: Vec<InstanceId> = Vec::new();
    let mut last: Option<Failure> = None;
    for attempt in 0..gw.config.max_attempts.max(1) {
        let routed = match router.route_blocks(
            prompt_tokens,
            &hashes,
            session_key,
            &exclude,
            Instant::now(),
        ) {
            Ok(r) => r,
            Err(e @ RouteError::Rejected(_)) => return Err(e.into()),
            Err(e) => return Err(upstream_error(last, e)),
        };
        if attempt > 0 {
            gw.metrics.retries.fetch_add(1, Ordering::Relaxed);
        }
        let booking = Booking {
            router: router.clone(),
            request: routed.request,
        };
        let Some(instance) = router.client().instance(routed.worker) else {
            exclude.push(routed.worker);
            continue;
        };
        match forward(
            gw,
            &instance.url,
            &path,
            accept.as_ref(),
            auth.as_ref(),
            body.clone(),
        )
        .await
        {
            Ok(Forwarded::Ok(parts, first, rest)) => {
                router.prefill_done(routed.request);
                return Ok(stream_through(gw.clone(), parts, first, rest, booking));
            }
            Ok(Forwarded::ClientError(parts, bytes)) => {
                return Ok(Response::from_parts(
                    parts,
                    Full::new(bytes).map_err(|e| match e {}).boxed(),
                ));
            }
            Err(failure) => {
                gw.metrics.upstream_failures.fetch_add(1, Ordering::Relaxed);
                *gw.metrics
                    .failures_by_instance
                    .lock()
                    .entry(routed.worker)
                    .or_insert(0) += 1;
                let reason = failure.reason();
                tracing::warn!(endpoint = %router.endpoint(), instance = %routed.worker, url = %instance.url, reason, attempt, "upstream attempt failed");
                if gw.config.availability {
                    router.client().report_instance_down(routed.worker, &reason);
                }
                exclude.push(routed.worker);
                last = Some(failure);
            }
        }
    }
    Err(match last {
        Some(Failure::Timeout(e)) => ApiError::UpstreamTimeout(e),
        Some(f) => ApiError::Upstream(f.reason()),
        None => ApiError::Upstream("no attempt was made".into()),
    })
}

/// The error after routing ran out of workers: the last upstream failure if there was
/// one (502/504), else the routing error itself (503).
fn upstream_error(last: Option<Failure>, e: RouteError) -> ApiError {
    match last {
        None => e.into(),
        Some(Failure::Timeout(t)) => ApiError::UpstreamTimeout(format!("{t}; and then {e}")),
        Some(f) => ApiError::Upstream(format!("{}; and then {e}", f.reason())),
    }
}

async fn forward(
    gw: &Gateway,
    base: &str,
    path: &str,
    accept: Option<&HeaderValue>,
    auth: Option<&HeaderValue>,
    body: Bytes,
) -> Result<Forwarded, Failure> {
    let uri: hyper::Uri = format!("{base}{path}")
        .parse()
        .map_err(|e| Failure::Connect(format!("bad worker URL: {e}")))?;
    let mut req = Request::post(uri).header(CONTENT_TYPE, "application/json");
    if let Some(a) = accept {
        req = req.header(ACCEPT, a);
    }
    if let Some(a) = auth {
        req = req.header(AUTHORIZATION, a);
    }
    let req = req
        .body(Full::new(body))
        .map_err(|e| Failure::Connect(e.to_string()))?;
    let limit = gw.config.first_byte_timeout;
    let started = Instant::now();
    let response = match tokio::time::timeout(limit, gw.http.request(req)).await {
        Err(_) => return Err(Failure::Timeout(format!("no response within {limit:?}"))),
        Ok(Err(e)) => return Err(Failure::Connect(format!("{e:?}"))),
        Ok(Ok(r)) => r,
    };
    let (parts, mut body) = response.into_parts();
    if parts.status.is_server_error() {
        return Err(Failure::Status(parts.status));
    }
    if !parts.status.is_success() {
        let bytes = tokio::time::timeout(limit, Limited::new(body, 1 << 20).collect())
            .await
            .ok()
            .and_then(Result::ok)
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        return Ok(Forwarded::ClientError(parts, bytes));
    }
    // Wait for the first body bytes before answering the client, so that a worker that
    // fails now can still be failed over.
    loop {
        let left = limit.saturating_sub(started.elapsed());
        match tokio::time::timeout(left, body.frame()).await {
            Err(_) => return Err(Failure::Timeout(format!("no body within {limit:?}"))),
            Ok(None) => return Ok(Forwarded::Ok(parts, None, body)),
            Ok(Some(Err(e))) => return Err(Failure::Body(e.to_string())),
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

/// Passes the rest of the worker's response through, byte for byte.
fn stream_through(
    gw: Arc<Gateway>,
    mut parts: hyper::http::response::Parts,
    first: Option<Bytes>,
    mut upstream: Incoming,
    booking: Booking,
) -> Response<Body> {
    let is_sse = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    // The body is re-framed; its length may be unknown now.
    parts.headers.remove(hyper::header::CONTENT_LENGTH);
    parts.headers.remove(hyper::header::TRANSFER_ENCODING);
    if is_sse && !parts.headers.contains_key(CACHE_CONTROL) {
        parts
            .headers
            .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    }
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(32);
    tokio::spawn(async move {
        // Dropped on every exit: end, upstream error, client gone.
        let _booking = booking;
        let mut tail: Vec<u8> = Vec::new();
        if let Some(first) = first {
            note_usage_tail(&mut tail, &first);
            if tx.send(Ok(Frame::data(first))).await.is_err() {
                return;
            }
        }
        loop {
            match upstream.frame().await {
                None => break,
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    note_usage_tail(&mut tail, &data);
                    if tx.send(Ok(Frame::data(data))).await.is_err() {
                        return; // the client went away; dropping `upstream` tells the worker
                    }
                }
                Some(Err(e)) => {
                    gw.metrics.stream_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(error = %e, "upstream stream broke after it started");
                    if is_sse {
                        let event = format!(
                            "data: {}\n\n",
                            serde_json::json!({"error": {"message": format!("the worker's stream broke: {e}"), "type": "server_error", "param": null, "code": "upstream_stream_error"}})
                        );
                        let _ = tx.send(Ok(Frame::data(Bytes::from(event)))).await;
                    } else {
                        let _ = tx
                            .send(Err(std::io::Error::other(format!("upstream failed: {e}"))))
                            .await;
                    }
                    return;
                }
            }
        }
        if let Some((prompt, cached)) = openai::scan_usage(&tail) {
            gw.metrics
                .prompt_tokens
                .fetch_add(prompt, Ordering::Relaxed);
            gw.metrics
                .cached_tokens
                .fetch_add(cached, Ordering::Relaxed);
        }
    });
    Response::from_parts(
        parts,
        StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed(),
    )
}

/// Keeps the last 4 KiB of a response: `usage` comes at its end.
fn note_usage_tail(tail: &mut Vec<u8>, bytes: &[u8]) {
    tail.extend_from_slice(bytes);
    if tail.len() > 4096 {
        tail.drain(..tail.len() - 4096);
    }
}
