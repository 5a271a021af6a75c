//! `switchyard replay TRACE.jsonl`: replays a Mooncake-format trace through the real
//! router (HTTP, in one process) in front of mock workers with limited KV capacity, once
//! per policy on fresh workers, and reports TTFT, end-to-end latency, throughput and the
//! prefix hit rate next to the trace's infinite-cache bound.

pub mod report;
pub mod trace;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;

use crate::local::{LocalFleet, LocalFleetConfig};
use crate::worker::{EngineConfig, TimingModel};
use trace::TraceRequest;

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
                timing: TimingModel::default(),
            },
            speedup: 20.0,
            max_requests: 1000,
            duration: Duration::from_secs(300),
            max_output: 256,
        }
    }
}

/// Hit-rate bounds of the replayed requests.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Bounds {
    /// With an infinite cache.
    pub infinite: f64,
    /// With one LRU cache as large as all workers' KV caches together.
    pub capacity: f64,
}

/// One request's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// Answered 200 with a complete stream.
    pub ok: bool,
    /// Time to the first streamed bytes, seconds (simulated: wall × speedup).
    pub ttft: f64,
    /// Time to the end of the stream, seconds (simulated).
    pub e2e: f64,
    /// Prompt tokens (from the worker's usage).
    pub prompt_tokens: u64,
    /// Cached prompt tokens (from the worker's usage).
    pub cached_tokens: u64,
    /// Why it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One policy's run.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyRun {
    /// The policy.
    pub policy: String,
    /// Per-request outcomes, in trace order.
    pub outcomes: Vec<Outcome>,
    /// Simulated seconds from the first arrival to the last completion.
    pub span: f64,
}

#[derive(Serialize)]
struct Body<'a> {
    model: &'a str,
    prompt: &'a [u32],
    max_tokens: u32,
    stream: bool,
    stream_options: serde_json::Value,
}

/// Replays the trace once per policy. Progress goes to stderr.
pub async fn run(config: &ReplayConfig) -> Result<(Vec<PolicyRun>, Bounds, usize), String> {
    let mut reqs = trace::read(&config.trace)?;
    reqs.truncate(config.max_requests);
    let capacity = config.workers as u64
        * config.engine.kv_blocks as u64
        * u64::from(config.engine.block_size);
    let bound = Bounds {
        infinite: trace::infinite_cache_bound(&reqs),
        capacity: trace::lru_cache_bound(&reqs, capacity),
    };
    let count = reqs.len();
    let reqs = Arc::new(reqs);
    let mut runs = Vec::new();
    for policy in &config.policies {
        let mut engine = config.engine.clone();
        engine.speedup = config.speedup;
        let (spec, policy_config) = policy.split_once('=').unwrap_or((policy.as_str(), "{}"));
        let mut fleet = LocalFleet::start(LocalFleetConfig {
            workers: config.workers,
            engine,
            model: "replay".into(),
            policy: spec.to_string(),
            policy_config: policy_config.to_string(),
            availability: true,
            listen: "127.0.0.1:0".parse().expect("valid"),
            admin_token: None,
        })
        .await
        .map_err(|e| e.to_string())?;
        fleet.ready().await?;
        let run = replay_once(config, policy, &fleet.url, reqs.clone()).await;
        fleet.stop().await;
        runs.push(run);
    }
    Ok((runs, bound, count))
}

async fn replay_once(
    config: &ReplayConfig,
    policy: &str,
    url: &str,
    reqs: Arc<Vec<TraceRequest>>,
) -> PolicyRun {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let http: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(connector);
    let start = Instant::now();
    let done = Arc::new(AtomicU64::new(0));
    let speedup = config.speedup;
    let mut tasks = Vec::with_capacity(reqs.len());
    let progress = {
        let done = done.clone();
        let total = reqs.len();
        let policy = policy.to_string();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                eprintln!(
                    "[{policy}] {:>5}/{total} done, {:.0} s",
                    done.load(Ordering::Relaxed),
                    start.elapsed().as_secs_f64()
                );
            }
        })
    };
    let first_ts = reqs.first().map_or(0, |r| r.timestamp);
    for i in 0..reqs.len() {
        let at = Duration::from_secs_f64((reqs[i].timestamp - first_ts) as f64 / 1000.0 / speedup);
        if at > config.duration {
            break;
        }
        tokio::time::sleep_until(tokio::time::Instant::from_std(start + at)).await;
        let (http, url, reqs, done) = (http.clone(), url.to_string(), reqs.clone(), done.clone());
        let max_output = config.max_output;
        tasks.push(tokio::spawn(async move {
            let r = &reqs[i];
            let tokens = trace::tokens(r);
            let body = serde_json::to_vec(&Body {
                model: "replay",
                prompt: &tokens,
                max_tokens: r.output_length.clamp(1, max_output),
                stream: true,
                stream_options: serde_json::json!({"include_usage": true}),
            })
            .expect("serialises");
            let outcome = one(&http, &url, body, speedup).await;
            done.fetch_add(1, Ordering::Relaxed);
            (start.elapsed(), outcome)
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    let mut last = Duration::ZERO;
    for t in tasks {
        let (end, o) = t.await.unwrap_or_else(|e| {
            (
                Duration::ZERO,
                Outcome {
                    ok: false,
                    ttft: 0.0,
                    e2e: 0.0,
                    prompt_tokens: 0,
                    cached_tokens: 0,
                    error: Some(e.to_string()),
                },
            )
        });
        last = last.max(end);
        outcomes.push(o);
    }
    progress.abort();
    PolicyRun {
        policy: policy.to_string(),
        outcomes,
        span: last.as_secs_f64() * speedup,
    }
}

async fn one(
    http: &Client<HttpConnector, Full<Bytes>>,
    url: &str,
    body: Vec<u8>,
    speedup: f64,
) -> Outcome {
    let failed = |e: String| Outcome {
        ok: false,
        ttft: 0.0,
        e2e: 0.0,
        prompt_tokens: 0,
        cached_tokens: 0,
        error: Some(e),
    };
    let started = Instant::now();
    let req = hyper::Request::post(format!("{url}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("valid request");
    let resp = match http.request(req).await {
        Ok(r) => r,
        Err(e) => return failed(format!("{e:?}")),
    };
    let status = resp.status();
    let mut body = resp.into_body();
    let mut ttft = None;
    let mut tail: Vec<u8> = Vec::new();
    loop {
        match body.frame().await {
            None => break,
            Some(Err(e)) => return failed(e.to_string()),
            Some(Ok(f)) => {
                let Ok(data) = f.into_data() else { continue };
                ttft.get_or_insert_with(|| started.elapsed());
                tail.extend_from_slice(&data);
                if tail.len() > 8192 {
                    tail.drain(..tail.len() - 8192);
                }
            }
        }
    }
    if !status.is_success() {
        return failed(format!("{status}: {}", String::from_utf8_lossy(&tail)));
    }
    if !tail.ends_with(b"data: [DONE]\n\n") {
        return failed("the stream ended without [DONE]".into());
    }
    let (prompt_tokens, cached_tokens) = crate::openai::scan_usage(&tail).unwrap_or((0, 0));
    Outcome {
        ok: true,
        ttft: ttft.unwrap_or_default().as_secs_f64() * speedup,
        e2e: started.elapsed().as_secs_f64() * speedup,
        prompt_tokens,
        cached_tokens,
        error: None,
    }
}
