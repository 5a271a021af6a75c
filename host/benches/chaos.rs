//! Chaos: one steady load through one router while the fleet misbehaves, phase after
//! phase: a worker killed with SIGKILL, another frozen with SIGSTOP, 5 % poison prompts,
//! a worker shedding load with 503, workers closing idle connections, etcd frozen and
//! resumed. Five `mock-worker` processes registered in a real etcd, one `switchyard serve`
//! process. Two routers in one run: outlier detection on (the product), and off (every
//! failure ejects at once: the rules before it), the baseline.
//!
//! Per phase: requests, failed requests that were not poison, poison requests (they fail
//! by design), ejections, p99 latency of the successful ones; at the end, the in-flight
//! gauges once the load has stopped (every booking released).
//!
//! Run: `cargo bench --bench chaos` (needs `etcd` on the PATH).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, Full};

#[path = "common/etcd_fleet.rs"]
mod etcd_fleet;
use etcd_fleet::EtcdFleet;

/// The same real-etcd helper the integration tests use.
#[path = "../../tests/common/etcd.rs"]
#[allow(dead_code)]
mod etcd;

const PHASES: [&str; 7] = [
    "steady",
    "worker 1 killed (SIGKILL)",
    "worker 2 frozen (SIGSTOP), then resumed",
    "5 % poison prompts",
    "worker 3 sheds load (503, Retry-After 1)",
    "workers close idle connections after 1 s",
    "etcd frozen (SIGSTOP), then resumed",
];

struct Outcome {
    phase: usize,
    latency: Duration,
    ok: bool,
    poison: bool,
}

fn signal(pid: u32, sig: &str) {
    let _ = std::process::Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status();
}

async fn post(c: &Http, url: &str, body: String) -> bool {
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    match tokio::time::timeout(Duration::from_secs(60), c.request(req)).await {
        Ok(Ok(r)) => {
            let good = r.status().is_success();
            good && r.into_body().collect().await.is_ok()
        }
        _ => false,
    }
}

async fn set_fault(c: &Http, worker: &str, fault: &str) {
    let _ = post(
        c,
        &format!("http://{worker}/admin/fault"),
        fault.to_string(),
    )
    .await;
}

fn sum(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

async fn scenario(
    name: &str,
    flags: &[&str],
    phase_len: Duration,
    freeze: Duration,
) -> Vec<String> {
    let c = http();
    let EtcdFleet {
        etcd: e,
        mut workers,
        router: _router,
        url,
        cache: _cache,
    } = EtcdFleet::start(&c, 5, &["--fault-marker", "POISON"], flags).await;

    let phase = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..8usize {
        let (c, url, phase, stop) = (c.clone(), url.clone(), phase.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            // Bounded: at most 100,000 requests per client.
            for i in 0..100_000usize {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let p = phase.load(Ordering::Relaxed);
                let poison = p == 3 && (i * 8 + t) % 20 == 0;
                let body = format!(
                    r#"{{"model":"mock","prompt":"client {t} request {i}: steady load {}","max_tokens":4}}"#,
                    if poison { "POISON" } else { "" }
                );
                let started = Instant::now();
                let ok = post(&c, &format!("{url}/v1/completions"), body).await;
                out.push(Outcome { phase: p, latency: started.elapsed(), ok, poison });
            }
            out
        }));
    }
    let mut ejections = Vec::new();
    let ejected = |page: &str| sum(page, "switchyard_instance_down_reports_total");
    let mut before = ejected(&get_text(&c, &format!("{url}/metrics")).await);
    let mut frozen_pid = None;
    for p in 0..PHASES.len() {
        phase.store(p, Ordering::Relaxed);
        let mut len = phase_len;
        match p {
            1 => {
                let _ = workers[0].0.0.kill();
            }
            2 => {
                let pid = workers[1].0.0.id();
                signal(pid, "STOP");
                frozen_pid = Some(pid);
                len = freeze;
            }
            4 => {
                set_fault(
                    &c,
                    &workers[2].1,
                    r#"{"fault":"status","status":503,"retry_after_secs":1,"marker":"POISON"}"#,
                )
                .await
            }
            5 => {
                for (_, w) in &workers[1..] {
                    set_fault(
                        &c,
                        w,
                        r#"{"fault":"none","marker":"POISON","idle_close_ms":1000}"#,
                    )
                    .await;
                }
            }
            6 => {
                e.signal("STOP");
                len = freeze;
            }
            _ => {}
        }
        tokio::time::sleep(len).await;
        match p {
            2 => {
                if let Some(pid) = frozen_pid {
                    signal(pid, "CONT");
                }
                tokio::time::sleep(phase_len).await;
            }
            4 => set_fault(&c, &workers[2].1, r#"{"fault":"none","marker":"POISON"}"#).await,
            6 => {
                e.signal("CONT");
                tokio::time::sleep(phase_len).await;
            }
            _ => {}
        }
        let now = ejected(&get_text(&c, &format!("{url}/metrics")).await);
        ejections.push(now - before);
        before = now;
    }
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let in_flight = sum(
        &get_text(&c, &format!("{url}/metrics")).await,
        "switchyard_instance_in_flight",
    );
    let mut rows = Vec::new();
    for (p, title) in PHASES.iter().enumerate() {
        let of: Vec<&Outcome> = all.iter().filter(|o| o.phase == p).collect();
        let failed = of.iter().filter(|o| !o.ok && !o.poison).count();
        let poison = of.iter().filter(|o| o.poison).count();
        let mut lat: Vec<f64> = of
            .iter()
            .filter(|o| o.ok)
            .map(|o| o.latency.as_secs_f64() * 1e3)
            .collect();
        lat.sort_by(f64::total_cmp);
        let p99 = lat
            .get(((lat.len().max(1) - 1) as f64 * 0.99).round() as usize)
            .copied()
            .unwrap_or(f64::NAN);
        rows.push(format!(
            "| {name} | {title} | {} | {failed} | {poison} | {} | {p99:.0} |",
            of.len(),
            ejections[p],
        ));
    }
    rows.push(format!(
        "| {name} | in flight after the load stopped | | | | | {in_flight} |"
    ));
    rows
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let (phase, freeze) = if quick() {
            (Duration::from_secs(2), Duration::from_secs(3))
        } else {
            (Duration::from_secs(8), Duration::from_secs(12))
        };
        println!(
            "5 workers in etcd (lease TTL 10 s), 8 concurrent clients; phases of {} s (freezes {} s, then {} s after resuming):",
            phase.as_secs(), freeze.as_secs(), phase.as_secs()
        );
        println!();
        println!("| router | phase | requests | failed (not poison) | poison (fail by design) | ejections | p99 latency (ms) |");
        println!("| --- | --- | ---: | ---: | ---: | ---: | ---: |");
        for row in scenario("outlier detection", &[], phase, freeze).await {
            println!("{row}");
        }
        for row in scenario("eject on any failure (baseline)", &["--outlier-detection", "false"], phase, freeze).await {
            println!("{row}");
        }
    });
}
