//! Streams through a router over mock workers, as the migration tests send and read
//! them: the requests, the fleet, and what a client makes of an answer.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use super::http::{self, HttpClient};
use super::procs::{Proc, mock_worker, serve};
use super::router::{TOKEN, eventually, metric};

/// One request of the test's traffic: chat or completions, streamed with usage.
pub fn request(i: usize, max_tokens: u32) -> (&'static str, Value) {
    let text = format!("request {i}: tell me about the number {}", i * 7919);
    if i.is_multiple_of(2) {
        (
            "/v1/chat/completions",
            json!({"model": "mock", "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens, "stream": true, "stream_options": {"include_usage": true}}),
        )
    } else {
        (
            "/v1/completions",
            json!({"model": "mock", "prompt": text, "max_tokens": max_tokens, "stream": true,
                "stream_options": {"include_usage": true}}),
        )
    }
}

/// Streams `body` to `url + path`; `started` counts up once `after` chunks have arrived.
/// Returns the whole body.
pub async fn stream(
    c: &HttpClient,
    url: &str,
    path: &str,
    body: &Value,
    after: usize,
    started: Arc<AtomicUsize>,
) -> String {
    let (got, whole) = http::read_stream(
        c,
        &format!("{url}{path}"),
        body.to_string(),
        after,
        &started,
        Duration::from_secs(60),
    )
    .await;
    assert!(
        whole,
        "the answer is 200 and its stream ends in time, unbroken: {}",
        String::from_utf8_lossy(&got)
    );
    String::from_utf8(got).unwrap()
}

/// What a client reads from a stream.
#[derive(Debug, PartialEq)]
pub struct Read {
    pub text: String,
    pub ids: Vec<String>,
    pub finish: Option<String>,
    pub usage: Option<(u64, u64)>,
    pub done: bool,
    pub errors: Vec<String>,
    /// Chunks that stood for a token (the mock streams one a chunk, some with no text).
    pub tokens: usize,
}

pub fn read(body: &str) -> Read {
    let mut r = Read {
        text: String::new(),
        ids: Vec::new(),
        finish: None,
        usage: None,
        done: false,
        errors: Vec::new(),
        tokens: 0,
    };
    for e in http::sse_events(body.as_bytes()) {
        assert!(!r.done, "nothing after [DONE]: {body}");
        if e == "[DONE]" {
            r.done = true;
            continue;
        }
        let v: Value = serde_json::from_str(&e).unwrap();
        if let Some(err) = v.get("error") {
            r.errors
                .push(err["message"].as_str().unwrap_or("").to_string());
            continue;
        }
        let id = v["id"].as_str().unwrap().to_string();
        if !r.ids.contains(&id) {
            r.ids.push(id);
        }
        if let Some(c) = v["choices"].as_array().and_then(|c| c.first()) {
            let piece = c["delta"]["content"].as_str().or(c["text"].as_str());
            r.text.push_str(piece.unwrap_or(""));
            r.tokens += usize::from(piece.is_some() && c["delta"].get("role").is_none());
            if let Some(f) = c["finish_reason"].as_str() {
                assert!(r.finish.is_none(), "one final chunk: {body}");
                r.finish = Some(f.to_string());
            }
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            let (p, c) = (
                u["prompt_tokens"].as_u64().unwrap(),
                u["completion_tokens"].as_u64().unwrap(),
            );
            assert_eq!(u["total_tokens"].as_u64().unwrap(), p + c, "{u}");
            r.usage = Some((p, c));
        }
    }
    r
}

/// Streams continued on another worker, whatever broke them.
pub async fn continued(c: &HttpClient, url: &str) -> f64 {
    metric(
        c,
        url,
        "switchyard_migrations_total",
        "outcome=\"continued\"",
    )
    .await
}

/// Starts `n` streams of `tokens` (requests `0..n`) through `url` and returns once each
/// has received five events.
pub async fn under_way(
    c: &HttpClient,
    url: &str,
    n: usize,
    tokens: u32,
) -> Vec<tokio::task::JoinHandle<String>> {
    let started = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..n {
        let (c, url, started) = (c.clone(), url.to_string(), started.clone());
        let (path, body) = request(i, tokens);
        tasks.push(tokio::spawn(async move {
            stream(&c, &url, path, &body, 5, started).await
        }));
    }
    eventually("every stream under way", || async {
        started.load(Ordering::SeqCst) == n
    })
    .await;
    tasks
}

/// What each stream read, in order.
pub async fn finished(tasks: Vec<tokio::task::JoinHandle<String>>) -> Vec<Read> {
    let mut got = Vec::new();
    for t in tasks {
        got.push(read(&t.await.unwrap()));
    }
    got
}

/// Three workers at real speed (a token every ~10 ms), and a router over them.
pub async fn fleet(
    worker_flags: &[&[&str]],
    router_flags: &[&str],
) -> (Vec<(Proc, String)>, Proc, String) {
    let mut procs = Vec::new();
    let mut args = vec!["--model", "mock", "--admin-token", TOKEN];
    if !router_flags.contains(&"--health-check-interval-ms") {
        args.extend(["--health-check-interval-ms", "0"]);
    }
    let mut urls = Vec::new();
    for flags in worker_flags {
        let (p, url) = mock_worker(flags).await;
        procs.push((p, url.clone()));
        urls.push(url);
    }
    for u in &urls {
        args.extend(["--worker", u.as_str()]);
    }
    args.extend_from_slice(router_flags);
    let (router, url) = serve(&args).await;
    (procs, router, url)
}

/// Each stream read as one whole answer: no error, one identity, one final chunk,
/// `[DONE]`, and the text and usage of the same request run uninterrupted (`want`).
pub fn assert_reads_as(got: &[Read], want: &[Read]) {
    assert_eq!(got.len(), want.len());
    for (i, (got, want)) in got.iter().zip(want).enumerate() {
        assert!(got.errors.is_empty(), "stream {i}: {:?}", got.errors);
        assert_eq!(
            got.ids.len(),
            1,
            "stream {i} has one identity: {:?}",
            got.ids
        );
        assert_eq!(got.finish.as_deref(), Some("length"), "stream {i}");
        assert!(got.done, "stream {i} ends with [DONE]");
        assert_eq!(got.text, want.text, "stream {i}: no text lost or repeated");
        assert_eq!(
            got.usage, want.usage,
            "stream {i}: usage of the whole answer"
        );
    }
}

/// The same requests as the streams (`0..n`), each run whole through `url` (a router
/// or a worker).
pub async fn uninterrupted(c: &HttpClient, url: &str, n: usize, max_tokens: u32) -> Vec<Read> {
    let mut out = Vec::new();
    for i in 0..n {
        let (path, body) = request(i, max_tokens);
        out.push(read(&stream(c, url, path, &body, 0, Arc::default()).await));
    }
    out
}
