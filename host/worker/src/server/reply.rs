//! The shapes of the mock worker's answers, and the bounded read of a request body.

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};

use super::Body;

/// The largest request body the worker reads.
pub(super) const MAX_BODY: usize = 32 << 20;

pub(super) fn full(
    status: StatusCode,
    content_type: &str,
    body: impl Into<Bytes>,
) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(body.into()).map_err(|e| match e {}).boxed())
        .expect("valid response")
}

pub(super) fn json_response(status: StatusCode, v: serde_json::Value) -> Response<Body> {
    full(status, "application/json", v.to_string())
}

/// An error answer in vLLM's shape.
pub(super) fn error(
    status: StatusCode,
    message: &str,
    kind: &str,
    param: Option<&str>,
) -> Response<Body> {
    // vLLM's `ErrorResponse`: the status is the `code`.
    let body = serde_json::json!({"error": {"message": message, "type": kind, "param": param, "code": status.as_u16()}});
    full(status, "application/json", body.to_string())
}

/// A request's body, or the 413 answer when it exceeds `MAX_BODY`.
pub(super) async fn read_body(req: Request<Incoming>) -> Result<Bytes, Response<Body>> {
    match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(_) => Err(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request body too large",
            "invalid_request_error",
            None,
        )),
    }
}
