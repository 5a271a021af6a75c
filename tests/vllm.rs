//! The router in front of real vLLM engines (CPU, the tiny model of `tools/tiny-model.py`,
//! installed by `tools/vllm.sh`), and the mock worker held to what they do.
//!
//! One test, in stages, on one fleet of two engines (each takes about a minute to start
//! on these machines; starting them once keeps the suite within a few minutes):
//! 1. conformance: the same requests to a vLLM engine and to a mock worker of the same
//!    shape, compared as a router reads them (defaults, chunk shapes, errors, cache);
//! 2. the router, started after the engines, catches up on their caches from their
//!    replay sockets; it learns the engines' context from `/v1/models`, treats their 400s as
//!    the requests' own, routes a conversation's turns to the engine that caches it (the
//!    engines' own `cached_tokens`), mirrors their KV events (stored, and removed when
//!    the engine evicts) and reads their load from `/metrics`, and learns their latency
//!    from it and from whole answers;
//! 3. the two engines as a prefill and a decode worker (vLLM's `NixlConnector`): split
//!    requests answer as whole ones, `min_tokens` included, and a streamed one whose
//!    decode leg the router asked for token IDs shows the client none;
//! 4. a greedy streaming chat with no `max_tokens` whose engine is killed -9 mid-answer
//!    is as long as the uninterrupted answer, with the same text, one finish and one
//!    `[DONE]`: continued at the token level from the IDs the router asked the engine
//!    for itself, none of which the client sees; the same with the client's own
//!    `return_token_ids` (the same token IDs) for a chat continuing its own message into
//!    a token streamed with no text;
//! 5. the killed engine restarted: back in the fleet, its cache mirrored afresh.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use serde_json::{Value, json};

use common::conformance::observe;
use common::http::{self, HttpClient, post_json};
use common::procs::{mock_worker, serve};
use common::router::{TOKEN, admin_post, eventually, instances_of, metric};
use common::vllm::{BLOCK, CONTEXT, KV_BLOCKS, MODEL, Vllm, chain, model_dir};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vllm_engines_behind_the_router() {
    if common::vllm::no_vllm() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let c = http::client();
    let tokenizer = model_dir().join("tokenizer.json");
    let tokenizer = tokenizer.to_str().unwrap();
    let mut a = Vllm::spawn(0, dir.path());
    let mut b = Vllm::spawn(1, dir.path());
    let (_mock, mock) = mock_worker(&[
        "--block-size",
        &BLOCK.to_string(),
        "--kv-blocks",
        &KV_BLOCKS.to_string(),
        "--max-model-len",
        &CONTEXT.to_string(),
        "--tokenizer",
        tokenizer,
    ])
    .await;
    a.ready(&c).await;
    b.ready(&c).await;

    stage("conformance");
    let engine = observe(&c, &a.url(), MODEL).await;
    let simulated = observe(&c, &mock, "mock").await;
    assert_eq!(
        simulated, engine,
        "the mock worker differs from vLLM:\nmock: {simulated:#}\nvLLM: {engine:#}"
    );

    stage("router");
    let (_router, url) = router(
        tokenizer,
        &[
            "--admin-token",
            TOKEN,
            "--worker",
            &a.worker_arg(),
            "--worker",
            &b.worker_arg(),
        ],
    )
    .await;
    eventually(
        "both engines available, mirrored from their events",
        || async {
            let v = instances_of(&c, &url, MODEL).await;
            v["instances"].as_array().unwrap().iter().all(|i| {
                i["available"] == true && i["cache_view"] == "events" && i["cache_blocks"].is_u64()
            })
        },
    )
    .await;
    // Started late: what engine `a` cached while answering the conformance requests
    // came from its replay socket; `b` has answered nothing.
    let (a_url, b_url) = (a.url(), b.url());
    eventually("engine a's earlier blocks, replayed", || async {
        instance(&c, &url, &a_url).await["cached_blocks"]
            .as_u64()
            .is_some_and(|n| n >= 2)
    })
    .await;
    assert_eq!(instance(&c, &url, &b_url).await["cached_blocks"], 0);
    context_and_errors(&c, &url).await;
    prefix_routing(&c, &url, &a, &b).await;
    eviction_and_load(&c, &url, &a, &b).await;
    whole_answers_teach_the_model(&c, &url).await;

    stage("disaggregated");
    disaggregated(&c, &a, &b, tokenizer).await;

    stage("migration");
    migration_without_max_tokens(&c, &url, &mut a, &mut b).await;
    drop(dir);
}

/// Whole (non-streamed) answers teach an engine's latency model from what vLLM reports:
/// the time per token from its `/metrics` (`vllm:inter_token_latency_seconds`) and each
/// answer's first token inferred from its duration, so that whole answers are predicted
/// and compared (the router never sees their first token).
async fn whole_answers_teach_the_model(c: &HttpClient, url: &str) {
    let mut round = 0;
    eventually("whole answers predicted and compared on an engine", || {
        round += 1;
        async move {
            for i in 0..4 {
                let prompt = format!("a whole answer, round {round}, request {i}");
                let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 8});
                let (status, v, _) = post_json(c, &format!("{url}/v1/completions"), &body).await;
                assert_eq!(status, StatusCode::OK, "{v}");
            }
            let v = instances_of(c, url, MODEL).await;
            v["instances"].as_array().unwrap().iter().any(|i| {
                let m = &i["latency_model"];
                m["samples"]["tpot"].as_u64() > Some(0)
                    && m["tpot_ms_base"].as_f64().is_some_and(|t| t > 0.0)
                    && m["error"]["e2e"]["predictions"].as_u64() > Some(0)
            })
        }
    })
    .await;
}

/// A router for the engines' model (their block size and tokenizer) with `extra` flags.
async fn router(tokenizer: &str, extra: &[&str]) -> (common::procs::Proc, String) {
    let block = BLOCK.to_string();
    let mut args = vec![
        "--model",
        MODEL,
        "--block-size",
        &block,
        "--tokenizer",
        tokenizer,
    ];
    args.extend_from_slice(extra);
    serve(&args).await
}

fn stage(name: &str) {
    eprintln!("--- {name}");
}

async fn instance(c: &HttpClient, router: &str, engine: &str) -> Value {
    common::router::instance_of(c, router, MODEL, engine).await
}

/// A chat of one user message.
fn chat(content: &str) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0})
}

/// The router knows the engines' context (their `/v1/models`); an engine's 400 is the
/// request's, and passes to the client without costing the engine anything.
async fn context_and_errors(c: &HttpClient, url: &str) {
    let long = "x ".repeat(CONTEXT as usize + 10);
    let (status, v, _) = post_json(c, &format!("{url}/v1/chat/completions"), &chat(&long)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("context is {CONTEXT} tokens")),
        "{message}"
    );
    let mut too_long = chat("hi");
    too_long["max_tokens"] = json!(CONTEXT * 2);
    let mut min_over = chat("hi");
    min_over["max_tokens"] = json!(2);
    min_over["min_tokens"] = json!(5);
    for body in [too_long, min_over] {
        for _ in 0..3 {
            let (status, v, _) = post_json(c, &format!("{url}/v1/chat/completions"), &body).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
            assert_eq!(v["error"]["code"], 400, "the engine's own error: {v}");
        }
    }
    let v = instances_of(c, url, MODEL).await;
    for i in v["instances"].as_array().unwrap() {
        assert_eq!(i["available"], true, "{i}");
        assert_eq!(
            i["consecutive_failures"], 0,
            "a bad request is not a bad worker: {i}"
        );
    }
    // The engines' own pages give their load (vLLM's gauges, as this vLLM writes them).
    let read = metric(c, url, "switchyard_engine_pages_total", "result=\"read\"").await;
    assert!(read >= 1.0, "no engine /metrics page read");
}

/// Conversations' second turns go to the engine that holds their first: the engines'
/// own `cached_tokens` say so, and the router counted the prompt as they did.
async fn prefix_routing(c: &HttpClient, url: &str, a: &Vllm, b: &Vllm) {
    let hits_before = a.metric(c, "vllm:prefix_cache_hits_total").await
        + b.metric(c, "vllm:prefix_cache_hits_total").await;
    let (words, _) = chain();
    for conv in 0..6 {
        let system: String = (0..90)
            .map(|i| words[(conv * 7 + i) % words.len()].as_str())
            .collect();
        let first = json!({"model": MODEL, "temperature": 0, "max_tokens": 8, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": format!("question {conv}")}]});
        let (status, v, _) = post_json(c, &format!("{url}/v1/chat/completions"), &first).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        let answer = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        let mut second = first.clone();
        let messages = second["messages"].as_array_mut().unwrap();
        messages.push(json!({"role": "assistant", "content": answer}));
        messages.push(json!({"role": "user", "content": "and then?"}));
        let (_, explained, _) = admin_post(
            c,
            &format!("{url}/admin/endpoints/default/tiny/generate/explain"),
            &second,
        )
        .await;
        let (status, v, _) = post_json(c, &format!("{url}/v1/chat/completions"), &second).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        let usage = &v["usage"];
        assert_eq!(
            usage["prompt_tokens"], explained["prompt_tokens"],
            "the router tokenizes the chat as the engine does"
        );
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(
            cached >= u64::from(BLOCK) * 3,
            "conversation {conv}: the second turn found {cached} tokens cached: {v}"
        );
    }
    let hits = a.metric(c, "vllm:prefix_cache_hits_total").await
        + b.metric(c, "vllm:prefix_cache_hits_total").await;
    assert!(
        hits - hits_before >= f64::from(BLOCK) * 18.0,
        "{hits_before} -> {hits}"
    );
}

/// The engine's evictions reach the router's view (vLLM's `removed` events), and its
/// load comes from its `/metrics`.
async fn eviction_and_load(c: &HttpClient, url: &str, a: &Vllm, b: &Vllm) {
    let (words, _) = chain();
    // A prompt of 8 blocks, cached on the engine it went to.
    let prompt = |k: usize| -> String {
        (0..8 * BLOCK as usize)
            .map(|i| words[(k * 13 + i) % words.len()].as_str())
            .collect()
    };
    let first = json!({"model": MODEL, "prompt": prompt(0), "max_tokens": 1});
    let explain = format!("{url}/admin/endpoints/default/tiny/generate/explain");
    let (status, v, _) = post_json(c, &format!("{url}/v1/completions"), &first).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let overlap = || async {
        let (_, e, _) = admin_post(c, &explain, &first).await;
        e["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["overlap_blocks"].as_u64().unwrap())
            .max()
            .unwrap()
    };
    eventually(
        "the prompt's blocks stored in the router's view",
        || async { overlap().await >= 7 },
    )
    .await;
    // Fill both engines' caches (64 blocks each) with other prompts, straight to the
    // engines: the first prompt's blocks are evicted.
    for k in 1..=12 {
        for e in [a, b] {
            let body = json!({"model": MODEL, "prompt": prompt(k), "max_tokens": 1});
            let (status, v, _) = post_json(c, &format!("{}/v1/completions", e.url()), &body).await;
            assert_eq!(status, StatusCode::OK, "{v}");
        }
    }
    eventually(
        "the evicted blocks removed from the router's view",
        || async { overlap().await == 0 },
    )
    .await;

    // Load: a long answer running on an engine shows in the router's view of it.
    let body = json!({"model": MODEL, "prompt": "x", "max_tokens": 600, "stream": true});
    let req = Request::post(format!("{url}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    eventually("an engine's reported running request", || async {
        let v = instances_of(c, url, MODEL).await;
        v["instances"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["reported_running"] == 1)
    })
    .await;
    drop(resp);
}

/// The two engines as a prefill and a decode worker (vLLM's `NixlConnector`, moving KV
/// in host memory), behind a router that splits every request: the answer is the one a
/// whole engine gives, the prefill leg computed the prompt, the decode leg pulled it;
/// a request with `min_tokens` is split too (the prefill leg must not carry it: vLLM
/// refuses a minimum above the one token it asks for).
async fn disaggregated(c: &HttpClient, a: &Vllm, b: &Vllm, tokenizer: &str) {
    let (_router, url) = router(
        tokenizer,
        &[
            "--policy-config",
            r#"{"max_local_prefill_tokens": 0}"#,
            "--worker",
            &format!("{}#role=prefill", a.url()),
            "--worker",
            &format!("{}#role=decode", b.url()),
        ],
    )
    .await;
    let (words, _) = chain();
    let prefilled = a.metric(c, "vllm:prompt_tokens_total").await;
    for (i, min_tokens) in [(0, None), (1, Some(3))] {
        let system: String = (0..200)
            .map(|k| words[(k * 3 + i) % words.len()].as_str())
            .collect();
        let mut body = json!({"model": MODEL, "temperature": 0, "max_tokens": 8, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": "go on"}]});
        if let Some(m) = min_tokens {
            body["min_tokens"] = json!(m);
        }
        let (status, v, _) = post_json(c, &format!("{url}/v1/chat/completions"), &body).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        assert_eq!(text, words[..8].concat(), "the answer a whole engine gives");
        assert_eq!(v["usage"]["completion_tokens"], 8);
    }
    // Streamed, the decode leg is asked for token IDs (its stream may be migrated): the
    // client gets the answer a whole engine gives, and none of the IDs.
    let system: String = (0..200)
        .map(|k| words[(k * 3 + 2) % words.len()].as_str())
        .collect();
    let body = json!({"model": MODEL, "temperature": 0, "max_tokens": 8, "stream": true,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "go on"}]});
    let got = answer(&stream(c, &url, &body, usize::MAX, || {}).await);
    assert_eq!(
        got.text,
        words[..8].concat(),
        "the answer a whole engine gives"
    );
    assert_eq!((got.ids.len(), got.prompt_ids, got.dones), (0, 0, 1));
    assert_eq!(
        common::router::metric(c, &url, "switchyard_split_requests_total", "").await,
        3.0
    );
    assert_eq!(
        common::router::metric(c, &url, "switchyard_prefill_leg_failures_total", "").await,
        0.0
    );
    assert!(
        a.metric(c, "vllm:prompt_tokens_total").await - prefilled >= 400.0,
        "the prefill engine computed both prompts"
    );
}

/// Reads an event stream from the router; after `kill_after` events, calls `kill`.
async fn stream(
    c: &HttpClient,
    url: &str,
    body: &Value,
    kill_after: usize,
    mut kill: impl FnMut(),
) -> Vec<String> {
    let req = Request::post(format!("{url}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let read = async {
        let resp = c.request(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let mut body = resp.into_body();
        let mut got = Vec::new();
        let mut killed = false;
        while let Some(frame) = body.frame().await {
            let frame = frame.expect("the client's stream is not broken");
            if let Ok(d) = frame.into_data() {
                got.extend_from_slice(&d);
            }
            if !killed && got.windows(6).filter(|w| w == b"data: ").count() >= kill_after {
                killed = true;
                kill();
            }
        }
        got
    };
    let got = tokio::time::timeout(Duration::from_secs(300), read)
        .await
        .expect("the answer ends");
    http::sse_events(&got)
}

/// What a client makes of a streamed chat: the text, token IDs, finish reasons, usage
/// and `[DONE]`s.
struct Answer {
    text: String,
    ids: Vec<u64>,
    finishes: Vec<String>,
    completion_tokens: u64,
    dones: usize,
    /// Chunks that carried token IDs and no text.
    empty_chunks: usize,
    /// Chunks that carried token IDs.
    chunks: usize,
    /// Events that carried the prompt's token IDs.
    prompt_ids: usize,
}

fn answer(events: &[String]) -> Answer {
    let mut a = Answer {
        text: String::new(),
        ids: Vec::new(),
        finishes: Vec::new(),
        completion_tokens: 0,
        dones: 0,
        empty_chunks: 0,
        chunks: 0,
        prompt_ids: 0,
    };
    for e in events {
        if e == "[DONE]" {
            a.dones += 1;
            continue;
        }
        let v: Value = serde_json::from_str(e).unwrap();
        assert!(v.get("error").is_none(), "an error event: {e}");
        a.prompt_ids += usize::from(v.get("prompt_token_ids").is_some_and(|p| !p.is_null()));
        if let Some(choice) = v["choices"].get(0) {
            if let Some(t) = choice["delta"]["content"].as_str() {
                a.text.push_str(t);
            }
            if let Some(ids) = choice["token_ids"].as_array() {
                a.ids.extend(ids.iter().map(|i| i.as_u64().unwrap()));
                a.chunks += usize::from(!ids.is_empty());
                if !ids.is_empty() && choice["delta"]["content"] == "" {
                    a.empty_chunks += 1;
                }
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                a.finishes.push(f.to_string());
            }
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            a.completion_tokens = n;
        }
    }
    a
}

/// A greedy chat that names no `max_tokens` gets the rest of the context from vLLM; its
/// engine killed -9 mid-answer, the router continues it on the other engine and the
/// client gets the same answer: at the token level, from the IDs the router asked for
/// (`--migration-token-ids`, on by default) and the client never sees; then (after the
/// killed engine is restarted, and mirrored afresh) with the client's own
/// `return_token_ids`.
async fn migration_without_max_tokens(c: &HttpClient, url: &str, a: &mut Vllm, b: &mut Vllm) {
    let mut body = chat("Tell me everything.");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let whole = answer(&stream(c, url, &body, usize::MAX, || {}).await);
    assert_eq!(whole.finishes, ["length"]);
    assert_eq!(whole.dones, 1);
    assert!(
        whole.completion_tokens > u64::from(CONTEXT) - 40,
        "no max_tokens: the rest of the context ({} tokens)",
        whole.completion_tokens
    );
    for client_asks in [false, true] {
        let mut body = body.clone();
        if client_asks {
            // The client continues its own assistant message, which ends with a word
            // the model follows with the byte tokens of one character: vLLM streams the
            // first with its ID and no text, which the continuation must not lose.
            let (_, detours) = chain();
            body["messages"]
                .as_array_mut()
                .unwrap()
                .push(json!({"role": "assistant", "content": detours[0]}));
            body["continue_final_message"] = json!(true);
            body["add_generation_prompt"] = json!(false);
            body["return_token_ids"] = json!(true);
            // Three tokens a chunk after the first (speculative decoding's shape): the
            // continuation must count them by their IDs.
            body["stream_interval"] = json!(3);
        }
        let reference = answer(&stream(c, url, &body, usize::MAX, || {}).await);
        if client_asks {
            assert!(reference.empty_chunks > 0, "a token streamed with no text");
            assert_eq!(reference.ids.len() as u64, reference.completion_tokens);
            assert!(
                reference.ids.len() > 2 * reference.chunks,
                "several tokens a chunk"
            );
        }
        let engines = [a.url(), b.url()];
        eventually("the reference stream's booking released", || async {
            instances_of(c, url, MODEL).await["instances"]
                .as_array()
                .unwrap()
                .iter()
                .all(|i| i["booked"] == 0)
        })
        .await;
        // Which engine runs it, once it streams: the router's own bookings say (not its
        // in-flight count, which takes the engine's reported load for a second after the
        // reference stream ended on one: a stream placed on the other engine could leave
        // the idle one killed and nothing to continue).
        let serving = std::sync::Arc::new(parking_lot::Mutex::new(None::<usize>));
        let finder = {
            let (s, c, url, engines) =
                (serving.clone(), c.clone(), url.to_string(), engines.clone());
            tokio::spawn(async move {
                let deadline = Instant::now() + Duration::from_secs(120);
                while Instant::now() < deadline && s.lock().is_none() {
                    let v = instances_of(&c, &url, MODEL).await;
                    for i in v["instances"].as_array().unwrap() {
                        if i["booked"].as_u64().unwrap_or(0) > 0 {
                            *s.lock() = engines.iter().position(|u| *u == i["url"]);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
        };
        let mut killed = None;
        let events = stream(c, url, &body, 40, || {
            let k = serving.lock().expect("the serving engine is known by now");
            if k == 0 {
                a.kill()
            } else {
                b.kill()
            }
            killed = Some(k);
        })
        .await;
        finder.abort();
        let got = answer(&events);
        assert_eq!(
            metric(c, url, "switchyard_token_level_migrations_total", "").await,
            1.0 + f64::from(u8::from(client_asks)),
            "continued at the token level"
        );
        assert_eq!(got.dones, 1, "one [DONE]");
        assert_eq!(got.finishes, reference.finishes, "one finish, the engine's");
        assert_eq!(
            got.completion_tokens, reference.completion_tokens,
            "as long as the uninterrupted answer"
        );
        assert_eq!(
            got.text, reference.text,
            "the same text (the model's argmax is robust)"
        );
        assert_eq!(got.ids, reference.ids, "the same token IDs");
        assert_eq!(
            got.prompt_ids, reference.prompt_ids,
            "the prompt's IDs as asked"
        );
        if client_asks {
            break;
        }
        assert!(
            got.ids.is_empty() && got.prompt_ids == 0,
            "no IDs the client did not ask for"
        );
        assert_eq!(reference.text, whole.text);
        // The killed engine restarted: back in the fleet, the cache it had (an answer's
        // worth of blocks) gone from the router's view, what it stores now mirrored.
        let e = if killed == Some(0) { &mut *a } else { &mut *b };
        e.restart();
        e.ready(c).await;
        let u = e.url();
        // The router probes an ejected worker with backoff up to 30 s, and this one was
        // down for a minute or more: its next probe may be that far off.
        let deadline = Instant::now() + Duration::from_secs(90);
        while instance(c, url, &u).await["available"] != true {
            assert!(
                Instant::now() < deadline,
                "the restarted engine never came back"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (words, _) = chain();
        let prompt: String = (0..3 * BLOCK as usize)
            .map(|i| words[(i * 5) % words.len()].as_str())
            .collect();
        let (status, v, _) = post_json(
            c,
            &format!("{u}/v1/completions"),
            &json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{v}");
        eventually("the restarted engine's cache mirrored afresh", || async {
            let n = instance(c, url, &u).await["cached_blocks"]
                .as_u64()
                .unwrap();
            (2..=3).contains(&n)
        })
        .await;
    }
}
