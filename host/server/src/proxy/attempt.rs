//! A completion's third stage: its attempts. Each places the request (or takes the
//! queue's placement), books both legs, runs a split request's prefill leg, sends the
//! request (or its decode leg) and then either relays the answer or settles the failure
//! and places the request again, up to `--max-attempts`.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use bytes::Bytes;
use hyper::Response;
use hyper::body::Incoming;
use tokio::task::JoinHandle;

use super::prepare::Prepared;
use super::relay::Relay;
use super::tokenize::BLOCKING_TOKENIZE_BYTES;
use super::{
    Attempt, Attempts, Booked, Booking, Failed, Failure, Forwarded, PREFILL_VERDICT, answer,
    count_failed_attempt, decided, forward, give_up, handoff, migrate, settle, split,
};
use crate::verdict::{self, Verdict};
use crate::{ApiError, Body, Gateway};
use switchyard_ids::InstanceId;
use switchyard_router::{KvRouter, Placing, PrefillLeg, RouteError, Routed};
use switchyard_tokens::openai;

/// A split request's prefill leg running beside its decode leg (SGLang's handoff).
struct Beside {
    worker: InstanceId,
    url: String,
    task: JoinHandle<Result<(), split::LegEnd>>,
}

impl Beside {
    /// Its worker, as a failed prefill leg of attempt `attempt`.
    fn failed(&self, attempt: Attempt) -> Failed<'_> {
        Failed {
            worker: self.worker,
            url: &self.url,
            attempt,
            prefill: true,
        }
    }
}

/// What the prefill leg leaves the attempt to send.
enum Leg {
    /// This body with these headers to the (decode) worker, the prefill leg beside it if
    /// it runs at once.
    Send(Bytes, forward::Outbound, Option<Beside>),
    /// The client's answer.
    Done(Result<Response<Body>, ApiError>),
    /// Place the request again.
    Retry,
}

/// Places, sends and relays the request until one attempt serves it, the client's answer
/// is known, or the attempts run out.
pub(super) async fn attempts(
    gw: &Arc<Gateway>,
    p: &Prepared,
    body: Bytes,
    mut queued: Option<Routed>,
    request_started: Instant,
) -> Result<Response<Body>, ApiError> {
    let router = &p.router;
    let client = router.client().clone();
    let endpoint = router.endpoint().to_string();
    let mut a = Attempts::default();
    let mut attempt = 0;
    // vLLM's handoff: a prefill done, and the decode request carrying it (with the
    // split's request ID), kept for the next decode worker when one fails before its
    // first byte.
    let mut kept: Option<(Bytes, forward::Outbound)> = None;
    while attempt < gw.config.max_attempts.max(1) {
        let placing = if kept.is_some() {
            Placing::Decode
        } else {
            Placing::Any
        };
        let placed = match queued.take() {
            Some(r) => Ok(r),
            None => router.place(&p.ask(), &a.exclude, Instant::now(), placing),
        };
        let Booked {
            routed,
            booking,
            prefill,
        } = match placed {
            Ok(r) => decided(gw, &endpoint, router, r),
            Err(_) if kept.is_some() => {
                // No decode worker is left for the prefill kept: place it anew.
                kept = None;
                continue;
            }
            // A retry the policy refuses is refused for the workers it left out (a split
            // fleet with its only decode worker excluded): the client hears what failed.
            Err(e @ RouteError::Rejected(_)) if attempt == 0 => return Err(e.into()),
            Err(e) => return give_up(gw, &client, a, Some(e)),
        };
        if attempt > 0 {
            gw.metrics.retries.fetch_add(1, Ordering::Relaxed);
        }
        attempt += 1;
        let this = Attempt {
            stream: p.parsed.stream,
            limit: p.limit,
            number: attempt,
        };
        let worker = routed.worker;
        let Some(instance) = client.instance(worker) else {
            a.exclude.push(worker);
            continue;
        };
        let (send_body, send_headers, mut beside) =
            match prefill_leg(gw, p, &body, prefill, &mut kept, &mut a, this).await {
                Leg::Send(b, h, beside) => (b, h, beside),
                Leg::Done(done) => return done,
                Leg::Retry => continue,
            };
        let (send_body, ids_asked) = asking_token_ids(gw, p, worker, send_body);
        let send = || {
            forward::forward(
                gw,
                &instance.url,
                &p.path,
                &send_headers,
                send_body.clone(),
                p.limit,
            )
        };
        // The prefill leg beside has ended (answered, or its task failed): its task is
        // done and must not be polled again.
        let mut prefill_answered = false;
        let mut sent = match &mut beside {
            None => send().await,
            Some(b) => {
                // The decode worker waits for its prefill: a prefill leg that fails
                // first ends the wait, and both legs are placed again.
                let decode = send();
                tokio::pin!(decode);
                tokio::select! {
                    s = &mut decode => s,
                    r = &mut b.task => match r {
                        Ok(Ok(())) => {
                            prefill_answered = true;
                            decode.await
                        }
                        Ok(Err(split::LegEnd::Refused(ans))) => return Ok(answer(ans)),
                        Ok(Err(split::LegEnd::Router(e))) => return Err(e),
                        Ok(Err(split::LegEnd::Failed(f))) => {
                            drop(booking);
                            match settle(gw, router, &mut a, b.failed(this), f) {
                                Some(done) => return done,
                                None => continue,
                            }
                        }
                        Err(e) => {
                            // Panicked or cancelled: done too, never to be polled again.
                            prefill_answered = true;
                            Err(Failure::Local(format!("the prefill leg ended: {e}")))
                        }
                    },
                }
            }
        };
        if gw.config.outlier_detection
            && a.reconnects == 0
            && let Err(closed @ Failure::Closed(_)) = &sent
        {
            // Once, on a fresh connection, to the same worker with the same booking
            // (its prefix is there), not counted against it.
            a.reconnects += 1;
            count_failed_attempt(gw, router, worker, &instance.url, closed, attempt);
            sent = send().await;
        }
        let failure = match sent {
            Ok(Forwarded::Ok(parts, first, rest)) => {
                let served = Served {
                    routed: &routed,
                    booking,
                    started: request_started,
                    head: (parts, first, rest),
                    ids_asked,
                };
                return Ok(relay(gw, p, &body, &mut a, served));
            }
            Ok(Forwarded::ClientError(ans)) => {
                // The request's own fault, so any earlier 5xx most likely was too.
                verdict::apply(gw, &client, worker, Verdict::Answered);
                return Ok(answer(ans));
            }
            Err(f) => f,
        };
        drop(booking);
        let beside = beside.filter(|_| !prefill_answered);
        let failed = Failed {
            worker,
            url: &instance.url,
            attempt: this,
            prefill: false,
        };
        if let Some(done) = after_failure(gw, router, &mut a, beside, failed, failure).await {
            return done;
        }
    }
    give_up(gw, &client, a, None)
}

/// A split request's prefill leg: none (the whole request, or a prefill kept from a
/// failed decode leg), done first (vLLM's handoff: the decode leg carries its answer),
/// or started beside the decode leg (SGLang's).
async fn prefill_leg(
    gw: &Arc<Gateway>,
    p: &Prepared,
    body: &Bytes,
    prefill: Option<(PrefillLeg, Booking)>,
    kept: &mut Option<(Bytes, forward::Outbound)>,
    a: &mut Attempts,
    this: Attempt,
) -> Leg {
    let Some((leg, prefill_booking)) = prefill else {
        let (b, h) = kept
            .clone()
            .unwrap_or_else(|| (body.clone(), p.headers.clone()));
        return Leg::Send(b, h, None);
    };
    let client = p.router.client();
    let Some(instance) = client.instance(leg.worker) else {
        a.exclude.push(leg.worker);
        return Leg::Retry;
    };
    gw.metrics.splits.fetch_add(1, Ordering::Relaxed);
    match handoff::Protocol::of(&instance) {
        handoff::Protocol::Vllm => {
            // One request ID for both legs, as vLLM's own proxy sends.
            let both = p.headers.with_fresh_id();
            match split::vllm_prefill(gw, &instance.url, &p.path, &both, body).await {
                Ok(decode_body) => {
                    // Its answer (one token) is its prefill: the worker's latency model
                    // learns from it.
                    p.router.prefill_done(leg.request);
                    verdict::apply(gw, client, leg.worker, Verdict::Answered);
                    *kept = Some((decode_body.clone(), both.clone()));
                    Leg::Send(decode_body, both, None)
                }
                Err(split::LegEnd::Refused(ans)) => Leg::Done(Ok(answer(ans))),
                Err(split::LegEnd::Router(e)) => Leg::Done(Err(e)),
                Err(split::LegEnd::Failed(f)) => {
                    drop(prefill_booking);
                    let failed = Failed {
                        worker: leg.worker,
                        url: &instance.url,
                        attempt: this,
                        prefill: true,
                    };
                    match settle(gw, &p.router, a, failed, f) {
                        Some(done) => Leg::Done(done),
                        None => Leg::Retry,
                    }
                }
            }
        }
        handoff::Protocol::Sglang { host, port } => {
            // The client's request written again with the room: off the async workers
            // past 8 KiB.
            let large = body.len() > BLOCKING_TOKENIZE_BYTES;
            let (b, room) = (body.clone(), handoff::fresh_room());
            let made = crate::error::off_thread_if(large, "the split's body", move || {
                handoff::sglang_body(&b, &host, port, room)
            })
            .await;
            let both = match made {
                Ok(Ok(b)) => b,
                Ok(Err(message)) => {
                    return Leg::Done(Err(ApiError::BadRequest(openai::BadRequest {
                        message,
                        param: None,
                    })));
                }
                Err(e) => return Leg::Done(Err(e)),
            };
            let task = tokio::spawn(split::prefill_beside(
                gw.clone(),
                instance.url.clone(),
                p.path.clone(),
                p.headers.clone(),
                both.clone(),
                gw.config.request_timeout,
                prefill_booking,
            ));
            let beside = Beside {
                worker: leg.worker,
                url: instance.url.clone(),
                task,
            };
            Leg::Send(both, p.headers.clone(), Some(beside))
        }
    }
}

/// The attempt that answered: its placement and booking (which the relay keeps), and
/// the answer's head, first data frame and the rest of its body.
struct Served<'a> {
    routed: &'a Routed,
    booking: Booking,
    started: Instant,
    head: (hyper::http::response::Parts, Option<Bytes>, Incoming),
    /// The router asked the worker for token IDs the client did not ask for.
    ids_asked: bool,
}

/// `body` as sent to `worker`: asking for token IDs when the worker is vLLM and a stream
/// of the request may be migrated (a continuation is then exact), with whether it asks.
fn asking_token_ids(gw: &Gateway, p: &Prepared, worker: InstanceId, body: Bytes) -> (Bytes, bool) {
    let asked = p
        .router
        .streams_token_ids(worker)
        .then(|| migrate::Migration::ask_token_ids(gw, &p.parsed, &body))
        .flatten();
    match asked {
        Some(b) => (b, true),
        None => (body, false),
    }
}

/// The worker answered 2xx: its earlier failures settled, and the answer relayed with
/// the booking (released when the relay ends) and what it takes to continue a stream.
fn relay(
    gw: &Arc<Gateway>,
    p: &Prepared,
    body: &Bytes,
    a: &mut Attempts,
    served: Served<'_>,
) -> Response<Body> {
    let router = &p.router;
    let client = router.client();
    let worker = served.routed.worker;
    let endpoint = router.endpoint().to_string();
    gw.metrics
        .timings
        .first_byte(&endpoint, served.started.elapsed());
    router.prefill_done(served.routed.request);
    verdict::apply(gw, client, worker, Verdict::Answered);
    // Served here: the earlier 5xx answers were those workers' own faults.
    for (w, reason) in a.pending.drain(..) {
        verdict::apply(gw, client, w, Verdict::Failing(&reason));
    }
    let migration = migrate::Migration::new(
        gw,
        p.api,
        migrate::Resend::new(&p.path, &p.headers, &p.parsed, p.session_key),
        body,
        &p.parsed,
        p.prompt_tokens,
        router
            .context_len()
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
    )
    .map(|m| m.ids_asked(served.ids_asked));
    let relay = Relay {
        gw: gw.clone(),
        client: client.clone(),
        worker,
        router: router.clone(),
        booking: Some(served.booking),
        started: served.started,
        endpoint,
        predicted_blocks: served.routed.overlap_blocks,
        migration,
    };
    let (parts, first, rest) = served.head;
    relay.stream(parts, first, rest)
}

/// The attempt failed before its first byte: settled against the worker that caused it
/// (`None`: try again). A decode worker fails when its prefill worker does (the KV never
/// comes): a prefill leg beside it that failed too, or fails within a moment, is the
/// cause.
async fn after_failure(
    gw: &Arc<Gateway>,
    router: &Arc<KvRouter>,
    a: &mut Attempts,
    beside: Option<Beside>,
    decode: Failed<'_>,
    failure: Failure,
) -> Option<Result<Response<Body>, ApiError>> {
    if let Some(mut b) = beside {
        let prefill = tokio::time::timeout(PREFILL_VERDICT, &mut b.task).await;
        // A room serves one handoff: the next attempt runs both legs again.
        b.task.abort();
        if let Ok(Ok(Err(split::LegEnd::Failed(f)))) = prefill {
            return settle(gw, router, a, b.failed(decode.attempt), f);
        }
    }
    settle(gw, router, a, decode, failure)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::book;
    use std::time::Duration;
    use switchyard_discovery::{DiscoveryUpdate, EndpointPath, InstanceInfo};
    use switchyard_policy::{PolicyEngine, PolicyHandle, RuntimeConfig};
    use switchyard_router::client::{Client, ClientConfig, HttpHealthCheck};
    use switchyard_router::{Ask, KvRouterConfig};

    /// A placement dropped on any path (here: before anything was sent, as when its
    /// decode worker leaves discovery between the decision and the lookup) releases both
    /// legs' bookings: they are guards from the moment of the placement.
    #[tokio::test]
    async fn a_split_placement_dropped_before_sending_releases_both_legs() {
        let endpoint = EndpointPath::for_model("m");
        let client = Client::new(
            endpoint.clone(),
            ClientConfig::default(),
            Arc::new(HttpHealthCheck::new(Duration::from_secs(1))),
        );
        client.apply(DiscoveryUpdate::Reset(
            (0..2u64)
                .map(|i| {
                    let url = format!("http://192.0.2.{}:8000", i + 1);
                    InstanceInfo::new(InstanceId(i), endpoint.clone(), url, "m", 16)
                })
                .collect(),
        ));
        let engine = PolicyEngine::new(RuntimeConfig {
            cache_dir: None,
            ..RuntimeConfig::default()
        })
        .unwrap();
        let policy = engine.load_spec("round-robin", "{}").unwrap();
        let policy = Arc::new(PolicyHandle::new(engine, policy).unwrap());
        let router = Arc::new(KvRouter::new(client, policy, KvRouterConfig::new(16)));
        let place = || {
            router
                .place(&Ask::new(64, &[]), &[], Instant::now(), Placing::Any)
                .unwrap()
        };
        // A decode placement and a prefill leg booked on the other worker, as a split
        // decision gives them.
        let mut routed = place();
        let leg = place();
        assert_ne!(routed.worker, leg.worker, "round-robin spreads them");
        routed.prefill = Some(PrefillLeg {
            worker: leg.worker,
            request: leg.request,
            overlap_blocks: 0,
        });
        let booked_on = |w| router.load_of(w).booked;
        assert_eq!((booked_on(routed.worker), booked_on(leg.worker)), (1, 1));
        let (decode, prefill) = (routed.worker, leg.worker);
        drop(book(&router, routed));
        assert_eq!((booked_on(decode), booked_on(prefill)), (0, 0));
        assert_eq!(router.expired_bookings(), 0);
    }
}
