//! The etcd v3 API through etcd's own JSON gateway (HTTP/1.1 on the client port, served
//! by every etcd since 3.3 at `/v3/...`): range, put, delete, leases and watches.
//!
//! Why not gRPC: the gRPC client crates build their protocol code with `protoc` at compile
//! time, which a machine with only Rust does not have; the gateway carries the same API
//! as JSON (64-bit integers as decimal strings, bytes as base64) over the HTTP client the
//! router already has. A watch is one long POST whose response is a stream of JSON
//! objects, one per watch response.
//!
//! `https://` endpoints are checked against the system roots plus the operator's CA files
//! (the same TLS as for workers). With a user and password the client authenticates
//! (`/v3/auth/authenticate`) and sends the token etcd gives with every call; a token etcd
//! no longer accepts (expired, or the server restarted) is replaced once per call.
//!
//! Only `discovery/etcd*` uses this module.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{Value, json};

use super::DiscoveryError;
use switchyard_net::upstream::{Connector, Tls};

/// etcd's own user authentication.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdAuth {
    /// The etcd user.
    pub user: String,
    /// Its password (never printed).
    pub password: String,
}

impl std::fmt::Debug for EtcdAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdAuth")
            .field("user", &self.user)
            .finish_non_exhaustive()
    }
}

/// Largest JSON answer read whole (a range over many instances and policies).
const MAX_ANSWER: usize = 256 << 20;

/// A key and its value as etcd stores them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    /// The key.
    pub key: Vec<u8>,
    /// The value.
    pub value: Vec<u8>,
    /// Revision of the key's creation.
    pub create_revision: i64,
    /// Revision of its last change.
    pub mod_revision: i64,
    /// Its lease (0: none).
    pub lease: i64,
}

/// A change seen by a watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The key was written.
    Put(Kv),
    /// The key was deleted (only `key` and `mod_revision` are set).
    Delete(Kv),
}

/// An etcd cluster, reached at its client URLs (tried in turn).
#[derive(Clone)]
pub struct EtcdApi {
    endpoints: Vec<String>,
    http: HttpClient<Connector, Full<Bytes>>,
    timeout: Duration,
    /// The endpoint to try first (the last one that answered).
    current: std::sync::Arc<AtomicUsize>,
    /// Credentials, and the token they were last exchanged for.
    auth: Option<std::sync::Arc<(EtcdAuth, Mutex<Option<String>>)>>,
}

impl std::fmt::Debug for EtcdApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdApi")
            .field("endpoints", &self.endpoints)
            .finish()
    }
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn unb64(text: Option<&str>) -> Result<Vec<u8>, String> {
    text.map_or(Ok(Vec::new()), |t| {
        base64::engine::general_purpose::STANDARD
            .decode(t)
            .map_err(|e| format!("bad base64 from etcd: {e}"))
    })
}

/// A 64-bit integer as the gateway writes it (a decimal string; absent means 0).
fn int(v: &Value) -> i64 {
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

/// The end of the range of keys that start with `prefix` (etcd's "prefix" convention).
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

#[derive(Deserialize)]
struct RawKv {
    key: Option<String>,
    value: Option<String>,
    #[serde(default)]
    create_revision: Value,
    #[serde(default)]
    mod_revision: Value,
    #[serde(default)]
    lease: Value,
}

impl RawKv {
    fn into_kv(self) -> Result<Kv, String> {
        Ok(Kv {
            key: unb64(self.key.as_deref())?,
            value: unb64(self.value.as_deref())?,
            create_revision: int(&self.create_revision),
            mod_revision: int(&self.mod_revision),
            lease: int(&self.lease),
        })
    }
}

impl EtcdApi {
    /// A client of the etcd at `endpoints` (`http://host:port`), giving each call
    /// `timeout`.
    pub fn new(endpoints: &[String], timeout: Duration) -> EtcdApi {
        EtcdApi::with_access(endpoints, timeout, &Tls::default(), None)
    }

    /// A client with TLS trust for `https://` endpoints and, optionally, credentials.
    pub fn with_access(
        endpoints: &[String],
        timeout: Duration,
        tls: &Tls,
        auth: Option<EtcdAuth>,
    ) -> EtcdApi {
        EtcdApi {
            endpoints: endpoints
                .iter()
                .map(|e| e.trim_end_matches('/').to_string())
                .collect(),
            http: HttpClient::builder(TokioExecutor::new()).build(tls.connector(timeout)),
            timeout,
            current: std::sync::Arc::default(),
            auth: auth.map(|a| std::sync::Arc::new((a, Mutex::new(None)))),
        }
    }

    fn error(&self, why: impl std::fmt::Display) -> DiscoveryError {
        DiscoveryError::Etcd {
            endpoints: self.endpoints.join(","),
            why: why.to_string(),
        }
    }

    /// Sends `body` to `path` on the first endpoint that answers, authenticated when the
    /// client has credentials; returns the answer's head and body (not read).
    async fn send(
        &self,
        path: &str,
        body: &Value,
    ) -> Result<hyper::Response<Incoming>, DiscoveryError> {
        let Some(auth) = &self.auth else {
            return self.send_as(path, body, None).await;
        };
        let cached = auth.1.lock().clone();
        let token = match cached {
            Some(t) => t,
            None => self.authenticate(&auth.0).await?,
        };
        let resp = self.send_as(path, body, Some(&token)).await?;
        if resp.status() != hyper::StatusCode::UNAUTHORIZED {
            return Ok(resp);
        }
        // The token is no longer valid (expired, or a restarted server): once more with
        // a fresh one.
        let token = self.authenticate(&auth.0).await?;
        self.send_as(path, body, Some(&token)).await
    }

    /// Exchanges the credentials for a token and keeps it.
    async fn authenticate(&self, auth: &EtcdAuth) -> Result<String, DiscoveryError> {
        let body = json!({"name": auth.user, "password": auth.password});
        let resp = self.send_as("/v3/auth/authenticate", &body, None).await?;
        let v = self
            .answer("/v3/auth/authenticate", resp)
            .await
            .map_err(|e| self.error(format!("etcd refused user `{}`: {e}", auth.user)))?;
        let token = v
            .get("token")
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                self.error(format!(
                    "etcd gave user `{}` no token (is authentication enabled on it?)",
                    auth.user
                ))
            })?
            .to_string();
        if let Some(a) = &self.auth {
            *a.1.lock() = Some(token.clone());
        }
        Ok(token)
    }

    async fn send_as(
        &self,
        path: &str,
        body: &Value,
        token: Option<&str>,
    ) -> Result<hyper::Response<Incoming>, DiscoveryError> {
        if self.endpoints.is_empty() {
            return Err(self.error("no etcd endpoint configured"));
        }
        let body = Bytes::from(body.to_string());
        let first = self.current.load(Ordering::Relaxed);
        let mut last = String::new();
        for i in 0..self.endpoints.len() {
            let n = (first + i) % self.endpoints.len();
            let uri = format!("{}{path}", self.endpoints[n]);
            let mut req =
                hyper::Request::post(uri.as_str()).header("content-type", "application/json");
            if let Some(token) = token {
                req = req.header("authorization", token);
            }
            let req = req
                .body(Full::new(body.clone()))
                .map_err(|e| self.error(format!("bad etcd URL {uri}: {e}")))?;
            match tokio::time::timeout(self.timeout, self.http.request(req)).await {
                Ok(Ok(resp)) => {
                    self.current.store(n, Ordering::Relaxed);
                    return Ok(resp);
                }
                Ok(Err(e)) => last = format!("{uri}: {}", switchyard_net::error_chain(&e)),
                Err(_) => last = format!("{uri}: no answer within {:?}", self.timeout),
            }
        }
        Err(self.error(last))
    }

    /// One unary call of the gateway (`path` such as `/v3/auth/enable`): the answer's
    /// JSON, or the error etcd gave.
    pub async fn call(&self, path: &str, body: Value) -> Result<Value, DiscoveryError> {
        let resp = self.send(path, &body).await?;
        self.answer(path, resp).await
    }

    /// An answer's JSON, or the error etcd gave.
    async fn answer(
        &self,
        path: &str,
        resp: hyper::Response<Incoming>,
    ) -> Result<Value, DiscoveryError> {
        let status = resp.status();
        let bytes = tokio::time::timeout(
            self.timeout,
            Limited::new(resp.into_body(), MAX_ANSWER).collect(),
        )
        .await
        .map_err(|_| self.error(format!("{path}: the answer did not finish in time")))?
        .map_err(|e| self.error(format!("{path}: {e}")))?
        .to_bytes();
        let v: Value = serde_json::from_slice(&bytes)
            .map_err(|e| self.error(format!("{path}: not JSON ({e})")))?;
        if !status.is_success() || v.get("error").is_some() {
            let message = v
                .get("message")
                .or_else(|| v.get("error"))
                .and_then(Value::as_str)
                .unwrap_or("no message");
            return Err(self.error(format!("{path}: {status}: {message}")));
        }
        Ok(v)
    }

    /// Every key under `prefix`, and the revision they were read at.
    pub async fn range_prefix(&self, prefix: &str) -> Result<(Vec<Kv>, i64), DiscoveryError> {
        self.range(prefix, false).await
    }

    /// Every key under `prefix`, without their values (empty).
    pub async fn keys_with_prefix(&self, prefix: &str) -> Result<Vec<Kv>, DiscoveryError> {
        Ok(self.range(prefix, true).await?.0)
    }

    async fn range(&self, prefix: &str, keys_only: bool) -> Result<(Vec<Kv>, i64), DiscoveryError> {
        let v = self
            .call(
                "/v3/kv/range",
                json!({"key": b64(prefix.as_bytes()), "range_end": b64(&prefix_end(prefix.as_bytes())), "keys_only": keys_only}),
            )
            .await?;
        range_answer(&v).map_err(|e| self.error(e))
    }

    /// Writes `key`, bound to `lease` if given.
    pub async fn put(
        &self,
        key: &str,
        value: &[u8],
        lease: Option<i64>,
    ) -> Result<(), DiscoveryError> {
        let mut body = json!({"key": b64(key.as_bytes()), "value": b64(value)});
        if let Some(l) = lease {
            body["lease"] = json!(l.to_string());
        }
        self.call("/v3/kv/put", body).await.map(|_| ())
    }

    /// Deletes `key`, or every key under it with `prefix`.
    pub async fn delete(&self, key: &str, prefix: bool) -> Result<(), DiscoveryError> {
        let mut body = json!({"key": b64(key.as_bytes())});
        if prefix {
            body["range_end"] = json!(b64(&prefix_end(key.as_bytes())));
        }
        self.call("/v3/kv/deleterange", body).await.map(|_| ())
    }

    /// A new lease of `ttl` seconds; returns its ID.
    pub async fn lease_grant(&self, ttl: i64) -> Result<i64, DiscoveryError> {
        let v = self
            .call("/v3/lease/grant", json!({"TTL": ttl.to_string()}))
            .await?;
        match int(&v["ID"]) {
            0 => Err(self.error("lease grant returned no ID")),
            id => Ok(id),
        }
    }

    /// Renews `lease`; returns its remaining TTL in seconds (0 or less: it is gone).
    pub async fn lease_keep_alive(&self, lease: i64) -> Result<i64, DiscoveryError> {
        let v = self
            .call("/v3/lease/keepalive", json!({"ID": lease.to_string()}))
            .await?;
        Ok(int(&v["result"]["TTL"]))
    }

    /// Revokes `lease`: the keys bound to it are deleted at once.
    pub async fn lease_revoke(&self, lease: i64) -> Result<(), DiscoveryError> {
        self.call("/v3/lease/revoke", json!({"ID": lease.to_string()}))
            .await
            .map(|_| ())
    }

    /// Whether the member answers and has a leader (one without a leader answers
    /// status calls but can serve nothing).
    pub async fn status(&self) -> Result<(), DiscoveryError> {
        let v = self.call("/v3/maintenance/status", json!({})).await?;
        // A member ID is a u64 (as a JSON string, often past i64): only "0" or none
        // means no leader.
        let leader = match &v["leader"] {
            Value::String(s) => s.as_str() != "0" && !s.is_empty(),
            Value::Number(n) => n.as_u64() != Some(0),
            _ => false,
        };
        if !leader {
            return Err(self.error("the etcd member has no leader"));
        }
        Ok(())
    }

    /// How many keys are under `prefix`, and the newest revision at which one of them was
    /// written: a linearizable read (it needs a leader) that returns one key at most.
    pub async fn prefix_summary(&self, prefix: &str) -> Result<(i64, i64), DiscoveryError> {
        let v = self
            .call(
                "/v3/kv/range",
                json!({
                    "key": b64(prefix.as_bytes()),
                    "range_end": b64(&prefix_end(prefix.as_bytes())),
                    "keys_only": true,
                    "limit": "1",
                    "sort_order": "DESCEND",
                    "sort_target": "MOD",
                }),
            )
            .await?;
        let newest = v
            .get("kvs")
            .and_then(Value::as_array)
            .and_then(|kvs| kvs.first())
            .map_or(0, |kv| int(&kv["mod_revision"]));
        Ok((int(&v["count"]), newest))
    }

    /// Watches every key under `prefix` from `start_revision`; `listed` are the keys a
    /// range read at `start_revision - 1`, which the watch keeps up to date to check
    /// itself against etcd ([`Watch::check`]).
    pub async fn watch_prefix(
        &self,
        prefix: &str,
        listed: &[Kv],
        start_revision: i64,
    ) -> Result<Watch, DiscoveryError> {
        let body = json!({"create_request": {
            "key": b64(prefix.as_bytes()),
            "range_end": b64(&prefix_end(prefix.as_bytes())),
            "start_revision": start_revision.to_string(),
        }});
        let resp = self.send("/v3/watch", &body).await?;
        if !resp.status().is_success() {
            return Err(self.error(format!("watch: {}", resp.status())));
        }
        let mut watch = Watch {
            body: resp.into_body(),
            lines: switchyard_bounded::lines::Lines::default(),
            api: self.clone(),
            prefix: prefix.to_string(),
            keys: listed.iter().map(|kv| kv.key.clone()).collect(),
            seen_revision: listed.iter().map(|kv| kv.mod_revision).max().unwrap_or(0),
            delivered: false,
            suspect: None,
            next_check: tokio::time::Instant::now(),
            check_every: self.timeout,
        };
        // The first answer confirms the watch was created.
        let first = watch.message().await?;
        if first["result"]["created"] != true {
            return Err(self.error(format!("watch was not created: {first}")));
        }
        Ok(watch)
    }
}

/// An open watch: a stream of JSON watch responses.
///
/// A watch can die without a word: the member or NAT path holding its connection can
/// vanish without a reset while every other call still succeeds. So the watch keeps what
/// it has seen (the keys under its prefix, the newest revision written) and
/// [`Watch::check`] compares it with etcd on another connection; a difference that the
/// watch does not deliver by the next check means it is dead.
pub struct Watch {
    body: Incoming,
    lines: switchyard_bounded::lines::Lines,
    api: EtcdApi,
    prefix: String,
    /// The keys under the prefix as the listing and the watch's events have them.
    keys: std::collections::HashSet<Vec<u8>>,
    /// The newest `mod_revision` the listing or an event has shown.
    seen_revision: i64,
    /// Whether the stream delivered anything since the last check.
    delivered: bool,
    /// What the last check found missing, if anything.
    suspect: Option<String>,
    /// When [`Watch::next_checked`] checks next (at once, then every call timeout).
    next_check: tokio::time::Instant,
    check_every: std::time::Duration,
}

impl Watch {
    /// Compares what the watch has seen with etcd: an `Err` when etcd showed changes
    /// (more or fewer keys, or a newer write) at the previous check that the watch has
    /// not delivered anything since — the stream is dead, and the caller re-lists.
    /// A live watch that is merely behind delivers within one check's interval.
    pub async fn check(&mut self) -> Result<(), DiscoveryError> {
        let (count, newest) = self.api.prefix_summary(&self.prefix).await?;
        let known = i64::try_from(self.keys.len()).unwrap_or(i64::MAX);
        let behind = (count != known || newest > self.seen_revision).then(|| {
            format!(
                "etcd holds {count} keys written up to revision {newest}; the watch has {known} up to {}",
                self.seen_revision
            )
        });
        let delivered = std::mem::take(&mut self.delivered);
        match (self.suspect.take(), behind) {
            (Some(earlier), Some(_)) if !delivered => Err(self.api.error(format!(
                "the watch on {} delivered nothing since etcd moved on ({earlier})",
                self.prefix
            ))),
            (_, behind) => {
                self.suspect = behind;
                Ok(())
            }
        }
    }

    /// The next JSON object of the stream.
    async fn message(&mut self) -> Result<Value, DiscoveryError> {
        loop {
            // Objects are separated by newlines; blank lines are skipped.
            if let Some(line) = self.lines.next_line() {
                let line = line.trim_ascii();
                if line.is_empty() {
                    continue;
                }
                let parsed = serde_json::from_slice(line);
                return parsed.map_err(|e| self.api.error(format!("watch: not JSON ({e})")));
            }
            if self.lines.pending() > MAX_ANSWER {
                return Err(self.api.error("watch: an answer is too large"));
            }
            match self.body.frame().await {
                None => {
                    let rest = self.lines.rest().trim_ascii();
                    if rest.is_empty() {
                        return Err(self.api.error("the watch stream ended"));
                    }
                    // A last object without a newline.
                    let parsed = serde_json::from_slice(rest);
                    return parsed.map_err(|e| self.api.error(format!("watch: not JSON ({e})")));
                }
                Some(Err(e)) => return Err(self.api.error(format!("watch: {e}"))),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.lines.push(&data);
                    }
                }
            }
        }
    }

    /// [`Watch::next`], with the watch [checked](Watch::check) at every call timeout while
    /// it waits: what every long-lived watch runs.
    pub async fn next_checked(&mut self) -> Result<Vec<Event>, DiscoveryError> {
        loop {
            match tokio::time::timeout_at(self.next_check, self.next()).await {
                Ok(events) => return events,
                Err(_) => {
                    self.next_check = tokio::time::Instant::now() + self.check_every;
                    self.check().await?;
                }
            }
        }
    }

    /// The events of the next watch response that has any. Ends with an error when the
    /// watch is canceled (e.g. its start revision was compacted) or the stream breaks.
    pub async fn next(&mut self) -> Result<Vec<Event>, DiscoveryError> {
        loop {
            let v = self.message().await?;
            self.delivered = true;
            let out = watch_answer(&v).map_err(|e| self.api.error(e))?;
            for e in &out {
                let (Event::Put(kv) | Event::Delete(kv)) = e;
                self.seen_revision = self.seen_revision.max(kv.mod_revision);
                match e {
                    Event::Put(_) => self.keys.insert(kv.key.clone()),
                    Event::Delete(_) => self.keys.remove(&kv.key),
                };
            }
            if !out.is_empty() {
                return Ok(out);
            }
        }
    }
}

/// The keys of a range answer of the gateway, and the revision they were read at.
pub fn range_answer(v: &Value) -> Result<(Vec<Kv>, i64), String> {
    let revision = int(&v["header"]["revision"]);
    let kvs = match v.get("kvs") {
        Some(list) => serde_json::from_value::<Vec<RawKv>>(list.clone())
            .map_err(|e| format!("range: {e}"))?
            .into_iter()
            .map(RawKv::into_kv)
            .collect::<Result<Vec<_>, _>>()?,
        None => Vec::new(),
    };
    Ok((kvs, revision))
}

/// The events of one watch answer of the gateway (none for a progress or creation
/// answer); an error when the watch failed or was canceled (e.g. its start revision was
/// compacted).
pub fn watch_answer(v: &Value) -> Result<Vec<Event>, String> {
    if let Some(e) = v.get("error") {
        return Err(format!("watch: {e}"));
    }
    let result = &v["result"];
    if result["canceled"] == true {
        return Err(format!(
            "watch canceled (compacted at {}): {}",
            int(&result["compact_revision"]),
            result["cancel_reason"].as_str().unwrap_or("")
        ));
    }
    let Some(events) = result.get("events").and_then(Value::as_array) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::with_capacity(events.len());
    for e in events {
        let kv: RawKv =
            serde_json::from_value(e["kv"].clone()).map_err(|err| format!("watch event: {err}"))?;
        let kv = kv.into_kv()?;
        out.push(if e["type"] == "DELETE" {
            Event::Delete(kv)
        } else {
            Event::Put(kv)
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_range_ends_after_every_key_that_starts_with_it() {
        assert_eq!(prefix_end(b"a/b/"), b"a/b0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }

    #[test]
    fn gateway_integers_and_bytes_are_decoded() {
        let raw: RawKv = serde_json::from_value(json!({
            "key": "Zm9vL2E=", "value": "YmFy", "create_revision": "2",
            "mod_revision": "7", "lease": "2324035769577435655"
        }))
        .unwrap();
        let kv = raw.into_kv().unwrap();
        assert_eq!(kv.key, b"foo/a");
        assert_eq!(kv.value, b"bar");
        assert_eq!((kv.create_revision, kv.mod_revision), (2, 7));
        assert_eq!(kv.lease, 2324035769577435655);
        // Absent fields are zero or empty, as the gateway omits defaults.
        let raw: RawKv = serde_json::from_value(json!({"key": "Zm9vL2E="})).unwrap();
        let kv = raw.into_kv().unwrap();
        assert_eq!((kv.value.len(), kv.lease, kv.mod_revision), (0, 0, 0));
    }
}
