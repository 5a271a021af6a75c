//! A pick without forwarding, for a gateway that carries the bytes itself (the endpoint
//! picker, `crate::epp`): the request prepared and admitted exactly as at the front door
//! (parse, router, tokenize, hash, context check, the overload queue), then placed on a
//! worker of its own (no split: the gateway sends one request) and booked. The booking
//! is a guard: the picker releases it when the gateway reports the answer's end, and
//! dropping it (the gateway's stream gone without a response phase) releases it too.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

pub(crate) use super::handoff::authority;
use super::{Booked, book, decided};
use super::{Booking, prepare};
use crate::{ApiError, Gateway};
use switchyard_ids::InstanceId;
use switchyard_router::{KvRouter, Placing};
use switchyard_tokens::openai::Api;

/// A request placed for a gateway.
pub(crate) struct Picked {
    /// The chosen worker.
    pub(crate) worker: InstanceId,
    /// The chosen worker's base URL.
    pub(crate) url: String,
    /// Where the gateway may go if the chosen worker fails, best first: `host:port` of
    /// other eligible workers, most prompt cached first, then least loaded.
    pub(crate) fallbacks: Vec<String>,
    pub(crate) router: Arc<KvRouter>,
    booking: Option<Booking>,
    /// The answer's status, once the gateway reported it.
    status: Option<u16>,
    /// The answer's headers were learned from (once per exchange).
    learned: bool,
    /// How long the gateway has, once the pick is answered, to start the answer: a
    /// stream's first-byte timeout, a whole answer's request timeout.
    pub(crate) first_byte_limit: std::time::Duration,
    /// When the booking was last told the answer is alive.
    touched: std::time::Instant,
    /// The request's `--max-in-flight` slot, held until its answer ends, as at the front
    /// door: a gateway's requests count against the same bound.
    slot: Option<switchyard_bounded::slot::Slot>,
    /// The answer's last bytes (its `usage` comes at its end).
    tail: Vec<u8>,
}

impl Picked {
    /// The answer's first bytes arrived: the prompt is prefilled.
    pub(crate) fn first_token(&self) {
        if let Some(b) = &self.booking {
            self.router.prefill_done(b.request);
        }
    }

    /// The answer's status came (the first time it is reported: a later report does not
    /// change what the answer was).
    pub(crate) fn status(&mut self, status: Option<u16>) {
        if self.status.is_none() {
            self.status = status;
        }
    }

    /// Whether this is the first time the answer's headers are learned from.
    pub(crate) fn first_answer(&mut self) -> bool {
        !std::mem::replace(&mut self.learned, true)
    }

    /// A chunk of the answer passed: kept for its usage, and the booking told it is
    /// alive (at most every [`super::relay::TOUCH_EVERY`]: a long stream is not taken for
    /// a leak by the hard expiry).
    pub(crate) fn body(&mut self, bytes: &[u8]) {
        super::relay::note_usage_tail(&mut self.tail, bytes);
        let now = std::time::Instant::now();
        if let Some(b) = &self.booking
            && now.saturating_duration_since(self.touched) >= super::relay::TOUCH_EVERY
        {
            self.touched = now;
            b.router.touch(b.request);
        }
    }

    /// The answer ended: a successful one teaches the worker's latency model (its
    /// output tokens from its usage, where it has one); its load is released.
    pub(crate) fn end(&mut self) {
        if let Some(b) = self.booking.take()
            && self.status.is_some_and(|s| (200..300).contains(&s))
        {
            let output = switchyard_tokens::openai::scan_completion_tokens(&self.tail)
                .map(|n| u32::try_from(n).unwrap_or(u32::MAX));
            b.router.complete(b.request, output);
        }
        self.slot = None;
    }

    /// The answer ended or was left: its load is released.
    pub(crate) fn finish(&mut self) {
        self.booking = None;
        self.slot = None;
    }

    /// Whether the gateway's answer has begun (its headers came).
    pub(crate) fn answered(&self) -> bool {
        self.status.is_some()
    }
}

/// Prepares, admits and places a request for a gateway, among the workers `allowed`
/// keeps (all of them when it keeps every one), with up to `fallbacks` other workers.
/// None allowed (an empty or foreign subset) is 503 `no_eligible_worker`.
pub(crate) async fn pick(
    gw: &Arc<Gateway>,
    api: Api,
    req: &hyper::http::request::Parts,
    body: &Bytes,
    allowed: &(dyn Fn(&str) -> bool + Send + Sync),
    fallbacks: usize,
) -> Result<Picked, ApiError> {
    let p = prepare::prepare(gw, api, req, body).await?;
    let router = p.router.clone();
    let client = router.client().clone();
    let snapshot = client.snapshot();
    let exclude: Vec<InstanceId> = snapshot
        .instances
        .iter()
        .filter(|(_, s)| !allowed(&s.info.url))
        .map(|(id, _)| *id)
        .collect();
    if !exclude.is_empty() && exclude.len() == snapshot.instances.len() {
        return Err(ApiError::NoEligibleWorker(
            "no worker of the gateway's subset serves this model".into(),
        ));
    }
    // A slot of the front door's `--max-in-flight`, given back while the request waits
    // in the queue and taken again when it is placed.
    let mut slot = Some(gw.in_flight_slot()?);
    let queued = prepare::admit(gw, &p, body.len(), &mut slot).await?;
    let chosen = match queued {
        Some(r) if !exclude.contains(&r.worker) && r.prefill.is_none() => r,
        other => {
            // Not where the gateway allows, or split: released (its guards dropped),
            // and placed again.
            drop(other.map(|r| book(&router, r)));
            router.place(&p.ask(), &exclude, Instant::now(), Placing::Alone)?
        }
    };
    // A whole request on one worker: no prefill leg to keep (its guard, if any, drops).
    let Booked {
        routed, booking, ..
    } = decided(gw, &router.endpoint().to_string(), &router, chosen);
    let Some(instance) = client.instance(routed.worker) else {
        return Err(ApiError::Overloaded(
            "the worker chosen left discovery".into(),
        ));
    };
    let mut others = exclude;
    others.push(routed.worker);
    let fallbacks = fallbacks_of(&router, &p.hashes, &others, fallbacks);
    Ok(Picked {
        worker: routed.worker,
        url: instance.url.clone(),
        fallbacks,
        router,
        booking: Some(booking),
        status: None,
        learned: false,
        first_byte_limit: p.limit,
        touched: std::time::Instant::now(),
        slot,
        tail: Vec::new(),
    })
}

/// Up to `n` workers besides those in `exclude` that can serve a whole request, most
/// prompt cached first, then fewest prompt tokens pending, then fewest in flight: the
/// next best places without another policy call.
fn fallbacks_of(
    router: &KvRouter,
    hashes: &[switchyard_ids::BlockHash],
    exclude: &[InstanceId],
    n: usize,
) -> Vec<String> {
    if n == 0 {
        return Vec::new();
    }
    let (candidates, _) = router.candidates(hashes, exclude);
    let mut rows: Vec<_> = (0..candidates.len())
        .map(|i| candidates.row(i))
        .filter(|r| r.role != switchyard_ids::Role::Prefill)
        .collect();
    rows.sort_by_key(|r| {
        (
            std::cmp::Reverse(r.overlap_blocks),
            r.pending_prefill_tokens,
            r.in_flight,
        )
    });
    let client = router.client();
    rows.iter()
        .filter_map(|r| client.instance(r.id))
        .filter_map(|i| authority(&i.url).map(str::to_string))
        .take(n)
        .collect()
}
