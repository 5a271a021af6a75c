//! The architecture's floors, as Cargo sees them: every workspace crate's declared
//! dependencies (from `cargo metadata`) point only to lower floors, and the crates that
//! must stay free of something (I/O in the KV crate, wasmtime outside the policy
//! runtime, HTTP in the pure crates) are, through every crate they reach, not only the
//! ones they name. A change that breaks the layering fails here with the crate and the
//! path to the dependency named, not in review; so does an import circle between two
//! modules of one crate, and a source file over 700 lines.

use std::collections::BTreeMap;
use std::process::Command;

use serde_json::Value;

/// Each workspace crate's floor: a crate may depend only on crates of lower floors.
const FLOORS: &[(&str, u32)] = &[
    ("switchyard-ids", 0),
    ("switchyard-bounded", 0),
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
    // gRPC is the endpoint picker's alone.
    ("tonic", "switchyard-server"),
    ("envoy-types", "switchyard-server"),
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
    "switchyard-bounded",
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

/// The triple of the machine the tests run on, as rustc names it.
fn host_triple() -> String {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let out = Command::new(rustc)
        .arg("-vV")
        .output()
        .expect("rustc -vV runs");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("host: "))
        .expect("rustc -vV names its host")
        .trim()
        .to_string()
}

/// `cargo metadata --offline` with `extra` flags, as JSON, resolved for this machine's
/// platform only: a registry that only ever built for it lacks other platforms' crates
/// (`anstyle-wincon`, `windows-sys`), and `--offline` must not need them.
fn metadata(extra: &[&str]) -> Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--offline"])
        .args(["--filter-platform", &host_triple()])
        .args(extra)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn read_metadata() -> BTreeMap<String, Vec<String>> {
    let meta = metadata(&["--no-deps"]);
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

/// The resolved graph: package name → the names of what it depends on (normal and build
/// edges, for this machine's platform), read once for all tests.
fn graph() -> &'static BTreeMap<String, Vec<String>> {
    static GRAPH: std::sync::OnceLock<BTreeMap<String, Vec<String>>> = std::sync::OnceLock::new();
    GRAPH.get_or_init(|| {
        let meta = metadata(&[]);
        let names: BTreeMap<&str, &str> = meta["packages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p["id"].as_str().unwrap(), p["name"].as_str().unwrap()))
            .collect();
        let mut graph: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for node in meta["resolve"]["nodes"].as_array().unwrap() {
            let name = names[node["id"].as_str().unwrap()].to_string();
            let deps = graph.entry(name).or_default();
            for d in node["deps"].as_array().unwrap() {
                let used = d["dep_kinds"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|k| k["kind"] != "dev");
                if used {
                    deps.push(names[d["pkg"].as_str().unwrap()].to_string());
                }
            }
        }
        graph
    })
}

/// The path from `from` to `to` through the resolved graph, not passing through `via`
/// (the one crate allowed to bring `to` in), if there is one.
fn path(from: &str, to: &str, via: Option<&str>) -> Option<Vec<String>> {
    let graph = graph();
    let mut came: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([from]);
    while let Some(at) = queue.pop_front() {
        if at == to {
            let mut p = vec![to.to_string()];
            let mut cur = to;
            while let Some(prev) = came.get(cur) {
                p.push(prev.to_string());
                cur = prev;
            }
            p.reverse();
            return Some(p);
        }
        for next in graph.get(at).into_iter().flatten() {
            if Some(next.as_str()) == via || next == from || came.contains_key(next.as_str()) {
                continue;
            }
            came.insert(next, at);
            queue.push_back(next);
        }
    }
    None
}

/// Networking and async runtimes, which `switchyard-kv` must not reach.
const IO: &[&str] = &["tokio", "mio", "socket2", "async-std", "smol"];

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
fn no_crate_reaches_io_wasmtime_zeromq_or_http_around_its_floor() {
    let mut wrong = Vec::new();
    for io in IO.iter().chain(HTTP) {
        if let Some(p) = path("switchyard-kv", io, None) {
            wrong.push(format!("switchyard-kv reaches {io}: {}", p.join(" -> ")));
        }
    }
    for (name, _) in FLOORS {
        for (dep, owner) in ONLY_IN {
            if name != owner
                && let Some(p) = path(name, dep, Some(owner))
            {
                wrong.push(format!(
                    "{name} reaches {dep} other than through {owner}: {}",
                    p.join(" -> ")
                ));
            }
        }
        if NO_HTTP.contains(name) {
            for http in HTTP {
                if let Some(p) = path(name, http, None) {
                    wrong.push(format!("{name} reaches {http}: {}", p.join(" -> ")));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Rooms stay small: no source file of the workspace over 700 lines (split by concern
/// as it grows).
#[test]
fn no_source_file_is_over_700_lines() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(&root)
        .output();
    // Outside a git checkout (a source tarball), every file under the workspace's
    // source folders.
    let files: Vec<std::path::PathBuf> = match out {
        Ok(o) if o.status.success() => o
            .stdout
            .split(|b| *b == 0)
            .filter(|f| !f.is_empty())
            .map(|f| root.join(String::from_utf8_lossy(f).as_ref()))
            .collect(),
        _ => {
            let mut files = Vec::new();
            let mut stack = vec![
                root.join("host"),
                root.join("policies"),
                root.join("tests"),
                root.join("tools"),
            ];
            while let Some(dir) = stack.pop() {
                for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                    let p = e.path();
                    if p.is_dir() && !p.ends_with("target") {
                        stack.push(p);
                    } else {
                        files.push(p);
                    }
                }
            }
            files
        }
    };
    const SOURCE: &[&str] = &["rs", "py", "sh", "js", "ts", "html", "wit"];
    let mut long = Vec::new();
    for f in files {
        if !f
            .extension()
            .is_some_and(|e| SOURCE.contains(&e.to_str().unwrap_or("")))
        {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        let lines = text.lines().count();
        if lines > 700 {
            long.push(format!("{} has {lines} lines", f.display()));
        }
    }
    assert!(long.is_empty(), "over 700 lines:\n{}", long.join("\n"));
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

/// Rooms stay small inside a file too: no function of the workspace (Rust or Python,
/// tests included) over 150 lines, first line to closing brace. The scan is
/// `tools/long-functions.py`'s.
#[test]
fn no_function_is_over_150_lines() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../tools/long-functions.py");
    let out = Command::new("python3")
        .args([script, "150"])
        .output()
        .expect("python3 runs (tools/test.sh installs it)");
    assert!(
        out.status.success(),
        "functions over 150 lines (split them by concern):\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
