//! Disaggregated fleets, end to end: real mock-worker processes in prefill and decode
//! roles speaking vLLM's and SGLang's handoff protocols, a real router process, real
//! HTTP. A split request must read exactly as the same request served whole by one
//! worker (the mock's text is a function of its context); the prefill worker computes
//! the prompt, the decode worker receives its blocks and generates the answer.

mod common;

use std::time::Duration;

use serde_json::{Value, json};

use common::http::{self, HttpClient};
use common::procs::{Proc, free_port, mock_worker, serve};
use common::router::metric;

/// Long enough that its prefill is worth a handoff under kv-cost's defaults (over 1,000
/// uncached tokens), unique per `i`.
fn long_text(i: usize) -> String {
    let mut s = format!("request {i}: ");
    while s.len() < 9000 {
        s.push_str(&format!(
            "paragraph {} of the report on item {i}. ",
            s.len()
        ));
    }
    s
}

fn body(path: &str, text: &str, stream: bool) -> Value {
    if path == "/v1/chat/completions" {
        json!({"model": "mock", "messages": [{"role": "user", "content": text}],
            "max_tokens": 12, "stream": stream, "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null }})
    } else {
        json!({"model": "mock", "prompt": text, "max_tokens": 12, "stream": stream,
            "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null }})
    }
}

/// What the client read: the answer's text, and its usage (prompt, cached, completion).
#[derive(Debug, PartialEq)]
struct Answer {
    text: String,
    usage: (u64, u64, u64),
}

fn usage_of(u: &Value) -> (u64, u64, u64) {
    (
        u["prompt_tokens"].as_u64().unwrap_or(0),
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
        u["completion_tokens"].as_u64().unwrap_or(0),
    )
}

async fn ask(c: &HttpClient, url: &str, path: &str, body: &Value) -> Answer {
    let stream = body["stream"] == true;
    let (status, json, bytes) = http::post_json(c, &format!("{url}{path}"), body).await;
    assert!(
        status.is_success(),
        "{path} answered {status}: {}",
        String::from_utf8_lossy(&bytes)
    );
    if !stream {
        let choice = &json["choices"][0];
        let text = choice["message"]["content"]
            .as_str()
            .or(choice["text"].as_str())
            .unwrap_or_default()
            .to_string();
        return Answer {
            text,
            usage: usage_of(&json["usage"]),
        };
    }
    let mut text = String::new();
    let mut usage = (0, 0, 0);
    let mut done = false;
    for event in http::sse_events(&bytes) {
        if event == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(&event).unwrap();
        assert!(v.get("error").is_none(), "an error event: {event}");
        if let Some(choice) = v["choices"].get(0) {
            text.push_str(
                choice["delta"]["content"]
                    .as_str()
                    .or(choice["text"].as_str())
                    .unwrap_or_default(),
            );
        }
        if v["usage"].is_object() {
            usage = usage_of(&v["usage"]);
        }
    }
    assert!(done, "the stream ends with [DONE]");
    Answer { text, usage }
}

/// The engine counters of a mock worker.
async fn stats(c: &HttpClient, url: &str) -> Value {
    let (_, body) = http::get(c, &format!("{url}/stats")).await;
    serde_json::from_slice(&body).unwrap()
}

const SPEED: &[&str] = &["--speedup", "50"];

/// Mock workers of `role` in `protocol`, `n` of them (SGLang prefill workers with a
/// bootstrap port each); `extra` flags for the first.
async fn workers(
    n: usize,
    role: &str,
    protocol: &str,
    first_extra: &[&str],
) -> Vec<(Proc, String, String)> {
    let mut out = Vec::new();
    for i in 0..n {
        let mut args: Vec<String> = ["--role", role, "--pd-protocol", protocol]
            .iter()
            .chain(SPEED)
            .map(|s| s.to_string())
            .collect();
        let mut spec_suffix = format!("#role={role}");
        if role == "prefill" && protocol == "sglang" {
            let port = free_port();
            args.extend(["--bootstrap-port".to_string(), port.to_string()]);
            spec_suffix.push_str(&format!("&bootstrap_port={port}"));
        }
        if i == 0 {
            args.extend(first_extra.iter().map(|s| s.to_string()));
        }
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let (p, url) = mock_worker(&refs).await;
        let spec = format!("{url}{spec_suffix}");
        out.push((p, url, spec));
    }
    out
}

/// A router in front of `fleet` with `extra` flags.
async fn router(fleet: &[&(Proc, String, String)], extra: &[&str]) -> (Proc, String) {
    let mut args: Vec<&str> = vec!["--model", "mock"];
    for (_, _, spec) in fleet {
        args.extend(["--worker", spec.as_str()]);
    }
    args.extend_from_slice(extra);
    serve(&args).await
}

/// Every request shape: chat and completions, streamed and not.
const SHAPES: [(&str, bool); 4] = [
    ("/v1/chat/completions", false),
    ("/v1/chat/completions", true),
    ("/v1/completions", false),
    ("/v1/completions", true),
];

/// Both protocols: each shape through the router reads as one aggregated worker's answer;
/// the prefill workers computed the prompts (one token each), the decode workers received
/// every full block and generated the answers.
async fn split_requests_read_as_whole_ones(protocol: &str) {
    let c = http::client();
    let (_whole, whole_url) = mock_worker(SPEED).await;
    let prefill = workers(2, "prefill", protocol, &[]).await;
    let decode = workers(2, "decode", protocol, &[]).await;
    let fleet: Vec<_> = prefill.iter().chain(&decode).collect();
    let (_router, url) = router(
        &fleet,
        &["--policy-config", r#"{"max_local_prefill_tokens": 0}"#],
    )
    .await;
    for (i, (path, stream)) in SHAPES.iter().enumerate() {
        let b = body(path, &long_text(i), *stream);
        let expected = ask(&c, &whole_url, path, &b).await;
        let got = ask(&c, &url, path, &b).await;
        assert_eq!(got.text, expected.text, "{path} stream={stream}");
        let (prompt, cached, completion) = got.usage;
        assert_eq!(
            (prompt, completion),
            (expected.usage.0, 12),
            "{path} stream={stream}"
        );
        assert_eq!(
            cached,
            prompt / 16 * 16,
            "the decode worker received every full block ({path} stream={stream})"
        );
    }
    let mut prefilled = 0;
    let mut prefill_tokens = 0;
    for (_, u, _) in &prefill {
        let s = stats(&c, u).await;
        prefilled += s["finished"].as_u64().unwrap();
        prefill_tokens += s["prefill_tokens"].as_u64().unwrap();
        assert_eq!(
            s["generated_tokens"], s["finished"],
            "a prefill worker generates one token per request"
        );
    }
    assert_eq!(prefilled, 4, "every request was prefilled once");
    assert!(prefill_tokens > 4 * 1000, "the prompts were computed there");
    let mut generated = 0;
    for (_, u, _) in &decode {
        let s = stats(&c, u).await;
        generated += s["generated_tokens"].as_u64().unwrap();
        assert!(
            s["prefill_tokens"].as_u64().unwrap() <= 4 * 16,
            "a decode worker computes at most each prompt's partial block: {s}"
        );
    }
    assert_eq!(
        generated,
        4 * 12,
        "the decode workers generated the answers"
    );
    assert_eq!(
        metric(&c, &url, "switchyard_split_requests_total", "").await,
        4.0
    );
    for (role, n) in [("prefill", 2.0), ("decode", 2.0), ("both", 0.0)] {
        let label = format!("role=\"{role}\"");
        assert_eq!(
            metric(&c, &url, "switchyard_instance_role", &label).await,
            n,
            "/metrics shows each worker's role"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_split_requests_read_as_whole_ones() {
    split_requests_read_as_whole_ones("vllm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_split_requests_read_as_whole_ones() {
    split_requests_read_as_whole_ones("sglang").await;
}

/// Conditional disaggregation: under kv-cost's defaults a short prompt runs on a decode
/// worker alone (vLLM's handoff allows it), a long one is split; with SGLang's, whose
/// decode workers cannot serve alone, even a short one is split.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_prompts_stay_on_the_decode_worker_where_the_protocol_allows() {
    let c = http::client();
    for protocol in ["vllm", "sglang"] {
        let prefill = workers(1, "prefill", protocol, &[]).await;
        let decode = workers(1, "decode", protocol, &[]).await;
        let fleet: Vec<_> = prefill.iter().chain(&decode).collect();
        let (_router, url) = router(&fleet, &[]).await;
        let short = body("/v1/completions", "a short question", false);
        ask(&c, &url, "/v1/completions", &short).await;
        let split = metric(&c, &url, "switchyard_split_requests_total", "").await;
        match protocol {
            "vllm" => assert_eq!(split, 0.0, "a short prompt is not split"),
            _ => assert_eq!(split, 1.0, "SGLang's decode workers need a prefill worker"),
        }
        let long = body("/v1/completions", &long_text(99), false);
        ask(&c, &url, "/v1/completions", &long).await;
        let split_after = metric(&c, &url, "switchyard_split_requests_total", "").await;
        assert_eq!(
            split_after,
            split + 1.0,
            "a long prompt is split ({protocol})"
        );
    }
}

/// A prefill worker that dies mid-handoff costs the client nothing: the request is placed
/// again on the other prefill worker, and the dead one leaves the fleet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_killed_mid_handoff_is_replaced() {
    let c = http::client();
    for protocol in ["vllm", "sglang"] {
        let prefill = workers(2, "prefill", protocol, &["--fault", "crash"]).await;
        let decode = workers(1, "decode", protocol, &[]).await;
        let fleet: Vec<_> = prefill.iter().chain(&decode).collect();
        // round-robin: the crashing worker's turn comes within two requests.
        let (_router, url) = router(&fleet, &["--policy", "round-robin"]).await;
        for i in 0..4 {
            for (path, stream) in [("/v1/chat/completions", true), ("/v1/completions", false)] {
                let b = body(path, &long_text(i), stream);
                let got = ask(&c, &url, path, &b).await;
                assert_eq!(got.usage.2, 12, "{protocol}: the whole answer");
            }
        }
        assert!(
            metric(&c, &url, "switchyard_prefill_leg_failures_total", "").await >= 1.0,
            "{protocol}: the crashing prefill worker was tried"
        );
        let s = stats(&c, &prefill[1].1).await;
        assert_eq!(
            s["finished"], 8,
            "{protocol}: the survivor prefilled every request"
        );
    }
}

/// A decode worker that fails before its first token is replaced by another; with vLLM's
/// handoff the prefill is not run again (the prefill worker kept it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_decode_worker_is_replaced_and_vllm_keeps_the_prefill() {
    let c = http::client();
    for protocol in ["vllm", "sglang"] {
        let prefill = workers(1, "prefill", protocol, &[]).await;
        let decode = workers(2, "decode", protocol, &["--fault", "error"]).await;
        let fleet: Vec<_> = prefill.iter().chain(&decode).collect();
        let (_router, url) = router(&fleet, &["--policy", "round-robin"]).await;
        let n = 4u64;
        for i in 0..n as usize {
            let b = body("/v1/completions", &long_text(i), true);
            let got = ask(&c, &url, "/v1/completions", &b).await;
            assert_eq!(got.usage.2, 12, "{protocol}: the whole answer");
        }
        assert!(
            metric(&c, &url, "switchyard_upstream_failures_total", "").await >= 1.0,
            "{protocol}: the failing decode worker was tried"
        );
        let prefilled = stats(&c, &prefill[0].1).await["finished"].as_u64().unwrap();
        match protocol {
            "vllm" => assert_eq!(
                prefilled, n,
                "the prefill is kept for the next decode worker"
            ),
            _ => assert!(
                prefilled > n,
                "a room serves one handoff: SGLang's prefill re-runs"
            ),
        }
    }
}

/// SGLang's handoff: a decode worker that fails after its prefill leg has answered (the
/// prefill worker was quicker) is replaced like any failing decode worker; the answered
/// leg is not waited on again (which once took down the client's connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_leg_failing_after_its_prefill_answered_is_replaced() {
    let c = http::client();
    let prefill = workers(1, "prefill", "sglang", &[]).await;
    let decode = workers(
        2,
        "decode",
        "sglang",
        &["--fault", "error", "--first-token-delay-ms", "400"],
    )
    .await;
    // It presents itself as SGLang, as SGLang does (SMG tells the engines' handoffs
    // apart by `owned_by`).
    let (_, models) = http::get(&c, &format!("{}/v1/models", prefill[0].1)).await;
    let models: Value = serde_json::from_slice(&models).unwrap();
    assert_eq!(models["data"][0]["owned_by"], "sglang");
    let fleet: Vec<_> = prefill.iter().chain(&decode).collect();
    let (_router, url) = router(&fleet, &["--policy", "round-robin"]).await;
    for i in 0..4 {
        for stream in [false, true] {
            let b = body("/v1/completions", &long_text(i), stream);
            let got = ask(&c, &url, "/v1/completions", &b).await;
            assert_eq!(
                got.usage.2, 12,
                "the whole answer, from the other decode worker"
            );
        }
    }
    assert!(
        metric(&c, &url, "switchyard_upstream_failures_total", "").await >= 1.0,
        "the failing decode worker was tried"
    );
}

/// A policy built against switchyard:policy@0.2.0 knows nothing of roles: the router asks
/// it once among the prefill workers and once among the decode workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_built_for_an_older_contract_places_split_requests() {
    let c = http::client();
    let prefill = workers(1, "prefill", "vllm", &[]).await;
    let decode = workers(1, "decode", "vllm", &[]).await;
    let fleet: Vec<_> = prefill.iter().chain(&decode).collect();
    let old = common::guest("built_for_0_2");
    let (_router, url) = router(&fleet, &["--policy", old.to_str().unwrap()]).await;
    for i in 0..2 {
        let b = body("/v1/chat/completions", &long_text(i), false);
        assert_eq!(ask(&c, &url, "/v1/chat/completions", &b).await.usage.2, 12);
    }
    assert_eq!(
        metric(&c, &url, "switchyard_split_requests_total", "").await,
        2.0
    );
    assert_eq!(
        metric(&c, &url, "switchyard_policy_fallbacks_total", "").await,
        0.0,
        "the old policy decided, not the fallback"
    );
}

/// The mock's handoff is bounded: a decode request naming a handoff nobody computed is
/// recomputed (vLLM) or refused (SGLang) within the wait, never hung forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_without_its_prefill_recomputes_or_refuses() {
    let c = http::client();
    let (_p, purl) = mock_worker(&["--role", "prefill"]).await;
    let (_d, durl) = mock_worker(&["--role", "decode"]).await;
    let port = purl.rsplit_once(':').unwrap().1;
    let b = json!({"model": "mock", "prompt": "hello there", "max_tokens": 3,
        "kv_transfer_params": {"do_remote_prefill": true, "remote_host": "127.0.0.1",
            "remote_port": port.parse::<u16>().unwrap(), "remote_request_id": "never-made"}});
    let got = tokio::time::timeout(
        Duration::from_secs(90),
        http::post_json(&c, &format!("{durl}/v1/completions"), &b),
    )
    .await
    .expect("answered within the handoff wait");
    assert!(
        got.0.is_success(),
        "vLLM recomputes: {}",
        String::from_utf8_lossy(&got.2)
    );
    assert_eq!(got.1["usage"]["completion_tokens"], 3);
}

/// The router's KV view of a split: the prefill worker's events and the decode worker's
/// (it stores the blocks it receives) both show the prompt, so the conversation's next
/// turn finds its prefix on either; `explain` shows the roles and the split.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_workers_of_a_split_hold_the_prompt_in_the_routers_view() {
    use common::router::{TOKEN, eventually};
    let c = http::client();
    let prefill = workers(1, "prefill", "vllm", &[]).await;
    let decode = workers(1, "decode", "vllm", &[]).await;
    let fleet: Vec<_> = prefill.iter().chain(&decode).collect();
    let (_router, url) = router(
        &fleet,
        &[
            "--kv-events",
            "true",
            "--admin-token",
            TOKEN,
            "--policy-config",
            r#"{"max_local_prefill_tokens": 0}"#,
        ],
    )
    .await;
    let b = body("/v1/completions", &long_text(7), false);
    ask(&c, &url, "/v1/completions", &b).await;
    let explain = format!("{url}/admin/endpoints/default/mock/generate/explain");
    let view = || async {
        let (status, _, bytes) = http::send(
            &c,
            hyper::Method::POST,
            &explain,
            &[
                ("authorization", &format!("Bearer {TOKEN}")),
                ("content-type", "application/json"),
            ],
            b.to_string(),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
        assert!(status.is_success(), "{}", String::from_utf8_lossy(&bytes));
        serde_json::from_slice::<Value>(&bytes).unwrap()
    };
    eventually("both workers' events to show the prompt", || async {
        let v = view().await;
        let blocks = v["prompt_blocks"].as_u64().unwrap();
        let rows = v["candidates"].as_array().unwrap().clone();
        rows.len() == 2
            && rows
                .iter()
                .all(|r| r["overlap_blocks"].as_u64() == Some(blocks))
    })
    .await;
    let v = view().await;
    let mut roles: Vec<&str> = v["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["role"].as_str().unwrap())
        .collect();
    roles.sort();
    assert_eq!(roles, ["decode", "prefill"]);
    // Both hold the whole prompt: kv-cost runs it on the decode worker alone.
    assert!(v["prefill"].is_null(), "{v}");
    assert_eq!(
        v["chosen"].as_str().map(|id| id.is_empty()),
        Some(false),
        "{v}"
    );
}
