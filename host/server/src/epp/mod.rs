//! The endpoint picker (`--epp-listen`): Envoy's external processing service
//! (`envoy.service.ext_proc.v3.ExternalProcessor`, gRPC) as the Gateway API Inference
//! Extension's endpoint picker protocol uses it. A gateway sends each request's headers
//! and body; the picker decides as the front door would (`proxy::pick`: the same
//! parsing, router, policy, queue and bookings) and answers the worker's `ip:port`
//! (then up to `--epp-fallbacks` others) in the `x-gateway-destination-endpoint` header
//! and the `envoy.lb` dynamic metadata; the gateway carries the bytes. The answer's
//! status and the endpoint that served it feed outlier detection; its first bytes mark
//! the prompt prefilled and its end releases the booking; a stream that ends without
//! them, or goes silent, releases it too.
//!
//! Body modes: `FULL_DUPLEX_STREAMED` (the reference picker's: the body comes in chunks
//! and goes back once the pick is made) and `BUFFERED` (the body comes whole; its
//! answer carries the pick). Others cannot carry a pick made from the body and are
//! refused with a 500 that says so.

mod counted;
mod outcome;
pub mod protocol;

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, HeadersResponse, HttpHeaders, ProcessingRequest, ProcessingResponse,
    processing_request::Request as In, processing_response::Response as Out,
};
use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt};
use tonic::{Status, Streaming};

use crate::body::Held;
use crate::proxy::pick::{Picked, authority, pick};
use crate::{ApiError, Gateway};
use protocol::{Mode, answer, bad, immediate, streamed};

/// Most fallback endpoints a pick may name.
pub const MAX_FALLBACKS: usize = 8;

/// The picker's TLS identity: a certificate chain and its private key, PEM, checked
/// when read (at start: a bad file is a configuration error, not a picker that fails
/// every handshake).
#[derive(Clone, PartialEq, Eq)]
pub struct EppTls {
    cert: Vec<u8>,
    key: Vec<u8>,
}

impl std::fmt::Debug for EppTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EppTls { .. }")
    }
}

impl EppTls {
    /// Most bytes of either file.
    const MAX_FILE: u64 = 1 << 20;

    /// Reads and checks `cert` and `key`.
    pub fn read(cert: &std::path::Path, key: &std::path::Path) -> Result<EppTls, String> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};
        let read = |p: &std::path::Path| {
            switchyard_bounded::files::read(p, Self::MAX_FILE)
                .map_err(|e| format!("{}: {e}", p.display()))
        };
        let (cert_pem, key_pem) = (read(cert)?, read(key)?);
        let chain = CertificateDer::pem_slice_iter(&cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("certificate file {}: {e}", cert.display()))?;
        if chain.is_empty() {
            return Err(format!(
                "certificate file {} holds no certificate",
                cert.display()
            ));
        }
        PrivateKeyDer::from_pem_slice(&key_pem)
            .map_err(|e| format!("key file {}: {e}", key.display()))?;
        Ok(EppTls {
            cert: cert_pem,
            key: key_pem,
        })
    }
}

/// Most gRPC streams (exchanges) open at once on one connection: a gateway multiplexes
/// its requests over a few connections; a peer opening thousands on one is refused them.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 1024;
/// HTTP/2 flow-control windows: what a peer may send before the picker reads it, per
/// stream and per connection (a message is read whole, up to the body limit, only once
/// the picker asks for it).
const STREAM_WINDOW: u32 = 1 << 20;
const CONNECTION_WINDOW: u32 = 4 << 20;
/// HTTP/2 pings: a gateway that answers none within the timeout is gone.
const KEEPALIVE: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// What the picker says beyond the pick.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Other workers named after each pick (at most [`MAX_FALLBACKS`]).
    pub fallbacks: usize,
    /// Name the endpoint that served in each answer's headers ([`protocol::SERVED`]).
    pub report_served: bool,
}

/// Serves the picker on `listener` until `stop` resolves, naming up to
/// `options.fallbacks` other workers after each pick; over TLS with `tls`. Its connections are held to the front
/// door's bounds (`crate::listen`: `--max-connections` of their own, keepalive, the write
/// deadline); its exchanges to the streams per connection above and, each, to the front
/// door's `--max-in-flight` once picked.
pub async fn serve(
    gw: Arc<Gateway>,
    listener: tokio::net::TcpListener,
    options: Options,
    tls: Option<EppTls>,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    // gRPC health, as GIE's deployments probe it: `liveness` while the process answers;
    // `readiness` and the ext_proc service while the front door itself would be ready
    // (discovery done, a worker available, not draining; a full queue is one model's,
    // shed per request), checked every second.
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("liveness", tonic_health::ServingStatus::Serving)
        .await;
    let watch = gw.clone();
    let ready_task = tokio::spawn(async move {
        loop {
            let status = if watch.is_serving() {
                tonic_health::ServingStatus::Serving
            } else {
                tonic_health::ServingStatus::NotServing
            };
            for service in [
                "readiness",
                "envoy.service.ext_proc.v3.ExternalProcessor",
                "",
            ] {
                reporter.set_service_status(service, status).await;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    // One message holds at most a whole buffered body, and its headers.
    let largest = gw.config.max_body_bytes.saturating_add(64 << 10);
    let picker = Picker {
        gw: gw.clone(),
        options: Options {
            fallbacks: options.fallbacks.min(MAX_FALLBACKS),
            ..options
        },
        probes: Arc::default(),
    };
    let mut server = tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .concurrency_limit_per_connection(MAX_STREAMS_PER_CONNECTION as usize)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .http2_keepalive_interval(Some(KEEPALIVE))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT));
    if let Some(t) = tls {
        let identity = tonic::transport::Identity::from_pem(t.cert, t.key);
        server = server.tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))?;
    }
    let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (max, write_limit) = (gw.config.max_connections, gw.config.client_idle_timeout);
    let counts = gw.clone();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).filter_map(move |r| {
        let stream = r.ok()?;
        match crate::listen::harden(stream, &connections, max, write_limit) {
            Ok(accepted) => Some(Ok::<_, std::io::Error>(accepted)),
            Err(_refused) => {
                counts
                    .metrics
                    .refused_connections
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                None
            }
        }
    });
    let served = server
        .add_service(health)
        .add_service(counted::Budgeted {
            inner: ExternalProcessorServer::new(picker).max_decoding_message_size(largest),
            budget: gw.bodies.clone(),
            largest,
        })
        .serve_with_incoming_shutdown(incoming, stop)
        .await;
    ready_task.abort();
    served
}

struct Picker {
    gw: Arc<Gateway>,
    options: Options,
    probes: Arc<outcome::Probes>,
}

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: tonic::Request<Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Answers>, Status> {
        let input = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let probes = self.probes.clone();
        tokio::spawn(exchange(self.gw.clone(), self.options, probes, input, tx));
        Ok(tonic::Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// One request's exchange with the gateway.
struct Exchange {
    mode: Mode,
    /// Whether response body chunks are each answered with themselves.
    response_full_duplex: bool,
    headers: Option<HttpHeaders>,
    body: Vec<u8>,
    /// The body's bytes counted in the front door's budget of bodies held.
    held: Held,
    /// The subset the gateway allows, if it sent one.
    subset: Option<Vec<String>>,
    options: Options,
    probes: Arc<outcome::Probes>,
    picked: Option<Picked>,
    /// The pick is answered (the request phase is over).
    decided: bool,
    answered: bool,
}

async fn exchange(
    gw: Arc<Gateway>,
    options: Options,
    probes: Arc<outcome::Probes>,
    mut input: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
) {
    let mut x = Exchange {
        mode: Mode::FullDuplex,
        response_full_duplex: true,
        headers: None,
        body: Vec::new(),
        held: gw.bodies.hold(),
        subset: None,
        options,
        probes,
        picked: None,
        decided: false,
        answered: false,
    };
    // The request phase must end within the client timeout (as a body must at the front
    // door); after the pick, a gateway silent for a whole request timeout is gone.
    let limits = gw.body_limits();
    let request_deadline = tokio::time::Instant::now() + limits.deadline;
    let mut first = true;
    loop {
        // After the pick, the gateway has the worker's first byte's time to start the
        // answer (a stream's first-byte timeout, a whole answer's request timeout): a
        // pick nobody forwards holds its booking no longer. Once the answer runs, a
        // gateway silent for a whole request timeout is gone.
        let wait = match &x.picked {
            Some(p) if !p.answered() => tokio::time::Instant::now() + p.first_byte_limit,
            _ if x.decided => tokio::time::Instant::now() + gw.config.request_timeout,
            _ => request_deadline,
        };
        let m = match tokio::time::timeout_at(wait, input.message()).await {
            Ok(Ok(Some(m))) => m,
            Ok(Ok(None) | Err(_)) => break,
            Err(_) if x.decided => break,
            Err(_) => {
                let e = ApiError::BodyTimeout(limits.deadline);
                send(&gw, &tx, immediate(&e).await).await;
                break;
            }
        };
        if first {
            first = false;
            x.mode = Mode::of(&m).unwrap_or(Mode::FullDuplex);
            x.response_full_duplex = Mode::response_full_duplex(&m).unwrap_or(true);
        }
        // The subset matters to the pick alone: not read again for the answer's chunks.
        if !x.decided && x.subset.is_none() {
            x.subset = protocol::subset_hint(&m);
        }
        // A gateway gone while the pick is made (the request waiting in the queue, say)
        // ends it: its place in the queue and any booking go with it.
        let answers = tokio::select! {
            a = step(&gw, &mut x, m) => a,
            _ = tx.closed() => return,
        };
        // An immediate answer ends the request: nothing more is read for it.
        let refused = ends_the_request(&answers);
        for a in answers {
            if !send(&gw, &tx, a).await {
                return;
            }
        }
        if refused {
            break;
        }
    }
    // The stream ended: whatever was booked is released as `x` drops.
}

/// Whether `answers` hold an immediate answer, which ends the request.
fn ends_the_request(answers: &[ProcessingResponse]) -> bool {
    answers
        .iter()
        .any(|a| matches!(a.response, Some(Out::ImmediateResponse(_))))
}

/// Sends one answer to the gateway within the write deadline the front door gives its
/// clients (`--client-idle-timeout-secs`): a gateway that stops reading its stream ends
/// the exchange instead of holding its answers (and its booking) forever. False when
/// the answer could not be sent.
async fn send(
    gw: &Gateway,
    tx: &mpsc::Sender<Result<ProcessingResponse, Status>>,
    a: ProcessingResponse,
) -> bool {
    matches!(
        tokio::time::timeout(gw.config.client_idle_timeout, tx.send(Ok(a))).await,
        Ok(Ok(()))
    )
}

/// The answers to one message of the exchange.
async fn step(
    gw: &Arc<Gateway>,
    x: &mut Exchange,
    m: ProcessingRequest,
) -> Vec<ProcessingResponse> {
    let served = m.request.as_ref().and_then(|r| match r {
        In::ResponseHeaders(h) => Some(protocol::served(&m, Some(h))),
        _ => None,
    });
    match m.request {
        Some(In::RequestHeaders(h)) => {
            let eos = h.end_of_stream;
            x.headers = Some(h);
            if let Mode::Unusable(mode) = x.mode {
                let e = ApiError::Internal(format!(
                    "the gateway sends the request body in mode {mode}: the endpoint picker \
                     needs FULL_DUPLEX_STREAMED or BUFFERED"
                ));
                return vec![immediate(&e).await];
            }
            if eos {
                decide(gw, x).await
            } else if x.mode == Mode::Buffered {
                // The body comes next, whole; the pick goes with its answer.
                vec![answer(Out::RequestHeaders(HeadersResponse::default()))]
            } else {
                Vec::new()
            }
        }
        Some(In::RequestBody(b)) if !x.decided => {
            if let Err(e) = x.held.take(x.body.len(), b.body.len(), &gw.body_limits()) {
                return vec![immediate(&e).await];
            }
            x.body.extend_from_slice(&b.body);
            // A buffered body comes in one message, whatever its end-of-stream says.
            if b.end_of_stream || x.mode == Mode::Buffered {
                decide(gw, x).await
            } else {
                Vec::new()
            }
        }
        Some(In::RequestBody(b)) => vec![answer(Out::RequestBody(BodyResponse {
            response: Some(streamed(b.body, b.end_of_stream)),
        }))],
        Some(In::RequestTrailers(_)) => {
            // Trailers end the request: a pick not made yet is made now, and its
            // answers (headers, body) go before the trailers'.
            let mut out = if x.decided {
                Vec::new()
            } else {
                decide(gw, x).await
            };
            if !ends_the_request(&out) {
                out.push(answer(Out::RequestTrailers(Default::default())));
            }
            out
        }
        Some(In::ResponseHeaders(h)) => {
            if let Some(p) = &mut x.picked {
                let status = protocol::status(&h);
                let retry_after = protocol::header(&h, "retry-after")
                    .and_then(|v| std::str::from_utf8(v).ok())
                    .and_then(|v| crate::proxy::parse_retry_after(v.trim()));
                let answer = outcome::Answer {
                    status,
                    retry_after,
                    served: served.clone().flatten(),
                };
                p.status(status);
                outcome::learn(gw, &x.probes, p, answer);
                if h.end_of_stream {
                    p.end();
                }
            }
            let response = served
                .flatten()
                .filter(|_| x.options.report_served)
                .map(|s| protocol::served_header(&s));
            vec![answer(Out::ResponseHeaders(HeadersResponse { response }))]
        }
        Some(In::ResponseBody(b)) => {
            if let Some(p) = &mut x.picked {
                if !x.answered {
                    x.answered = true;
                    p.first_token();
                }
                p.body(&b.body);
                if b.end_of_stream {
                    p.end();
                }
            }
            let response = x
                .response_full_duplex
                .then(|| streamed(b.body, b.end_of_stream));
            vec![answer(Out::ResponseBody(BodyResponse { response }))]
        }
        Some(In::ResponseTrailers(_)) => {
            if let Some(p) = &mut x.picked {
                p.end();
            }
            vec![answer(Out::ResponseTrailers(Default::default()))]
        }
        None => Vec::new(),
    }
}

/// The pick for the request gathered so far: the headers answered with the destination,
/// then the body returned (full duplex) — or the body's answer carrying the pick
/// (buffered); or an immediate answer saying why not.
async fn decide(gw: &Arc<Gateway>, x: &mut Exchange) -> Vec<ProcessingResponse> {
    x.decided = true;
    let Some(h) = &x.headers else {
        return vec![immediate(&ApiError::BadRequest(bad("no request headers"))).await];
    };
    let (parts, api) = match protocol::request_parts(h, &gw.config.overload) {
        Ok(p) => p,
        Err(e) => return vec![immediate(&e).await],
    };
    let body = Bytes::from(std::mem::take(&mut x.body));
    let subset = x.subset.take();
    let allowed = move |url: &str| {
        subset
            .as_ref()
            .is_none_or(|s| s.iter().any(|a| Some(a.as_str()) == authority(url)))
    };
    let picked = match pick(gw, api, &parts, &body, &allowed, x.options.fallbacks).await {
        Ok(p) => p,
        Err(e) => return vec![immediate(&e).await],
    };
    let Some(primary) = authority(&picked.url) else {
        return vec![immediate(&ApiError::Internal("a worker URL without host".into())).await];
    };
    let mut dest = primary.to_string();
    for f in &picked.fallbacks {
        dest.push(',');
        dest.push_str(f);
    }
    x.picked = Some(picked);
    gw.metrics
        .epp_picks
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (mutation, metadata) = protocol::pick_headers(&dest);
    let eos_at_headers = x.headers.as_ref().is_some_and(|h| h.end_of_stream);
    let mut out = Vec::new();
    if x.mode == Mode::Buffered && !eos_at_headers {
        let mut a = answer(Out::RequestBody(BodyResponse {
            response: Some(mutation),
        }));
        a.dynamic_metadata = Some(metadata);
        out.push(a);
    } else {
        let mut a = answer(Out::RequestHeaders(HeadersResponse {
            response: Some(mutation),
        }));
        a.dynamic_metadata = Some(metadata);
        out.push(a);
        if !eos_at_headers {
            // The body goes back as it came, in chunks Envoy takes.
            let mut chunks = body.chunks(protocol::CHUNK).peekable();
            if chunks.peek().is_none() {
                out.push(answer(Out::RequestBody(BodyResponse {
                    response: Some(streamed(Vec::new(), true)),
                })));
            }
            while let Some(c) = chunks.next() {
                out.push(answer(Out::RequestBody(BodyResponse {
                    response: Some(streamed(c.to_vec(), chunks.peek().is_none())),
                })));
            }
        }
    }
    // The body is the gateway's again: no longer held here.
    x.held = gw.bodies.hold();
    out
}
