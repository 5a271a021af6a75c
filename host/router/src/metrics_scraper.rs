//! Load from the engines themselves: every available worker without Switchyard's NDJSON
//! stream (which carries load reports) has its Prometheus `/metrics` read at an interval,
//! and the engine's running/waiting requests and KV usage become its reported load
//! (`kv::engine_metrics`). So a router sees load that other routers or clients put on a
//! worker. A worker whose page has none of the engines' gauges, or cannot be read, is
//! asked again only after [`QUIET_RETRY`]; one scrape never waits longer than
//! [`SCRAPE_TIMEOUT`]. Every available worker's `/v1/models` is also read, once and then
//! every [`MODELS_EVERY`], for its context length (`max_model_len`: the endpoint's
//! longest is the most prompt tokens a request to it may have) and its engine (a vLLM
//! worker is asked for token IDs on a stream that may be migrated).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client as HttpClient;
use switchyard_net::upstream::Connector;

use super::KvRouter;
use switchyard_ids::InstanceId;
use switchyard_kv::engine_metrics;

/// Longest a scrape may take.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(1);
/// A worker whose metrics could not be used is scraped again after this long.
pub const QUIET_RETRY: Duration = Duration::from_secs(30);
/// Largest `/metrics` page read.
const MAX_PAGE: usize = 4 << 20;
/// Largest `/v1/models` answer read.
const MAX_MODELS: usize = 1 << 20;
/// How often each worker's `/v1/models` is read for its context length.
pub const MODELS_EVERY: Duration = Duration::from_secs(300);

/// Scrape counters of one endpoint.
#[derive(Debug, Default)]
pub struct ScrapeStats {
    /// Pages read and applied.
    pub ok: AtomicU64,
    /// Scrapes that failed or found no engine gauges.
    pub failed: AtomicU64,
}

/// Scrapes `router`'s workers every `interval` until the router is dropped.
pub fn spawn(router: &Arc<KvRouter>, interval: Duration) -> tokio::task::JoinHandle<()> {
    let weak = Arc::downgrade(router);
    let http = super::background_http(&router.config.tls, SCRAPE_TIMEOUT);
    tokio::spawn(async move {
        let mut quiet_until: HashMap<InstanceId, Instant> = HashMap::new();
        // When each worker's `/v1/models` was last read (every worker, NDJSON or not).
        let mut models_read: HashMap<InstanceId, Instant> = HashMap::new();
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(router) = weak.upgrade() else { return };
            let snap = router.client().snapshot();
            let now = Instant::now();
            quiet_until.retain(|id, until| snap.instances.contains_key(id) && *until > now);
            models_read.retain(|id, at| {
                snap.instances.contains_key(id) && now.duration_since(*at) < MODELS_EVERY
            });
            let mut contexts = tokio::task::JoinSet::new();
            for id in snap.available.iter() {
                let Some(state) = snap.instances.get(id) else {
                    continue;
                };
                if models_read.contains_key(id) {
                    continue;
                }
                models_read.insert(*id, now);
                let url = format!("{}/v1/models", state.info.url);
                let (http, model, id) = (http.clone(), state.info.model.clone(), *id);
                contexts.spawn(async move {
                    let body = fetch(&http, &url, MAX_MODELS).await.ok()?;
                    Some((id, engine_metrics::models(&body, &model)?))
                });
            }
            let mut scrapes = tokio::task::JoinSet::new();
            for id in snap.available.iter() {
                let Some(state) = snap.instances.get(id) else {
                    continue;
                };
                if state.info.events_url.is_some() || quiet_until.contains_key(id) {
                    continue;
                }
                let url = format!("{}/metrics", state.info.url);
                let http = http.clone();
                let block_size = state.info.block_size;
                let id = *id;
                scrapes.spawn(async move { (id, scrape(&http, &url, block_size).await) });
            }
            drop(router);
            while let Some(done) = contexts.join_next().await {
                let Ok(Some((id, models))) = done else {
                    continue;
                };
                let Some(router) = weak.upgrade() else { return };
                router.note_models(id, models);
            }
            while let Some(done) = scrapes.join_next().await {
                let Ok((id, result)) = done else { continue };
                let Some(router) = weak.upgrade() else { return };
                match result {
                    Ok(found) => {
                        router.scrape_stats.ok.fetch_add(1, Ordering::Relaxed);
                        router.report_engine_load(id, found.load, found.size_known);
                    }
                    Err(why) => {
                        let n = router.scrape_stats.failed.fetch_add(1, Ordering::Relaxed) + 1;
                        if n <= 10 || n.is_multiple_of(1000) {
                            tracing::debug!(instance = %id, why, "engine metrics not usable; asking again in {QUIET_RETRY:?}");
                        }
                        quiet_until.insert(id, Instant::now() + QUIET_RETRY);
                    }
                }
            }
        }
    })
}

/// `GET url`, its body up to `max` bytes, within [`SCRAPE_TIMEOUT`].
async fn fetch(
    http: &HttpClient<Connector, Empty<Bytes>>,
    url: &str,
    max: usize,
) -> Result<Bytes, String> {
    let uri: hyper::Uri = url.parse().map_err(|e| format!("bad URL: {e}"))?;
    let read = async {
        let response = http.get(uri).await.map_err(|e| e.to_string())?;
        if !response.status().is_success() {
            return Err(format!("HTTP {}", response.status()));
        }
        let body = Limited::new(response.into_body(), max)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok(body)
    };
    tokio::time::timeout(SCRAPE_TIMEOUT, read)
        .await
        .map_err(|_| format!("timed out after {SCRAPE_TIMEOUT:?}"))?
}

async fn scrape(
    http: &HttpClient<Connector, Empty<Bytes>>,
    url: &str,
    block_size: u32,
) -> Result<engine_metrics::EngineLoad, String> {
    let body = fetch(http, url, MAX_PAGE).await?;
    let text = std::str::from_utf8(&body).map_err(|_| "not UTF-8".to_string())?;
    engine_metrics::parse(text, block_size)
        .ok_or_else(|| "no vLLM or SGLang load gauges".to_string())
}
