//! Another program as the load generator: the replay starts the fleet and the router as
//! usual, then hands them to a command (e.g. NVIDIA's `aiperf`) with the trace rescaled
//! to the replay's speed, and reads its per-request records back, so that one table
//! compares routers as seen by an independent client.
//!
//! The command is a shell template: `{url}` is the router's base URL, `{trace}` a
//! Mooncake-format copy of the requests with timestamps divided by the speedup and
//! outputs capped, `{out}` a fresh directory for its results, `{model}` the model name.
//! It must leave `{out}/profile_export.jsonl` in aiperf's per-request format.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::trace::TraceRequest;
use super::{Outcome, PolicyRun, ReplayConfig};

/// The command with its placeholders filled in.
pub fn expand(template: &str, url: &str, trace: &Path, out: &Path, model: &str) -> String {
    template
        .replace("{url}", url)
        .replace("{trace}", &trace.display().to_string())
        .replace("{out}", &out.display().to_string())
        .replace("{model}", model)
}

/// The requests as the client must send them: arrival times divided by `speedup`.
pub fn scaled_trace(reqs: &[TraceRequest], speedup: f64, max_output: u32) -> String {
    let mut s = String::new();
    for r in reqs {
        let line = serde_json::json!({
            "timestamp": (r.timestamp as f64 / speedup).round() as u64,
            "input_length": r.input_length,
            "output_length": r.output_length.clamp(1, max_output.max(1)),
            "hash_ids": r.hash_ids,
        });
        s.push_str(&line.to_string());
        s.push('\n');
    }
    s
}

/// Reads aiperf's `profile_export.jsonl`: outcomes (times × `speedup`, as simulated
/// seconds) and the span from the first request's start to the last one's end.
pub fn read_records(text: &str, speedup: f64) -> Result<(Vec<Outcome>, f64), String> {
    let mut outcomes = Vec::new();
    let (mut first, mut last) = (u64::MAX, 0u64);
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("record {}: {e}", i + 1))?;
        let meta = &v["metadata"];
        if meta["benchmark_phase"]
            .as_str()
            .is_some_and(|p| p != "profiling")
        {
            continue;
        }
        let metric = |name: &str| v["metrics"][name]["value"].as_f64();
        if let (Some(start), Some(end)) = (
            meta["request_start_ns"].as_u64(),
            meta["request_end_ns"].as_u64(),
        ) {
            first = first.min(start);
            last = last.max(end);
        }
        let error = v["error"]
            .as_object()
            .map(|e| serde_json::Value::Object(e.clone()).to_string())
            .or_else(|| {
                (meta["was_cancelled"] == true).then(|| "cancelled by the client".to_string())
            });
        outcomes.push(
            match (
                metric("time_to_first_token"),
                metric("request_latency"),
                error,
            ) {
                (Some(ttft), Some(e2e), None) => Outcome {
                    ok: true,
                    ttft: ttft / 1e3 * speedup,
                    e2e: e2e / 1e3 * speedup,
                    prompt_tokens: metric("usage_prompt_tokens").unwrap_or(0.0) as u64,
                    cached_tokens: metric("usage_prompt_cache_read_tokens").unwrap_or(0.0) as u64,
                    // aiperf records each request's mean inter-token latency, not its gaps.
                    itl: metric("inter_token_latency")
                        .map(|ms| vec![(ms / 1e3 * speedup) as f32])
                        .unwrap_or_default(),
                    status: None,
                    error: None,
                    class: None,
                    whole: false,
                },
                (_, _, error) => Outcome {
                    ok: false,
                    ttft: 0.0,
                    e2e: 0.0,
                    prompt_tokens: 0,
                    cached_tokens: 0,
                    itl: Vec::new(),
                    // aiperf records the HTTP status of an error it received.
                    status: error.as_deref().and_then(http_status),
                    error: Some(error.unwrap_or_else(|| "no time to first token".into())),
                    class: None,
                    whole: false,
                },
            },
        );
    }
    if outcomes.is_empty() {
        return Err("the client recorded no requests".into());
    }
    let span = if last > first {
        (last - first) as f64 / 1e9 * speedup
    } else {
        0.0
    };
    Ok((outcomes, span))
}

/// Runs the client `template` against `url` for one router, for at most the replay's
/// duration plus ten minutes.
pub async fn run(
    config: &ReplayConfig,
    template: &str,
    name: &str,
    url: &str,
    reqs: &[TraceRequest],
) -> Result<PolicyRun, String> {
    let (logs, speedup) = (&config.logs, config.speedup);
    let limit = config.duration + Duration::from_secs(600);
    let stem = name.replace(['/', ' '], "_");
    let trace: PathBuf = logs.join(format!("{stem}.client-trace.jsonl"));
    let out: PathBuf = logs.join(format!("{stem}.client"));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    std::fs::write(&trace, scaled_trace(reqs, speedup, config.max_output))
        .map_err(|e| format!("{}: {e}", trace.display()))?;
    let command = expand(template, url, &trace, &out, "replay");
    let log = logs.join(format!("{stem}.client.log"));
    eprintln!("[{name}] client: {command} (output in {})", log.display());
    let log_file = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err_file = log_file.try_clone().map_err(|e| e.to_string())?;
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(&command)
        .stdin(Stdio::null())
        .stdout(log_file)
        .stderr(err_file)
        .spawn()
        .map_err(|e| format!("cannot start the client: {e}"))?;
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() > limit => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "the client ran longer than {limit:?}; see {}",
                    log.display()
                ));
            }
            Ok(None) => tokio::time::sleep(Duration::from_millis(200)).await,
            Err(e) => return Err(e.to_string()),
        }
    };
    if !status.success() {
        return Err(format!(
            "the client failed ({status}); see {}",
            log.display()
        ));
    }
    let records = out.join("profile_export.jsonl");
    let text =
        std::fs::read_to_string(&records).map_err(|e| format!("{}: {e}", records.display()))?;
    let (outcomes, span) = read_records(&text, speedup)?;
    Ok(PolicyRun {
        policy: name.to_string(),
        outcomes,
        span,
        router: None,
        live: None,
        worker_requests: Vec::new(),
        fleet_hit_rate: None,
        telemetry: None,
        floors: Default::default(),
    })
}

/// The HTTP status in an aiperf error record (`{"code": 503, ...}`), if any.
fn http_status(error: &str) -> Option<u16> {
    let v: serde_json::Value = serde_json::from_str(error).ok()?;
    v["code"].as_u64().and_then(|c| u16::try_from(c).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aiperf_records_become_outcomes_in_simulated_seconds() {
        let text = r#"{"metadata":{"benchmark_phase":"profiling","request_start_ns":1000000000,"request_end_ns":1500000000,"was_cancelled":false},"metrics":{"time_to_first_token":{"value":85.0,"unit":"ms"},"request_latency":{"value":258.0,"unit":"ms"},"usage_prompt_tokens":{"value":3000,"unit":"tokens"},"usage_prompt_cache_read_tokens":{"value":1024,"unit":"tokens"}}}
{"metadata":{"benchmark_phase":"warmup","request_start_ns":1,"request_end_ns":2},"metrics":{}}
{"metadata":{"benchmark_phase":"profiling","request_start_ns":1200000000,"request_end_ns":3000000000,"was_cancelled":false},"metrics":{},"error":{"code":503,"message":"busy"}}
"#;
        let (outcomes, span) = read_records(text, 20.0).unwrap();
        assert_eq!(outcomes.len(), 2, "the warm-up record is skipped");
        assert!(outcomes[0].ok);
        assert!((outcomes[0].ttft - 1.7).abs() < 1e-9);
        assert!((outcomes[0].e2e - 5.16).abs() < 1e-9);
        assert_eq!(
            (outcomes[0].prompt_tokens, outcomes[0].cached_tokens),
            (3000, 1024)
        );
        assert!(!outcomes[1].ok);
        assert!(outcomes[1].error.as_deref().unwrap().contains("busy"));
        assert!((span - 40.0).abs() < 1e-9, "2 s of wall time at 20x");
        assert!(read_records("", 1.0).is_err());
    }

    #[test]
    fn the_trace_is_rescaled_and_the_command_filled_in() {
        let reqs = vec![TraceRequest {
            timestamp: 4000,
            input_length: 600,
            output_length: 900,
            hash_ids: vec![1, 2],
        }];
        let line = scaled_trace(&reqs, 20.0, 256);
        let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
        assert_eq!(v["timestamp"], 200);
        assert_eq!(v["output_length"], 256);
        assert_eq!(v["hash_ids"], serde_json::json!([1, 2]));
        assert_eq!(
            expand(
                "c --url {url} -i {trace} -o {out} -m {model}",
                "http://x",
                Path::new("/t"),
                Path::new("/o"),
                "m"
            ),
            "c --url http://x -i /t -o /o -m m"
        );
    }
}
