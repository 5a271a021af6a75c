//! A plain HTTP client for tests (hyper), returning status and body.

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
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    (status, json, bytes)
}

pub async fn get(c: &HttpClient, url: &str) -> (StatusCode, Bytes) {
    let (status, _, bytes) = send(
        c,
        Method::GET,
        url,
        &[],
        Bytes::new(),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    (status, bytes)
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
