//! The router's own limits under abuse, end to end: slow clients, connection and request
//! caps, running out of file descriptors, a policy that cannot load. Real mock-worker
//! processes, router process and HTTP.

mod common;

use std::time::Duration;

use common::etcd::Etcd;
use common::faults::*;
use common::http::{self};
use common::procs::{Proc, mock_worker};
use common::router::{PATIENCE, TOKEN, available, eventually, metric};
use hyper::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
