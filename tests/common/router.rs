//! Reading a running router's state from the outside: admin API and metrics.

use std::time::{Duration, Instant};

use hyper::{Method, StatusCode};
use serde_json::Value;

use super::http::{self, HttpClient};

pub const TOKEN: &str = "test-admin-token";
pub const PATIENCE: Duration = Duration::from_secs(30);

/// Polls until `f` holds (bounded): waiting on state another process changes.
pub async fn eventually<F: std::future::Future<Output = bool>>(
    what: &str,
    mut f: impl FnMut() -> F,
) {
    let deadline = Instant::now() + PATIENCE;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `GET url` with the admin token: the status and the body as text.
pub async fn admin_get_text(c: &HttpClient, url: &str) -> (StatusCode, String) {
    admin_send(c, Method::GET, url).await
}

/// `METHOD url` with the admin token and no body: the status and the body as text.
pub async fn admin_send(c: &HttpClient, method: Method, url: &str) -> (StatusCode, String) {
    let (status, _, body) = http::send(
        c,
        method,
        url,
        &[("authorization", &format!("Bearer {TOKEN}"))],
        "",
        PATIENCE,
    )
    .await
    .unwrap();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// The admin API's bearer credential for [`TOKEN`].
pub fn auth() -> String {
    format!("Bearer {TOKEN}")
}

/// `POST url` on the admin API with a JSON body: its status, JSON (or null) and bytes.
pub async fn admin_post(
    c: &HttpClient,
    url: &str,
    body: &Value,
) -> (StatusCode, Value, bytes::Bytes) {
    let (status, _, bytes) = http::send(
        c,
        Method::POST,
        url,
        &[
            ("content-type", "application/json"),
            ("authorization", &auth()),
        ],
        body.to_string(),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, v, bytes)
}

/// Whether an `explain` answer shows a candidate holding `blocks` of the prompt, seen
/// through its engine's KV events (not predicted).
pub fn published(explained: &Value, blocks: &Value) -> bool {
    explained["candidates"].as_array().is_some_and(|cs| {
        cs.iter()
            .any(|c| c["overlap_blocks"] == *blocks && c["cache_view"] == "events")
    })
}

/// `GET url` on the admin API, which must answer 200 with JSON.
pub async fn admin_get(c: &HttpClient, url: &str) -> Value {
    let (status, _, body) = http::send(
        c,
        Method::GET,
        url,
        &[("authorization", &auth())],
        "",
        PATIENCE,
    )
    .await
    .unwrap();
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    serde_json::from_slice(&body).unwrap()
}

/// The endpoint's instances from the admin API (`{"panic": .., "instances": [..]}`).
pub async fn instances(c: &HttpClient, router: &str) -> Value {
    instances_of(c, router, "mock").await
}

/// The instances of the endpoint serving `model`.
pub async fn instances_of(c: &HttpClient, router: &str, model: &str) -> Value {
    admin_get(
        c,
        &format!("{router}/admin/endpoints/default/{model}/generate/instances"),
    )
    .await
}

/// How many instances are available.
pub async fn available(c: &HttpClient, router: &str) -> usize {
    instances(c, router).await["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["available"] == true)
        .count()
}

/// The instance whose URL is `url`.
pub async fn instance(c: &HttpClient, router: &str, url: &str) -> Value {
    instance_of(c, router, "mock", url).await
}

/// The instance whose URL is `url`, of the endpoint serving `model`.
pub async fn instance_of(c: &HttpClient, router: &str, model: &str, url: &str) -> Value {
    instances_of(c, router, model).await["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["url"] == url)
        .cloned()
        .unwrap_or_else(|| panic!("no instance {url}"))
}

/// The sum of the samples of metric `name` whose labels contain `labels` (e.g.
/// `kind="failing"`), from `/metrics`.
pub async fn metric(c: &HttpClient, router: &str, name: &str, labels: &str) -> f64 {
    let (_, body) = http::get(c, &format!("{router}/metrics")).await;
    series_sum(&String::from_utf8_lossy(&body), name, labels)
}

/// The sum of the samples of `name` in Prometheus `text` whose labels contain `labels`.
/// A series not yet counted is 0, but a name not exported at all (renamed, never
/// registered) fails the test rather than reading as 0.
pub fn series_sum(text: &str, name: &str, labels: &str) -> f64 {
    let family = ["_total", "_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name);
    let exported = text.lines().any(|l| {
        let declared = l.strip_prefix("# TYPE ").and_then(|r| r.split(' ').next());
        declared.is_some_and(|d| d == name || d == family)
            || l.split(['{', ' ']).next() == Some(name)
    });
    assert!(exported, "/metrics exports no `{name}`");
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, rest) = series.split_once('{').unwrap_or((series, ""));
            (n == name && rest.contains(labels)).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}
