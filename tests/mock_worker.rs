//! The mock worker as users run it: real HTTP, the real event stream, real processes for
//! the command-line flags, a real etcd for registration.

mod common;

use std::process::Command;
use std::time::Duration;

use common::http::{self, HttpClient, get, post_json, sse_events};
use common::procs::Proc;
use hyper::{Method, StatusCode};
use serde_json::{Value, json};
use switchyard::kv::events::KvEvent;
use switchyard::worker::MockWorker;

async fn worker(kv_blocks: usize) -> MockWorker {
    MockWorker::bind(
        common::kv::mock_worker_config(kv_blocks),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap()
}

fn long_prompt(topic: &str) -> String {
    format!(
        "You are a meticulous analyst. {} Please summarise the {topic} in detail.",
        "Background material follows. ".repeat(40)
    )
}

async fn stats(c: &HttpClient, w: &MockWorker) -> Value {
    let (_, body) = get(c, &format!("{}/stats", w.url())).await;
    serde_json::from_slice(&body).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_prompt_twice_is_served_from_the_cache_the_second_time() {
    let w = worker(4096).await;
    let c = http::client();
    let body = json!({"model": "mock", "prompt": long_prompt("report"), "max_tokens": 4});
    let (status, first, _) = post_json(&c, &format!("{}/v1/completions", w.url()), &body).await;
    assert_eq!(status, StatusCode::OK, "{first}");
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 200, "{first}");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(first["usage"]["completion_tokens"], 4);
    let after_first = stats(&c, &w).await;

    let (_, second, _) = post_json(&c, &format!("{}/v1/completions", w.url()), &body).await;
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // Every full block is reused; only the partial last block is prefilled again.
    assert_eq!(cached, prompt_tokens / 16 * 16);
    let after_second = stats(&c, &w).await;
    let prefill = |s: &Value| s["prefill_tokens"].as_u64().unwrap();
    assert_eq!(prefill(&after_first), prompt_tokens);
    assert_eq!(
        prefill(&after_second) - prefill(&after_first),
        prompt_tokens - cached
    );
    assert!(prompt_tokens - cached < 16);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streams_valid_sse_ending_in_done_with_usage() {
    let w = worker(4096).await;
    let c = http::client();
    let body = json!({
        "model": "mock", "stream": true, "max_tokens": 6, "stream_options": {"include_usage": true},
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
    });
    let (status, headers, bytes) = http::send(
        &c,
        Method::POST,
        &format!("{}/v1/chat/completions", w.url()),
        &[],
        body.to_string(),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["content-type"], "text/event-stream");
    let events = sse_events(&bytes);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    // A chunk per token after the role's, some tokens without text of their own (a
    // lone byte of a character), as vLLM streams them.
    let tokens = chunks
        .iter()
        .filter(|c| {
            let delta = &c["choices"][0]["delta"];
            delta["content"].is_string() && delta.get("role").is_none()
        })
        .count();
    assert_eq!(tokens, 6);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk" && c["id"] == chunks[0]["id"])
    );
    assert_eq!(
        chunks
            .iter()
            .filter(|c| c["choices"][0]["finish_reason"] == "length")
            .count(),
        1
    );
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_style_errors() {
    let w = worker(64).await;
    let c = http::client();
    let url = format!("{}/v1/chat/completions", w.url());
    for (body, status, param) in [
        (
            json!({"messages": [{"role": "user", "content": "x"}]}),
            StatusCode::BAD_REQUEST,
            json!("model"),
        ),
        (
            json!({"model": "mock", "messages": "hi"}),
            StatusCode::BAD_REQUEST,
            json!("messages"),
        ),
        (
            json!({"model": "mock", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}),
            StatusCode::BAD_REQUEST,
            json!("max_tokens"),
        ),
        (
            json!({"model": "other", "messages": [{"role": "user", "content": "x"}]}),
            StatusCode::NOT_FOUND,
            json!("model"),
        ),
        // Longer than the context (by default what 64 blocks of 16 tokens hold), as vLLM
        // says it.
        (
            json!({"model": "mock", "messages": [{"role": "user", "content": "word ".repeat(3000)}]}),
            StatusCode::BAD_REQUEST,
            json!("input_tokens"),
        ),
    ] {
        let (got, err, raw) = post_json(&c, &url, &body).await;
        assert_eq!(got, status, "{}", String::from_utf8_lossy(&raw));
        assert!(
            err["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{err}"
        );
        assert!(err["error"]["type"].is_string(), "{err}");
        assert_eq!(err["error"]["param"], param, "{err}");
    }
    let (status, _, bytes) = http::send(
        &c,
        Method::POST,
        &url,
        &[],
        "{not json",
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&bytes).contains("not valid JSON"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_cache_evicts_and_the_event_stream_says_so() {
    // 40 blocks: room for one ~26-block prompt, not two.
    let w = worker(40).await;
    let c = http::client();
    let events_url = format!("{}/v1/kv_events", w.url());
    let uri: hyper::Uri = events_url.parse().unwrap();
    let raw: hyper_util::client::legacy::Client<_, http_body_util::Empty<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let resp = raw.get(uri).await.unwrap();
    let mut body = resp.into_body();
    use http_body_util::BodyExt;
    let mut lines = Vec::new();
    let mut buf = Vec::new();
    let collect = async {
        for topic in ["alpha", "beta", "gamma"] {
            let body = json!({"model": "mock", "prompt": format!("{topic} {}", "filler text here ".repeat(60)), "max_tokens": 1});
            let (s, v, _) = post_json(&c, &format!("{}/v1/completions", w.url()), &body).await;
            assert_eq!(s, StatusCode::OK, "{v}");
        }
    };
    collect.await;
    let read = async {
        while !lines
            .iter()
            .any(|e: &KvEvent| matches!(e, KvEvent::Removed { .. }))
        {
            let frame = body.frame().await.unwrap().unwrap();
            buf.extend_from_slice(&frame.into_data().unwrap());
            while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                lines.push(serde_json::from_slice(&line).unwrap());
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .expect("a removed event");
    assert!(matches!(lines[0], KvEvent::Snapshot { .. }));
    // The least recently used blocks go first: the first prompt's, tail first (so that
    // what stays cached is still a usable prefix).
    let first_stored = lines.iter().find_map(|e| match e {
        KvEvent::Stored { blocks, .. } => Some(blocks.clone()),
        _ => None,
    });
    let removed = lines.iter().find_map(|e| match e {
        KvEvent::Removed { blocks, .. } => Some(blocks.clone()),
        _ => None,
    });
    let (first_stored, removed) = (first_stored.unwrap(), removed.unwrap());
    let tail: Vec<u64> = first_stored[first_stored.len() - removed.len()..]
        .iter()
        .rev()
        .copied()
        .collect();
    assert_eq!(removed, tail, "{lines:?}");
    let seqs: Vec<u64> = lines.iter().filter_map(KvEvent::seq).collect();
    assert!(seqs.windows(2).all(|p| p[1] == p[0] + 1), "{seqs:?}");
}

/// A `switchyard mock-worker` process at 1000x speed, with `args`.
async fn spawn_worker(args: &[&str]) -> (Proc, String) {
    let mut all = vec!["--speedup", "1000"];
    all.extend_from_slice(args);
    common::procs::mock_worker(&all).await
}

fn hello() -> Value {
    json!({"model": "mock", "prompt": "hello world", "max_tokens": 2})
}

async fn complete(c: &HttpClient, url: &str, limit: Duration) -> Result<StatusCode, String> {
    http::send(
        c,
        Method::POST,
        &format!("{url}/v1/completions"),
        &[],
        hello().to_string(),
        limit,
    )
    .await
    .map(|r| r.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_fault_flag_does_what_it_says() {
    let c = http::client();
    let quick = Duration::from_secs(5);

    // crash after 1: the first request succeeds, the second finds the process gone.
    let (mut p, url) = spawn_worker(&["--fault", "crash", "--fault-after", "1"]).await;
    assert_eq!(complete(&c, &url, quick).await, Ok(StatusCode::OK));
    assert!(complete(&c, &url, quick).await.is_err());
    let status = tokio::task::spawn_blocking(move || p.0.wait().unwrap())
        .await
        .unwrap();
    assert!(!status.success());

    // error: HTTP 500 with an error body as vLLM's (the status as its code).
    let (_p, url) = spawn_worker(&["--fault", "error"]).await;
    let (s, v, _) = post_json(&c, &format!("{url}/v1/completions"), &hello()).await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(v["error"]["code"], 500);
    assert_eq!(v["error"]["message"], "injected fault");

    // refuse after 1: then connections are refused.
    let (_p, url) = spawn_worker(&["--fault", "refuse", "--fault-after", "1"]).await;
    assert_eq!(complete(&c, &url, quick).await, Ok(StatusCode::OK));
    let addr = url.trim_start_matches("http://").to_string();
    let mut refused = false;
    for _ in 0..200 {
        if std::net::TcpStream::connect(&addr).is_err() {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(refused, "connections are refused");

    // hang: no answer.
    let (_p, url) = spawn_worker(&["--fault", "hang"]).await;
    assert_eq!(
        complete(&c, &url, Duration::from_millis(700)).await,
        Err("timed out".to_string())
    );

    // cut_stream: a streaming response breaks off before [DONE].
    let (_p, url) = spawn_worker(&["--fault", "cut-stream"]).await;
    let body = json!({"model": "mock", "prompt": "hello world", "max_tokens": 8, "stream": true});
    let r = http::send(
        &c,
        Method::POST,
        &format!("{url}/v1/completions"),
        &[],
        body.to_string(),
        quick,
    )
    .await;
    match r {
        Err(e) => assert!(e.contains("body failed"), "{e}"),
        Ok((_, _, bytes)) => assert!(!String::from_utf8_lossy(&bytes).contains("[DONE]")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_can_be_switched_at_run_time() {
    let c = http::client();
    let (_p, url) = spawn_worker(&[]).await;
    let set = |fault: &str| {
        let c = c.clone();
        let url = url.clone();
        let fault = fault.to_string();
        async move {
            let (s, v, _) =
                post_json(&c, &format!("{url}/admin/fault"), &json!({"fault": fault})).await;
            assert_eq!(s, StatusCode::OK, "{v}");
        }
    };
    assert_eq!(
        complete(&c, &url, Duration::from_secs(5)).await,
        Ok(StatusCode::OK)
    );
    set("error").await;
    assert_eq!(
        complete(&c, &url, Duration::from_secs(5)).await,
        Ok(StatusCode::INTERNAL_SERVER_ERROR)
    );
    assert_eq!(
        get(&c, &format!("{url}/health")).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    set("none").await;
    assert_eq!(
        complete(&c, &url, Duration::from_secs(5)).await,
        Ok(StatusCode::OK)
    );
    assert_eq!(get(&c, &format!("{url}/health")).await.0, StatusCode::OK);
    let (s, _, _) = post_json(
        &c,
        &format!("{url}/admin/fault"),
        &json!({"fault": "explode"}),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_register_in_etcd_while_running_and_leave_on_a_graceful_stop() {
    let etcd = common::etcd::Etcd::start();
    let config = switchyard::discovery::etcd::EtcdConfig::new(vec![etcd.url()]);
    // Port 0: each worker on a free port of its own (a fixed base port would need the
    // next one free too).
    let p = common::procs::switchyard(&[
        "mock-worker",
        "--listen",
        "127.0.0.1:0",
        "--model",
        "mock",
        "--speedup",
        "1000",
        "--etcd",
        &etcd.url(),
        "--count",
        "2",
        "--ttl",
        "60",
    ]);
    let mut found = Vec::new();
    for _ in 0..400 {
        found = switchyard::discovery::etcd::list_all(&config)
            .await
            .unwrap()
            .0;
        if found.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(found.len(), 2);
    assert!(found.iter().all(|i| {
        i.model == "mock"
            && i.events_url
                .as_deref()
                .is_some_and(|u| u.ends_with("/v1/kv_events"))
    }));
    let pid = p.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let mut p = p;
    let status = tokio::task::spawn_blocking(move || p.0.wait().unwrap())
        .await
        .unwrap();
    assert!(status.success());
    // The 60 s lease was revoked, not left to expire.
    assert!(
        switchyard::discovery::etcd::list_all(&config)
            .await
            .unwrap()
            .0
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoints_other_routers_probe_answer_with_the_workers_own_figures() {
    let w = worker(4096).await;
    let c = http::client();
    let (status, body) = get(&c, &format!("{}/get_server_info", w.url())).await;
    assert_eq!(status, StatusCode::OK);
    let info: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(info["page_size"], 16, "{info}");
    assert_eq!(info["max_total_num_tokens"], 4096 * 16, "{info}");
    for path in [
        "/server_info",
        "/get_model_info",
        "/model_info",
        "/version",
        "/v1/loads",
    ] {
        let (status, body) = get(&c, &format!("{}{path}", w.url())).await;
        assert_eq!(status, StatusCode::OK, "{path}");
        serde_json::from_slice::<Value>(&body).unwrap_or_else(|e| panic!("{path}: {e}"));
    }

    // /tokenize gives the very tokens the engine caches: the usage of a completion with
    // the same prompt counts as many.
    let prompt = long_prompt("tokens");
    let (status, tok, _) = post_json(
        &c,
        &format!("{}/tokenize", w.url()),
        &json!({"prompt": prompt}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{tok}");
    let (_, done, _) = post_json(
        &c,
        &format!("{}/v1/completions", w.url()),
        &json!({"model": "mock", "prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(tok["count"], done["usage"]["prompt_tokens"], "{tok} {done}");
    assert_eq!(
        tok["tokens"].as_array().unwrap().len() as u64,
        tok["count"].as_u64().unwrap()
    );

    // Chat render: the rendered prompt and its tokens; a render without messages is a 400.
    let messages = json!([{"role": "user", "content": "hello there"}]);
    let (status, r, _) = post_json(
        &c,
        &format!("{}/v1/chat/completions/render", w.url()),
        &json!({"messages": messages}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{r}");
    assert!(r["prompt"].as_str().unwrap().contains("hello there"), "{r}");
    assert_eq!(
        r["prompt_token_ids"].as_array().unwrap().len() as u64,
        r["count"].as_u64().unwrap()
    );
    let (status, _, _) = post_json(
        &c,
        &format!("{}/v1/chat/completions/render", w.url()),
        &json!({"prompt": "no messages"}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_route_reads_a_large_body_first_so_the_connection_stays_usable() {
    let w = worker(4096).await;
    let c = http::client();
    let big = "x".repeat(60_000);
    for round in 0..5 {
        // Same pooled client: a connection closed under it would fail the next request.
        let (status, _, body) = http::send(
            &c,
            Method::POST,
            &format!("{}/v1/no-such-route", w.url()),
            &[("content-type", "application/json")],
            big.clone(),
            Duration::from_secs(10),
        )
        .await
        .unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert!(String::from_utf8_lossy(&body).contains("no such route"));
        let (status, _) = get(&c, &format!("{}/health", w.url())).await;
        assert_eq!(status, StatusCode::OK, "round {round}");
    }
}

/// A word-level `tokenizer.json`: a few words, everything else `[UNK]`.
fn word_tokenizer(dir: &std::path::Path) -> String {
    let json = r#"{
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "unk_token": "[UNK]",
                  "vocab": {"[UNK]": 0, "the": 1, "report": 2, "covers": 3, "revenue": 4, "costs": 5, "question": 6}}
    }"#;
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, json).unwrap();
    path.to_string_lossy().into_owned()
}

/// Sends 40 prompts sharing a long prefix through `router`; returns the tokens the worker
/// reported cached and the router's count of cache hits it did not predict.
async fn shared_prefix_traffic(c: &HttpClient, router: &str) -> (u64, f64) {
    let prefix = "the report covers revenue and costs ".repeat(20);
    let mut cached = 0;
    for i in 0..40 {
        let (s, v, _) = post_json(
            c,
            &format!("{router}/v1/completions"),
            &json!({"model": "mock", "prompt": format!("{prefix} question {i}"), "max_tokens": 1}),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        cached += v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        // Let the worker's KV events reach the router before the next request.
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let unpredicted =
        common::router::metric(c, router, "switchyard_unpredicted_cache_hits_total", "").await;
    (cached, unpredicted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_tokenizing_unlike_its_workers_says_so_and_the_same_tokenizer_fixes_it() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = word_tokenizer(dir.path());
    let c = http::client();
    // Workers cut prompts with the model's tokenizer.json; the first router does not.
    let (_w1, worker1) = common::procs::mock_worker(&["--tokenizer", &tokenizer]).await;
    let (_r1, blind) = common::procs::serve(&[
        "--worker",
        &worker1,
        "--model",
        "mock",
        "--kv-events",
        "true",
    ])
    .await;
    let (cached, unpredicted) = shared_prefix_traffic(&c, &blind).await;
    assert!(cached > 0, "the worker reuses its cache");
    assert!(
        unpredicted >= f64::from(switchyard::router::UNPREDICTED_STREAK),
        "{unpredicted} unpredicted cache hits"
    );
    // Given the workers' tokenizer, the router predicts what the worker finds.
    let (_w2, worker2) = common::procs::mock_worker(&["--tokenizer", &tokenizer]).await;
    let (_r2, seeing) = common::procs::serve(&[
        "--worker",
        &worker2,
        "--model",
        "mock",
        "--kv-events",
        "true",
        "--tokenizer",
        &tokenizer,
    ])
    .await;
    let (cached, unpredicted) = shared_prefix_traffic(&c, &seeing).await;
    assert!(cached > 0);
    assert_eq!(unpredicted, 0.0);
}

/// The load a mock reports, read from each place a router reads it: vLLM's `/metrics`
/// (through the official Prometheus parser), SGLang's `/v1/loads` and `/get_load`.
struct Reported {
    kv_usage: f64,
    prefix_queries: f64,
    prefix_hits: f64,
    token_usage: f64,
    num_used_tokens: u64,
    num_tokens: u64,
}

async fn reported(c: &HttpClient, w: &MockWorker) -> Reported {
    let (_, page) = get(c, &format!("{}/metrics", w.url())).await;
    let samples = common::prom::parse(&String::from_utf8_lossy(&page));
    let sample = |name: &str| {
        samples
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name} in /metrics"))
            .value
    };
    let (_, loads) = get(c, &format!("{}/v1/loads", w.url())).await;
    let loads: Value = serde_json::from_slice(&loads).unwrap();
    let (_, legacy) = get(c, &format!("{}/get_load", w.url())).await;
    let legacy: Value = serde_json::from_slice(&legacy).unwrap();
    Reported {
        kv_usage: sample("vllm:kv_cache_usage_perc"),
        prefix_queries: sample("vllm:prefix_cache_queries_total"),
        prefix_hits: sample("vllm:prefix_cache_hits_total"),
        token_usage: loads["loads"][0]["token_usage"].as_f64().unwrap(),
        num_used_tokens: loads["loads"][0]["num_used_tokens"].as_u64().unwrap(),
        num_tokens: legacy[0]["num_tokens"].as_u64().unwrap(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_full_of_finished_requests_reports_no_usage_and_still_counts_its_hits() {
    // 64 blocks of 16 tokens; each prompt takes ~30 blocks, different from its first, so
    // six of them fill the cache and evict.
    let w = worker(64).await;
    let c = http::client();
    let prompt = |i: usize| format!("Request {i}. {}", long_prompt("report"));
    for i in 0..6 {
        let (status, body, _) = post_json(
            &c,
            &format!("{}/v1/completions", w.url()),
            &json!({"model": "mock", "prompt": prompt(i), "max_tokens": 2}),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let s = stats(&c, &w).await;
    assert_eq!(s["running"], 0, "{s}");
    assert!(s["kv_cached_blocks"].as_u64().unwrap() >= 56, "{s}");
    // Nothing runs: the cached blocks are free to evict, and every report says so.
    let idle = reported(&c, &w).await;
    assert_eq!(idle.kv_usage, 0.0);
    assert_eq!(idle.token_usage, 0.0);
    assert_eq!(idle.num_used_tokens, 0);
    assert_eq!(idle.num_tokens, 0);
    assert!(idle.prefix_queries > 0.0);

    // The last prompt again: its blocks are still cached, and the hits count them.
    let (_, again, _) = post_json(
        &c,
        &format!("{}/v1/completions", w.url()),
        &json!({"model": "mock", "prompt": prompt(5), "max_tokens": 2}),
    )
    .await;
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_f64()
        .unwrap();
    let prompt_tokens = again["usage"]["prompt_tokens"].as_f64().unwrap();
    assert!(cached > 0.0, "{again}");
    let after = reported(&c, &w).await;
    assert_eq!(after.prefix_hits - idle.prefix_hits, cached);
    assert_eq!(after.prefix_queries - idle.prefix_queries, prompt_tokens);
    assert_eq!(after.kv_usage, 0.0);
}
