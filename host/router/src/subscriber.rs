//! KV event subscriptions, following the shared Client: one per *available* worker that
//! serves Switchyard's NDJSON stream, and one per known worker whose engine publishes
//! over ZMQ (`engine_subscriber`). Events are applied to the endpoint's index; a sequence
//! gap resubscribes for a fresh snapshot; a broken or silent stream reconnects with
//! backoff; malformed lines are counted and skipped; a worker that discovery removes has
//! its blocks dropped.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client as HttpClient;
use switchyard_net::upstream::Connector;

use super::KvRouter;
use switchyard_ids::InstanceId;
use switchyard_kv::events::{KvEvent, SeqCheck, check_seq};

/// Subscription timing.
#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    /// First reconnect delay (doubles up to `backoff_max`).
    pub backoff_initial: Duration,
    /// Longest reconnect delay.
    pub backoff_max: Duration,
    /// A stream silent for this long (no event, no load report) is reconnected.
    pub idle_timeout: Duration,
}

impl Default for SubscriberConfig {
    fn default() -> Self {
        SubscriberConfig {
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(10),
        }
    }
}

/// Counters of the event subscriptions of one endpoint.
#[derive(Debug, Default)]
pub struct EventStats {
    /// Cache events applied (snapshots included).
    pub applied: AtomicU64,
    /// Lines that were not valid events.
    pub malformed: AtomicU64,
    /// Sequence gaps (each forces a resubscription).
    pub gaps: AtomicU64,
    /// Successful connections (each starts with a snapshot).
    pub connects: AtomicU64,
    /// Streams that broke or went silent.
    pub disconnects: AtomicU64,
}

/// Longest NDJSON line read (a snapshot of a whole cache is one line: 1M blocks of ~21
/// bytes each fit). A longer one ends the connection, which reconnects with backoff.
pub const MAX_LINE: usize = 64 << 20;

/// A connection that lasted this long, having delivered its snapshot, starts the next
/// reconnect's backoff from the beginning; a shorter one (a gap right after every
/// snapshot, a stream that breaks at once) keeps backing off.
const STEADY: Duration = Duration::from_secs(5);

/// Starts following `router`'s client; runs until the router is dropped.
pub fn spawn(router: &Arc<KvRouter>, config: SubscriberConfig) -> tokio::task::JoinHandle<()> {
    let weak = Arc::downgrade(router);
    let mut changes = router.client().subscribe_changes();
    let http = super::background_http(&router.config.tls, Duration::from_secs(2));
    // Taken now, not when the task first runs: a worker that leaves in between is still
    // dropped (anything may have written its state meanwhile).
    let mut known: BTreeSet<InstanceId> = router
        .client()
        .snapshot()
        .instances
        .keys()
        .copied()
        .collect();
    tokio::spawn(async move {
        let mut subs: HashMap<InstanceId, (Source, tokio::task::AbortHandle)> = HashMap::new();
        loop {
            {
                let Some(router) = weak.upgrade() else { break };
                let snap = router.client().snapshot();
                for gone in known.iter().filter(|id| !snap.instances.contains_key(id)) {
                    router.drop_worker(*gone);
                }
                known = snap.instances.keys().copied().collect();
                let available: BTreeSet<InstanceId> = snap.available.iter().copied().collect();
                let source_of = |id: &InstanceId| {
                    snap.instances
                        .get(id)
                        .and_then(|s| match &s.info.engine_events {
                            Some(e) => Some(Source::Engine(e.clone())),
                            None => s.info.events_url.clone().map(Source::Ndjson),
                        })
                };
                subs.retain(|id, (source, task)| {
                    // Engine sockets are followed while the worker is known at all: its
                    // engine keeps publishing while its HTTP side is down, and what it
                    // publishes meanwhile is still its cache.
                    let wanted = match source {
                        Source::Engine(_) => snap.instances.contains_key(id),
                        Source::Ndjson(_) => available.contains(id),
                    };
                    let keep = wanted && source_of(id).as_ref() == Some(source);
                    if !keep {
                        task.abort();
                    }
                    keep
                });
                for id in snap.instances.keys() {
                    let Some(source) = source_of(id) else {
                        continue;
                    };
                    if subs.contains_key(id)
                        || (matches!(source, Source::Ndjson(_)) && !available.contains(id))
                    {
                        continue;
                    }
                    let task = match &source {
                        Source::Ndjson(url) => tokio::spawn(follow(
                            weak.clone(),
                            *id,
                            url.clone(),
                            config.clone(),
                            http.clone(),
                        )),
                        Source::Engine(e) => tokio::spawn(super::engine_subscriber::follow(
                            weak.clone(),
                            *id,
                            (**e).clone(),
                            (config.backoff_initial, config.backoff_max),
                        )),
                    };
                    subs.insert(*id, (source, task.abort_handle()));
                }
            }
            if changes.changed().await.is_err() {
                break;
            }
        }
        for (_, (_, task)) in subs {
            task.abort();
        }
    })
}

/// Where a worker's cache events come from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    /// Switchyard's NDJSON stream at this URL.
    Ndjson(String),
    /// The engine's ZMQ publisher.
    Engine(Arc<switchyard_discovery::EngineEventSource>),
}

enum End {
    Gap,
    Broken(String),
}

async fn follow(
    router: Weak<KvRouter>,
    worker: InstanceId,
    url: String,
    config: SubscriberConfig,
    http: HttpClient<Connector, Empty<Bytes>>,
) {
    let mut delay = config.backoff_initial;
    loop {
        let mut synced = false;
        let started = tokio::time::Instant::now();
        let end = stream_once(&router, worker, &url, &config, &http, &mut synced).await;
        let Some(r) = router.upgrade() else { return };
        if synced && started.elapsed() >= STEADY {
            delay = config.backoff_initial;
        }
        match end {
            End::Gap => {
                r.event_stats.gaps.fetch_add(1, Ordering::Relaxed);
                tracing::info!(instance = %worker, retry_in = ?delay, "KV event sequence gap; resubscribing for a snapshot");
            }
            End::Broken(why) => {
                r.event_stats.disconnects.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(instance = %worker, url, why, retry_in = ?delay, "KV event stream broke");
            }
        }
        drop(r);
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(config.backoff_max);
    }
}

async fn stream_once(
    router: &Weak<KvRouter>,
    worker: InstanceId,
    url: &str,
    config: &SubscriberConfig,
    http: &HttpClient<Connector, Empty<Bytes>>,
    synced: &mut bool,
) -> End {
    let uri: hyper::Uri = match url.parse() {
        Ok(u) => u,
        Err(e) => return End::Broken(format!("bad events URL: {e}")),
    };
    let response = match tokio::time::timeout(config.idle_timeout, http.get(uri)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return End::Broken(e.to_string()),
        Err(_) => return End::Broken("connect timed out".into()),
    };
    if !response.status().is_success() {
        return End::Broken(format!("HTTP {}", response.status()));
    }
    let mut body = response.into_body();
    let mut lines = switchyard_bounded::lines::Lines::default();
    let mut last: Option<u64> = None;
    loop {
        let frame = match tokio::time::timeout(config.idle_timeout, body.frame()).await {
            Err(_) => return End::Broken(format!("silent for {:?}", config.idle_timeout)),
            Ok(None) => return End::Broken("stream ended".into()),
            Ok(Some(Err(e))) => return End::Broken(e.to_string()),
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        lines.push(&data);
        while let Some(line) = lines.next_line() {
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let Some(r) = router.upgrade() else {
                return End::Broken("router dropped".into());
            };
            let event: KvEvent = match serde_json::from_slice(line) {
                Ok(e) => e,
                Err(e) => {
                    let n = r.event_stats.malformed.fetch_add(1, Ordering::Relaxed) + 1;
                    if n <= 10 || n.is_multiple_of(1000) {
                        tracing::warn!(instance = %worker, error = %e, malformed = n, "skipping a malformed KV event");
                    }
                    continue;
                }
            };
            match check_seq(last, &event) {
                SeqCheck::Reset => {
                    // Counted before the snapshot is applied, so that whoever sees the
                    // index updated also sees the connection counted.
                    if !*synced {
                        r.event_stats.connects.fetch_add(1, Ordering::Relaxed);
                    }
                    r.apply_event(worker, &event);
                    *synced = true;
                    last = event.seq();
                    r.event_stats.applied.fetch_add(1, Ordering::Relaxed);
                }
                SeqCheck::Apply => {
                    r.apply_event(worker, &event);
                    last = event.seq();
                    r.event_stats.applied.fetch_add(1, Ordering::Relaxed);
                }
                SeqCheck::NotSequenced => {
                    if let Some(load) = event.load() {
                        r.report_load(worker, load);
                    }
                }
                SeqCheck::Gap { expected, got } => {
                    tracing::debug!(instance = %worker, expected, got, "KV event gap");
                    return End::Gap;
                }
            }
        }
        if lines.pending() > MAX_LINE {
            return End::Broken(format!("a line longer than {MAX_LINE} bytes"));
        }
    }
}
