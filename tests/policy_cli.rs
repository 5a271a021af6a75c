//! `switchyard policy ...` as a user runs it.

mod common;

use std::process::Command;

fn switchyard(args: &[&str]) -> (bool, String) {
    let cache = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("policy-cache");
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(args)
        .env("SWITCHYARD_POLICY_CACHE", cache)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn policy_check_prints_identity_and_a_sample_decision() {
    let wasm = common::guest("session_affinity");
    let (ok, out) = switchyard(&[
        "policy",
        "check",
        wasm.to_str().unwrap(),
        "--config",
        r#"{"max_in_flight": 4}"#,
    ]);
    assert!(ok, "{out}");
    assert!(out.contains("policy:   session-affinity 0.1.0"), "{out}");
    assert!(out.contains("sha256:   "), "{out}");
    assert!(out.contains("world:    switchyard:policy@0.4.0"), "{out}");
    assert!(out.contains("canary:   chose worker"), "{out}");
    // And timed as a serving router would call it, within the call budget.
    assert!(out.contains("(budget 10ms)"), "{out}");
}

#[test]
fn policy_check_explains_what_is_wrong() {
    let cases = [
        (
            common::guest("wrong_world"),
            "does not implement the switchyard:policy@0.4.0 world `policy` (nor 0.3.0, 0.2.0 or 0.1.0)",
        ),
        (common::guest("spin_forever"), "time budget"),
        // Waiting on a clock is refused as blocking, not by a panic.
        (common::guest("sleeps"), "would block"),
        (common::guest("bad_config"), "refused its configuration"),
        // IDs through a double: the canary's IDs are above 2^53, so they come back rounded.
        (common::guest("rounds_ids"), "which is not a candidate"),
        // Named, and refused before it is compiled.
        (
            common::guest("imports_http"),
            "imports `leaky:net/http@1.0.0`, which is not provided",
        ),
        (std::path::PathBuf::from("Cargo.toml"), "magic bytes"),
        (
            std::path::PathBuf::from("/nonexistent/policy.wasm"),
            "cannot read policy file",
        ),
    ];
    for (path, needle) in cases {
        let (ok, out) = switchyard(&["policy", "check", path.to_str().unwrap()]);
        assert!(!ok, "{} should fail", path.display());
        assert!(
            out.contains(needle),
            "{}: `{out}` should mention `{needle}`",
            path.display()
        );
    }
    // A refused import is found before compiling: nothing is cached for it.
    let cache = tempfile::tempdir().unwrap();
    let wasm = common::guest("imports_http");
    let (ok, _) = switchyard(&[
        "policy",
        "check",
        wasm.to_str().unwrap(),
        "--cache-dir",
        cache.path().to_str().unwrap(),
    ]);
    assert!(!ok);
    assert_eq!(std::fs::read_dir(cache.path()).map_or(0, |d| d.count()), 0);
    // The same memory cap as `serve`: kv-cost's instance needs more than 1 MiB.
    let (ok, out) = switchyard(&["policy", "check", "kv-cost", "--policy-memory-mb", "1"]);
    assert!(!ok);
    assert!(out.contains("growing memory"), "{out}");
    let (ok, out) = switchyard(&["policy", "check", "kv-cost", "--config", "{not json"]);
    assert!(!ok);
    assert!(out.contains("invalid kv-cost config"), "{out}");
}

#[test]
fn policy_builtin_lists_the_builtins() {
    let (ok, out) = switchyard(&["policy", "builtin"]);
    assert!(ok);
    assert!(
        out.contains("kv-cost") && out.contains("round-robin"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_compiles_policies_into_the_documented_cache() {
    let cache = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", common::procs::free_port());
    let wasm = common::guest("session_affinity");
    let _router = common::procs::Proc(
        Command::new(env!("CARGO_BIN_EXE_switchyard"))
            .args([
                "serve",
                "--listen",
                &listen,
                "--worker",
                "http://127.0.0.1:9",
            ])
            .args(["--policy", wasm.to_str().unwrap()])
            .env("SWITCHYARD_POLICY_CACHE", cache.path())
            .env("SWITCHYARD_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    // It listens once its policies are loaded (compiled, or read from the cache).
    common::procs::wait_ok(&format!("http://{listen}/health")).await;
    let entries = std::fs::read_dir(cache.path()).unwrap().count();
    assert!(
        entries > 0,
        "nothing was cached in {}",
        cache.path().display()
    );
}

/// `policy test` runs a cases file: the example policy's own cases pass; a case it does
/// not meet is reported and the command fails; a malformed file says which case is wrong.
#[test]
fn policy_test_runs_scripted_cases_and_fails_on_a_wrong_answer() {
    let wasm = common::guest("session_affinity");
    let cases = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/session-affinity/cases.json"
    );
    let config = r#"{"max_in_flight": 4, "reject_when_full": true}"#;
    let (ok, out) = switchyard(&[
        "policy",
        "test",
        wasm.to_str().unwrap(),
        cases,
        "--config",
        config,
    ]);
    assert!(ok, "{out}");
    assert!(out.contains("4 of 4 cases passed"), "{out}");

    let dir = tempfile::tempdir().unwrap();
    let wrong = dir.path().join("wrong.json");
    std::fs::write(
        &wrong,
        r#"[{"name": "busy worker", "candidates": [{"id": 1, "in_flight": 3}, {"id": 2}],
             "expect": {"worker": 1}},
            {"candidates": [{"id": 5}], "expect": {"answer": true}}]"#,
    )
    .unwrap();
    let (ok, out) = switchyard(&[
        "policy",
        "test",
        wasm.to_str().unwrap(),
        wrong.to_str().unwrap(),
    ]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("FAIL  busy worker: expected worker 1, chose worker 2"),
        "{out}"
    );
    assert!(out.contains("1 of 2 cases passed"), "{out}");

    // The built-in kv-cost, on a case written for it.
    let prefix = dir.path().join("prefix.json");
    std::fs::write(
        &prefix,
        r#"[{"request": {"prompt_blocks": 62},
             "candidates": [{"id": 9}, {"id": 4, "overlap_blocks": 62}],
             "expect": {"worker": 4}}]"#,
    )
    .unwrap();
    let (ok, out) = switchyard(&["policy", "test", "kv-cost", prefix.to_str().unwrap()]);
    assert!(ok, "{out}");

    std::fs::write(
        &wrong,
        r#"[{"candidates": [{"id": 1}], "expect": {"worker": "one"}}]"#,
    )
    .unwrap();
    let (ok, out) = switchyard(&["policy", "test", "kv-cost", wrong.to_str().unwrap()]);
    assert!(!ok);
    assert!(out.contains("not a list of cases"), "{out}");
}

/// `policy bench` times the policy and the built-in kv-cost at 8, 64 and 1,024
/// candidates (no figure is asserted: only that every row is there and no call failed).
#[test]
fn policy_bench_prints_the_call_cost_at_three_sizes_beside_kv_cost() {
    let wasm = common::guest("session_affinity");
    let (ok, out) = switchyard(&["policy", "bench", wasm.to_str().unwrap(), "--calls", "200"]);
    assert!(ok, "{out}");
    for size in ["8", "64", "1024"] {
        for policy in ["session-affinity 0.1.0", "kv-cost (built-in)"] {
            let row = out
                .lines()
                .find(|l| l.starts_with(policy) && l.split_whitespace().any(|w| w == size))
                .unwrap_or_else(|| panic!("no row for {policy} at {size}: {out}"));
            assert!(row.trim_end().ends_with(" 0"), "failed calls: {row}");
        }
    }
}

/// Makes a `lang` scaffold named `name`, builds it with `build` (run in the project), and
/// checks that the component at `wasm` (relative to the project) passes `policy check`
/// under its name and its own sample cases.
fn scaffold_builds_and_passes(lang: &str, name: &str, build: &[&str], wasm: &str) {
    let dir = tempfile::tempdir().unwrap();
    let project = dir.path().join(name);
    let (ok, out) = switchyard(&[
        "policy",
        "new",
        name,
        "--lang",
        lang,
        "--dir",
        project.to_str().unwrap(),
    ]);
    assert!(ok, "{out}");
    for step in build.split(|s| *s == "&&") {
        let program = if step[0] == "cargo" {
            // The toolchain running this test (it has the wasm32-wasip2 target).
            std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
        } else {
            step[0].to_string()
        };
        let out = Command::new(program)
            .args(&step[1..])
            .current_dir(&project)
            // The guests' target directory: their dependencies are built there already.
            .env(
                "CARGO_TARGET_DIR",
                concat!(env!("CARGO_MANIFEST_DIR"), "/../target/guests"),
            )
            .output()
            .unwrap_or_else(|e| panic!("{step:?}: {e}"));
        assert!(
            out.status.success(),
            "{step:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let wasm = project.join(wasm);
    let (ok, out) = switchyard(&["policy", "check", wasm.to_str().unwrap()]);
    assert!(ok, "{out}");
    assert!(out.contains(&format!("policy:   {name} 0.1.0")), "{out}");
    let cases = project.join("cases.json");
    let (ok, out) = switchyard(&[
        "policy",
        "test",
        wasm.to_str().unwrap(),
        cases.to_str().unwrap(),
    ]);
    assert!(ok, "{out}");
    assert!(out.contains("3 of 3 cases passed"), "{out}");
}

/// `policy new` writes a Rust project that builds, as its README says, into a component
/// `policy check` accepts and whose sample cases `policy test` passes.
#[test]
fn a_new_rust_policy_builds_and_passes_check_and_its_cases() {
    scaffold_builds_and_passes(
        "rust",
        "prefix-first",
        &["cargo", "build", "--release", "--target", "wasm32-wasip2"],
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../target/guests/wasm32-wasip2/release/prefix_first.wasm"
        ),
    );
}

/// The Python scaffold builds with componentize-py (tools/test.sh installs the version its
/// requirements.txt pins): worker IDs above 2^53 (the canary's) come back exact.
#[test]
fn a_new_python_policy_builds_and_passes_check_and_its_cases() {
    scaffold_builds_and_passes("python", "py-prefix", &["./build.sh"], "py_prefix.wasm");
}

/// The JavaScript scaffold builds with componentize-js (from npm, as its package.json
/// pins it): BigInt worker IDs come back exact, and no `wasi:http` import is left in.
#[test]
fn a_new_javascript_policy_builds_and_passes_check_and_its_cases() {
    scaffold_builds_and_passes(
        "js",
        "js-prefix",
        &[
            "npm",
            "install",
            "--no-audit",
            "--no-fund",
            "&&",
            "npm",
            "run",
            "build",
        ],
        "js_prefix.wasm",
    );
}
