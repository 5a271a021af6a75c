//! `switchyard serve` end to end: real etcd, real mock-worker processes, a real router
//! process, real HTTP — and a real OpenAI client library.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::etcd::Etcd;
use common::http::{self, get, post_json, sse_events};
use common::procs::{mock_worker, serve};
use common::router::{PATIENCE, TOKEN, admin_get, auth, eventually, instance, metric};
use common::serve::*;
use hyper::{Method, StatusCode};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_prefix_goes_to_the_same_worker_and_round_robin_spreads() {
    let fleet = etcd_fleet(3, "100").await;
    let (workers, url, c) = (&fleet.workers, fleet.url.clone(), fleet.c.clone());

    let context =
        "The quarterly report covers revenue, costs, hiring and the product roadmap. ".repeat(12);
    let (s, first, _) = post_json(
        &c,
        &format!("{url}/v1/chat/completions"),
        &chat(&format!("{context} What was revenue?"), 2),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{first}");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // Wait until the router has seen the worker's KV events for that prompt.
    eventually("the KV events of the first request", || async {
        common::router::instances(&c, &url).await["instances"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["cached_blocks"].as_u64().unwrap_or(0) > 0)
    })
    .await;
    let (_, second, _) = post_json(
        &c,
        &format!("{url}/v1/chat/completions"),
        &chat(&format!("{context} What were the costs?"), 2),
    )
    .await;
    let prompt = second["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached * 10 >= prompt * 8,
        "the shared prefix was not reused: {cached} of {prompt} tokens cached"
    );

    // A long conversation's second turn: the router reuses the tokens of the first
    // turn's text instead of tokenizing the history again, and still finds the cache.
    let history = "Appendix: revenue by region, costs by quarter, hiring by team. ".repeat(80);
    let turn1 = json!({"model": "mock", "max_tokens": 2, "messages": [
        {"role": "system", "content": history},
        {"role": "user", "content": "Summarise the appendix."}]});
    let (s, v, _) = post_json(&c, &format!("{url}/v1/chat/completions"), &turn1).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let hits_before = metric(&c, &url, "switchyard_token_prefix_hits_total", "").await;
    eventually("the KV events of the first turn", || async {
        let (_, again, _) = post_json(
            &c,
            &format!("{url}/v1/chat/completions"),
            &json!({"model": "mock", "max_tokens": 2, "messages": [
                {"role": "system", "content": history},
                {"role": "user", "content": "Summarise the appendix."},
                {"role": "assistant", "content": "Revenue grew."},
                {"role": "user", "content": "And costs?"}]}),
        )
        .await;
        let prompt = again["usage"]["prompt_tokens"].as_u64().unwrap_or(1);
        let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        cached * 10 >= prompt * 8
    })
    .await;
    assert!(
        metric(&c, &url, "switchyard_token_prefix_hits_total", "").await > hits_before,
        "the second turn was tokenized from the start"
    );

    // Switch the endpoint to round-robin: six requests, two per worker.
    let (s, _, body) = http::send(
        &c,
        Method::PUT,
        &format!("{url}/admin/endpoints/default/mock/generate/policy?builtin=round-robin"),
        &[("authorization", &auth())],
        "",
        PATIENCE,
    )
    .await
    .unwrap();
    assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let mut before = Vec::new();
    for (_, w) in workers {
        before.push(worker_finished(&c, w).await);
    }
    for i in 0..6 {
        let (s, v, _) = post_json(
            &c,
            &format!("{url}/v1/chat/completions"),
            &chat(&format!("{context} question {i}"), 1),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{v}");
    }
    for (i, (_, w)) in workers.iter().enumerate() {
        assert_eq!(
            worker_finished(&c, w).await - before[i],
            2,
            "round-robin spread unevenly"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_worker_under_load_fails_no_client_request() {
    let mut fleet = etcd_fleet(4, "50").await;
    let (url, c) = (fleet.url.clone(), fleet.c.clone());
    let dead_url = fleet.workers[0].1.clone();
    let dead_id = instance(&c, &url, &dead_url).await["id"]
        .as_str()
        .unwrap()
        .to_string();

    let stop = Arc::new(AtomicBool::new(false));
    let clients = load(url.clone(), 6, stop.clone());
    tokio::time::sleep(Duration::from_millis(800)).await;
    fleet.workers[0].0.kill();
    let failures = "switchyard_instance_upstream_failures_total";
    let dead = format!("instance=\"{dead_id}\"");
    eventually("the first failure on the dead worker", || async {
        metric(&c, &url, failures, &dead).await >= 1.0
    })
    .await;
    // Requests sent to it from here on (not those in flight when it died, which fail
    // after the first one and count as failures too): its routing decisions.
    let decisions = "switchyard_instance_decisions_total";
    let first = metric(&c, &url, decisions, &dead).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(true, Ordering::Relaxed);
    let (ok, failed, errors) = clients.await.unwrap();
    let after = metric(&c, &url, decisions, &dead).await;
    assert_eq!(failed, 0, "client requests failed: {errors:?}");
    assert!(ok > 50, "only {ok} requests completed");
    assert!(
        first > 0.0 && after - first <= 1.0,
        "{} requests were sent to the dead worker after its first failure",
        after - first
    );
    let down = instance(&c, &url, &dead_url).await;
    assert_eq!(down["available"], false, "{down}");
}

/// A worker stand-in that answers with fixed bytes, in awkward chunks, so that the
/// router's pass-through can be compared byte for byte.
async fn fixed_upstream() -> (String, &'static [&'static [u8]]) {
    const CHUNKS: &[&[u8]] = &[
        b"data: {\"id\":\"x\",\"choices\":[{\"delta\":{\"content\":\"He",
        b"llo\"}}]}\n\n",
        b": a comment line the router must not touch\n\ndata:   {\"odd\" :  \"spacing\"}\n\n",
        b"data: {\"usage\":{\"prompt_tokens\":7,\"prompt_tokens_details\":{\"cached_tokens\":3}}}\n\n",
        b"data: [DONE]\n\n",
    ];
    use hyper::body::Frame;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    |req: hyper::Request<hyper::body::Incoming>| async move {
                        let (tx, rx) = tokio::sync::mpsc::channel::<
                            Result<Frame<bytes::Bytes>, std::convert::Infallible>,
                        >(8);
                        if req.uri().path() != "/health" {
                            tokio::spawn(async move {
                                for c in CHUNKS {
                                    tokio::time::sleep(Duration::from_millis(20)).await;
                                    let _ = tx
                                        .send(Ok(Frame::data(bytes::Bytes::from_static(c))))
                                        .await;
                                }
                            });
                        }
                        let body = http_body_util::StreamBody::new(
                            tokio_stream::wrappers::ReceiverStream::new(rx),
                        );
                        Ok::<_, std::convert::Infallible>(
                            hyper::Response::builder()
                                .header("content-type", "text/event-stream")
                                .body(body)
                                .unwrap(),
                        )
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (url, CHUNKS)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_pass_through_byte_for_byte_and_bad_requests_get_the_documented_errors() {
    let (upstream, chunks) = fixed_upstream().await;
    let (_router, url) = serve(&[
        "--worker",
        &upstream,
        "--model",
        "mock",
        "--max-body-bytes",
        "4096",
        "--admin-token",
        TOKEN,
    ])
    .await;
    let c = http::client();
    let body =
        json!({"model": "mock", "stream": true, "messages": [{"role": "user", "content": "hi"}]})
            .to_string();
    let (status, headers, bytes) = http::send(
        &c,
        Method::POST,
        &format!("{url}/v1/chat/completions"),
        &[],
        body,
        PATIENCE,
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["content-type"], "text/event-stream");
    assert_eq!(bytes, chunks.concat(), "the stream was altered");
    // The usage in the stream reached the metrics.
    assert_eq!(
        metric(&c, &url, "switchyard_cached_prompt_tokens_total", "").await,
        3.0
    );
    the_request_is_timed_and_every_family_described(&c, &url).await;
    let completions = format!("{url}/v1/chat/completions");
    let cases: Vec<(Vec<u8>, StatusCode, &str)> = vec![
        (
            b"{this is not json".to_vec(),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
        ),
        (
            json!({"model": "mock"}).to_string().into_bytes(),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
        ),
        (
            chat("x", 1)
                .to_string()
                .replace("\"mock\"", "\"gpt-imaginary\"")
                .into_bytes(),
            StatusCode::NOT_FOUND,
            "invalid_request_error",
        ),
        (
            chat(&"long ".repeat(2000), 1).to_string().into_bytes(),
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
        ),
    ];
    for (body, want, kind) in cases {
        let (status, _, bytes) = http::send(&c, Method::POST, &completions, &[], body, PATIENCE)
            .await
            .unwrap();
        assert_eq!(status, want, "{}", String::from_utf8_lossy(&bytes));
        let err: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(err["error"]["type"], kind, "{err}");
        assert!(
            err["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    the_admin_api_asks_for_its_token(&c, &url).await;
    // Still serving.
    let (s, _, _) = http::send(&c, Method::POST, &completions, &[], json!({"model": "mock", "stream": true, "messages": [{"role": "user", "content": "again"}]}).to_string(), PATIENCE).await.unwrap();
    assert_eq!(s, StatusCode::OK);
    assert_eq!(get(&c, &format!("{url}/health")).await.0, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_worker_gives_502_then_503_and_the_router_keeps_serving() {
    let closed = format!("http://127.0.0.1:{}", common::procs::free_port());
    let (_router, url) = serve(&["--worker", &closed, "--model", "mock"]).await;
    let c = http::client();
    let (s, v, _) = post_json(&c, &format!("{url}/v1/chat/completions"), &chat("hi", 1)).await;
    assert_eq!(s, StatusCode::BAD_GATEWAY, "{v}");
    assert_eq!(v["error"]["code"], "upstream_error");
    let (s, v, _) = post_json(&c, &format!("{url}/v1/chat/completions"), &chat("hi", 1)).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(v["error"]["code"], "no_available_worker");
    assert_eq!(get(&c, &format!("{url}/health")).await.0, StatusCode::OK);
    assert_eq!(
        get(&c, &format!("{url}/ready")).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_works_against_serve() {
    let (_w1, w1) = mock_worker(&["--speedup", "100"]).await;
    let (_w2, w2) = mock_worker(&["--speedup", "100"]).await;
    let workers = format!("{w1},{w2}");
    let (_router, url) = serve(&[
        "--worker",
        &workers,
        "--model",
        "mock",
        "--kv-events",
        "true",
    ])
    .await;
    let script = r#"
import os, openai
client = openai.OpenAI(base_url=os.environ["BASE_URL"] + "/v1", api_key="unused")
r = client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "Hello from the OpenAI client"}], max_tokens=5)
assert r.choices[0].message.content.strip(), r
assert r.usage.completion_tokens == 5, r.usage
print("non-streaming:", r.choices[0].message.content.strip())
parts = []
for chunk in client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "Stream please"}], max_tokens=4, stream=True):
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
assert len(parts) == 4, parts
print("streaming:", "".join(parts).strip())
c = client.completions.create(model="mock", prompt="Once upon a time", max_tokens=3)
assert c.choices[0].text.strip(), c
print("completions:", c.choices[0].text.strip())
models = [m.id for m in client.models.list()]
assert models == ["mock"], models
print("ok")
"#;
    let out = tokio::process::Command::new("python3")
        .args(["-c", script])
        .env("BASE_URL", &url)
        .output()
        .await
        .expect("python3 runs (.ci/run installs the `openai` package)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.ends_with("ok\n"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_an_open_stream_finish_and_stops_accepting() {
    // Real time: 150 tokens at ~10 ms a step take ~1.5 s.
    let (_w, worker) = mock_worker(&[]).await;
    let (router, url) = serve(&[
        "--worker",
        &worker,
        "--model",
        "mock",
        "--kv-events",
        "true",
    ])
    .await;
    let body = json!({"model": "mock", "stream": true, "max_tokens": 150, "messages": [{"role": "user", "content": "long story"}]});
    let c = http::client();
    let req = hyper::Request::post(format!("{url}/v1/chat/completions"))
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    use http_body_util::BodyExt;
    let mut body = resp.into_body();
    let mut got = body
        .frame()
        .await
        .unwrap()
        .unwrap()
        .into_data()
        .unwrap()
        .to_vec();
    router.terminate();
    // New connections are refused once the listener closes.
    let addr = url.trim_start_matches("http://").to_string();
    eventually("the listener to close", || {
        let addr = addr.clone();
        async move { std::net::TcpStream::connect(addr).is_err() }
    })
    .await;
    let rest = tokio::time::timeout(PATIENCE, body.collect())
        .await
        .unwrap()
        .unwrap()
        .to_bytes();
    got.extend_from_slice(&rest);
    let events = sse_events(&got);
    assert_eq!(events.last().unwrap(), "[DONE]");
    // Every token's chunk (the opening chunk carries the role and no token).
    assert_eq!(
        events
            .iter()
            .filter(|e| e.contains("\"content\"") && !e.contains("\"role\""))
            .count(),
        150
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_broken_after_it_started_ends_with_an_error_event_and_is_counted() {
    let (_w, worker) = mock_worker(&["--speedup", "100", "--fault", "cut-stream"]).await;
    let (_router, url) = serve(&[
        "--worker",
        &worker,
        "--model",
        "mock",
        "--kv-events",
        "true",
    ])
    .await;
    let c = http::client();
    let body = json!({"model": "mock", "stream": true, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]});
    let (status, _, bytes) = http::send(
        &c,
        Method::POST,
        &format!("{url}/v1/chat/completions"),
        &[],
        body.to_string(),
        PATIENCE,
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::OK);
    let events = sse_events(&bytes);
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "upstream_stream_error", "{events:?}");
    assert!(
        events.iter().any(|e| e.contains("\"content\"")),
        "some tokens arrived first"
    );
    assert_eq!(
        metric(&c, &url, "switchyard_stream_errors_total", "").await,
        1.0
    );
}

/// Clients' `Authorization` header (vLLM's `--api-key`) goes to static workers, which the
/// operator named, but not to workers found in etcd, where whoever can write an instance
/// record would receive it, unless the operator says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_credentials_reach_only_workers_the_operator_trusts() {
    let etcd = Etcd::start();
    let key = "sk-worker-key";
    let (_w, wurl) = mock_worker(&["--api-key", key, "--etcd", &etcd.url()]).await;
    let c = http::client();
    let ask = |router: String| {
        let c = c.clone();
        async move {
            http::send(
                &c,
                Method::POST,
                &format!("{router}/v1/chat/completions"),
                &[
                    ("authorization", &format!("Bearer {key}")),
                    ("content-type", "application/json"),
                ],
                chat("hi", 2).to_string(),
                PATIENCE,
            )
            .await
            .unwrap()
            .0
        }
    };
    let (_a, fixed) = serve(&["--worker", &wurl, "--model", "mock"]).await;
    assert_eq!(
        ask(fixed).await,
        StatusCode::OK,
        "static workers get the header"
    );
    let (_b, discovered) = serve(&["--etcd", &etcd.url(), "--admin-token", TOKEN]).await;
    wait_available(&c, &discovered, 1).await;
    assert_eq!(
        ask(discovered).await,
        StatusCode::UNAUTHORIZED,
        "etcd-discovered workers do not, by default"
    );
    let (_c, trusting) = serve(&[
        "--etcd",
        &etcd.url(),
        "--admin-token",
        TOKEN,
        "--forward-authorization",
        "true",
    ])
    .await;
    wait_available(&c, &trusting, 1).await;
    assert_eq!(ask(trusting).await, StatusCode::OK);
}

/// The request was timed, in histograms with buckets (so a median can be read), and
/// every family says what it is: HELP and TYPE before its samples.
async fn the_request_is_timed_and_every_family_described(c: &http::HttpClient, url: &str) {
    let (_, text) = get(c, &format!("{url}/metrics")).await;
    let text = String::from_utf8_lossy(&text);
    for name in [
        "switchyard_decision_seconds_count{",
        "switchyard_policy_call_seconds_count{",
        "switchyard_tokenize_seconds_count ",
        "switchyard_time_to_first_byte_seconds_count{",
        "switchyard_request_duration_seconds_count{",
    ] {
        let count = text
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok());
        assert_eq!(count, Some(1.0), "{name}\n{text}");
    }
    assert!(
        text.lines()
            .any(|l| l.starts_with("switchyard_policy_call_seconds_bucket{") && l.contains("le=\"")),
        "{text}"
    );
    // Every family says what it is: HELP and TYPE before its samples.
    let mut helped = std::collections::HashSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            helped.insert(rest.split(' ').next().unwrap_or_default().to_string());
        } else if !line.starts_with('#') && !line.is_empty() {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| helped.contains(*f)))
                .unwrap_or(name);
            assert!(helped.contains(family), "{name} has no HELP\n{text}");
        }
    }
}

/// The admin API refuses a missing, wrong or partial token, and names built-ins only;
/// an upload over its limit is 413.
async fn the_admin_api_asks_for_its_token(c: &http::HttpClient, url: &str) {
    let (s, _) = get(c, &format!("{url}/admin/endpoints")).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _, _) = http::send(
        c,
        Method::GET,
        &format!("{url}/admin/endpoints"),
        &[("authorization", "Bearer wrong")],
        "",
        PATIENCE,
    )
    .await
    .unwrap();
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _, _) = http::send(
        c,
        Method::PUT,
        &format!("{url}/admin/endpoints/default/mock/generate/policy?builtin=round-robin"),
        &[],
        "",
        PATIENCE,
    )
    .await
    .unwrap();
    assert_eq!(s, StatusCode::UNAUTHORIZED, "no swap without the token");
    admin_get(c, &format!("{url}/admin/endpoints")).await;
    let admin = |method: Method, path: &str, auth: String, body: Vec<u8>| {
        let (c, url) = (c.clone(), format!("{url}{path}"));
        async move {
            http::send(
                &c,
                method,
                &url,
                &[("authorization", &auth)],
                body,
                PATIENCE,
            )
            .await
            .unwrap()
        }
    };
    // The scheme is case-insensitive; a prefix of the token is still the wrong token.
    let (s, _, _) = admin(
        Method::GET,
        "/admin/endpoints",
        format!("bearer {TOKEN}"),
        vec![],
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let prefix = format!("Bearer {}", &TOKEN[..TOKEN.len() - 1]);
    let (s, _, _) = admin(Method::GET, "/admin/endpoints", prefix, vec![]).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    // `?builtin=` names a built-in, never a file on the router's disk.
    let policy = "/admin/endpoints/default/mock/generate/policy";
    let (s, _, body) = admin(
        Method::PUT,
        &format!("{policy}?builtin=/etc/hostname"),
        auth(),
        vec![],
    )
    .await;
    let body = String::from_utf8_lossy(&body);
    assert_eq!(s, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("not a built-in policy"), "{body}");
    // A policy over the upload limit is too large (413), not a bad request.
    let (s, _, _) = admin(Method::PUT, policy, auth(), vec![0u8; (32 << 20) + 1]).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
}
