//! Load from the engines themselves: every available worker without Switchyard's NDJSON
//! stream (which carries load reports) has its Prometheus `/metrics` read at an interval,
//! and the engine's running/waiting requests and KV usage become its reported load
//! (`kv::engine_metrics`). So a router sees load that other routers or clients put on a
//! worker. A worker whose page has none of the engines' gauges (not an engine) is asked
//! again only after [`QUIET_RETRY`]; one whose page could not be read (a timeout, a
//! refused connection, an error status: a busy or restarting engine, whose load matters
//! most then) is asked again after a backoff that doubles from the interval up to
//! [`QUIET_RETRY`], and a page read resets it. One scrape never waits longer than
//! [`SCRAPE_TIMEOUT`]. Every available worker's `/v1/models` is also read, once and then
//! every [`MODELS_EVERY`] (a page not read, after the same backoff: a worker first seen
//! while its engine loads is known within seconds of its first answer), for its context
//! length (`max_model_len`: the endpoint's
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
/// A worker whose page has no engine gauges is scraped again after this long; the
/// longest backoff of one whose page could not be read.
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

/// Why a worker's load could not be read from its page.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Unusable {
    /// The page was read and has none of the engines' gauges (or there is none: 404):
    /// not an engine, asked again after [`QUIET_RETRY`].
    NotEngine(String),
    /// The page could not be read: asked again after a backoff.
    Unread(String),
}

/// When a worker whose page could not be read `failures` times in a row is asked
/// again: the interval, doubled for each failure after the first, at most
/// [`QUIET_RETRY`].
fn backoff(interval: Duration, failures: u32) -> Duration {
    let doubled = interval.saturating_mul(1 << failures.saturating_sub(1).min(16));
    doubled.min(QUIET_RETRY)
}

/// When each worker's page is next due, and how many reads of it failed in a row: a page
/// read is due again after `every` (at every tick when zero), one not read after the
/// [`backoff`]. Serves both pages: `/metrics` at every tick, `/v1/models` every
/// [`MODELS_EVERY`].
#[derive(Debug, Default)]
struct Due {
    every: Duration,
    due: HashMap<InstanceId, Instant>,
    unread: HashMap<InstanceId, u32>,
}

impl Due {
    fn every(every: Duration) -> Due {
        Due {
            every,
            ..Due::default()
        }
    }

    /// Forgets the workers gone and the dates past (those are due again).
    fn retain(&mut self, live: impl Fn(&InstanceId) -> bool, now: Instant) {
        self.due.retain(|id, due| live(id) && *due > now);
        self.unread.retain(|id, _| live(id));
    }

    /// Whether `id`'s page is due now; if so, it is next due after `every` unless
    /// [`Due::unread`] or [`Due::wait`] says otherwise.
    fn take(&mut self, id: InstanceId, now: Instant) -> bool {
        if self.due.get(&id).is_some_and(|due| *due > now) {
            return false;
        }
        if !self.every.is_zero() {
            self.due.insert(id, now + self.every);
        }
        true
    }

    /// A page read (for `/v1/models`, an engine's or not): the failures are forgotten.
    fn read(&mut self, id: InstanceId) {
        self.unread.remove(&id);
    }

    /// A page not read (an engine still starting, or busy): asked again after the
    /// backoff, which is returned — not after `every`, or a worker first seen while its
    /// engine loaded would go minutes without its `/v1/models` (its context length,
    /// whether it streams token IDs for migration).
    fn unread(&mut self, id: InstanceId, now: Instant, interval: Duration) -> Duration {
        let k = self.unread.entry(id).or_default();
        *k = k.saturating_add(1);
        let after = backoff(interval, *k);
        self.wait(id, now, after, interval);
        after
    }

    /// Asked again at the tick after `after` (a wait of one interval is no wait).
    fn wait(&mut self, id: InstanceId, now: Instant, after: Duration, interval: Duration) {
        self.due.insert(id, now + after.saturating_sub(interval));
    }
}

/// Scrapes `router`'s workers every `interval` until the router is dropped.
pub fn spawn(router: &Arc<KvRouter>, interval: Duration) -> tokio::task::JoinHandle<()> {
    let weak = Arc::downgrade(router);
    let http = super::background_http(&router.config.tls, SCRAPE_TIMEOUT);
    tokio::spawn(async move {
        // The engines' `/metrics` pages, and every worker's `/v1/models` (NDJSON or not).
        let mut pages = Due::default();
        let mut models = Due::every(MODELS_EVERY);
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(router) = weak.upgrade() else { return };
            let snap = router.client().snapshot();
            let now = Instant::now();
            pages.retain(|id| snap.instances.contains_key(id), now);
            models.retain(|id| snap.instances.contains_key(id), now);
            let mut contexts = tokio::task::JoinSet::new();
            for id in snap.available.iter() {
                let Some(state) = snap.instances.get(id) else {
                    continue;
                };
                if !models.take(*id, now) {
                    continue;
                }
                let url = format!("{}/v1/models", state.info.url);
                let (http, model, id) = (http.clone(), state.info.model.clone(), *id);
                contexts.spawn(async move {
                    let read = fetch(&http, &url, MAX_MODELS).await.ok();
                    (id, read.map(|body| engine_metrics::models(&body, &model)))
                });
            }
            let mut scrapes = tokio::task::JoinSet::new();
            for id in snap.available.iter() {
                let Some(state) = snap.instances.get(id) else {
                    continue;
                };
                if state.info.events_url.is_some() || !pages.take(*id, now) {
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
                let Ok((id, read)) = done else { continue };
                let Some(read) = read else {
                    models.unread(id, Instant::now(), interval);
                    continue;
                };
                models.read(id);
                if let Some(found) = read {
                    let Some(router) = weak.upgrade() else { return };
                    router.note_models(id, found);
                }
            }
            while let Some(done) = scrapes.join_next().await {
                let Ok((id, result)) = done else { continue };
                let Some(router) = weak.upgrade() else { return };
                match result {
                    Ok(found) => {
                        router.scrape_stats.ok.fetch_add(1, Ordering::Relaxed);
                        router.report_engine_load(id, found.load, found.size_known);
                        pages.read(id);
                    }
                    Err(why) => {
                        let n = router.scrape_stats.failed.fetch_add(1, Ordering::Relaxed) + 1;
                        let (after, why) = match why {
                            Unusable::NotEngine(why) => {
                                pages.wait(id, Instant::now(), QUIET_RETRY, interval);
                                (QUIET_RETRY, why)
                            }
                            Unusable::Unread(why) => {
                                (pages.unread(id, Instant::now(), interval), why)
                            }
                        };
                        if n <= 10 || n.is_multiple_of(1000) {
                            tracing::debug!(instance = %id, why, "engine metrics not usable; asking again in {after:?}");
                        }
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
) -> Result<Bytes, Unusable> {
    let unread = |e: String| Unusable::Unread(e);
    let uri: hyper::Uri = url
        .parse()
        .map_err(|e| Unusable::NotEngine(format!("bad URL: {e}")))?;
    let read = async {
        let response = http.get(uri).await.map_err(|e| unread(e.to_string()))?;
        match response.status() {
            s if s.is_success() => {}
            hyper::StatusCode::NOT_FOUND => return Err(Unusable::NotEngine("HTTP 404".into())),
            s => return Err(unread(format!("HTTP {s}"))),
        }
        let body = Limited::new(response.into_body(), max)
            .collect()
            .await
            .map_err(|e| unread(e.to_string()))?
            .to_bytes();
        Ok(body)
    };
    tokio::time::timeout(SCRAPE_TIMEOUT, read)
        .await
        .map_err(|_| unread(format!("timed out after {SCRAPE_TIMEOUT:?}")))?
}

async fn scrape(
    http: &HttpClient<Connector, Empty<Bytes>>,
    url: &str,
    block_size: u32,
) -> Result<engine_metrics::EngineLoad, Unusable> {
    let body = fetch(http, url, MAX_PAGE).await?;
    let text = std::str::from_utf8(&body).map_err(|_| Unusable::NotEngine("not UTF-8".into()))?;
    engine_metrics::parse(text, block_size)
        .ok_or_else(|| Unusable::NotEngine("no vLLM or SGLang load gauges".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A page not read is asked for again at the next tick, then at doubling waits up
    /// to the quiet retry; never sooner than the interval, never later than the quiet
    /// retry, however many times in a row (and the shift never overflows).
    #[test]
    fn an_unread_page_backs_off_from_the_interval_to_the_quiet_retry() {
        let s = Duration::from_secs;
        let waits: Vec<_> = (1..=7).map(|k| backoff(s(1), k)).collect();
        assert_eq!(waits, [s(1), s(2), s(4), s(8), s(16), s(30), s(30)]);
        assert_eq!(backoff(s(1), u32::MAX), QUIET_RETRY);
        assert_eq!(
            backoff(Duration::from_millis(250), 1),
            Duration::from_millis(250)
        );
        assert_eq!(backoff(s(60), 1), QUIET_RETRY, "an interval past it");
    }

    /// A worker's `/v1/models` is read when first seen, then every five minutes; one not
    /// read (an engine still loading) is asked for again at the next tick, then at the
    /// doubling backoff, and once read it is back to five minutes.
    #[test]
    fn an_unread_models_page_is_asked_for_again_at_the_backoff_not_in_five_minutes() {
        let s = Duration::from_secs;
        let (id, t0) = (InstanceId(7), Instant::now());
        let mut m = Due::every(MODELS_EVERY);
        let due_at = |m: &mut Due, from: Instant| {
            (0..=400)
                .map(|k| from + s(k))
                .find(|t| {
                    m.retain(|_| true, *t);
                    m.due.get(&id).is_none_or(|due| due <= t)
                })
                .map(|t| t - from)
        };
        assert!(m.take(id, t0), "due when first seen");
        assert!(!m.take(id, t0 + s(1)));
        assert_eq!(due_at(&mut m, t0), Some(MODELS_EVERY), "read: five minutes");
        // Not read, four times in a row: due again after 0, 1, 3 and 7 s (the tick after
        // waits of 1, 2, 4 and 8 s, ticks a second apart).
        let mut waits = Vec::new();
        let mut t = t0;
        for _ in 0..4 {
            assert!(m.take(id, t));
            m.unread(id, t, s(1));
            let wait = due_at(&mut m, t).unwrap();
            waits.push(wait);
            t += wait;
        }
        assert_eq!(waits, [s(0), s(1), s(3), s(7)]);
        assert!(m.take(id, t));
        m.read(id);
        assert_eq!(due_at(&mut m, t), Some(MODELS_EVERY), "read at last");
        // Gone: forgotten, and due at once if it comes back.
        m.unread(id, t, s(1));
        m.retain(|_| false, t);
        assert!(m.due.is_empty() && m.unread.is_empty());
    }

    /// The same schedule for `/metrics`: due at every tick while read; one not read at
    /// the backoff; a page without engine gauges after the quiet retry.
    #[test]
    fn a_metrics_page_is_due_at_every_tick_until_it_is_not_read() {
        let s = Duration::from_secs;
        let (id, t0) = (InstanceId(3), Instant::now());
        let mut p = Due::default();
        for k in 0..3 {
            p.retain(|_| true, t0 + s(k));
            assert!(p.take(id, t0 + s(k)), "tick {k}");
        }
        assert_eq!(p.unread(id, t0, s(1)), s(1));
        assert_eq!(p.unread(id, t0, s(1)), s(2));
        assert!(!p.take(id, t0), "waiting out the backoff");
        p.retain(|_| true, t0 + s(1));
        assert!(p.take(id, t0 + s(1)), "the tick after two seconds' backoff");
        p.read(id);
        assert_eq!(p.unread(id, t0, s(1)), s(1), "a read resets the backoff");
        p.wait(id, t0, QUIET_RETRY, s(1));
        p.retain(|_| true, t0 + s(28));
        assert!(!p.take(id, t0 + s(28)));
        p.retain(|_| true, t0 + s(29));
        assert!(p.take(id, t0 + s(29)));
    }
}
