//! What a router reads from an OpenAI-compatible engine, as one JSON value: the same
//! requests sent to a real vLLM engine and to a mock worker must read alike
//! (`tests/vllm.rs`).

use std::time::Duration;

use hyper::StatusCode;
use serde_json::{Value, json};

use super::http::{self, HttpClient, post_json};
use super::vllm::{BLOCK, CONTEXT};

/// What a router reads from an OpenAI server `base` serving `model`: defaults, chunk
/// shapes, errors, the cache's report. Text and IDs are left out (the mock's words are
/// its own); their shape is kept.
pub async fn observe(c: &HttpClient, base: &str, model: &str) -> Value {
    let chat_url = format!("{base}/v1/chat/completions");
    let comp_url = format!("{base}/v1/completions");
    let (_, models) = http::get(c, &format!("{base}/v1/models")).await;
    let models: Value = serde_json::from_slice(&models).unwrap();
    let m = &models["data"][0];
    let chat_body = |extra: Value| {
        let mut v =
            json!({"model": model, "messages": [{"role": "user", "content": "Hello there"}]});
        v.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        v
    };
    // Defaults: a chat runs to the end of the context; a completion gives 16.
    let (_, chat_default, _) = post_json(c, &chat_url, &chat_body(json!({}))).await;
    let u = &chat_default["usage"];
    let (_, comp_default, _) = post_json(
        c,
        &comp_url,
        &json!({"model": model, "prompt": "Hello there"}),
    )
    .await;
    let (_, both, _) = post_json(
        c,
        &chat_url,
        &chat_body(json!({"max_completion_tokens": null, "max_tokens": 5})),
    )
    .await;
    // Streams, with the token IDs and the usage.
    let shapes = |events: &[String]| -> Vec<String> {
        events
            .iter()
            .map(|e| {
                if e == "[DONE]" {
                    return "done".to_string();
                }
                let v: Value = serde_json::from_str(e).unwrap();
                let mut kind = Vec::new();
                if v.get("prompt_token_ids").is_some_and(|p| p.is_array()) {
                    kind.push("prompt_ids".to_string());
                }
                match v["choices"].get(0) {
                    None => kind.push("no_choice".into()),
                    Some(ch) => {
                        if ch["delta"].get("role").is_some() {
                            kind.push(format!("role{}", ch["delta"]["content"]));
                        } else if ch["delta"]["content"].is_string() || ch["text"].is_string() {
                            kind.push("text".into());
                        }
                        if let Some(ids) = ch["token_ids"].as_array() {
                            kind.push(format!("ids{}", ids.len()));
                        }
                        if ch.get("prompt_token_ids").is_some_and(|p| p.is_array()) {
                            kind.push("choice_prompt_ids".into());
                        }
                        if let Some(f) = ch["finish_reason"].as_str() {
                            kind.push(f.into());
                        }
                    }
                }
                if v["usage"].is_object() {
                    kind.push(format!("usage{}", v["usage"]["completion_tokens"]));
                }
                kind.join("+")
            })
            .collect()
    };
    let streamed = |body: Value, to: String| {
        let c = c.clone();
        async move {
            let (status, _, bytes) = http::send(
                &c,
                hyper::Method::POST,
                &to,
                &[("content-type", "application/json")],
                body.to_string(),
                Duration::from_secs(60),
            )
            .await
            .unwrap();
            assert_eq!(status, StatusCode::OK);
            http::sse_events(&bytes)
        }
    };
    let s = json!({"max_tokens": 3, "stream": true, "return_token_ids": true, "stream_options": {"include_usage": true}});
    let chat_stream = streamed(chat_body(s.clone()), chat_url.clone()).await;
    let mut comp = json!({"model": model, "prompt": "Hello there"});
    comp.as_object_mut()
        .unwrap()
        .extend(s.as_object().unwrap().clone());
    let comp_stream = streamed(comp, comp_url.clone()).await;
    // Several tokens a chunk (vLLM's `stream_interval`, as with speculative decoding):
    // the first token alone, then three at a time, the rest with the finish.
    let batched = json!({"model": model, "prompt": "Hello there", "max_tokens": 8, "stream": true, "return_token_ids": true, "stream_interval": 3});
    let batched_stream = streamed(batched, comp_url.clone()).await;
    let mut plain = chat_body(json!({"max_tokens": 2, "stream": true}));
    plain["temperature"] = json!(0);
    let plain_stream = streamed(plain, chat_url.clone()).await;
    // Errors.
    let status = |body: Value, to: String| {
        let c = c.clone();
        async move {
            let (status, v, _) = post_json(&c, &to, &body).await;
            json!([status.as_u16(), v["error"]["code"], v["error"]["param"]])
        }
    };
    let long = "x ".repeat(CONTEXT as usize + 10);
    let errors = json!({
        "max_tokens_over_context": status(chat_body(json!({"max_tokens": CONTEXT * 2})), chat_url.clone()).await,
        "prompt_over_context": status(json!({"model": model, "prompt": long}), comp_url.clone()).await,
        "min_over_max": status(json!({"model": model, "prompt": "x", "max_tokens": 1, "min_tokens": 5}), comp_url.clone()).await,
        "max_tokens_zero": status(json!({"model": model, "prompt": "x", "max_tokens": 0}), comp_url.clone()).await,
        "stream_interval_zero": status(json!({"model": model, "prompt": "x", "stream_interval": 0}), comp_url.clone()).await,
        "unknown_model": status(json!({"model": "nope", "prompt": "x"}), comp_url.clone()).await[0],
    });
    // The prefix cache: a prompt of 2.5 blocks twice; the second finds 2 blocks.
    let ids: Vec<u32> = (0..BLOCK * 5 / 2).map(|i| 1000 + i * 7).collect();
    let prompt = json!({"model": model, "prompt": ids, "max_tokens": 1});
    let before = counters(c, base).await;
    let (_, first, _) = post_json(c, &comp_url, &prompt).await;
    let (_, second, _) = post_json(c, &comp_url, &prompt).await;
    let after = counters(c, base).await;
    json!({
        "models": {"max_model_len": m["max_model_len"], "owned_by": m["owned_by"]},
        "chat_default": {
            "finish_reason": chat_default["choices"][0]["finish_reason"],
            "to_the_end_of_the_context": u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap() == u64::from(CONTEXT),
        },
        "completion_default": comp_default["usage"]["completion_tokens"],
        "max_completion_tokens_null": both["usage"]["completion_tokens"],
        "chat_stream": shapes(&chat_stream),
        "completion_stream": shapes(&comp_stream),
        "plain_chat_stream": shapes(&plain_stream),
        "several_tokens_a_chunk": shapes(&batched_stream),
        "errors": errors,
        "cache": [first["usage"]["prompt_tokens_details"]["cached_tokens"], second["usage"]["prompt_tokens_details"]["cached_tokens"]],
        // The engine's own prefix-cache counters over the two (tokens queried, hit) and
        // its finished requests: what a benchmark reads instead of the answers' usage.
        "counters": [after[0] - before[0], after[1] - before[1], after[2] - before[2]],
    })
}

/// `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total` and
/// `vllm:request_success_total` from `base`'s `/metrics`, each summed over its series (as
/// the replay reads an engine's).
async fn counters(c: &HttpClient, base: &str) -> [f64; 3] {
    let (_, page) = http::get(c, &format!("{base}/metrics")).await;
    let n = switchyard::replay::engines::parse(&String::from_utf8_lossy(&page));
    [n.queries, n.hits, n.finished]
}
