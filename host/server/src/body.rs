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

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::ApiError;
use switchyard_bounded::budget::{Budget, Grant};
use switchyard_tokens::openai;

/// Bytes of request bodies held at once, across every request (and the picker's
/// messages being received): a [`Budget`] of `max_body_bytes_total`, shared with
/// everything that holds a request body; given back when the [`Held`] guard is dropped
/// (when the request's answer ends).
#[derive(Debug, Clone)]
pub struct BodyBudget {
    budget: Budget,
}

impl BodyBudget {
    /// A budget of `total` bytes.
    pub fn new(total: usize) -> BodyBudget {
        BodyBudget {
            budget: Budget::new(total as u64),
        }
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        usize::try_from(self.budget.used()).unwrap_or(usize::MAX)
    }

    /// A share of nothing yet, to [`Held::take`] from as a body comes in.
    pub fn hold(&self) -> Held {
        Held {
            budget: self.budget.clone(),
            grant: Grant::default(),
        }
    }
}

/// A share of the [`BodyBudget`], returned when dropped.
#[derive(Debug)]
pub struct Held {
    budget: Budget,
    grant: Grant,
}

impl Held {
    /// Takes `more` bytes for a body that holds `have` already: 413 past the
    /// per-request limit (nothing more is taken), 503 when the budget has no room.
    pub fn take(&mut self, have: usize, more: usize, limits: &Limits) -> Result<(), ApiError> {
        if have.saturating_add(more) > limits.max {
            return Err(ApiError::TooLarge(limits.max));
        }
        let Some(grant) = self.budget.take(more as u64) else {
            return Err(ApiError::Overloaded(format!(
                "{} bytes of request bodies held",
                self.budget.capacity()
            )));
        };
        self.grant.absorb(grant);
        Ok(())
    }
}

/// The limits a body is read under (the sum of bodies held at once is the
/// [`BodyBudget`]'s).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest body of one request.
    pub max: usize,
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
    fn the_budget_is_shared_given_back_and_a_request_is_held_to_its_limit() {
        let budget = BodyBudget::new(100);
        let limits = Limits {
            max: 70,
            deadline: Duration::from_secs(1),
        };
        let (mut a, mut b) = (budget.hold(), budget.hold());
        a.take(0, 60, &limits).unwrap();
        assert!(
            matches!(b.take(0, 50, &limits), Err(ApiError::Overloaded(_))),
            "past the total"
        );
        assert!(
            matches!(a.take(60, 11, &limits), Err(ApiError::TooLarge(70))),
            "past one request's limit"
        );
        b.take(0, 40, &limits).unwrap();
        assert_eq!(budget.held(), 100);
        drop(a);
        assert_eq!(budget.held(), 40);
        assert!(b.take(40, usize::MAX, &limits).is_err(), "no overflow");
        drop(b);
        assert_eq!(budget.held(), 0);
    }
}
