//! A plain HTTP client for tests (hyper), returning status and body.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// Sends a request and reads the whole response (bounded by `limit`).
pub async fn send(
    c: &HttpClient,
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
    limit: Duration,
) -> Result<(StatusCode, hyper::HeaderMap, Bytes), String> {
    let mut req = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(body.into())).unwrap();
    let fut = async {
        let resp = c
            .request(req)
            .await
            .map_err(|e| format!("request failed: {e:?}"))?;
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("body failed: {e}"))?
            .to_bytes();
        Ok((status, headers, body))
    };
    tokio::time::timeout(limit, fut)
        .await
        .map_err(|_| "timed out".to_string())?
}

/// Posts `body` (JSON) to `url` and reads the answer as a stream, within `limit`:
/// `started` counts up once `after` events (`data: ` lines) have arrived, or at the end
/// if fewer came. Returns what was read, and whether the answer was 200 and its body
/// ended cleanly in time.
pub async fn read_stream(
    c: &HttpClient,
    url: &str,
    body: String,
    after: usize,
    started: &AtomicUsize,
    limit: Duration,
) -> (Vec<u8>, bool) {
    let req = Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let mut got = Vec::new();
    let mut events = 0;
    let read = async {
        let Ok(resp) = c.request(req).await else {
            return false;
        };
        let status = resp.status();
        let mut body = resp.into_body();
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { return false };
            if let Ok(d) = frame.into_data() {
                // Counted once: only the windows that reach into the new bytes.
                let from = got.len().saturating_sub(5);
                got.extend_from_slice(&d);
                let before = events;
                events += got[from..].windows(6).filter(|w| w == b"data: ").count();
                if before < after && events >= after {
                    started.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
        status == StatusCode::OK
    };
    let ok = tokio::time::timeout(limit, read).await.unwrap_or(false);
    if events < after || after == 0 {
        started.fetch_add(1, Ordering::SeqCst);
    }
    (got, ok)
}

/// Posts `body` as JSON; the status, the JSON answer and its bytes. The bound is a
/// hang detector, not a timing: a real engine on a loaded CPU may take a minute to write
/// a whole context (a chat without `max_tokens` runs to its end).
pub async fn post_json(
    c: &HttpClient,
    url: &str,
    body: &serde_json::Value,
) -> (StatusCode, serde_json::Value, Bytes) {
    let (status, _, bytes) = send(
        c,
        Method::POST,
        url,
        &[("content-type", "application/json")],
        body.to_string(),
        Duration::from_secs(180),
    )
    .await
    .unwrap();
    let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    (status, json, bytes)
}

/// `GET url`: its status and body, or no status if the request failed.
pub async fn get_maybe(c: &HttpClient, url: &str) -> (Option<StatusCode>, Bytes) {
    match send(
        c,
        Method::GET,
        url,
        &[],
        Bytes::new(),
        Duration::from_secs(30),
    )
    .await
    {
        Ok((status, _, bytes)) => (Some(status), bytes),
        Err(_) => (None, Bytes::new()),
    }
}

pub async fn get(c: &HttpClient, url: &str) -> (StatusCode, Bytes) {
    let (status, bytes) = get_maybe(c, url).await;
    (status.unwrap_or_else(|| panic!("GET {url} failed")), bytes)
}

/// Parses a complete SSE body into its `data:` payloads; panics on anything that is not
/// valid SSE as OpenAI streams it (events of `data:` lines separated by blank lines).
pub fn sse_events(body: &[u8]) -> Vec<String> {
    let text = std::str::from_utf8(body).expect("SSE is UTF-8");
    assert!(
        text.ends_with("\n\n"),
        "an SSE stream ends with a blank line: {text:?}"
    );
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let data = e
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {e:?}"));
            assert!(!data.contains('\n'), "one line per event");
            data.to_string()
        })
        .collect()
}
