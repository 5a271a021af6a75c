//! Faults that must not become outages, end to end: real mock-worker processes with
//! injected faults, a real router process, real HTTP (and a real etcd where discovery is
//! the subject).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::faults::*;
use common::http::{self, post_json};
use common::procs::{mock_worker, serve};
use common::router::{PATIENCE, TOKEN, available, eventually, instance, metric};
use hyper::StatusCode;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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

/// `--availability false` (the benchmarks' baseline) keeps every discovered worker in
/// the picks, whatever happens: a stream that stalls ends with its error event, and its
/// worker is still routed to, even with outlier detection set to eject at the first
/// failure (one meaning of a failure for every path: a stall used to eject here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_availability_tracking_a_stalling_worker_is_never_ejected() {
    let (_workers, _router, url) = fleet(
        1,
        |_| vec!["--fault", "stall"],
        &[
            "--availability",
            "false",
            "--consecutive-failures",
            "1",
            "--stream-idle-timeout-secs",
            "1",
            "--health-check-interval-ms",
            "0",
            "--migration-limit",
            "0",
        ],
    )
    .await;
    let c = http::client();
    for i in 0..2 {
        let (s, _, body) = complete(&c, &url, &chat(&format!("stall {i}"), 50, true)).await;
        assert_eq!(s, StatusCode::OK);
        assert!(body.contains("sent nothing"), "{body}");
        assert_eq!(
            available(&c, &url).await,
            1,
            "the stalling worker was ejected"
        );
    }
    assert_eq!(
        metric(&c, &url, "switchyard_stream_stalls_total", "").await,
        2.0
    );
}
