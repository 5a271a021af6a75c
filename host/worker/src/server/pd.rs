//! Disaggregated prefill and decode: the KV handoff between a prefill worker and a decode
//! worker, in each engine's own protocol, so that routers (Switchyard's, and the peers'
//! P/D modes) drive the mock as they drive the engines.
//!
//! **vLLM** (the KV-connector flow of its disaggregated proxy example and `NixlConnector`,
//! vLLM 0.10–0.11):
//! - the prefill worker gets the request with `kv_transfer_params` `{"do_remote_decode":
//!   true, "do_remote_prefill": false, ...}` (the router sets `max_tokens` 1 and no
//!   streaming), computes the prompt, keeps its blocks for the decode worker and answers
//!   with `kv_transfer_params` `{"do_remote_prefill": true, "do_remote_decode": false,
//!   "remote_block_ids": [...], "remote_engine_id": ..., "remote_request_id": ...,
//!   "remote_host": ..., "remote_port": ..., "tp_size": 1}`;
//! - the decode worker gets the client's request with those parameters, pulls the blocks
//!   it does not hold already from `remote_host:remote_port`, and decodes. A pull that
//!   fails is recomputed locally (vLLM's "recompute" on a failed KV load). Without
//!   `kv_transfer_params` either worker serves the whole request, as vLLM does.
//!
//! **SGLang** (its `disaggregation` module, 0.4–0.5):
//! - the router sends the same request to both workers at once, with `bootstrap_host`,
//!   `bootstrap_port` (the prefill worker's) and `bootstrap_room` (a random number naming
//!   the handoff);
//! - the prefill worker computes the prompt and one token and keeps the KV under the room;
//! - the decode worker asks the prefill worker's bootstrap server for the room, waits for
//!   its prefill, receives the KV and decodes; a transfer that fails aborts the request
//!   (500). Either worker refuses a request without a room (SGLang's disaggregation mode
//!   has no aggregated path).
//!
//! The prefill keeps its KV under its request's ID (its `X-Request-Id` when it has one)
//! and names it `remote_request_id`, which the decode worker's pull and its "done" name,
//! as `NixlConnector` does since its metadata version 2 (vLLM 0.32 checked): the legs'
//! own request IDs need not match.
//!
//! The mock's transfer: `GET /handoff/{key}?have=N[&wait=1]` on the prefill worker (its
//! HTTP port for vLLM, its bootstrap port for SGLang; SGLang's decode worker waits for a
//! prefill running beside it, vLLM's finds it done or not at all), holds the blocks for
//! the simulated wire time of the blocks the decode worker lacks
//! (`transfer_us_per_token` per token of them, divided by the speed-up), releases them and answers
//! `{"blocks": N}`. Blocks kept for a decode worker that never comes are released after
//! [`HANDOFF_TTL`] (vLLM's abort timeout plays that part), and at most [`MAX_HANDOFFS`]
//! are kept (the oldest goes first).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::StatusCode;
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::Notify;

use crate::cache::Lease;
use crate::engine::Engine;
use switchyard_ids::Role;

/// Which engine a disaggregated worker plays. A mock worker takes part in either handoff
/// (the request's fields say which), so that one fleet serves every router's P/D mode;
/// the engine decides what a request without handoff fields gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum PdProtocol {
    /// vLLM's: a request without `kv_transfer_params` is served whole.
    #[default]
    Vllm,
    /// SGLang's: a request without a bootstrap room is refused (its disaggregated
    /// workers have no aggregated path).
    Sglang,
}

/// A worker's part in a disaggregated fleet.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PdConfig {
    /// Prefill, decode or both (an aggregated worker: no handoff).
    pub role: Role,
    /// The handoff protocol.
    pub protocol: PdProtocol,
    /// The port of a prefill worker's bootstrap server (SGLang's handoff).
    pub bootstrap_port: Option<u16>,
    /// Simulated wire time per token of the KV blocks moved, microseconds (divided by
    /// the speed-up).
    pub transfer_us_per_token: f64,
}

impl PdConfig {
    /// The engine the worker plays, as its `/v1/models` names it (`owned_by`): SGLang's
    /// with SGLang's handoff, else vLLM's.
    pub fn engine_name(&self) -> &'static str {
        match self.protocol {
            PdProtocol::Sglang => "sglang",
            PdProtocol::Vllm => "vllm",
        }
    }
}

impl Default for PdConfig {
    fn default() -> Self {
        PdConfig {
            role: Role::Both,
            protocol: PdProtocol::Vllm,
            bootstrap_port: None,
            // A token of an 8B model's KV is ~128 KiB: ~2.5 us at 50 GB/s, a sixteenth
            // of its prefill under the default timing model.
            transfer_us_per_token: 2.5,
        }
    }
}

/// How long KV kept for a decode worker waits for it.
pub const HANDOFF_TTL: Duration = Duration::from_secs(120);
/// Most handoffs kept at once.
pub const MAX_HANDOFFS: usize = 4096;
/// How long a decode worker waits for its prefill (SGLang: the prefill runs beside it).
pub const HANDOFF_WAIT: Duration = Duration::from_secs(60);
/// Largest answer read from a prefill worker's handoff route.
const MAX_HANDOFF_ANSWER: usize = 4096;

/// The handoff fields of a request body.
#[derive(Debug, Default, Deserialize)]
struct Fields {
    #[serde(default)]
    kv_transfer_params: Option<KvTransferParams>,
    #[serde(default)]
    bootstrap_host: Option<String>,
    #[serde(default)]
    bootstrap_port: Option<u16>,
    #[serde(default)]
    bootstrap_room: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
struct KvTransferParams {
    #[serde(default)]
    do_remote_decode: bool,
    #[serde(default)]
    do_remote_prefill: bool,
    #[serde(default)]
    remote_block_ids: Option<Vec<u64>>,
    #[serde(default)]
    remote_request_id: Option<String>,
    #[serde(default)]
    remote_host: Option<String>,
    #[serde(default)]
    remote_port: Option<u16>,
}

/// What a request asks of this worker's part in a handoff.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leg {
    /// No handoff: the whole request here.
    Whole,
    /// Compute the prompt and keep its KV under `key` for a decode worker.
    Prefill {
        /// The handoff's name (vLLM: made here; SGLang: the room).
        key: String,
        /// vLLM answers with the parameters the decode worker needs.
        vllm: bool,
    },
    /// Receive the prompt's KV from `host:port`'s handoff `key`, then decode.
    Decode {
        /// The prefill worker's host.
        host: String,
        /// Its handoff port.
        port: u16,
        /// The handoff's name.
        key: String,
        /// vLLM recomputes on a failed pull; SGLang aborts.
        vllm: bool,
    },
}

/// The leg `body` asks for on a worker with `pd`, or the 400 message.
pub fn leg(pd: &PdConfig, body: &[u8], fresh_key: impl FnOnce() -> String) -> Result<Leg, String> {
    let mentions = |needle: &[u8]| body.windows(needle.len()).any(|w| w == needle);
    let fields: Fields = if mentions(b"kv_transfer_params") || mentions(b"bootstrap_room") {
        serde_json::from_slice(body).map_err(|e| format!("bad handoff fields: {e}"))?
    } else {
        Fields::default()
    };
    if let Some(p) = fields.kv_transfer_params {
        return vllm_leg(pd, p, fresh_key);
    }
    match (pd.role, fields.bootstrap_room) {
        (Role::Both, _) => Ok(Leg::Whole),
        (Role::Prefill, Some(room)) => Ok(Leg::Prefill {
            key: room.to_string(),
            vllm: false,
        }),
        (Role::Decode, Some(room)) => {
            let (Some(host), Some(port)) = (fields.bootstrap_host, fields.bootstrap_port) else {
                return Err("a decode request needs bootstrap_host and bootstrap_port".into());
            };
            Ok(Leg::Decode {
                host,
                port,
                key: room.to_string(),
                vllm: false,
            })
        }
        (role, None) if pd.protocol == PdProtocol::Sglang => Err(format!(
            "this is a {role} worker in disaggregation mode: the request needs bootstrap_host, bootstrap_port and bootstrap_room"
        )),
        (_, None) => Ok(Leg::Whole),
    }
}

/// The leg of a request with vLLM's `kv_transfer_params`.
fn vllm_leg(
    pd: &PdConfig,
    p: KvTransferParams,
    fresh_key: impl FnOnce() -> String,
) -> Result<Leg, String> {
    if p.do_remote_decode {
        if pd.role == Role::Decode {
            return Err(
                "this worker is a decode worker (kv_consumer): it does not prefill for others"
                    .into(),
            );
        }
        return Ok(Leg::Prefill {
            key: fresh_key(),
            vllm: true,
        });
    }
    if p.do_remote_prefill {
        if pd.role == Role::Prefill {
            return Err(
                "this worker is a prefill worker (kv_producer): it does not decode from others"
                    .into(),
            );
        }
        let (Some(host), Some(port), Some(key)) =
            (p.remote_host, p.remote_port, p.remote_request_id)
        else {
            return Err("kv_transfer_params with do_remote_prefill need remote_host, remote_port and remote_request_id".into());
        };
        let _ = p.remote_block_ids;
        return Ok(Leg::Decode {
            host,
            port,
            key,
            vllm: true,
        });
    }
    Ok(Leg::Whole)
}

enum State {
    /// The prefill is running.
    Computing,
    /// Computed: these blocks are kept for the decode worker.
    Ready { lease: Option<Lease>, blocks: usize },
    /// The prefill failed or was cancelled.
    Failed,
}

struct Entry {
    state: State,
    since: Instant,
}

/// The handoffs a prefill worker keeps for decode workers.
pub(super) struct Handoffs {
    entries: Mutex<HashMap<String, Entry>>,
    changed: Notify,
}

impl Handoffs {
    pub(super) fn new() -> Handoffs {
        Handoffs {
            entries: Mutex::new(HashMap::new()),
            changed: Notify::new(),
        }
    }

    /// A prefill for `key` started.
    pub(super) fn begin(self: &Arc<Self>, engine: &Engine, key: &str) -> PrefillGuard {
        self.insert(engine, key, State::Computing);
        PrefillGuard {
            handoffs: self.clone(),
            key: key.to_string(),
            done: false,
        }
    }

    fn insert(&self, engine: &Engine, key: &str, state: State) {
        let mut stale = Vec::new();
        {
            let mut entries = self.entries.lock();
            let now = Instant::now();
            entries.retain(|_, e| {
                let keep = now.duration_since(e.since) < HANDOFF_TTL;
                if !keep {
                    stale.push(std::mem::replace(&mut e.state, State::Failed));
                }
                keep
            });
            // A key already kept (a prefill becoming ready) takes no new room.
            if entries.len() >= MAX_HANDOFFS
                && !entries.contains_key(key)
                && let Some(oldest) = entries
                    .iter()
                    .min_by_key(|(_, e)| e.since)
                    .map(|(k, _)| k.clone())
            {
                stale.extend(entries.remove(&oldest).map(|e| e.state));
            }
            if let Some(old) = entries.insert(key.to_string(), Entry { state, since: now }) {
                stale.push(old.state);
            }
        }
        for s in stale {
            if let State::Ready { lease: Some(l), .. } = s {
                engine.unpin(&l);
            }
        }
        self.changed.notify_waiters();
    }

    /// Hands `key`'s KV to a decode worker that holds its first `have` blocks: waits up
    /// to `wait` for its prefill, keeps the blocks for the wire time of the rest, then
    /// releases them. The blocks moved, or the status and reason.
    pub(super) async fn hand_over(
        &self,
        engine: &Engine,
        key: &str,
        have: usize,
        transfer_us_per_token: f64,
        wait: Duration,
    ) -> Result<usize, (StatusCode, String)> {
        let deadline = tokio::time::Instant::now() + wait;
        let (lease, blocks) = loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut entries = self.entries.lock();
                match entries.get(key).map(|e| &e.state) {
                    Some(State::Ready { .. }) => {
                        let Some(Entry {
                            state: State::Ready { lease, blocks },
                            ..
                        }) = entries.remove(key)
                        else {
                            unreachable!("matched above")
                        };
                        break (lease, blocks);
                    }
                    Some(State::Failed) => {
                        entries.remove(key);
                        return Err((StatusCode::GONE, format!("the prefill of `{key}` failed")));
                    }
                    None if wait.is_zero() => {
                        return Err((StatusCode::NOT_FOUND, format!("no prefill kept as `{key}`")));
                    }
                    Some(State::Computing) | None => {}
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err((
                    StatusCode::NOT_FOUND,
                    format!("no prefill of `{key}` finished within {wait:?}"),
                ));
            }
        };
        let moved = blocks.saturating_sub(have);
        let tokens = moved as f64 * f64::from(engine.config().block_size);
        let us = transfer_us_per_token * tokens / engine.config().speedup.max(1e-9);
        if let Ok(d) = Duration::try_from_secs_f64(us / 1e6)
            && !d.is_zero()
        {
            tokio::time::sleep(d.min(HANDOFF_WAIT)).await;
        }
        if let Some(l) = lease {
            engine.unpin(&l);
        }
        Ok(blocks)
    }
}

/// Marks a prefill's handoff failed unless it was completed.
pub(super) struct PrefillGuard {
    handoffs: Arc<Handoffs>,
    key: String,
    done: bool,
}

impl PrefillGuard {
    /// The prefill finished: keep `lease` (its `blocks` prompt blocks) for the decode
    /// worker.
    pub(super) fn ready(mut self, engine: &Engine, lease: Option<Lease>, blocks: usize) {
        self.done = true;
        self.handoffs
            .insert(engine, &self.key, State::Ready { lease, blocks });
    }
}

impl Drop for PrefillGuard {
    fn drop(&mut self) {
        if !self.done {
            let mut entries = self.handoffs.entries.lock();
            if let Some(e) = entries.get_mut(&self.key)
                && matches!(e.state, State::Computing)
            {
                e.state = State::Failed;
            }
            drop(entries);
            self.handoffs.changed.notify_waiters();
        }
    }
}

/// A prefill leg's KV, to keep for its decode worker once computed.
pub(super) struct Keep {
    pub(super) guard: PrefillGuard,
    pub(super) blocks: Vec<switchyard_ids::BlockHash>,
    pub(super) tokens: Vec<u32>,
    pub(super) keys: crate::cache::BlockKeys,
}

impl Keep {
    /// The prefill is done: pin its blocks for the decode worker; how many.
    pub(super) fn ready(self, engine: &Engine) -> usize {
        let lease = engine.pin(&self.blocks, &self.tokens, &self.keys);
        let n = self.blocks.len();
        self.guard.ready(engine, lease, n);
        n
    }
}

/// A request's ID as vLLM takes it, from `X-Request-Id` when it is one the handoff can
/// name (1 to 128 of `[A-Za-z0-9._-]`), else `fresh`.
pub(super) fn request_id(header: Option<&[u8]>, fresh: impl FnOnce() -> String) -> String {
    match header {
        Some(h)
            if (1..=128).contains(&h.len())
                && h.iter()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(b)) =>
        {
            String::from_utf8_lossy(h).into_owned()
        }
        _ => fresh(),
    }
}

/// A number fixed for the process and unlike another's, so that handoff keys made here
/// do not repeat those of a worker that ran on the same port before.
pub(super) fn process_nonce() -> u64 {
    static NONCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *NONCE.get_or_init(|| {
        use std::hash::{BuildHasher, RandomState};
        RandomState::new().hash_one(std::process::id())
    })
}

/// vLLM's answer parameters for a prefill kept under `key` with `blocks` blocks.
pub(super) fn vllm_params(
    key: &str,
    blocks: usize,
    host: &str,
    port: u16,
    engine_id: &str,
) -> serde_json::Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": (0..blocks).collect::<Vec<_>>(),
        "remote_engine_id": engine_id,
        "remote_request_id": key,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    })
}

/// Asks the prefill worker at `host:port` for handoff `key`, holding the first `have`
/// blocks already: the blocks it computed, or why not.
pub(super) async fn fetch(
    host: &str,
    port: u16,
    key: &str,
    have: usize,
    wait: bool,
) -> Result<usize, String> {
    let work = async {
        let stream = tokio::net::TcpStream::connect((host, port))
            .await
            .map_err(|e| format!("connecting to {host}:{port}: {e}"))?;
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| format!("handshake with {host}:{port}: {e}"))?;
        tokio::spawn(conn);
        let uri = format!("/handoff/{key}?have={have}&wait={}", u8::from(wait));
        let req = hyper::Request::get(uri)
            .header(hyper::header::HOST, format!("{host}:{port}"))
            .body(Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| format!("asking {host}:{port} for `{key}`: {e}"))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), MAX_HANDOFF_ANSWER)
            .collect()
            .await
            .map_err(|e| format!("reading {host}:{port}'s answer: {e}"))?
            .to_bytes();
        if !status.is_success() {
            return Err(format!(
                "{host}:{port} answered {status}: {}",
                String::from_utf8_lossy(&body)
            ));
        }
        #[derive(Deserialize)]
        struct Answer {
            blocks: usize,
        }
        serde_json::from_slice::<Answer>(&body)
            .map(|a| a.blocks)
            .map_err(|e| format!("{host}:{port}'s answer: {e}"))
    };
    tokio::time::timeout(HANDOFF_WAIT + Duration::from_secs(5), work)
        .await
        .map_err(|_| format!("{host}:{port} did not hand `{key}` over in time"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pd(role: Role, protocol: PdProtocol) -> PdConfig {
        PdConfig {
            role,
            protocol,
            ..PdConfig::default()
        }
    }

    #[test]
    fn vllm_legs_follow_kv_transfer_params() {
        let p = pd(Role::Prefill, PdProtocol::Vllm);
        let key = || "k1".to_string();
        assert_eq!(leg(&p, br#"{"prompt":"x"}"#, key), Ok(Leg::Whole));
        assert_eq!(
            leg(
                &p,
                br#"{"kv_transfer_params":{"do_remote_decode":true,"remote_host":null}}"#,
                key
            ),
            Ok(Leg::Prefill {
                key: "k1".into(),
                vllm: true
            })
        );
        let d = pd(Role::Decode, PdProtocol::Vllm);
        let body = br#"{"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"h","remote_port":7,"remote_request_id":"r","remote_block_ids":[0,1]}}"#;
        assert_eq!(
            leg(&d, body, key),
            Ok(Leg::Decode {
                host: "h".into(),
                port: 7,
                key: "r".into(),
                vllm: true
            })
        );
        assert!(leg(&p, body, key).unwrap_err().contains("prefill worker"));
        assert!(
            leg(
                &d,
                br#"{"kv_transfer_params":{"do_remote_prefill":true}}"#,
                key
            )
            .is_err()
        );
        assert!(leg(&d, br#"{"kv_transfer_params": 5}"#, key).is_err());
    }

    #[test]
    fn sglang_workers_need_a_room() {
        let key = || unreachable!();
        let p = pd(Role::Prefill, PdProtocol::Sglang);
        assert!(
            leg(&p, br#"{"prompt":"x"}"#, key)
                .unwrap_err()
                .contains("bootstrap_room")
        );
        assert_eq!(
            leg(
                &p,
                br#"{"bootstrap_host":"h","bootstrap_port":8998,"bootstrap_room":42}"#,
                key
            ),
            Ok(Leg::Prefill {
                key: "42".into(),
                vllm: false
            })
        );
        let d = pd(Role::Decode, PdProtocol::Sglang);
        assert_eq!(
            leg(
                &d,
                br#"{"bootstrap_host":"h","bootstrap_port":8998,"bootstrap_room":42}"#,
                key
            ),
            Ok(Leg::Decode {
                host: "h".into(),
                port: 8998,
                key: "42".into(),
                vllm: false
            })
        );
        assert_eq!(
            leg(&pd(Role::Both, PdProtocol::Sglang), b"{}", key),
            Ok(Leg::Whole)
        );
    }

    fn engine() -> Arc<Engine> {
        Engine::start(crate::engine::EngineConfig {
            block_size: 16,
            kv_blocks: 64,
            max_batch: 4,
            speedup: 1000.0,
            max_batched_tokens: crate::engine::DEFAULT_MAX_BATCHED_TOKENS,
            max_model_len: None,
            eos_period: 0,
            stream_interval: 1,
            timing: crate::engine::TimingModel::default(),
        })
    }

    /// Worst case: decode workers that never come. At most MAX_HANDOFFS are kept; the
    /// oldest goes first and its blocks are released, so KV held for nobody cannot pile up.
    #[tokio::test]
    async fn handoffs_nobody_takes_are_bounded_and_release_their_blocks() {
        let e = engine();
        let h = Arc::new(Handoffs::new());
        let blocks = [switchyard_ids::BlockHash(1), switchyard_ids::BlockHash(2)];
        let lease = e.pin(&blocks, &[], &Default::default());
        assert!(lease.is_some());
        h.begin(&e, "first").ready(&e, lease, 2);
        assert_eq!(e.stats().kv_used_blocks, 2, "held for its decode worker");
        for i in 0..MAX_HANDOFFS {
            h.begin(&e, &format!("k{i}")).ready(&e, None, 0);
        }
        assert_eq!(h.entries.lock().len(), MAX_HANDOFFS);
        assert_eq!(
            e.stats().kv_used_blocks,
            0,
            "the oldest handoff's blocks were released"
        );
        let gone = h.hand_over(&e, "first", 0, 0.0, Duration::ZERO).await;
        assert_eq!(gone.unwrap_err().0, StatusCode::NOT_FOUND);
        // A prefill that fails (its guard dropped unready) tells a waiting decode at once.
        drop(h.begin(&e, "failed"));
        let failed = h.hand_over(&e, "failed", 0, 0.0, HANDOFF_WAIT).await;
        assert_eq!(failed.unwrap_err().0, StatusCode::GONE);
        // One that is ready is handed over once.
        h.begin(&e, "ok").ready(&e, None, 3);
        assert_eq!(h.hand_over(&e, "ok", 1, 0.0, Duration::ZERO).await, Ok(3));
        assert!(h.hand_over(&e, "ok", 0, 0.0, Duration::ZERO).await.is_err());
    }

    #[test]
    fn a_prefill_is_kept_under_its_request_id_when_it_can_name_it() {
        assert_eq!(
            request_id(Some(b"abc-1.x_y"), || "fresh".into()),
            "abc-1.x_y"
        );
        assert_eq!(request_id(Some(b"a b"), || "fresh".into()), "fresh");
        assert_eq!(request_id(Some(&[b'a'; 129]), || "fresh".into()), "fresh");
        assert_eq!(request_id(None, || "fresh".into()), "fresh");
    }
}
