//! Input from outside that must not crash, stall or grow the router: hostile peers on a
//! worker's KV event socket and clients that stall their bodies, end to end with real
//! router and mock-worker processes and real sockets.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::hostile_zmtp::{Hostile, hostile_publisher};
use common::http::{self, post_json};
use common::procs::{mock_worker, serve};
use common::router::{PATIENCE, eventually, metric};
use hyper::StatusCode;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A mock worker (`worker_flags`; sped up 100x unless they say) and a router over it (`router_flags`);
/// returns both processes and the router's and the worker's URLs.
async fn one_worker(
    worker_flags: &[&str],
    router_flags: &[&str],
) -> (common::procs::Proc, common::procs::Proc, String, String) {
    let mut wf = worker_flags.to_vec();
    if !wf.contains(&"--speedup") {
        wf.extend(["--speedup", "100"]);
    }
    let (worker, worker_url) = mock_worker(&wf).await;
    let mut rf = vec!["--model", "mock", "--worker", worker_url.as_str()];
    rf.extend_from_slice(router_flags);
    let (router, url) = serve(&rf).await;
    (worker, router, url, worker_url)
}

/// A worker whose KV event socket is held by a hostile peer: a frame declaring 2^62
/// bytes (which aborted the router when a ZMQ library reserved it), or endless MORE
/// frames (which grew it past a GiB in a second). The router refuses each connection at
/// its bound, reconnects with backoff, stays up with its memory bounded, and serves both
/// workers all the while.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_kv_event_peer_neither_kills_nor_grows_the_router() {
    for mode in [Hostile::HugeFrame, Hostile::EndlessMore] {
        let (endpoint, connections) = hostile_publisher(mode).await;
        let (_good, good_url) = mock_worker(&["--speedup", "100"]).await;
        let (_other, other_url) = mock_worker(&["--speedup", "100"]).await;
        let hostile_worker = format!("{other_url}#kv_events={endpoint}");
        let (mut router, url) = serve(&[
            "--model",
            "mock",
            "--worker",
            &good_url,
            "--worker",
            &hostile_worker,
            "--policy",
            "round-robin",
        ])
        .await;
        eventually("the router to come back to the hostile peer", || async {
            connections.load(Ordering::Relaxed) >= 3
        })
        .await;
        let c = http::client();
        for i in 0..20 {
            let body = json!({"model": "mock", "prompt": format!("request {i}"), "max_tokens": 2});
            let (status, answer, _) = post_json(&c, &format!("{url}/v1/completions"), &body).await;
            assert_eq!(status, StatusCode::OK, "{mode:?}, request {i}: {answer}");
        }
        assert!(
            router.0.try_wait().unwrap().is_none(),
            "{mode:?}: the router died"
        );
        let rss =
            switchyard::replay::external::proc_status_kb(router.0.id(), "VmRSS").unwrap() * 1024;
        assert!(
            rss < 512 << 20,
            "{mode:?}: the router holds {} MiB",
            rss >> 20
        );
        router.kill();
    }
}

/// Clients that send a request head and then stall their body take no in-flight slot:
/// with room for 4 requests and 12 stalled uploads, normal requests sent one after
/// another for as long as any upload is still stalled are all served (had the uploads
/// held slots, those sent in the ~3 s before the router gave up on them would have been
/// refused 503), and each stalled upload is answered 408 once the client timeout passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_uploads_hold_no_slot_and_are_answered_408() {
    let (_worker, _router, url, _) = one_worker(
        &[],
        &["--max-in-flight", "4", "--client-idle-timeout-secs", "3"],
    )
    .await;
    let addr = url.trim_start_matches("http://").to_string();
    let mut stalled = Vec::new();
    for _ in 0..12 {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\"",
        )
        .await
        .unwrap();
        // Each one's answer, read as it comes.
        stalled.push(tokio::spawn(async move {
            let mut answer = Vec::new();
            let mut buf = [0u8; 1024];
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => answer.extend_from_slice(&buf[..n]),
                }
                if answer.windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            String::from_utf8_lossy(&answer).into_owned()
        }));
    }
    let c = http::client();
    let deadline = std::time::Instant::now() + PATIENCE;
    let mut served = 0;
    while stalled.iter().any(|t| !t.is_finished()) {
        assert!(
            std::time::Instant::now() < deadline,
            "a stalled upload was never answered"
        );
        let body = json!({"model": "mock", "prompt": format!("request {served}"), "max_tokens": 2});
        let (status, answer, _) = post_json(&c, &format!("{url}/v1/completions"), &body).await;
        assert_eq!(
            status,
            StatusCode::OK,
            "request {served}, beside the stalled uploads: {answer}"
        );
        served += 1;
    }
    assert!(
        served >= 20,
        "only {served} requests beside the stalled uploads"
    );
    for t in stalled {
        let answer = t.await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    }
}

/// A 16 MB token-ID prompt (8M tokens, ~500k blocks) is refused before anything is
/// booked or predicted: it used to be recorded as half a million predicted blocks under
/// the index's write lock before the worker refused it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_16_mb_token_prompt_is_refused_before_any_booking_or_prediction() {
    let (_worker, _router, url, worker_url) =
        one_worker(&[], &["--admin-token", common::router::TOKEN]).await;
    let mut body = String::with_capacity(16 << 20);
    body.push_str(r#"{"model": "mock", "max_tokens": 1, "prompt": ["#);
    for i in 0..8_000_000u32 {
        body.push_str(if i == 0 { "1" } else { ",1" });
    }
    body.push_str("]}");
    assert!(body.len() < 16 << 20);
    let c = http::client();
    let (status, _, answer) = http::send(
        &c,
        hyper::Method::POST,
        &format!("{url}/v1/completions"),
        &[("content-type", "application/json")],
        body,
        PATIENCE,
    )
    .await
    .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    assert!(answer.contains("the prompt has 8000000 tokens"), "{answer}");
    let instance = common::router::instance(&c, &url, &worker_url).await;
    assert_eq!(instance["cached_blocks"], 0, "{instance}");
    assert_eq!(instance["booked"], 0, "{instance}");
    let ok = json!({"model": "mock", "prompt": "a normal one", "max_tokens": 2});
    let (status, answer, _) = post_json(&c, &format!("{url}/v1/completions"), &ok).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
}

/// Streaming clients that stop reading hold their slots only until the client timeout:
/// with room for 2 requests, two clients that never read their 60,000-token streams (more than the kernel buffers) are
/// cut once the router's writes stall for 2 s, and normal requests are served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_stop_reading_are_cut_and_give_their_slots_back() {
    let (_worker, _router, url, _) = one_worker(
        &["--speedup", "1000", "--kv-blocks", "100000"],
        &["--max-in-flight", "2", "--client-idle-timeout-secs", "2"],
    )
    .await;
    let addr: std::net::SocketAddr = url.trim_start_matches("http://").parse().unwrap();
    let mut silent = Vec::new();
    for i in 0..2 {
        // A small receive window, never read: the router's writes stall at once.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut s = socket.connect(addr).await.unwrap();
        let body = json!({"model": "mock", "prompt": format!("long story {i}"), "max_tokens": 60000, "stream": true}).to_string();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(head.as_bytes()).await.unwrap();
        silent.push(s);
    }
    let c = http::client();
    eventually("a normal request served beside the silent streams", || {
        let (c, url) = (c.clone(), url.clone());
        async move {
            let ok = json!({"model": "mock", "prompt": "short", "max_tokens": 2});
            post_json(&c, &format!("{url}/v1/completions"), &ok).await.0 == StatusCode::OK
        }
    })
    .await;
    drop(silent);
}

/// A prompt longer than the model's context is refused by the router before anything is
/// booked, once a worker's `/v1/models` has said its `max_model_len` (the mock's: what
/// its cache holds, here 64 blocks of 16 tokens); prompts that fit are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_past_the_models_context_is_refused_by_the_router() {
    let (_worker, _router, url, _) = one_worker(&["--kv-blocks", "64"], &[]).await;
    let c = http::client();
    let long: Vec<u32> = (0..2000).map(|i| 1 + i % 500).collect();
    let body = json!({"model": "mock", "prompt": long, "max_tokens": 1});
    eventually("the router to know the model's context", || {
        let (c, url, body) = (c.clone(), url.clone(), body.clone());
        async move {
            let (status, answer, _) = post_json(&c, &format!("{url}/v1/completions"), &body).await;
            status == StatusCode::BAD_REQUEST
                && answer.to_string().contains("context is 1024 tokens")
        }
    })
    .await;
    let short: Vec<u32> = (0..500).map(|i| 1 + i % 500).collect();
    let ok = json!({"model": "mock", "prompt": short, "max_tokens": 2});
    let (status, answer, _) = post_json(&c, &format!("{url}/v1/completions"), &ok).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
}

/// Many peers on the bound KV events socket, each at its per-message bound (a 24 MiB
/// payload sent but for its last byte, held until the message deadline): they share the
/// router's one budget for event input (`--kv-events-memory-mib 32`), so the router holds
/// one such message, not twenty (which took ~500 MiB before the budget), refuses the
/// others' frames at their headers, and keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_peers_at_their_bound_together_are_held_to_the_event_memory() {
    let port = common::procs::free_port();
    let bind = format!("tcp://127.0.0.1:{port}");
    let (_worker, router, url, _) = one_worker(
        &[],
        &["--kv-events-bind", &bind, "--kv-events-memory-mib", "32"],
    )
    .await;
    let address = format!("127.0.0.1:{port}");
    let peers: Vec<_> = (0..20)
        .map(|_| {
            let a = address.clone();
            tokio::spawn(async move { unfinished_message(&a, 24 << 20, PATIENCE).await })
        })
        .collect();
    // Every peer has sent what it meant to (or was refused), within the 10 s message
    // deadline of the one the router admitted.
    let c = http::client();
    eventually("the peers refused at the budget", || {
        let (c, url) = (c.clone(), url.clone());
        async move {
            metric(
                &c,
                &url,
                "switchyard_kv_events_refused_connections_total",
                "",
            )
            .await
                >= 19.0
        }
    })
    .await;
    // The budget's own gauge cannot exceed the budget by construction: the process's
    // resident memory is the measure.
    let rss = switchyard::replay::external::proc_status_kb(router.0.id(), "VmRSS").unwrap() * 1024;
    assert!(
        rss < 160 << 20,
        "20 peers at their bound: the router holds {} MiB",
        rss >> 20
    );
    let ok = json!({"model": "mock", "prompt": "still serving", "max_tokens": 2});
    let (status, answer, _) = post_json(&c, &format!("{url}/v1/completions"), &ok).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    for p in peers {
        p.abort();
    }
}

/// A publisher connecting to a router's bound KV events socket (`address`: `HOST:PORT`)
/// that sends a message whose last frame declares `size` bytes and then sends all but
/// the last byte of it, so that the router holds the message unfinished until its
/// deadline. Returns once it has sent what it meant to, or the router hung up; the
/// connection stays open until `hold` ends.
async fn unfinished_message(address: &str, size: u64, hold: Duration) {
    let Ok(mut s) = TcpStream::connect(address).await else {
        return;
    };
    let mut head = switchyard::router::zmtp::hello(b"PUB");
    // [topic (MORE), seq (MORE), payload (LONG): `size` bytes declared].
    head.extend_from_slice(&[0x01, 1, b't', 0x01, 8]);
    head.extend_from_slice(&1u64.to_be_bytes());
    head.push(0x02);
    head.extend_from_slice(&size.to_be_bytes());
    if s.write_all(&head).await.is_err() {
        return;
    }
    let chunk = vec![b'x'; 1 << 20];
    let mut left = size.saturating_sub(1);
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        // The router stops reading a connection it closed: the write fails or stalls.
        match tokio::time::timeout(Duration::from_secs(2), s.write_all(&chunk[..n])).await {
            Ok(Ok(())) => left -= n as u64,
            _ => return,
        }
    }
    tokio::time::sleep(hold).await;
}
