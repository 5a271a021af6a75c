//! Faults a mock worker can be given, by flag or at run time (`POST /admin/fault`).

use hyper::{Response, StatusCode};
use serde::Deserialize;

use super::Body;
use super::reply::error;

/// An injected fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// Behave.
    None,
    /// Exit the process at once (with `after_tokens`: once a stream has sent that many).
    Crash,
    /// Accept requests and never answer.
    Hang,
    /// Close the listening socket: connections are refused.
    Refuse,
    /// Answer every completion with HTTP 500.
    Error,
    /// Cut streaming responses half-way (with `after_tokens`: after that many).
    CutStream,
    /// Answer every completion with `status` (default 500), with `Retry-After` when
    /// `retry_after_secs` is set (e.g. 503 or 429: load shedding).
    Status,
    /// Send the first chunk of a stream (with `after_tokens`: that many), then nothing (a
    /// non-streaming request hangs); health still answers 200.
    Stall,
}

/// A fault and when it starts, plus faults that apply to some requests or connections.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct FaultConfig {
    /// The fault.
    pub fault: Fault,
    /// It starts after this many completion requests were served.
    #[serde(default)]
    pub after: u64,
    /// The status of [`Fault::Status`] and of marked prompts [default: 500].
    #[serde(default)]
    pub status: Option<u16>,
    /// A `Retry-After` (seconds) on those answers. Any number, written as Rust prints
    /// it: a faithful engine sends whole seconds, a broken one anything (`1e20` is
    /// written `100000000000000000000`).
    #[serde(default)]
    pub retry_after_secs: Option<f64>,
    /// Where a stream's `crash`, `cut_stream` or `stall` strikes: after this many tokens.
    #[serde(default)]
    pub after_tokens: Option<u32>,
    /// Prompts containing this text are answered `status` (a "poison" request), whatever
    /// the fault.
    #[serde(default)]
    pub marker: Option<String>,
    /// Instead, marked prompts' streams are cut after this many tokens (a request that
    /// breaks every worker it reaches mid-stream).
    #[serde(default)]
    pub marker_after_tokens: Option<u32>,
    /// `/health` answers 200 whatever the fault.
    #[serde(default)]
    pub health_lies: bool,
    /// Every completion waits this long before it starts (a slow first token).
    #[serde(default)]
    pub first_token_delay_ms: u64,
    /// Keep-alive connections idle this long are closed (as uvicorn does after 5 s).
    #[serde(default)]
    pub idle_close_ms: Option<u64>,
}

impl FaultConfig {
    /// No fault.
    pub const NONE: FaultConfig = FaultConfig {
        fault: Fault::None,
        after: 0,
        status: None,
        retry_after_secs: None,
        after_tokens: None,
        marker: None,
        marker_after_tokens: None,
        health_lies: false,
        first_token_delay_ms: 0,
        idle_close_ms: None,
    };

    /// The answer of [`Fault::Status`] and of marked prompts.
    pub(super) fn status_answer(&self, message: &str) -> Response<Body> {
        let status = self
            .status
            .and_then(|s| StatusCode::from_u16(s).ok())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut r = error(status, message, "server_error", None);
        if let Some(secs) = self.retry_after_secs
            && let Ok(v) = hyper::header::HeaderValue::from_str(&secs.to_string())
        {
            r.headers_mut().insert(hyper::header::RETRY_AFTER, v);
        }
        r
    }
}
