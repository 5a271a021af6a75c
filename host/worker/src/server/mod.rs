//! The mock worker's HTTP server.
//!
//! - this module: the worker's life (listen, TLS, accept, register, stop);
//! - `routes`: the HTTP surface below, but for completions;
//! - `generate`: completions and chat completions, streamed or whole;
//! - `fault`: what can be injected, and when.
//!
//! | route | does |
//! | --- | --- |
//! | `POST /v1/completions`, `POST /v1/chat/completions` | OpenAI-compatible, streaming (SSE) or not; `usage.prompt_tokens_details.cached_tokens` reports the prefix found in the cache |
//! | `GET /v1/models` | the one model served |
//! | `GET /health` | 200 when serving; 503 while a fault is active |
//! | `GET /v1/kv_events` | the KV event stream (`docs/kv-events.md`) |
//! | `GET /metrics` | load and counters in vLLM's Prometheus names (`vllm:num_requests_running`, `vllm:prefix_cache_hits_total`, …) |
//! | `POST /reset_prefix_cache` | vLLM's (its dev mode): the cache emptied, `{"success": false}` while requests run |
//! | `GET /stats` | the engine's step accounting |
//! | `GET /get_server_info`, `/server_info` | model, KV block size (`page_size`, `block_size`), cache size, batch limit |
//! | `GET /get_model_info`, `/model_info`, `/version` | what routers probe at start |
//! | `GET /v1/loads`, `/get_load` | running and waiting requests, KV usage |
//! | `POST /tokenize`, `POST /v1/chat/completions/render` | vLLM's: the worker's own token IDs for a prompt or chat |
//! | `GET /handoff/{key}?have=N` | a disaggregated prefill worker hands a prompt's KV to a decode worker (`pd`); also on its bootstrap port |
//! | `POST /admin/fault` | a [`FaultConfig`] as JSON: `{"fault": "crash" \| "hang" \| "refuse" \| "error" \| "status" \| "stall" \| "cut_stream" \| "none", "after": N, "after_tokens": 20, "status": 503, "retry_after_secs": 2, "marker": "POISON", "marker_after_tokens": 5, "health_lies": true, "first_token_delay_ms": 500, "idle_close_ms": 1000}` (all but `fault` optional) |

mod answer;
mod fault;
mod generate;
pub mod pd;
mod reply;
mod routes;
mod words;

pub use fault::{Fault, FaultConfig};
pub use pd::{HANDOFF_TTL, MAX_HANDOFFS, PdConfig, PdProtocol};

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::engine::{Engine, EngineConfig};
use switchyard_discovery::{EndpointPath, InstanceInfo};
use switchyard_ids::InstanceId;
use switchyard_kv::hash::BlockHasher;
use switchyard_tokens::prefix::DEFAULT_BUDGET_TOKENS;
use switchyard_tokens::{PrefixTokenizer, Tokenizer};

use routes::route;

pub(crate) type Body = BoxBody<Bytes, std::io::Error>;

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
    /// Its part in a fleet that splits prefill from decode.
    pub pd: PdConfig,
    /// LoRA adapters served besides the model (vLLM's `--lora-modules` names): a
    /// request naming one is answered as the model would be, its blocks keyed (and
    /// published) with the adapter's name as vLLM keys them.
    pub lora_adapters: Vec<String>,
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

pub(crate) struct Shared {
    model: String,
    /// The LoRA adapters served besides it.
    lora_adapters: Vec<String>,
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
    /// Its part in a disaggregated fleet.
    pd: PdConfig,
    /// KV kept for decode workers.
    handoffs: Arc<pd::Handoffs>,
    /// The address decode workers reach it at.
    addr: SocketAddr,
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
            lora_adapters: config.lora_adapters,
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
            pd: config.pd,
            handoffs: Arc::new(pd::Handoffs::new()),
            addr,
        });
        shared.update_refuse();
        let (shutdown, shutdown_rx) = watch::channel(false);
        if let Some(port) = config.pd.bootstrap_port {
            // SGLang's bootstrap server: decode workers ask it for their rooms.
            let bootstrap = SocketAddr::new(addr.ip(), port);
            let std_listener = std::net::TcpListener::bind(bootstrap)?;
            std_listener.set_nonblocking(true)?;
            tokio::spawn(accept_loop(
                TcpListener::from_std(std_listener)?,
                bootstrap,
                shared.clone(),
                refuse_rx.clone(),
                shutdown_rx.clone(),
            ));
        }
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

    /// The port of its bootstrap server (an SGLang-style prefill worker), if any.
    pub fn bootstrap_port(&self) -> Option<u16> {
        self.shared.pd.bootstrap_port
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
            role: self.shared.pd.role,
            bootstrap_port: self.shared.pd.bootstrap_port,
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
