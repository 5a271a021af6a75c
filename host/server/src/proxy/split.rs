//! The prefill leg of a split request: sent, read within its bounds, its failure
//! classified like any attempt's (the decode leg is an ordinary attempt).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::StatusCode;

use crate::Gateway;

use super::forward::{Outbound, forward};
use super::handoff::{self, MAX_PREFILL_ANSWER};
use super::tokenize::BLOCKING_TOKENIZE_BYTES;
use super::{Answer, Booking, Failure, Forwarded};

/// How a prefill leg ended, when not with its handoff.
#[derive(Debug)]
pub(super) enum LegEnd {
    /// The worker refused the request itself (a 4xx): the client's answer.
    Refused(Answer),
    /// The leg failed: the worker's fault or not, as [`Failure`] says.
    Failed(Failure),
    /// The router's own fault (its body builder panicked): the client's 500.
    Router(crate::ApiError),
}

/// A 502 answer naming what the prefill worker did wrong (counted like a 5xx: against
/// it once another worker serves the request).
fn bad_answer(why: String) -> Failure {
    let (parts, ()) = hyper::Response::builder()
        .status(StatusCode::BAD_GATEWAY)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(())
        .expect("a valid response head")
        .into_parts();
    let body = switchyard_tokens::openai::error_body(&why, "server_error", None, None);
    Failure::Status((parts, Bytes::from(body)))
}

/// vLLM's prefill leg: the prompt computed on `base`, which keeps its KV; the decode
/// worker's request (the client's `body` with the answer's `kv_transfer_params`).
pub(super) async fn vllm_prefill(
    gw: &Gateway,
    base: &str,
    path: &str,
    headers: &Outbound,
    body: &Bytes,
) -> Result<Bytes, LegEnd> {
    // The client's request parsed and written again: off the async workers past 8 KiB.
    let large = body.len() > BLOCKING_TOKENIZE_BYTES;
    let b = body.clone();
    let (body, request) = crate::error::off_thread_if(large, "the prefill leg's body", move || {
        handoff::object(&b).map(|o| {
            let request = handoff::vllm_prefill_body(&o);
            (o, request)
        })
    })
    .await
    .map_err(LegEnd::Router)?
    .map_err(|e| LegEnd::Failed(bad_answer(e)))?;
    let limit = gw.config.request_timeout;
    let started = Instant::now();
    let to = headers.without_accept();
    let (first, rest) = match forward(gw, base, path, &to, request, limit).await {
        Ok(Forwarded::Ok(_, first, rest)) => (first, rest),
        Ok(Forwarded::ClientError(ans)) => return Err(LegEnd::Refused(ans)),
        Err(f) => return Err(LegEnd::Failed(f)),
    };
    let room = MAX_PREFILL_ANSWER.saturating_sub(first.as_ref().map_or(0, Bytes::len));
    let left = limit.saturating_sub(started.elapsed());
    let tail = match tokio::time::timeout(left, Limited::new(rest, room).collect()).await {
        Err(_) => {
            return Err(LegEnd::Failed(Failure::Timeout(format!(
                "the prefill answer did not end within {limit:?}"
            ))));
        }
        Ok(Err(e)) => {
            return Err(LegEnd::Failed(Failure::Unreachable(format!(
                "the prefill answer broke (or passed {MAX_PREFILL_ANSWER} bytes): {e}"
            ))));
        }
        Ok(Ok(b)) => b.to_bytes(),
    };
    let mut answer = first.map(|b| b.to_vec()).unwrap_or_default();
    answer.extend_from_slice(&tail);
    let params = handoff::vllm_transfer_params(&answer)
        .map_err(|e| LegEnd::Failed(bad_answer(format!("prefill worker: {e}"))))?;
    crate::error::off_thread_if(large, "the decode leg's body", move || {
        handoff::vllm_decode_body(body, params)
    })
    .await
    .map_err(LegEnd::Router)
}

/// SGLang's prefill leg, beside the decode leg: `Ok` once the prefill worker answers (it
/// has computed the prompt); the rest of its answer is then read and dropped (bounded)
/// before the leg's booking is released.
pub(super) async fn prefill_beside(
    gw: Arc<Gateway>,
    base: String,
    path: String,
    headers: Outbound,
    body: Bytes,
    limit: Duration,
    booking: Booking,
) -> Result<(), LegEnd> {
    let started = Instant::now();
    match forward(&gw, &base, &path, &headers.without_accept(), body, limit).await {
        Ok(Forwarded::Ok(_, _, rest)) => {
            // Its answer is its prefill: the worker's latency model learns from it.
            booking.router.prefill_done(booking.request);
            let left = limit.saturating_sub(started.elapsed());
            tokio::spawn(async move {
                let _ =
                    tokio::time::timeout(left, Limited::new(rest, MAX_PREFILL_ANSWER).collect())
                        .await;
                drop(booking);
            });
            Ok(())
        }
        Ok(Forwarded::ClientError(ans)) => Err(LegEnd::Refused(ans)),
        Err(f) => Err(LegEnd::Failed(f)),
    }
}
