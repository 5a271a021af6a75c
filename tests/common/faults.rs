//! Fleets of mock-worker processes for the fault tests, and the requests they send.

use super::http::{self, HttpClient};
use super::procs::{Proc, mock_worker, serve};
use super::router::{PATIENCE, TOKEN};
use hyper::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub fn chat(text: &str, max_tokens: u32, stream: bool) -> Value {
    json!({"model": "mock", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": stream})
}

/// `n` mock workers started with `flags(i)`, and a router over them with `extra` flags.
pub async fn fleet(
    n: usize,
    flags: impl Fn(usize) -> Vec<&'static str>,
    extra: &[&str],
) -> (Vec<(Proc, String)>, Proc, String) {
    let mut workers = Vec::new();
    for i in 0..n {
        let mut f = vec!["--speedup", "100"];
        f.extend(flags(i));
        workers.push(mock_worker(&f).await);
    }
    let mut args = vec!["--model", "mock", "--admin-token", TOKEN];
    for (_, url) in &workers {
        args.extend(["--worker", url.as_str()]);
    }
    args.extend_from_slice(extra);
    let (router, url) = serve(&args).await;
    (workers, router, url)
}

/// Worker flags: the first worker sheds load with 503 and `Retry-After: retry_after`,
/// the others serve.
pub fn first_sheds(retry_after: &'static str) -> impl Fn(usize) -> Vec<&'static str> {
    move |i| {
        if i == 0 {
            vec![
                "--fault",
                "status",
                "--fault-status",
                "503",
                "--fault-retry-after-secs",
                retry_after,
            ]
        } else {
            vec![]
        }
    }
}

pub async fn complete(
    c: &HttpClient,
    url: &str,
    body: &Value,
) -> (StatusCode, hyper::HeaderMap, String) {
    let (s, h, b) = http::send(
        c,
        Method::POST,
        &format!("{url}/v1/chat/completions"),
        &[("content-type", "application/json")],
        body.to_string(),
        PATIENCE,
    )
    .await
    .unwrap();
    (s, h, String::from_utf8_lossy(&b).into_owned())
}

/// Opens a streaming completion on a connection of its own; returns the connection and
/// the first bytes of the answer.
pub async fn open_stream(addr: &str) -> (tokio::net::TcpStream, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = chat("hang", 50, true).to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(PATIENCE, s.read(&mut buf))
        .await
        .unwrap()
        .unwrap_or(0);
    let head = String::from_utf8_lossy(&buf[..n]).into_owned();
    (s, head)
}
