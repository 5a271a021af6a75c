//! Reading a client's request body before the request takes a slot: under the client
//! timeout, within the per-request size limit, and within a budget of bytes held across
//! all requests.
//!
//! Why before the slot: an in-flight slot taken at the head and held while the body
//! trickles in lets a few thousand connections that send a head with
//! `content-length: 100` and then nothing hold every slot, so real requests get 503 while
//! `/ready` says 200. Here a body that does not arrive whole within the deadline gets
//! 408 and costs nothing but its connection; a request takes its slot only once it is
//! ready to be routed.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::ApiError;
use switchyard_tokens::openai;

/// Bytes of request bodies held at once, across every request; given back when the
/// [`Held`] guard is dropped (when the request's answer ends).
#[derive(Debug, Default)]
pub struct BodyBudget {
    held: Arc<AtomicUsize>,
}

impl BodyBudget {
    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// A share of nothing yet, to [`Held::grow`] as a body comes in.
    pub fn hold(&self) -> Held {
        Held {
            held: self.held.clone(),
            bytes: 0,
        }
    }
}

/// A share of the [`BodyBudget`], returned when dropped.
#[derive(Debug)]
pub struct Held {
    held: Arc<AtomicUsize>,
    bytes: usize,
}

impl Held {
    /// Takes `more` bytes for a body that holds `have` already: 413 past the
    /// per-request limit (nothing more is taken), 503 when the budget has no room.
    pub fn take(&mut self, have: usize, more: usize, limits: &Limits) -> Result<(), ApiError> {
        if have.saturating_add(more) > limits.max {
            return Err(ApiError::TooLarge(limits.max));
        }
        if !self.grow(more, limits.total) {
            return Err(ApiError::Overloaded(format!(
                "{} bytes of request bodies held",
                limits.total
            )));
        }
        Ok(())
    }

    /// Takes `n` more bytes, if the budget has them.
    fn grow(&mut self, n: usize, total: usize) -> bool {
        let taken = self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                h.checked_add(n).filter(|t| *t <= total)
            })
            .is_ok();
        if taken {
            self.bytes += n;
        }
        taken
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.held.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// The limits a body is read under.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest body of one request.
    pub max: usize,
    /// Largest sum of bodies held at once.
    pub total: usize,
    /// The whole body must arrive within this.
    pub deadline: Duration,
}

/// Reads `body` whole: 413 past `limits.max`, 503 when the budget has no room, 408 past
/// the deadline, 400 when the connection breaks. The bytes stay counted in `budget` until the returned guard is dropped.
pub async fn read(
    body: Incoming,
    budget: &BodyBudget,
    limits: Limits,
) -> Result<(Bytes, Held), ApiError> {
    let mut held = budget.hold();
    // A `content-length` over the limit is not refused before reading: a client still
    // sending its body would see the connection reset instead of the 413. The body is
    // read up to the limit (never more is held), then refused.
    let read = async {
        let mut body = body;
        let mut buf = BytesMut::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| {
                ApiError::BadRequest(openai::BadRequest {
                    message: format!("cannot read the request body: {e}"),
                    param: None,
                })
            })?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            held.take(buf.len(), data.len(), &limits)?;
            buf.extend_from_slice(&data);
        }
        Ok::<_, ApiError>(buf.freeze())
    };
    let bytes = tokio::time::timeout(limits.deadline, read)
        .await
        .map_err(|_| ApiError::BodyTimeout(limits.deadline))??;
    Ok((bytes, held))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_shared_and_given_back() {
        let budget = BodyBudget::default();
        let mut a = Held {
            held: budget.held.clone(),
            bytes: 0,
        };
        let mut b = Held {
            held: budget.held.clone(),
            bytes: 0,
        };
        assert!(a.grow(60, 100));
        assert!(!b.grow(50, 100), "past the total");
        assert!(b.grow(40, 100));
        assert_eq!(budget.held(), 100);
        drop(a);
        assert_eq!(budget.held(), 40);
        assert!(
            !b.grow(usize::MAX, usize::MAX),
            "an overflowing sum is refused"
        );
        drop(b);
        assert_eq!(budget.held(), 0);
    }
}
