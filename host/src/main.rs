//! The `switchyard` command line: the only place that reads the environment, sets up
//! logging and turns errors into exit codes.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use switchyard::policy::{BUILTINS, CallOutcome, PolicyEngine, RuntimeConfig};

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
    },
    /// List the built-in policies.
    Builtin,
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
        }) => policy_check(&policy, &config, cache_dir),
    }
}

fn policy_check(spec: &str, config: &str, cache_dir: Option<PathBuf>) -> anyhow::Result<()> {
    let mut runtime = RuntimeConfig::default();
    if cache_dir.is_some() {
        runtime.cache_dir = cache_dir;
    }
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
            println!("canary:   chose worker {id} of a, b, c, d (synthetic)")
        }
        CallOutcome::Rejected(r) => println!("canary:   rejected ({:?}): {}", r.kind, r.reason),
    }
    println!("ok");
    Ok(())
}
