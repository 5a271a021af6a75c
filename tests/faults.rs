//! Faults that must not become outages, end to end: real mock-worker processes with
//! injected faults, a real router process, real HTTP (and a real etcd where discovery is
//! the subject).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::etcd::Etcd;
use common::http::{self, HttpClient, post_json};
use common::procs::{Proc, mock_worker, serve};
use common::router::{PATIENCE, TOKEN, admin_get_text, available, eventually, instance, metric};
use hyper::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn chat(text: &str, max_tokens: u32, stream: bool) -> Value {
    json!({"model": "mock", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": stream})
}

/// `n` mock workers started with `flags(i)`, and a router over them with `extra` flags.
async fn fleet(
    n: usize,
    flags: impl Fn(usize) -> Vec<&'static str>,
    extra: &[&str],
) -> (Vec<(Proc, String)>, Proc, String) {
    let mut workers = Vec::new();
    for i in 0..n {
        let mut f = vec!["--speedup", "100"];
        f.extend(flags(i));
        workers.push(mock_worker(&f).await);
    }
    let mut args = vec!["--model", "mock", "--admin-token", TOKEN];
    for (_, url) in &workers {
        args.extend(["--worker", url.as_str()]);
    }
    args.extend_from_slice(extra);
    let (router, url) = serve(&args).await;
    (workers, router, url)
}

/// Worker flags: the first worker sheds load with 503 and `Retry-After: retry_after`,
/// the others serve.
fn first_sheds(retry_after: &'static str) -> impl Fn(usize) -> Vec<&'static str> {
    move |i| {
        if i == 0 {
            vec![
                "--fault",
                "status",
                "--fault-status",
                "503",
                "--fault-retry-after-secs",
                retry_after,
            ]
        } else {
            vec![]
        }
    }
}

async fn complete(
    c: &HttpClient,
    url: &str,
    body: &Value,
) -> (StatusCode, hyper::HeaderMap, String) {
    let (s, h, b) = http::send(
        c,
        Method::POST,
        &format!("{url}/v1/chat/completions"),
        &[("content-type", "application/json")],
        body.to_string(),
        PATIENCE,
    )
    .await
    .unwrap();
    (s, h, String::from_utf8_lossy(&b).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_requests_fail_alone_with_the_engines_message_and_eject_no_one() {
    let (_workers, _router, url) = fleet(
        4,
        |_| vec!["--fault-marker", "POISON"],
        &["--health-check-interval-ms", "0"],
    )
    .await;
    let c = http::client();
    let (ok, poison_ok, failed) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(parking_lot::Mutex::new(Vec::new())),
    );
    // 120 requests over 6 clients; every tenth carries the marker.
    let mut tasks = Vec::new();
    for t in 0..6u32 {
        let (c, url, ok, poison_ok, failed) = (
            c.clone(),
            url.clone(),
            ok.clone(),
            poison_ok.clone(),
            failed.clone(),
        );
        tasks.push(tokio::spawn(async move {
            for i in 0..20u32 {
                let poison = (t * 20 + i) % 10 == 0;
                let text = format!(
                    "client {t} request {i} {}",
                    if poison { "POISON" } else { "" }
                );
                let (s, _, body) = complete(&c, &url, &chat(&text, 2, false)).await;
                match (poison, s) {
                    (false, StatusCode::OK) => {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    (true, StatusCode::INTERNAL_SERVER_ERROR)
                        if body.contains("this prompt fails on every worker") =>
                    {
                        poison_ok.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => failed.lock().push(format!("poison={poison} {s}: {body}")),
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let failed = failed.lock().clone();
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(ok.load(Ordering::Relaxed), 108);
    assert_eq!(poison_ok.load(Ordering::Relaxed), 12);
    assert_eq!(
        available(&c, &url).await,
        4,
        "a poison request ejected a worker"
    );
    assert_eq!(
        metric(&c, &url, "switchyard_poison_requests_total", "").await,
        12.0
    );
    assert_eq!(
        metric(&c, &url, "switchyard_ejections_total", "").await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_workers_are_skipped_for_their_retry_after_and_never_ejected() {
    // One of two sheds load with 503 and Retry-After: 5.
    let (workers, _router, url) =
        fleet(2, first_sheds("5"), &["--health-check-interval-ms", "0"]).await;
    let c = http::client();
    let started = Instant::now();
    for i in 0..30 {
        let (s, _, body) = complete(&c, &url, &chat(&format!("question {i}"), 1, false)).await;
        assert_eq!(s, StatusCode::OK, "{body}");
    }
    let busy = metric(&c, &url, "switchyard_busy_answers_total", "").await;
    // Skipped for 5 s after each busy answer.
    let windows = (started.elapsed().as_secs_f64() / 5.0).ceil();
    assert!(
        busy >= 1.0 && busy <= windows,
        "{busy} busy answers in {windows} windows"
    );
    let shedding = instance(&c, &url, &workers[0].1).await;
    assert_eq!(shedding["available"], true, "{shedding}");
    assert_eq!(
        metric(&c, &url, "switchyard_ejections_total", "").await,
        0.0
    );

    // Every worker answers 429: the client gets the worker's own 429 with Retry-After,
    // then 503 with Retry-After while both are skipped; nobody is ejected.
    let (_w, _r, url) = fleet(
        2,
        |_| {
            vec![
                "--fault",
                "status",
                "--fault-status",
                "429",
                "--fault-retry-after-secs",
                "30",
            ]
        },
        &["--health-check-interval-ms", "0"],
    )
    .await;
    let (s, h, body) = complete(&c, &url, &chat("hello", 1, false)).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert_eq!(h["retry-after"], "30");
    let (s, h, body) = complete(&c, &url, &chat("hello again", 1, false)).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body.contains("workers_busy"), "{body}");
    let after: u64 = h["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=30).contains(&after), "{after}");
    assert_eq!(available(&c, &url).await, 2);
}

/// A worker whose `Retry-After` is absurd (1e20 s, past what a `Duration` holds) is busy
/// for the router's longest skip (`--max-retry-after-secs`), like any busy worker: every
/// request gets an answer, from the healthy worker, and the shedding one is not chosen
/// again while it is skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absurd_retry_after_is_capped_and_costs_no_request() {
    let (workers, _router, url) = fleet(
        2,
        first_sheds("1e20"),
        &[
            "--health-check-interval-ms",
            "0",
            "--max-retry-after-secs",
            "60",
            // Round robin reaches the shedding worker within two requests.
            "--policy",
            "round-robin",
        ],
    )
    .await;
    let c = http::client();
    for i in 0..20 {
        let (s, _, body) = complete(&c, &url, &chat(&format!("question {i}"), 1, false)).await;
        assert_eq!(s, StatusCode::OK, "request {i}: {body}");
    }
    // Skipped for 60 s after its first 503: chosen once.
    let busy = metric(&c, &url, "switchyard_busy_answers_total", "").await;
    assert_eq!(busy, 1.0, "busy answers");
    let shedding = instance(&c, &url, &workers[0].1).await;
    assert_eq!(shedding["available"], true, "{shedding}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_three_of_four_workers_failing_half_stay_in_and_the_healthy_one_serves() {
    let (_workers, _router, url) = fleet(
        4,
        |i| {
            if i < 3 {
                vec!["--fault", "error"]
            } else {
                vec![]
            }
        },
        &["--base-ejection-ms", "60000"],
    )
    .await;
    let c = http::client();
    // Until two of the failing workers are out, a request may meet two failing ones and
    // count as poison; bounded at 200 requests.
    let mut i = 0;
    while metric(&c, &url, "switchyard_ejections_total", "").await < 2.0 {
        assert!(i < 200, "the failing workers were never ejected");
        complete(&c, &url, &chat(&format!("request {i}"), 1, false)).await;
        let n = available(&c, &url).await;
        assert!(n >= 2, "only {n} of 4 available after request {i}");
        i += 1;
    }
    // Then every request lands on the healthy worker, directly or after one failed
    // attempt on the third failing one, which the share keeps in.
    for j in 0..30 {
        let (s, _, body) = complete(&c, &url, &chat(&format!("later {j}"), 1, false)).await;
        assert_eq!(s, StatusCode::OK, "{body}");
        assert_eq!(available(&c, &url).await, 2);
    }
    assert!(metric(&c, &url, "switchyard_ejections_refused_total", "").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_stalls_ends_with_an_error_event_and_releases_its_booking() {
    let (_workers, _router, url) = fleet(
        1,
        |_| vec!["--fault", "stall"],
        &[
            "--stream-idle-timeout-secs",
            "1",
            "--health-check-interval-ms",
            "0",
        ],
    )
    .await;
    let c = http::client();
    let (s, _, body) = complete(&c, &url, &chat("hello", 50, true)).await;
    assert_eq!(s, StatusCode::OK);
    let events = http::sse_events(body.as_bytes());
    assert!(events.len() >= 2, "{events:?}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "upstream_stream_error", "{last}");
    assert!(
        last["error"]["message"]
            .as_str()
            .unwrap()
            .contains("sent nothing")
    );
    eventually("the booking released", || async {
        metric(&c, &url, "switchyard_instance_in_flight", "").await == 0.0
    })
    .await;
    assert_eq!(
        metric(&c, &url, "switchyard_stream_stalls_total", "").await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_stream_releases_its_booking() {
    // The worker stalls after the first chunk and the idle timeout is a minute: only the
    // client's leaving can release the booking in time.
    let (_workers, _router, url) = fleet(
        1,
        |_| vec!["--fault", "stall"],
        &["--health-check-interval-ms", "0"],
    )
    .await;
    let c = http::client();
    let addr = url.trim_start_matches("http://").to_string();
    let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let body = chat("hello", 50, true).to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = tokio::time::timeout(PATIENCE, conn.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "closed before the first chunk");
        got.extend_from_slice(&buf[..n]);
    }
    assert_eq!(
        metric(&c, &url, "switchyard_instance_in_flight", "").await,
        1.0
    );
    drop(conn);
    eventually("the booking released after the client left", || async {
        metric(&c, &url, "switchyard_instance_in_flight", "").await == 0.0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_longer_than_the_first_byte_timeout_succeeds() {
    // 100 tokens at 20 ms each (no speedup): a 2 s answer behind a 1 s first-byte timeout.
    let (worker, wurl) = mock_worker(&["--decode-base-us", "20000"]).await;
    let (_router, url) = serve(&[
        "--worker",
        &wurl,
        "--model",
        "mock",
        "--first-byte-timeout-secs",
        "1",
        "--admin-token",
        TOKEN,
    ])
    .await;
    let c = http::client();
    let (s, _, body) = complete(&c, &url, &chat("write a long story", 100, false)).await;
    assert_eq!(s, StatusCode::OK, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 100);
    assert_eq!(available(&c, &url).await, 1);
    drop(worker);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_health_lies_is_ejected_for_longer_each_time() {
    let (workers, _router, url) = fleet(
        2,
        |i| {
            if i == 0 {
                vec!["--fault", "error", "--health-lies"]
            } else {
                vec![]
            }
        },
        &[
            "--base-ejection-ms",
            "200",
            "--health-check-interval-ms",
            "0",
        ],
    )
    .await;
    let c = http::client();
    let liar = workers[0].1.clone();
    let mut lengths = Vec::new();
    let deadline = Instant::now() + PATIENCE;
    let mut i = 0;
    while lengths.len() < 3 {
        assert!(Instant::now() < deadline, "ejections so far: {lengths:?}");
        i += 1;
        let (s, _, body) = complete(&c, &url, &chat(&format!("q {i}"), 1, false)).await;
        assert_eq!(s, StatusCode::OK, "{body}");
        let state = instance(&c, &url, &liar).await;
        if let Some(d) = state["down"]["ejected_for_secs"].as_f64()
            && lengths.last() != Some(&d)
        {
            lengths.push(d);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        lengths.windows(2).all(|w| w[1] > w[0]),
        "ejections did not grow: {lengths:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_whose_workers_are_all_gone_answers_503_until_one_returns() {
    let etcd = Etcd::start();
    let (w, _) = mock_worker(&["--etcd", &etcd.url(), "--speedup", "100"]).await;
    let (_router, url) = serve(&["--etcd", &etcd.url(), "--admin-token", TOKEN]).await;
    let c = http::client();
    let (s, _, body) = complete(&c, &url, &chat("hi", 1, false)).await;
    assert_eq!(s, StatusCode::OK, "{body}");
    // A graceful stop deregisters the worker at once.
    w.terminate();
    eventually("the model to lose its worker", || async {
        let (s, _, _) = complete(&c, &url, &chat("hi", 1, false)).await;
        s == StatusCode::SERVICE_UNAVAILABLE
    })
    .await;
    let (s, h, body) = complete(&c, &url, &chat("hi", 1, false)).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(h.contains_key("retry-after"));
    assert!(body.contains("no_available_worker"), "{body}");
    let (_w2, _) = mock_worker(&["--etcd", &etcd.url(), "--speedup", "100"]).await;
    eventually("a new worker to serve the model", || async {
        complete(&c, &url, &chat("hi", 1, false)).await.0 == StatusCode::OK
    })
    .await;
    // A model never seen is still 404.
    let (s, _, _) = post_json(
        &c,
        &format!("{url}/v1/chat/completions"),
        &json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

/// An endpoint whose workers have all been gone for the grace period is released: its
/// router, Client and metrics series are gone and the model is unknown (404); when a
/// worker registers again the endpoint is set up anew and serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_gone_past_its_grace_is_released_and_comes_back_anew() {
    let etcd = Etcd::start();
    let (w, _) = mock_worker(&["--etcd", &etcd.url(), "--speedup", "100"]).await;
    let (_router, url) = serve(&[
        "--etcd",
        &etcd.url(),
        "--admin-token",
        TOKEN,
        "--endpoint-grace-secs",
        "1",
    ])
    .await;
    let c = http::client();
    assert_eq!(
        complete(&c, &url, &chat("hi", 1, false)).await.0,
        StatusCode::OK
    );
    let series = |c: http::HttpClient, url: String| async move {
        let (_, body) = http::get(&c, &format!("{url}/metrics")).await;
        String::from_utf8_lossy(&body).contains("endpoint=\"default/mock/generate\"")
    };
    assert!(series(c.clone(), url.clone()).await);
    w.terminate();
    eventually("the endpoint released after its grace", || async {
        let gone = complete(&c, &url, &chat("hi", 1, false)).await.0 == StatusCode::NOT_FOUND;
        gone && !series(c.clone(), url.clone()).await
    })
    .await;
    let (s, endpoints) = admin_get_text(&c, &format!("{url}/admin/endpoints")).await;
    assert_eq!(s, StatusCode::OK);
    assert!(!endpoints.contains("default/mock/generate"), "{endpoints}");
    let (_w2, _) = mock_worker(&["--etcd", &etcd.url(), "--speedup", "100"]).await;
    eventually("the endpoint set up anew", || async {
        complete(&c, &url, &chat("hi", 1, false)).await.0 == StatusCode::OK
    })
    .await;
}

/// A model served by two endpoints (two deployments of it) gets a router for each;
/// requests go to the one with available workers, so when one deployment's workers all
/// leave the model is still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_served_by_two_endpoints_is_routed_to_the_one_with_workers() {
    let etcd = Etcd::start();
    let (_blue, _) = mock_worker(&[
        "--etcd",
        &etcd.url(),
        "--speedup",
        "100",
        "--endpoint",
        "blue/mock/generate",
    ])
    .await;
    let (green, _) = mock_worker(&["--etcd", &etcd.url(), "--speedup", "100"]).await;
    let (_router, url) = serve(&["--etcd", &etcd.url(), "--admin-token", TOKEN]).await;
    let c = http::client();
    let endpoints = || async {
        admin_get_text(&c, &format!("{url}/admin/endpoints"))
            .await
            .1
    };
    eventually("a router for each endpoint", || async {
        let e = endpoints().await;
        e.contains("blue/mock/generate") && e.contains("default/mock/generate")
    })
    .await;
    assert_eq!(
        complete(&c, &url, &chat("hi", 1, false)).await.0,
        StatusCode::OK
    );
    green.terminate();
    // Once discovery has seen the green workers leave, every request is served by blue.
    eventually("the model served by the other endpoint", || async {
        for _ in 0..10 {
            if complete(&c, &url, &chat("hi", 1, false)).await.0 != StatusCode::OK {
                return false;
            }
        }
        true
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_loris_clients_do_not_stop_others_and_are_cut_off() {
    let (_workers, _router, url) = fleet(1, |_| vec![], &["--client-idle-timeout-secs", "1"]).await;
    let addr = url.trim_start_matches("http://").to_string();
    let mut slow = Vec::new();
    for _ in 0..50 {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
            .await
            .unwrap();
        slow.push(s);
    }
    let c = http::client();
    let (s, _, body) = complete(&c, &url, &chat("hello", 1, false)).await;
    assert_eq!(s, StatusCode::OK, "{body}");
    // Each slow connection is closed by the router once its head is overdue.
    for mut s in slow {
        let mut buf = [0u8; 512];
        let closed = tokio::time::timeout(PATIENCE, async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "a slow connection was never closed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_and_requests_over_the_limits_get_503_with_retry_after() {
    let (_workers, _router, url) = fleet(
        1,
        |_| vec!["--fault", "stall"],
        &[
            "--max-in-flight",
            "2",
            "--max-connections",
            "4",
            "--health-check-interval-ms",
            "0",
        ],
    )
    .await;
    let addr = url.trim_start_matches("http://").to_string();
    // Two streams that never end fill the in-flight limit.
    let mut open = Vec::new();
    for _ in 0..2 {
        let (s, head) = open_stream(&addr).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        open.push(s);
    }
    let c = http::client();
    let (s, h, body) = complete(&c, &url, &chat("one more", 1, false)).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body.contains("router_overloaded"), "{body}");
    assert_eq!(h["retry-after"], "1");
    // Connections beyond the cap are answered 503 and closed.
    let mut extra = Vec::new();
    let mut refused = 0;
    for _ in 0..4 {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = vec![0u8; 1024];
        let n = tokio::time::timeout(PATIENCE, s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        if String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 503") {
            refused += 1;
        }
        extra.push(s);
    }
    assert!(refused >= 1, "no connection was refused at the limit");
    assert!(metric(&c, &url, "switchyard_refused_connections_total", "").await >= 1.0);
    // Both limits give their room back when the clients leave.
    drop(open);
    drop(extra);
    eventually("room for a stream again", || async {
        open_stream(&addr).await.1.starts_with("HTTP/1.1 200")
    })
    .await;
}

/// Opens a streaming completion on a connection of its own; returns the connection and
/// the first bytes of the answer.
async fn open_stream(addr: &str) -> (tokio::net::TcpStream, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = chat("hang", 50, true).to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(PATIENCE, s.read(&mut buf))
        .await
        .unwrap()
        .unwrap_or(0);
    let head = String::from_utf8_lossy(&buf[..n]).into_owned();
    (s, head)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_etcd_and_a_mass_deregistration_lose_no_request() {
    let etcd = Etcd::start();
    let mut workers = Vec::new();
    for _ in 0..3 {
        workers.push(mock_worker(&["--etcd", &etcd.url(), "--speedup", "100", "--ttl", "2"]).await);
    }
    let (_router, url) = serve(&["--etcd", &etcd.url(), "--admin-token", TOKEN]).await;
    let c = http::client();
    eventually("three workers", || async { available(&c, &url).await == 3 }).await;
    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let served = Arc::new(AtomicU64::new(0));
    let load = {
        let (c, url, stop, failures, served) = (
            c.clone(),
            url.clone(),
            stop.clone(),
            failures.clone(),
            served.clone(),
        );
        tokio::spawn(async move {
            // Bounded: at most 5,000 requests.
            for i in 0..5000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let (s, _, body) = complete(&c, &url, &chat(&format!("q {i}"), 1, false)).await;
                if s == StatusCode::OK {
                    served.fetch_add(1, Ordering::Relaxed);
                } else {
                    failures.lock().push(format!("{s}: {body}"));
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Frozen past every lease's TTL.
    etcd.signal("STOP");
    tokio::time::sleep(Duration::from_secs(5)).await;
    etcd.signal("CONT");
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Then every registration disappears at once (a mass lease expiry, a bad deploy):
    // the workers still answer, so they keep serving for the grace period.
    switchyard::discovery::etcd_api::EtcdApi::new(&[etcd.url()], Duration::from_secs(5))
        .delete("switchyard/instances/", true)
        .await
        .unwrap();
    eventually("the removals held", || async {
        metric(&c, &url, "switchyard_held_removals_total", "").await >= 3.0
    })
    .await;
    assert_eq!(available(&c, &url).await, 3);
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    let failures = failures.lock().clone();
    assert!(
        failures.is_empty(),
        "{} failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(served.load(Ordering::Relaxed) > 50);
}

/// The connections carrying the router's etcd watches freeze without a close or a reset
/// (a member or NAT path that vanished) while every other call still succeeds. A worker
/// registered during the freeze must still be served: the watches check themselves
/// against etcd every 2 s on other connections, and one that has not delivered a change
/// etcd showed by the next check is re-listed and re-made. Bound: 15 s (two checks, a
/// re-list, and this machine's slack), well under the 30 s periodic re-listing of models.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_registered_while_the_watch_is_frozen_is_served() {
    let etcd = Etcd::start();
    let proxy = common::etcd::FreezingProxy::start(&etcd.url()).await;
    let (_a, _) = mock_worker(&["--etcd", &etcd.url(), "--speedup", "100"]).await;
    let (_router, url) = serve(&["--etcd", &proxy.url, "--admin-token", TOKEN]).await;
    let c = http::client();
    eventually("the first worker", || async {
        available(&c, &url).await == 1
    })
    .await;
    proxy.freeze_watches();
    let (_b, b_url) = mock_worker(&["--etcd", &etcd.url(), "--speedup", "100"]).await;
    let registered = Instant::now();
    while available(&c, &url).await < 2 {
        assert!(
            registered.elapsed() < Duration::from_secs(15),
            "a worker registered during the freeze was not discovered within 15 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let b = instance(&c, &url, &b_url).await;
    assert_eq!(b["available"], true, "{b}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_out_of_file_descriptors_blames_no_worker_and_recovers() {
    let (_w, worker) = mock_worker(&["--speedup", "100"]).await;
    // The router with a limit of 128 open files (what `ulimit -n` sets).
    let listen = format!("127.0.0.1:{}", common::procs::free_port());
    let script = format!(
        "ulimit -n 128 && SWITCHYARD_ADMIN_TOKEN={TOKEN} exec {} serve --listen {listen} --worker {worker} --model mock --policy-budget-ms 250",
        env!("CARGO_BIN_EXE_switchyard")
    );
    let _router = Proc(
        std::process::Command::new("sh")
            .args(["-c", &script])
            .env(
                "SWITCHYARD_POLICY_CACHE",
                std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("policy-cache"),
            )
            .env("SWITCHYARD_LOG", "error")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let url = format!("http://{listen}");
    common::procs::wait_ok(&format!("{url}/ready")).await;
    // One client connection made before the exhaustion, kept alive for the requests
    // below (a client of its own, so that its pool holds exactly this connection).
    let c = http::client();
    let (s, _, _) = complete(&c, &url, &chat("before", 1, false)).await;
    assert_eq!(s, StatusCode::OK);
    // Idle connections until the router has no file descriptor left; wait for its
    // pooled connection to the worker to expire, so the next request must open one.
    let mut idle = Vec::new();
    for _ in 0..200 {
        idle.push(tokio::net::TcpStream::connect(&listen).await.unwrap());
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (s, _, body) = complete(&c, &url, &chat("during", 1, false)).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body.contains("router_overloaded"), "{body}");
    drop(idle);
    eventually("the router to serve again", || async {
        complete(&c, &url, &chat("after", 1, false)).await.0 == StatusCode::OK
    })
    .await;
    let metrics = |name: &'static str| {
        let (c, url) = (c.clone(), url.clone());
        async move { metric(&c, &url, name, "").await }
    };
    assert!(metrics("switchyard_local_failures_total").await >= 1.0);
    assert!(metrics("switchyard_accept_errors_total").await >= 1.0);
    assert_eq!(metrics("switchyard_ejections_total").await, 0.0);
    assert_eq!(available(&c, &url).await, 1);
}

/// A worker that closes idle keep-alive connections (uvicorn does after 5 s; here after
/// 1 s) while requests come about as often: a pooled connection may be closed just as the
/// router reuses it. That is retried on a fresh connection and never blamed on the worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_closing_idle_connections_fails_no_request_and_is_never_reported() {
    let (_w, wurl) = mock_worker(&["--idle-close-ms", "1000", "--speedup", "100"]).await;
    let (_r, rurl) = serve(&["--worker", &wurl, "--model", "mock", "--admin-token", TOKEN]).await;
    let c = http::client();
    for i in 0..8 {
        // Just around the worker's idle limit.
        tokio::time::sleep(Duration::from_millis(if i % 2 == 0 { 990 } else { 1010 })).await;
        let (status, body, _) = post_json(
            &c,
            &format!("{rurl}/v1/chat/completions"),
            &chat("hello", 4, false),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "request {i}: {body}");
    }
    let inst = instance(&c, &rurl, &wurl).await;
    assert_eq!(inst["available"], true, "{inst}");
    assert_eq!(inst["ejections"], 0, "{inst}");
    assert_eq!(inst["consecutive_failures"], 0, "{inst}");
}

/// An `https://` worker whose certificate comes from the fleet's own CA: with the CA
/// given (`--ca-file`) requests are served through it, its health is probed and its
/// metrics are read over TLS; without it the router refuses the worker's certificate
/// and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_worker_is_served_when_its_ca_is_trusted() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = common::tls::self_signed_ca(dir.path());
    let port = common::procs::free_port();
    let listen = format!("127.0.0.1:{port}");
    let (cert, key) = (cert.to_str().unwrap(), key.to_str().unwrap());
    let _w = common::procs::switchyard(&[
        "mock-worker",
        "--listen",
        &listen,
        "--model",
        "mock",
        "--speedup",
        "100",
        "--tls-cert",
        cert,
        "--tls-key",
        key,
    ]);
    let wurl = format!("https://localhost:{port}");
    let c = http::client();

    let (_r, rurl) = serve(&[
        "--worker",
        &wurl,
        "--model",
        "mock",
        "--admin-token",
        TOKEN,
        "--ca-file",
        ca.to_str().unwrap(),
        "--health-check-interval-ms",
        "200",
    ])
    .await;
    eventually("a request served by the https worker", || {
        let (c, rurl) = (c.clone(), rurl.clone());
        async move {
            let (status, _, _) = post_json(
                &c,
                &format!("{rurl}/v1/chat/completions"),
                &chat("hello", 4, false),
            )
            .await;
            status == StatusCode::OK
        }
    })
    .await;
    for i in 0..5 {
        let (status, _, body) = post_json(
            &c,
            &format!("{rurl}/v1/chat/completions"),
            &chat("hello", 4, true),
        )
        .await;
        let body = String::from_utf8_lossy(&body);
        assert_eq!(status, StatusCode::OK, "request {i}: {body}");
        assert!(body.contains("[DONE]"), "request {i}: {body}");
    }
    let inst = instance(&c, &rurl, &wurl).await;
    assert_eq!(inst["available"], true, "{inst}");
    assert_eq!(inst["ejections"], 0, "{inst}");

    // The same worker, the same router flags but no CA: its certificate is refused.
    let (_r2, rurl2) = serve(&[
        "--worker",
        &wurl,
        "--model",
        "mock",
        "--health-check-interval-ms",
        "0",
    ])
    .await;
    let (status, _, body) = post_json(
        &c,
        &format!("{rurl2}/v1/chat/completions"),
        &chat("hello", 4, false),
    )
    .await;
    let body = String::from_utf8_lossy(&body);
    assert!(status.is_server_error(), "{status}: {body}");
    assert!(
        body.contains("certificate"),
        "the error does not say why: {body}"
    );
}

/// An endpoint whose policy cannot load is not loaded again by every request: the
/// policy file, valid when the router started, is broken before the endpoint's first
/// worker registers; 30 requests in a row then cost at most two load attempts (the
/// discovery pass's and one retry after the first backoff of 1 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_that_fails_to_load_is_not_loaded_again_by_every_request() {
    let etcd = Etcd::start();
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.wasm");
    std::fs::copy(common::guest("picks_first"), &policy).unwrap();
    let config = dir.path().join("router.toml");
    std::fs::write(
        &config,
        format!(
            "[endpoints.\"default/mock/generate\"]\npolicy = \"{}\"\n",
            policy.display()
        ),
    )
    .unwrap();
    let listen = format!("127.0.0.1:{}", common::procs::free_port());
    let _router = common::procs::switchyard(&[
        "serve",
        "--listen",
        &listen,
        "--etcd",
        &etcd.url(),
        "--config",
        config.to_str().unwrap(),
    ]);
    let url = format!("http://{listen}");
    common::procs::wait_ok(&format!("{url}/health")).await;
    std::fs::write(&policy, b"not a component").unwrap();
    let (_w, _) = mock_worker(&["--etcd", &etcd.url(), "--speedup", "100"]).await;
    let c = http::client();
    let failures = "switchyard_endpoint_policy_load_failures_total";
    eventually("the first failed load", || async {
        metric(&c, &url, failures, "").await >= 1.0
    })
    .await;
    for i in 0..30 {
        let (s, _, body) = complete(&c, &url, &chat(&format!("q {i}"), 1, false)).await;
        assert!(s.is_client_error() || s.is_server_error(), "{s}: {body}");
    }
    let loads = metric(&c, &url, failures, "").await;
    assert!(loads <= 2.0, "{loads} failed loads for 30 requests");
}
