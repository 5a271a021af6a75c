//! Chaos: one steady load through one router while the fleet misbehaves, phase after
//! phase: a worker killed with SIGKILL, another frozen with SIGSTOP, 5 % poison prompts,
//! a worker shedding load with 503, workers closing idle connections, etcd frozen and
//! resumed, then hostile input: a registered instance whose KV event socket is a hostile
//! ZMTP peer (a frame declaring 2^62 bytes, then endless MORE frames) beside 64 uploads
//! that stall after their head, with room for only 64 requests in flight. Five
//! `mock-worker` processes registered in a real etcd, one `switchyard serve` process. Two routers in one run: outlier detection on (the product), and off (every
//! failure ejects at once: the rules before it), the baseline.
//!
//! Per phase: requests, failed requests that were not poison, poison requests (they fail
//! by design), ejections, p99 latency of the successful ones; at the end, the in-flight
//! gauges once the load has stopped (every booking released).
//!
//! Then streams: 24 long generations (chat and completions, a token every ~10 ms) through
//! a fresh fleet of three, one worker killed with SIGKILL (then, another time, frozen
//! with SIGSTOP, its streams stalled until the 5 s idle timeout) while they run; once with
//! migration (the product) and once with `--migration-limit 0` (a broken stream ends with
//! an error event). Per router: streams failed, tokens lost and duplicated against the
//! same requests' uninterrupted text, migrations, the gap the clients saw (the router's
//! `switchyard_migration_gap_seconds`: mean, and the bucket holding the p99), and the
//! prompt tokens the continuations prefilled again.
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

/// The hostile KV event peer of the integration tests.
#[path = "../../tests/common/hostile_zmtp.rs"]
mod hostile_zmtp;

/// Requests in flight the router takes: 8 clients never need more, and 64 stalled
/// uploads would take every slot if a slot were taken before the body arrived.
const MAX_IN_FLIGHT: &str = "64";

const PHASES: [&str; 8] = [
    "steady",
    "worker 1 killed (SIGKILL)",
    "worker 2 frozen (SIGSTOP), then resumed",
    "5 % poison prompts",
    "worker 3 sheds load (503, Retry-After 1)",
    "workers close idle connections after 1 s",
    "etcd frozen (SIGSTOP), then resumed",
    "hostile KV event peer, 64 stalled uploads",
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
    } = EtcdFleet::start(
        &c,
        5,
        &["--fault-marker", "POISON"],
        &[&["--max-in-flight", MAX_IN_FLIGHT], flags].concat(),
    )
    .await;

    let phase = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..8usize {
        let (c, url, phase, stop) = (c.clone(), url.clone(), phase.clone(), stop.clone());
        tasks.push(tokio::spawn(client(t, c, url, phase, stop)));
    }
    let mut ejections = Vec::new();
    let ejected = |page: &str| sum(page, "switchyard_instance_down_reports_total");
    let mut before = ejected(&get_text(&c, &format!("{url}/metrics")).await);
    let mut frozen_pid = None;
    let mut stalled = Vec::new();
    let mut hostile = None;
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
            7 => {
                hostile = Some(register_hostile(&e, &workers[4].1).await);
                let addr = url.trim_start_matches("http://");
                for _ in 0..64 {
                    stalled.push(stall_upload(addr).await);
                }
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
    drop(stalled);
    let mut hostile_connections = [0, 0];
    if let Some((key, counts)) = hostile {
        let _ = e.api().delete(&key, false).await;
        hostile_connections = counts.map(|c| c.load(Ordering::Relaxed));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let in_flight = sum(
        &get_text(&c, &format!("{url}/metrics")).await,
        "switchyard_instance_in_flight",
    );
    table(name, &all, &ejections, in_flight, hostile_connections)
}

/// Client `t`'s requests until `stop`, each tagged with the phase it was sent in (every
/// twentieth a poisoned prompt in phase 3).
async fn client(
    t: usize,
    c: Http,
    url: String,
    phase: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
) -> Vec<Outcome> {
    let mut out = Vec::new();
    // Bounded: at most 100,000 requests per client and phase (a phase of fast
    // failures must not use up the next phases' requests), and by the phases'
    // own lengths (`stop`).
    let mut in_phase = (usize::MAX, 0usize);
    let mut i = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let p = phase.load(Ordering::Relaxed);
        if in_phase.0 != p {
            in_phase = (p, 0);
        }
        if in_phase.1 >= 100_000 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        in_phase.1 += 1;
        i += 1;
        let poison = p == 3 && (i * 8 + t).is_multiple_of(20);
        let body = format!(
            r#"{{"model":"mock","prompt":"client {t} request {i}: steady load {}","max_tokens":4}}"#,
            if poison { "POISON" } else { "" }
        );
        let started = Instant::now();
        let ok = post(&c, &format!("{url}/v1/completions"), body).await;
        out.push(Outcome {
            phase: p,
            latency: started.elapsed(),
            ok,
            poison,
        });
    }
    out
}

/// The scenario's rows: each phase's requests, failures, poisoned prompts, ejections and
/// p99 latency; then what was left in flight and the hostile peer's connections.
fn table(
    name: &str,
    all: &[Outcome],
    ejections: &[f64],
    in_flight: f64,
    hostile_connections: [u64; 2],
) -> Vec<String> {
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
    rows.push(format!(
        "| {name} | hostile peer connections (2^62-byte frame / endless MORE frames), each closed at its bound | | | | | {} / {} |",
        hostile_connections[0], hostile_connections[1]
    ));
    rows
}

/// Registers an instance of `worker` (host:port) whose KV event socket is a hostile
/// ZMTP peer: a 2^62-byte frame header on odd connections, endless MORE frames on even
/// ones. Returns its etcd key and the counts of connections the router made to each peer.
async fn register_hostile(
    e: &etcd::Etcd,
    worker: &str,
) -> (String, [Arc<std::sync::atomic::AtomicU64>; 2]) {
    use switchyard::discovery::{
        EndpointPath, EngineEventSource, InstanceInfo, InstanceKey, InstanceRecord,
    };
    use switchyard::ids::InstanceId;
    let (huge, huge_n) = hostile_zmtp::hostile_publisher(hostile_zmtp::Hostile::HugeFrame).await;
    let (endless, endless_n) =
        hostile_zmtp::hostile_publisher(hostile_zmtp::Hostile::EndlessMore).await;
    let endpoint = EndpointPath::for_model("mock");
    let info = InstanceInfo {
        // Rank 0 and rank 1: one of each kind of hostile peer (rank r connects to the
        // endpoint's port plus r, so each rank names its own endpoint here).
        engine_events: Some(Arc::new(EngineEventSource {
            endpoint: huge,
            replay: Some(endless),
            topic: String::new(),
            data_parallel_size: 1,
        })),
        registration: 0,
        ..InstanceInfo::new(
            InstanceId(0xbad),
            endpoint,
            format!("http://{worker}"),
            "mock",
            16,
        )
    };
    let key = InstanceKey {
        root: "switchyard".into(),
        endpoint: info.endpoint.clone(),
        id: info.id,
    }
    .to_string();
    let record = serde_json::to_string(&InstanceRecord::from_info(&info)).unwrap();
    e.api().put(&key, record.as_bytes(), None).await.unwrap();
    (key, [huge_n, endless_n])
}

/// A connection that sends a completion's head, promising 100 bytes of body, and then
/// nothing.
async fn stall_upload(addr: &str) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{")
        .await
        .unwrap();
    s
}

/// One streaming request's body: chat or completions, `max_tokens` long, with usage.
fn stream_request(i: usize, max_tokens: u32) -> (&'static str, String) {
    let text = format!("stream {i}: a long answer about {}", i * 104_729);
    if i.is_multiple_of(2) {
        (
            "/v1/chat/completions",
            serde_json::json!({"model": "mock", "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens, "stream": true, "stream_options": {"include_usage": true}})
            .to_string(),
        )
    } else {
        (
            "/v1/completions",
            serde_json::json!({"model": "mock", "prompt": text, "max_tokens": max_tokens,
                "stream": true, "stream_options": {"include_usage": true}})
            .to_string(),
        )
    }
}

/// A stream as its client read it: the words of its text, and whether it ended with the
/// engine's `[DONE]` and no error event.
struct Streamed {
    words: Vec<String>,
    complete: bool,
}

/// Streams one request; `started` counts up at its fifth event.
async fn read_stream(
    c: &Http,
    url: &str,
    path: &str,
    body: String,
    started: &AtomicUsize,
) -> Streamed {
    let (got, _) = common::http::read_stream(
        c,
        &format!("{url}{path}"),
        body,
        5,
        started,
        Duration::from_secs(120),
    )
    .await;
    let text = String::from_utf8_lossy(&got);
    let mut words = String::new();
    let mut complete = false;
    let mut error = false;
    for event in text.split("\n\n") {
        let Some(data) = event.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            complete = true;
            continue;
        }
        let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else {
            continue;
        };
        error |= v.get("error").is_some();
        if let Some(c) = v["choices"].as_array().and_then(|c| c.first()) {
            words.push_str(
                c["delta"]["content"]
                    .as_str()
                    .or(c["text"].as_str())
                    .unwrap_or(""),
            );
        }
    }
    Streamed {
        words: words.split_whitespace().map(str::to_string).collect(),
        complete: complete && !error,
    }
}

/// The gap histogram's mean and the upper bound of the bucket holding its p99, in ms.
fn gap_figures(page: &str) -> (f64, f64) {
    let count = metric(page, "switchyard_migration_gap_seconds_count");
    let sum = metric(page, "switchyard_migration_gap_seconds_sum");
    let mut p99 = f64::NAN;
    for l in page
        .lines()
        .filter(|l| l.starts_with("switchyard_migration_gap_seconds_bucket{"))
    {
        let (Some(le), Some(n)) = (
            l.split("le=\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
                .and_then(|v| v.parse::<f64>().ok()),
            l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()),
        ) else {
            continue;
        };
        if p99.is_nan() && count > 0.0 && n >= 0.99 * count {
            p99 = le * 1e3;
        }
    }
    (
        if count > 0.0 {
            sum / count * 1e3
        } else {
            f64::NAN
        },
        p99,
    )
}

/// 24 streams, one worker of three killed (or frozen: `freeze`) while they run; then the
/// same requests again, uninterrupted, for the reference text.
async fn streams_scenario(name: &str, flags: &[&str], freeze: bool) -> String {
    const STREAMS: usize = 24;
    let tokens: u32 = if quick() { 120 } else { 400 };
    let c = http();
    let EtcdFleet {
        etcd: _e,
        mut workers,
        router: _router,
        url,
        cache: _cache,
    } = EtcdFleet::start(&c, 3, &["--decode-base-us", "200000"], flags).await;
    let started = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..STREAMS {
        let (c, url, started) = (c.clone(), url.clone(), started.clone());
        let (path, body) = stream_request(i, tokens);
        tasks.push(tokio::spawn(async move {
            read_stream(&c, &url, path, body, &started).await
        }));
    }
    // Bounded: 1,500 polls of 20 ms.
    for _ in 0..1500 {
        if started.load(Ordering::SeqCst) == STREAMS {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let victim = workers[0].0.0.id();
    if freeze {
        signal(victim, "STOP");
    } else {
        let _ = workers[0].0.0.kill();
    }
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.unwrap());
    }
    if freeze {
        signal(victim, "CONT");
    }
    let none = AtomicUsize::new(0);
    let (mut failed, mut lost, mut duplicated) = (0, 0, 0);
    for (i, g) in got.iter().enumerate() {
        let (path, body) = stream_request(i, tokens);
        let want = read_stream(&c, &url, path, body, &none).await;
        let common = g
            .words
            .iter()
            .zip(&want.words)
            .take_while(|(a, b)| a == b)
            .count();
        lost += want.words.len() - common;
        duplicated += g.words.len() - common;
        if !g.complete {
            failed += 1;
        }
    }
    let page = get_text(&c, &format!("{url}/metrics")).await;
    // `+ 0.0`: an empty sum is -0.
    let migrations = sum(&page, "switchyard_migrations_total") + 0.0;
    let (gap_mean, gap_p99) = gap_figures(&page);
    let gap = if gap_mean.is_nan() {
        "—".to_string()
    } else {
        format!("{gap_mean:.0} / ≤ {gap_p99:.0}")
    };
    let prefill = metric(&page, "switchyard_migration_prefill_tokens_total");
    format!(
        "| {name} | {} | {STREAMS} × {tokens} tokens | {failed} | {lost} | {duplicated} | {migrations} | {gap} | {prefill} |",
        if freeze {
            "frozen (SIGSTOP)"
        } else {
            "killed (SIGKILL)"
        }
    )
}

fn main() {
    let runtime = common::runtime(2);
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
        println!();
        println!("Streams while a worker of three is killed or frozen, a token every ~10 ms (idle timeout 5 s):");
        println!();
        println!("| router | worker | streams | failed | tokens lost | tokens duplicated | migrations | gap mean / p99 (ms) | continuation prefill tokens |");
        println!("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |");
        for freeze in [false, true] {
            let idle = ["--stream-idle-timeout-secs", "5"];
            println!("{}", streams_scenario("migration (default)", &idle, freeze).await);
            println!(
                "{}",
                streams_scenario("--migration-limit 0", &[&idle[..], &["--migration-limit", "0"]].concat(), freeze).await
            );
        }
    });
}
