//! Running engines (real vLLM servers) as the replay's fleet instead of mock workers: the
//! routers are compared on engines the replay did not start, so before each router it
//! empties their prefix caches (vLLM's `POST /reset_prefix_cache`, served when the engine
//! runs with `VLLM_SERVER_DEV_MODE=1`), and it reads the hit rate from the engines' own
//! counters (`vllm:prefix_cache_hits` over `vllm:prefix_cache_queries`, in tokens) rather
//! than from what the answers' usage says.

use std::time::{Duration, Instant};

use super::ReplayConfig;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// The engines, as `serve --worker` takes them (`URL` or `URL#kv_events=...`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Engines {
    /// One spec per engine.
    pub specs: Vec<String>,
    /// Their measured timing, for the oracle floor of TTFT (`--engine-floor`).
    pub floor: Option<super::floor::Measured>,
}

/// What an engine's counters said at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counters {
    /// Prompt tokens found in the prefix cache.
    pub hits: f64,
    /// Prompt tokens looked up in it.
    pub queries: f64,
    /// Requests finished (every finish reason).
    pub finished: f64,
}

/// The largest `/metrics` page read (a vLLM engine's is ~30 KiB).
const METRICS_LIMIT: usize = 4 << 20;

impl Engines {
    /// The engines' base URLs (each spec without its `#...` options).
    pub fn urls(&self) -> Vec<String> {
        self.specs.iter().map(|s| url_of(s).to_string()).collect()
    }

    /// Empties every engine's prefix cache. vLLM refuses while blocks are held (a request
    /// still running): retried for up to a minute.
    pub async fn reset(&self) -> Result<(), String> {
        for url in self.urls() {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let (status, body) = request(&format!("{url}/reset_prefix_cache"), true).await?;
                if status == 404 {
                    return Err(format!(
                        "{url} has no /reset_prefix_cache: start vLLM with VLLM_SERVER_DEV_MODE=1"
                    ));
                }
                let success = serde_json::from_slice::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|v| v.get("success").and_then(|s| s.as_bool()));
                // Engines that answer 200 without a body have reset.
                if status == 200 && success != Some(false) {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(format!(
                        "{url} did not reset its prefix cache within 60 s (status {status})"
                    ));
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        Ok(())
    }

    /// Every engine's counters, in the order of `specs`.
    pub async fn counters(&self) -> Result<Vec<Counters>, String> {
        let mut out = Vec::new();
        for url in self.urls() {
            let (status, body) = request(&format!("{url}/metrics"), false).await?;
            if status != 200 {
                return Err(format!("{url}/metrics answered {status}"));
            }
            out.push(parse(&String::from_utf8_lossy(&body)));
        }
        Ok(out)
    }
}

/// Running engines' first requests are slow (kernels chosen, memory touched): the first
/// router would pay for it. A tenth of the trace (20 to 200 requests), straight to the
/// engines in turn, before any router; its figures are not kept.
pub(super) async fn warm_up(
    config: &ReplayConfig,
    reqs: &[super::TraceRequest],
) -> Result<(), String> {
    let n = (reqs.len() / 10).clamp(20, 200).min(reqs.len());
    let warm = std::sync::Arc::new(reqs[..n].to_vec());
    let urls = config.engines.urls();
    eprintln!("[warm-up] {n} requests straight to {} engines", urls.len());
    let run = super::replay_once(config, "warm-up", &urls, warm, super::Prompts::Text).await;
    let failed = run.outcomes.iter().filter(|o| !o.ok).count();
    if failed == run.outcomes.len() {
        let why = run.outcomes.iter().find_map(|o| o.error.clone());
        return Err(format!(
            "the engines answered none of the warm-up's {n} requests: {}",
            why.unwrap_or_default()
        ));
    }
    Ok(())
}

/// A spec's URL: what comes before `#`.
pub fn url_of(spec: &str) -> &str {
    spec.split('#').next().unwrap_or(spec)
}

/// The fleet's hit rate between two readings, and each engine's finished requests.
pub fn delta(before: &[Counters], after: &[Counters]) -> (Option<f64>, Vec<u64>) {
    let (mut hits, mut queries) = (0.0, 0.0);
    let mut finished = Vec::new();
    for (b, a) in before.iter().zip(after) {
        hits += (a.hits - b.hits).max(0.0);
        queries += (a.queries - b.queries).max(0.0);
        finished.push((a.finished - b.finished).max(0.0) as u64);
    }
    ((queries > 0.0).then(|| hits / queries), finished)
}

/// Sums the samples of the counters named in a Prometheus text exposition (every label
/// set; vLLM labels them by model and engine index).
pub fn parse(text: &str) -> Counters {
    let mut c = Counters::default();
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let name = line.split(['{', ' ']).next().unwrap_or("");
        let slot = match name {
            "vllm:prefix_cache_hits_total" => &mut c.hits,
            "vllm:prefix_cache_queries_total" => &mut c.queries,
            "vllm:request_success_total" => &mut c.finished,
            _ => continue,
        };
        if let Some(v) = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite())
        {
            *slot += v;
        }
    }
    c
}

/// A GET (or an empty POST) answered within ten seconds, its body bounded.
async fn request(url: &str, post: bool) -> Result<(u16, Bytes), String> {
    let http: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let req = hyper::Request::builder()
        .method(if post { "POST" } else { "GET" })
        .uri(url)
        .body(Full::new(Bytes::new()))
        .map_err(|e| format!("{url}: {e}"))?;
    tokio::time::timeout(Duration::from_secs(10), async {
        let r = http.request(req).await.map_err(|e| format!("{url}: {e}"))?;
        let status = r.status().as_u16();
        let body = http_body_util::Limited::new(r.into_body(), METRICS_LIMIT)
            .collect()
            .await
            .map_err(|e| format!("{url}: {e}"))?
            .to_bytes();
        Ok((status, body))
    })
    .await
    .map_err(|_| format!("{url}: no answer within 10 s"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_summed_over_label_sets_and_deltas_give_the_hit_rate() {
        let page = "\
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"replay\"} 96.0
vllm:prefix_cache_hits_created{engine=\"0\",model_name=\"replay\"} 1.7e9
vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"replay\"} 400.0
vllm:request_success_total{engine=\"0\",finished_reason=\"stop\",model_name=\"replay\"} 3.0
vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"replay\"} 7.0
vllm:num_requests_running{engine=\"0\",model_name=\"replay\"} 1.0
";
        let c = parse(page);
        assert_eq!(
            c,
            Counters {
                hits: 96.0,
                queries: 400.0,
                finished: 10.0
            }
        );
        let later = Counters {
            hits: 396.0,
            queries: 1000.0,
            finished: 15.0,
        };
        let other = Counters::default();
        let (rate, finished) = delta(
            &[c, other],
            &[
                later,
                Counters {
                    hits: 0.0,
                    queries: 400.0,
                    finished: 5.0,
                },
            ],
        );
        // (300 + 0) hits of (600 + 400) queried.
        assert_eq!(rate, Some(0.3));
        assert_eq!(finished, vec![5, 5]);
        assert_eq!(delta(&[c], &[c]).0, None, "nothing queried, no rate");
        assert_eq!(
            url_of("http://127.0.0.1:8000#kv_events=tcp://127.0.0.1:5557"),
            "http://127.0.0.1:8000"
        );
    }
}
