//! Every error the front door returns, mapped to an HTTP status and OpenAI's error body in
//! one place.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Response, StatusCode};

use super::Body;
use switchyard_router::RouteError;
use switchyard_tokens::openai;

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Malformed request.
    #[error("{0}")]
    BadRequest(openai::BadRequest),
    /// The body is larger than the limit.
    #[error("request body larger than {0} bytes")]
    TooLarge(usize),
    /// The body did not arrive within the client timeout.
    #[error("the request body did not arrive within {0:?}")]
    BodyTimeout(std::time::Duration),
    /// No endpoint serves the model.
    #[error("the model `{0}` does not exist")]
    UnknownModel(String),
    /// The model is known but has no instance right now.
    #[error("the model `{0}` has no instance right now")]
    ModelUnavailable(String),
    /// The router itself is at a limit (connections, requests in flight, file
    /// descriptors).
    #[error("the router is overloaded: {0}")]
    Overloaded(String),
    /// Routing failed (no instance, or the policy refused).
    #[error(transparent)]
    Route(#[from] RouteError),
    /// Every attempt to reach a worker failed.
    #[error("upstream workers failed: {0}")]
    Upstream(String),
    /// Every attempt timed out.
    #[error("upstream workers timed out: {0}")]
    UpstreamTimeout(String),
    /// Missing or wrong admin token.
    #[error("{0}")]
    Unauthorized(&'static str),
    /// No such route.
    #[error("no route for {0}")]
    NotFound(String),
    /// Something the admin API refused (e.g. a bad policy).
    #[error("{0}")]
    Refused(String),
    /// The router is shutting down.
    #[error("the router is shutting down")]
    ShuttingDown,
    /// Refused by the overload queue (a tenant over its share, a full fleet, a
    /// deadline).
    #[error("{}", .0.message)]
    Shed(crate::queue::Shed),
    /// A gateway's subset names no worker of the endpoint.
    #[error("{0}")]
    NoEligibleWorker(String),
    /// The router's own fault (a task of its own panicked): neither the client's nor a
    /// worker's.
    #[error("the router failed: {0}")]
    Internal(String),
}

impl ApiError {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) | ApiError::Refused(_) => StatusCode::BAD_REQUEST,
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            // Past its objectives, not the fleet's capacity: the client's own bound.
            ApiError::Route(RouteError::Late { .. }) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::UnknownModel(_) | ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Route(_)
            | ApiError::ShuttingDown
            | ApiError::ModelUnavailable(_)
            | ApiError::NoEligibleWorker(_)
            | ApiError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Upstream(_) => StatusCode::BAD_GATEWAY,
            ApiError::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Shed(s) if s.reason == crate::queue::ShedReason::TenantShare => {
                StatusCode::TOO_MANY_REQUESTS
            }
            ApiError::Shed(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// When a client should try again, for the answers that mean "not now".
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        use std::time::Duration;
        // Whole seconds, rounded up; saturating.
        let up = |d: &Duration| {
            Duration::from_secs(d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0)))
        };
        match self {
            ApiError::Route(
                RouteError::Busy { retry_after, .. } | RouteError::Late { retry_after, .. },
            ) => Some(up(retry_after)),
            // At most a minute: an estimate from the recent dispatch rate.
            ApiError::Shed(s) => Some(up(&s.retry_after).min(Duration::from_secs(60))),
            ApiError::Route(RouteError::NoInstances { .. })
            | ApiError::Route(RouteError::Saturated { .. })
            | ApiError::ModelUnavailable(_)
            | ApiError::Overloaded(_)
            | ApiError::ShuttingDown => Some(Duration::from_secs(1)),
            _ => None,
        }
    }

    /// The response: OpenAI's `{"error": {message, type, param, code}}`.
    pub fn response(&self) -> Response<Body> {
        let (kind, param, code) = match self {
            ApiError::BadRequest(b) => ("invalid_request_error", b.param.as_deref(), None),
            ApiError::TooLarge(_) => ("invalid_request_error", None, Some("request_too_large")),
            ApiError::BodyTimeout(_) => ("invalid_request_error", None, Some("request_timeout")),
            ApiError::UnknownModel(_) => (
                "invalid_request_error",
                Some("model"),
                Some("model_not_found"),
            ),
            ApiError::Route(RouteError::NoInstances { .. }) | ApiError::ModelUnavailable(_) => {
                ("server_error", None, Some("no_available_worker"))
            }
            ApiError::Route(RouteError::Busy { .. }) => {
                ("server_error", None, Some("workers_busy"))
            }
            ApiError::Overloaded(_) => ("server_error", None, Some("router_overloaded")),
            ApiError::NoEligibleWorker(_) => ("server_error", None, Some("no_eligible_worker")),
            ApiError::Route(RouteError::Rejected(_)) => {
                ("server_error", None, Some("rejected_by_policy"))
            }
            ApiError::Upstream(_) => ("server_error", None, Some("upstream_error")),
            ApiError::UpstreamTimeout(_) => ("server_error", None, Some("upstream_timeout")),
            ApiError::Internal(_) => ("server_error", None, Some("internal_error")),
            ApiError::Unauthorized(_) => ("authentication_error", None, Some("invalid_api_key")),
            ApiError::NotFound(_) => ("invalid_request_error", None, Some("not_found")),
            ApiError::Refused(_) => ("invalid_request_error", None, Some("refused")),
            ApiError::ShuttingDown => ("server_error", None, Some("shutting_down")),
            ApiError::Route(RouteError::Saturated { .. }) => {
                ("server_error", None, Some("fleet_full"))
            }
            ApiError::Route(RouteError::Late { .. }) => {
                ("server_error", None, Some("objectives_unmet"))
            }
            ApiError::Shed(s) => ("server_error", None, Some(s.reason.code())),
        };
        let mut builder = Response::builder()
            .status(self.status())
            .header("content-type", "application/json");
        if matches!(self, ApiError::Unauthorized(_)) {
            builder = builder.header("www-authenticate", "Bearer");
        }
        if let Some(after) = self.retry_after() {
            builder = builder.header("retry-after", after.as_secs().max(1));
        }
        builder
            .body(
                Full::new(Bytes::from(openai::error_body(
                    &self.to_string(),
                    kind,
                    param,
                    code,
                )))
                .map_err(|e| match e {})
                .boxed(),
            )
            .expect("valid response")
    }
}

/// `f` on a blocking thread, off the async workers; its panic is the router's own fault
/// (500), not a worker's.
pub(crate) async fn off_thread<T: Send + 'static>(
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Internal(format!("{what} failed: {e}")))
}

/// `f` off the async workers when `large` (a request body past 8 KiB parsed or written
/// again), else here.
pub(crate) async fn off_thread_if<T: Send + 'static>(
    large: bool,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    if large {
        off_thread(what, f).await
    } else {
        Ok(f())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_off_the_async_threads_is_the_routers_own_500() {
        let ok = off_thread("adding", || 2 + 2).await.unwrap();
        assert_eq!(ok, 4);
        let err = off_thread("the request parser", || -> u32 { panic!("a bug") })
            .await
            .unwrap_err();
        assert_eq!(err.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = err
            .response()
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "internal_error", "{v}");
        assert_eq!(v["error"]["type"], "server_error", "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with("the router failed: the request parser failed"),
            "{v}"
        );
    }
}
