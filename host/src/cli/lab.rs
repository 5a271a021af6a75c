//! `switchyard demo`, `replay` and `trace-gen`: fleets in one process and the traces they are measured with.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use switchyard::local::{LocalFleet, LocalFleetConfig};
use switchyard::worker::{EngineConfig, TimingModel};

use super::shutdown_signal;

/// Shapes `trace-gen` starts from; each flag given overrides the shape's value.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum TraceShape {
    /// Multi-turn chat over shared system prompts; caches of 4,096 blocks evict.
    Chat,
    /// Long conversations (10–40k-token documents, turns towards 100k tokens) that
    /// large caches (65,536 blocks of 64 tokens) hold without evicting much.
    LargeCache,
}

#[derive(Args)]
pub struct TraceGenArgs {
    /// The shape to start from.
    #[arg(long, value_enum, default_value = "chat")]
    pub shape: TraceShape,
    /// Requests (default 1,500).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Mean arrivals per second of trace time (chat: 4; large-cache: 6).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Requests arriving at the same instant (1: Poisson arrivals).
    #[arg(long)]
    pub burst: Option<usize>,
    /// Mean turns per conversation (chat: 6; large-cache: 12).
    #[arg(long)]
    pub turns: Option<f64>,
    /// Least seconds between two turns of a conversation (chat: 10; large-cache: 5).
    #[arg(long)]
    pub think_secs: Option<f64>,
    /// Distinct system prompts (8).
    #[arg(long)]
    pub system_prompts: Option<usize>,
    /// Tokens per system prompt (2,048).
    #[arg(long)]
    pub system_tokens: Option<u32>,
    /// Share of user messages that are long documents (chat: 0.1; large-cache: 0.05).
    #[arg(long)]
    pub long_fraction: Option<f64>,
    /// Short messages: most tokens (chat: 600; large-cache: 2,000).
    #[arg(long)]
    pub short_max: Option<u32>,
    /// Long messages: most tokens (16,000).
    #[arg(long)]
    pub long_max: Option<u32>,
    /// A conversation is cut past this many prompt tokens (chat: 64,000; large-cache:
    /// 100,000).
    #[arg(long)]
    pub max_prompt_tokens: Option<u32>,
    /// Seed (1).
    #[arg(long)]
    pub seed: Option<u64>,
}

/// Writes a synthetic trace to stdout.
pub fn trace_gen(a: TraceGenArgs) -> anyhow::Result<()> {
    use switchyard::replay::synth::SynthConfig;
    let shape = match a.shape {
        TraceShape::Chat => SynthConfig::default(),
        TraceShape::LargeCache => SynthConfig::large_cache(),
    };
    let short_max = a.short_max.unwrap_or(shape.short_tokens.1);
    let long_max = a.long_max.unwrap_or(shape.long_tokens.1);
    let config = SynthConfig {
        requests: a.requests.unwrap_or(shape.requests),
        rate: a.rate.unwrap_or(shape.rate),
        burst: a.burst.unwrap_or(shape.burst),
        turns: a.turns.unwrap_or(shape.turns),
        think_secs: a.think_secs.unwrap_or(shape.think_secs),
        system_prompts: a.system_prompts.unwrap_or(shape.system_prompts),
        system_tokens: a.system_tokens.unwrap_or(shape.system_tokens),
        long_fraction: a.long_fraction.unwrap_or(shape.long_fraction),
        short_tokens: (shape.short_tokens.0.min(short_max), short_max),
        long_tokens: (shape.long_tokens.0.min(long_max), long_max),
        max_prompt_tokens: a.max_prompt_tokens.unwrap_or(shape.max_prompt_tokens),
        seed: a.seed.unwrap_or(shape.seed),
        ..shape
    };
    let trace = switchyard::replay::synth::generate(&config);
    print!("{}", switchyard::replay::synth::to_jsonl(&trace));
    Ok(())
}

#[derive(Args)]
pub struct ReplayArgs {
    /// The trace (JSON lines: timestamp, input_length, output_length, hash_ids).
    pub trace: PathBuf,
    /// Policies to compare, each on fresh workers: built-in names or `.wasm` paths, each
    /// optionally followed by `=` and its JSON configuration. Repeat the flag or separate
    /// with commas (commas inside a JSON configuration are kept). `none` runs no policy
    /// in process (only the `--router`s).
    #[arg(long = "policy", default_value = "kv-cost,round-robin,random")]
    pub policies: Vec<String>,
    /// Mock workers.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// KV cache per worker, in blocks.
    #[arg(long, default_value_t = 65536)]
    pub kv_blocks: usize,
    /// Timing model: prefill cost per uncached prompt token, in µs.
    #[arg(long, default_value_t = TimingModel::default().prefill_us_per_token)]
    pub prefill_us_per_token: f64,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 64)]
    pub block_size: u32,
    /// Most requests running at once per worker (vLLM's `--max-num-seqs`, SGLang's
    /// `--max-running-requests`); more wait in its queue.
    #[arg(long, alias = "max-num-seqs", default_value_t = 32)]
    pub max_batch: usize,
    /// Most tokens a worker computes in one step (vLLM's `--max-num-batched-tokens`,
    /// SGLang's `--chunked-prefill-size`): longer prompts are prefilled in chunks between
    /// decode steps. 0 computes each prompt whole in one step.
    #[arg(long, alias = "chunked-prefill-size", default_value_t = switchyard::worker::DEFAULT_MAX_BATCHED_TOKENS)]
    pub max_num_batched_tokens: u64,
    /// Replay this many times faster than the trace (the workers' time runs as fast).
    #[arg(long, default_value_t = 20.0)]
    pub speedup: f64,
    /// Replay at most this many requests.
    #[arg(long, default_value_t = 1000)]
    pub max_requests: usize,
    /// How the in-process router learns the workers' caches: `zmq` (vLLM's ZMQ events,
    /// as engines publish them), `ndjson` (the mock workers' own stream) or `none`
    /// (approximate mode: predicted from its decisions, predictions living 120 s of
    /// simulated time). Several, comma-separated, run every policy once per mode.
    #[arg(long, default_value = "zmq", value_delimiter = ',')]
    pub kv_events: Vec<switchyard::local::KvEventsMode>,
    /// Another program as the client, a shell command: `{url}` (the router), `{trace}`
    /// (the requests, timestamps divided by the speedup), `{out}` (a directory where it
    /// must leave aiperf's `profile_export.jsonl`), `{model}`. E.g. `aiperf profile
    /// --url {url} --model {model} --endpoint-type completions --streaming --input-file
    /// {trace} --custom-dataset-type mooncake_trace --fixed-schedule --artifact-dir {out}
    /// --tokenizer ...`. Its files go to `--router-logs`.
    #[arg(long)]
    pub client: Option<String>,
    /// The mock workers' `tokenizer.json` (and the in-process router's; give external
    /// routers the same file in their command) [default: the built-in tokenizer].
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Stop sending after this many seconds per policy.
    #[arg(long, default_value_t = 300)]
    pub duration: u64,
    /// Cap on generated tokens per request.
    #[arg(long, default_value_t = 256)]
    pub max_output: u32,
    /// Also replay through a router run as a process of its own, as `NAME=COMMAND`
    /// (repeatable), on fresh mock workers after the policies. In COMMAND, `{port}` is the
    /// port it must listen on at 127.0.0.1, `{workers}` the workers' URLs separated by
    /// spaces, `{workers_comma}` by commas, `{worker_args}` `--worker URL` per worker.
    /// Its CPU time and peak memory are reported; every run then sends text prompts.
    /// With `--prefill-workers` and `--decode-workers`, a command using the placeholders
    /// of a disaggregated fleet (`{prefill_workers}`, `{prefill_workers_bootstrap}`,
    /// `{decode_workers}` for Switchyard; `{prefill_urls}`, `{decode_urls}` for the peers'
    /// `--prefill URL PORT` and `--decode URL`) runs on one.
    #[arg(long = "router")]
    pub routers: Vec<String>,
    /// A running engine to replay on instead of mock workers (repeatable), as `serve
    /// --worker` takes it (`URL` or `URL#kv_events=...`): for external `--router`s only
    /// (add `--policy none`). Before each router the engines' prefix caches are emptied
    /// (vLLM's `POST /reset_prefix_cache`: start them with `VLLM_SERVER_DEV_MODE=1`) and
    /// the hit rate is read from their own counters. Give `--speedup 1`, and `--kv-blocks`
    /// and `--block-size` as the engines have them (for the bounds).
    #[arg(long = "engine")]
    pub engines: Vec<String>,
    /// The `--engine`s' measured timing, `FIXED_MS,MS_PER_1K_TOKENS` (as
    /// `tools/engine-stage.py` prints it), for the oracle floor of TTFT: a request costs
    /// at least the fixed part and its never-seen tokens at the per-token price.
    #[arg(long)]
    pub engine_floor: Option<String>,
    /// Run every external router this many times, the order turned by one each round;
    /// a table then gives each figure's median and range over the runs.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Prefill workers of the disaggregated fleet (each with a bootstrap port, so that
    /// either handoff works) for the `--router`s that ask for one.
    #[arg(long, default_value_t = 0, requires = "decode_workers")]
    pub prefill_workers: usize,
    /// Decode workers of the disaggregated fleet.
    #[arg(long, default_value_t = 0, requires = "prefill_workers")]
    pub decode_workers: usize,
    /// Goodput counts the requests whose time to first token is at most this (simulated
    /// seconds).
    #[arg(long, default_value_t = switchyard::replay::Slo::default().ttft)]
    pub slo_ttft_secs: f64,
    /// ... and whose answer ends within this (simulated seconds).
    #[arg(long, default_value_t = switchyard::replay::Slo::default().e2e)]
    pub slo_e2e_secs: f64,
    /// Arrivals come this many times faster than the trace says, the workers' speed
    /// unchanged (1.5: half again the load).
    #[arg(long, default_value_t = 1.0)]
    pub load: f64,
    /// Ask for whole (non-streamed) answers: the client's first byte is the answer's
    /// end, so TTFT is the whole answer's time, and goodput counts the E2E SLO alone.
    #[arg(long)]
    pub whole: bool,
    /// Mark this share of the requests interactive (`x-switchyard-priority: high`) and
    /// the rest batch (`low`), each with a deadline (`--queue-deadline-secs`);
    /// the table then gives goodput, refusals and TTFT per class.
    #[arg(long)]
    pub interactive_share: Option<f64>,
    /// Spread the requests over this many tenants (`x-switchyard-tenant`), with
    /// `--interactive-share` [default: 2].
    #[arg(long, requires = "interactive_share")]
    pub tenants: Option<usize>,
    /// With `--interactive-share`: every request's deadline in the router's queue
    /// (`x-switchyard-deadline-ms`), simulated seconds: the latest start from which it
    /// can still meet its SLO [default: half the TTFT SLO, the other half left for its
    /// prefill; with `--whole`, half the E2E SLO, the SLO a whole answer is held to].
    #[arg(long, requires = "interactive_share")]
    pub queue_deadline_secs: Option<f64>,
    /// The interactive requests' own queue deadline, simulated seconds [default:
    /// `--queue-deadline-secs`].
    #[arg(long, requires = "interactive_share")]
    pub interactive_deadline_secs: Option<f64>,
    /// Router replicas: with N above 1, every policy also runs through N in-process
    /// routers sharing the workers (each with its own state, as N `serve` processes),
    /// the requests sent to them in turn, beside its run through one.
    #[arg(long = "routers", default_value_t = 1)]
    pub replicas: usize,
    /// A policy that decides as a shadow beside every policy run (built-in name or
    /// `.wasm` path, `=CONFIG` optionally): one run compares them on the same decisions
    /// (agreement, cache used, predicted cost) in the decision telemetry table.
    #[arg(long)]
    pub shadow: Option<String>,
    /// Where the external routers' output goes.
    #[arg(long, default_value = "replay-logs")]
    pub router_logs: PathBuf,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "replay-results.json")]
    pub json: PathBuf,
    /// Where to write the TTFT chart (SVG).
    #[arg(long, default_value = "replay-ttft.svg")]
    pub chart: PathBuf,
}

/// The classes, tenants and deadlines `--interactive-share` marks the requests with.
/// A request's deadline defaults to half its SLO: the TTFT SLO's for streams, the E2E
/// SLO's for whole answers (whose client sees no first token before the end).
fn mix(args: &ReplayArgs) -> anyhow::Result<Option<switchyard::replay::Mix>> {
    let Some(share) = args.interactive_share else {
        return Ok(None);
    };
    anyhow::ensure!(
        (0.0..=1.0).contains(&share),
        "--interactive-share is a share, from 0 to 1"
    );
    let slo = if args.whole {
        args.slo_e2e_secs
    } else {
        args.slo_ttft_secs
    };
    Ok(Some(switchyard::replay::Mix {
        interactive: share,
        tenants: args.tenants.unwrap_or(2).max(1),
        deadline: args.queue_deadline_secs.unwrap_or(slo / 2.0).max(0.001),
        interactive_deadline: args.interactive_deadline_secs.map(|d| d.max(0.001)),
    }))
}

pub async fn replay(args: ReplayArgs) -> anyhow::Result<()> {
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
    config.rounds = args.rounds.max(1);
    anyhow::ensure!(
        args.engine_floor.is_none() || !args.engines.is_empty(),
        "--engine-floor prices running engines: give it with --engine (the mock workers' floor comes from their own timing)"
    );
    if !args.engines.is_empty() {
        anyhow::ensure!(
            config.policies.is_empty() && !config.routers.is_empty(),
            "--engine runs external routers only: add --policy none and at least one --router"
        );
        anyhow::ensure!(
            args.prefill_workers == 0 && config.client.is_none() && config.replicas == 1,
            "--engine runs aggregated engines with the replay's own client and one router"
        );
        config.engines.specs = args.engines.clone();
        config.engines.floor = args
            .engine_floor
            .as_deref()
            .map(switchyard::replay::floor::Measured::parse)
            .transpose()
            .map_err(anyhow::Error::msg)?;
        config.workers = args.engines.len();
    }
    anyhow::ensure!(
        args.slo_ttft_secs > 0.0 && args.slo_e2e_secs > 0.0,
        "--slo-ttft-secs and --slo-e2e-secs must be positive"
    );
    config.slo = switchyard::replay::Slo {
        ttft: args.slo_ttft_secs,
        e2e: args.slo_e2e_secs,
    };
    anyhow::ensure!(
        args.load > 0.0 && args.load.is_finite(),
        "--load must be positive"
    );
    config.load = args.load;
    config.whole = args.whole;
    config.mix = mix(&args)?;
    if args.prefill_workers > 0 || args.decode_workers > 0 {
        anyhow::ensure!(
            args.prefill_workers > 0 && args.decode_workers > 0,
            "a disaggregated fleet needs --prefill-workers and --decode-workers, both at least 1"
        );
        config.disaggregated = Some((args.prefill_workers, args.decode_workers));
    }
    config.kv_events = args.kv_events.clone();
    config.tokenizer = args.tokenizer.clone();
    config.engine.kv_blocks = args.kv_blocks;
    config.engine.block_size = args.block_size.max(1);
    config.engine.max_batch = args.max_batch.max(1);
    config.engine.max_batched_tokens = args.max_num_batched_tokens;
    config.engine.timing.prefill_us_per_token = args.prefill_us_per_token;
    config.speedup = args.speedup;
    config.max_requests = args.max_requests;
    config.duration = Duration::from_secs(args.duration);
    config.max_output = args.max_output.max(1);
    let fleet = if config.engines.specs.is_empty() {
        "mock workers"
    } else {
        "running engines"
    };
    eprintln!(
        "replaying {} (at most {} requests, {}x, load {}x) against {} {fleet} of {} x {}-token blocks, batch {}, step budget {} tokens",
        args.trace.display(),
        config.max_requests,
        config.speedup,
        config.load,
        config.workers,
        config.engine.kv_blocks,
        config.engine.block_size,
        config.engine.max_batch,
        config.engine.max_batched_tokens
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
    print!(
        "{}",
        switchyard::replay::report::table(&runs, bound, config.slo)
    );
    if let Some(t) = switchyard::replay::report::spread_table(&runs, config.slo) {
        println!("\nOver {} rounds, median (min–max):\n\n{t}", config.rounds);
    }
    if let Some(t) = switchyard::replay::report::class_table(&runs, config.slo) {
        println!("\n{t}");
    }
    if let Some(t) = switchyard::replay::report::telemetry_table(&runs) {
        println!("\n{t}");
    }
    if let Some(live) = switchyard::replay::report::live_table(&runs) {
        print!("\n{live}");
    }
    std::fs::write(
        &args.json,
        serde_json::to_vec_pretty(&switchyard::replay::report::json(&runs, bound, config.slo))?,
    )?;
    std::fs::write(&args.chart, switchyard::replay::report::svg(&runs))?;
    println!();
    println!("wrote {} and {}", args.json.display(), args.chart.display());
    Ok(())
}

/// The demo model's natural answer length: up to this many tokens.
const DEMO_EOS_PERIOD: u32 = 48;

pub async fn demo(
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
            max_batched_tokens: switchyard::worker::DEFAULT_MAX_BATCHED_TOKENS,
            max_model_len: None,
            // Answers end by themselves, as a chat model's do: a chat that names no
            // `max_tokens` gets a short answer, not the rest of the context.
            eos_period: DEMO_EOS_PERIOD,
            stream_interval: 1,
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
    println!(
        "Admin token: {token} (the demo's own; `serve` takes yours from --admin-token-file or SWITCHYARD_ADMIN_TOKEN)"
    );
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        replay: ReplayArgs,
    }

    fn args(flags: &[&str]) -> ReplayArgs {
        let argv = ["replay", "trace.jsonl"].iter().chain(flags);
        Cli::try_parse_from(argv).expect("flags parse").replay
    }

    #[test]
    fn a_whole_answer_waits_half_its_e2e_slo_and_a_stream_half_its_ttft_slo() {
        let stream = mix(&args(&["--interactive-share", "0.2"]))
            .unwrap()
            .unwrap();
        assert_eq!(stream.deadline, 1.0);
        let whole = mix(&args(&["--interactive-share", "0.2", "--whole"]))
            .unwrap()
            .unwrap();
        assert_eq!(whole.deadline, 15.0);
        let set = mix(&args(&[
            "--interactive-share",
            "0.2",
            "--whole",
            "--queue-deadline-secs",
            "3",
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(set.deadline, 3.0);
        assert!(mix(&args(&[])).unwrap().is_none());
        assert!(mix(&args(&["--interactive-share", "2"])).is_err());
    }
}
