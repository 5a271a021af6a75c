//! The Kubernetes API, as much of it as discovery reads: a GET of one object or a list,
//! and a watch (a long GET whose answer is a stream of JSON events, one a line). Over
//! the HTTP client the router already has, with a bearer token (a service account's, in
//! a cluster) and the API server's CA. Every answer is read within a size bound and a
//! deadline; a watch's events each within [`MAX_EVENT`], its silence within the idle
//! limit the caller gives (the server sends a bookmark at least every minute or so
//! when asked for them).
//!
//! Only `discovery/kube*` uses this module.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use switchyard_net::upstream::{Connector, Tls};

/// The largest list answer read (thousands of pods are a few MiB).
pub const MAX_LIST: usize = 64 << 20;

/// The largest watch event read (one pod object).
pub const MAX_EVENT: usize = 4 << 20;

/// Why a call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum KubeError {
    /// The API server could not be reached, or broke the answer off.
    #[error("the Kubernetes API at {server}: {why}")]
    Unreachable {
        /// The server's URL.
        server: String,
        /// What went wrong.
        why: String,
    },
    /// The server refused: its status, and its own message (a 403 names the verb, the
    /// resource and the namespace the service account lacks).
    #[error("the Kubernetes API refused {what}: {status}: {message}")]
    Refused {
        /// What was asked.
        what: String,
        /// The HTTP status.
        status: u16,
        /// The server's message.
        message: String,
    },
    /// A watch's resource version is too old (410 Gone): list again.
    #[error("the watch's resource version is gone (410): listing again")]
    Gone,
}

/// Where the bearer token comes from.
#[derive(Debug, Clone)]
pub enum Token {
    /// This token.
    Fixed(String),
    /// The token in this file, read again for every call (a service account's projected
    /// token is rotated in place), within 64 KiB.
    File(std::path::PathBuf),
}

/// A client of one API server.
#[derive(Clone)]
pub struct KubeApi {
    server: String,
    token: Option<Token>,
    http: HttpClient<Connector, Empty<Bytes>>,
    timeout: Duration,
}

impl std::fmt::Debug for KubeApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeApi")
            .field("server", &self.server)
            .field("token", &self.token.as_ref().map(|_| "(set)"))
            .finish()
    }
}

impl KubeApi {
    /// A client of the server at `server` (`https://host:port`), sending `token` as a
    /// bearer token when there is one, trusting `tls`'s roots; each call and connection
    /// within `timeout`.
    pub fn new(server: &str, token: Option<Token>, tls: &Tls, timeout: Duration) -> KubeApi {
        KubeApi {
            server: server.trim_end_matches('/').to_string(),
            token,
            http: HttpClient::builder(TokioExecutor::new()).build(tls.connector(timeout)),
            timeout,
        }
    }

    fn unreachable(&self, why: impl std::fmt::Display) -> KubeError {
        KubeError::Unreachable {
            server: self.server.clone(),
            why: why.to_string(),
        }
    }

    async fn send(&self, path: &str) -> Result<hyper::Response<Incoming>, KubeError> {
        let uri = format!("{}{path}", self.server);
        let mut req = hyper::Request::get(uri.as_str()).header("accept", "application/json");
        let token = match &self.token {
            None => None,
            Some(Token::Fixed(t)) => Some(t.clone()),
            Some(Token::File(path)) => Some(
                switchyard_bounded::files::read_to_string(path, 64 << 10)
                    .map_err(|e| {
                        self.unreachable(format!("the token file {}: {e}", path.display()))
                    })?
                    .trim()
                    .to_string(),
            ),
        };
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let req = req
            .body(Empty::new())
            .map_err(|e| self.unreachable(format!("bad URL {uri}: {e}")))?;
        match tokio::time::timeout(self.timeout, self.http.request(req)).await {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) => Err(self.unreachable(switchyard_net::error_chain(&e))),
            Err(_) => Err(self.unreachable(format!("no answer within {:?}", self.timeout))),
        }
    }

    /// The JSON at `path` (an object or a list), read within [`MAX_LIST`] and the call
    /// timeout; `what` names it in errors (`list pods in namespace x`).
    pub async fn get(&self, path: &str, what: &str) -> Result<Value, KubeError> {
        let resp = self.send(path).await?;
        let status = resp.status();
        let bytes = tokio::time::timeout(
            self.timeout,
            Limited::new(resp.into_body(), MAX_LIST).collect(),
        )
        .await
        .map_err(|_| self.unreachable(format!("{what}: the answer did not finish in time")))?
        .map_err(|e| self.unreachable(format!("{what}: {e}")))?
        .to_bytes();
        let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        if !status.is_success() {
            return Err(refused(what, status.as_u16(), &v));
        }
        Ok(v)
    }

    /// A watch of `path` (which carries `watch=1` and its resource version); its events
    /// as they come, each within [`MAX_EVENT`], the stream silent at most `idle`.
    pub async fn watch(
        &self,
        path: &str,
        what: &str,
        idle: Duration,
    ) -> Result<KubeWatch, KubeError> {
        let resp = self.send(path).await?;
        let status = resp.status();
        if !status.is_success() {
            let body = tokio::time::timeout(
                self.timeout,
                Limited::new(resp.into_body(), MAX_EVENT).collect(),
            )
            .await;
            let v = match body {
                Ok(Ok(b)) => serde_json::from_slice(&b.to_bytes()).unwrap_or(Value::Null),
                _ => Value::Null,
            };
            if status.as_u16() == 410 {
                return Err(KubeError::Gone);
            }
            return Err(refused(what, status.as_u16(), &v));
        }
        Ok(KubeWatch {
            body: resp.into_body(),
            lines: switchyard_bounded::lines::Lines::default(),
            api: self.clone(),
            idle,
        })
    }
}

/// A refusal with the server's own message (a `Status` object's).
fn refused(what: &str, status: u16, v: &Value) -> KubeError {
    let message = v
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("no message")
        .chars()
        .take(1024)
        .collect();
    KubeError::Refused {
        what: what.to_string(),
        status,
        message,
    }
}

/// An open watch.
pub struct KubeWatch {
    body: Incoming,
    lines: switchyard_bounded::lines::Lines,
    api: KubeApi,
    idle: Duration,
}

/// One watch event.
#[derive(Debug, Clone)]
pub struct WatchEvent {
    /// `ADDED`, `MODIFIED`, `DELETED` or `BOOKMARK`.
    pub kind: String,
    /// The object (for a bookmark, only its resource version).
    pub object: Value,
}

impl KubeWatch {
    /// The next event; `Ok(None)` when the server ended the watch (its timeout): watch
    /// again from the last resource version. An `ERROR` event is [`KubeError::Gone`]
    /// for a 410, else a refusal.
    pub async fn next(&mut self) -> Result<Option<WatchEvent>, KubeError> {
        loop {
            if let Some(line) = self.lines.next_line() {
                let line = line.trim_ascii();
                if line.is_empty() {
                    continue;
                }
                let v: Value = serde_json::from_slice(line)
                    .map_err(|e| self.api.unreachable(format!("watch: not JSON ({e})")))?;
                return event(v).map(Some);
            }
            if self.lines.pending() > MAX_EVENT {
                return Err(self.api.unreachable("watch: an event is too large"));
            }
            let frame = tokio::time::timeout(self.idle, self.body.frame())
                .await
                .map_err(|_| {
                    self.api
                        .unreachable(format!("the watch was silent for {:?}", self.idle))
                })?;
            match frame {
                None => return Ok(None),
                Some(Err(e)) => return Err(self.api.unreachable(format!("watch: {e}"))),
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data() {
                        self.lines.push(&data);
                    }
                }
            }
        }
    }
}

/// A watch line as an event.
pub fn event(v: Value) -> Result<WatchEvent, KubeError> {
    let kind = v.get("type").and_then(Value::as_str).unwrap_or_default();
    if kind == "ERROR" {
        let code = v["object"]["code"].as_u64().unwrap_or(0);
        if code == 410 {
            return Err(KubeError::Gone);
        }
        return Err(refused(
            "watch",
            u16::try_from(code).unwrap_or(0),
            &v["object"],
        ));
    }
    Ok(WatchEvent {
        kind: kind.to_string(),
        object: v.get("object").cloned().unwrap_or(Value::Null),
    })
}
