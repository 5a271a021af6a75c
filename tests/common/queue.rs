//! The overload tests' helpers: mock workers with small batches, a router in front of
//! them, completions posted and queued, configuration files, refusals read.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::http::{self, HttpClient};
use super::procs::{Proc, mock_worker, serve};
use super::router::{TOKEN, eventually, metric};

/// A completion of `max_tokens` tokens (~10 ms each on the mock at speed 1).
pub fn body(prompt: &str, max_tokens: u32) -> String {
    json!({"model": "mock", "prompt": prompt, "max_tokens": max_tokens}).to_string()
}

/// A prompt of several blocks, unique per `tag`.
pub fn prompt(tag: &str) -> String {
    sized_prompt(tag, 1500)
}

/// A prompt of at least `chars` characters, unique per `tag`.
pub fn sized_prompt(tag: &str, chars: usize) -> String {
    let mut s = format!("{tag}: ");
    while s.len() < chars {
        s.push_str(&format!("line {} about {tag}. ", s.len()));
    }
    s
}

/// Posts a completion with `headers`; status, headers and the JSON answer.
pub async fn post(
    c: &HttpClient,
    router: &str,
    body: String,
    headers: &[(&str, &str)],
) -> (hyper::StatusCode, hyper::HeaderMap, Value) {
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    let (status, h, bytes) = http::send(
        c,
        hyper::Method::POST,
        &format!("{router}/v1/completions"),
        &all,
        body,
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    (
        status,
        h,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// Starts a request in the background.
/// A request started in the background: its status, headers, answer and end.
pub type Pending = tokio::task::JoinHandle<(hyper::StatusCode, hyper::HeaderMap, Value, Instant)>;

pub fn spawn_post(router: &str, body: String, headers: Vec<(&'static str, String)>) -> Pending {
    let router = router.to_string();
    tokio::spawn(async move {
        let c = http::client();
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (s, hm, v) = post(&c, &router, body, &h).await;
        (s, hm, v, Instant::now())
    })
}

pub async fn stats(c: &HttpClient, worker: &str) -> Value {
    let (_, body) = http::get(c, &format!("{worker}/stats")).await;
    serde_json::from_slice(&body).unwrap()
}

/// Requests a worker has taken: finished, running and waiting.
pub async fn taken(c: &HttpClient, worker: &str) -> u64 {
    let s = stats(c, worker).await;
    ["finished", "running", "waiting"]
        .iter()
        .map(|k| s[k].as_u64().unwrap())
        .sum()
}

pub async fn queued(c: &HttpClient, router: &str) -> f64 {
    metric(c, router, "switchyard_queue_depth", "").await
}

/// Mock workers running at most `batch` requests at once each.
pub async fn workers(batches: &[&str]) -> Vec<(Proc, String)> {
    let mut out = Vec::new();
    for b in batches {
        out.push(mock_worker(&["--max-num-seqs", b]).await);
    }
    out
}

/// A request started in the background, once it waits in the router's queue.
pub async fn enqueue(
    c: &HttpClient,
    url: &str,
    body: String,
    headers: Vec<(&'static str, String)>,
) -> Pending {
    let before = queued(c, url).await;
    let task = spawn_post(url, body, headers);
    eventually("the request to wait in the queue", || async {
        queued(c, url).await == before + 1.0
    })
    .await;
    task
}

/// A configuration file of `toml` (kept while the directory lives).
pub fn config_file(toml: &str) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("switchyard.toml");
    std::fs::write(&path, toml).unwrap();
    (dir, path.to_str().unwrap().to_string())
}

pub async fn router(fleet: &[(Proc, String)], extra: &[&str]) -> (Proc, String) {
    let mut args: Vec<&str> = vec!["--model", "mock", "--admin-token", TOKEN];
    for (_, url) in fleet {
        args.extend(["--worker", url.as_str()]);
    }
    args.extend_from_slice(extra);
    serve(&args).await
}

/// A refusal: its status, `Retry-After` and error code.
pub fn refusal(r: &(hyper::StatusCode, hyper::HeaderMap, Value)) -> (u16, bool, String) {
    (
        r.0.as_u16(),
        r.1.get("retry-after")
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
            .is_some_and(|s| s >= 1),
        r.2["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    )
}
