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

use crate::verdict::{self, Verdict};
use crate::{Body, Gateway};
use switchyard_ids::InstanceId;
use switchyard_router::KvRouter;
use switchyard_router::client::Client;
use switchyard_tokens::openai::{self};

use super::Booking;
use super::forward::strip_hop_by_hop;
use super::migrate::{self, Break, Migration, Moved, Next};

/// A continuation being placed on another worker, on a task of its own (the body must be
/// `Sync`; a future is not); aborted if the client leaves first.
pub(super) struct Moving(tokio::task::JoinHandle<Result<Moved, String>>);

impl Drop for Moving {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The relay of one response that has started: where to report a stall, and the load
/// booking it releases when it ends, however it ends.
pub(super) struct Relay {
    pub(super) gw: Arc<Gateway>,
    pub(super) client: Arc<Client>,
    pub(super) worker: InstanceId,
    pub(super) router: Arc<KvRouter>,
    /// Released when the relay is dropped: at the end, on a break, or when the client
    /// leaves; moved to the next worker with a migrated stream.
    pub(super) booking: Option<Booking>,
    /// When the request arrived, and its endpoint: a complete response is timed.
    pub(super) started: Instant,
    pub(super) endpoint: String,
    /// The prompt blocks the router saw cached on this worker when routing.
    pub(super) predicted_blocks: u32,
    /// How to continue the stream elsewhere if it breaks (`None`: it ends instead).
    pub(super) migration: Option<Box<Migration>>,
}

impl Relay {
    /// Counts the stream's breaks so far against the workers that broke it, once
    /// (after another worker finished the answer, or when none can).
    fn charge_breaks(&mut self) {
        if let Some(m) = &mut self.migration {
            for (w, why) in m.broken.drain(..) {
                verdict::apply(&self.gw, &self.client, w, Verdict::Failing(&why));
            }
        }
    }

    /// Passes the rest of the worker's response through, byte for byte (a migratable
    /// stream event by event). When the worker breaks the stream or is silent for longer
    /// than the idle timeout (the worker is then counted as failing), the stream is
    /// continued on another worker if it can be ([`migrate`]), else ends early, with an
    /// error event on event streams; stops reading from the worker as soon as the client
    /// is gone.
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
        let mut relay = self;
        if !is_sse {
            relay.migration = None;
        }
        let migrating = relay.migration.is_some();
        let body = RelayBody {
            relay,
            first,
            upstream,
            idle,
            timer: Box::pin(tokio::time::sleep(period(idle, migrating))),
            last_data: tokio::time::Instant::now(),
            leaving_since: None,
            is_sse,
            tail: Vec::new(),
            done: false,
            touched: tokio::time::Instant::now(),
            moving: None,
            ready: None,
            pending_break: None,
            ended_upstream: false,
            break_reason: String::new(),
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
    /// A chunk the worker sent that is not yet read (its answer's first bytes).
    pub(super) first: Option<Bytes>,
    pub(super) upstream: Incoming,
    pub(super) idle: Duration,
    /// Fires when the worker may have been silent for `idle` (a migratable stream's every
    /// check period); it then looks at `last_data`, and is not moved per chunk.
    pub(super) timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// When the worker last sent something.
    pub(super) last_data: tokio::time::Instant,
    /// Since when the worker has been gone from discovery (a drain), if it is.
    pub(super) leaving_since: Option<tokio::time::Instant>,
    pub(super) is_sse: bool,
    pub(super) tail: Vec<u8>,
    pub(super) done: bool,
    /// When the booking was last told the stream is alive.
    pub(super) touched: tokio::time::Instant,
    /// A continuation being placed after a break.
    pub(super) moving: Option<Moving>,
    /// Events ready for the client (sent before anything else).
    pub(super) ready: Option<Bytes>,
    /// A break found in a chunk whose earlier events are sent first.
    pub(super) pending_break: Option<String>,
    /// Nothing more comes from upstream: the stream ends once `ready` is sent.
    pub(super) ended_upstream: bool,
    /// Why the stream broke, while its continuation is being placed.
    pub(super) break_reason: String,
}

/// How often a relaying stream tells its booking it is alive (a lock per touch; the
/// hard expiry is minutes).
pub(super) const TOUCH_EVERY: Duration = Duration::from_secs(10);

/// How often a migratable stream looks whether its worker is leaving.
pub(super) const CHECK_EVERY: Duration = Duration::from_secs(1);

/// The relay's timer period: the idle timeout, or the worker check's if shorter.
fn period(idle: Duration, migrating: bool) -> Duration {
    if migrating {
        idle.min(CHECK_EVERY)
    } else {
        idle
    }
}

impl RelayBody {
    fn data(&mut self, data: Bytes) -> Frame<Bytes> {
        note_usage_tail(&mut self.tail, &data);
        let now = tokio::time::Instant::now();
        // The timer is not moved per chunk: when it fires, it looks at this.
        self.last_data = now;
        if now.duration_since(self.touched) >= TOUCH_EVERY {
            self.touched = now;
            if let Some(b) = &self.relay.booking {
                b.router.touch(b.request);
            }
        }
        if let Some(m) = &mut self.relay.migration
            && let Some(cut) = m.cut_at.take()
        {
            self.relay.gw.metrics.timings.migration_gap(cut.elapsed());
        }
        Frame::data(data)
    }

    /// A chunk from the worker, made ready for the client: passed on, or (a migratable
    /// stream) its complete events, rewritten after a migration; a server error event
    /// found in it is handled once the events before it are sent.
    fn chunk(&mut self, data: Bytes) {
        let Some(m) = &mut self.relay.migration else {
            self.ready = Some(data);
            return;
        };
        let (out, broke) = m.take(&data);
        self.ready = (!out.is_empty()).then_some(out);
        self.pending_break = broke;
    }

    /// The stream ended complete.
    fn finish(&mut self) {
        let r = &mut self.relay;
        // Another worker finished the answer: the breaks were those workers' faults.
        r.charge_breaks();
        if let Some(m) = &mut r.migration
            && m.used > 0
        {
            let metrics = &r.gw.metrics;
            metrics
                .migrated_streams_completed
                .fetch_add(1, Ordering::Relaxed);
            metrics
                .migration_prefill_tokens
                .fetch_add(m.prefill_spent(), Ordering::Relaxed);
        }
        if let Some((prompt, cached)) = openai::scan_usage(&self.tail) {
            let m = &r.gw.metrics;
            m.prompt_tokens.fetch_add(prompt, Ordering::Relaxed);
            m.cached_tokens.fetch_add(cached, Ordering::Relaxed);
            r.router.note_cache_report(r.predicted_blocks, cached);
        }
        // The current worker's tokens teach its latency model: counted on the stream
        // where it is watched, else its usage's (the whole answer's, unless migrated).
        let output = match &r.migration {
            Some(m) => Some(m.segment_tokens()),
            None => openai::scan_completion_tokens(&self.tail)
                .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
        };
        if let Some(b) = r.booking.take() {
            b.router.complete(b.request, output);
        }
        r.gw.metrics
            .timings
            .request_duration(&r.endpoint, r.started.elapsed());
    }

    /// The stream broke or stalled: continued on another worker if it can be (`None`),
    /// else an error event on event streams, an error otherwise.
    fn broke(&mut self, kind: Break, why: String) -> Option<Result<Frame<Bytes>, std::io::Error>> {
        let worker = self.relay.worker;
        tracing::warn!(instance = %worker, error = %why, "upstream stream ended early");
        if let Some(m) = &mut self.relay.migration {
            if m.complete() {
                // The engine had ended the answer: nothing is continued and nobody is
                // charged; the client gets the closing events it lacks.
                self.relay.gw.metrics.migration(kind.label(), "complete");
                self.ready = Some(m.close()).filter(|b| !b.is_empty());
                self.ended_upstream = true;
                return None;
            }
            if kind.is_failure() {
                m.broken.push((worker, why.clone()));
            }
            let refused = m.refusal();
            let next = match refused {
                Some(r) => Err(r),
                None => m.prepare(worker).map_err(|e| ("not_continuable", e)),
            };
            let metrics = &self.relay.gw.metrics;
            match next {
                Ok(Next::Continue(req)) => {
                    metrics.migration(kind.label(), "continued");
                    if req.token_level() {
                        metrics
                            .token_level_migrations
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    // The client's pause began with the last chunk it got.
                    let silent = self.last_data.elapsed();
                    let now = std::time::Instant::now();
                    m.cut_at = Some(now.checked_sub(silent).unwrap_or(now));
                    self.break_reason = why;
                    tracing::info!(instance = %worker, migration = m.used, "continuing the stream on another worker");
                    // The broken worker's booking goes now; the continuation books its own.
                    self.relay.booking = None;
                    self.moving = Some(Moving(tokio::spawn(migrate::continue_stream(
                        self.relay.gw.clone(),
                        self.relay.router.clone(),
                        req,
                    ))));
                    return None;
                }
                Ok(Next::Finish(events)) => {
                    metrics.migration(kind.label(), "completed");
                    self.relay.booking = None;
                    self.ready = Some(events);
                    self.ended_upstream = true;
                    return None;
                }
                Err((outcome, reason)) => {
                    metrics.migration(kind.label(), outcome);
                    if outcome == "poison" {
                        metrics.poison.fetch_add(1, Ordering::Relaxed);
                        m.broken.clear();
                    }
                    // No worker left to confirm them: the breaks count against their
                    // workers, as a lone 5xx does.
                    self.relay.charge_breaks();
                    return Some(self.end_broken(format!("{why}; not continued: {reason}")));
                }
            }
        }
        Some(self.end_broken(why))
    }

    /// Ends the stream with an error (an error event on event streams).
    fn end_broken(&mut self, why: String) -> Result<Frame<Bytes>, std::io::Error> {
        self.done = true;
        self.relay
            .gw
            .metrics
            .stream_errors
            .fetch_add(1, Ordering::Relaxed);
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

    /// A migratable stream's worker is going: gone from discovery for the drain grace
    /// (a graceful stop), or ejected while this stream has been silent for a check
    /// period (it is not worth waiting for the idle timeout).
    fn worker_leaving(&mut self, now: tokio::time::Instant) -> Option<(Break, String)> {
        let r = &self.relay;
        r.migration.as_ref()?;
        if r.client.instance(r.worker).is_none() {
            let grace = r.gw.config.drain_grace;
            let since = *self.leaving_since.get_or_insert(now);
            return (now.duration_since(since) >= grace).then(|| {
                (
                    Break::Drain,
                    format!("the worker left the fleet and was still streaming after the drain grace of {grace:?}"),
                )
            });
        }
        self.leaving_since = None;
        let silent = now.duration_since(self.last_data);
        (silent >= CHECK_EVERY && r.client.available().binary_search(&r.worker).is_err()).then(
            || {
                (
                    Break::Ejected,
                    format!("the worker was ejected and has sent nothing for {silent:?}"),
                )
            },
        )
    }

    /// The continuation started: its worker's stream becomes this one's.
    fn moved(&mut self, m: Moved) {
        let r = &mut self.relay;
        r.worker = m.worker;
        r.booking = Some(m.booking);
        r.predicted_blocks = m.predicted_blocks;
        self.upstream = m.upstream;
        self.tail.clear();
        let now = tokio::time::Instant::now();
        self.last_data = now;
        self.leaving_since = None;
        self.timer.as_mut().reset(now + period(self.idle, true));
        self.first = m.first;
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
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            if let Some(moving) = this.moving.as_mut() {
                let polled = std::pin::Pin::new(&mut moving.0)
                    .poll(cx)
                    .map(|r| r.unwrap_or_else(|e| Err(format!("the continuation failed: {e}"))));
                match polled {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok(m)) => {
                        this.moving = None;
                        this.moved(m);
                    }
                    Poll::Ready(Err(why)) => {
                        this.moving = None;
                        this.relay.gw.metrics.migration("continuation", "failed");
                        // No worker finished the answer to confirm them: the breaks
                        // count against their workers, as a lone 5xx does.
                        this.relay.charge_breaks();
                        let broke = std::mem::take(&mut this.break_reason);
                        return Poll::Ready(Some(
                            this.end_broken(format!("{broke}; it could not be continued: {why}")),
                        ));
                    }
                }
            }
            if let Some(out) = this.ready.take() {
                return Poll::Ready(Some(Ok(this.data(out))));
            }
            if let Some(why) = this.pending_break.take() {
                match this.broke(Break::ErrorEvent, why) {
                    Some(end) => return Poll::Ready(Some(end)),
                    None => continue,
                }
            }
            if let Some(first) = this.first.take() {
                this.chunk(first);
                continue;
            }
            if this.ended_upstream {
                this.done = true;
                this.finish();
                return Poll::Ready(None);
            }
            match std::pin::Pin::new(&mut this.upstream).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        this.chunk(data);
                    }
                }
                Poll::Ready(None) => {
                    if this.relay.migration.as_ref().is_some_and(|m| !m.complete()) {
                        let why = "the worker closed the stream before its final chunk".to_string();
                        if let Some(end) = this.broke(Break::Reset, why) {
                            return Poll::Ready(Some(end));
                        }
                        continue;
                    }
                    this.ended_upstream = true;
                }
                Poll::Ready(Some(Err(e))) => {
                    if let Some(end) =
                        this.broke(Break::Reset, format!("the worker's stream broke: {e}"))
                    {
                        return Poll::Ready(Some(end));
                    }
                }
                Poll::Pending => {
                    if this.timer.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    let now = tokio::time::Instant::now();
                    if now.duration_since(this.last_data) < this.idle {
                        if let Some((kind, why)) = this.worker_leaving(now) {
                            if let Some(end) = this.broke(kind, why) {
                                return Poll::Ready(Some(end));
                            }
                            continue;
                        }
                        let p = period(this.idle, this.relay.migration.is_some());
                        let next = (this.last_data + this.idle).min(now + p);
                        this.timer.as_mut().reset(next);
                        continue;
                    }
                    let why = format!("the worker sent nothing for {:?}", this.idle);
                    let r = &this.relay;
                    // Silent after the answer's end costs the answer nothing.
                    if !r.migration.as_ref().is_some_and(|m| m.complete()) {
                        verdict::apply(&r.gw, &r.client, r.worker, Verdict::Failing(&why));
                        r.gw.metrics.stalls.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Some(end) = this.broke(Break::Stall, why) {
                        return Poll::Ready(Some(end));
                    }
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
