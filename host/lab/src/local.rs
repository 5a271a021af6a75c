//! A whole fleet in one process: mock workers and the router on loopback, with static
//! discovery and KV events. Used by `switchyard demo`, `switchyard replay` and the
//! benchmarks.

use std::net::SocketAddr;

use tokio::net::TcpListener;
use tokio::sync::oneshot;

use switchyard_server::config::ServeArgs;
use switchyard_server::serve::{ServeError, serve};
use switchyard_worker::{EngineConfig, FaultConfig, MockWorker, MockWorkerConfig};

/// What to start.
#[derive(Debug, Clone)]
pub struct LocalFleetConfig {
    /// Mock workers.
    pub workers: usize,
    /// Their engine.
    pub engine: EngineConfig,
    /// The model they serve.
    pub model: String,
    /// The router's policy (built-in name or `.wasm`).
    pub policy: String,
    /// The policy's configuration.
    pub policy_config: String,
    /// Report failing workers down (false: the benchmark baseline).
    pub availability: bool,
    /// The router's address (`127.0.0.1:0` for any).
    pub listen: SocketAddr,
    /// Admin token, if the admin API is wanted.
    pub admin_token: Option<String>,
    /// Where the router learns the workers' caches.
    pub kv_events: KvEventsMode,
    /// Approximate mode's prediction lifetime [default: the router's].
    pub prediction_ttl_secs: Option<f64>,
    /// The workers' and the router's `tokenizer.json` [default: the built-in one].
    pub tokenizer: Option<std::path::PathBuf>,
    /// Router replicas in front of the same workers, each with its own listener and
    /// state, as several `switchyard serve` processes would be (at least one).
    pub routers: usize,
    /// How often the routers read the workers' `/metrics` [default: the router's].
    pub engine_metrics_ms: Option<u64>,
}

/// How the router of a local fleet learns what the workers cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvEventsMode {
    /// The workers publish vLLM's ZMQ events (with a replay socket), as engines do.
    Zmq,
    /// The workers' NDJSON stream at `/v1/kv_events`.
    Ndjson,
    /// No events: approximate mode, caches predicted from the router's decisions.
    None,
}

impl std::str::FromStr for KvEventsMode {
    type Err = String;

    fn from_str(s: &str) -> Result<KvEventsMode, String> {
        match s {
            "zmq" => Ok(KvEventsMode::Zmq),
            "ndjson" | "true" => Ok(KvEventsMode::Ndjson),
            "none" | "approximate" | "false" => Ok(KvEventsMode::None),
            other => Err(format!(
                "`{other}` is not a KV events mode (zmq, ndjson, none)"
            )),
        }
    }
}

impl std::fmt::Display for KvEventsMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvEventsMode::Zmq => "zmq events",
            KvEventsMode::Ndjson => "ndjson events",
            KvEventsMode::None => "approximate",
        })
    }
}

/// A running local fleet.
pub struct LocalFleet {
    /// The mock workers.
    pub workers: Vec<MockWorker>,
    /// Every router replica's base URL (the first is [`LocalFleet::url`]).
    pub urls: Vec<String>,
    routers: Vec<RouterTask>,
}

/// One in-process router.
struct RouterTask {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), ServeError>>,
}

/// Why a local fleet could not start.
#[derive(Debug, thiserror::Error)]
pub enum LocalFleetError {
    /// A socket could not be bound.
    #[error("cannot listen: {0}")]
    Io(#[from] std::io::Error),
    /// The router's configuration was refused.
    #[error(transparent)]
    Config(#[from] switchyard_server::config::ConfigError),
    /// The tokenizer could not be loaded.
    #[error(transparent)]
    Tokenizer(#[from] switchyard_tokens::TokenizerError),
}

/// `--worker` for `w`: its URL, with its ZMQ event sockets if it publishes them.
fn worker_spec(w: &MockWorker) -> String {
    match w.engine_events() {
        None => w.url(),
        Some(e) => format!(
            "{}#kv_events={}&kv_replay={}&topic={}",
            w.url(),
            e.endpoint,
            e.replay.unwrap_or_default(),
            e.topic
        ),
    }
}

impl LocalFleet {
    /// Starts the workers, then the router in front of them.
    pub async fn start(config: LocalFleetConfig) -> Result<LocalFleet, LocalFleetError> {
        let tokenizer =
            switchyard_tokens::Tokenizer::from_file_if_any(config.tokenizer.as_deref())?;
        let mut workers = Vec::new();
        for _ in 0..config.workers.max(1) {
            let worker_config = MockWorkerConfig {
                model: config.model.clone(),
                engine: config.engine.clone(),
                hash_seed: 0,
                fault: FaultConfig::NONE,
                tokenizer: tokenizer.clone(),
                zmq_events: (config.kv_events == KvEventsMode::Zmq).then(|| {
                    switchyard_worker::zmq::ZmqEventsConfig {
                        publish: "127.0.0.1:0".parse().expect("valid"),
                        replay: Some("127.0.0.1:0".parse().expect("valid")),
                        topic: "kv-events".into(),
                    }
                }),
                tls: None,
                chat: None,
                api_key: None,
                pd: Default::default(),
                lora_adapters: Vec::new(),
            };
            workers.push(
                MockWorker::bind(worker_config, "127.0.0.1:0".parse().expect("valid")).await?,
            );
        }
        let args = ServeArgs {
            listen: Some(config.listen),
            workers: workers.iter().map(worker_spec).collect(),
            model: Some(config.model.clone()),
            block_size: Some(config.engine.block_size),
            kv_events: Some(config.kv_events == KvEventsMode::Ndjson),
            prediction_ttl_secs: config.prediction_ttl_secs,
            tokenizer: config.tokenizer.clone(),
            policy: Some(config.policy.clone()),
            policy_config: Some(config.policy_config.clone()),
            admin_token: config.admin_token.clone(),
            availability: Some(config.availability),
            shutdown_grace_secs: Some(5),
            engine_metrics_ms: config.engine_metrics_ms,
            ..Default::default()
        };
        let mut urls = Vec::new();
        let mut routers = Vec::new();
        for i in 0..config.routers.max(1) {
            let serve_config = args.clone().resolve()?;
            // Replicas after the first take any free port.
            let addr = if i == 0 {
                config.listen
            } else {
                SocketAddr::new(config.listen.ip(), 0)
            };
            let listener = TcpListener::bind(addr).await?;
            urls.push(format!("http://{}", listener.local_addr()?));
            let (stop, stopped) = oneshot::channel::<()>();
            let task = tokio::spawn(serve(serve_config, listener, async move {
                let _ = stopped.await;
            }));
            routers.push(RouterTask { stop, task });
        }
        Ok(LocalFleet {
            workers,
            urls,
            routers,
        })
    }

    /// The first router's base URL.
    pub fn url(&self) -> &str {
        &self.urls[0]
    }

    /// Waits until every router is ready, or returns a startup error.
    pub async fn ready(&mut self) -> Result<(), String> {
        let http: hyper_util::client::legacy::Client<_, http_body_util::Empty<bytes::Bytes>> =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http();
        for (url, router) in self.urls.iter().zip(&mut self.routers) {
            let probe = format!("{url}/ready");
            let mut ready = false;
            for _ in 0..600 {
                if router.task.is_finished() {
                    return Err(match (&mut router.task).await {
                        Ok(Err(e)) => e.to_string(),
                        other => format!("the router stopped: {other:?}"),
                    });
                }
                if let Ok(r) = http.get(probe.parse().expect("valid URL")).await
                    && r.status().is_success()
                {
                    ready = true;
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            if !ready {
                return Err(format!("the router at {url} did not become ready"));
            }
        }
        Ok(())
    }

    /// Stops the routers (letting open requests finish) and the workers.
    pub async fn stop(self) {
        let tasks: Vec<_> = self
            .routers
            .into_iter()
            .map(|router| {
                let _ = router.stop.send(());
                router.task
            })
            .collect();
        for task in tasks {
            let _ = task.await;
        }
        for w in self.workers {
            w.shutdown().await;
        }
    }
}
