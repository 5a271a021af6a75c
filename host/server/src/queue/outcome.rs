//! What the queue answers and counts: the job a request waits with, its placement,
//! its admission, the reasons it may be shed and the counters of each.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use switchyard_ids::BlockHash;
use switchyard_router::{Ask, KvRouter, Objectives, RouteError, Routed};

use super::Ticket;

/// What a queued request needs to be placed later.
#[derive(Debug, Clone)]
pub struct Job {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// The prompt's block hashes.
    pub hashes: Vec<BlockHash>,
    /// The session key, if the request has one.
    pub session_key: Option<u64>,
    /// Whether its answer is streamed.
    pub stream: bool,
    /// The most output tokens it asks for, if it says.
    pub max_tokens: Option<u32>,
    /// Its latency objectives.
    pub objectives: Objectives,
}

impl Job {
    /// What `ask` needs to be placed later.
    pub fn of(ask: &Ask<'_>) -> Job {
        Job {
            prompt_tokens: ask.prompt_tokens,
            hashes: ask.hashes.to_vec(),
            session_key: ask.session_key,
            stream: ask.stream,
            max_tokens: ask.max_tokens,
            objectives: ask.objectives,
        }
    }

    /// The request as the router places it.
    pub fn ask(&self) -> Ask<'_> {
        Ask {
            prompt_tokens: self.prompt_tokens,
            hashes: &self.hashes,
            session_key: self.session_key,
            stream: self.stream,
            max_tokens: self.max_tokens,
            objectives: self.objectives,
        }
    }
}

/// A request placed (booked) by the queue; the bookings are released if it is dropped
/// before [`Placed::take`] (its client left in the meantime).
pub struct Placed {
    pub(super) router: Arc<KvRouter>,
    pub(super) routed: Option<Routed>,
}

impl Placed {
    /// The placement; its bookings are the caller's from here.
    pub fn take(mut self) -> Routed {
        self.routed.take().expect("taken once")
    }
}

impl Drop for Placed {
    fn drop(&mut self) {
        if let Some(r) = self.routed.take() {
            self.router.finish(r.request);
            if let Some(p) = r.prefill {
                self.router.finish(p.request);
            }
        }
    }
}

/// Why a request was refused by the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShedReason {
    /// Its tenant holds its share of a full queue (429).
    TenantShare,
    /// The queue is full, or the wait ahead exceeds its deadline (503).
    FleetFull,
    /// It waited its deadline (503).
    Deadline,
}

impl ShedReason {
    /// Every reason, in the order of [`QueueStats::shed`].
    pub const ALL: [ShedReason; 3] = [
        ShedReason::TenantShare,
        ShedReason::FleetFull,
        ShedReason::Deadline,
    ];

    /// The error code and metric label.
    pub fn code(self) -> &'static str {
        match self {
            ShedReason::TenantShare => "tenant_over_share",
            ShedReason::FleetFull => "fleet_full",
            ShedReason::Deadline => "queue_deadline",
        }
    }
}

/// A refusal: why, in words, and when to come back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shed {
    /// Why.
    pub reason: ShedReason,
    /// What the client reads.
    pub message: String,
    /// When to try again.
    pub retry_after: Duration,
}

/// How a request left the queue.
pub enum Outcome {
    /// Placed: go on with this placement.
    Placed(Placed),
    /// Not placeable for another reason than saturation (no worker, the policy
    /// refused): route it the usual way, which answers that.
    Route,
    /// Refused.
    Shed(Shed),
    /// Refused by the router's decision (the request's objectives met nowhere).
    Refused(RouteError),
}

/// What [`Queue::admit`] did with a request.
pub enum Admission {
    /// Settled at arrival: placed at once (nothing waited and a worker had room), to
    /// be routed the usual way, or refused.
    Now(Outcome),
    /// Waiting: await the ticket.
    Queued(Ticket),
}

/// One endpoint's counters, read at scrape time.
#[derive(Default)]
pub struct QueueStats {
    /// Requests that waited, ever.
    pub queued: AtomicU64,
    /// Requests placed from the queue.
    pub dispatched: AtomicU64,
    /// Requests refused, by [`ShedReason::ALL`]'s order.
    pub shed: [AtomicU64; 3],
    /// Queued requests whose client left.
    pub left: AtomicU64,
}

impl QueueStats {
    /// One request refused for `reason`.
    pub(super) fn count(&self, reason: ShedReason) {
        // `ALL` lists every reason: the index is always found.
        let i = ShedReason::ALL
            .iter()
            .position(|r| *r == reason)
            .unwrap_or(0);
        self.shed[i].fetch_add(1, Ordering::Relaxed);
    }
}
