//! One attempt: the request forwarded to one worker, its failure classified, the
//! worker's hop-by-hop headers stripped from its answer.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use hyper::{Request, StatusCode};

use crate::Gateway;
use switchyard_router::client::local_exhaustion;

use super::{Failure, Forwarded};

/// The client's headers an attempt carries to a worker, and the request ID both legs
/// of a vLLM split share.
#[derive(Clone, Default)]
pub(super) struct Outbound {
    /// The client's `Accept`.
    pub(super) accept: Option<HeaderValue>,
    /// The client's `Authorization`, for endpoints whose workers may see it.
    pub(super) auth: Option<HeaderValue>,
    /// `X-Request-Id`: vLLM's disaggregated proxy sends one to both legs of a split.
    /// `NixlConnector` before its metadata version 2 named the decode side's "done" by
    /// it (two IDs left the prefill's blocks pinned until its abort timeout); vLLM 0.32
    /// names the prefill's request in its `kv_transfer_params` instead.
    pub(super) request_id: Option<HeaderValue>,
}

impl Outbound {
    /// These headers with a fresh request ID (a split's, for both its legs).
    pub(super) fn with_fresh_id(&self) -> Outbound {
        let id = format!("switchyard-{:016x}", super::handoff::fresh_room());
        Outbound {
            request_id: HeaderValue::from_str(&id).ok(),
            ..self.clone()
        }
    }

    /// These headers without `Accept` (a leg whose answer the router reads itself).
    pub(super) fn without_accept(&self) -> Outbound {
        Outbound {
            accept: None,
            ..self.clone()
        }
    }
}

pub(super) fn set_retry_after(headers: &mut hyper::HeaderMap, d: Duration) {
    // Saturating: a float past `u64::MAX` converts to `u64::MAX`.
    let secs = d.as_secs_f64().ceil().max(1.0) as u64;
    headers.insert(RETRY_AFTER, HeaderValue::from(secs));
}

/// A `Retry-After` in seconds (the HTTP-date form is not used by inference servers).
/// A value too large for a `Duration` saturates (the client's `busy_max` caps it next);
/// a negative, non-finite or unreadable one is no value at all.
pub(super) fn retry_after(headers: &hyper::HeaderMap) -> Option<Duration> {
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
pub(super) fn classify(e: &hyper_util::client::legacy::Error) -> Failure {
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
pub(super) fn strip_hop_by_hop(headers: &mut hyper::HeaderMap) {
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

pub(super) async fn forward(
    gw: &Gateway,
    base: &str,
    path: &str,
    headers: &Outbound,
    body: Bytes,
    limit: Duration,
) -> Result<Forwarded, Failure> {
    let uri: hyper::Uri = format!("{base}{path}")
        .parse()
        .map_err(|e| Failure::Unreachable(format!("bad worker URL: {e}")))?;
    let mut req = Request::post(uri).header(CONTENT_TYPE, "application/json");
    if let Some(a) = &headers.accept {
        req = req.header(ACCEPT, a);
    }
    if let Some(a) = &headers.auth {
        req = req.header(AUTHORIZATION, a);
    }
    if let Some(id) = &headers.request_id {
        req = req.header("x-request-id", id);
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
