//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

pub mod conformance;
pub mod echo;
pub mod engine;
pub mod etcd;
pub mod events;
pub mod faults;
pub mod gateway;
pub mod health;
pub mod hostile_zmtp;
pub mod http;
pub mod kube;
pub mod kv;
pub mod policy;
pub mod procs;
pub mod prom;
pub mod queue;
pub mod router;
pub mod serve;
pub mod streams;
pub mod tls;
pub mod vllm;

/// Whether a test that needs `tool` (installed by `tools/test.sh` at `path`) goes
/// without it: plain `cargo test` on a machine that never ran `tools/test.sh` runs what it
/// can and says which tests it left. Under `tools/test.sh` (and so CI), which sets
/// `SWITCHYARD_REQUIRE_TOOLS`, a missing tool fails the test instead: a run that left a
/// test out is not a pass.
pub fn goes_without(tool: &str, path: &std::path::Path) -> bool {
    if path.exists() {
        return false;
    }
    let why = format!(
        "needs {tool} at {} (run tools/test.sh, which installs it)",
        path.display()
    );
    assert!(
        std::env::var_os("SWITCHYARD_REQUIRE_TOOLS").is_none(),
        "{why}"
    );
    let test = std::thread::current()
        .name()
        .unwrap_or("a test")
        .to_string();
    // Straight to stderr: the harness hides what a passing test prints.
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
    true
}

/// The `.wasm` of a guest built by the host's build script, by artifact name.
pub fn guest(name: &str) -> PathBuf {
    let path = match name {
        "session_affinity" => env!("SWITCHYARD_SESSION_AFFINITY_WASM"),
        "spin_forever" => env!("SWITCHYARD_SPIN_FOREVER_WASM"),
        "memory_bomb" => env!("SWITCHYARD_MEMORY_BOMB_WASM"),
        "panics" => env!("SWITCHYARD_PANICS_WASM"),
        "wrong_id" => env!("SWITCHYARD_WRONG_ID_WASM"),
        "stdout_spam" => env!("SWITCHYARD_STDOUT_SPAM_WASM"),
        "reads_host" => env!("SWITCHYARD_READS_HOST_WASM"),
        "bad_config" => env!("SWITCHYARD_BAD_CONFIG_WASM"),
        "wrong_world" => env!("SWITCHYARD_WRONG_WORLD_WASM"),
        "rounds_ids" => env!("SWITCHYARD_ROUNDS_IDS_WASM"),
        "picks_last" => env!("SWITCHYARD_PICKS_LAST_WASM"),
        "picks_first" => env!("SWITCHYARD_PICKS_FIRST_WASM"),
        "imports_http" => env!("SWITCHYARD_IMPORTS_HTTP_WASM"),
        "loud" => env!("SWITCHYARD_LOUD_WASM"),
        "sleeps" => env!("SWITCHYARD_SLEEPS_WASM"),
        "flaky" => env!("SWITCHYARD_FLAKY_WASM"),
        "built_for_0_1" => env!("SWITCHYARD_BUILT_FOR_0_1_WASM"),
        "built_for_0_2" => env!("SWITCHYARD_BUILT_FOR_0_2_WASM"),
        "built_for_0_3" => env!("SWITCHYARD_BUILT_FOR_0_3_WASM"),
        other => panic!("no test guest named {other}"),
    };
    PathBuf::from(path)
}

/// A small deterministic RNG (SplitMix64) for generated test data.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A runtime configuration for tests: compiled policies cached under cargo's
/// per-project temporary directory, so repeated runs skip compilation, and a call
/// budget wide enough that a busy 2-core test machine (tests run in parallel, in an
/// unoptimised build) never interrupts a well-behaved policy.
pub fn runtime() -> switchyard::policy::RuntimeConfig {
    switchyard::policy::RuntimeConfig {
        call_budget: std::time::Duration::from_millis(500),
        load_budget: std::time::Duration::from_secs(1),
        cache_dir: Some(PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("policy-cache")),
        ..Default::default()
    }
}
