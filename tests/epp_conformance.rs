//! An endpoint-picker conformance suite that needs no Kubernetes. The Gateway API
//! Inference Extension's conformance tests run only in a cluster, but what they assert
//! is plain HTTP; here the same assertions run with a real Envoy (configured as GIE's
//! reference gateway, `tests/envoy/gateway.yaml`), the picker under test, and echo
//! backends that say who served and what reached them (`tests/common/echo.rs`).
//!
//! The picker is started through an adapter: `ADAPTER PORT ENDPOINT...` serves the
//! ext_proc service and gRPC health on `127.0.0.1:PORT` for those endpoints
//! (`tools/epp-conformance/switchyard.sh` is Switchyard's). `SWITCHYARD_EPP_ADAPTER`
//! names another; `tools/epp-conformance.sh [ADAPTER]` runs the suite.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::StatusCode;
use serde_json::{Value, json};

use common::echo::{Echo, echo};
use common::gateway::{REFERENCE, Spec, envoy};
use common::http::{self, HttpClient};
use common::procs::{Proc, free_port};

/// The adapter that starts the picker under test.
fn adapter() -> String {
    std::env::var("SWITCHYARD_EPP_ADAPTER").unwrap_or_else(|_| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tools/epp-conformance/switchyard.sh"
        )
        .to_string()
    })
}

/// How the picker under test is asked to behave.
#[derive(Clone, Copy, Default)]
struct Ask {
    /// Other endpoints to name after each pick.
    fallbacks: usize,
    /// Shed what a one-endpoint pool cannot take.
    shed: bool,
}

/// The picker under test for `endpoints`, serving once its gRPC health says `liveness`;
/// its process and port.
async fn picker(endpoints: &[&str], ask: Ask) -> (Proc, u16) {
    let port = free_port();
    let child = Command::new(adapter())
        .arg(port.to_string())
        .args(endpoints)
        .env("SWITCHYARD_BIN", env!("CARGO_BIN_EXE_switchyard"))
        .env("EPP_CONFORMANCE_FALLBACKS", ask.fallbacks.to_string())
        .env("EPP_CONFORMANCE_SHED", if ask.shed { "1" } else { "0" })
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start the adapter {}: {e}", adapter()));
    let mut proc = Proc(child);
    for _ in 0..600 {
        if let Some(exit) = proc.0.try_wait().unwrap() {
            panic!("the picker exited ({exit}) at start");
        }
        if health(port, "liveness").await == Some(true) {
            return (proc, port);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the picker never answered gRPC health `liveness`");
}

/// The picker's gRPC health for `service`: serving or not, or no answer (an error: an
/// unknown service, or nothing listening).
async fn health(port: u16, service: &str) -> Option<bool> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .ok()?
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .ok()?;
    let mut client = tonic_health::pb::health_client::HealthClient::new(channel);
    let request = tonic_health::pb::HealthCheckRequest {
        service: service.into(),
    };
    let answer = client.check(request).await.ok()?;
    Some(
        answer.into_inner().status
            == tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
    )
}

/// Waits (bounded) until the picker says it is ready.
async fn ready(port: u16) {
    common::router::eventually("the picker's readiness", || async {
        health(port, "readiness").await == Some(true)
    })
    .await;
}

/// `n` echo backends, and their addresses.
async fn backends(n: usize) -> (Vec<Echo>, Vec<String>) {
    let mut all = Vec::new();
    for _ in 0..n {
        all.push(echo().await);
    }
    let addrs = all.iter().map(|e| e.addr.clone()).collect();
    (all, addrs)
}

/// A completion through the gateway: its status, headers and JSON answer.
async fn complete(
    c: &HttpClient,
    gateway: &str,
    body: Value,
) -> (StatusCode, hyper::HeaderMap, Value) {
    let (status, headers, bytes) = http::send(
        c,
        hyper::Method::POST,
        &format!("{gateway}/v1/completions"),
        &[("content-type", "application/json")],
        body.to_string(),
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, headers, v)
}

fn prompt(i: usize) -> Value {
    json!({"model": "mock", "prompt": format!("conformance request {i}"), "max_tokens": 2})
}

/// The endpoints a pick named, in order, as the backend saw the header.
fn named(answer: &Value) -> Vec<String> {
    answer["echo"]["destination"]
        .as_str()
        .unwrap_or_default()
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// Sends `n` requests, `at_once` at a time; every answer must be 200 from a backend that
/// is the first endpoint the pick named. The backends that served, in order.
async fn served_by_the_first_named(
    c: &HttpClient,
    gateway: &str,
    n: usize,
    pool: &[String],
) -> Vec<String> {
    let mut served = Vec::new();
    for batch in (0..n).collect::<Vec<_>>().chunks(5) {
        let sent: Vec<_> = batch
            .iter()
            .map(|i| {
                let (c, g) = (c.clone(), gateway.to_string());
                let body = prompt(*i);
                tokio::spawn(async move { complete(&c, &g, body).await })
            })
            .collect();
        for s in sent {
            let (status, _, answer) = s.await.unwrap();
            assert_eq!(status, 200, "{answer}");
            let by = answer["echo"]["served_by"].as_str().unwrap().to_string();
            let list = named(&answer);
            assert_eq!(
                list.first(),
                Some(&by),
                "served by {by}, not the first endpoint the pick named ({list:?})"
            );
            assert!(
                list.iter().all(|e| pool.contains(e)),
                "the pick named an endpoint outside the pool: {list:?}"
            );
            served.push(by);
        }
    }
    served
}

/// GIE's reference gateway (an ORIGINAL_DST cluster reading the destination header):
/// every request reaches the endpoint the picker named, and is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_routes_each_request_to_the_endpoint_the_picker_names() {
    if common::gateway::no_envoy() {
        return;
    }
    let (_b, pool) = backends(3).await;
    let endpoints: Vec<&str> = pool.iter().map(String::as_str).collect();
    let (_p, port) = picker(&endpoints, Ask::default()).await;
    ready(port).await;
    let (_envoy, gateway, _dir) = envoy(port, &REFERENCE).await;
    let c = http::client();
    let served = served_by_the_first_named(&c, &gateway, 30, &pool).await;
    assert_eq!(served.len(), 30);
}

/// A pool cluster behind Envoy's override_host policy routes by the `envoy.lb` metadata,
/// and the backend sees the header: with fallbacks named, the two carry the same list,
/// and the first endpoint of it serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_header_and_the_metadata_name_the_same_endpoints_and_the_first_serves() {
    if common::gateway::no_envoy() {
        return;
    }
    let (_b, pool) = backends(3).await;
    let endpoints: Vec<&str> = pool.iter().map(String::as_str).collect();
    let (_p, port) = picker(
        &endpoints,
        Ask {
            fallbacks: 1,
            ..Ask::default()
        },
    )
    .await;
    ready(port).await;
    let spec = Spec {
        pool: Some(&endpoints),
        ..REFERENCE
    };
    let (_envoy, gateway, _dir) = envoy(port, &spec).await;
    let c = http::client();
    served_by_the_first_named(&c, &gateway, 20, &pool).await;
}

/// The endpoint that served, as the gateway reports it to the picker, comes back in
/// the answer's `x-gateway-destination-endpoint-served` header (GIE's conformance
/// picker says it in `x-conformance-test-served-endpoint`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoint_that_served_is_reported() {
    if common::gateway::no_envoy() {
        return;
    }
    let (_b, pool) = backends(2).await;
    let endpoints: Vec<&str> = pool.iter().map(String::as_str).collect();
    let (_p, port) = picker(&endpoints, Ask::default()).await;
    ready(port).await;
    let (_envoy, gateway, _dir) = envoy(port, &REFERENCE).await;
    let c = http::client();
    for i in 0..6 {
        let (status, headers, answer) = complete(&c, &gateway, prompt(i)).await;
        assert_eq!(status, 200, "{answer}");
        let reported = headers
            .get("x-gateway-destination-endpoint-served")
            .or_else(|| headers.get("x-conformance-test-served-endpoint"))
            .and_then(|v| v.to_str().ok())
            .unwrap_or_else(|| panic!("no served endpoint reported: {headers:?}"));
        assert_eq!(reported, answer["echo"]["served_by"], "{headers:?}");
    }
}

/// The gateway's subset hint bounds the pick: every request lands in the subset, and a
/// subset of no endpoint of the pool is 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_bounds_the_pick() {
    if common::gateway::no_envoy() {
        return;
    }
    let (_b, pool) = backends(3).await;
    let endpoints: Vec<&str> = pool.iter().map(String::as_str).collect();
    let (_p, port) = picker(&endpoints, Ask::default()).await;
    ready(port).await;
    let only = [endpoints[1]];
    let spec = Spec {
        pool: Some(&endpoints),
        subset: Some(&only),
        ..REFERENCE
    };
    let (_envoy, gateway, _dir) = envoy(port, &spec).await;
    let c = http::client();
    let served = served_by_the_first_named(&c, &gateway, 10, &pool).await;
    assert!(served.iter().all(|s| s == endpoints[1]), "{served:?}");

    let foreign = ["127.0.0.1:9"];
    let spec = Spec {
        pool: Some(&endpoints),
        subset: Some(&foreign),
        ..REFERENCE
    };
    let (_envoy2, gateway2, _dir2) = envoy(port, &spec).await;
    let (status, _, answer) = complete(&c, &gateway2, prompt(0)).await;
    assert_eq!(status, 503, "{answer}");
}

/// A pool with no endpoint that answers: every request is 503 (from the picker, or from
/// the gateway failing to reach its pick), none hangs, and the picker keeps serving
/// gRPC health.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_with_no_live_endpoint_answers_503() {
    if common::gateway::no_envoy() {
        return;
    }
    // Ports that were free a moment ago: nothing listens there.
    let dead = [
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    ];
    let endpoints: Vec<&str> = dead.iter().map(String::as_str).collect();
    let (_p, port) = picker(&endpoints, Ask::default()).await;
    let (_envoy, gateway, _dir) = envoy(port, &REFERENCE).await;
    let c = http::client();
    for i in 0..5 {
        let (status, _, answer) = complete(&c, &gateway, prompt(i)).await;
        assert_eq!(status, 503, "request {i}: {answer}");
    }
    assert_eq!(health(port, "liveness").await, Some(true));
}

/// A picker that sheds says so with 429 (GIE's status for a request dropped under
/// load), and what it took is served, not lost: requests held on a one-endpoint pool
/// until one is shed, then released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shed_request_is_429_and_the_requests_taken_are_served() {
    if common::gateway::no_envoy() {
        return;
    }
    let (backend, pool) = backends(1).await;
    let (_p, port) = picker(
        &[&pool[0]],
        Ask {
            shed: true,
            ..Ask::default()
        },
    )
    .await;
    ready(port).await;
    let (_envoy, gateway, _dir) = envoy(port, &REFERENCE).await;
    let c = http::client();
    let mut taken = Vec::new();
    let mut shed = None;
    for i in 0..8 {
        let (c2, g) = (c.clone(), gateway.clone());
        let body = json!({"model": "mock", "prompt": format!("held {i}"), "max_tokens": 2, "echo_hold": true});
        let mut sent = tokio::spawn(async move { complete(&c2, &g, body).await });
        // A shed request is answered at once; a taken one waits for the release.
        match tokio::time::timeout(Duration::from_secs(2), &mut sent).await {
            Ok(answer) => {
                shed = Some(answer.unwrap());
                break;
            }
            Err(_) => taken.push(sent),
        }
    }
    let (status, _, answer) = shed.expect("nothing was shed after 8 held requests");
    assert_eq!(status, 429, "{answer}");
    assert!(!taken.is_empty(), "the first request was shed");
    backend[0].release();
    for t in taken {
        let (status, _, answer) = t.await.unwrap();
        assert_eq!(status, 200, "{answer}");
    }
}

/// gRPC health as GIE's deployments probe it: `liveness`, `readiness` and the ext_proc
/// service serving; a service it does not have is an error, not "serving".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_serves_liveness_readiness_and_the_ext_proc_service() {
    let (_b, pool) = backends(1).await;
    let (_p, port) = picker(&[&pool[0]], Ask::default()).await;
    ready(port).await;
    for service in [
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        assert_eq!(health(port, service).await, Some(true), "{service}");
    }
    assert_eq!(health(port, "no-such-service").await, None);
}

/// Full duplex streaming both ways: a large request body reaches the backend whole,
/// and a streamed answer's first chunk reaches the client while the rest is still
/// held at the backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_stream_both_ways_in_full_duplex() {
    if common::gateway::no_envoy() {
        return;
    }
    let (backend, pool) = backends(1).await;
    let (_p, port) = picker(&[&pool[0]], Ask::default()).await;
    ready(port).await;
    let (_envoy, gateway, _dir) = envoy(port, &REFERENCE).await;
    let c = http::client();
    // 1 MiB of prompt, in many of the gateway's body chunks.
    let big = json!({"model": "mock", "prompt": "many words ".repeat(95_000), "max_tokens": 2})
        .to_string();
    let (status, _, bytes) = http::send(
        &c,
        hyper::Method::POST,
        &format!("{gateway}/v1/completions"),
        &[("content-type", "application/json")],
        big.clone(),
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    let answer: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["echo"]["body_bytes"], big.len());
    assert_eq!(
        answer["echo"]["body_hash"],
        common::echo::hash(big.as_bytes())
    );

    let body = json!({"model": "mock", "prompt": "stream", "max_tokens": 4, "stream": true});
    let req = hyper::Request::post(format!("{gateway}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(30), c.request(req))
        .await
        .expect("the stream's headers")
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut got = Vec::new();
    while !got.windows(6).any(|w| w == b"data: ") {
        let frame = tokio::time::timeout(Duration::from_secs(30), body.frame())
            .await
            .expect("the first chunk arrives before the backend is released")
            .expect("the stream goes on")
            .unwrap();
        if let Ok(d) = frame.into_data() {
            got.extend_from_slice(&d);
        }
    }
    backend[0].release();
    let rest = tokio::time::timeout(Duration::from_secs(30), body.collect())
        .await
        .expect("the rest once released")
        .unwrap()
        .to_bytes();
    got.extend_from_slice(&rest);
    let events = http::sse_events(&got);
    assert_eq!(events.len(), 5, "{events:?}");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
}

/// A picker that is gone: a gateway failing open goes on to its pool's own balancing
/// (200), one failing closed answers an error (5xx) and sends nothing on unpicked —
/// never a hang. Envoy keeps a copy of the body to fail open with only when it buffers
/// it (`BUFFERED`): in full duplex the body is the picker's once a chunk is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_picker_a_gateway_fails_open_or_closed_as_configured() {
    if common::gateway::no_envoy() {
        return;
    }
    let (backend, pool) = backends(2).await;
    let endpoints: Vec<&str> = pool.iter().map(String::as_str).collect();
    let (mut p, port) = picker(&endpoints, Ask::default()).await;
    ready(port).await;
    let open = Spec {
        pool: Some(&endpoints),
        fail_open: true,
        body_mode: "BUFFERED",
        ..REFERENCE
    };
    let closed = Spec {
        pool: Some(&endpoints),
        ..REFERENCE
    };
    let (_e1, open_gateway, _d1) = envoy(port, &open).await;
    let (_e2, closed_gateway, _d2) = envoy(port, &closed).await;
    let c = http::client();
    assert_eq!(complete(&c, &open_gateway, prompt(0)).await.0, 200);
    assert_eq!(complete(&c, &closed_gateway, prompt(1)).await.0, 200);
    p.kill();
    let (status, _, answer) = complete(&c, &open_gateway, prompt(2)).await;
    assert_eq!(status, 200, "failing open: {answer}");
    assert!(
        pool.iter()
            .any(|e| answer["echo"]["served_by"] == e.as_str()),
        "{answer}"
    );
    let before: usize = backend.iter().map(Echo::served).sum();
    let (status, _, answer) = complete(&c, &closed_gateway, prompt(3)).await;
    assert!(
        status.is_server_error(),
        "failing closed: {status} {answer}"
    );
    let after: usize = backend.iter().map(Echo::served).sum();
    assert_eq!(before, after, "failing closed, a request went on unpicked");
}
