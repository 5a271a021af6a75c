//! `switchyard serve` configuration: command-line flags, environment variables
//! (`SWITCHYARD_*`, named beside each flag) and an optional TOML file (`--config`),
//! resolved once into a typed [`ServeConfig`]. A flag or variable beats the file, the
//! file beats the default. Unknown keys in the file are errors.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::GatewayConfig;
use switchyard_discovery::etcd::EtcdConfig;
use switchyard_discovery::{EndpointPath, EngineEventSource};
use switchyard_policy::RuntimeConfig;
use switchyard_router::client::{ClientConfig, OutlierConfig};

/// Flags of `switchyard serve`.
#[derive(Debug, Default, Clone, clap::Args)]
pub struct ServeArgs {
    /// TOML configuration file (see the README for its keys).
    #[arg(long, env = "SWITCHYARD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1:8000].
    #[arg(long, env = "SWITCHYARD_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Discover workers in etcd (comma-separated client URLs).
    #[arg(long = "etcd", env = "SWITCHYARD_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Root of Switchyard's keys in etcd [default: switchyard].
    #[arg(long, env = "SWITCHYARD_ETCD_ROOT")]
    pub etcd_root: Option<String>,
    /// etcd user, password and CA.
    #[command(flatten)]
    pub etcd_access: EtcdAccessArgs,
    /// A static worker's base URL (repeatable); used when no etcd is given. Its engine's
    /// ZMQ KV events go after `#`:
    /// `http://10.0.0.7:8000#kv_events=tcp://10.0.0.7:5557&kv_replay=tcp://10.0.0.7:5558&topic=kv-events&dp=1`.
    #[arg(long = "worker", env = "SWITCHYARD_WORKERS", value_delimiter = ',')]
    pub workers: Vec<String>,
    /// The model the static workers serve [default: mock-model].
    #[arg(long, env = "SWITCHYARD_MODEL")]
    pub model: Option<String>,
    /// Static workers publish a KV event stream at `/v1/kv_events` (Switchyard mock
    /// workers do); without it their caches are predicted from routing decisions.
    #[arg(long, env = "SWITCHYARD_KV_EVENTS")]
    pub kv_events: Option<bool>,
    /// Key of the router's block-hash chain (a u64). Workers that publish Switchyard's
    /// NDJSON events compute the same chain, so they must be given the same key
    /// (`mock-worker --kv-hash-key`); engines' own events are re-hashed by the router,
    /// and predictions are the router's own [default: random per process when no worker
    /// can publish NDJSON events (static workers without `--kv-events`), else 0].
    #[arg(long, env = "SWITCHYARD_KV_HASH_KEY")]
    pub kv_hash_key: Option<u64>,
    /// KV block size of the static workers, in tokens [default: 16].
    #[arg(long, env = "SWITCHYARD_BLOCK_SIZE")]
    pub block_size: Option<u32>,
    /// Routing policy: a built-in name (`kv-cost`, `round-robin`) or a `.wasm` path
    /// [default: kv-cost].
    #[arg(long, env = "SWITCHYARD_POLICY")]
    pub policy: Option<String>,
    /// The policy's configuration, JSON [default: {}].
    #[arg(long, env = "SWITCHYARD_POLICY_CONFIG")]
    pub policy_config: Option<String>,
    /// Reload `--policy PATH.wasm` when the file changes.
    #[arg(long, env = "SWITCHYARD_POLICY_WATCH")]
    pub watch: Option<bool>,
    /// Refused with a reason: a token on the command line is readable by every user of
    /// the machine (`ps`). Kept so that its use gets that reason, not "unknown flag".
    #[arg(long = "admin-token", hide = true)]
    pub admin_token_on_command_line: Option<String>,
    /// The admin API's bearer token from the environment (`SWITCHYARD_ADMIN_TOKEN`, read
    /// by [`ServeArgs::resolve`]), at least 16 bytes; the admin API is off without a
    /// token.
    #[arg(skip)]
    pub admin_token: Option<String>,
    /// A file holding the admin API's bearer token (keeps it out of the command line,
    /// which other users of the machine can read).
    #[arg(long, env = "SWITCHYARD_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// How long a model whose workers are all gone is answered 503 (then 404), seconds;
    /// then its endpoint's router, Client and subscriptions are released [default: 600].
    #[arg(long, env = "SWITCHYARD_ENDPOINT_GRACE_SECS")]
    pub endpoint_grace_secs: Option<u64>,
    /// Serve the admin API on this address only (e.g. a private interface), with
    /// /metrics and /health; the public listener then has no /admin/ routes.
    #[arg(long, env = "SWITCHYARD_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// Hugging Face `tokenizer.json` [default: the built-in tokenizer].
    #[arg(long, env = "SWITCHYARD_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// The model's chat template, as the engines render it: a `tokenizer_config.json` or a
    /// Jinja file [default: the one beside `--tokenizer`, else ChatML].
    #[arg(long, env = "SWITCHYARD_CHAT_TEMPLATE")]
    pub chat_template: Option<PathBuf>,
    /// Tokens of earlier prompts kept so that a conversation's next turn tokenizes only
    /// its new text; 0 tokenizes every prompt whole [default: 8388608].
    #[arg(long, env = "SWITCHYARD_TOKENIZER_CACHE_TOKENS")]
    pub tokenizer_cache_tokens: Option<usize>,
    /// Largest request body, bytes [default: 16777216].
    #[arg(long, env = "SWITCHYARD_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Request bodies held at once (being read, and kept for retries until their
    /// answer ends), bytes; past it new requests get 503 [default: 1073741824].
    #[arg(long, env = "SWITCHYARD_MAX_BODY_BYTES_TOTAL")]
    pub max_body_bytes_total: Option<usize>,
    /// Longest prompt routed, in tokens; longer ones get 400 before any booking
    /// [default: 1048576, above every served model's context].
    #[arg(long, env = "SWITCHYARD_MAX_PROMPT_TOKENS")]
    pub max_prompt_tokens: Option<usize>,
    /// Workers tried per request [default: 3].
    #[arg(long, env = "SWITCHYARD_MAX_ATTEMPTS")]
    pub max_attempts: Option<usize>,
    /// Worker connect timeout, ms [default: 1000].
    #[arg(long, env = "SWITCHYARD_CONNECT_TIMEOUT_MS")]
    pub connect_timeout_ms: Option<u64>,
    /// Timeout for a worker's first response bytes, seconds [default: 120].
    #[arg(long, env = "SWITCHYARD_FIRST_BYTE_TIMEOUT_SECS")]
    pub first_byte_timeout_secs: Option<u64>,
    /// How long open requests may finish after SIGTERM, seconds [default: 30].
    #[arg(long, env = "SWITCHYARD_SHUTDOWN_GRACE_SECS")]
    pub shutdown_grace_secs: Option<u64>,
    /// Time budget of one policy call, ms [default: 10].
    #[arg(long, env = "SWITCHYARD_POLICY_BUDGET_MS")]
    pub policy_budget_ms: Option<u64>,
    /// Memory cap of one policy instance, MiB [default: 64].
    #[arg(long, env = "SWITCHYARD_POLICY_MEMORY_MB")]
    pub policy_memory_mb: Option<usize>,
    /// Memory cap of all policy instances together, MiB [default: 1024].
    #[arg(long, env = "SWITCHYARD_POLICY_MEMORY_TOTAL_MB")]
    pub policy_memory_total_mb: Option<usize>,
    /// Idle policy instances kept ready per policy, made off the request path
    /// [default: 4; grows with demand up to 64].
    #[arg(long, env = "SWITCHYARD_POLICY_WARM_INSTANCES")]
    pub policy_warm_instances: Option<usize>,
    /// Accept policies that reject every canary request (by default such a policy is
    /// refused: it would answer every request 503).
    #[arg(long, env = "SWITCHYARD_POLICY_MAY_REJECT_ALL")]
    pub policy_may_reject_all: Option<bool>,
    /// A public key (from `switchyard policy keygen`) whose signed pushes through etcd
    /// this router applies (repeatable). With any, unsigned pushes and pushes signed by
    /// other keys are refused; with none, every push is applied.
    #[arg(
        long = "policy-trusted-key",
        env = "SWITCHYARD_POLICY_TRUSTED_KEYS",
        value_delimiter = ','
    )]
    pub policy_trusted_keys: Vec<PathBuf>,
    /// Where compiled policies are cached [default: ~/.cache/switchyard/policies].
    #[arg(long, env = "SWITCHYARD_POLICY_CACHE")]
    pub policy_cache: Option<PathBuf>,
    /// Report failing workers down at once [default: true]; `false` is a baseline that
    /// keeps routing to every discovered worker until discovery drops it.
    #[arg(long, env = "SWITCHYARD_AVAILABILITY")]
    pub availability: Option<bool>,
    /// Timeout for a non-streaming answer, which comes whole at the end of the
    /// generation, seconds [default: 600].
    #[arg(long, env = "SWITCHYARD_REQUEST_TIMEOUT_SECS")]
    pub request_timeout_secs: Option<u64>,
    /// Longest silence between two chunks of a started response, seconds [default: 60].
    #[arg(long, env = "SWITCHYARD_STREAM_IDLE_TIMEOUT_SECS")]
    pub stream_idle_timeout_secs: Option<u64>,
    /// Time a client connection may take to send a request head, and stay idle between
    /// requests, seconds [default: 30].
    #[arg(long, env = "SWITCHYARD_CLIENT_IDLE_TIMEOUT_SECS")]
    pub client_idle_timeout_secs: Option<u64>,
    /// Most client connections at once [default: 4096].
    #[arg(long, env = "SWITCHYARD_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Most completion requests in flight at once [default: 2048].
    #[arg(long, env = "SWITCHYARD_MAX_IN_FLIGHT")]
    pub max_in_flight: Option<usize>,
    /// 5xx answers or timeouts in a row that eject a worker [default: 3].
    #[arg(long, env = "SWITCHYARD_CONSECUTIVE_FAILURES")]
    pub consecutive_failures: Option<u32>,
    /// Most of an endpoint's workers ejected at once, percent; one may always be
    /// [default: 50].
    #[arg(long, env = "SWITCHYARD_MAX_EJECTION_PERCENT")]
    pub max_ejection_percent: Option<u32>,
    /// Below this percentage of available workers, route over every worker not known to
    /// be unreachable; 0 turns it off [default: 50].
    #[arg(long, env = "SWITCHYARD_PANIC_THRESHOLD_PERCENT")]
    pub panic_threshold_percent: Option<u32>,
    /// First ejection's length, ms; the n-th lasts n times as long [default: 2000].
    #[arg(long, env = "SWITCHYARD_BASE_EJECTION_MS")]
    pub base_ejection_ms: Option<u64>,
    /// Longest ejection, seconds [default: 120].
    #[arg(long, env = "SWITCHYARD_MAX_EJECTION_SECS")]
    pub max_ejection_secs: Option<u64>,
    /// Active health checks of available workers every this many ms; 0 turns them off
    /// [default: 5000].
    #[arg(long, env = "SWITCHYARD_HEALTH_CHECK_INTERVAL_MS")]
    pub health_check_interval_ms: Option<u64>,
    /// Workers without a KV event stream: how long a predicted cache entry (from the
    /// router's own decisions) lives, seconds [default: 120]. Shorter when workers'
    /// caches turn over faster.
    #[arg(long, env = "SWITCHYARD_PREDICTION_TTL_SECS")]
    pub prediction_ttl_secs: Option<f64>,
    /// Workers without a KV event stream: most (worker, block) predictions kept
    /// [default: 1048576].
    #[arg(long, env = "SWITCHYARD_PREDICTION_MAX_BLOCKS")]
    pub prediction_max_blocks: Option<usize>,
    /// Read workers' engine load (vLLM's and SGLang's Prometheus gauges at `/metrics`)
    /// every this many ms; 0 turns it off [default: 1000]. Workers serving Switchyard's
    /// NDJSON event stream report load on it instead.
    #[arg(long, env = "SWITCHYARD_ENGINE_METRICS_MS")]
    pub engine_metrics_ms: Option<u64>,
    /// How long a worker that discovery removed while it was serving keeps serving
    /// (unless it fails or deregisters), seconds; 0 believes discovery at once
    /// [default: 60].
    #[arg(long, env = "SWITCHYARD_DISCOVERY_GRACE_SECS")]
    pub discovery_grace_secs: Option<u64>,
    /// Longest `Retry-After` honoured from a busy worker, seconds [default: 60].
    #[arg(long, env = "SWITCHYARD_MAX_RETRY_AFTER_SECS")]
    pub max_retry_after_secs: Option<u64>,
    /// Classify failures (busy, poison, runs of 5xx, ejection share) [default: true];
    /// `false` is a benchmark baseline that ejects a worker at its first failure of any
    /// kind, with no share limit, no health checks and no hold on discovery removals.
    #[arg(long, env = "SWITCHYARD_OUTLIER_DETECTION")]
    pub outlier_detection: Option<bool>,
    /// Health endpoint path of the static workers [default: /health].
    #[arg(long, env = "SWITCHYARD_HEALTH_PATH")]
    pub health_path: Option<String>,
    /// Pass clients' `Authorization` header on to workers (vLLM's `--api-key`) [default:
    /// true for static workers, which the operator named; false with etcd, where whoever
    /// can write an instance record would receive it]. Per endpoint in the file:
    /// `[endpoints."ns/comp/ep"] forward_authorization = true`.
    #[arg(long, env = "SWITCHYARD_FORWARD_AUTHORIZATION")]
    pub forward_authorization: Option<bool>,
    /// PEM file of CA certificates trusted for `https://` workers, besides the system's
    /// roots (repeatable).
    #[arg(long = "ca-file", env = "SWITCHYARD_CA_FILES", value_delimiter = ',')]
    pub ca_files: Vec<PathBuf>,
    /// Central mode of engine KV events: bind a SUB socket here that engines connect to
    /// (their `endpoint` is `tcp://ROUTER:PORT`), one address per data-parallel rank in
    /// rank order; workers then say `kv_events=bound` and the topic naming them.
    #[arg(
        long = "kv-events-bind",
        env = "SWITCHYARD_KV_EVENTS_BIND",
        value_delimiter = ','
    )]
    pub kv_events_bind: Vec<String>,
}

/// The TOML file. Same keys as the flags (snake_case), plus per-endpoint policies.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    listen: Option<SocketAddr>,
    #[serde(default)]
    etcd: Vec<String>,
    etcd_root: Option<String>,
    etcd_user: Option<String>,
    etcd_password_file: Option<PathBuf>,
    #[serde(default)]
    etcd_ca_files: Vec<PathBuf>,
    #[serde(default)]
    workers: Vec<WorkerEntry>,
    model: Option<String>,
    kv_events: Option<bool>,
    kv_hash_key: Option<u64>,
    block_size: Option<u32>,
    policy: Option<String>,
    policy_config: Option<String>,
    watch: Option<bool>,
    admin_token: Option<String>,
    admin_token_file: Option<PathBuf>,
    admin_listen: Option<SocketAddr>,
    endpoint_grace_secs: Option<u64>,
    tokenizer: Option<PathBuf>,
    chat_template: Option<PathBuf>,
    tokenizer_cache_tokens: Option<usize>,
    max_body_bytes: Option<usize>,
    max_body_bytes_total: Option<usize>,
    max_prompt_tokens: Option<usize>,
    max_attempts: Option<usize>,
    connect_timeout_ms: Option<u64>,
    first_byte_timeout_secs: Option<u64>,
    shutdown_grace_secs: Option<u64>,
    policy_budget_ms: Option<u64>,
    policy_memory_mb: Option<usize>,
    policy_memory_total_mb: Option<usize>,
    policy_warm_instances: Option<usize>,
    #[serde(default)]
    policy_trusted_keys: Vec<PathBuf>,
    policy_cache: Option<PathBuf>,
    policy_may_reject_all: Option<bool>,
    availability: Option<bool>,
    request_timeout_secs: Option<u64>,
    stream_idle_timeout_secs: Option<u64>,
    client_idle_timeout_secs: Option<u64>,
    max_connections: Option<usize>,
    max_in_flight: Option<usize>,
    consecutive_failures: Option<u32>,
    max_ejection_percent: Option<u32>,
    panic_threshold_percent: Option<u32>,
    base_ejection_ms: Option<u64>,
    max_ejection_secs: Option<u64>,
    health_check_interval_ms: Option<u64>,
    prediction_ttl_secs: Option<f64>,
    prediction_max_blocks: Option<usize>,
    engine_metrics_ms: Option<u64>,
    discovery_grace_secs: Option<u64>,
    max_retry_after_secs: Option<u64>,
    outlier_detection: Option<bool>,
    health_path: Option<String>,
    forward_authorization: Option<bool>,
    #[serde(default)]
    ca_files: Vec<PathBuf>,
    #[serde(default)]
    kv_events_bind: Vec<String>,
    /// `[endpoints."namespace/component/endpoint"]` tables.
    #[serde(default)]
    endpoints: BTreeMap<String, EndpointFile>,
}

/// Per-endpoint settings in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointFile {
    policy: Option<String>,
    policy_config: Option<String>,
    forward_authorization: Option<bool>,
}

/// A policy to load: a built-in name or a `.wasm` path, and its configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicySpec {
    /// Built-in name or path.
    pub spec: String,
    /// JSON configuration.
    pub config: String,
}

/// A `workers` entry of the TOML file: a URL (with optional `#kv_events=…`) or a table.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum WorkerEntry {
    Url(String),
    Table(WorkerTable),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkerTable {
    url: String,
    kv_events: Option<String>,
    kv_replay: Option<String>,
    #[serde(default)]
    topic: String,
    data_parallel_size: Option<u32>,
}

/// A static worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticWorker {
    /// Base URL, without a trailing `/`.
    pub url: String,
    /// Its engine's ZMQ KV event publisher, if any.
    pub engine_events: Option<EngineEventSource>,
}

impl StaticWorker {
    /// Parses `URL` or `URL#kv_events=…&kv_replay=…&topic=…&dp=N`.
    pub fn parse(s: &str) -> Result<StaticWorker, ConfigError> {
        let (url, options) = s.split_once('#').unwrap_or((s, ""));
        let mut table = WorkerTable {
            url: url.to_string(),
            kv_events: None,
            kv_replay: None,
            topic: String::new(),
            data_parallel_size: None,
        };
        for kv in options.split('&').filter(|kv| !kv.is_empty()) {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            match k {
                "kv_events" => table.kv_events = Some(v.to_string()),
                "kv_replay" => table.kv_replay = Some(v.to_string()),
                "topic" => table.topic = v.to_string(),
                "dp" | "data_parallel_size" => {
                    table.data_parallel_size = Some(v.parse().map_err(|_| {
                        ConfigError(format!("worker `{s}`: dp=`{v}` is not a number"))
                    })?)
                }
                _ => {
                    return Err(ConfigError(format!(
                        "worker `{s}`: unknown option `{k}` (known: kv_events, kv_replay, topic, dp)"
                    )));
                }
            }
        }
        StaticWorker::from_table(table)
    }

    fn from_table(t: WorkerTable) -> Result<StaticWorker, ConfigError> {
        let url = t.url.trim_end_matches('/').to_string();
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(ConfigError(format!("worker `{url}` is not an http(s) URL")));
        }
        let engine_events = match t.kv_events {
            None if t.kv_replay.is_some() => {
                return Err(ConfigError(format!(
                    "worker `{url}`: kv_replay without kv_events"
                )));
            }
            None => None,
            Some(endpoint) => {
                let src = EngineEventSource {
                    endpoint,
                    replay: t.kv_replay,
                    topic: t.topic,
                    data_parallel_size: t.data_parallel_size.unwrap_or(1),
                };
                src.validate()
                    .map_err(|e| ConfigError(format!("worker `{url}`: {e}")))?;
                Some(src)
            }
        };
        Ok(StaticWorker { url, engine_events })
    }
}

/// Where workers come from.
#[derive(Debug, Clone)]
pub enum DiscoveryConfig {
    /// etcd.
    Etcd(EtcdConfig),
    /// A fixed list.
    Static {
        /// The workers.
        workers: Vec<StaticWorker>,
        /// Their model.
        model: String,
        /// Their block size.
        block_size: u32,
        /// Whether they serve `/v1/kv_events`.
        kv_events: bool,
        /// Their health endpoint's path.
        health_path: String,
    },
}

/// Everything `serve` needs, validated.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Listen address.
    pub listen: SocketAddr,
    /// Discovery.
    pub discovery: DiscoveryConfig,
    /// The policy of endpoints without their own.
    pub default_policy: PolicySpec,
    /// Per-endpoint policies.
    pub endpoint_policies: BTreeMap<EndpointPath, PolicySpec>,
    /// Reload file policies on change.
    pub watch: bool,
    /// Tokenizer file, if not built-in.
    pub tokenizer: Option<PathBuf>,
    /// Chat template file, if not the one beside the tokenizer (or ChatML).
    pub chat_template: Option<PathBuf>,
    /// Budget of the tokenizer's prefix cache, tokens (0: off).
    pub tokenizer_cache_tokens: usize,
    /// The front door.
    pub gateway: GatewayConfig,
    /// The policy runtime.
    pub runtime: RuntimeConfig,
    /// Re-admission probing.
    pub client: ClientConfig,
    /// Shutdown grace period.
    pub shutdown_grace: Duration,
    /// Predicted caches of workers without an event stream.
    pub approximate: switchyard_router::Approximate,
    /// How often workers' engine metrics are read (`None`: never).
    pub engine_metrics: Option<Duration>,
    /// Addresses of the SUB sockets engines connect to (central mode), rank by rank.
    pub kv_events_bind: Vec<String>,
    /// The key of the router's block-hash chain (see `--kv-hash-key`).
    pub kv_hash_key: u64,
    /// Whether clients' `Authorization` header goes on to workers, by default.
    pub forward_authorization: bool,
    /// Per-endpoint exceptions to `forward_authorization`.
    pub endpoint_forward_authorization: BTreeMap<EndpointPath, bool>,
    /// How long a model with no instances is answered 503 and its endpoint kept.
    pub endpoint_grace: Duration,
    /// Where the admin API is served, if not on `listen`.
    pub admin_listen: Option<SocketAddr>,
    /// Keys whose signed etcd pushes are applied (none: every push is).
    pub policy_trusted_keys: Vec<switchyard_discovery::signing::PublicKey>,
}

/// A list given by repeatable flags (or their variable) wins whole over the file's.
/// How every command that talks to etcd reaches it: its own user authentication and TLS.
/// The password is never a flag (it would show in the process list): it comes from a
/// file or from `SWITCHYARD_ETCD_PASSWORD`.
#[derive(Debug, Default, Clone, clap::Args)]
pub struct EtcdAccessArgs {
    /// etcd user, when etcd has authentication enabled; the password is read from
    /// --etcd-password-file or the SWITCHYARD_ETCD_PASSWORD variable.
    #[arg(long, env = "SWITCHYARD_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password (its first line).
    #[arg(long, env = "SWITCHYARD_ETCD_PASSWORD_FILE")]
    pub etcd_password_file: Option<PathBuf>,
    /// PEM CA certificate(s) trusted for an https:// etcd besides the system roots
    /// (repeatable).
    #[arg(
        long = "etcd-ca-file",
        env = "SWITCHYARD_ETCD_CA_FILES",
        value_delimiter = ','
    )]
    pub etcd_ca_files: Vec<PathBuf>,
}

impl EtcdAccessArgs {
    /// `config` with this TLS trust and these credentials.
    pub fn apply(&self, config: EtcdConfig) -> Result<EtcdConfig, ConfigError> {
        let tls = switchyard_net::upstream::Tls::with_ca_files(&self.etcd_ca_files)
            .map_err(|e| ConfigError(format!("etcd: {e}")))?;
        let password = match (
            &self.etcd_password_file,
            std::env::var("SWITCHYARD_ETCD_PASSWORD"),
        ) {
            (Some(path), _) => Some(
                std::fs::read_to_string(path)
                    .map_err(|e| {
                        ConfigError(format!(
                            "cannot read the etcd password file {}: {e}",
                            path.display()
                        ))
                    })?
                    .lines()
                    .next()
                    .unwrap_or("")
                    .to_string(),
            ),
            (None, Ok(p)) => Some(p),
            (None, Err(_)) => None,
        };
        let auth = match (&self.etcd_user, password) {
            (Some(user), Some(password)) => Some(switchyard_discovery::etcd_api::EtcdAuth {
                user: user.clone(),
                password,
            }),
            (Some(user), None) => {
                return Err(ConfigError(format!(
                    "etcd user `{user}` has no password: give --etcd-password-file or set \
                     SWITCHYARD_ETCD_PASSWORD"
                )));
            }
            (None, Some(_)) => {
                return Err(ConfigError(
                    "an etcd password was given without --etcd-user".into(),
                ));
            }
            (None, None) => None,
        };
        Ok(EtcdConfig {
            tls,
            auth,
            ..config
        })
    }
}

fn flag_or_file<T>(flag: Vec<T>, file: Vec<T>) -> Vec<T> {
    if flag.is_empty() { file } else { flag }
}

/// The longest time any setting may name: a year. Past it, `Instant::now() + d` can
/// overflow (a panic on every decision that uses it), and no operator means it.
pub const MAX_SETTING_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// The shortest admin token accepted, in bytes: a guessable token is no token.
pub const MIN_ADMIN_TOKEN_BYTES: usize = 16;

/// The admin token: from the environment or a file (this user's, mode 0600 or stricter),
/// at least [`MIN_ADMIN_TOKEN_BYTES`]; never from the command line or the config file
/// (which others may read).
fn admin_token(
    on_command_line: Option<String>,
    in_config_file: Option<String>,
    from_env: Option<String>,
    file: Option<PathBuf>,
) -> Result<Option<String>, ConfigError> {
    if on_command_line.is_some() {
        return Err(ConfigError(
            "--admin-token puts the token where every user of the machine can read it (the \
             process list): give it in a file (--admin-token-file, mode 0600) or in \
             SWITCHYARD_ADMIN_TOKEN"
                .into(),
        ));
    }
    if in_config_file.is_some() {
        return Err(ConfigError(
            "admin_token in the config file: name a file holding it (admin_token_file, mode \
             0600) instead"
                .into(),
        ));
    }
    let token = match (from_env, file) {
        (Some(_), Some(_)) => {
            return Err(ConfigError(
                "give the admin token in SWITCHYARD_ADMIN_TOKEN or in a file, not both".into(),
            ));
        }
        (Some(t), None) => t,
        (None, Some(path)) => read_secret_file(&path, "admin token file")?,
        (None, None) => return Ok(None),
    };
    if token.len() < MIN_ADMIN_TOKEN_BYTES {
        return Err(ConfigError(format!(
            "the admin token has {} bytes; at least {MIN_ADMIN_TOKEN_BYTES} (e.g. `openssl rand -hex 32`)",
            token.len()
        )));
    }
    Ok(Some(token))
}

/// A secret from a file that must be this user's and readable by no one else; its text,
/// trimmed, not empty, at most 4 KiB.
fn read_secret_file(path: &std::path::Path, what: &str) -> Result<String, ConfigError> {
    use std::io::Read;
    let fail = |why: String| ConfigError(format!("{what} {}: {why}", path.display()));
    let file = std::fs::File::open(path).map_err(|e| fail(e.to_string()))?;
    let meta = file.metadata().map_err(|e| fail(e.to_string()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if meta.mode() & 0o077 != 0 {
            return Err(fail(format!(
                "mode {:o} lets others read it; chmod 600 it",
                meta.mode() & 0o777
            )));
        }
    }
    let _ = meta;
    let mut text = String::new();
    file.take(4096)
        .read_to_string(&mut text)
        .map_err(|e| fail(e.to_string()))?;
    let text = text.trim().to_string();
    if text.is_empty() {
        return Err(fail("it is empty".into()));
    }
    Ok(text)
}

/// A duration setting given in `unit`s (`from` builds it), checked against
/// [`MAX_SETTING_DURATION`]; `default` when unset.
fn bounded(
    name: &str,
    value: Option<u64>,
    from: fn(u64) -> Duration,
    default: Duration,
) -> Result<Duration, ConfigError> {
    let Some(v) = value else { return Ok(default) };
    let d = from(v);
    if d > MAX_SETTING_DURATION {
        return Err(ConfigError(format!(
            "{name} = {v} is longer than a year ({} s), the most any duration may be",
            MAX_SETTING_DURATION.as_secs()
        )));
    }
    Ok(d)
}

/// A configuration problem, said plainly.
#[derive(Debug, thiserror::Error)]
#[error("configuration: {0}")]
pub struct ConfigError(pub String);

impl ServeArgs {
    /// Merges flags, environment and the file.
    pub fn resolve(self) -> Result<ServeConfig, ConfigError> {
        let file: FileConfig = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| ConfigError(format!("cannot read {}: {e}", path.display())))?;
                toml::from_str(&text)
                    .map_err(|e| ConfigError(format!("{}: {e}", path.display())))?
            }
            None => FileConfig::default(),
        };
        let etcd = flag_or_file(self.etcd, file.etcd);
        let workers: Vec<StaticWorker> = if self.workers.is_empty() {
            file.workers
                .into_iter()
                .map(|w| match w {
                    WorkerEntry::Url(u) => StaticWorker::parse(&u),
                    WorkerEntry::Table(t) => StaticWorker::from_table(t),
                })
                .collect::<Result<_, _>>()?
        } else {
            self.workers
                .iter()
                .map(|w| StaticWorker::parse(w))
                .collect::<Result<_, _>>()?
        };
        let discovery = match (etcd.is_empty(), workers.is_empty()) {
            (false, true) => DiscoveryConfig::Etcd(
                EtcdAccessArgs {
                    etcd_user: self.etcd_access.etcd_user.clone().or(file.etcd_user),
                    etcd_password_file: self
                        .etcd_access
                        .etcd_password_file
                        .clone()
                        .or(file.etcd_password_file),
                    etcd_ca_files: flag_or_file(
                        self.etcd_access.etcd_ca_files.clone(),
                        file.etcd_ca_files,
                    ),
                }
                .apply(EtcdConfig {
                    root: self
                        .etcd_root
                        .or(file.etcd_root)
                        .unwrap_or_else(|| "switchyard".into()),
                    ..EtcdConfig::new(etcd)
                })?,
            ),
            (true, false) => DiscoveryConfig::Static {
                workers,
                model: self
                    .model
                    .or(file.model)
                    .unwrap_or_else(|| "mock-model".into()),
                block_size: self.block_size.or(file.block_size).unwrap_or(16).max(1),
                kv_events: self.kv_events.or(file.kv_events).unwrap_or(false),
                health_path: self
                    .health_path
                    .clone()
                    .or(file.health_path.clone())
                    .unwrap_or_else(|| "/health".into()),
            },
            (false, false) => {
                return Err(ConfigError(
                    "give either --etcd or --worker, not both".into(),
                ));
            }
            (true, true) => {
                return Err(ConfigError(
                    "no workers: give --etcd URL or --worker URL".into(),
                ));
            }
        };
        let default_policy = PolicySpec {
            spec: self
                .policy
                .or(file.policy)
                .unwrap_or_else(|| "kv-cost".into()),
            config: self
                .policy_config
                .or(file.policy_config)
                .unwrap_or_else(|| "{}".into()),
        };
        let mut endpoint_policies = BTreeMap::new();
        let mut endpoint_forward_authorization = BTreeMap::new();
        for (path, ep) in file.endpoints {
            let endpoint: EndpointPath = path
                .parse()
                .map_err(|e| ConfigError(format!("[endpoints.\"{path}\"]: {e}")))?;
            if let Some(forward) = ep.forward_authorization {
                endpoint_forward_authorization.insert(endpoint.clone(), forward);
            }
            if ep.policy.is_none() && ep.policy_config.is_none() {
                continue;
            }
            let spec = PolicySpec {
                spec: ep.policy.unwrap_or_else(|| default_policy.spec.clone()),
                config: ep.policy_config.unwrap_or_else(|| "{}".into()),
            };
            endpoint_policies.insert(endpoint, spec);
        }
        let kv_events_bind = flag_or_file(self.kv_events_bind, file.kv_events_bind);
        for address in &kv_events_bind {
            if !address.starts_with("tcp://") || !address.contains(':') {
                return Err(ConfigError(format!(
                    "--kv-events-bind `{address}` is not tcp://HOST:PORT"
                )));
            }
        }
        let defaults = GatewayConfig::default();
        let ca_files = flag_or_file(self.ca_files, file.ca_files);
        let tls = switchyard_net::upstream::Tls::with_ca_files(&ca_files)
            .map_err(|e| ConfigError(e.to_string()))?;
        let gateway = GatewayConfig {
            tls,
            max_body_bytes: self
                .max_body_bytes
                .or(file.max_body_bytes)
                .unwrap_or(defaults.max_body_bytes),
            max_body_bytes_total: self
                .max_body_bytes_total
                .or(file.max_body_bytes_total)
                .unwrap_or(defaults.max_body_bytes_total),
            max_prompt_tokens: self
                .max_prompt_tokens
                .or(file.max_prompt_tokens)
                .unwrap_or(defaults.max_prompt_tokens)
                .max(1),
            max_attempts: self
                .max_attempts
                .or(file.max_attempts)
                .unwrap_or(defaults.max_attempts)
                .max(1),
            connect_timeout: bounded(
                "connect_timeout_ms",
                self.connect_timeout_ms.or(file.connect_timeout_ms),
                Duration::from_millis,
                defaults.connect_timeout,
            )?,
            first_byte_timeout: bounded(
                "first_byte_timeout_secs",
                self.first_byte_timeout_secs
                    .or(file.first_byte_timeout_secs),
                Duration::from_secs,
                defaults.first_byte_timeout,
            )?,
            admin_token: admin_token(
                self.admin_token_on_command_line,
                file.admin_token,
                self.admin_token.or_else(|| {
                    std::env::var("SWITCHYARD_ADMIN_TOKEN")
                        .ok()
                        .filter(|t| !t.is_empty())
                }),
                self.admin_token_file.or(file.admin_token_file),
            )?,
            availability: self.availability.or(file.availability).unwrap_or(true),
            request_timeout: bounded(
                "request_timeout_secs",
                self.request_timeout_secs.or(file.request_timeout_secs),
                Duration::from_secs,
                defaults.request_timeout,
            )?,
            stream_idle_timeout: bounded(
                "stream_idle_timeout_secs",
                self.stream_idle_timeout_secs
                    .or(file.stream_idle_timeout_secs),
                Duration::from_secs,
                defaults.stream_idle_timeout,
            )?,
            client_idle_timeout: bounded(
                "client_idle_timeout_secs",
                self.client_idle_timeout_secs
                    .or(file.client_idle_timeout_secs),
                Duration::from_secs,
                defaults.client_idle_timeout,
            )?,
            max_connections: self
                .max_connections
                .or(file.max_connections)
                .unwrap_or(defaults.max_connections)
                .max(1),
            max_in_flight: self
                .max_in_flight
                .or(file.max_in_flight)
                .unwrap_or(defaults.max_in_flight)
                .max(1),
            outlier_detection: self
                .outlier_detection
                .or(file.outlier_detection)
                .unwrap_or(true),
            ..defaults
        };
        let od = OutlierConfig::default();
        let percent = |p: u32| f64::from(p.min(100)) / 100.0;
        let outlier = OutlierConfig {
            consecutive_failures: self
                .consecutive_failures
                .or(file.consecutive_failures)
                .unwrap_or(od.consecutive_failures)
                .max(1),
            max_ejection_share: self
                .max_ejection_percent
                .or(file.max_ejection_percent)
                .map_or(od.max_ejection_share, percent),
            panic_threshold: self
                .panic_threshold_percent
                .or(file.panic_threshold_percent)
                .map_or(od.panic_threshold, percent),
            base_ejection: bounded(
                "base_ejection_ms",
                self.base_ejection_ms.or(file.base_ejection_ms),
                Duration::from_millis,
                od.base_ejection,
            )?,
            max_ejection: bounded(
                "max_ejection_secs",
                self.max_ejection_secs.or(file.max_ejection_secs),
                Duration::from_secs,
                od.max_ejection,
            )?,
            health_interval: match self
                .health_check_interval_ms
                .or(file.health_check_interval_ms)
            {
                Some(0) => None,
                Some(ms) => Some(bounded(
                    "health_check_interval_ms",
                    Some(ms),
                    Duration::from_millis,
                    Duration::ZERO,
                )?),
                None => od.health_interval,
            },
            discovery_grace: bounded(
                "discovery_grace_secs",
                self.discovery_grace_secs.or(file.discovery_grace_secs),
                Duration::from_secs,
                od.discovery_grace,
            )?,
            busy_max: bounded(
                "max_retry_after_secs",
                self.max_retry_after_secs.or(file.max_retry_after_secs),
                Duration::from_secs,
                od.busy_max,
            )?,
            ..od
        };
        let outlier = if gateway.outlier_detection {
            outlier
        } else {
            OutlierConfig {
                consecutive_failures: 1,
                max_ejection_share: 1.0,
                panic_threshold: 0.0,
                // Probed 0.5 s after the failure, as before outlier detection.
                base_ejection: Duration::from_millis(500),
                max_ejection: Duration::from_millis(500),
                health_interval: None,
                discovery_grace: Duration::ZERO,
                ..outlier
            }
        };
        let approx_defaults = switchyard_router::Approximate::default();
        let prediction_ttl = self.prediction_ttl_secs.or(file.prediction_ttl_secs);
        let prediction_ttl = match prediction_ttl {
            None => approx_defaults.ttl,
            Some(t) => Duration::try_from_secs_f64(t)
                .ok()
                .filter(|d| !d.is_zero() && *d <= MAX_SETTING_DURATION)
                .ok_or_else(|| {
                    ConfigError(format!(
                        "prediction_ttl_secs = {t}: must be a positive number of seconds, at most a year"
                    ))
                })?,
        };
        let approximate = switchyard_router::Approximate {
            ttl: prediction_ttl,
            max_blocks: self
                .prediction_max_blocks
                .or(file.prediction_max_blocks)
                .unwrap_or(approx_defaults.max_blocks)
                .max(1),
        };
        let runtime_defaults = RuntimeConfig::default();
        let runtime = RuntimeConfig {
            call_budget: bounded(
                "policy_budget_ms",
                self.policy_budget_ms.or(file.policy_budget_ms),
                Duration::from_millis,
                runtime_defaults.call_budget,
            )?,
            memory_cap: self
                .policy_memory_mb
                .or(file.policy_memory_mb)
                .map_or(runtime_defaults.memory_cap, |mb| mb << 20),
            total_memory_cap: self
                .policy_memory_total_mb
                .or(file.policy_memory_total_mb)
                .map_or(runtime_defaults.total_memory_cap, |mb| mb << 20),
            warm_instances: self
                .policy_warm_instances
                .or(file.policy_warm_instances)
                .unwrap_or(runtime_defaults.warm_instances)
                .clamp(1, runtime_defaults.max_warm_instances),
            cache_dir: self
                .policy_cache
                .or(file.policy_cache)
                .or(runtime_defaults.cache_dir.clone()),
            allow_reject_all: self
                .policy_may_reject_all
                .or(file.policy_may_reject_all)
                .unwrap_or(false),
            ..runtime_defaults
        };
        let policy_trusted_keys = flag_or_file(self.policy_trusted_keys, file.policy_trusted_keys)
            .iter()
            .map(|path| switchyard_discovery::signing::PublicKey::load(path).map_err(ConfigError))
            .collect::<Result<Vec<_>, _>>()?;
        let kv_hash_key = match self.kv_hash_key.or(file.kv_hash_key) {
            Some(key) => key,
            // Only the router computes the chain: keyed at random, so that no client can
            // craft prompts whose blocks collide with others'.
            None if matches!(
                discovery,
                DiscoveryConfig::Static {
                    kv_events: false,
                    ..
                }
            ) =>
            {
                use std::hash::BuildHasher;
                std::hash::RandomState::new().hash_one(std::time::SystemTime::now()) | 1
            }
            // Workers may publish NDJSON events, hashed with the chain: they and the router
            // share the key, 0 unless both are given another.
            None => 0,
        };
        Ok(ServeConfig {
            kv_hash_key,
            listen: self
                .listen
                .or(file.listen)
                .unwrap_or_else(|| "127.0.0.1:8000".parse().expect("valid")),
            default_policy,
            endpoint_policies,
            watch: self.watch.or(file.watch).unwrap_or(false),
            tokenizer: self.tokenizer.or(file.tokenizer),
            chat_template: self.chat_template.or(file.chat_template),
            tokenizer_cache_tokens: self
                .tokenizer_cache_tokens
                .or(file.tokenizer_cache_tokens)
                .unwrap_or(switchyard_tokens::prefix::DEFAULT_BUDGET_TOKENS),
            gateway,
            runtime,
            client: ClientConfig {
                outlier,
                ..ClientConfig::default()
            },
            shutdown_grace: bounded(
                "shutdown_grace_secs",
                self.shutdown_grace_secs.or(file.shutdown_grace_secs),
                Duration::from_secs,
                Duration::from_secs(30),
            )?,
            approximate,
            engine_metrics: match self
                .engine_metrics_ms
                .or(file.engine_metrics_ms)
                .unwrap_or(1000)
            {
                0 => None,
                ms => Some(bounded(
                    "engine_metrics_ms",
                    Some(ms),
                    Duration::from_millis,
                    Duration::ZERO,
                )?),
            },
            kv_events_bind,
            forward_authorization: self
                .forward_authorization
                .or(file.forward_authorization)
                .unwrap_or(matches!(discovery, DiscoveryConfig::Static { .. })),
            endpoint_forward_authorization,
            policy_trusted_keys,
            admin_listen: self.admin_listen.or(file.admin_listen),
            endpoint_grace: bounded(
                "endpoint_grace_secs",
                self.endpoint_grace_secs.or(file.endpoint_grace_secs),
                Duration::from_secs,
                Duration::from_secs(600),
            )?,
            discovery,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f
    }

    #[test]
    fn the_admin_token_comes_from_a_private_file_or_the_environment_and_is_long() {
        use std::os::unix::fs::PermissionsExt;
        let args = |token: Option<&str>, path: Option<&std::path::Path>| ServeArgs {
            workers: vec!["http://a:1".into()],
            admin_token: token.map(str::to_string),
            admin_token_file: path.map(std::path::Path::to_path_buf),
            ..Default::default()
        };
        let private = |text: &str| {
            let f = file(text);
            std::fs::set_permissions(f.path(), std::fs::Permissions::from_mode(0o600)).unwrap();
            f
        };
        let f = private("s3cret-s3cret-s3cret\n");
        let c = args(None, Some(f.path())).resolve().unwrap();
        assert_eq!(
            c.gateway.admin_token.as_deref(),
            Some("s3cret-s3cret-s3cret")
        );
        let err = args(Some("x"), Some(f.path())).resolve().unwrap_err();
        assert!(err.to_string().contains("not both"), "{err}");
        let empty = private("  \n");
        let err = args(None, Some(empty.path())).resolve().unwrap_err();
        assert!(err.to_string().contains("is empty"), "{err}");
        let missing = std::path::Path::new("/nonexistent/token");
        assert!(args(None, Some(missing)).resolve().is_err());
        // Readable by others, too short, or on the command line: refused, saying why.
        std::fs::set_permissions(f.path(), std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = args(None, Some(f.path())).resolve().unwrap_err();
        assert!(err.to_string().contains("chmod 600"), "{err}");
        let err = args(Some("short"), None).resolve().unwrap_err();
        assert!(err.to_string().contains("at least 16"), "{err}");
        assert!(args(Some("a-long-enough-token"), None).resolve().is_ok());
        let err = ServeArgs {
            workers: vec!["http://a:1".into()],
            admin_token_on_command_line: Some("a-long-enough-token".into()),
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("process list"), "{err}");
    }

    #[test]
    fn flags_beat_the_file_and_the_file_beats_defaults() {
        let f = file(
            r#"
            listen = "127.0.0.1:9000"
            workers = ["http://127.0.0.1:8001/"]
            policy = "round-robin"
            max_attempts = 5
            [endpoints."default/other/generate"]
            policy = "kv-cost"
            policy_config = '{"overlap_weight": 2}'
            "#,
        );
        let args = ServeArgs {
            config: Some(f.path().into()),
            max_attempts: Some(2),
            ..Default::default()
        };
        let c = args.resolve().unwrap();
        assert_eq!(c.listen.port(), 9000);
        assert_eq!(c.gateway.max_attempts, 2);
        assert_eq!(c.default_policy.spec, "round-robin");
        let ep: EndpointPath = "default/other/generate".parse().unwrap();
        assert_eq!(c.endpoint_policies[&ep].config, r#"{"overlap_weight": 2}"#);
        match c.discovery {
            DiscoveryConfig::Static { workers, model, .. } => {
                assert_eq!(
                    workers,
                    vec![StaticWorker {
                        url: "http://127.0.0.1:8001".into(),
                        engine_events: None
                    }]
                );
                assert_eq!(model, "mock-model");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_policy_cache_directory_comes_from_the_flag_or_the_file() {
        let f = file("workers = [\"http://x:1\"]\npolicy_cache = \"/var/cache/sy\"\n");
        let c = ServeArgs {
            config: Some(f.path().into()),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        assert_eq!(c.runtime.cache_dir, Some(PathBuf::from("/var/cache/sy")));
        let c = ServeArgs {
            config: Some(f.path().into()),
            policy_cache: Some("/tmp/other".into()),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        assert_eq!(c.runtime.cache_dir, Some(PathBuf::from("/tmp/other")));
    }

    #[test]
    fn prediction_lifetime_and_size_come_from_flags_or_the_file() {
        let f = file(
            "workers = [\"http://x:1\"]\nprediction_ttl_secs = 6.5\nprediction_max_blocks = 5000\n",
        );
        let c = ServeArgs {
            config: Some(f.path().into()),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        assert_eq!(c.approximate.ttl, Duration::from_millis(6500));
        assert_eq!(c.approximate.max_blocks, 5000);
        let c = ServeArgs {
            config: Some(f.path().into()),
            prediction_ttl_secs: Some(30.0),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        assert_eq!(c.approximate.ttl, Duration::from_secs(30));
        let err = ServeArgs {
            config: Some(f.path().into()),
            prediction_ttl_secs: Some(0.0),
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("prediction_ttl_secs"), "{err}");
    }

    /// A duration past a year would overflow `Instant` arithmetic on the request path;
    /// each is refused at start with the setting's name, whether from a flag or the file.
    /// The chain is keyed at random where only the router computes it, shared (0, or
    /// the key given) where workers may publish NDJSON events hashed with it.
    #[test]
    fn the_hash_chain_is_keyed_at_random_only_where_no_worker_computes_it() {
        let args = |kv_events: Option<bool>, key: Option<u64>| ServeArgs {
            workers: vec!["http://a:1".into()],
            kv_events,
            kv_hash_key: key,
            ..Default::default()
        };
        let (a, b) = (
            args(None, None).resolve().unwrap().kv_hash_key,
            args(None, None).resolve().unwrap().kv_hash_key,
        );
        assert!(a != 0 && b != 0 && a != b, "{a} {b}");
        assert_eq!(args(Some(true), None).resolve().unwrap().kv_hash_key, 0);
        assert_eq!(
            args(Some(true), Some(42)).resolve().unwrap().kv_hash_key,
            42
        );
        assert_eq!(args(None, Some(42)).resolve().unwrap().kv_hash_key, 42);
    }

    #[test]
    fn durations_that_would_overflow_a_clock_are_refused_by_name() {
        let f = file("workers = [\"http://x:1\"]\nrequest_timeout_secs = 18446744073709551615\n");
        let err = ServeArgs {
            config: Some(f.path().into()),
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("request_timeout_secs"), "{err}");
        let workers = vec!["http://x:1".to_string()];
        for args in [
            ServeArgs {
                prediction_ttl_secs: Some(1e19),
                ..Default::default()
            },
            ServeArgs {
                max_retry_after_secs: Some(u64::MAX),
                ..Default::default()
            },
            ServeArgs {
                base_ejection_ms: Some(u64::MAX),
                ..Default::default()
            },
            ServeArgs {
                shutdown_grace_secs: Some(u64::MAX / 2),
                ..Default::default()
            },
        ] {
            let err = ServeArgs {
                workers: workers.clone(),
                ..args
            }
            .resolve()
            .unwrap_err();
            assert!(err.to_string().contains("a year"), "{err}");
        }
        let c = ServeArgs {
            workers,
            max_retry_after_secs: Some(3600),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        assert_eq!(c.client.outlier.busy_max, Duration::from_secs(3600));
    }

    #[test]
    fn unknown_keys_and_missing_workers_are_errors() {
        let f = file("workers = [\"http://x:1\"]\npolcy = \"kv-cost\"\n");
        let err = ServeArgs {
            config: Some(f.path().into()),
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("unknown field `polcy`"), "{err}");
        let err = ServeArgs::default().resolve().unwrap_err();
        assert!(err.to_string().contains("no workers"), "{err}");
        let err = ServeArgs {
            workers: vec!["localhost:1".into()],
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(err.to_string().contains("not an http(s) URL"), "{err}");
    }

    #[test]
    fn workers_name_their_engines_kv_event_sockets_on_the_command_line_or_in_the_file() {
        let w = StaticWorker::parse(
            "http://10.0.0.7:8000/#kv_events=tcp://10.0.0.7:5557&kv_replay=tcp://10.0.0.7:5558&topic=kv&dp=2",
        )
        .unwrap();
        assert_eq!(w.url, "http://10.0.0.7:8000");
        let src = w.engine_events.unwrap();
        assert_eq!(src.endpoint, "tcp://10.0.0.7:5557");
        assert_eq!(src.replay.as_deref(), Some("tcp://10.0.0.7:5558"));
        assert_eq!((src.topic.as_str(), src.data_parallel_size), ("kv", 2));
        // Central mode: the engine connects to the router; its topic names it.
        let w =
            StaticWorker::parse("http://h:1#kv_events=bound&topic=w1&kv_replay=tcp://h:2").unwrap();
        assert_eq!(w.engine_events.unwrap().endpoint, "bound");
        for bad in [
            "http://h:1#kv_events=tcp://*:5557",
            "http://h:1#kv_events=ipc:///tmp/x",
            "http://h:1#kv_replay=tcp://h:2",
            "http://h:1#kv_events=tcp://h:2&dp=0",
            "http://h:1#kv_event=tcp://h:2",
            "http://h:1#kv_events=bound",
        ] {
            assert!(StaticWorker::parse(bad).is_err(), "{bad}");
        }
        let f = file(
            "[[workers]]\nurl = \"http://a:8000\"\nkv_events = \"tcp://a:5557\"\n\n[[workers]]\nurl = \"http://b:8000\"\n",
        );
        let c = ServeArgs {
            config: Some(f.path().into()),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        let DiscoveryConfig::Static { workers, .. } = c.discovery else {
            panic!()
        };
        assert_eq!(
            workers[0].engine_events,
            Some(EngineEventSource::new("tcp://a:5557"))
        );
        assert_eq!(workers[1].engine_events, None);
    }
}
