//! Subscriptions to engines' own KV events over ZMQ (vLLM, SGLang; `kv::engine_events`):
//! one SUB connection per worker and data-parallel rank to the engine's PUB socket
//! (the router's own bounded ZMTP, [`super::zmtp`]; reconnected with backoff), feeding the worker's
//! [`EngineView`]. A sequence gap is fetched from the engine's replay socket; what cannot
//! be fetched makes the view incomplete (see `kv::engine_view`). On connecting, the
//! replay socket is asked for everything the engine still buffers, so that a router
//! started after its workers begins with their caches.

use std::sync::Weak;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use std::sync::Arc;

use super::zmtp::{Connection, KV_EVENT_LIMITS, SocketType, ZmtpError};

use super::{KvRouter, ViewStatus};
use switchyard_bounded::budget::{Budget, Grant};
use switchyard_discovery::EngineEventSource;
use switchyard_ids::InstanceId;
use switchyard_kv::engine_events::{EngineBatch, decode_batch};
use switchyard_kv::engine_view::{EngineView, IndexOp, SeqVerdict};

/// Engine hashes kept per worker, over all its ranks, before a runaway stream is reset
/// (far above any GPU cache: 4M blocks of 16 tokens is 64M tokens); less once the
/// worker's cache size is known.
pub const MAX_ENGINE_ENTRIES: usize = 4 << 20;

/// How long a replay request may take, and most batches taken from one.
pub const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// After a replay request fails, gaps are not fetched for this long (they count as lost):
/// a replay socket that hangs must not cost every gapped batch the whole timeout.
pub const REPLAY_QUIET: Duration = Duration::from_secs(10);
const REPLAY_MAX_BATCHES: usize = 100_000;

/// How long a new connection may stay silent before the replay socket is asked once
/// more. An engine applies a new subscription some time after the router sends it; a
/// batch published in between is never delivered, and the catch-up made on connecting
/// may have run before it was published. The next batch would show the gap, but an idle
/// engine sends none: without this second catch-up its cache would stay short of those
/// blocks while the view says it is exact.
pub const JOIN_SETTLE: Duration = Duration::from_secs(1);

/// Follows `worker`'s engine events until aborted (every rank in a task of its own, all
/// aborted with this one).
pub async fn follow(
    router: Weak<KvRouter>,
    worker: InstanceId,
    source: EngineEventSource,
    backoff: (Duration, Duration),
) {
    let Some(r) = router.upgrade() else { return };
    let view = Arc::new(Mutex::new(EngineView::new(
        r.config.block_size,
        r.config.hash_seed,
        MAX_ENGINE_ENTRIES,
        source.data_parallel_size,
    )));
    // Not in sync yet: approximate until the first batches say otherwise.
    r.apply_engine_ops(worker, &[], ViewStatus::default());
    let budget = r.config.event_budget.clone();
    drop(r);
    let mut ranks = tokio::task::JoinSet::new();
    for rank in 0..source.data_parallel_size.max(1) {
        let feed = Feed {
            router: router.clone(),
            worker,
            rank,
            endpoint: EngineEventSource::for_rank(&source.endpoint, rank),
            replay: source
                .replay
                .as_ref()
                .map(|r| EngineEventSource::for_rank(r, rank)),
            topic: source.topic.clone(),
            view: view.clone(),
            malformed: 0,
            replay_failures: 0,
            replay_quiet_until: None,
            budget: budget.clone(),
        };
        ranks.spawn(feed.run(backoff));
    }
    while ranks.join_next().await.is_some() {}
}

struct Feed {
    router: Weak<KvRouter>,
    worker: InstanceId,
    rank: u32,
    endpoint: String,
    replay: Option<String>,
    topic: String,
    view: Arc<Mutex<EngineView>>,
    malformed: u64,
    replay_failures: u64,
    replay_quiet_until: Option<tokio::time::Instant>,
    /// The router's budget for event input (every batch's bytes are held against it
    /// from the socket until handled).
    budget: Budget,
}

impl Feed {
    async fn run(mut self, (initial, max): (Duration, Duration)) {
        if self.endpoint == super::central_events::BOUND {
            return self.run_bound().await;
        }
        let mut delay = initial;
        loop {
            let connected = async {
                let mut sub = Connection::connect(
                    &self.endpoint,
                    SocketType::Sub,
                    KV_EVENT_LIMITS,
                    Duration::from_secs(5),
                )
                .await?
                .with_budget(self.budget.clone());
                sub.subscribe(self.topic.as_bytes()).await?;
                Ok::<_, ZmtpError>(sub)
            }
            .await;
            let mut sub = match connected {
                Ok(sub) => sub,
                Err(e) => {
                    tracing::debug!(instance = %self.worker, endpoint = self.endpoint, error = %e, retry_in = ?delay, "cannot connect to the engine's KV events");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(max);
                    continue;
                }
            };
            tracing::info!(instance = %self.worker, endpoint = self.endpoint, rank = self.rank, "following the engine's KV events");
            self.catch_up().await;
            let mut received = 0u64;
            // Once per connection, and only while it has been silent since.
            let mut settle = Some(tokio::time::Instant::now() + JOIN_SETTLE);
            let why = loop {
                if let Some(at) = settle {
                    match tokio::time::timeout_at(at, sub.readable()).await {
                        Err(_) => {
                            settle = None;
                            self.catch_up().await;
                            continue;
                        }
                        Ok(Err(e)) => break e,
                        // Batches flow: a missed one shows as a gap in the next.
                        Ok(Ok(())) => settle = None,
                    }
                }
                // Its bytes held against the budget until it is handled.
                let (msg, _held) = match sub.recv_held().await {
                    Ok(m) => m,
                    Err(e) => break e,
                };
                received += 1;
                let Some((seq, payload)) = frames(msg) else {
                    self.count_malformed("a message is not [topic, seq, payload]");
                    continue;
                };
                if !self.handle(seq, &payload, true).await {
                    return;
                }
            };
            // A peer that broke the protocol or its bounds is waited out like one that
            // cannot be reached: it must not get a tight reconnect loop. A connection
            // that delivered batches starts the backoff again.
            let hostile = why.broke_bounds();
            if hostile {
                self.count_malformed(&format!("the KV event connection broke its bounds: {why}"));
            } else {
                tracing::debug!(instance = %self.worker, error = %why, "KV event connection ended");
            }
            if received > 0 && !hostile {
                delay = initial;
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(max);
        }
    }

    /// Central mode: the engine connects to the router's bound sockets, and its batches
    /// come by topic.
    async fn run_bound(mut self) {
        let Some(router) = self.router.upgrade() else {
            return;
        };
        let claim = match &router.config.central_events {
            Some(hub) => hub.claim(&self.topic, self.rank, self.worker),
            None => Err("the router binds no KV events socket (--kv-events-bind)".into()),
        };
        drop(router);
        let mut claim = match claim {
            Ok(c) => c,
            Err(why) => {
                tracing::warn!(instance = %self.worker, topic = self.topic, rank = self.rank, why, "cannot follow the engine's KV events; its cache is predicted");
                return;
            }
        };
        tracing::info!(instance = %self.worker, topic = self.topic, rank = self.rank, "following the engine's KV events (central mode)");
        self.catch_up().await;
        while let Some((seq, payload, _held)) = claim.batches.recv().await {
            if !self.handle(seq, &payload, true).await {
                return;
            }
        }
        // The feed is over: what the engine does from now on is not seen.
        if let Some(r) = self.router.upgrade() {
            let status = {
                let v = self.view.lock();
                ViewStatus {
                    complete: false,
                    ..self.status(&v)
                }
            };
            r.apply_engine_ops(self.worker, &[], status);
        }
    }

    /// Asks the replay socket for everything after the last applied batch.
    async fn catch_up(&mut self) {
        let Some(replay) = self.replay.clone() else {
            return;
        };
        let from = self
            .view
            .lock()
            .last_seq(self.rank)
            .map_or(0, |s| s.saturating_add(1));
        match self.replay(&replay, from, None).await {
            Some((batches, _)) if batches.is_empty() && from == 0 => {
                // The engine has published nothing yet: its cache is empty.
                let status = {
                    let mut v = self.view.lock();
                    v.synced_empty(self.rank);
                    self.status(&v)
                };
                if let Some(r) = self.router.upgrade() {
                    r.apply_engine_ops(self.worker, &[], status);
                }
            }
            Some((batches, _held)) => {
                for (seq, payload) in batches {
                    if !self.handle(seq, &payload, false).await {
                        return;
                    }
                }
            }
            None => {}
        }
    }

    /// The batches `from..to` from the replay socket; `None` when the request failed or
    /// was not made (within [`REPLAY_QUIET`] of a failure).
    async fn replay(
        &mut self,
        endpoint: &str,
        from: u64,
        to: Option<u64>,
    ) -> Option<(Vec<(u64, Bytes)>, Grant)> {
        let now = tokio::time::Instant::now();
        if self.replay_quiet_until.is_some_and(|t| now < t) {
            return None;
        }
        match fetch_replay(endpoint, from, to, &self.budget).await {
            Ok(batches) => Some(batches),
            Err(e) => {
                self.replay_failures += 1;
                self.replay_quiet_until = Some(tokio::time::Instant::now() + REPLAY_QUIET);
                tracing::debug!(instance = %self.worker, endpoint, error = e, failures = self.replay_failures, "KV event replay failed; gaps count as lost for {REPLAY_QUIET:?}");
                None
            }
        }
    }

    fn count_malformed(&mut self, why: &str) {
        self.malformed += 1;
        let n = self.malformed;
        if n <= 10 || n.is_multiple_of(1000) {
            tracing::warn!(instance = %self.worker, rank = self.rank, why, malformed = n, "skipping a malformed KV event batch");
        }
    }

    fn status(&self, view: &EngineView) -> ViewStatus {
        ViewStatus {
            complete: view.complete(),
            counts: view.counts(),
            malformed: self.malformed,
            replay_failures: self.replay_failures,
        }
    }

    /// Decodes a payload; an undecodable one is counted and becomes an empty batch, so
    /// that the sequence keeps moving (it is not a gap).
    fn decode(&mut self, payload: &[u8]) -> EngineBatch {
        decode_batch(payload).unwrap_or_else(|e| {
            self.count_malformed(&e.to_string());
            EngineBatch {
                ts: f64::NEG_INFINITY,
                rank: None,
                events: Vec::new(),
            }
        })
    }

    /// Handles one batch; `false` when the router is gone.
    async fn handle(&mut self, seq: u64, payload: &[u8], may_replay: bool) -> bool {
        let Some(router) = self.router.upgrade() else {
            return false;
        };
        let batch = self.decode(payload);
        let mut ops: Vec<IndexOp> = Vec::new();
        let verdict = self.view.lock().check(self.rank, seq, batch.ts);
        let verdict = match verdict {
            SeqVerdict::Restart => {
                tracing::info!(instance = %self.worker, rank = self.rank, seq, "engine restarted (KV event sequence started again); resyncing");
                ops.extend(self.view.lock().restart(self.rank));
                if seq == 0 {
                    SeqVerdict::Apply
                } else {
                    SeqVerdict::Gap { from: 0, to: seq }
                }
            }
            v => v,
        };
        match verdict {
            SeqVerdict::Duplicate => {}
            SeqVerdict::Apply | SeqVerdict::Restart => {
                let mut v = self.view.lock();
                ops.extend(v.apply(self.rank, seq, batch.ts, &batch.events));
            }
            SeqVerdict::Gap { from, to } => {
                let (missing, _held) = match (self.replay.clone(), may_replay) {
                    (Some(replay), true) => self
                        .replay(&replay, from, Some(to))
                        .await
                        .unwrap_or_default(),
                    _ => (Vec::new(), Grant::default()),
                };
                // Decoded before the view is locked.
                let missing: Vec<(u64, EngineBatch)> =
                    missing.iter().map(|(s, p)| (*s, self.decode(p))).collect();
                let mut v = self.view.lock();
                let mut filled = 0;
                for (s, b) in &missing {
                    if v.check(self.rank, *s, b.ts) == SeqVerdict::Apply {
                        ops.extend(v.apply(self.rank, *s, b.ts, &b.events));
                        filled += 1;
                    }
                }
                if v.check(self.rank, seq, batch.ts) != SeqVerdict::Apply {
                    tracing::info!(instance = %self.worker, rank = self.rank, from, to, filled, "KV event gap not filled by the replay socket; the view is incomplete until the cache turns over");
                    ops.extend(v.lost_gap(self.rank, seq));
                }
                ops.extend(v.apply(self.rank, seq, batch.ts, &batch.events));
            }
        }
        let capacity = router.known_capacity(self.worker).unwrap_or(0) as usize;
        let status = {
            let mut v = self.view.lock();
            v.set_capacity_hint(capacity);
            self.status(&v)
        };
        router.apply_engine_ops(self.worker, &ops, status);
        true
    }
}

/// `[topic, seq, payload]` (or `[seq, payload]` from a publisher without topics).
fn frames(msg: Vec<Bytes>) -> Option<(u64, Bytes)> {
    super::zmtp::topic_frames(msg).map(|(_, seq, payload)| (seq, payload))
}

/// Asks a replay socket for the batches from `from` (up to, not including, `to`), their
/// bytes held against `budget` (a replay that does not fit fails, and its gap counts as
/// lost).
pub async fn fetch_replay(
    endpoint: &str,
    from: u64,
    to: Option<u64>,
    budget: &Budget,
) -> Result<(Vec<(u64, Bytes)>, Grant), String> {
    let deadline = tokio::time::Instant::now() + REPLAY_TIMEOUT;
    let connect = Connection::connect(
        endpoint,
        SocketType::Dealer,
        KV_EVENT_LIMITS,
        REPLAY_TIMEOUT,
    );
    let mut dealer = tokio::time::timeout_at(deadline, connect)
        .await
        .map_err(|_| "connect timed out".to_string())?
        .map_err(|e| e.to_string())?
        .with_budget(budget.clone());
    tokio::time::timeout_at(deadline, dealer.send(&[b"", &from.to_be_bytes()]))
        .await
        .map_err(|_| "send timed out".to_string())?
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    let mut held = Grant::default();
    loop {
        let (msg, grant) = tokio::time::timeout_at(deadline, dealer.recv_held())
            .await
            .map_err(|_| format!("timed out after {} batches", out.len()))?
            .map_err(|e| e.to_string())?;
        let Some((seq, payload)) = frames(msg) else {
            return Err("a malformed replay message".into());
        };
        if seq == u64::MAX {
            // -1 as a signed 8-byte integer: the end.
            return Ok((out, held));
        }
        if to.is_none_or(|t| seq < t) && seq >= from && out.len() < REPLAY_MAX_BATCHES {
            out.push((seq, payload));
            held.absorb(grant);
        }
    }
}
