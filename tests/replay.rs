//! `switchyard replay` on a small generated trace (tests never read ../shared).

mod common;

use std::path::Path;
use std::process::Command;

/// Runs `switchyard replay TRACE ARGS` to success, writing its JSON (`out.json`) and its
/// chart (`ttft.svg`) beside the trace; its standard output and its JSON.
fn replay(trace: &Path, args: &[&str]) -> (String, serde_json::Value) {
    let dir = trace.parent().unwrap();
    let json = dir.join("out.json");
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .arg("replay")
        .arg(trace)
        .args(args)
        .arg("--json")
        .arg(&json)
        .arg("--chart")
        .arg(dir.join("ttft.svg"))
        .env(
            "SWITCHYARD_POLICY_CACHE",
            Path::new(env!("CARGO_TARGET_TMPDIR")).join("policy-cache"),
        )
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    (stdout, v)
}

/// A generated chat trace of `requests` requests (10 a second, seed 3) in `dir`, without
/// long documents: a handful of 16k-token prefills would make the mean TTFT of a run this
/// short a matter of luck.
fn chat_trace(dir: &Path, requests: &str) -> std::path::PathBuf {
    let trace = dir.join("trace.jsonl");
    let generated = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args([
            "trace-gen",
            "--requests",
            requests,
            "--rate",
            "10",
            "--seed",
            "3",
        ])
        .args(["--long-fraction", "0"])
        .output()
        .unwrap();
    assert!(generated.status.success());
    std::fs::write(&trace, &generated.stdout).unwrap();
    trace
}

/// Four requests in `dir` sharing a two-block prefix (each with a block of its own),
/// `gap_ms` apart in trace time.
fn shared_prefix_trace(dir: &Path, gap_ms: u64) -> std::path::PathBuf {
    let trace = dir.join("trace.jsonl");
    let lines: Vec<String> = (0..4u64)
        .map(|i| {
            format!(
                r#"{{"timestamp": {}, "input_length": 1400, "output_length": 4, "hash_ids": [1, 2, {}]}}"#,
                i * gap_ms,
                10 + i
            )
        })
        .collect();
    std::fs::write(&trace, lines.join("\n")).unwrap();
    trace
}

/// The entry of the replay's JSON list `list` (`summary` or `runs`) for policy `name`.
fn entry(v: &serde_json::Value, list: &str, name: &str, stdout: &str) -> serde_json::Value {
    v[list]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["policy"] == name)
        .unwrap_or_else(|| panic!("no run named {name}: {stdout}"))
        .clone()
}

#[test]
fn replay_compares_policies_and_writes_json_and_a_chart() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.jsonl");
    // Ten conversations of three turns each; every turn extends the previous one. Requests
    // are spaced so that they rarely overlap: the cache, not the load, decides.
    let mut lines = Vec::new();
    for turn in 0..3u64 {
        for conv in 0..10u64 {
            let ids: Vec<u64> = (0..=turn + 1).map(|b| conv * 100 + b).collect();
            let len = ids.len() as u64 * 512 - 100;
            lines.push(format!(
                r#"{{"timestamp": {}, "input_length": {len}, "output_length": 8, "hash_ids": {ids:?}}}"#,
                turn * 40_000 + conv * 2_000
            ));
        }
    }
    std::fs::write(&trace, lines.join("\n")).unwrap();
    let (stdout, v) = replay(
        &trace,
        &[
            "--policy",
            "kv-cost",
            "--policy",
            "round-robin",
            "--speedup",
            "50",
            "--workers",
            "3",
        ],
    );
    assert!(stdout.contains("| kv-cost | 30 | 0 |"), "{stdout}");
    assert!(stdout.contains("| round-robin | 30 | 0 |"), "{stdout}");

    // Turns 2 and 3 repeat all but the last block of the turn before.
    let bound = v["infinite_cache_bound"].as_f64().unwrap();
    assert!(bound > 0.4, "{bound}");
    let hit = |policy: &str| {
        entry(&v, "summary", policy, &stdout)["hit_rate"]
            .as_f64()
            .unwrap()
    };
    // kv-cost sends each turn to the worker holding the conversation.
    assert!(
        hit("kv-cost") > 0.8 * bound,
        "kv-cost hit rate {} vs bound {bound}",
        hit("kv-cost")
    );
    assert!(
        hit("kv-cost") > hit("round-robin"),
        "{} vs {}",
        hit("kv-cost"),
        hit("round-robin")
    );
    let svg = std::fs::read_to_string(dir.path().join("ttft.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("kv-cost") && svg.contains("<polyline"));
}

/// A small real client in Python that speaks the `--client` contract: reads `{trace}`,
/// sends each request to `{url}` as a streaming text completion at its (rescaled) time,
/// and writes aiperf-style records to `{out}/profile_export.jsonl`.
const CLIENT: &str = r#"
import json, sys, time, urllib.request
url, trace, out = sys.argv[1], sys.argv[2], sys.argv[3]
reqs = [json.loads(l) for l in open(trace) if l.strip()]
t0 = time.time()
with open(out + "/profile_export.jsonl", "w") as f:
    for r in reqs:
        time.sleep(max(0.0, t0 + r["timestamp"] / 1000 - time.time()))
        words = " ".join("w%d" % (h % 97) for h in r["hash_ids"] for _ in range(64))
        body = json.dumps({"model": "replay", "prompt": words, "max_tokens": r["output_length"],
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
        start = time.time_ns()
        req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
        first, usage = None, {}
        with urllib.request.urlopen(req) as resp:
            for line in resp:
                first = first or time.time_ns()
                if line.startswith(b"data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
        end = time.time_ns()
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        f.write(json.dumps({"metadata": {"benchmark_phase": "profiling", "request_start_ns": start,
                                         "request_end_ns": end, "was_cancelled": False},
                            "metrics": {"time_to_first_token": {"value": (first - start) / 1e6},
                                        "request_latency": {"value": (end - start) / 1e6},
                                        "usage_prompt_tokens": {"value": usage.get("prompt_tokens", 0)},
                                        "usage_prompt_cache_read_tokens": {"value": cached}}}) + "\n")
"#;

#[test]
fn another_program_can_be_the_client() {
    let dir = tempfile::tempdir().unwrap();
    // Four requests sharing a two-block prefix, one second apart in trace time.
    let trace = shared_prefix_trace(dir.path(), 1000);
    let client = dir.path().join("client.py");
    std::fs::write(&client, CLIENT).unwrap();
    let logs = dir.path().join("logs");
    let (stdout, v) = replay(
        &trace,
        &[
            "--policy",
            "kv-cost",
            "--speedup",
            "20",
            "--workers",
            "2",
            "--client",
            &format!("python3 {} {{url}} {{trace}} {{out}}", client.display()),
            "--router-logs",
            logs.to_str().unwrap(),
        ],
    );
    assert!(stdout.contains("| kv-cost | 4 | 0 |"), "{stdout}");
    // The client got the trace at the replay's speed: 1 s of trace time is 50 ms.
    let sent = std::fs::read_to_string(logs.join("kv-cost.client-trace.jsonl")).unwrap();
    assert!(
        sent.lines().nth(1).unwrap().contains(r#""timestamp":50"#),
        "{sent}"
    );
    // Its records became the run's outcomes: the later requests found the shared prefix.
    let outcomes = v["runs"][0]["outcomes"].as_array().unwrap();
    assert_eq!(outcomes.len(), 4);
    assert!(
        outcomes
            .iter()
            .all(|o| o["ok"] == true && o["ttft"].as_f64().unwrap() > 0.0)
    );
    assert!(
        outcomes[1..]
            .iter()
            .any(|o| o["cached_tokens"].as_u64().unwrap() > 0),
        "{outcomes:?}"
    );
}

/// Three router replicas in front of the same workers, the replay's client sending them
/// requests in turn (as a load balancer would): kv-cost through them routes as well as
/// through one router, because each replica adds the workers' own load reports to its
/// third of the requests instead of believing the workers three times emptier.
#[test]
fn three_router_replicas_route_as_well_as_one() {
    let dir = tempfile::tempdir().unwrap();
    let trace = chat_trace(dir.path(), "300");
    let (stdout, v) = replay(
        &trace,
        &[
            "--policy",
            "kv-cost",
            "--routers",
            "3",
            "--workers",
            "4",
            "--kv-blocks",
            "2048",
            "--block-size",
            "16",
            // Slow enough that four routers' CPU time in a debug build is not simulated
            // as seconds of queueing.
            "--speedup",
            "2",
        ],
    );
    let summary = |name: &str| entry(&v, "summary", name, &stdout);
    let (one, three) = (summary("kv-cost x1 routers"), summary("kv-cost x3 routers"));
    for s in [&one, &three] {
        assert_eq!(s["failed"], 0, "{stdout}");
        assert_eq!(s["requests"], 300, "{stdout}");
    }
    let f = |s: &serde_json::Value, k: &str| s[k].as_f64().unwrap();
    assert!(
        f(&three, "ttft_mean_s") <= 1.25 * f(&one, "ttft_mean_s"),
        "three replicas' mean TTFT is more than 25 % above one router's:\n{stdout}"
    );
    // On 300 requests the skew moves run to run by more than a tenth (one router 1.12
    // against three 1.12–1.35 with identical settings): the bound catches replicas
    // piling onto one worker, not that noise.
    assert!(
        f(&three, "load_skew") <= f(&one, "load_skew") + 0.35,
        "three replicas skew the load more than one router:\n{stdout}"
    );
    assert!(
        f(&three, "hit_rate") >= f(&one, "hit_rate") - 0.05,
        "three replicas find fewer cached prefixes than one router:\n{stdout}"
    );
}

/// `--shadow` runs a shadow beside every policy, so that one run compares several
/// strategies on the same decisions: round-robin as a shadow of itself agrees on every
/// decision, as a shadow of kv-cost it does not, and it would have used less of the
/// cache kv-cost found. The decision telemetry agrees with what the workers reported.
#[test]
fn a_shadow_beside_each_policy_compares_them_on_the_same_decisions() {
    let dir = tempfile::tempdir().unwrap();
    let trace = chat_trace(dir.path(), "120");
    let (stdout, v) = replay(
        &trace,
        &[
            "--policy",
            "kv-cost,round-robin",
            "--shadow",
            "round-robin",
            "--workers",
            "3",
            "--kv-blocks",
            "2048",
            "--block-size",
            "16",
            "--speedup",
            "4",
        ],
    );
    assert!(
        stdout.contains("| policy (decision telemetry) |"),
        "{stdout}"
    );
    let run_of = |name: &str| entry(&v, "runs", name, &stdout);
    for name in ["kv-cost", "round-robin"] {
        let t = &run_of(name)["telemetry"];
        assert_eq!(t["routed"], 120, "{stdout}");
        let s = &t["shadow"];
        assert_eq!(s["compared"], 120, "{stdout}");
        assert_eq!(
            (s["dropped"].as_u64(), s["failures"].as_u64()),
            (Some(0), Some(0))
        );
        // The workers reported what the router predicted on them (exact event views).
        assert_eq!(
            t["predicted_cached_tokens"], t["reported_cached_tokens"],
            "{stdout}"
        );
    }
    let (kv, rr) = (
        run_of("kv-cost")["telemetry"].clone(),
        run_of("round-robin")["telemetry"].clone(),
    );
    assert_eq!(
        rr["shadow"]["agreed"], 120,
        "round-robin agrees with itself: {stdout}"
    );
    assert!(kv["shadow"]["agreed"].as_u64().unwrap() < 120, "{stdout}");
    let blocks = |t: &serde_json::Value, who: &str| t["shadow"][who].as_u64().unwrap();
    assert!(
        blocks(&kv, "shadow_overlap_blocks") < blocks(&kv, "live_overlap_blocks"),
        "round-robin would have used less of the cache than kv-cost did: {stdout}"
    );
    let ratio = |t: &serde_json::Value| {
        t["chosen_overlap_blocks"].as_f64().unwrap() / t["best_overlap_blocks"].as_f64().unwrap()
    };
    assert!(ratio(&kv) > ratio(&rr), "{stdout}");
}

/// Running engines instead of fresh mock workers (`--engine`, as `tools/b7-vllm.sh` runs
/// real vLLM engines): before each router the engines' caches are emptied, so a router
/// run twice finds the same hits both times, and the hit rate and finished requests are
/// the engines' own counters over the run (the mock keeps vLLM's); the routers' rounds
/// give a table of medians and ranges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_engines_are_emptied_before_each_router_and_read_from_their_counters() {
    let dir = tempfile::tempdir().unwrap();
    // Four requests sharing a two-block prefix, half a second apart.
    let trace = shared_prefix_trace(dir.path(), 500);
    // The engines' measured prices without running engines: refused, not ignored.
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .arg("replay")
        .arg(&trace)
        .args(["--engine-floor", "2,1"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains("--engine-floor prices running engines"),
        "{said}"
    );
    let mut engines = Vec::new();
    let mut args: Vec<String> = Vec::new();
    for _ in 0..2 {
        let listen = format!("127.0.0.1:{}", common::procs::free_port());
        let p =
            common::procs::switchyard(&["mock-worker", "--listen", &listen, "--model", "replay"]);
        common::procs::wait_ok(&format!("http://{listen}/v1/models")).await;
        engines.push(p);
        args.extend(["--engine".to_string(), format!("http://{listen}")]);
    }
    let bin = env!("CARGO_BIN_EXE_switchyard");
    args.extend(
        [
            "--policy",
            "none",
            "--speedup",
            "1",
            "--rounds",
            "2",
            "--router-logs",
            dir.path().join("logs").to_str().unwrap(),
            // The engines' measured prices: the oracle floor of TTFT on them.
            "--engine-floor",
            "2,1",
        ]
        .map(String::from),
    );
    args.extend([
        "--router".to_string(),
        format!("sy={bin} serve --listen 127.0.0.1:{{port}} {{worker_args}} --model replay --kv-events true"),
        "--router".to_string(),
        format!("rr={bin} serve --listen 127.0.0.1:{{port}} {{worker_args}} --model replay --kv-events true --policy round-robin"),
    ]);
    let (stdout, v) = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        replay(&trace, &args)
    })
    .await
    .unwrap();
    let runs: Vec<&serde_json::Value> = v["runs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["policy"] == "sy")
        .collect();
    assert_eq!(runs.len(), 2, "{stdout}");
    let rates: Vec<f64> = runs
        .iter()
        .map(|r| {
            r["fleet_hit_rate"]
                .as_f64()
                .expect("the engines' own hit rate")
        })
        .collect();
    assert!(rates[0] > 0.0, "the shared prefix hit: {rates:?}");
    // Emptied before each router (the warm-up and the first round's blocks gone): the
    // second round finds what the first did, no more.
    assert!((rates[0] - rates[1]).abs() < 1e-9, "{rates:?}");
    for r in &runs {
        let finished: u64 = r["worker_requests"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_u64().unwrap())
            .sum();
        assert_eq!(
            finished, 4,
            "the run's requests, from the engines' counters: {r}"
        );
    }
    assert!(stdout.contains("Over 2 rounds"), "{stdout}");
    let row = stdout
        .lines()
        .find(|l| l.starts_with("| sy | 2 | 0 |"))
        .unwrap_or_else(|| panic!("{stdout}"));
    // TTFT over the floor, each run's at least 1 (no router beats the floor).
    let floor: Vec<f64> = row
        .split('|')
        .nth(8)
        .unwrap()
        .split(['(', '–', ')', ',', '×'])
        .filter_map(|x| x.trim().parse().ok())
        .collect();
    assert!(
        !floor.is_empty() && floor.iter().all(|r| *r >= 1.0),
        "{row}"
    );
    drop(engines);
}
