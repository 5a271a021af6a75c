//! Helpers shared by the load benchmarks: a bounded load generator, process CPU time,
//! and percentiles. Router and worker processes are the tests' own (`tests/common`).
#![allow(dead_code)]

#[path = "../../../tests/common/http.rs"]
pub mod http;
#[path = "../../../tests/common/procs.rs"]
pub mod procs;

#[allow(unused_imports)]
pub use procs::{Proc, free_port, switchyard_with_cache, wait_ok};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

pub type Http = Client<HttpConnector, Full<Bytes>>;

pub fn http() -> Http {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build(c)
}

/// User + system CPU time of a process so far.
pub fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    // `rest` starts at field 3 (state, not numeric, skipped): utime is f[10], stime f[11].
    let ticks = f.get(10).copied().unwrap_or(0) + f.get(11).copied().unwrap_or(0);
    Duration::from_secs_f64(ticks as f64 / 100.0)
}

/// One completed request of a load run.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// When it was sent, since the start of the run.
    pub at: Duration,
    pub latency: Duration,
    pub ok: bool,
}

/// Sends `body` to `url` from `concurrency` tasks until `count` requests are done or
/// `limit` passes (whichever first), or `stop` is set.
pub async fn load(
    c: &Http,
    url: &str,
    body: &'static str,
    concurrency: usize,
    count: usize,
    limit: Duration,
    stop: Arc<AtomicBool>,
) -> Vec<Sample> {
    let start = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (c, url, next, stop) = (c.clone(), url.to_string(), next.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < count
                && start.elapsed() < limit
                && !stop.load(Ordering::Relaxed)
            {
                let at = start.elapsed();
                let t = Instant::now();
                let req = hyper::Request::post(&url)
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from_static(body.as_bytes())))
                    .unwrap();
                let ok = match c.request(req).await {
                    Ok(r) => {
                        let good = r.status().is_success();
                        good && r.into_body().collect().await.is_ok()
                    }
                    Err(_) => false,
                };
                out.push(Sample {
                    at,
                    latency: t.elapsed(),
                    ok,
                });
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

pub fn percentile_us(samples: &[Sample], p: f64) -> f64 {
    let mut v: Vec<f64> = samples
        .iter()
        .filter(|s| s.ok)
        .map(|s| s.latency.as_secs_f64() * 1e6)
        .collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// A metric's value from a Prometheus text page (0 if absent).
pub fn metric(page: &str, name: &str) -> f64 {
    page.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.trim().parse().ok()))
        .unwrap_or(0.0)
}

pub async fn get_text(c: &Http, url: &str) -> String {
    let req = hyper::Request::get(url)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let r = c.request(req).await.unwrap();
    String::from_utf8_lossy(&r.into_body().collect().await.unwrap().to_bytes()).to_string()
}

/// `POST url` with a JSON `body`; the whole answer as text.
pub async fn post_text(c: &Http, url: &str, body: &str) -> String {
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let r = c.request(req).await.unwrap();
    String::from_utf8_lossy(&r.into_body().collect().await.unwrap().to_bytes()).to_string()
}

/// A Tokio runtime with `threads` worker threads (the load generator's, beside the
/// router and workers it measures).
pub fn runtime(threads: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .unwrap()
}

/// `cargo bench` passes `--bench`; other runs (e.g. `cargo test --benches`) do a tiny run.
pub fn quick() -> bool {
    !std::env::args().any(|a| a == "--bench")
}

/// A reproducible stream of random 64-bit values (SplitMix64).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(1);
        switchyard_cost_model::mix(self.0)
    }
}
