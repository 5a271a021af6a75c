//! The `switchyard` command line: the only place that reads the environment, sets up
//! logging and turns errors into exit codes.

mod cli;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use switchyard::config::ServeArgs;

use cli::lab::{ReplayArgs, TraceGenArgs};
use cli::policy::PolicyCommand;
use cli::register::RegisterArgs;
use cli::worker::MockWorkerArgs;
use cli::{EtcdArgs, tokio_runtime};

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
        Command::Policy(command) => cli::policy::run(command),
        Command::Register(args) => tokio_runtime()?.block_on(cli::register::register(args)),
        Command::Instances { etcd } => tokio_runtime()?.block_on(cli::register::instances(etcd)),
        Command::MockWorker(args) => tokio_runtime()?.block_on(cli::worker::mock_worker(args)),
        Command::Replay(args) => tokio_runtime()?.block_on(cli::lab::replay(args)),
        Command::TraceGen(args) => cli::lab::trace_gen(args),
        Command::Serve(args) => cli::serve_command(args),
        Command::Demo {
            listen,
            workers,
            speedup,
            policy,
        } => tokio_runtime()?.block_on(cli::lab::demo(listen, workers, speedup, policy)),
    }
}
