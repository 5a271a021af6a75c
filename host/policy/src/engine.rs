//! One wasmtime `Engine` and `Linker` for every policy of the process, the epoch ticker
//! that enforces per-call time budgets, and the compiled-code caches.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine};

use super::bindings::PolicyPre;
use super::cache::{self, CacheOutcome};
use super::sandbox::{self, HostState, MemoryBudget};
use super::warmer::Warmer;
use super::{PolicyError, describe_error};

/// Limits and knobs of the policy runtime.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// Wall-time budget of one `choose` call. Past it the call is interrupted and the
    /// decision falls back to native `kv-cost`.
    pub call_budget: Duration,
    /// Granularity of the epoch ticker that enforces `call_budget`.
    pub epoch_tick: Duration,
    /// Wall-time budget of a policy's lifecycle calls — instantiation, `configure`,
    /// `describe` and the canary `choose` at load time. Off the hot path, so generous: a
    /// busy host must not refuse a good policy.
    pub load_budget: Duration,
    /// Linear-memory cap per instance, in bytes (covers what the host lowers into it).
    pub memory_cap: usize,
    /// A warm instance is retired after this many calls (bounds what a leaky policy
    /// can accumulate).
    pub recycle_after_calls: u64,
    /// Idle instances kept ready per policy by a background warmer (a decision never
    /// waits for one to be created: without an idle instance the fallback decides).
    /// Grows by one per decision that found none, up to `max_warm_instances`.
    pub warm_instances: usize,
    /// Most idle warm instances kept per policy.
    pub max_warm_instances: usize,
    /// Linear memory of all policy instances of the process together, in bytes: an
    /// instance that would pass it is not created, a guest that would grow past it traps.
    pub total_memory_cap: usize,
    /// Longest a policy may take to compile; past it the load is refused. Compiles run
    /// one at a time.
    pub compile_budget: Duration,
    /// Consecutive failed calls after which the handle rolls back to the last good policy.
    pub rollback_after_failures: u32,
    /// Share of failed calls in a window of `rollback_window` calls at which the handle
    /// rolls back too (0: never by rate).
    pub rollback_failure_rate: f64,
    /// Calls per failure-rate window.
    pub rollback_window: u32,
    /// Guest stdout/stderr lines logged per second per policy; the rest are counted.
    pub guest_log_lines_per_sec: u32,
    /// Directory for compiled policies (keyed by content hash and engine
    /// compatibility hash); `None` compiles every load.
    pub cache_dir: Option<PathBuf>,
    /// Accept a policy that rejects every canary decision (one that turns a fleet into
    /// 503s); off by default.
    pub allow_reject_all: bool,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            call_budget: Duration::from_millis(10),
            load_budget: Duration::from_secs(2),
            epoch_tick: Duration::from_millis(1),
            memory_cap: 64 << 20,
            recycle_after_calls: 100_000,
            warm_instances: 4,
            max_warm_instances: 64,
            total_memory_cap: 1 << 30,
            compile_budget: Duration::from_secs(60),
            rollback_after_failures: 5,
            rollback_failure_rate: 0.2,
            rollback_window: 100,
            guest_log_lines_per_sec: 20,
            cache_dir: default_cache_dir(),
            allow_reject_all: false,
        }
    }
}

/// `$XDG_CACHE_HOME/switchyard/policies`, else `$HOME/.cache/switchyard/policies`.
pub fn default_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("switchyard").join("policies"))
}

/// The process-wide policy runtime. Cheap to clone.
#[derive(Clone)]
pub struct PolicyEngine {
    pub(crate) inner: Arc<EngineInner>,
}

pub(crate) struct EngineInner {
    pub(crate) engine: Engine,
    pub(crate) linker: Linker<HostState>,
    pub(crate) config: RuntimeConfig,
    /// Epoch ticks that make up one call budget (+1: the first tick may come at once).
    pub(crate) deadline_ticks: u64,
    /// The same for the load budget.
    pub(crate) load_deadline_ticks: u64,
    /// Compiled components by content sha256, so swapping back and forth between
    /// policies never recompiles. Bounded; cleared whole when full.
    compiled: Mutex<HashMap<String, Component>>,
    /// Held while compiling: one compile at a time, and a policy uploaded twice at
    /// once is compiled once.
    compile_lock: Mutex<()>,
    /// Compiles running or waiting for their turn.
    compiles_queued: AtomicUsize,
    /// Creates warm instances off the request path.
    pub(crate) warmer: Warmer,
    /// Memory of all instances together.
    pub(crate) memory: Arc<MemoryBudget>,
    /// Advances the epoch while guest code runs.
    pub(crate) ticker: Ticker,
}

/// Idle ticks (no guest call started) after which the ticker sleeps until the next call.
const TICKER_LINGER: u32 = 4;

/// Advances the engine's epoch every tick while guest code may run, and sleeps when no
/// call has started for [`TICKER_LINGER`] ticks: a 1 ms ticker that never sleeps costs
/// ~2 % of a core here, idle or not. Under steady traffic it keeps ticking (no wake-up on
/// the request path); after a quiet spell the first call wakes it, one system call.
pub(crate) struct Ticker {
    state: Arc<TickerState>,
    thread: std::thread::Thread,
}

#[derive(Default)]
struct TickerState {
    /// Guest calls in progress.
    running: AtomicUsize,
    /// Guest calls started, ever (activity between two ticks).
    started: AtomicU64,
    /// Epochs advanced, ever.
    ticks: AtomicU64,
    /// The ticker is parked or about to park.
    parked: AtomicBool,
    stop: AtomicBool,
}

/// Held while guest code may run: the ticker ticks.
pub(crate) struct Running<'a>(&'a Ticker);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.state.running.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Ticker {
    fn start(engine: wasmtime::EngineWeak, tick: Duration) -> std::io::Result<Ticker> {
        let state = Arc::new(TickerState::default());
        let s = state.clone();
        let handle = std::thread::Builder::new()
            .name("policy-epoch".into())
            .spawn(move || {
                let (mut idle, mut seen) = (0, 0);
                while !s.stop.load(Ordering::SeqCst) {
                    let started = s.started.load(Ordering::SeqCst);
                    if s.running.load(Ordering::SeqCst) == 0 && started == seen {
                        idle += 1;
                    } else {
                        idle = 0;
                    }
                    seen = started;
                    if idle > TICKER_LINGER {
                        // A call starting now sees `parked` and unparks (the token makes
                        // an unpark before the park count), or this sees it running.
                        s.parked.store(true, Ordering::SeqCst);
                        if s.running.load(Ordering::SeqCst) == 0 && !s.stop.load(Ordering::SeqCst) {
                            std::thread::park();
                        }
                        s.parked.store(false, Ordering::SeqCst);
                        idle = 0;
                        continue;
                    }
                    std::thread::sleep(tick);
                    match engine.upgrade() {
                        Some(engine) => engine.increment_epoch(),
                        None => break,
                    }
                    s.ticks.fetch_add(1, Ordering::Relaxed);
                }
            })?;
        Ok(Ticker {
            state,
            thread: handle.thread().clone(),
        })
    }

    /// Marks guest code running until the guard drops, waking the ticker if it sleeps.
    pub(crate) fn running(&self) -> Running<'_> {
        let s = &self.state;
        s.started.fetch_add(1, Ordering::SeqCst);
        if s.running.fetch_add(1, Ordering::SeqCst) == 0 && s.parked.load(Ordering::SeqCst) {
            self.thread.unpark();
        }
        Running(self)
    }

    /// Epochs advanced so far.
    pub(crate) fn ticks(&self) -> u64 {
        self.state.ticks.load(Ordering::Relaxed)
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        self.thread.unpark();
    }
}

const MAX_COMPILED_IN_MEMORY: usize = 32;

/// Most compiles running or waiting at once; more are refused as busy.
const MAX_QUEUED_COMPILES: usize = 4;

impl PolicyEngine {
    /// Builds the engine and linker and starts the epoch ticker thread (it stops when
    /// the last clone of this engine is dropped).
    pub fn new(config: RuntimeConfig) -> Result<PolicyEngine, PolicyError> {
        let mut wasm = Config::new();
        wasm.wasm_component_model(true)
            .concurrency_support(false)
            .epoch_interruption(true)
            // Trap messages stay one line; a policy's own stderr says where it failed.
            .wasm_backtrace_max_frames(None)
            .cranelift_opt_level(wasmtime::OptLevel::Speed);
        let engine = Engine::new(&wasm).map_err(|e| PolicyError::Runtime(describe_error(&e)))?;
        let mut linker = Linker::new(&engine);
        sandbox::add_to_linker(&mut linker)
            .map_err(|e| PolicyError::Runtime(describe_error(&e)))?;

        let tick = config.epoch_tick.max(Duration::from_micros(100));
        let ticks = |d: Duration| d.as_nanos().div_ceil(tick.as_nanos()) as u64 + 1;
        let deadline_ticks = ticks(config.call_budget);
        let load_deadline_ticks = ticks(config.load_budget.max(config.call_budget));
        let ticker = Ticker::start(engine.weak(), tick)
            .map_err(|e| PolicyError::Runtime(format!("cannot start the epoch ticker: {e}")))?;

        let warmer = Warmer::start()
            .map_err(|e| PolicyError::Runtime(format!("cannot start the policy warmer: {e}")))?;
        let memory = MemoryBudget::new(config.total_memory_cap);
        Ok(PolicyEngine {
            inner: Arc::new(EngineInner {
                engine,
                linker,
                config,
                deadline_ticks,
                load_deadline_ticks,
                compiled: Mutex::new(HashMap::new()),
                compile_lock: Mutex::new(()),
                compiles_queued: AtomicUsize::new(0),
                warmer,
                memory,
                ticker,
            }),
        })
    }

    /// Epochs the ticker has advanced: it stands still while no policy code runs.
    pub fn epoch_ticks(&self) -> u64 {
        self.inner.ticker.ticks()
    }

    /// Bytes of linear memory all policy instances hold now.
    pub fn instance_memory(&self) -> usize {
        self.inner.memory.used()
    }

    /// The runtime's configuration.
    pub fn config(&self) -> &RuntimeConfig {
        &self.inner.config
    }

    /// Compiles (or fetches from cache) and links a component after checking its header
    /// and imports: the linked component, its sha256 and where the code came from.
    pub(crate) fn link(
        &self,
        bytes: &[u8],
    ) -> Result<(PolicyPre, String, CacheOutcome), PolicyError> {
        if bytes.len() > super::MAX_POLICY_BYTES {
            return Err(PolicyError::TooLarge);
        }
        check_component_header(bytes)?;
        check_imports(bytes)?;
        let sha256 = cache::sha256_hex(bytes);
        let (component, cache) = self.compile(bytes, &sha256)?;
        let instance_pre = self.inner.linker.instantiate_pre(&component).map_err(|e| {
            PolicyError::Instantiate(format!(
                "{} (a policy may import only WASI 0.2 and must export the `policy` world)",
                describe_error(&e)
            ))
        })?;
        let pre = PolicyPre::new(instance_pre)
            .map_err(|e| PolicyError::WrongWorld(describe_error(&e)))?;
        Ok((pre, sha256, cache))
    }

    fn compile(
        &self,
        bytes: &[u8],
        sha256: &str,
    ) -> Result<(Component, CacheOutcome), PolicyError> {
        if let Some(c) = self.inner.compiled.lock().get(sha256) {
            return Ok((c.clone(), CacheOutcome::Memory));
        }
        let budget = self.inner.config.compile_budget;
        // Compiles wait their turn on their own threads; a bounded number may wait.
        let queued = &self.inner.compiles_queued;
        if queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_QUEUED_COMPILES).then_some(n + 1)
            })
            .is_err()
        {
            return Err(PolicyError::Busy(format!(
                "{MAX_QUEUED_COMPILES} policies are already compiling or waiting to; try again"
            )));
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let engine = self.clone();
        let bytes = bytes.to_vec();
        let sha = sha256.to_string();
        // On its own thread, so that a compile past its budget is given up on: the
        // thread finishes in the background (still one at a time) and its work is kept.
        let spawned = std::thread::Builder::new()
            .name("policy-compile".into())
            .spawn(move || {
                let inner = &engine.inner;
                let result = {
                    let _turn = inner.compile_lock.lock();
                    // Compiled while this one waited (the same policy uploaded twice).
                    let done = inner.compiled.lock().get(&sha).cloned();
                    match done {
                        Some(c) => Ok((c, CacheOutcome::Memory)),
                        None => cache::compile(
                            &inner.engine,
                            &bytes,
                            &sha,
                            inner.config.cache_dir.as_deref(),
                        )
                        .map_err(|e| PolicyError::NotAComponent(describe_error(&e)))
                        .inspect(|(component, _)| {
                            let mut compiled = inner.compiled.lock();
                            if compiled.len() >= MAX_COMPILED_IN_MEMORY {
                                compiled.clear();
                            }
                            compiled.insert(sha.clone(), component.clone());
                        }),
                    }
                };
                inner.compiles_queued.fetch_sub(1, Ordering::AcqRel);
                let _ = tx.send(result);
            });
        if let Err(e) = spawned {
            queued.fetch_sub(1, Ordering::AcqRel);
            return Err(PolicyError::Runtime(format!(
                "cannot start a compile thread: {e}"
            )));
        }
        match rx.recv_timeout(budget) {
            Ok(result) => result,
            Err(_) => Err(PolicyError::Busy(format!(
                "compiling took longer than {budget:?} (waiting for other compiles included); it goes on, and loading the same policy again uses it once done"
            ))),
        }
    }
}

/// The WASI 0.2 packages a policy may import (each one sandboxed, see `sandbox.rs`).
const ALLOWED_IMPORTS: [&str; 6] = [
    "wasi:cli/",
    "wasi:clocks/",
    "wasi:filesystem/",
    "wasi:io/",
    "wasi:random/",
    "wasi:sockets/",
];

/// Refuses a component importing anything but sandboxed WASI 0.2 before it is compiled
/// (so it is never compiled or cached), naming the import. Only the top-level
/// component's imports count: nested components' imports are satisfied inside it. A
/// component that cannot be parsed is left to the compiler's own message.
fn check_imports(bytes: &[u8]) -> Result<(), PolicyError> {
    use wasmparser::{Parser, Payload};
    let mut depth = 0usize;
    for payload in Parser::new(0).parse_all(bytes) {
        let Ok(payload) = payload else {
            return Ok(());
        };
        match payload {
            Payload::Version { .. } => depth += 1,
            Payload::End(_) => depth = depth.saturating_sub(1),
            Payload::ComponentImportSection(reader) if depth == 1 => {
                for import in reader {
                    let Ok(import) = import else {
                        return Ok(());
                    };
                    // Type imports (the contract's records, by `use`) carry no capability.
                    if matches!(import.ty, wasmparser::ComponentTypeRef::Type(_)) {
                        continue;
                    }
                    let name = format!(
                        "{}{}",
                        import.name.name,
                        import.name.version_suffix.unwrap_or("")
                    );
                    let wasi_02 = ALLOWED_IMPORTS.iter().any(|p| name.starts_with(p))
                        && name.contains("@0.2.");
                    // The contract's own types interface (type definitions only).
                    let contract = name.starts_with("switchyard:policy/");
                    if !(wasi_02 || contract) {
                        return Err(PolicyError::Instantiate(format!(
                            "the policy imports `{name}`, which is not provided: a policy may \
                             import only WASI 0.2 cli, clocks, filesystem, io, random and \
                             sockets (all sandboxed)"
                        )));
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Refuses what is plainly not a component before the compiler sees it, with a hint.
fn check_component_header(bytes: &[u8]) -> Result<(), PolicyError> {
    if bytes.len() < 8 || &bytes[..4] != b"\0asm" {
        return Err(PolicyError::NotAComponent(
            "the file does not start with the WebAssembly magic bytes".into(),
        ));
    }
    if bytes[4..8] == [1, 0, 0, 0] {
        return Err(PolicyError::NotAComponent(
            "this is a core WebAssembly module; build a component instead \
             (e.g. `cargo build --target wasm32-wasip2` with wit-bindgen)"
                .into(),
        ));
    }
    Ok(())
}
