//! The worker's answer relayed to the client: polled by the client's connection, with
//! the stream idle timer beside it and the load booking released however it ends.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::Response;
use hyper::body::{Frame, Incoming};
use hyper::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderValue};

use crate::{Body, Gateway};
use switchyard_ids::InstanceId;
use switchyard_router::client::Client;
use switchyard_tokens::openai::{self};

use super::Booking;
use super::forward::strip_hop_by_hop;

/// The relay of one response that has started: where to report a stall, and the load
/// booking it releases when it ends, however it ends.
pub(super) struct Relay {
    pub(super) gw: Arc<Gateway>,
    pub(super) client: Arc<Client>,
    pub(super) worker: InstanceId,
    /// Released when the relay is dropped: at the end, on a break, or when the client
    /// leaves.
    pub(super) booking: Booking,
    /// When the request arrived, and its endpoint: a complete response is timed.
    pub(super) started: Instant,
    pub(super) endpoint: String,
    /// The prompt blocks the router saw cached on this worker when routing.
    pub(super) predicted_blocks: u32,
}

impl Relay {
    /// Passes the rest of the worker's response through, byte for byte. Ends early, with
    /// an error event on event streams, when the worker breaks the stream or is silent
    /// for longer than the idle timeout (the worker is then counted as failing); stops
    /// reading from the worker as soon as the client is gone.
    pub(super) fn stream(
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
pub(super) struct RelayBody {
    pub(super) relay: Relay,
    pub(super) first: Option<Bytes>,
    pub(super) upstream: Incoming,
    pub(super) idle: Duration,
    /// Fires when the worker has been silent for `idle`; reset by each chunk.
    pub(super) timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    pub(super) is_sse: bool,
    pub(super) tail: Vec<u8>,
    pub(super) done: bool,
    /// When the booking was last told the stream is alive.
    pub(super) touched: tokio::time::Instant,
}

/// How often a relaying stream tells its booking it is alive (a lock per touch; the
/// hard expiry is minutes).
pub(super) const TOUCH_EVERY: Duration = Duration::from_secs(10);

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
pub(super) fn note_usage_tail(tail: &mut Vec<u8>, bytes: &[u8]) {
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
