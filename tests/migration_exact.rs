//! Exact migration: a stream continued at the token level, from the prompt's and the
//! answer's token IDs, reads as the uninterrupted one — whether the client asked for the
//! IDs (vLLM's `return_token_ids`) or the router asked a vLLM worker for them itself,
//! in which case the client never sees them.

mod common;

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use common::http;
use common::procs::{free_port, serve, switchyard, wait_ok};
use common::router::{TOKEN, eventually, instances, metric};
use common::streams::{continued, fleet, read, request, stream};

/// The token IDs and prompt IDs a client's stream carried.
fn ids(body: &str) -> (Vec<u64>, usize) {
    let mut ids = Vec::new();
    let mut prompts = 0;
    for e in http::sse_events(body.as_bytes()) {
        let Ok(v) = serde_json::from_str::<Value>(&e) else {
            continue;
        };
        prompts += usize::from(v.get("prompt_token_ids").is_some())
            + usize::from(v.pointer("/choices/0/prompt_token_ids").is_some());
        if let Some(t) = v.pointer("/choices/0/token_ids").and_then(Value::as_array) {
            ids.extend(t.iter().map(|t| t.as_u64().unwrap()));
        }
    }
    (ids, prompts)
}

/// The worker that cuts every stream after seven tokens, and a healthy one.
const CUT: &[&str] = &["--fault", "cut-stream", "--fault-after-tokens", "7"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_carries_token_ids_is_continued_exactly_at_the_token_level() {
    let (workers, _router, url) = fleet(&[CUT, &[]], &["--policy", "round-robin"]).await;
    let c = http::client();
    // Chat and completions, twice each, taking turns over the two workers; the mock's
    // answers have tokens with no text (a lone byte of "é").
    let mut got = Vec::new();
    for i in 0..4 {
        let (path, mut body) = request(i / 2, 30);
        body["return_token_ids"] = json!(true);
        // Every other one three tokens a chunk (vLLM's `stream_interval`).
        body["stream_interval"] = json!(1 + 2 * (i % 2));
        let raw = stream(&c, &url, path, &body, 0, Arc::default()).await;
        got.push((path, body, read(&raw), ids(&raw)));
    }
    // Every continuation (one per request that landed on the cutting worker) was exact.
    let token_level = metric(&c, &url, "switchyard_token_level_migrations_total", "").await;
    assert!(token_level >= 1.0);
    assert_eq!(continued(&c, &url).await, token_level);
    for (path, body, read_got, (got_ids, prompts)) in got {
        assert!(read_got.errors.is_empty(), "{:?}", read_got.errors);
        assert!(read_got.done);
        assert_eq!(prompts, 1, "the prompt's IDs once");
        // The same request, uninterrupted, straight from the healthy worker.
        let raw = stream(&c, &workers[1].1, path, &body, 0, Arc::default()).await;
        let (want, (want_ids, _)) = (read(&raw), ids(&raw));
        assert_eq!(read_got.text, want.text, "{path}");
        assert_eq!(got_ids, want_ids, "{path}: the same token IDs");
        assert_eq!(read_got.usage, want.usage, "{path}");
    }
}

/// The router asks vLLM workers for token IDs on its own (`--migration-token-ids`, on by
/// default) once their `/v1/models` says they are vLLM; a client that did not ask gets
/// an exact continuation and never an ID. With the setting off, the same breaks are
/// continued as text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_asks_for_token_ids_itself_and_the_client_never_sees_them() {
    for exact in [true, false] {
        let flags = [
            "--policy",
            "round-robin",
            "--migration-token-ids",
            if exact { "true" } else { "false" },
        ];
        let (workers, _router, url) = fleet(&[CUT, &[]], &flags).await;
        let c = http::client();
        eventually("both workers known as vLLM by their /v1/models", || async {
            instances(&c, &url).await["instances"]
                .as_array()
                .unwrap()
                .iter()
                .all(|i| i["streams_token_ids"] == true)
        })
        .await;
        let mut got = Vec::new();
        for i in 0..4 {
            let (path, mut body) = request(i / 2, 30);
            // Every other one three tokens a chunk when exact; the text level counts a
            // chunk without IDs as one token, so it is tried on one a chunk only.
            body["stream_interval"] = json!(if exact { 1 + 2 * (i % 2) } else { 1 });
            let raw = stream(&c, &url, path, &body, 0, Arc::default()).await;
            got.push((path, body, read(&raw), ids(&raw)));
        }
        let token_level = metric(&c, &url, "switchyard_token_level_migrations_total", "").await;
        let moved = continued(&c, &url).await;
        assert!(moved >= 1.0, "a stream landed on the cutting worker");
        assert_eq!(token_level, if exact { moved } else { 0.0 });
        for (path, body, got, (got_ids, prompts)) in got {
            assert!(got.errors.is_empty(), "{:?}", got.errors);
            assert!(got.done);
            assert_eq!(
                (got_ids.len(), prompts),
                (0, 0),
                "{path}: no IDs the client did not ask for"
            );
            let want = read(&stream(&c, &workers[1].1, path, &body, 0, Arc::default()).await);
            assert_eq!(got.text, want.text, "{path}, exact: {exact}");
            assert_eq!(got.usage, want.usage, "{path}, exact: {exact}");
        }
    }
}

/// A worker the router is given before it answers (an engine still loading its model)
/// is known by its `/v1/models` soon after its first answer — here, as vLLM, so its
/// streams are asked for token IDs — not at the next read five minutes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_answers_late_is_known_by_its_models_page_soon_after() {
    let listen = format!("127.0.0.1:{}", free_port());
    let worker = format!("http://{listen}");
    let flags = ["--model", "mock", "--admin-token", TOKEN];
    let more = ["--health-check-interval-ms", "0", "--worker", &worker];
    let (_router, url) = serve(&[&flags[..], &more].concat()).await;
    let c = http::client();
    let known = || async { instances(&c, &url).await["instances"][0]["streams_token_ids"] == true };
    // The router's first reads of the page find nothing listening.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!known().await, "nothing answered yet");
    let _worker = switchyard(&["mock-worker", "--listen", &listen, "--model", "mock"]);
    wait_ok(&format!("{worker}/v1/models")).await;
    // Asked again at doubling waits from the engine-metrics interval (1 s): 1, 3, 7,
    // 15 s after the first read, so within 12 s of the worker's start, where a page not
    // read used to wait 30 s (and five minutes before that) for its next try.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !known().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the late worker still unknown 20 s after it answered"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
