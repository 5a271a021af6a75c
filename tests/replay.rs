//! `switchyard replay` on a small generated trace (tests never read ../shared).

use std::process::Command;

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
    let json = dir.path().join("out.json");
    let chart = dir.path().join("ttft.svg");
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args([
            "replay",
            trace.to_str().unwrap(),
            "--policy",
            "kv-cost",
            "--policy",
            "round-robin",
            "--speedup",
            "50",
            "--workers",
            "3",
        ])
        .args([
            "--json",
            json.to_str().unwrap(),
            "--chart",
            chart.to_str().unwrap(),
        ])
        .env(
            "SWITCHYARD_POLICY_CACHE",
            std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("policy-cache"),
        )
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("| kv-cost | 30 | 0 |"), "{stdout}");
    assert!(stdout.contains("| round-robin | 30 | 0 |"), "{stdout}");

    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    // Turns 2 and 3 repeat all but the last block of the turn before.
    let bound = v["infinite_cache_bound"].as_f64().unwrap();
    assert!(bound > 0.4, "{bound}");
    let hit = |policy: &str| {
        v["summary"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["policy"] == policy)
            .unwrap()["hit_rate"]
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
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("kv-cost") && svg.contains("<polyline"));
}
