//! The mock worker's HTTP server.
//!
//! | route | does |
//! | --- | --- |
//! | `POST /v1/completions`, `POST /v1/chat/completions` | OpenAI-compatible, streaming (SSE) or not; `usage.prompt_tokens_details.cached_tokens` reports the prefix found in the cache |
//! | `GET /v1/models` | the one model served |
//! | `GET /health` | 200 when serving; 503 while a fault is active |
//! | `GET /v1/kv_events` | the KV event stream (`docs/kv-events.md`) |
//! | `GET /metrics` | load in vLLM's Prometheus names (`vllm:num_requests_running`, …) |
//! | `GET /stats` | the engine's step accounting |
//! | `GET /get_server_info`, `/server_info` | model, KV block size (`page_size`, `block_size`), cache size, batch limit |
//! | `GET /get_model_info`, `/model_info`, `/version` | what routers probe at start |
//! | `GET /v1/loads`, `/get_load` | running and waiting requests, KV usage |
//! | `POST /tokenize`, `POST /v1/chat/completions/render` | vLLM's: the worker's own token IDs for a prompt or chat |
//! | `POST /admin/fault` | a [`FaultConfig`] as JSON: `{"fault": "crash" \| "hang" \| "refuse" \| "error" \| "status" \| "stall" \| "cut_stream" \| "none", "after": N, "status": 503, "retry_after_secs": 2, "marker": "POISON", "health_lies": true, "first_token_delay_ms": 500, "idle_close_ms": 1000}` (all but `fault` optional) |

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

use super::engine::{Engine, EngineConfig, Output};
use switchyard_discovery::{EndpointPath, InstanceInfo};
use switchyard_ids::InstanceId;
use switchyard_kv::events::KvEvent;
use switchyard_kv::hash::BlockHasher;
use switchyard_tokens::openai::{self, Api, Prompt};
use switchyard_tokens::prefix::DEFAULT_BUDGET_TOKENS;
use switchyard_tokens::{PrefixTokenizer, Tokenizer};

type Body = BoxBody<Bytes, std::io::Error>;

/// An injected fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// Behave.
    None,
    /// Exit the process at once.
    Crash,
    /// Accept requests and never answer.
    Hang,
    /// Close the listening socket: connections are refused.
    Refuse,
    /// Answer every completion with HTTP 500.
    Error,
    /// Cut streaming responses half-way.
    CutStream,
    /// Answer every completion with `status` (default 500), with `Retry-After` when
    /// `retry_after_secs` is set (e.g. 503 or 429: load shedding).
    Status,
    /// Send the first chunk of a stream, then nothing (a non-streaming request hangs);
    /// health still answers 200.
    Stall,
}

/// A fault and when it starts, plus faults that apply to some requests or connections.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct FaultConfig {
    /// The fault.
    pub fault: Fault,
    /// It starts after this many completion requests were served.
    #[serde(default)]
    pub after: u64,
    /// The status of [`Fault::Status`] and of marked prompts [default: 500].
    #[serde(default)]
    pub status: Option<u16>,
    /// A `Retry-After` (seconds) on those answers. Any number, written as Rust prints
    /// it: a faithful engine sends whole seconds, a broken one anything (`1e20` is
    /// written `100000000000000000000`).
    #[serde(default)]
    pub retry_after_secs: Option<f64>,
    /// Prompts containing this text are answered `status` (a "poison" request), whatever
    /// the fault.
    #[serde(default)]
    pub marker: Option<String>,
    /// `/health` answers 200 whatever the fault.
    #[serde(default)]
    pub health_lies: bool,
    /// Every completion waits this long before it starts (a slow first token).
    #[serde(default)]
    pub first_token_delay_ms: u64,
    /// Keep-alive connections idle this long are closed (as uvicorn does after 5 s).
    #[serde(default)]
    pub idle_close_ms: Option<u64>,
}

impl FaultConfig {
    /// No fault.
    pub const NONE: FaultConfig = FaultConfig {
        fault: Fault::None,
        after: 0,
        status: None,
        retry_after_secs: None,
        marker: None,
        health_lies: false,
        first_token_delay_ms: 0,
        idle_close_ms: None,
    };

    /// The answer of [`Fault::Status`] and of marked prompts.
    fn status_answer(&self, message: &str) -> Response<Body> {
        let status = self
            .status
            .and_then(|s| StatusCode::from_u16(s).ok())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut r = error(
            status,
            message,
            "server_error",
            None,
            Some("injected_fault"),
        );
        if let Some(secs) = self.retry_after_secs
            && let Ok(v) = hyper::header::HeaderValue::from_str(&secs.to_string())
        {
            r.headers_mut().insert(hyper::header::RETRY_AFTER, v);
        }
        r
    }
}

/// One mock worker.
#[derive(Debug, Clone)]
pub struct MockWorkerConfig {
    /// The model name it serves.
    pub model: String,
    /// Engine shape and timing.
    pub engine: EngineConfig,
    /// Seed of the block hash chain (must match the router's).
    pub hash_seed: u64,
    /// Injected fault.
    pub fault: FaultConfig,
    /// The tokenizer for text and chat prompts (`None`: the built-in one).
    pub tokenizer: Option<Arc<Tokenizer>>,
    /// Publish KV events over ZMQ in vLLM's format too (the NDJSON stream at
    /// `/v1/kv_events` is always served).
    pub zmq_events: Option<super::zmq::ZmqEventsConfig>,
    /// Serve HTTPS with this certificate instead of plain HTTP.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// How chats become prompts (`None`: ChatML), as the engine's chat template does.
    pub chat: Option<Arc<switchyard_tokens::ChatFormat>>,
    /// Completions need `Authorization: Bearer <key>`, as with vLLM's `--api-key`.
    pub api_key: Option<String>,
}

/// A server TLS configuration from PEM files: the certificate chain and its private key
/// (what vLLM's `--ssl-certfile` and `--ssl-keyfile` take).
pub fn server_tls(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<Arc<rustls::ServerConfig>, String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("certificate file {}: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!(
            "certificate file {} holds no certificate",
            cert.display()
        ));
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| format!("key file {}: {e}", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| format!("certificate and key: {e}"))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// How long a client may take over its TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

struct Shared {
    model: String,
    engine: Arc<Engine>,
    /// The engine's tokenizer, reusing a conversation's earlier tokens (the simulated
    /// engine's own CPU time is not what it models, and benchmarks share the cores).
    tokenizer: PrefixTokenizer,
    hasher: BlockHasher,
    fault: Mutex<FaultConfig>,
    /// Completion requests received.
    served: AtomicU64,
    /// Tells the accept loop to stop accepting (true) or resume (false).
    refuse: watch::Sender<bool>,
    /// The ZMQ KV event publisher, if any.
    zmq: Option<(super::zmq::ZmqPublisher, String)>,
    /// HTTPS, if served.
    tls: Option<tokio_rustls::TlsAcceptor>,
    /// The key completions need, if any.
    api_key: Option<String>,
}

impl Shared {
    /// The fault in force for the next request, counting it.
    fn fault_for_request(&self) -> (Fault, FaultConfig) {
        let n = self.served.fetch_add(1, Ordering::SeqCst);
        let f = self.fault.lock().clone();
        let fault = if n >= f.after { f.fault } else { Fault::None };
        (fault, f)
    }

    fn active_fault(&self) -> Fault {
        let f = self.fault.lock();
        if self.served.load(Ordering::SeqCst) >= f.after {
            f.fault
        } else {
            Fault::None
        }
    }

    fn set_fault(&self, f: FaultConfig) {
        *self.fault.lock() = f;
        self.update_refuse();
    }

    fn update_refuse(&self) {
        self.refuse
            .send_replace(self.active_fault() == Fault::Refuse);
    }
}

/// A running mock worker.
pub struct MockWorker {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl MockWorker {
    /// Starts serving on `listener`.
    pub fn start(config: MockWorkerConfig, listener: TcpListener) -> std::io::Result<MockWorker> {
        let addr = listener.local_addr()?;
        let (refuse, refuse_rx) = watch::channel(false);
        let block_size = config.engine.block_size;
        let engine = Engine::start(config.engine);
        let zmq = match &config.zmq_events {
            Some(z) => Some((
                super::zmq::start(z, engine.subscribe().1, block_size)?,
                z.topic.clone(),
            )),
            None => None,
        };
        let shared = Arc::new(Shared {
            model: config.model,
            hasher: BlockHasher::new(block_size, config.hash_seed),
            engine,
            zmq,
            tokenizer: PrefixTokenizer::new(
                config
                    .tokenizer
                    .unwrap_or_else(|| Arc::new(Tokenizer::builtin())),
                DEFAULT_BUDGET_TOKENS,
            )
            .with_chat(
                config
                    .chat
                    .unwrap_or_else(|| Arc::new(switchyard_tokens::ChatFormat::ChatMl)),
            ),
            fault: Mutex::new(config.fault),
            served: AtomicU64::new(0),
            refuse,
            tls: config.tls.map(tokio_rustls::TlsAcceptor::from),
            api_key: config.api_key,
        });
        shared.update_refuse();
        let (shutdown, shutdown_rx) = watch::channel(false);
        let task = tokio::spawn(accept_loop(
            listener,
            addr,
            shared.clone(),
            refuse_rx,
            shutdown_rx,
        ));
        Ok(MockWorker {
            addr,
            shared,
            shutdown,
            task,
        })
    }

    /// Binds `addr` and starts.
    pub async fn bind(config: MockWorkerConfig, addr: SocketAddr) -> std::io::Result<MockWorker> {
        MockWorker::start(config, TcpListener::bind(addr).await?)
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://{addr}`, or `https://localhost:{port}` when it serves HTTPS on a
    /// loopback address (the name its certificate is for, typically).
    pub fn url(&self) -> String {
        match &self.shared.tls {
            None => format!("http://{}", self.addr),
            Some(_) if self.addr.ip().is_loopback() => {
                format!("https://localhost:{}", self.addr.port())
            }
            Some(_) => format!("https://{}", self.addr),
        }
    }

    /// What to register in discovery for this worker.
    pub fn instance_info(&self, id: InstanceId, endpoint: EndpointPath) -> InstanceInfo {
        InstanceInfo {
            id,
            endpoint,
            url: self.url(),
            model: self.shared.model.clone(),
            block_size: self.shared.engine.config().block_size,
            events_url: self
                .shared
                .zmq
                .is_none()
                .then(|| format!("{}/v1/kv_events", self.url())),
            engine_events: self.engine_events().map(Arc::new),
            health_path: "/health".into(),
            registration: 0,
        }
    }

    /// Where the ZMQ KV events are published, if they are (an unspecified bind address
    /// is given as this worker's HTTP host).
    pub fn engine_events(&self) -> Option<switchyard_discovery::EngineEventSource> {
        let (z, topic) = self.shared.zmq.as_ref()?;
        let host = |a: SocketAddr| {
            let ip = if a.ip().is_unspecified() {
                self.addr.ip()
            } else {
                a.ip()
            };
            let ip = if ip.is_unspecified() {
                std::net::IpAddr::from([127, 0, 0, 1])
            } else {
                ip
            };
            format!("tcp://{}", SocketAddr::new(ip, a.port()))
        };
        Some(switchyard_discovery::EngineEventSource {
            endpoint: host(z.publish),
            replay: z.replay.map(host),
            topic: topic.clone(),
            data_parallel_size: 1,
        })
    }

    /// Injects (or clears, with [`Fault::None`]) a fault at run time.
    pub fn set_fault(&self, fault: FaultConfig) {
        self.shared.set_fault(fault);
    }

    /// The engine's step accounting.
    pub fn stats(&self) -> super::EngineStats {
        self.shared.engine.stats()
    }

    /// Stops accepting and waits for the accept loop to end (open connections finish on
    /// their own tasks).
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        let _ = self.task.await;
    }
}

async fn accept_loop(
    mut listener: TcpListener,
    addr: SocketAddr,
    shared: Arc<Shared>,
    mut refuse: watch::Receiver<bool>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        if *refuse.borrow_and_update() {
            // Close the socket so connections are refused, until the fault is cleared.
            drop(listener);
            tokio::select! {
                r = refuse.wait_for(|r| !*r) => if r.is_err() { return },
                _ = shutdown.changed() => return,
            }
            listener = loop {
                match TcpListener::bind(addr).await {
                    Ok(l) => break l,
                    Err(e) => {
                        tracing::warn!(%addr, error = %e, "cannot listen again yet");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            };
            continue;
        }
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let shared = shared.clone();
                let idle_close = shared.fault.lock().idle_close_ms.map(Duration::from_millis);
                let shared_tls = shared.tls.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| {
                        let shared = shared.clone();
                        async move { Ok::<_, Infallible>(route(shared, req).await) }
                    });
                    let mut builder = http1::Builder::new();
                    if let Some(idle) = idle_close {
                        // hyper's header timer also runs while a connection is idle.
                        builder.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(idle);
                    }
                    match &shared_tls {
                        None => {
                            let _ = builder.serve_connection(TokioIo::new(stream), service).await;
                        }
                        Some(acceptor) => {
                            let handshake = tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream));
                            let Ok(Ok(stream)) = handshake.await else { return };
                            let _ = builder.serve_connection(TokioIo::new(stream), service).await;
                        }
                    }
                });
            }
            _ = refuse.changed() => {}
            _ = shutdown.changed() => return,
        }
    }
}

fn full(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(body.into()).map_err(|e| match e {}).boxed())
        .expect("valid response")
}

fn json_response(status: StatusCode, v: serde_json::Value) -> Response<Body> {
    full(status, "application/json", v.to_string())
}

fn error(
    status: StatusCode,
    message: &str,
    kind: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> Response<Body> {
    full(
        status,
        "application/json",
        openai::error_body(message, kind, param, code),
    )
}

async fn route(shared: Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    if let Some(key) = &shared.api_key
        && matches!(req.uri().path(), "/v1/completions" | "/v1/chat/completions")
        && req
            .headers()
            .get(hyper::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            != Some(key.as_str())
    {
        // vLLM's answer to a missing or wrong key.
        return json_response(StatusCode::UNAUTHORIZED, json!({"error": "Unauthorized"}));
    }
    match (req.method(), req.uri().path()) {
        (&Method::POST, "/v1/completions") => completion(shared, Api::Completions, req).await,
        (&Method::POST, "/v1/chat/completions") => completion(shared, Api::Chat, req).await,
        (&Method::GET, "/v1/models") => json_response(
            StatusCode::OK,
            // Its context is what its cache holds, as the engine refuses longer requests.
            json!({"object": "list", "data": [{"id": shared.model, "object": "model", "created": 0, "owned_by": "switchyard-mock", "max_model_len": shared.engine.config().capacity_tokens()}]}),
        ),
        (&Method::GET, "/health") => match shared.active_fault() {
            _ if shared.fault.lock().health_lies => {
                json_response(StatusCode::OK, json!({"status": "ok"}))
            }
            Fault::None | Fault::CutStream | Fault::Stall => {
                json_response(StatusCode::OK, json!({"status": "ok"}))
            }
            // Shedding load (429/503) is not being unhealthy.
            Fault::Status if matches!(shared.fault.lock().status, Some(429 | 503)) => {
                json_response(StatusCode::OK, json!({"status": "ok", "shedding": true}))
            }
            Fault::Hang => std::future::pending().await,
            f => json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"status": "faulty", "fault": format!("{f:?}")}),
            ),
        },
        (&Method::GET, "/v1/kv_events") => kv_events(&shared),
        (&Method::GET, "/metrics") => engine_metrics(&shared),
        (&Method::GET, "/get_server_info" | "/server_info") => {
            json_response(StatusCode::OK, server_info(&shared))
        }
        (&Method::GET, "/get_model_info" | "/model_info") => json_response(
            StatusCode::OK,
            json!({"model_path": shared.model, "tokenizer_path": null, "is_generation": true}),
        ),
        (&Method::GET, "/version") => json_response(
            StatusCode::OK,
            json!({"version": env!("CARGO_PKG_VERSION")}),
        ),
        (&Method::GET, "/v1/loads" | "/get_load") => {
            let s = shared.engine.stats();
            json_response(
                StatusCode::OK,
                json!({
                    "num_reqs": s.running + s.waiting,
                    "num_running_reqs": s.running,
                    "num_waiting_reqs": s.waiting,
                    "num_used_blocks": s.kv_used_blocks,
                    "num_total_blocks": s.kv_total_blocks,
                    "token_usage": if s.kv_total_blocks == 0 { 0.0 } else { s.kv_used_blocks as f64 / s.kv_total_blocks as f64 },
                }),
            )
        }
        (&Method::POST, "/tokenize") => tokenize(&shared, req, false).await,
        (&Method::POST, "/v1/chat/completions/render") => tokenize(&shared, req, true).await,
        (&Method::GET, "/stats") => json_response(
            StatusCode::OK,
            serde_json::to_value(shared.engine.stats()).expect("stats serialise"),
        ),
        (&Method::POST, "/admin/fault") => {
            let body = match Limited::new(req.into_body(), 4096).collect().await {
                Ok(b) => b.to_bytes(),
                Err(_) => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "body too large",
                        "invalid_request_error",
                        None,
                        None,
                    );
                }
            };
            match serde_json::from_slice::<FaultConfig>(&body) {
                Ok(f) => {
                    let answer = json!({"fault": format!("{:?}", f.fault), "after": f.after});
                    shared.set_fault(f);
                    json_response(StatusCode::OK, answer)
                }
                Err(e) => error(
                    StatusCode::BAD_REQUEST,
                    &format!("bad fault: {e}"),
                    "invalid_request_error",
                    None,
                    None,
                ),
            }
        }
        _ => {
            // Read the body before answering: a client that is still sending it would
            // otherwise see its connection closed unannounced, and a pooled client's next
            // request on it would fail.
            let path = req.uri().path().to_string();
            let drained = read_body(req).await.is_ok();
            let mut answer = error(
                StatusCode::NOT_FOUND,
                &format!("no such route: {path}"),
                "invalid_request_error",
                None,
                Some("not_found"),
            );
            if !drained {
                answer.headers_mut().insert(
                    hyper::header::CONNECTION,
                    hyper::header::HeaderValue::from_static("close"),
                );
            }
            answer
        }
    }
}

/// What SGLang's `/get_server_info` and vLLM-style routers read: the model, the KV block
/// size under the names each uses, the cache size and the batch limit.
fn server_info(shared: &Shared) -> serde_json::Value {
    let c = shared.engine.config();
    json!({
        "model_path": shared.model,
        "served_model_name": shared.model,
        "page_size": c.block_size,
        "block_size": c.block_size,
        "kv_block_size": c.block_size,
        "max_total_num_tokens": c.capacity_tokens(),
        "max_running_requests": c.max_batch,
        "tp_size": 1,
        "dp_size": 1,
        "version": env!("CARGO_PKG_VERSION"),
    })
}

/// A request's body, or the 413 answer when it exceeds `MAX_BODY`.
async fn read_body(req: Request<Incoming>) -> Result<Bytes, Response<Body>> {
    match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(_) => Err(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request body too large",
            "invalid_request_error",
            None,
            None,
        )),
    }
}

/// vLLM's `/tokenize` (a `prompt` or chat `messages`) and `/v1/chat/completions/render`
/// (chat `messages`, answered with the rendered prompt and its tokens), with the same
/// tokenizer and chat rendering the engine uses, so a router that asks gets exactly the
/// worker's token IDs.
async fn tokenize(shared: &Shared, req: Request<Incoming>, render: bool) -> Response<Body> {
    let bad = |m: &str| {
        error(
            StatusCode::BAD_REQUEST,
            m,
            "invalid_request_error",
            None,
            None,
        )
    };
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(too_large) => return too_large,
    };
    let Ok(serde_json::Value::Object(mut obj)) = serde_json::from_slice(&body) else {
        return bad("request body must be a JSON object");
    };
    obj.entry("model")
        .or_insert_with(|| serde_json::Value::String(shared.model.clone()));
    let api = if obj.contains_key("messages") {
        Api::Chat
    } else {
        Api::Completions
    };
    if render && api != Api::Chat {
        return bad("`messages` is required");
    }
    let body = serde_json::Value::Object(obj).to_string();
    let parsed = match openai::parse(api, body.as_bytes()) {
        Ok(p) => p,
        Err(e) => return bad(&e.message),
    };
    let (text, tokens) = match &parsed.prompt {
        Prompt::Tokens(t) => (None, Ok(t.clone())),
        Prompt::Text(t) => (Some(t.clone()), shared.tokenizer.encode(t)),
        Prompt::Chat(m) => match shared.tokenizer.render_chat(m) {
            Ok(text) => {
                let tokens = shared.tokenizer.encode(&text);
                (Some(text), tokens)
            }
            Err(e) => (None, Err(e)),
        },
    };
    let tokens = match tokens {
        Ok(t) => t,
        Err(e) => return bad(&e.to_string()),
    };
    let max_model_len = shared.engine.config().capacity_tokens();
    if render {
        json_response(
            StatusCode::OK,
            json!({"prompt": text, "prompt_token_ids": tokens, "count": tokens.len()}),
        )
    } else {
        json_response(
            StatusCode::OK,
            json!({"count": tokens.len(), "max_model_len": max_model_len, "tokens": tokens}),
        )
    }
}

/// Load in vLLM's own Prometheus names, as a router scrapes them from a vLLM server.
fn engine_metrics(shared: &Shared) -> Response<Body> {
    let s = shared.engine.stats();
    let m = &shared.model;
    let usage = if s.kv_total_blocks == 0 {
        0.0
    } else {
        s.kv_used_blocks as f64 / s.kv_total_blocks as f64
    };
    let page = format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"{m}\"}} {}\n\
         # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"{m}\"}} {}\n\
         # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"{m}\"}} {usage}\n\
         # HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"{}\",engine=\"0\",num_gpu_blocks=\"{}\",enable_prefix_caching=\"True\"}} 1.0\n",
        s.running,
        s.waiting,
        shared.hasher.block_size(),
        s.kv_total_blocks,
    );
    full(StatusCode::OK, "text/plain; version=0.0.4", page)
}

/// The KV event stream: snapshot, then every event, plus a load report each second.
fn kv_events(shared: &Arc<Shared>) -> Response<Body> {
    let (snapshot, mut events) = shared.engine.subscribe();
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(64);
    let engine = shared.engine.clone();
    tokio::spawn(async move {
        if tx
            .send(Ok(Frame::data(Bytes::from(snapshot.to_line()))))
            .await
            .is_err()
        {
            return;
        }
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            let line = tokio::select! {
                e = events.recv() => match e {
                    Ok(e) => e.to_wire().to_line(),
                    // Lagged or closed: end the stream; the subscriber resubscribes and
                    // gets a fresh snapshot.
                    Err(_) => return,
                },
                _ = tick.tick() => {
                    let s = engine.stats();
                    KvEvent::Load {
                        kv_used_blocks: s.kv_used_blocks,
                        kv_total_blocks: s.kv_total_blocks,
                        running: s.running as u32,
                        waiting: s.waiting as u32,
                    }
                    .to_line()
                }
            };
            if tx.send(Ok(Frame::data(Bytes::from(line)))).await.is_err() {
                return;
            }
        }
    });
    Response::builder()
        .header("content-type", "application/x-ndjson")
        .body(StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed())
        .expect("valid response")
}

/// Deterministic filler text for generated token `i`.
fn filler(i: u32) -> &'static str {
    const WORDS: [&str; 8] = [
        "lorem ",
        "ipsum ",
        "dolor ",
        "sit ",
        "amet ",
        "consectetur ",
        "adipiscing ",
        "elit ",
    ];
    WORDS[i as usize % WORDS.len()]
}

const MAX_BODY: usize = 32 << 20;

async fn completion(shared: Arc<Shared>, api: Api, req: Request<Incoming>) -> Response<Body> {
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(too_large) => return too_large,
    };
    let parsed = match openai::parse(api, &body) {
        Ok(p) => p,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &e.message,
                "invalid_request_error",
                e.param.as_deref(),
                None,
            );
        }
    };
    if parsed.model != shared.model {
        return error(
            StatusCode::NOT_FOUND,
            &format!(
                "The model `{}` does not exist (this worker serves `{}`)",
                parsed.model, shared.model
            ),
            "invalid_request_error",
            Some("model"),
            Some("model_not_found"),
        );
    }
    let (fault, faults) = shared.fault_for_request();
    shared.update_refuse();
    if let Some(marker) = faults.marker.as_deref()
        && !marker.is_empty()
        && body.windows(marker.len()).any(|w| w == marker.as_bytes())
    {
        return faults.status_answer("injected fault: this prompt fails on every worker");
    }
    if faults.first_token_delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(faults.first_token_delay_ms)).await;
    }
    match fault {
        Fault::Crash => {
            tracing::error!("fault injection: crashing");
            std::process::exit(3);
        }
        Fault::Hang => return std::future::pending().await,
        Fault::Error | Fault::Refuse => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "injected fault",
                "server_error",
                None,
                Some("injected_fault"),
            );
        }
        Fault::Status => return faults.status_answer("injected fault"),
        Fault::Stall if !parsed.stream => return std::future::pending().await,
        Fault::None | Fault::CutStream | Fault::Stall => {}
    }
    let tokens = match &parsed.prompt {
        Prompt::Tokens(t) => Ok(t.clone()),
        Prompt::Text(t) => shared.tokenizer.encode(t),
        Prompt::Chat(m) => shared
            .tokenizer
            .render_chat(m)
            .and_then(|text| shared.tokenizer.encode(&text)),
    };
    let tokens = match tokens {
        Ok(t) if !t.is_empty() => t,
        Ok(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "the prompt is empty",
                "invalid_request_error",
                Some("prompt"),
                None,
            );
        }
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &e.to_string(),
                "invalid_request_error",
                Some("prompt"),
                None,
            );
        }
    };
    let prompt_tokens = tokens.len() as u32;
    let salt = parsed.cache_salt.as_deref();
    let blocks = shared.hasher.salted_hashes(&tokens, salt);
    // The ZMQ publisher sends stored blocks' tokens, as vLLM does.
    let block_tokens = if shared.zmq.is_some() {
        let mut t = tokens.to_vec();
        t.truncate(blocks.len() * shared.hasher.block_size() as usize);
        t
    } else {
        Vec::new()
    };
    let mut out = shared.engine.submit(
        blocks,
        block_tokens,
        salt.map(Arc::from),
        prompt_tokens,
        parsed.max_tokens,
    );
    let cached_tokens = match out.recv().await {
        Some(Output::Admitted { cached_tokens }) => cached_tokens,
        Some(Output::TooLarge { needed }) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("the request needs {needed} KV blocks, more than this worker has"),
                "invalid_request_error",
                Some("prompt"),
                Some("context_length_exceeded"),
            );
        }
        _ => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "engine stopped",
                "server_error",
                None,
                None,
            );
        }
    };
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let id = format!(
        "{}-{:x}",
        if api == Api::Chat { "chatcmpl" } else { "cmpl" },
        shared.served.load(Ordering::Relaxed)
    );
    let usage = move |completion: u32| {
        json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        })
    };
    if !parsed.stream {
        let mut text = String::new();
        let mut n = 0;
        while let Some(o) = out.recv().await {
            match o {
                Output::Token(i) => {
                    text.push_str(filler(i));
                    n += 1;
                }
                Output::Done => break,
                _ => {}
            }
        }
        let choice = match api {
            Api::Chat => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
            }
            Api::Completions => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length"})
            }
        };
        let object = if api == Api::Chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        return json_response(
            StatusCode::OK,
            json!({"id": id, "object": object, "created": created, "model": shared.model, "choices": [choice], "usage": usage(n)}),
        );
    }
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(16);
    let model = shared.model.clone();
    let max_tokens = parsed.max_tokens;
    let include_usage = parsed.include_usage;
    tokio::spawn(async move {
        let object = if api == Api::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let chunk = |choice: serde_json::Value| {
            let v = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
            Bytes::from(format!("data: {v}\n\n"))
        };
        let mut n = 0u32;
        while let Some(o) = out.recv().await {
            let bytes = match o {
                Output::Token(i) => {
                    if fault == Fault::Stall && n >= 1 {
                        // Silent, with the connection open, until the client leaves.
                        tx.closed().await;
                        return;
                    }
                    if fault == Fault::CutStream && n >= max_tokens / 2 {
                        let _ = tx
                            .send(Err(std::io::Error::other("injected fault: stream cut")))
                            .await;
                        return;
                    }
                    n += 1;
                    match api {
                        Api::Chat if i == 0 => chunk(
                            json!({"index": 0, "delta": {"role": "assistant", "content": filler(i)}, "finish_reason": null}),
                        ),
                        Api::Chat => chunk(
                            json!({"index": 0, "delta": {"content": filler(i)}, "finish_reason": null}),
                        ),
                        Api::Completions => chunk(
                            json!({"index": 0, "text": filler(i), "logprobs": null, "finish_reason": null}),
                        ),
                    }
                }
                Output::Done => {
                    let last = match api {
                        Api::Chat => {
                            chunk(json!({"index": 0, "delta": {}, "finish_reason": "length"}))
                        }
                        Api::Completions => chunk(
                            json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "length"}),
                        ),
                    };
                    let mut tail = last.to_vec();
                    if include_usage {
                        let v = json!({"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": usage(n)});
                        tail.extend_from_slice(format!("data: {v}\n\n").as_bytes());
                    }
                    tail.extend_from_slice(b"data: [DONE]\n\n");
                    let _ = tx.send(Ok(Frame::data(Bytes::from(tail)))).await;
                    return;
                }
                _ => continue,
            };
            if tx.send(Ok(Frame::data(bytes))).await.is_err() {
                return; // the client went away; dropping `out` cancels the request
            }
        }
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed())
        .expect("valid response")
}
