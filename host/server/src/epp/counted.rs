//! The picker's gRPC request bodies counted in the front door's budget of bodies held.
//! tonic gathers each message whole before the exchange sees it (up to a whole buffered
//! body), so a gateway, or anyone who reaches the port, could hold a partial message on
//! every stream of every connection; here the bytes of the message being received are
//! taken from [`BodyBudget`] from its first byte until its last, when tonic decodes it
//! and the exchange's own [`Held`] takes over. A message the budget has no room for ends
//! its stream with an error, as the front door answers 503 to a body it has no room for.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tonic::codegen::Service;
use tonic::server::NamedService;

use crate::body::{BodyBudget, Held, Limits};

/// A gRPC message's header: a compression flag and a big-endian length.
const HEADER: usize = 5;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A request body whose partly received message is held in the budget.
pub(crate) struct Counted<B> {
    inner: B,
    budget: BodyBudget,
    limits: Limits,
    frames: Framing,
    held: Held,
}

impl<B> Counted<B> {
    /// `inner`, counted in `budget`; a message is at most `largest` bytes.
    pub(crate) fn new(inner: B, budget: BodyBudget, largest: usize) -> Counted<B> {
        Counted {
            held: budget.hold(),
            inner,
            budget,
            limits: Limits {
                max: largest.saturating_add(HEADER),
                deadline: Duration::MAX,
            },
            frames: Framing::default(),
        }
    }
}

/// Where a stream of length-prefixed messages is.
#[derive(Debug, Default)]
pub(crate) struct Framing {
    header: [u8; HEADER],
    /// Header bytes of the next message seen.
    header_seen: usize,
    /// Bytes of the message's payload still to come.
    left: usize,
    /// Bytes of the message being received seen so far (header included).
    pub(crate) partial: usize,
}

impl Framing {
    /// Reads `data`; true when a message ended in it (the bytes before the last
    /// message's start need no holding any more). `partial` is then the bytes of the
    /// message still being received.
    pub(crate) fn read(&mut self, mut data: &[u8]) -> bool {
        let mut ended = false;
        while !data.is_empty() {
            if self.left == 0 && self.header_seen < HEADER {
                let n = (HEADER - self.header_seen).min(data.len());
                self.header[self.header_seen..self.header_seen + n].copy_from_slice(&data[..n]);
                self.header_seen += n;
                self.partial += n;
                data = &data[n..];
                if self.header_seen == HEADER {
                    let len = u32::from_be_bytes([
                        self.header[1],
                        self.header[2],
                        self.header[3],
                        self.header[4],
                    ]);
                    self.left = len as usize;
                    self.header_seen = 0;
                    if self.left == 0 {
                        ended = true;
                        self.partial = 0;
                    }
                }
            } else {
                let n = self.left.min(data.len());
                self.left -= n;
                self.partial += n;
                data = &data[n..];
                if self.left == 0 {
                    ended = true;
                    self.partial = 0;
                }
            }
        }
        ended
    }
}

impl<B> Body for Counted<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let frame = match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) => f,
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => return Poll::Pending,
        };
        if let Some(data) = frame.data_ref() {
            let before = this.frames.partial;
            if this.frames.read(data) {
                // The messages that ended go to the exchange, which holds them itself.
                this.held = this.budget.hold();
                if let Err(e) = this.held.take(0, this.frames.partial, &this.limits) {
                    return Poll::Ready(Some(Err(e.to_string().into())));
                }
            } else if let Err(e) = this.held.take(before, data.len(), &this.limits) {
                return Poll::Ready(Some(Err(e.to_string().into())));
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A gRPC service whose request bodies are [`Counted`].
#[derive(Clone)]
pub(crate) struct Budgeted<S> {
    pub(crate) inner: S,
    pub(crate) budget: BodyBudget,
    /// The largest message.
    pub(crate) largest: usize,
}

impl<S: NamedService> NamedService for Budgeted<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> Service<hyper::Request<B>> for Budgeted<S>
where
    S: Service<hyper::Request<Counted<B>>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: hyper::Request<B>) -> S::Future {
        let (budget, largest) = (self.budget.clone(), self.largest);
        self.inner
            .call(req.map(|body| Counted::new(body, budget, largest)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(len: u32) -> Vec<u8> {
        let mut m = vec![0];
        m.extend_from_slice(&len.to_be_bytes());
        m.extend(std::iter::repeat_n(7u8, len as usize));
        m
    }

    #[test]
    fn the_partial_message_is_what_is_counted_across_frames() {
        let mut f = Framing::default();
        let (a, b) = (message(10), message(3));
        // A header cut in two, then part of the payload.
        assert!(!f.read(&a[..2]));
        assert!(!f.read(&a[2..9]));
        assert_eq!(f.partial, 9);
        // The rest of the first message and the start of the next.
        let mut rest = a[9..].to_vec();
        rest.extend_from_slice(&b[..4]);
        assert!(f.read(&rest));
        assert_eq!(f.partial, 4);
        assert!(f.read(&b[4..]));
        assert_eq!(f.partial, 0);
        // An empty message ends at its header.
        assert!(f.read(&message(0)));
        assert_eq!(f.partial, 0);
    }

    #[test]
    fn a_partial_message_past_the_budget_ends_the_stream_and_gives_its_bytes_back() {
        let budget = BodyBudget::new(1000);
        let m = message(2000);
        let frames: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = m
            .chunks(400)
            .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        let inner = http_body_util::StreamBody::new(tokio_stream::iter(frames));
        let mut body = Counted::new(inner, budget.clone(), 4 << 20);
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        let mut results = Vec::new();
        while let Poll::Ready(Some(r)) = Pin::new(&mut body).poll_frame(&mut cx) {
            let failed = r.is_err();
            results.push(r.is_ok());
            if failed {
                break;
            }
        }
        assert_eq!(
            results,
            [true, true, false],
            "the third 400 bytes pass 1000"
        );
        assert_eq!(budget.held(), 800, "the two frames taken are still held");
        drop(body);
        assert_eq!(budget.held(), 0);
    }
}
