//! B5: kill -9 a worker under load. Four `mock-worker` processes registered in a real
//! etcd (lease TTL 10 s), one `switchyard serve` process, steady load; worker 1 is killed
//! a quarter of the way in. Three routers are compared in one run:
//!
//! - availability tracking on (the product): the worker is reported down at its first
//!   failure and the failed request retried elsewhere;
//! - tracking off, with retries: every request keeps being offered to the dead worker
//!   until its lease expires, and retried after failing there;
//! - tracking off, no retries: routing to every registered instance, as routers without
//!   availability tracking do — the baseline.
//!
//! Run: `cargo bench --bench failover` (needs `etcd` on the PATH).

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use common::*;

const BODY: &str = r#"{"model":"mock","prompt":"steady load, a short prompt","max_tokens":4}"#;

#[path = "common/etcd_fleet.rs"]
mod etcd_fleet;
use etcd_fleet::EtcdFleet;

/// The same real-etcd helper the integration tests use.
#[path = "../../tests/common/etcd.rs"]
#[allow(dead_code)]
mod etcd;

async fn scenario(name: &str, serve_flags: &[&str], seconds: u64) -> String {
    let c = http();
    let EtcdFleet {
        etcd: _etcd,
        mut workers,
        router: _router,
        url,
        cache: _cache,
    } = EtcdFleet::start(&c, 4, &[], serve_flags).await;

    let stop = Arc::new(AtomicBool::new(false));
    let load_url = format!("{url}/v1/completions");
    let start = Instant::now();
    let (c2, stop2) = (c.clone(), stop.clone());
    let runner = tokio::spawn(async move {
        load(
            &c2,
            &load_url,
            BODY,
            8,
            usize::MAX,
            Duration::from_secs(seconds),
            stop2,
        )
        .await
    });
    // Sample the failures counter every 50 ms: recovery ends at its last increase.
    let (c3, url3, stop3) = (c.clone(), url.clone(), stop.clone());
    let sampler = tokio::spawn(async move {
        let mut points = Vec::new();
        while !stop3.load(std::sync::atomic::Ordering::Relaxed) {
            let page = get_text(&c3, &format!("{url3}/metrics")).await;
            points.push((
                start.elapsed(),
                metric(&page, "switchyard_upstream_failures_total"),
            ));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        points
    });
    let kill_at = Duration::from_secs(seconds) / 4;
    tokio::time::sleep(kill_at).await;
    let killed_at = start.elapsed();
    let _ = workers[0].0.0.kill();
    let samples = runner.await.unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let points = sampler.await.unwrap();
    let page = get_text(&c, &format!("{url}/metrics")).await;
    let dead_failures: f64 = page
        .lines()
        .filter(|l| l.starts_with("switchyard_instance_upstream_failures_total{"))
        .map(|l| {
            l.rsplit_once(' ')
                .map_or(0.0, |(_, v)| v.parse().unwrap_or(0.0))
        })
        .sum();
    let failed: Vec<&Sample> = samples.iter().filter(|s| !s.ok).collect();
    let last_increase = points
        .windows(2)
        .filter(|w| w[1].1 > w[0].1)
        .map(|w| w[1].0)
        .max();
    let recovery = last_increase.map_or(0.0, |t| t.saturating_sub(killed_at).as_secs_f64());
    let still_failing = points.windows(2).last().is_some_and(|w| w[1].1 > w[0].1);
    let recovery = if still_failing {
        format!("not within the run (> {recovery:.1} s)")
    } else {
        format!("{recovery:.2} s")
    };
    format!(
        "| {name} | {} | {} | {} | {:.0} | {recovery} |",
        samples.len(),
        failed.len(),
        (dead_failures - 1.0).max(0.0),
        percentile_us(&samples, 0.99) / 1000.0,
    )
}

fn main() {
    let runtime = common::runtime(2);
    runtime.block_on(async {
        let seconds = if quick() { 4 } else { 16 };
        println!("4 workers in etcd (lease TTL 10 s), 8 concurrent clients for {seconds} s, worker 1 killed with SIGKILL at {} s:", seconds / 4);
        println!();
        println!("| router | requests | failed requests | requests to the dead worker after its first failure | p99 latency (ms) | time to full recovery |");
        println!("| --- | ---: | ---: | ---: | ---: | ---: |");
        println!("{}", scenario("availability tracking on", &[], seconds).await);
        println!("{}", scenario("tracking off, 3 attempts", &["--availability", "false"], seconds).await);
        println!("{}", scenario("tracking off, 1 attempt (baseline)", &["--availability", "false", "--max-attempts", "1"], seconds).await);
    });
}
