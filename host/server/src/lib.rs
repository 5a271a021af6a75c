//! The HTTP front door: OpenAI-compatible routes, the proxy with failover, the admin API,
//! health and metrics.
//!
//! | route | does |
//! | --- | --- |
//! | `POST /v1/chat/completions`, `POST /v1/completions` | route by KV overlap and load, proxy to the chosen worker (streaming passed through), fail over on worker errors |
//! | `GET /v1/models` | the models discovery knows |
//! | `GET /health` | 200 while the process serves |
//! | `GET /ready` | 200 once discovery has answered and some endpoint has an available worker |
//! | `GET /metrics` | Prometheus text |
//! | `/admin/...` | bearer token; see [`admin`] |
//!
//! Must not know: etcd (endpoints come through [`Fleet`]), wasmtime (policies through
//! `PolicyHandle`).

pub mod admin;
pub mod body;
pub mod config;
pub mod epp;
pub mod error;
pub mod listen;
pub mod metrics;
pub mod proxy;
pub mod queue;
pub mod serve;
pub mod verdict;
pub mod write_deadline;

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::json;
use tokio::net::TcpListener;

pub use error::ApiError;
pub use metrics::Metrics;
use switchyard_bounded::slot::Slot;
use switchyard_discovery::EndpointPath;
use switchyard_router::KvRouter;
use switchyard_tokens::PrefixTokenizer;

/// Response bodies.
pub type Body = BoxBody<Bytes, std::io::Error>;

/// The endpoints the front door routes to. Implemented by `serve`, which owns discovery.
pub trait Fleet: Send + Sync + 'static {
    /// The router of the endpoint serving `model`, if any.
    fn router_for_model(&self, model: &str) -> Option<Arc<KvRouter>>;
    /// The router of `endpoint`, if it is known.
    fn router(&self, endpoint: &EndpointPath) -> Option<Arc<KvRouter>>;
    /// Every router created so far.
    fn routers(&self) -> Vec<Arc<KvRouter>>;
    /// Known models and their endpoints.
    fn models(&self) -> Vec<(String, EndpointPath)>;
    /// True once discovery has answered (with etcd: instances, and pushed policies
    /// reconciled).
    fn discovered(&self) -> bool;
    /// True when `model` was served recently but has no router now (its instances are
    /// gone): such requests get 503, not 404.
    fn model_known(&self, _model: &str) -> bool {
        false
    }
    /// The fleet's own counters for `/metrics`: name (without `switchyard_` and
    /// `_total`), help, value.
    fn counters(&self) -> Vec<(&'static str, &'static str, u64)> {
        Vec::new()
    }
}

/// Limits and behaviour of the front door.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    /// Most bytes of request bodies held at once (being read or kept for retries).
    pub max_body_bytes_total: usize,
    /// Longest prompt routed, in tokens; a longer one is refused (400) before anything
    /// is booked or predicted.
    pub max_prompt_tokens: usize,
    /// LoRA adapters the workers serve, by name, and the base model of each: a request
    /// naming one is routed among the base model's workers, on the blocks the engines
    /// key with the adapter's name.
    pub lora_adapters: std::collections::BTreeMap<String, String>,
    /// Largest request head (request line and headers).
    pub max_header_bytes: usize,
    /// Workers tried per request (the first plus retries).
    pub max_attempts: usize,
    /// Times one stream may be continued on another worker after it broke mid-answer
    /// (0: a broken stream ends with an error event).
    pub migration_limit: u32,
    /// Ask vLLM workers for token IDs on streams that may be migrated, so that a
    /// continuation is exact (the IDs are taken out of what the client gets).
    pub migration_token_ids: bool,
    /// How long a worker that left the fleet gracefully (deregistered) may go on
    /// streaming before its streams are moved to other workers.
    pub drain_grace: Duration,
    /// Timeout for connecting to a worker.
    pub connect_timeout: Duration,
    /// Timeout for a streaming response's head and first body bytes (its first token).
    pub first_byte_timeout: Duration,
    /// Timeout for a non-streaming response, which arrives whole at the end of the
    /// generation. Exceeding it gives the client 504 and is not retried.
    pub request_timeout: Duration,
    /// Longest silence between two chunks of a response that has started.
    pub stream_idle_timeout: Duration,
    /// How long a client connection may take to send a request head, and stay idle
    /// between requests (one timer in hyper: it restarts when the connection goes idle);
    /// also how long a request body may take to arrive whole, and how long a client may
    /// leave the router's writes unread before its connection is closed.
    pub client_idle_timeout: Duration,
    /// Most client connections open at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// Most completion requests in flight at once; more are answered 503.
    pub max_in_flight: usize,
    /// The admin API's bearer token; `None` disables the admin API.
    pub admin_token: Option<String>,
    /// The admin API is served on a listener of its own (`--admin-listen`), not on the
    /// public one.
    pub admin_listener: bool,
    /// Report failing workers down (the product); `false` only retries elsewhere and
    /// keeps routing to every discovered worker (a baseline for benchmarks).
    pub availability: bool,
    /// Classify failures (busy, poison, runs of 5xx; the product); `false` ejects a
    /// worker at its first failure of any kind, the rule before outlier detection (a
    /// baseline for benchmarks).
    pub outlier_detection: bool,
    /// The trust put in `https://` workers' certificates.
    pub tls: switchyard_net::upstream::Tls,
    /// The queue, classes and tenants past the fleet's capacity.
    pub overload: Arc<queue::classes::OverloadConfig>,
}

impl GatewayConfig {
    /// The model whose workers serve `model` (its base, for a LoRA adapter), and the
    /// adapter's name if it is one.
    pub fn served_by<'a>(&'a self, model: &'a str) -> (&'a str, Option<&'a str>) {
        match self.lora_adapters.get(model) {
            Some(base) => (base, Some(model)),
            None => (model, None),
        }
    }
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            max_body_bytes: 16 << 20,
            max_body_bytes_total: 1 << 30,
            max_prompt_tokens: 1 << 20,
            lora_adapters: Default::default(),
            max_header_bytes: 64 << 10,
            max_attempts: 3,
            migration_limit: 2,
            migration_token_ids: true,
            drain_grace: Duration::from_secs(20),
            connect_timeout: Duration::from_millis(1000),
            first_byte_timeout: Duration::from_secs(120),
            request_timeout: Duration::from_secs(600),
            stream_idle_timeout: Duration::from_secs(60),
            client_idle_timeout: Duration::from_secs(30),
            max_connections: 4096,
            max_in_flight: 2048,
            admin_token: None,
            admin_listener: false,
            availability: true,
            outlier_detection: true,
            tls: switchyard_net::upstream::Tls::default(),
            overload: Arc::default(),
        }
    }
}

/// The front door's state.
pub struct Gateway {
    pub(crate) config: GatewayConfig,
    pub(crate) fleet: Arc<dyn Fleet>,
    pub(crate) tokenizer: Arc<PrefixTokenizer>,
    pub(crate) http: HttpClient<switchyard_net::upstream::Connector, Full<Bytes>>,
    pub(crate) metrics: Metrics,
    draining: AtomicBool,
    /// Completion requests in flight (bounded by `max_in_flight`).
    in_flight: Arc<AtomicUsize>,
    /// Request bodies held (bounded by `max_body_bytes_total`).
    bodies: body::BodyBudget,
    /// Each endpoint's queue, made at its first saturated request.
    queues: parking_lot::Mutex<std::collections::HashMap<EndpointPath, Arc<queue::Queue>>>,
}

impl Gateway {
    /// A front door over `fleet`.
    pub fn new(
        config: GatewayConfig,
        fleet: Arc<dyn Fleet>,
        tokenizer: Arc<PrefixTokenizer>,
    ) -> Arc<Gateway> {
        let connector = config.tls.connector(config.connect_timeout);
        // Idle upstream connections are closed after 3 s: below the 5 s keep-alive of
        // uvicorn (vLLM, SGLang), so the router is not the one to reuse a connection the
        // worker is closing.
        let http = HttpClient::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(3))
            .pool_timer(hyper_util::rt::TokioTimer::new())
            .pool_max_idle_per_host(256)
            .build(connector);
        let bodies = body::BodyBudget::new(config.max_body_bytes_total);
        let gw = Arc::new(Gateway {
            config,
            fleet,
            tokenizer,
            http,
            metrics: Metrics::default(),
            draining: AtomicBool::new(false),
            in_flight: Arc::new(AtomicUsize::new(0)),
            bodies,
            queues: parking_lot::Mutex::default(),
        });
        // The admin page's trends: one point a second for as long as the gateway lives
        // (the task holds it weakly); and the queues of released routers let go.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let weak = Arc::downgrade(&gw);
            rt.spawn(async move {
                let mut every = tokio::time::interval(Duration::from_secs(1));
                every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    every.tick().await;
                    let Some(gw) = weak.upgrade() else { return };
                    let routers = gw.fleet.routers();
                    gw.metrics.trends.sample(&routers);
                    // Queues of routers let go of are dropped within a second.
                    gw.queues_among(&routers);
                }
            });
        }
        gw
    }

    /// The front door's counters.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// `router`'s queue (made on first use), or `None` when queueing is off.
    pub(crate) fn queue_for(&self, router: &Arc<KvRouter>) -> Option<Arc<queue::Queue>> {
        let overload = &self.config.overload;
        if overload.queue_max == 0 {
            return None;
        }
        let mut queues = self.queues.lock();
        let q = queues.entry(router.endpoint().clone()).or_insert_with(|| {
            queue::Queue::start(router.clone(), overload.clone(), self.queue_waits(router))
        });
        if !Arc::ptr_eq(q.router(), router) {
            // The endpoint's router was made anew (its workers left and came back).
            *q = queue::Queue::start(router.clone(), overload.clone(), self.queue_waits(router));
        }
        Some(q.clone())
    }

    /// Every endpoint's queue. Queues of routers the fleet let go of are dropped here,
    /// with their metrics series (requests still waiting in one keep it alive until they
    /// leave).
    pub fn queues(&self) -> Vec<(EndpointPath, Arc<queue::Queue>)> {
        self.queues_among(&self.fleet.routers())
    }

    /// [`Gateway::queues`], the fleet's routers being `live`.
    fn queues_among(&self, live: &[Arc<KvRouter>]) -> Vec<(EndpointPath, Arc<queue::Queue>)> {
        let mut queues = self.queues.lock();
        queues.retain(|endpoint, q| {
            let keep = live.iter().any(|r| Arc::ptr_eq(r, q.router()));
            if !keep {
                self.metrics
                    .timings
                    .forget_queue(&endpoint.to_string(), q.classes());
            }
            keep
        });
        queues.iter().map(|(e, q)| (e.clone(), q.clone())).collect()
    }

    fn queue_waits(
        &self,
        router: &KvRouter,
    ) -> Vec<prometheus_client::metrics::histogram::Histogram> {
        let endpoint = router.endpoint().to_string();
        self.config
            .overload
            .classes
            .iter()
            .map(|c| self.metrics.timings.queue_wait(&endpoint, &c.name))
            .collect()
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>, role: Listener) -> Response<Body> {
        let path = req.uri().path().to_string();
        let admin_here = match role {
            Listener::Public => !self.config.admin_listener,
            Listener::Admin => true,
        };
        let response = match (req.method(), path.as_str()) {
            (_, p) if p.starts_with("/admin/") && !admin_here => Err(ApiError::NotFound(
                "the admin API is served on the admin listener (--admin-listen), not here".into(),
            )),
            (m, p)
                if role == Listener::Admin
                    && !p.starts_with("/admin/")
                    && p != "/metrics"
                    && p != "/health" =>
            {
                Err(ApiError::NotFound(format!(
                    "{m} {p}: the admin listener serves /admin/, /metrics and /health only"
                )))
            }
            (&Method::POST, "/v1/chat/completions") => {
                self.admit(switchyard_tokens::openai::Api::Chat, req).await
            }
            (&Method::POST, "/v1/completions") => {
                self.admit(switchyard_tokens::openai::Api::Completions, req)
                    .await
            }
            (&Method::GET, "/v1/models") => Ok(self.models()),
            (&Method::GET, "/health") => {
                Ok(json_response(StatusCode::OK, &json!({"status": "ok"})))
            }
            (&Method::GET, "/ready") => Ok(self.ready()),
            (&Method::GET, "/metrics") => {
                let routers = self.fleet.routers();
                Ok(text_response(
                    StatusCode::OK,
                    prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
                    self.metrics.render(
                        &routers,
                        self.tokenizer.stats(),
                        self.fleet.counters(),
                        self.queues_among(&routers),
                        self.bodies.held(),
                    ),
                ))
            }
            (_, p) if p.starts_with("/admin/") => admin::handle(&self, req).await,
            (m, p) => Err(ApiError::NotFound(format!("{m} {p}"))),
        };
        let response = response.unwrap_or_else(|e| e.response());
        if path.starts_with("/v1/") {
            self.metrics.count_status(response.status().as_u16());
        }
        response
    }

    /// A completion request, if the router has room for it. The body is read whole
    /// first (under the client timeout and the body budget, [`body`]); only then is an
    /// in-flight slot taken, held until the response body ends (streams included).
    async fn admit(
        self: &Arc<Self>,
        api: switchyard_tokens::openai::Api,
        req: Request<Incoming>,
    ) -> Result<Response<Body>, ApiError> {
        let started = std::time::Instant::now();
        let (parts, incoming) = req.into_parts();
        let (bytes, held) = match body::read(incoming, &self.bodies, self.body_limits()).await {
            Ok(b) => b,
            Err(e) => {
                if matches!(e, ApiError::BodyTimeout(_) | ApiError::Overloaded(_)) {
                    self.metrics.shed.fetch_add(1, Ordering::Relaxed);
                }
                return Err(e);
            }
        };
        let slot = self.in_flight_slot()?;
        // A request waiting in an endpoint's queue gives its slot back meanwhile (the
        // queue's own limits bound it) and takes one again when placed.
        let mut slot = Some(slot);
        let response = proxy::completion(self, api, &parts, bytes, started, &mut slot).await?;
        let (parts, body) = response.into_parts();
        Ok(Response::from_parts(
            parts,
            Guarded {
                body,
                _slot: slot,
                _body: held,
            }
            .boxed(),
        ))
    }

    fn models(&self) -> Response<Body> {
        let models = self.fleet.models();
        let mut data: Vec<_> = models
            .iter()
            .map(|(model, endpoint)| {
                json!({"id": model, "object": "model", "created": 0, "owned_by": "switchyard", "endpoint": endpoint.to_string()})
            })
            .collect();
        // An adapter is listed with its base model (`parent`, as vLLM lists it).
        for (adapter, base) in &self.config.lora_adapters {
            if let Some((_, endpoint)) = models.iter().find(|(m, _)| m == base) {
                data.push(json!({"id": adapter, "object": "model", "created": 0, "owned_by": "switchyard", "parent": base, "endpoint": endpoint.to_string()}));
            }
        }
        json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
    }

    /// What a request body is read under: the per-request limit, the budget of bodies
    /// held, the client timeout (the endpoint picker's request phase too).
    pub(crate) fn body_limits(&self) -> body::Limits {
        body::Limits {
            max: self.config.max_body_bytes,
            deadline: self.config.client_idle_timeout,
        }
    }

    /// A slot of `--max-in-flight`, for a request the front door or the endpoint picker
    /// takes on; past the bound the request is shed (503 at the front door, 429 to a
    /// gateway).
    pub(crate) fn in_flight_slot(&self) -> Result<Slot, ApiError> {
        Slot::take(&self.in_flight, self.config.max_in_flight).ok_or_else(|| {
            self.metrics.shed.fetch_add(1, Ordering::Relaxed);
            ApiError::Overloaded(format!("{} requests in flight", self.config.max_in_flight))
        })
    }

    /// Whether `/ready` would answer 200.
    pub fn is_ready(&self) -> bool {
        self.readiness(true).is_ok()
    }

    /// The endpoint picker's readiness: `/ready`'s but for full queues. A gateway asks one
    /// picker for every model, and a full queue is one model's: the picker sheds that
    /// model's requests itself (429), where a picker reported unready would fail every
    /// model closed, or open to the gateway's own balancing, past overload protection.
    pub fn is_serving(&self) -> bool {
        self.readiness(false).is_ok()
    }

    fn ready(&self) -> Response<Body> {
        match self.readiness(true) {
            Ok(v) => json_response(StatusCode::OK, &v),
            Err(why) => json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &json!({"ready": false, "why": why}),
            ),
        }
    }

    /// Ready (and what it serves), or why not; a full queue counts with `queues`.
    fn readiness(&self, queues: bool) -> Result<serde_json::Value, String> {
        if self.draining.load(Ordering::Relaxed) {
            return Err("shutting down".into());
        }
        if !self.fleet.discovered() {
            return Err("discovery (instances and pushed policies) has not answered yet".into());
        }
        let models = self.fleet.models();
        let available = models
            .iter()
            .filter(|(m, _)| {
                self.fleet
                    .router_for_model(m)
                    .is_some_and(|r| !r.client().available().is_empty())
            })
            .count();
        if available == 0 {
            return Err("no available worker".into());
        }
        // A replica whose queue is full refuses what it is sent: let the balancer in
        // front send elsewhere.
        if queues && let Some((endpoint, _)) = self.queues().into_iter().find(|(_, q)| q.is_full())
        {
            return Err(format!(
                "the queue of {endpoint} is full: every worker is saturated"
            ));
        }
        Ok(json!({"ready": true, "models": models.len(), "models_with_workers": available}))
    }
}

pub(crate) fn json_response(status: StatusCode, v: &serde_json::Value) -> Response<Body> {
    text_response(status, "application/json", v.to_string())
}

/// A complete body from text.
pub(crate) fn full_body(body: String) -> Body {
    Full::new(Bytes::from(body)).map_err(|e| match e {}).boxed()
}

pub(crate) fn text_response(
    status: StatusCode,
    content_type: &str,
    body: String,
) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(full_body(body))
        .expect("valid response")
}

/// Which listener a connection came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    /// The clients' listener: the OpenAI API, health, metrics, and the admin API unless
    /// it has a listener of its own.
    Public,
    /// The admin listener (`--admin-listen`): the admin API, metrics and health only.
    Admin,
}

/// Serves `gateway` on `listener` until `shutdown` resolves; then stops accepting and
/// lets open requests (streams included) finish for up to `grace`.
pub async fn run(
    gateway: Arc<Gateway>,
    listener: TcpListener,
    role: Listener,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let connections = Arc::new(AtomicUsize::new(0));
    let refusing = Arc::new(AtomicUsize::new(0));
    let mut accept_backoff = Duration::from_millis(5);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning; the pending
                        // connections wait in the backlog.
                        gateway.metrics.accept_errors.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(error = %e, retry_in = ?accept_backoff, "accept failed");
                        tokio::select! {
                            _ = tokio::time::sleep(accept_backoff) => {}
                            _ = &mut shutdown => break,
                        }
                        accept_backoff = (accept_backoff * 2).min(Duration::from_secs(1));
                        continue;
                    }
                };
                accept_backoff = Duration::from_millis(5);
                let limits = (gateway.config.max_connections, gateway.config.client_idle_timeout);
                let stream = match listen::harden(stream, &connections, limits.0, limits.1) {
                    Ok(s) => s,
                    Err(stream) => {
                        gateway.metrics.refused_connections.fetch_add(1, Ordering::Relaxed);
                        // Answered 503 by at most REFUSING tasks at once; past them the
                        // connection is closed unanswered (each task holds a descriptor).
                        if let Some(refusing) = Slot::take(&refusing, REFUSING) {
                            tokio::spawn(async move {
                                refuse_connection(stream).await;
                                drop(refusing);
                            });
                        }
                        continue;
                    }
                };
                let gw = gateway.clone();
                let service = service_fn(move |req| {
                    let gw = gw.clone();
                    async move { Ok::<_, Infallible>(gw.handle(req, role).await) }
                });
                let conn = http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(gateway.config.client_idle_timeout)
                    .max_buf_size(gateway.config.max_header_bytes.max(8192))
                    .serve_connection(TokioIo::new(stream), service);
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    let _ = conn.await;
                });
            }
            _ = &mut shutdown => break,
        }
    }
    drop(listener);
    gateway.draining.store(true, Ordering::Relaxed);
    tracing::info!(grace = ?grace, "shutting down: finishing open requests");
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("open requests did not finish within the grace period");
    }
}

/// Connections over the limit answered at once; more are closed unanswered.
const REFUSING: usize = 256;

/// A response body that holds an in-flight slot, and its request body's share of the
/// body budget, until it ends or is dropped.
struct Guarded {
    body: Body,
    _slot: Option<Slot>,
    _body: body::Held,
}

impl hyper::body::Body for Guarded {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, std::io::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// Answers a connection over the limit with 503 and closes it. The request head is read
/// first (briefly): closing a socket with unread data would reset the connection and
/// lose the answer.
async fn refuse_connection(mut stream: tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_millis(200), async {
        while head.len() < 64 << 10 && !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    let body = switchyard_tokens::openai::error_body(
        "the router is at its connection limit",
        "server_error",
        None,
        Some("router_overloaded"),
    );
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let write = async {
        stream.write_all(answer.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
}
