//! What a replay runs: the trace, the fleet, the routers, the load and the objectives.

use std::path::PathBuf;
use std::time::Duration;

use switchyard_worker::{EngineConfig, TimingModel};

use super::Outcome;
use super::engines;
use super::external::ExternalRouter;

/// What to replay, against what.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// The trace.
    pub trace: PathBuf,
    /// Policies to compare, each on fresh workers: a built-in name or a `.wasm` path,
    /// optionally followed by `=` and its JSON configuration (`kv-cost={"overlap_weight":4}`).
    pub policies: Vec<String>,
    /// Mock workers.
    pub workers: usize,
    /// Their engine (block size, KV capacity, batch, timing, speedup).
    pub engine: EngineConfig,
    /// Arrival times are divided by this (the workers' simulated time runs as fast).
    pub speedup: f64,
    /// Replay at most this many requests.
    pub max_requests: usize,
    /// Stop sending after this long (wall time per policy).
    pub duration: Duration,
    /// Cap on generated tokens per request.
    pub max_output: u32,
    /// Routers run as processes of their own, after the policies, on fresh workers too.
    /// With any of these, every run sends text prompts (which every router can match).
    pub routers: Vec<ExternalRouter>,
    /// Where the external routers' output goes (one `NAME.log` each).
    pub logs: PathBuf,
    /// How the router learns the workers' caches; every policy runs once per mode
    /// (approximate mode predicts caches from its own decisions, with the prediction
    /// lifetime scaled down by `speedup`).
    pub kv_events: Vec<crate::local::KvEventsMode>,
    /// The mock workers' (and the in-process router's) `tokenizer.json`.
    pub tokenizer: Option<PathBuf>,
    /// Another program as the client (see [`client`]); `None`: the replay's own.
    pub client: Option<String>,
    /// Above 1: every policy also runs through this many router replicas sharing the
    /// workers, requests sent to them in turn.
    pub replicas: usize,
    /// A policy (built-in name or `.wasm` path, `=CONFIG` optionally) attached as the
    /// shadow beside every policy run, so that one run compares them on the same decisions.
    pub shadow: Option<String>,
    /// Prefill and decode workers of the disaggregated fleet the external routers with
    /// P/D placeholders run on (the others keep `workers` aggregated ones).
    pub disaggregated: Option<(usize, usize)>,
    /// The service level a request must meet to count as goodput: TTFT and E2E at most
    /// these (simulated seconds).
    pub slo: Slo,
    /// Arrivals come this many times faster than the trace says, the workers' speed
    /// unchanged: 1.5 loads the fleet half again as much.
    pub load: f64,
    /// Whole (non-streamed) answers instead of streams.
    pub whole: bool,
    /// Priority classes and tenants marked on the requests, if any.
    pub mix: Option<Mix>,
    /// Running engines the external routers run in front of, instead of fresh mock
    /// workers (none: mock workers).
    pub engines: engines::Engines,
    /// Every external router runs this many times, the order turned by one each round
    /// (each router first once in `routers` rounds), so that the order's effects (a
    /// warm-up, the machine's drift) show as the spread of its runs.
    pub rounds: usize,
}

/// Requests marked with a class and a tenant (`x-switchyard-priority`,
/// `x-switchyard-tenant`, and the class's deadline in `x-switchyard-deadline-ms`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mix {
    /// The share of interactive requests (class `high`); the others are batch (class
    /// `low`).
    pub interactive: f64,
    /// Tenants the requests are spread over (evenly, by a hash of their index).
    pub tenants: usize,
    /// Every request's deadline in the router's queue, simulated seconds: the latest
    /// start from which it can still meet the TTFT SLO.
    pub deadline: f64,
    /// The interactive requests' own deadline, if shorter or longer.
    pub interactive_deadline: Option<f64>,
}

impl Mix {
    /// Request `i`'s class (interactive or not) and tenant: the same for every router.
    pub fn of(&self, i: usize) -> (bool, usize) {
        // splitmix64: a fixed, well-spread hash of the index.
        let mut z = (i as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let unit = (z >> 11) as f64 / (1u64 << 53) as f64;
        (
            unit < self.interactive,
            (z % self.tenants.max(1) as u64) as usize,
        )
    }
}

/// A request's service level objective, in simulated seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slo {
    /// Longest time to first token.
    pub ttft: f64,
    /// Longest time to the end of the answer.
    pub e2e: f64,
}

impl Slo {
    /// Whether a request served as `o` met it: its first token in time (a stream's; a
    /// whole answer's first byte is its end, so its end alone counts) and its end.
    pub fn met(&self, o: &Outcome) -> bool {
        (o.whole || o.ttft <= self.ttft) && o.e2e <= self.e2e
    }
}

impl Default for Slo {
    /// TTFT 2 s (an interactive user's patience for the first word), E2E 30 s.
    fn default() -> Self {
        Slo {
            ttft: 2.0,
            e2e: 30.0,
        }
    }
}

impl ReplayConfig {
    /// Defaults for a trace: kv-cost, round-robin and random; 4 workers of 65,536 64-token
    /// blocks (4M tokens each), batch 32; 20x speed.
    pub fn new(trace: PathBuf) -> ReplayConfig {
        ReplayConfig {
            trace,
            policies: vec!["kv-cost".into(), "round-robin".into(), "random".into()],
            workers: 4,
            engine: EngineConfig {
                block_size: 64,
                kv_blocks: 4096,
                max_batch: 32,
                speedup: 20.0,
                max_batched_tokens: switchyard_worker::DEFAULT_MAX_BATCHED_TOKENS,
                max_model_len: None,
                eos_period: 0,
                stream_interval: 1,
                timing: TimingModel::default(),
            },
            speedup: 20.0,
            max_requests: 1000,
            duration: Duration::from_secs(300),
            max_output: 256,
            routers: Vec::new(),
            logs: std::env::temp_dir(),
            kv_events: vec![crate::local::KvEventsMode::Zmq],
            tokenizer: None,
            client: None,
            replicas: 1,
            shadow: None,
            disaggregated: None,
            slo: Slo::default(),
            load: 1.0,
            whole: false,
            mix: None,
            engines: engines::Engines::default(),
            rounds: 1,
        }
    }
}

/// Splits a comma-separated list of policy specs, keeping the commas inside a spec's
/// JSON configuration (`kv-cost={"a":1,"b":2},round-robin` is two specs).
pub fn split_policies(list: &str) -> Vec<String> {
    let mut out = Vec::new();
    let (mut depth, mut in_string, mut escaped, mut start) = (0i32, false, false, 0);
    for (i, c) in list.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if in_string => escaped = true,
            '"' => in_string = !in_string,
            '{' | '[' if !in_string => depth += 1,
            '}' | ']' if !in_string => depth -= 1,
            ',' if !in_string && depth <= 0 => {
                out.push(list[start..i].trim().to_string());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(list[start..].trim().to_string());
    out.retain(|s| !s.is_empty());
    out
}
