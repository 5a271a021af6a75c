//! `switchyard policy ...`: check, test, benchmark, scaffold, sign, push and remove routing policies.

use std::path::PathBuf;
use std::time::Duration;

use clap::Subcommand;
use switchyard::discovery::EndpointPath;
use switchyard::discovery::etcd_policy::{self, PushedPolicy};
use switchyard::discovery::signing::{self, SigningKey};
use switchyard::policy::{BUILTINS, CallOutcome, PolicyEngine, RuntimeConfig};

use super::{EtcdArgs, tokio_runtime};

/// How long a command at a terminal waits for a policy to compile. `serve` gives up after
/// a minute (an upload must not hold the admin API; the compile goes on and is kept), but
/// a person checking a component wants the answer: a Python or JavaScript policy carries
/// its interpreter (tens of MB of Wasm), which a busy 2-core machine can take minutes to
/// compile the first time (it is cached after). Still a bound: a stuck compile ends.
const CLI_COMPILE_BUDGET: Duration = Duration::from_secs(30 * 60);

/// The runtime's defaults, as `serve` uses them, but for the compile's patience.
fn cli_runtime() -> RuntimeConfig {
    RuntimeConfig {
        compile_budget: CLI_COMPILE_BUDGET,
        ..RuntimeConfig::default()
    }
}

#[derive(Subcommand)]
pub enum PolicyCommand {
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

/// Runs one `switchyard policy` command.
pub fn run(command: PolicyCommand) -> anyhow::Result<()> {
    match command {
        PolicyCommand::Builtin => {
            for b in BUILTINS {
                println!("{:<12} {}", b.name, b.summary);
            }
            Ok(())
        }
        PolicyCommand::Check {
            policy,
            config,
            cache_dir,
            policy_budget_ms,
            policy_memory_mb,
        } => {
            let mut runtime = cli_runtime();
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
        PolicyCommand::Push {
            policy,
            etcd,
            endpoint,
            config,
            sign,
            shadow,
            sample,
        } => {
            let shadow = shadow.then_some(sample);
            tokio_runtime()?.block_on(policy_push(policy, etcd, endpoint, config, sign, shadow))
        }
        PolicyCommand::Remove {
            etcd,
            endpoint,
            shadow,
        } => tokio_runtime()?.block_on(async {
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
        PolicyCommand::New { name, lang, dir } => {
            let dir = dir.unwrap_or_else(|| PathBuf::from(&name));
            let files = switchyard::policy::scaffold::create(&dir, &name, lang)
                .map_err(anyhow::Error::msg)?;
            for f in &files {
                println!("wrote {}", f.display());
            }
            println!("next: see {}", dir.join("README.md").display());
            Ok(())
        }
        PolicyCommand::Test {
            policy,
            cases,
            config,
        } => policy_test(&policy, &cases, &config),
        PolicyCommand::Bench {
            policy,
            config,
            calls,
        } => policy_bench(&policy, &config, calls),
        PolicyCommand::Keygen { out } => {
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

pub async fn policy_push(
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
        None => switchyard::bounded::files::read(
            std::path::Path::new(&spec),
            switchyard::policy::MAX_POLICY_BYTES as u64,
        )
        .map_err(|e| anyhow::anyhow!("cannot read {spec}: {e}"))?,
    };
    // Validate here first, so that an operator sees a broken policy at once.
    let engine = PolicyEngine::new(cli_runtime())?;
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

pub fn policy_test(spec: &str, cases: &std::path::Path, config: &str) -> anyhow::Result<()> {
    let text = switchyard::bounded::files::read_to_string(cases, 64 << 20)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", cases.display()))?;
    let cases = switchyard::policy::cases::parse(&text)
        .map_err(|e| anyhow::anyhow!("{}: {e}", cases.display()))?;
    let engine = PolicyEngine::new(cli_runtime())?;
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

pub fn policy_bench(spec: &str, config: &str, calls: usize) -> anyhow::Result<()> {
    let engine = PolicyEngine::new(cli_runtime())?;
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

pub fn policy_check(spec: &str, config: &str, runtime: RuntimeConfig) -> anyhow::Result<()> {
    let budget = runtime.call_budget;
    let engine = PolicyEngine::new(runtime)?;
    let loaded = engine.load_spec(spec, config)?;
    let outcome = loaded.canary()?;
    let info = loaded.info();
    println!("policy:   {} {}", info.name, info.version);
    println!("sha256:   {}", info.sha256);
    println!("world:    {}", info.world);
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
        // The canary's workers are all `both`: a split answer is a placement it cannot take.
        CallOutcome::Pair { prefill, decode } => {
            println!("canary:   split the request (prefill {prefill}, decode {decode})")
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
