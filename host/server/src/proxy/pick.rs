//! A pick without forwarding, for a gateway that carries the bytes itself (the endpoint
//! picker, `crate::epp`): the request prepared and admitted exactly as at the front door
//! (parse, router, tokenize, hash, context check, the overload queue), then placed on a
//! worker of its own (no split: the gateway sends one request) and booked. The booking
//! is a guard: the picker releases it when the gateway reports the answer's end, and
//! dropping it (the gateway's stream gone without a response phase) releases it too.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use super::{Booking, prepare};
use crate::{ApiError, Gateway};
use switchyard_ids::InstanceId;
use switchyard_router::{KvRouter, Placing};
use switchyard_tokens::openai::Api;

/// A request placed for a gateway.
pub(crate) struct Picked {
    /// The chosen worker's base URL.
    pub(crate) url: String,
    router: Arc<KvRouter>,
    booking: Option<Booking>,
}

impl Picked {
    /// The answer's first bytes arrived: the prompt is prefilled.
    pub(crate) fn first_token(&self) {
        if let Some(b) = &self.booking {
            self.router.prefill_done(b.request);
        }
    }

    /// The answer ended: its load is released.
    pub(crate) fn finish(&mut self) {
        self.booking = None;
    }
}

/// Prepares, admits and places a request for a gateway, among the workers `allowed`
/// keeps (all of them when it keeps every one).
pub(crate) async fn pick(
    gw: &Arc<Gateway>,
    api: Api,
    req: &hyper::http::request::Parts,
    body: &Bytes,
    allowed: &(dyn Fn(&str) -> bool + Send + Sync),
) -> Result<Picked, ApiError> {
    let p = prepare::prepare(gw, api, req, body).await?;
    let router = p.router.clone();
    let client = router.client().clone();
    let mut slot = None;
    let queued = prepare::admit(gw, &req.headers, &p, body.len(), &mut slot).await?;
    let exclude: Vec<InstanceId> = client
        .snapshot()
        .instances
        .iter()
        .filter(|(_, s)| !allowed(&s.info.url))
        .map(|(id, _)| *id)
        .collect();
    let routed = match queued {
        Some(r) if !exclude.contains(&r.worker) && r.prefill.is_none() => r,
        other => {
            // Not where the gateway allows, or split: released, and placed again.
            if let Some(r) = other {
                router.finish(r.request);
                if let Some(leg) = r.prefill {
                    router.finish(leg.request);
                }
            }
            router.place(
                p.prompt_tokens,
                &p.hashes,
                p.session_key,
                &exclude,
                Instant::now(),
                Placing::Alone,
            )?
        }
    };
    let endpoint = router.endpoint().to_string();
    gw.metrics
        .timings
        .decision(&endpoint, routed.decision_time, routed.decision.call_time);
    let booking = Booking {
        router: router.clone(),
        request: routed.request,
    };
    if let Some(leg) = routed.prefill {
        router.finish(leg.request);
    }
    let Some(instance) = client.instance(routed.worker) else {
        return Err(ApiError::Overloaded(
            "the worker chosen left discovery".into(),
        ));
    };
    Ok(Picked {
        url: instance.url.clone(),
        router,
        booking: Some(booking),
    })
}
