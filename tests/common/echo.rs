//! Echo backends for the endpoint-picker conformance suite (`tests/epp_conformance.rs`):
//! model servers that say who they are and what reached them. Each answers a POST with
//! an OpenAI-shaped completion whose `echo` field names the backend that served
//! (`served_by`), the `x-gateway-destination-endpoint` header the gateway forwarded,
//! and the request body's size and hash; `"stream": true` answers as SSE, one chunk at
//! once and the rest only once the test releases it (so a test can see a chunk arrive
//! before the answer ends, with no clock); `"echo_hold": true` holds the answer until
//! released. Health, models and metrics answer 200, as a model server's do. A hold
//! lasts at most [`HOLD_LIMIT`]: a test that forgets to release fails, never hangs.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::Frame;
use hyper::{Request, Response};
use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc};

/// The longest an answer is held for a release.
pub const HOLD_LIMIT: Duration = Duration::from_secs(20);

/// The largest request body an echo backend reads.
const MAX_BODY: usize = 8 << 20;

type Body = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;

/// One echo backend, serving until dropped.
pub struct Echo {
    /// `127.0.0.1:PORT`.
    pub addr: String,
    release: Arc<Notify>,
    served: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Echo {
    /// Completions answered (or begun, for streams) so far.
    pub fn served(&self) -> usize {
        self.served.load(Ordering::SeqCst)
    }

    /// Lets every held answer and stream (now and to come) go on.
    pub fn release(&self) {
        self.release.notify_waiters();
        self.release.notify_one();
    }
}

/// Starts an echo backend on a free port.
pub async fn echo() -> Echo {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let release = Arc::new(Notify::new());
    let served = Arc::new(AtomicUsize::new(0));
    let (me, gate, count) = (addr.clone(), release.clone(), served.clone());
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (me, gate, count) = (me.clone(), gate.clone(), count.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    let (me, gate, count) = (me.clone(), gate.clone(), count.clone());
                    async move { Ok::<_, Infallible>(answer(req, &me, gate, &count).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Echo {
        addr,
        release,
        served,
        task,
    }
}

fn full(status: u16, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(
            Full::new(body.into())
                .map_err(|never: Infallible| match never {})
                .boxed(),
        )
        .unwrap()
}

async fn answer(
    req: Request<hyper::body::Incoming>,
    me: &str,
    gate: Arc<Notify>,
    served: &AtomicUsize,
) -> Response<Body> {
    match (req.method().as_str(), req.uri().path()) {
        ("GET", "/v1/models") => {
            return full(
                200,
                "application/json",
                json!({"object": "list", "data": [{"id": "mock", "object": "model"}]}).to_string(),
            );
        }
        ("GET", _) => return full(200, "text/plain", ""),
        _ => {}
    }
    let destination = req
        .headers()
        .get("x-gateway-destination-endpoint")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let Ok(body) = Limited::new(req.into_body(), MAX_BODY).collect().await else {
        return full(413, "text/plain", "too large");
    };
    let body = body.to_bytes();
    served.fetch_add(1, Ordering::SeqCst);
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let echo = json!({
        "served_by": me,
        "destination": destination,
        "body_bytes": body.len(),
        "body_hash": hash(&body),
    });
    let held = |gate: Arc<Notify>| async move {
        let _ = tokio::time::timeout(HOLD_LIMIT, gate.notified()).await;
    };
    if request["stream"] == true {
        let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(8);
        tokio::spawn(async move {
            let chunk = |i: usize| {
                let v = json!({"id": "echo", "object": "text_completion", "model": "mock",
                    "choices": [{"index": 0, "text": format!("chunk {i} "), "finish_reason": null}],
                    "echo": echo});
                Bytes::from(format!("data: {v}\n\n"))
            };
            if tx.send(Ok(Frame::data(chunk(0)))).await.is_err() {
                return;
            }
            held(gate).await;
            for i in 1..4 {
                if tx.send(Ok(Frame::data(chunk(i)))).await.is_err() {
                    return;
                }
            }
            let _ = tx
                .send(Ok(Frame::data(Bytes::from("data: [DONE]\n\n"))))
                .await;
        });
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed())
            .unwrap();
    }
    if request["echo_hold"] == true {
        held(gate).await;
    }
    let v = json!({"id": "echo", "object": "text_completion", "model": "mock",
        "choices": [{"index": 0, "text": "echo", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        "echo": echo});
    full(200, "application/json", v.to_string())
}

/// A body's hash, as the echo reports it.
pub fn hash(body: &[u8]) -> String {
    use std::hash::Hasher as _;
    let mut h = std::hash::DefaultHasher::new();
    h.write(body);
    format!("{:016x}", h.finish())
}
