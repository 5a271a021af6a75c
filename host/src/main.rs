//! The `switchyard` command line: the only place that reads the environment, sets up
//! logging and turns errors into exit codes.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use switchyard::config::ServeArgs;
use switchyard::discovery::etcd::{EtcdConfig, list_all};
use switchyard::discovery::etcd_policy::{self, PushedPolicy};
use switchyard::discovery::etcd_register::Registration;
use switchyard::discovery::signing::{self, SigningKey};
use switchyard::discovery::{EndpointPath, InstanceInfo};
use switchyard::ids::InstanceId;
use switchyard::local::{LocalFleet, LocalFleetConfig};
use switchyard::policy::{BUILTINS, CallOutcome, PolicyEngine, RuntimeConfig};
use switchyard::serve::serve;
use switchyard::worker::{
    EngineConfig, Fault, FaultConfig, MockWorker, MockWorkerConfig, TimingModel,
};

/// A KV-cache-aware router for LLM inference fleets, with sandboxed Wasm routing policies.
#[derive(Parser)]
#[command(name = "switchyard", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Inspect and validate routing policies.
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// Register an existing OpenAI-compatible server (e.g. a vLLM worker) in etcd and keep
    /// its lease alive until stopped (Ctrl-C / SIGTERM revoke it at once).
    Register(RegisterArgs),
    /// Run the router: OpenAI-compatible HTTP in front of discovered workers.
    Serve(Box<ServeArgs>),
    /// Start a few mock workers and the router in this process, on embedded defaults: no
    /// etcd, no files. Prints the URL and a request to try.
    Demo {
        /// Router address.
        #[arg(long, default_value = "127.0.0.1:8000")]
        listen: std::net::SocketAddr,
        /// Mock workers to start.
        #[arg(long, default_value_t = 3)]
        workers: u16,
        /// Run the workers' simulated time this many times faster.
        #[arg(long, default_value_t = 1.0)]
        speedup: f64,
        /// Routing policy (built-in name or `.wasm`).
        #[arg(long, default_value = "kv-cost")]
        policy: String,
    },
    /// Replay a Mooncake-format trace through the real router in front of mock workers,
    /// once per policy, and print TTFT, latency, throughput and prefix hit rate.
    Replay(ReplayArgs),
    /// Write a synthetic multi-turn trace (Mooncake format) to stdout: conversations that
    /// resend their history, shared system prompts, Poisson or bursty arrivals, short and
    /// long messages mixed.
    TraceGen(TraceGenArgs),
    /// Run simulated LLM workers (CPU only): OpenAI-compatible endpoints, a KV cache with
    /// prefix reuse and LRU eviction, continuous batching, a KV event stream, and fault
    /// injection.
    MockWorker(MockWorkerArgs),
    /// List the instances registered in etcd.
    Instances {
        #[command(flatten)]
        etcd: EtcdArgs,
    },
}

#[derive(Args)]
struct EtcdArgs {
    /// etcd client URL(s), comma-separated.
    #[arg(
        long = "etcd",
        env = "SWITCHYARD_ETCD",
        value_delimiter = ',',
        required = true
    )]
    endpoints: Vec<String>,
    /// Root of Switchyard's keys in etcd.
    #[arg(long, env = "SWITCHYARD_ETCD_ROOT", default_value = "switchyard")]
    etcd_root: String,
    #[command(flatten)]
    access: switchyard::config::EtcdAccessArgs,
}

impl EtcdArgs {
    fn config(&self) -> anyhow::Result<EtcdConfig> {
        Ok(self.access.apply(EtcdConfig {
            root: self.etcd_root.clone(),
            ..EtcdConfig::new(self.endpoints.clone())
        })?)
    }
}

#[derive(Args)]
struct TraceGenArgs {
    /// Requests.
    #[arg(long, default_value_t = switchyard::replay::synth::SynthConfig::default().requests)]
    requests: usize,
    /// Mean arrivals per second of trace time.
    #[arg(long, default_value_t = switchyard::replay::synth::SynthConfig::default().rate)]
    rate: f64,
    /// Requests arriving at the same instant (1: Poisson arrivals).
    #[arg(long, default_value_t = switchyard::replay::synth::SynthConfig::default().burst)]
    burst: usize,
    /// Mean turns per conversation.
    #[arg(long, default_value_t = switchyard::replay::synth::SynthConfig::default().turns)]
    turns: f64,
    /// Least seconds between two turns of a conversation.
    #[arg(long, default_value_t = switchyard::replay::synth::SynthConfig::default().think_secs)]
    think_secs: f64,
    /// Distinct system prompts.
    #[arg(long, default_value_t = switchyard::replay::synth::SynthConfig::default().system_prompts)]
    system_prompts: usize,
    /// Tokens per system prompt.
    #[arg(long, default_value_t = switchyard::replay::synth::SynthConfig::default().system_tokens)]
    system_tokens: u32,
    /// Share of user messages that are long documents.
    #[arg(long, default_value_t = switchyard::replay::synth::SynthConfig::default().long_fraction)]
    long_fraction: f64,
    /// Short messages: most tokens.
    #[arg(long, default_value_t = switchyard::replay::synth::SynthConfig::default().short_tokens.1)]
    short_max: u32,
    /// Long messages: most tokens.
    #[arg(long, default_value_t = switchyard::replay::synth::SynthConfig::default().long_tokens.1)]
    long_max: u32,
    /// Seed.
    #[arg(long, default_value_t = switchyard::replay::synth::SynthConfig::default().seed)]
    seed: u64,
}

#[derive(Args)]
struct ReplayArgs {
    /// The trace (JSON lines: timestamp, input_length, output_length, hash_ids).
    trace: PathBuf,
    /// Policies to compare, each on fresh workers: built-in names or `.wasm` paths, each
    /// optionally followed by `=` and its JSON configuration. Repeat the flag or separate
    /// with commas (commas inside a JSON configuration are kept). `none` runs no policy
    /// in process (only the `--router`s).
    #[arg(long = "policy", default_value = "kv-cost,round-robin,random")]
    policies: Vec<String>,
    /// Mock workers.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// KV cache per worker, in blocks.
    #[arg(long, default_value_t = 65536)]
    kv_blocks: usize,
    /// Timing model: prefill cost per uncached prompt token, in µs.
    #[arg(long, default_value_t = TimingModel::default().prefill_us_per_token)]
    prefill_us_per_token: f64,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 64)]
    block_size: u32,
    /// Most requests running at once per worker.
    #[arg(long, default_value_t = 32)]
    max_batch: usize,
    /// Replay this many times faster than the trace (the workers' time runs as fast).
    #[arg(long, default_value_t = 20.0)]
    speedup: f64,
    /// Replay at most this many requests.
    #[arg(long, default_value_t = 1000)]
    max_requests: usize,
    /// How the in-process router learns the workers' caches: `zmq` (vLLM's ZMQ events,
    /// as engines publish them), `ndjson` (the mock workers' own stream) or `none`
    /// (approximate mode: predicted from its decisions, predictions living 120 s of
    /// simulated time). Several, comma-separated, run every policy once per mode.
    #[arg(long, default_value = "zmq", value_delimiter = ',')]
    kv_events: Vec<switchyard::local::KvEventsMode>,
    /// Another program as the client, a shell command: `{url}` (the router), `{trace}`
    /// (the requests, timestamps divided by the speedup), `{out}` (a directory where it
    /// must leave aiperf's `profile_export.jsonl`), `{model}`. E.g. `aiperf profile
    /// --url {url} --model {model} --endpoint-type completions --streaming --input-file
    /// {trace} --custom-dataset-type mooncake_trace --fixed-schedule --artifact-dir {out}
    /// --tokenizer ...`. Its files go to `--router-logs`.
    #[arg(long)]
    client: Option<String>,
    /// The mock workers' `tokenizer.json` (and the in-process router's; give external
    /// routers the same file in their command) [default: the built-in tokenizer].
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Stop sending after this many seconds per policy.
    #[arg(long, default_value_t = 300)]
    duration: u64,
    /// Cap on generated tokens per request.
    #[arg(long, default_value_t = 256)]
    max_output: u32,
    /// Also replay through a router run as a process of its own, as `NAME=COMMAND`
    /// (repeatable), on fresh mock workers after the policies. In COMMAND, `{port}` is the
    /// port it must listen on at 127.0.0.1, `{workers}` the workers' URLs separated by
    /// spaces, `{workers_comma}` by commas, `{worker_args}` `--worker URL` per worker.
    /// Its CPU time and peak memory are reported; every run then sends text prompts.
    #[arg(long = "router")]
    routers: Vec<String>,
    /// Router replicas: with N above 1, every policy also runs through N in-process
    /// routers sharing the workers (each with its own state, as N `serve` processes),
    /// the requests sent to them in turn, beside its run through one.
    #[arg(long = "routers", default_value_t = 1)]
    replicas: usize,
    /// A policy that decides as a shadow beside every policy run (built-in name or
    /// `.wasm` path, `=CONFIG` optionally): one run compares them on the same decisions
    /// (agreement, cache used, predicted cost) in the decision telemetry table.
    #[arg(long)]
    shadow: Option<String>,
    /// Where the external routers' output goes.
    #[arg(long, default_value = "replay-logs")]
    router_logs: PathBuf,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "replay-results.json")]
    json: PathBuf,
    /// Where to write the TTFT chart (SVG).
    #[arg(long, default_value = "replay-ttft.svg")]
    chart: PathBuf,
}

#[derive(Args)]
struct MockWorkerArgs {
    /// Key of the block-hash chain of its NDJSON events: the routers' `--kv-hash-key`.
    #[arg(long, env = "SWITCHYARD_KV_HASH_KEY", default_value_t = 0)]
    kv_hash_key: u64,
    /// Address of the first worker; further workers (`--count`) take the next ports.
    #[arg(long, default_value = "127.0.0.1:8001")]
    listen: std::net::SocketAddr,
    /// Workers to run in this process.
    #[arg(long, default_value_t = 1)]
    count: u16,
    /// The model name served.
    #[arg(long, default_value = "mock-model")]
    model: String,
    /// Hugging Face `tokenizer.json` for prompts [default: the built-in tokenizer]: the
    /// same file as the router's, so both cut prompts into the same blocks.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The model's chat template: a `tokenizer_config.json` or a Jinja file [default:
    /// the one beside `--tokenizer`, else ChatML].
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// KV cache size, in blocks, per worker.
    #[arg(long, default_value_t = 8192)]
    kv_blocks: usize,
    /// Most requests running at once per worker.
    #[arg(long, default_value_t = 64)]
    max_batch: usize,
    /// Run simulated time this many times faster.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Timing model: prefill cost per uncached prompt token, in µs.
    #[arg(long, default_value_t = TimingModel::default().prefill_us_per_token)]
    prefill_us_per_token: f64,
    /// Timing model: fixed cost of a decode step, in µs.
    #[arg(long, default_value_t = TimingModel::default().decode_base_us)]
    decode_base_us: f64,
    /// Timing model: added decode-step cost per running sequence, in µs.
    #[arg(long, default_value_t = TimingModel::default().decode_us_per_seq)]
    decode_us_per_seq: f64,
    /// Register the workers in this etcd (comma-separated URLs); no discovery without it.
    #[arg(long = "etcd", env = "SWITCHYARD_ETCD", value_delimiter = ',')]
    etcd: Vec<String>,
    /// Root of Switchyard's keys in etcd.
    #[arg(long, env = "SWITCHYARD_ETCD_ROOT", default_value = "switchyard")]
    etcd_root: String,
    #[command(flatten)]
    etcd_access: switchyard::config::EtcdAccessArgs,
    /// Endpoint path to register under (default: default/MODEL/generate).
    #[arg(long)]
    endpoint: Option<EndpointPath>,
    /// Registration lease TTL in seconds.
    #[arg(long, default_value_t = 10)]
    ttl: u64,
    /// Inject a fault.
    #[arg(long, value_enum, default_value = "none")]
    fault: Fault,
    /// The fault starts after this many completion requests.
    #[arg(long, default_value_t = 0)]
    fault_after: u64,
    /// Status of `--fault status` and of `--fault-marker` prompts [default: 500].
    #[arg(long)]
    fault_status: Option<u16>,
    /// `Retry-After` (seconds) on those answers.
    #[arg(long)]
    fault_retry_after_secs: Option<f64>,
    /// Prompts containing this text fail (a "poison" request), whatever the fault.
    #[arg(long)]
    fault_marker: Option<String>,
    /// `/health` answers 200 whatever the fault.
    #[arg(long)]
    health_lies: bool,
    /// Every completion waits this long before it starts, ms (a slow first token).
    #[arg(long, default_value_t = 0)]
    first_token_delay_ms: u64,
    /// Close keep-alive connections idle this long, ms (uvicorn closes after 5 s).
    #[arg(long)]
    idle_close_ms: Option<u64>,
    /// Also publish KV events in vLLM's ZMQ format: the PUB socket on this port and the
    /// replay socket on the next (worker `i` of `--count` on `PORT + 2i`; 0: any free
    /// ports); registered workers then advertise these sockets instead of the NDJSON
    /// stream.
    #[arg(long)]
    zmq_events: Option<u16>,
    /// The topic of those events.
    #[arg(long, default_value = "kv-events")]
    zmq_topic: String,
    /// Serve HTTPS with this PEM certificate chain (with `--tls-key`).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of `--tls-cert`.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Completions need `Authorization: Bearer KEY` (vLLM's `--api-key`).
    #[arg(long, env = "SWITCHYARD_MOCK_API_KEY")]
    api_key: Option<String>,
}

#[derive(Args)]
struct RegisterArgs {
    #[command(flatten)]
    etcd: EtcdArgs,
    /// The server's HTTP base URL, e.g. http://10.0.0.7:8000.
    #[arg(long)]
    url: String,
    /// The model it serves (selects the endpoint in the router).
    #[arg(long)]
    model: String,
    /// Endpoint path namespace/component/endpoint (default: default/MODEL/generate).
    #[arg(long)]
    endpoint: Option<EndpointPath>,
    /// Lease TTL in seconds; the registration disappears this long after a crash.
    #[arg(long, default_value_t = 10)]
    ttl: u64,
    /// The server's KV block size in tokens.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// URL of the server's KV event stream (Switchyard's NDJSON), if it publishes one.
    #[arg(long)]
    events_url: Option<String>,
    /// The engine's ZMQ KV event socket, e.g. tcp://10.0.0.7:5557 (vLLM's
    /// `--kv-events-config` endpoint, SGLang's the same), if it publishes one.
    #[arg(long)]
    kv_events: Option<String>,
    /// The engine's ZMQ replay socket, e.g. tcp://10.0.0.7:5558.
    #[arg(long, requires = "kv_events")]
    kv_replay: Option<String>,
    /// The topic the engine publishes its KV events under.
    #[arg(long, default_value = "", requires = "kv_events")]
    kv_topic: String,
    /// Data-parallel ranks of the engine (rank r publishes on the ports plus r).
    #[arg(long, default_value_t = 1, requires = "kv_events")]
    data_parallel_size: u32,
    /// Path of the server's health endpoint.
    #[arg(long, default_value = "/health")]
    health_path: String,
    /// Instance ID in hex (default: random).
    #[arg(long)]
    instance_id: Option<InstanceId>,
}

#[derive(Subcommand)]
enum PolicyCommand {
    /// Load, configure and canary-test a policy; print its identity and a sample decision.
    Check {
        /// A `.wasm` component, or the name of a built-in policy.
        policy: String,
        /// The operator configuration passed to the policy's `configure`, as JSON.
        #[arg(long, default_value = "{}")]
        config: String,
        /// Where compiled policies are cached (default: ~/.cache/switchyard/policies).
        #[arg(long, env = "SWITCHYARD_POLICY_CACHE")]
        cache_dir: Option<PathBuf>,
        /// Time budget of one call, ms, as `serve` takes it [default: 10].
        #[arg(long, env = "SWITCHYARD_POLICY_BUDGET_MS")]
        policy_budget_ms: Option<u64>,
        /// Memory cap of one instance, MiB, as `serve` takes it [default: 64].
        #[arg(long, env = "SWITCHYARD_POLICY_MEMORY_MB")]
        policy_memory_mb: Option<usize>,
    },
    /// List the built-in policies.
    Builtin,
    /// Store a policy in etcd for an endpoint: every router replica watching etcd
    /// validates it and swaps to it, without a restart.
    Push {
        /// The `.wasm` component, or a built-in name.
        policy: String,
        #[command(flatten)]
        etcd: EtcdArgs,
        /// Endpoint path namespace/component/endpoint.
        #[arg(long)]
        endpoint: EndpointPath,
        /// The policy's configuration, JSON.
        #[arg(long, default_value = "{}")]
        config: String,
        /// Sign the push with this private key (from `policy keygen`): routers started
        /// with --policy-trusted-key apply only pushes signed by a key they trust.
        #[arg(long, env = "SWITCHYARD_POLICY_SIGNING_KEY")]
        sign: Option<PathBuf>,
        /// Push it as the endpoint's shadow: it decides beside the live policy on every
        /// replica, is compared with it, and never serves (promote it through the admin
        /// API, or push it without --shadow).
        #[arg(long)]
        shadow: bool,
        /// With --shadow: the share of decisions the shadow is offered, in (0, 1].
        #[arg(long, default_value_t = 1.0, requires = "shadow")]
        sample: f64,
    },
    /// Delete the policy pushed for an endpoint: every router watching etcd returns the
    /// endpoint to its configured policy.
    Remove {
        #[command(flatten)]
        etcd: EtcdArgs,
        /// Endpoint path namespace/component/endpoint.
        #[arg(long)]
        endpoint: EndpointPath,
        /// Delete the pushed shadow instead: every router removes it.
        #[arg(long)]
        shadow: bool,
    },
    /// Write a new policy project, ready to build: the contract's WIT, the build recipe,
    /// sample test cases and a README saying how to build, check, test and load it.
    New {
        /// The policy's name (lower-case letters, digits, `-`); also the directory made.
        name: String,
        /// The language.
        #[arg(long, value_enum, default_value = "rust")]
        lang: switchyard::policy::scaffold::Lang,
        /// Where to make it [default: ./NAME].
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Run scripted decisions against a policy: a JSON list of cases, each a request,
    /// candidates and the expected answer (`{"worker": ID}`, `{"worker_in": [IDs]}`,
    /// `{"reject": "all-busy"|"no-fit"|"refused"|"any"}`, `{"answer": true}`). Prints one
    /// line per case; exits non-zero if any fails.
    Test {
        /// A `.wasm` component, or the name of a built-in policy.
        policy: String,
        /// The cases file (JSON).
        cases: PathBuf,
        /// The policy's configuration, JSON.
        #[arg(long, default_value = "{}")]
        config: String,
    },
    /// Time one `choose` call of a policy at 8, 64 and 1,024 candidates, beside the
    /// built-in kv-cost, as the router calls it (a warm instance, under the time budget).
    Bench {
        /// A `.wasm` component, or the name of a built-in policy.
        policy: String,
        /// The policy's configuration, JSON.
        #[arg(long, default_value = "{}")]
        config: String,
        /// Timed calls per candidate count.
        #[arg(long, default_value_t = 20_000)]
        calls: usize,
    },
    /// Make an ed25519 key pair for signing policy pushes: the private key at OUT (mode
    /// 0600, never overwritten) and the public key at OUT.pub, for routers'
    /// --policy-trusted-key.
    Keygen {
        /// Where to write the private key.
        #[arg(long)]
        out: PathBuf,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SWITCHYARD_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Policy(PolicyCommand::Builtin) => {
            for b in BUILTINS {
                println!("{:<12} {}", b.name, b.summary);
            }
            Ok(())
        }
        Command::Policy(PolicyCommand::Check {
            policy,
            config,
            cache_dir,
            policy_budget_ms,
            policy_memory_mb,
        }) => {
            let mut runtime = RuntimeConfig::default();
            if cache_dir.is_some() {
                runtime.cache_dir = cache_dir;
            }
            if let Some(ms) = policy_budget_ms {
                runtime.call_budget = Duration::from_millis(ms);
            }
            if let Some(mb) = policy_memory_mb {
                runtime.memory_cap = mb << 20;
            }
            policy_check(&policy, &config, runtime)
        }
        Command::Register(args) => tokio_runtime()?.block_on(register(args)),
        Command::Instances { etcd } => tokio_runtime()?.block_on(instances(etcd)),
        Command::MockWorker(args) => tokio_runtime()?.block_on(mock_worker(args)),
        Command::Replay(args) => tokio_runtime()?.block_on(replay(args)),
        Command::TraceGen(a) => {
            let defaults = switchyard::replay::synth::SynthConfig::default();
            let config = switchyard::replay::synth::SynthConfig {
                requests: a.requests,
                rate: a.rate,
                burst: a.burst,
                turns: a.turns,
                think_secs: a.think_secs,
                system_prompts: a.system_prompts,
                system_tokens: a.system_tokens,
                long_fraction: a.long_fraction,
                short_tokens: (defaults.short_tokens.0.min(a.short_max), a.short_max),
                long_tokens: (defaults.long_tokens.0.min(a.long_max), a.long_max),
                seed: a.seed,
                ..defaults
            };
            let trace = switchyard::replay::synth::generate(&config);
            print!("{}", switchyard::replay::synth::to_jsonl(&trace));
            Ok(())
        }
        Command::Serve(args) => {
            let config = args.resolve()?;
            tokio_runtime()?.block_on(async move {
                let listener = tokio::net::TcpListener::bind(config.listen)
                    .await
                    .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", config.listen))?;
                println!("switchyard serving on http://{}", listener.local_addr()?);
                serve(config, listener, shutdown_signal()).await?;
                Ok(())
            })
        }
        Command::Demo {
            listen,
            workers,
            speedup,
            policy,
        } => tokio_runtime()?.block_on(demo(listen, workers, speedup, policy)),
        Command::Policy(PolicyCommand::Push {
            policy,
            etcd,
            endpoint,
            config,
            sign,
            shadow,
            sample,
        }) => {
            let shadow = shadow.then_some(sample);
            tokio_runtime()?.block_on(policy_push(policy, etcd, endpoint, config, sign, shadow))
        }
        Command::Policy(PolicyCommand::Remove {
            etcd,
            endpoint,
            shadow,
        }) => tokio_runtime()?.block_on(async {
            let role = if shadow {
                etcd_policy::Role::Shadow
            } else {
                etcd_policy::Role::Live
            };
            let existed = etcd_policy::remove(&etcd.config()?, role, &endpoint).await?;
            match (existed, shadow) {
                (true, false) => println!(
                    "removed the push for {endpoint}: routers return it to their configured policy"
                ),
                (true, true) => {
                    println!("removed the shadow pushed for {endpoint}: routers drop it")
                }
                (false, false) => println!("no push was stored for {endpoint}"),
                (false, true) => println!("no shadow was stored for {endpoint}"),
            }
            anyhow::Ok(())
        }),
        Command::Policy(PolicyCommand::New { name, lang, dir }) => {
            let dir = dir.unwrap_or_else(|| PathBuf::from(&name));
            let files = switchyard::policy::scaffold::create(&dir, &name, lang)
                .map_err(anyhow::Error::msg)?;
            for f in &files {
                println!("wrote {}", f.display());
            }
            println!("next: see {}", dir.join("README.md").display());
            Ok(())
        }
        Command::Policy(PolicyCommand::Test {
            policy,
            cases,
            config,
        }) => policy_test(&policy, &cases, &config),
        Command::Policy(PolicyCommand::Bench {
            policy,
            config,
            calls,
        }) => policy_bench(&policy, &config, calls),
        Command::Policy(PolicyCommand::Keygen { out }) => {
            let public = SigningKey::generate(&out).map_err(anyhow::Error::msg)?;
            println!(
                "private key: {} (keep it secret; `policy push --sign` takes it)\npublic key:  {} ({public})\nrouters trust it with --policy-trusted-key {}",
                out.display(),
                signing::public_path(&out).display(),
                signing::public_path(&out).display()
            );
            Ok(())
        }
    }
}

fn tokio_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("install a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

fn random_instance_id() -> InstanceId {
    use std::hash::{BuildHasher, RandomState};
    InstanceId(RandomState::new().hash_one((std::process::id(), std::time::SystemTime::now())))
}

async fn register(args: RegisterArgs) -> anyhow::Result<()> {
    let config = args.etcd.config()?;
    let info = InstanceInfo {
        id: args.instance_id.unwrap_or_else(random_instance_id),
        endpoint: args
            .endpoint
            .unwrap_or_else(|| EndpointPath::for_model(&args.model)),
        url: args.url.trim_end_matches('/').to_string(),
        model: args.model,
        block_size: args.block_size,
        events_url: args.events_url,
        engine_events: args
            .kv_events
            .map(|endpoint| switchyard::discovery::EngineEventSource {
                endpoint,
                replay: args.kv_replay,
                topic: args.kv_topic,
                data_parallel_size: args.data_parallel_size,
            })
            .map(std::sync::Arc::new),
        health_path: args.health_path,
        registration: 0,
    };
    if let Some(src) = &info.engine_events {
        src.validate().map_err(anyhow::Error::msg)?;
    }
    anyhow::ensure!(
        info.url.starts_with("http://") || info.url.starts_with("https://"),
        "--url must be an http(s) URL, got {}",
        info.url
    );
    let mut registration = Registration::start(config, &info, Duration::from_secs(args.ttl));
    let lease = registration
        .wait_registered(Duration::from_secs(15))
        .await?;
    println!(
        "registered {} (lease {lease:x}); Ctrl-C to deregister",
        registration.key()
    );
    shutdown_signal().await;
    registration.stop().await;
    println!("deregistered");
    Ok(())
}

async fn mock_worker(args: MockWorkerArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.count >= 1, "--count must be at least 1");
    anyhow::ensure!(args.speedup > 0.0, "--speedup must be positive");
    anyhow::ensure!(
        args.block_size >= 1 && args.kv_blocks >= 1 && args.max_batch >= 1,
        "sizes must be at least 1"
    );
    let tokenizer = switchyard::tokens::Tokenizer::from_file_if_any(args.tokenizer.as_deref())?;
    let config = MockWorkerConfig {
        model: args.model.clone(),
        engine: EngineConfig {
            block_size: args.block_size,
            kv_blocks: args.kv_blocks,
            max_batch: args.max_batch,
            speedup: args.speedup,
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
            marker: args.fault_marker.clone(),
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
        api_key: args.api_key.clone(),
        tls: match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => Some(
                switchyard::worker::server::server_tls(cert, key).map_err(anyhow::Error::msg)?,
            ),
            _ => None,
        },
    };
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
        let id = random_instance_id();
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
            ))
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
    for w in workers {
        w.shutdown().await;
    }
    println!("stopped");
    Ok(())
}

async fn replay(args: ReplayArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.speedup > 0.0, "--speedup must be positive");
    let mut config = switchyard::replay::ReplayConfig::new(args.trace.clone());
    if !args.policies.is_empty() {
        config.policies = args
            .policies
            .iter()
            .flat_map(|p| switchyard::replay::split_policies(p))
            .filter(|p| p != "none")
            .collect();
    }
    for spec in &args.routers {
        config.routers.push(
            switchyard::replay::external::ExternalRouter::parse(spec)
                .map_err(anyhow::Error::msg)?,
        );
    }
    config.client = args.client.clone();
    config.replicas = args.replicas.max(1);
    config.shadow = args.shadow.clone();
    anyhow::ensure!(
        config.replicas == 1 || config.client.is_none(),
        "--routers N drives its replicas with the replay's own client; drop --client"
    );
    if !config.routers.is_empty() || config.client.is_some() {
        std::fs::create_dir_all(&args.router_logs)?;
        config.logs = args.router_logs.clone();
    }
    config.workers = args.workers.max(1);
    config.kv_events = args.kv_events.clone();
    config.tokenizer = args.tokenizer.clone();
    config.engine.kv_blocks = args.kv_blocks;
    config.engine.block_size = args.block_size.max(1);
    config.engine.max_batch = args.max_batch.max(1);
    config.engine.timing.prefill_us_per_token = args.prefill_us_per_token;
    config.speedup = args.speedup;
    config.max_requests = args.max_requests;
    config.duration = Duration::from_secs(args.duration);
    config.max_output = args.max_output.max(1);
    eprintln!(
        "replaying {} (at most {} requests, {}x) against {} mock workers of {} x {}-token blocks, batch {}",
        args.trace.display(),
        config.max_requests,
        config.speedup,
        config.workers,
        config.engine.kv_blocks,
        config.engine.block_size,
        config.engine.max_batch
    );
    let (runs, bound, count) = switchyard::replay::run(&config)
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    println!(
        "{count} requests from {}; times are simulated (wall time x {}).",
        args.trace.display(),
        config.speedup
    );
    println!();
    print!("{}", switchyard::replay::report::table(&runs, bound));
    if let Some(t) = switchyard::replay::report::telemetry_table(&runs) {
        println!("\n{t}");
    }
    if let Some(live) = switchyard::replay::report::live_table(&runs) {
        print!("\n{live}");
    }
    std::fs::write(
        &args.json,
        serde_json::to_vec_pretty(&switchyard::replay::report::json(&runs, bound))?,
    )?;
    std::fs::write(&args.chart, switchyard::replay::report::svg(&runs))?;
    println!();
    println!("wrote {} and {}", args.json.display(), args.chart.display());
    Ok(())
}

async fn demo(
    listen: std::net::SocketAddr,
    count: u16,
    speedup: f64,
    policy: String,
) -> anyhow::Result<()> {
    anyhow::ensure!(count >= 1, "--workers must be at least 1");
    anyhow::ensure!(speedup > 0.0, "--speedup must be positive");
    let model = "mock-model";
    let token = "demo-admin-token";
    let mut fleet = LocalFleet::start(LocalFleetConfig {
        workers: usize::from(count),
        engine: EngineConfig {
            block_size: 16,
            kv_blocks: 8192,
            max_batch: 64,
            speedup,
            timing: TimingModel::default(),
        },
        model: model.into(),
        policy,
        policy_config: "{}".into(),
        availability: true,
        listen,
        kv_events: switchyard::local::KvEventsMode::Zmq,
        prediction_ttl_secs: None,
        tokenizer: None,
        admin_token: Some(token.into()),
        routers: 1,
        engine_metrics_ms: None,
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e} (pick another port with --listen)"))?;
    fleet.ready().await.map_err(|e| anyhow::anyhow!(e))?;
    let url = fleet.url().to_string();
    println!("Switchyard demo: {count} mock workers serving `{model}` behind the router at {url}");
    for w in &fleet.workers {
        println!("  mock worker {}", w.url());
    }
    println!();
    println!("Try:");
    println!(
        "  curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'"
    );
    println!("  curl -s {url}/v1/models");
    println!("  curl -s -H 'authorization: Bearer {token}' {url}/admin/endpoints");
    println!("  curl -s {url}/metrics");
    println!();
    println!("The admin page (workers, policy, shadow, live charts): {url}/admin/ui?token={token}");
    println!();
    println!("Ctrl-C to stop.");
    shutdown_signal().await;
    fleet.stop().await;
    Ok(())
}

async fn policy_push(
    spec: String,
    etcd: EtcdArgs,
    endpoint: EndpointPath,
    config: String,
    sign: Option<PathBuf>,
    shadow: Option<f64>,
) -> anyhow::Result<()> {
    if let Some(sample) = shadow
        && !(sample > 0.0 && sample <= 1.0)
    {
        anyhow::bail!("--sample {sample}: a share of the decisions in (0, 1]");
    }
    let key = sign
        .map(|path| SigningKey::load(&path))
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let bytes = match switchyard::policy::builtin(&spec) {
        Some(b) => b.wasm.to_vec(),
        None => std::fs::read(&spec).map_err(|e| anyhow::anyhow!("cannot read {spec}: {e}"))?,
    };
    // Validate here first, so that an operator sees a broken policy at once.
    let engine = PolicyEngine::new(RuntimeConfig::default())?;
    let loaded = engine.load(
        switchyard::policy::PolicySource::Uploaded("push".into()),
        &bytes,
        &config,
    )?;
    loaded.canary()?;
    let mut pushed = match shadow {
        Some(sample) => PushedPolicy::shadow(&bytes, &config, sample),
        None => PushedPolicy::new(&bytes, &config),
    };
    if let Some(key) = &key {
        pushed.sign(&endpoint, key);
    }
    let stored = etcd_policy::push(&etcd.config()?, &endpoint, &pushed).await?;
    println!(
        "pushed {}{} {} (sha256 {}) to {stored}{}",
        if shadow.is_some() { "shadow " } else { "" },
        loaded.info().name,
        loaded.info().version,
        pushed.sha256,
        match &pushed.signer {
            Some(signer) => format!(", signed by {signer}"),
            None => String::new(),
        }
    );
    Ok(())
}

async fn instances(etcd: EtcdArgs) -> anyhow::Result<()> {
    let (found, malformed) = list_all(&etcd.config()?).await?;
    println!(
        "{:<36} {:<18} {:<24} {:<8} URL",
        "ENDPOINT", "INSTANCE", "MODEL", "BLOCK"
    );
    for i in &found {
        println!(
            "{:<36} {:<18} {:<24} {:<8} {}",
            i.endpoint.to_string(),
            i.id.to_string(),
            i.model,
            i.block_size,
            i.url
        );
    }
    for e in &malformed {
        eprintln!("skipped: {e}");
    }
    println!("{} instance(s)", found.len());
    Ok(())
}

fn policy_test(spec: &str, cases: &std::path::Path, config: &str) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(cases)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", cases.display()))?;
    let cases = switchyard::policy::cases::parse(&text)
        .map_err(|e| anyhow::anyhow!("{}: {e}", cases.display()))?;
    let engine = PolicyEngine::new(RuntimeConfig::default())?;
    let loaded = engine.load_spec(spec, config)?;
    loaded.canary()?;
    let mut failed = 0;
    for (i, case) in cases.iter().enumerate() {
        match case.run(i, &loaded) {
            Ok(did) => println!("ok    {}: {did}", case.label(i)),
            Err(did) => {
                failed += 1;
                println!(
                    "FAIL  {}: expected {}, {did}",
                    case.label(i),
                    case.expected()
                );
            }
        }
    }
    println!(
        "{} of {} cases passed ({} {})",
        cases.len() - failed,
        cases.len(),
        loaded.info().name,
        loaded.info().version
    );
    anyhow::ensure!(failed == 0, "{failed} case(s) failed");
    Ok(())
}

fn policy_bench(spec: &str, config: &str, calls: usize) -> anyhow::Result<()> {
    let engine = PolicyEngine::new(RuntimeConfig::default())?;
    let loaded = engine.load_spec(spec, config)?;
    loaded.canary()?;
    let reference = engine.load_spec("kv-cost", "{}")?;
    println!(
        "{:<24} {:>10} {:>10} {:>10} {:>10} {:>9}",
        "policy", "candidates", "p50 µs", "p99 µs", "mean µs", "failures"
    );
    let name = format!("{} {}", loaded.info().name, loaded.info().version);
    for size in [8, 64, 1024] {
        for (label, policy) in [(name.as_str(), &loaded), ("kv-cost (built-in)", &reference)] {
            let c = switchyard::policy::bench::call_cost(policy, size, calls);
            println!(
                "{label:<24} {:>10} {:>10.2} {:>10.2} {:>10.2} {:>9}",
                c.candidates,
                c.p50.as_secs_f64() * 1e6,
                c.p99.as_secs_f64() * 1e6,
                c.mean.as_secs_f64() * 1e6,
                c.failures
            );
        }
    }
    Ok(())
}

fn policy_check(spec: &str, config: &str, runtime: RuntimeConfig) -> anyhow::Result<()> {
    let budget = runtime.call_budget;
    let engine = PolicyEngine::new(runtime)?;
    let loaded = engine.load_spec(spec, config)?;
    let outcome = loaded.canary()?;
    let info = loaded.info();
    println!("policy:   {} {}", info.name, info.version);
    println!("sha256:   {}", info.sha256);
    println!("source:   {}", info.source);
    println!("config:   {}", info.config);
    println!(
        "loaded:   {:.1} ms ({:?})",
        info.load_time.as_secs_f64() * 1e3,
        info.cache
    );
    match outcome {
        CallOutcome::Chosen(id) => {
            println!("canary:   chose worker {id} of four synthetic workers")
        }
        CallOutcome::Rejected(r) => println!("canary:   rejected ({:?}): {}", r.kind, r.reason),
    }
    // The canary ran within the generous load budget; a serving router allows a call
    // only the call budget.
    let took = loaded
        .timed_call()
        .map_err(|e| anyhow::anyhow!("a decision within the {budget:?} call budget failed: {e}"))?;
    println!(
        "call:     {:.1} µs (budget {budget:?})",
        took.as_secs_f64() * 1e6
    );
    println!("ok");
    Ok(())
}
