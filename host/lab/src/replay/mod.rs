//! `switchyard replay TRACE.jsonl`: replays a Mooncake-format trace through the real
//! router (HTTP, in one process) in front of mock workers with limited KV capacity, once
//! per policy on fresh workers, and reports TTFT, end-to-end latency, throughput and the
//! prefix hit rate next to the trace's infinite-cache bound.

pub mod client;
mod config;
pub mod engines;
pub mod external;
pub mod floor;
pub mod live;
pub mod report;
mod stats;
pub mod synth;
pub mod telemetry;
pub mod trace;

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
use external::{ProcessCost, replay_external};
use live::LiveTimings;
use switchyard_ids::Role;
use switchyard_worker::{FaultConfig, MockWorker, MockWorkerConfig, PdConfig};
use trace::TraceRequest;

pub use config::{Mix, ReplayConfig, Slo, split_policies};

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
    /// The gaps between the stream's chunks after the first, seconds (simulated): the
    /// inter-token latency as the client sees it.
    #[serde(skip)]
    pub itl: Vec<f32>,
    /// The router's status when it answered other than 2xx (408, 429 and 503: refused).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Why it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Its class, when the replay marks them (`interactive` or `batch`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub class: Option<&'static str>,
    /// A whole (non-streamed) answer: its first byte is its end, and its SLO its end's.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub whole: bool,
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
    /// The router process's cost (external routers only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub router: Option<ProcessCost>,
    /// The router's own latency histograms, when it exposes Switchyard's `/metrics`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub live: Option<LiveTimings>,
    /// Requests each mock worker finished.
    pub worker_requests: Vec<u64>,
    /// On a disaggregated fleet: the share of the prompt tokens no worker computed (the
    /// decode workers report received blocks as cached, so their usage does not say).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet_hit_rate: Option<f64>,
    /// What Switchyard's routers said about their decisions (in-process runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub telemetry: Option<telemetry::Telemetry>,
    /// Each request's oracle floor of TTFT (simulated seconds), in trace order, where the
    /// lab knows the engines' timing (its mock workers, or `--engine-floor`); empty
    /// otherwise.
    #[serde(skip)]
    pub floors: Arc<Vec<f64>>,
}

/// How prompts are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Prompts {
    /// Token ID arrays.
    Tokens,
    /// Text that tokenizes to the same lengths and prefixes.
    Text,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Prompt {
    Tokens(Vec<u32>),
    Text(String),
}

#[derive(Serialize)]
struct Body<'a> {
    model: &'a str,
    prompt: Prompt,
    max_tokens: u32,
    stream: bool,
    stream_options: serde_json::Value,
}

/// The requests as the bounds count them: in the trace's blocks, or, when the routers
/// get text and the workers a `tokenizer.json`, in that tokenizer's tokens and the
/// workers' blocks (a real tokenizer does not cut the text back into the trace's blocks:
/// English-like text takes about half the trace's tokens).
fn block_views(
    config: &ReplayConfig,
    reqs: &[TraceRequest],
    prompts: Prompts,
) -> Result<Vec<trace::BlockView>, String> {
    let tokenizer = match (prompts, &config.tokenizer) {
        (Prompts::Text, Some(path)) => {
            switchyard_tokens::Tokenizer::from_file(path).map_err(|e| e.to_string())?
        }
        _ => return Ok(reqs.iter().map(trace::BlockView::of_trace).collect()),
    };
    let block = config.engine.block_size as usize;
    reqs.iter()
        .map(|r| {
            let tokens = tokenizer
                .encode(&trace::text(r))
                .map_err(|e| e.to_string())?;
            Ok(trace::BlockView::of_tokens(&tokens, block))
        })
        .collect()
}

/// Replays the trace once per policy. Progress goes to stderr.
pub async fn run(config: &ReplayConfig) -> Result<(Vec<PolicyRun>, Bounds, usize), String> {
    let mut reqs = trace::read(&config.trace)?;
    reqs.truncate(config.max_requests);
    let capacity = config.workers as u64
        * config.engine.kv_blocks as u64
        * u64::from(config.engine.block_size);
    let prompts = if config.routers.is_empty() {
        Prompts::Tokens
    } else {
        Prompts::Text
    };
    let views = block_views(config, &reqs, prompts)?;
    let bound = Bounds {
        infinite: trace::infinite_cache_bound(&views),
        capacity: trace::lru_cache_bound(&views, capacity),
    };
    // The floor on the lab's own workers, or on real engines whose timing was measured.
    let floors: Arc<Vec<f64>> = Arc::new(
        match (config.engines.specs.is_empty(), config.engines.floor) {
            (true, _) => trace::never_seen_tokens(&views)
                .into_iter()
                .map(|n| floor::oracle_ttft(n, &config.engine))
                .collect(),
            (false, Some(m)) => trace::never_seen_tokens(&views)
                .into_iter()
                .map(|n| m.ttft(n))
                .collect(),
            (false, None) => Vec::new(),
        },
    );
    let count = reqs.len();
    let reqs = Arc::new(reqs);
    let mut runs = Vec::new();
    let modes = if config.kv_events.is_empty() {
        vec![crate::local::KvEventsMode::Zmq]
    } else {
        config.kv_events.clone()
    };
    let replicas: Vec<usize> = if config.replicas > 1 {
        vec![1, config.replicas]
    } else {
        vec![1]
    };
    let mut runs_of = Vec::new();
    for mode in &modes {
        for policy in &config.policies {
            for routers in &replicas {
                runs_of.push((*mode, policy, *routers));
            }
        }
    }
    for (mode, policy, routers) in runs_of {
        let mut name = if modes.len() > 1 {
            format!("{policy} ({mode})")
        } else {
            policy.clone()
        };
        if config.replicas > 1 {
            name = format!("{name} x{routers} routers");
        }
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
            admin_token: Some(ADMIN_TOKEN.into()),
            kv_events: mode,
            tokenizer: config.tokenizer.clone(),
            // Predictions live as long in the workers' simulated time as they would
            // live in real time.
            prediction_ttl_secs: Some(
                switchyard_router::Approximate::default().ttl.as_secs_f64() / config.speedup,
            ),
            routers,
            // The workers' metrics read once a second of their simulated time.
            engine_metrics_ms: Some(((1000.0 / config.speedup) as u64).max(20)),
        })
        .await
        .map_err(|e| e.to_string())?;
        fleet.ready().await?;
        if let Some(shadow) = &config.shadow {
            for url in &fleet.urls {
                telemetry::attach_shadow(url, ADMIN_TOKEN, shadow).await?;
            }
        }
        let run = drive(config, &name, &fleet.urls, reqs.clone(), prompts).await;
        let worker_requests = fleet.workers.iter().map(|w| w.stats().finished).collect();
        let telemetry = telemetry::read(&fleet.urls, ADMIN_TOKEN).await;
        fleet.stop().await;
        runs.push(PolicyRun {
            worker_requests,
            telemetry: Some(telemetry?),
            ..run?
        });
    }
    if !config.engines.specs.is_empty() {
        engines::warm_up(config, &reqs).await?;
    }
    let n = config.routers.len();
    for round in 0..config.rounds.max(1) {
        for k in 0..n {
            let router = &config.routers[(round + k) % n];
            runs.push(replay_external(config, router, reqs.clone()).await?);
        }
    }
    for r in &mut runs {
        r.floors = floors.clone();
    }
    Ok((runs, bound, count))
}

/// The admin token of the replay's in-process routers (they listen on 127.0.0.1 only,
/// for the length of one run).
const ADMIN_TOKEN: &str = "replay-admin-token";

/// One run's requests, by the replay's own client (sent to the routers in turn) or by
/// the configured one (to the first).
async fn drive(
    config: &ReplayConfig,
    name: &str,
    urls: &[String],
    reqs: Arc<Vec<TraceRequest>>,
    prompts: Prompts,
) -> Result<PolicyRun, String> {
    match &config.client {
        Some(template) => client::run(config, template, name, &urls[0], &reqs).await,
        None => Ok(replay_once(config, name, urls, reqs, prompts).await),
    }
}

/// The body of a GET that answers 200 within five seconds.
async fn scrape(url: &str) -> Option<String> {
    let http: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let req = hyper::Request::get(url)
        .body(Full::new(Bytes::new()))
        .ok()?;
    let answer = tokio::time::timeout(Duration::from_secs(5), async {
        let r = http.request(req).await.ok()?;
        if !r.status().is_success() {
            return None;
        }
        r.into_body().collect().await.ok().map(|b| b.to_bytes())
    })
    .await
    .ok()??;
    String::from_utf8(answer.to_vec()).ok()
}

async fn replay_once(
    config: &ReplayConfig,
    policy: &str,
    urls: &[String],
    reqs: Arc<Vec<TraceRequest>>,
    prompts: Prompts,
) -> PolicyRun {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let http: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(connector);
    let start = Instant::now();
    let done = Arc::new(AtomicU64::new(0));
    let speedup = config.speedup;
    // Arrivals only: the workers' time runs at `speedup`.
    let pace = speedup * config.load;
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
        let at = Duration::from_secs_f64((reqs[i].timestamp - first_ts) as f64 / 1000.0 / pace);
        if at > config.duration {
            break;
        }
        tokio::time::sleep_until(tokio::time::Instant::from_std(start + at)).await;
        let url = urls[i % urls.len()].clone();
        let (http, reqs, done) = (http.clone(), reqs.clone(), done.clone());
        let max_output = config.max_output;
        let whole = config.whole;
        let marks = config.mix.map(|mix| {
            let (interactive, tenant) = mix.of(i);
            // In wall milliseconds.
            let slo = match mix.interactive_deadline {
                Some(d) if interactive => d,
                _ => mix.deadline,
            };
            Marks {
                class: if interactive { "interactive" } else { "batch" },
                priority: if interactive { "high" } else { "low" },
                tenant: format!("tenant-{tenant}"),
                deadline_ms: ((slo / speedup) * 1000.0).ceil().max(1.0) as u64,
            }
        });
        tasks.push(tokio::spawn(async move {
            let r = &reqs[i];
            let prompt = match prompts {
                Prompts::Tokens => Prompt::Tokens(trace::tokens(r)),
                Prompts::Text => Prompt::Text(trace::text(r)),
            };
            let body = serde_json::to_vec(&Body {
                model: "replay",
                prompt,
                max_tokens: r.output_length.clamp(1, max_output),
                stream: !whole,
                stream_options: if whole {
                    serde_json::Value::Null
                } else {
                    serde_json::json!({"include_usage": true})
                },
            })
            .expect("serialises");
            let outcome = Outcome {
                whole,
                ..one(&http, &url, body, speedup, marks.as_ref()).await
            };
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
                    itl: Vec::new(),
                    status: None,
                    error: Some(e.to_string()),
                    class: None,
                    whole: false,
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
        router: None,
        live: None,
        worker_requests: Vec::new(),
        fleet_hit_rate: None,
        telemetry: None,
        floors: Default::default(),
    }
}

/// A request's class and tenant as its headers say them.
struct Marks {
    class: &'static str,
    priority: &'static str,
    tenant: String,
    deadline_ms: u64,
}

async fn one(
    http: &Client<HttpConnector, Full<Bytes>>,
    url: &str,
    body: Vec<u8>,
    speedup: f64,
    marks: Option<&Marks>,
) -> Outcome {
    let class = marks.map(|m| m.class);
    let failed = |e: String| Outcome {
        ok: false,
        ttft: 0.0,
        e2e: 0.0,
        prompt_tokens: 0,
        cached_tokens: 0,
        itl: Vec::new(),
        status: None,
        error: Some(e),
        class,
        whole: false,
    };
    let started = Instant::now();
    let mut req = hyper::Request::post(format!("{url}/v1/completions"))
        .header("content-type", "application/json");
    if let Some(m) = marks {
        req = req
            .header("x-switchyard-priority", m.priority)
            .header("x-switchyard-tenant", &m.tenant)
            .header("x-switchyard-deadline-ms", m.deadline_ms);
    }
    let req = req
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
    let mut itl = Vec::new();
    let mut last = None;
    loop {
        match body.frame().await {
            None => break,
            Some(Err(e)) => return failed(e.to_string()),
            Some(Ok(f)) => {
                let Ok(data) = f.into_data() else { continue };
                let now = Instant::now();
                ttft.get_or_insert_with(|| now - started);
                if let Some(before) = last.replace(now) {
                    // Bounded: one gap per chunk, and a stream has max_tokens chunks.
                    if itl.len() < 1 << 16 {
                        itl.push(((now - before).as_secs_f64() * speedup) as f32);
                    }
                }
                tail.extend_from_slice(&data);
                if tail.len() > 8192 {
                    tail.drain(..tail.len() - 8192);
                }
            }
        }
    }
    if !status.is_success() {
        return Outcome {
            status: Some(status.as_u16()),
            ..failed(format!("{status}: {}", String::from_utf8_lossy(&tail)))
        };
    }
    let streamed = tail.starts_with(b"data:") || tail.windows(6).any(|w| w == b"data: ");
    if streamed && !tail.ends_with(b"data: [DONE]\n\n") {
        return failed("the stream ended without [DONE]".into());
    }
    if !streamed && switchyard_tokens::openai::scan_completion_tokens(&tail).is_none() {
        return failed("the answer ended without its usage".into());
    }
    let (prompt_tokens, cached_tokens) =
        switchyard_tokens::openai::scan_usage(&tail).unwrap_or((0, 0));
    Outcome {
        ok: true,
        ttft: ttft.unwrap_or_default().as_secs_f64() * speedup,
        e2e: started.elapsed().as_secs_f64() * speedup,
        prompt_tokens,
        cached_tokens,
        itl,
        status: None,
        error: None,
        class,
        whole: false,
    }
}

#[cfg(test)]
mod tests {
    use super::split_policies;

    #[test]
    fn policy_lists_split_on_commas_outside_json() {
        assert_eq!(
            split_policies(r#"kv-cost={"a":1,"b":[2,3]},round-robin, x.wasm={"s":"},{"}"#),
            vec![
                r#"kv-cost={"a":1,"b":[2,3]}"#,
                "round-robin",
                r#"x.wasm={"s":"},{"}"#
            ]
        );
        assert_eq!(split_policies("kv-cost"), vec!["kv-cost"]);
        assert!(split_policies(" , ").is_empty());
    }
}
