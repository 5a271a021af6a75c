//! The flags of `switchyard serve`, each with its `SWITCHYARD_*` variable.

use std::net::SocketAddr;
use std::path::PathBuf;

use super::EtcdAccessArgs;

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
    /// Kubernetes discovery: a GIE InferencePool or a pod selector.
    #[command(flatten)]
    pub kube: super::kube::KubeArgs,
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
    /// Also serve the endpoint picker (Envoy's ext_proc over gRPC, as Gateway API
    /// Inference Extension gateways ask it) on this address.
    #[arg(long, env = "SWITCHYARD_EPP_LISTEN")]
    pub epp_listen: Option<SocketAddr>,
    /// Other workers the endpoint picker names after each pick, for a gateway to retry
    /// on (Envoy's override_host policy); 0 for a gateway that reads one endpoint (an
    /// ORIGINAL_DST cluster) [default: 0, at most 8].
    #[arg(long, env = "SWITCHYARD_EPP_FALLBACKS")]
    pub epp_fallbacks: Option<usize>,
    /// Name the endpoint that served each answer, as the gateway reported it, in the
    /// answer's `x-gateway-destination-endpoint-served` header (what GIE's conformance
    /// picker reports; it tells clients a worker's address) [default: false].
    #[arg(long, env = "SWITCHYARD_EPP_REPORT_SERVED")]
    pub epp_report_served: Option<bool>,
    /// Serve the endpoint picker over TLS with this certificate chain (PEM), as GIE's
    /// reference picker does; with `--epp-tls-key`.
    #[arg(long, env = "SWITCHYARD_EPP_TLS_CERT")]
    pub epp_tls_cert: Option<PathBuf>,
    /// The private key (PEM) of `--epp-tls-cert`.
    #[arg(long, env = "SWITCHYARD_EPP_TLS_KEY")]
    pub epp_tls_key: Option<PathBuf>,
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
    /// Times a stream that breaks mid-answer (worker gone, stalled, or failing) is
    /// continued on another worker; 0 ends it with an error event [default: 2].
    #[arg(long, env = "SWITCHYARD_MIGRATION_LIMIT")]
    pub migration_limit: Option<u32>,
    /// Ask vLLM workers for token IDs on streams that may be migrated
    /// (`return_token_ids`, taken out again before the client sees them), so that a
    /// continuation is exact: the prompt and answer so far as token IDs, not as text
    /// [default: true].
    #[arg(long, env = "SWITCHYARD_MIGRATION_TOKEN_IDS")]
    pub migration_token_ids: Option<bool>,
    /// How long a worker that deregistered may go on streaming before its streams are
    /// moved to other workers, seconds [default: 20].
    #[arg(long, env = "SWITCHYARD_DRAIN_GRACE_SECS")]
    pub drain_grace_secs: Option<u64>,
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
    /// LoRA adapters the workers serve (vLLM's `--lora-modules` names), as `NAME` (an
    /// adapter of `--model`) or `NAME=BASE_MODEL`; repeatable. A request naming one is
    /// routed among its base model's workers, on the blocks engines key with its name.
    #[arg(
        long = "lora-adapter",
        env = "SWITCHYARD_LORA_ADAPTERS",
        value_delimiter = ','
    )]
    pub lora_adapters: Vec<String>,
    /// Memory for engines' KV event input, MiB: every batch read from an engine's (or a
    /// central-mode peer's) socket, queued or being replayed, is held against it; a
    /// connection whose next message does not fit is closed (a gap, replayed or marked
    /// incomplete) [default: 512].
    #[arg(long, env = "SWITCHYARD_KV_EVENTS_MEMORY_MIB")]
    pub kv_events_memory_mib: Option<u64>,
    /// Most requests waiting in the router's queue per endpoint when every worker is
    /// saturated; 0 turns the queue off [default: 1024].
    #[arg(long, env = "SWITCHYARD_QUEUE_MAX")]
    pub queue_max: Option<usize>,
    /// Most bytes of request bodies waiting per endpoint [default: 268435456].
    #[arg(long, env = "SWITCHYARD_QUEUE_MAX_BYTES")]
    pub queue_max_bytes: Option<usize>,
    /// A worker whose engine queue (its reported waiting requests, and those routed
    /// beyond the batch it was seen running) reaches this is saturated; 0: never
    /// [default: 0: engines that chunk prefills queue while they have room].
    #[arg(long, env = "SWITCHYARD_SATURATION_QUEUED")]
    pub saturation_queued: Option<u32>,
    /// A worker whose reported KV usage reaches this share is saturated; above 1: never
    /// [default: never: a full cache with an empty queue is busy, not saturated].
    #[arg(long, env = "SWITCHYARD_SATURATION_KV_USAGE")]
    pub saturation_kv_usage: Option<f32>,
    /// A worker with this many requests in flight is saturated: the concurrency your
    /// workers meet their latency objectives at, or a limit for workers that report no
    /// load; 0: no limit [default: 0].
    #[arg(long, env = "SWITCHYARD_SATURATION_MAX_IN_FLIGHT")]
    pub saturation_max_in_flight: Option<u32>,
    /// A worker with this many uncached prompt tokens routed to it and not yet
    /// prefilled is saturated (a new request would wait for them); 0: no limit
    /// [default: 0].
    #[arg(long, env = "SWITCHYARD_SATURATION_PREFILL_TOKENS")]
    pub saturation_prefill_tokens: Option<u64>,
    /// A worker that would make a new request wait this long for the prefill already
    /// routed to it (its unprefilled tokens at the prefill rate measured from its first
    /// tokens) is saturated: when every worker is, requests wait in the router's queue,
    /// and leave it for the worker the policy places them on once it is below it; 0:
    /// never [default: 1000].
    #[arg(long, env = "SWITCHYARD_SATURATION_WAIT_MS")]
    pub saturation_wait_ms: Option<u64>,
    /// A worker whose engine queues requests (it reports some waiting) while as many
    /// are in flight there as it was ever seen running is saturated: a request sent
    /// there would wait in the engine's queue for a slot [default: true].
    #[arg(long, env = "SWITCHYARD_SATURATION_BATCH_FULL")]
    pub saturation_batch_full: Option<bool>,
    /// The header naming a request's tenant [default: x-switchyard-tenant].
    #[arg(long, env = "SWITCHYARD_TENANT_HEADER")]
    pub tenant_header: Option<String>,
}
