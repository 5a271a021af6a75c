//! `switchyard mock-worker`: simulated engines, configured from flags.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use switchyard::discovery::etcd::EtcdConfig;
use switchyard::discovery::etcd_register::Registration;
use switchyard::discovery::{EndpointPath, Role};
use switchyard::worker::{
    DEFAULT_MAX_BATCHED_TOKENS, EngineConfig, Fault, FaultConfig, MockWorker, MockWorkerConfig,
    PdConfig, PdProtocol, TimingModel,
};

use super::shutdown_signal;

#[derive(Args)]
pub struct MockWorkerArgs {
    /// Key of the block-hash chain of its NDJSON events: the routers' `--kv-hash-key`.
    #[arg(long, env = "SWITCHYARD_KV_HASH_KEY", default_value_t = 0)]
    pub kv_hash_key: u64,
    /// Address of the first worker; further workers (`--count`) take the next ports.
    #[arg(long, default_value = "127.0.0.1:8001")]
    pub listen: std::net::SocketAddr,
    /// Workers to run in this process.
    #[arg(long, default_value_t = 1)]
    pub count: u16,
    /// The model name served.
    #[arg(long, default_value = "mock-model")]
    pub model: String,
    /// Hugging Face `tokenizer.json` for prompts [default: the built-in tokenizer]: the
    /// same file as the router's, so both cut prompts into the same blocks.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// The model's chat template: a `tokenizer_config.json` or a Jinja file [default:
    /// the one beside `--tokenizer`, else ChatML].
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// KV cache size, in blocks, per worker.
    #[arg(long, default_value_t = 8192)]
    pub kv_blocks: usize,
    /// Most requests running at once per worker (vLLM's `--max-num-seqs`, SGLang's
    /// `--max-running-requests`); more wait in its queue.
    #[arg(long, alias = "max-num-seqs", default_value_t = 64)]
    pub max_batch: usize,
    /// Most tokens computed in one engine step (vLLM's `--max-num-batched-tokens`,
    /// SGLang's `--chunked-prefill-size`): longer prompts are prefilled in chunks between
    /// decode steps. 0 computes each prompt whole in one step.
    #[arg(long, alias = "chunked-prefill-size", default_value_t = DEFAULT_MAX_BATCHED_TOKENS)]
    pub max_num_batched_tokens: u64,
    /// The model's context in tokens, prompt and answer together (vLLM's
    /// `--max-model-len`, SGLang's `--context-length`): a chat that sets no `max_tokens`
    /// is answered up to it. Default: what the KV cache holds.
    #[arg(long, alias = "context-length")]
    pub max_model_len: Option<u64>,
    /// The simulated model ends its answer by itself (`finish_reason` "stop") when prompt
    /// and answer reach a multiple of this many tokens. 0: never, as with `ignore_eos`
    /// (an answer runs to its limit).
    #[arg(long, default_value_t = 0)]
    pub eos_period: u32,
    /// Tokens per streamed chunk (vLLM's `--stream-interval`): the first token alone,
    /// then a chunk every this many tokens, and the rest with the finish.
    #[arg(long, default_value_t = 1)]
    pub stream_interval: u32,
    /// Run simulated time this many times faster.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Timing model: prefill cost per uncached prompt token, in µs.
    #[arg(long, default_value_t = TimingModel::default().prefill_us_per_token)]
    pub prefill_us_per_token: f64,
    /// Timing model: fixed cost of a decode step, in µs.
    #[arg(long, default_value_t = TimingModel::default().decode_base_us)]
    pub decode_base_us: f64,
    /// Timing model: added decode-step cost per running sequence, in µs.
    #[arg(long, default_value_t = TimingModel::default().decode_us_per_seq)]
    pub decode_us_per_seq: f64,
    /// Register the workers in this etcd (comma-separated URLs); no discovery without it.
    #[arg(long = "etcd", env = "SWITCHYARD_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Root of Switchyard's keys in etcd.
    #[arg(long, env = "SWITCHYARD_ETCD_ROOT", default_value = "switchyard")]
    pub etcd_root: String,
    #[command(flatten)]
    pub etcd_access: switchyard::config::EtcdAccessArgs,
    /// Endpoint path to register under (default: default/MODEL/generate).
    #[arg(long)]
    pub endpoint: Option<EndpointPath>,
    /// Registration lease TTL in seconds.
    #[arg(long, default_value_t = 10)]
    pub ttl: u64,
    /// Inject a fault.
    #[arg(long, value_enum, default_value = "none")]
    pub fault: Fault,
    /// The fault starts after this many completion requests.
    #[arg(long, default_value_t = 0)]
    pub fault_after: u64,
    /// Status of `--fault status` and of `--fault-marker` prompts [default: 500].
    #[arg(long)]
    pub fault_status: Option<u16>,
    /// `Retry-After` (seconds) on those answers.
    #[arg(long)]
    pub fault_retry_after_secs: Option<f64>,
    /// Where a stream's `crash`, `cut-stream` or `stall` strikes: after this many tokens
    /// [default: crash at once, cut half-way, stall after the first].
    #[arg(long)]
    pub fault_after_tokens: Option<u32>,
    /// Prompts containing this text fail (a "poison" request), whatever the fault.
    #[arg(long)]
    pub fault_marker: Option<String>,
    /// Instead of failing, marked prompts' streams are cut after this many tokens.
    #[arg(long)]
    pub fault_marker_after_tokens: Option<u32>,
    /// `/health` answers 200 whatever the fault.
    #[arg(long)]
    pub health_lies: bool,
    /// Every completion waits this long before it starts, ms (a slow first token).
    #[arg(long, default_value_t = 0)]
    pub first_token_delay_ms: u64,
    /// On SIGTERM, deregister at once, then go on serving the requests running for up to
    /// this long before exiting (what is still running then is cut), seconds.
    #[arg(long, default_value_t = 0)]
    pub shutdown_grace_secs: u64,
    /// Close keep-alive connections idle this long, ms (uvicorn closes after 5 s).
    #[arg(long)]
    pub idle_close_ms: Option<u64>,
    /// Also publish KV events in vLLM's ZMQ format: the PUB socket on this port and the
    /// replay socket on the next (worker `i` of `--count` on `PORT + 2i`; 0: any free
    /// ports); registered workers then advertise these sockets instead of the NDJSON
    /// stream.
    #[arg(long)]
    pub zmq_events: Option<u16>,
    /// The topic of those events.
    #[arg(long, default_value = "kv-events")]
    pub zmq_topic: String,
    /// A LoRA adapter served besides the model (vLLM's `--lora-modules` name; repeatable):
    /// a request naming it is answered as the model, its blocks keyed with its name.
    #[arg(long = "lora-adapter", value_delimiter = ',')]
    pub lora_adapters: Vec<String>,
    /// Serve HTTPS with this PEM certificate chain (with `--tls-key`).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of `--tls-cert`.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Completions need `Authorization: Bearer KEY` (vLLM's `--api-key`).
    #[arg(long, env = "SWITCHYARD_MOCK_API_KEY")]
    pub api_key: Option<String>,
    /// Its part in a fleet that splits prefill from decode: `prefill`, `decode` or `both`
    /// (an aggregated worker).
    #[arg(long, default_value_t = Role::Both)]
    pub role: Role,
    /// The engine a disaggregated worker plays: `vllm` serves a request without handoff
    /// fields whole, `sglang` refuses it. Either way it takes part in both handoffs, vLLM's
    /// `kv_transfer_params` and SGLang's bootstrap rooms (with `--bootstrap-port`).
    #[arg(long, value_enum, default_value = "vllm")]
    pub pd_protocol: PdProtocol,
    /// A prefill worker's bootstrap server port for SGLang's handoff (worker `i` of
    /// `--count` on `PORT + i`), registered with it (the router then hands over SGLang's
    /// way).
    #[arg(long)]
    pub bootstrap_port: Option<u16>,
    /// Simulated wire time per token of the KV blocks a decode worker receives from a
    /// prefill worker, microseconds (divided by `--speedup`).
    #[arg(long, default_value_t = PdConfig::default().transfer_us_per_token)]
    pub kv_transfer_us_per_token: f64,
}

/// The workers' configuration from the flags, checked.
fn config(args: &MockWorkerArgs) -> anyhow::Result<MockWorkerConfig> {
    anyhow::ensure!(args.count >= 1, "--count must be at least 1");
    anyhow::ensure!(args.speedup > 0.0, "--speedup must be positive");
    anyhow::ensure!(
        args.block_size >= 1 && args.kv_blocks >= 1 && args.max_batch >= 1,
        "sizes must be at least 1"
    );
    anyhow::ensure!(
        args.kv_transfer_us_per_token.is_finite() && args.kv_transfer_us_per_token >= 0.0,
        "--kv-transfer-us-per-token must be a finite number >= 0"
    );
    match (args.role, args.pd_protocol, args.bootstrap_port) {
        (Role::Prefill, PdProtocol::Sglang, None) => {
            anyhow::bail!("an SGLang-style prefill worker needs --bootstrap-port")
        }
        (Role::Prefill, _, _) | (_, _, None) => {}
        (_, _, Some(_)) => {
            anyhow::bail!("--bootstrap-port is a prefill worker's (--role prefill)")
        }
    }
    let tokenizer = switchyard::tokens::Tokenizer::from_file_if_any(args.tokenizer.as_deref())?;
    Ok(MockWorkerConfig {
        model: args.model.clone(),
        engine: EngineConfig {
            block_size: args.block_size,
            kv_blocks: args.kv_blocks,
            max_batch: args.max_batch,
            speedup: args.speedup,
            max_batched_tokens: args.max_num_batched_tokens,
            max_model_len: args.max_model_len,
            eos_period: args.eos_period,
            stream_interval: args.stream_interval.max(1),
            timing: TimingModel {
                prefill_us_per_token: args.prefill_us_per_token,
                decode_base_us: args.decode_base_us,
                decode_us_per_seq: args.decode_us_per_seq,
            },
        },
        hash_seed: args.kv_hash_key,
        fault: FaultConfig {
            fault: args.fault,
            after: args.fault_after,
            status: args.fault_status,
            retry_after_secs: args.fault_retry_after_secs,
            after_tokens: args.fault_after_tokens,
            marker: args.fault_marker.clone(),
            marker_after_tokens: args.fault_marker_after_tokens,
            health_lies: args.health_lies,
            first_token_delay_ms: args.first_token_delay_ms,
            idle_close_ms: args.idle_close_ms,
        },
        tokenizer,
        chat: Some(std::sync::Arc::new(
            switchyard::tokens::ChatFormat::resolve(
                args.chat_template.as_deref(),
                args.tokenizer.as_deref(),
            )?,
        )),
        zmq_events: None,
        lora_adapters: args.lora_adapters.clone(),
        api_key: args.api_key.clone(),
        pd: PdConfig {
            role: args.role,
            protocol: args.pd_protocol,
            bootstrap_port: args.bootstrap_port,
            transfer_us_per_token: args.kv_transfer_us_per_token,
        },
        tls: match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => Some(
                switchyard::worker::server::server_tls(cert, key).map_err(anyhow::Error::msg)?,
            ),
            _ => None,
        },
    })
}

pub async fn mock_worker(args: MockWorkerArgs) -> anyhow::Result<()> {
    let config = config(&args)?;
    let endpoint = args
        .endpoint
        .clone()
        .unwrap_or_else(|| EndpointPath::for_model(&args.model));
    let mut workers = Vec::new();
    let mut registrations = Vec::new();
    for i in 0..args.count {
        // Port 0: each worker on a free port of its own (printed below).
        let port = match args.listen.port() {
            0 => 0,
            base => base
                .checked_add(i)
                .ok_or_else(|| anyhow::anyhow!("port overflow"))?,
        };
        let addr = std::net::SocketAddr::new(args.listen.ip(), port);
        let mut config = config.clone();
        if let Some(base) = args.bootstrap_port {
            config.pd.bootstrap_port = Some(
                base.checked_add(i)
                    .ok_or_else(|| anyhow::anyhow!("--bootstrap-port overflow"))?,
            );
        }
        if let Some(base) = args.zmq_events {
            // Port 0: any free ports (the registration says which).
            let port = |k: u16| {
                if base == 0 {
                    return Ok(0);
                }
                base.checked_add(2 * i + k)
                    .ok_or_else(|| anyhow::anyhow!("--zmq-events port overflow"))
            };
            config.zmq_events = Some(switchyard::worker::zmq::ZmqEventsConfig {
                publish: std::net::SocketAddr::new(args.listen.ip(), port(0)?),
                replay: Some(std::net::SocketAddr::new(args.listen.ip(), port(1)?)),
                topic: args.zmq_topic.clone(),
            });
        }
        let worker = MockWorker::bind(config, addr)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))?;
        let id = super::register::random_instance_id();
        if !args.etcd.is_empty() {
            let etcd = args.etcd_access.apply(EtcdConfig {
                root: args.etcd_root.clone(),
                ..EtcdConfig::new(args.etcd.clone())
            })?;
            let info = worker.instance_info(id, endpoint.clone());
            let mut reg = Registration::start(etcd, &info, Duration::from_secs(args.ttl));
            reg.wait_registered(Duration::from_secs(15)).await?;
            registrations.push(reg);
        }
        println!(
            "mock worker {}/{}: {} model={} instance={id} kv_blocks={} block_size={}{}",
            i + 1,
            args.count,
            worker.url(),
            args.model,
            args.kv_blocks,
            args.block_size,
            worker.engine_events().map_or(String::new(), |e| format!(
                " kv_events={} kv_replay={}",
                e.endpoint,
                e.replay.unwrap_or_default()
            )) + &match (args.role, worker.bootstrap_port()) {
                (Role::Both, _) => String::new(),
                (role, None) => format!(" role={role}"),
                (role, Some(p)) => format!(" role={role} bootstrap_port={p}"),
            }
        );
        workers.push(worker);
    }
    if !registrations.is_empty() {
        println!(
            "registered {} worker(s) under {endpoint} in etcd",
            registrations.len()
        );
    }
    shutdown_signal().await;
    for reg in registrations {
        reg.stop().await;
    }
    // Requests running go on for the grace (bounded: checked every 50 ms).
    let deadline = std::time::Instant::now() + Duration::from_secs(args.shutdown_grace_secs);
    while std::time::Instant::now() < deadline
        && workers.iter().any(|w| {
            let s = w.stats();
            s.running + s.waiting > 0
        })
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for w in workers {
        w.shutdown().await;
    }
    println!("stopped");
    Ok(())
}
