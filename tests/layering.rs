//! The architecture's floors, as Cargo sees them: every workspace crate's declared
//! dependencies (from `cargo metadata`) point only to lower floors, and the crates that
//! must stay free of something (I/O in the KV crate, wasmtime outside the policy
//! runtime, HTTP in the pure crates) are. A change that breaks the layering fails here
//! with the crate and the dependency named, not in review; so does an import circle
//! between two modules of one crate.

use std::collections::BTreeMap;
use std::process::Command;

use serde_json::Value;

/// Each workspace crate's floor: a crate may depend only on crates of lower floors.
const FLOORS: &[(&str, u32)] = &[
    ("switchyard-ids", 0),
    ("switchyard-cost-model", 0),
    ("switchyard-kv", 1),
    ("switchyard-tokens", 1),
    ("switchyard-net", 1),
    ("switchyard-policy", 1),
    ("switchyard-discovery", 2),
    ("switchyard-router", 3),
    ("switchyard-worker", 3),
    ("switchyard-server", 4),
    ("switchyard-lab", 5),
    ("switchyard", 6),
];

/// Everything `switchyard-kv` may depend on: data structures and formats, nothing that
/// reaches the network, a runtime or a clock.
const KV_MAY_USE: &[&str] = &[
    "switchyard-ids",
    "bytemuck",
    "foldhash",
    "rmp",
    "rmpv",
    "serde",
    "serde_json",
    "smallvec",
    "thiserror",
    "xxhash-rust",
];

/// Dependencies only one crate may have.
const ONLY_IN: &[(&str, &str)] = &[
    ("wasmtime", "switchyard-policy"),
    ("wasmtime-wasi", "switchyard-policy"),
    ("wasmtime-wasi-io", "switchyard-policy"),
    ("wasmparser", "switchyard-policy"),
    ("zeromq", "switchyard-worker"),
];

/// HTTP and TLS crates, which the crates below the network floors must not have.
const HTTP: &[&str] = &[
    "hyper",
    "hyper-util",
    "hyper-rustls",
    "rustls",
    "tokio-rustls",
];
const NO_HTTP: &[&str] = &[
    "switchyard-ids",
    "switchyard-kv",
    "switchyard-tokens",
    "switchyard-policy",
];

/// Workspace crate → its normal and build dependencies' names, read once for all tests.
fn declared() -> &'static BTreeMap<String, Vec<String>> {
    static DECLARED: std::sync::OnceLock<BTreeMap<String, Vec<String>>> =
        std::sync::OnceLock::new();
    DECLARED.get_or_init(read_metadata)
}

fn read_metadata() -> BTreeMap<String, Vec<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).unwrap();
    meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| d["kind"] != "dev")
                .map(|d| d["name"].as_str().unwrap().to_string())
                .collect();
            (p["name"].as_str().unwrap().to_string(), deps)
        })
        .collect()
}

fn floor(name: &str) -> Option<u32> {
    FLOORS.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
}

#[test]
fn every_crate_has_a_floor_and_depends_only_on_lower_ones() {
    let crates = declared();
    let mut wrong = Vec::new();
    for (name, deps) in crates {
        let Some(own) = floor(name) else {
            wrong.push(format!("{name} has no floor in FLOORS"));
            continue;
        };
        for dep in deps.iter().filter(|d| d.starts_with("switchyard")) {
            match floor(dep) {
                Some(f) if f < own => {}
                Some(f) => wrong.push(format!("{name} (floor {own}) uses {dep} (floor {f})")),
                None => wrong.push(format!("{name} uses {dep}, which has no floor")),
            }
        }
    }
    assert_eq!(crates.len(), FLOORS.len(), "crates: {:?}", crates.keys());
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_kv_crate_uses_nothing_that_does_io() {
    let crates = declared();
    let extra: Vec<_> = crates["switchyard-kv"]
        .iter()
        .filter(|d| !KV_MAY_USE.contains(&d.as_str()))
        .collect();
    assert!(extra.is_empty(), "switchyard-kv depends on {extra:?}");
}

#[test]
fn wasmtime_zeromq_and_http_stay_where_they_belong() {
    let crates = declared();
    let mut wrong = Vec::new();
    for (name, deps) in crates {
        for dep in deps {
            if let Some((_, owner)) = ONLY_IN.iter().find(|(d, _)| d == dep)
                && owner != name
            {
                wrong.push(format!("{name} uses {dep}, which only {owner} may"));
            }
            if NO_HTTP.contains(&name.as_str()) && HTTP.contains(&dep.as_str()) {
                wrong.push(format!("{name} uses {dep}: it must know no HTTP"));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Inside a crate, no two modules import each other, directly or around a ring (Cargo
/// already refuses such a circle between crates). The scan is `tools/module-circles.py`'s.
#[test]
fn no_modules_import_each_other_in_a_circle() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../tools/module-circles.py");
    let out = Command::new("python3")
        .arg(script)
        .output()
        .expect("python3 runs (tools/test.sh installs it)");
    assert!(
        out.status.success(),
        "import circles:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
