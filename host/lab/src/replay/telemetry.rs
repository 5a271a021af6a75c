//! The decision telemetry of a replayed policy, read from its routers' admin API after
//! the run (summed over replicas), and the shadow attached beside it, if any.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde_json::Value;

use switchyard_router::shadow::ShadowTally;

/// The admin path of the replay's endpoint.
const ENDPOINT: &str = "/admin/endpoints/default/replay/generate";

/// What the routers said about their decisions, summed over replicas.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Telemetry {
    /// Requests routed.
    pub routed: u64,
    /// Leading prompt blocks cached on the chosen workers.
    pub chosen_overlap_blocks: u64,
    /// ... on the best candidates.
    pub best_overlap_blocks: u64,
    /// Responses that reported cached tokens.
    pub cache_reports: u64,
    /// Over those, the tokens the router predicted cached.
    pub predicted_cached_tokens: u64,
    /// ... and the tokens the workers reported cached.
    pub reported_cached_tokens: u64,
    /// Requests not routed (every kind).
    pub unrouted: u64,
    /// The shadow beside the policy, if one ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shadow: Option<ShadowTelemetry>,
}

/// A shadow's comparison with the live policy, summed over replicas.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ShadowTelemetry {
    /// The shadow (`name version`).
    pub name: String,
    /// What it did, as the routers count it.
    #[serde(flatten)]
    pub tally: ShadowTally,
}

impl Telemetry {
    /// Block-weighted overlap achieved over the best available.
    pub fn overlap_ratio(&self) -> Option<f64> {
        switchyard_router::shadow::ratio(
            self.chosen_overlap_blocks,
            self.best_overlap_blocks,
            self.routed,
        )
    }
}

/// One admin API call; its JSON answer, or why it failed.
async fn call(
    method: hyper::Method,
    url: &str,
    token: &str,
    config: Option<&str>,
    body: Bytes,
) -> Result<Value, String> {
    let http: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(url)
        .header("authorization", format!("Bearer {token}"));
    if let Some(config) = config {
        req = req.header("x-policy-config", config);
    }
    let req = req.body(Full::new(body)).map_err(|e| e.to_string())?;
    tokio::time::timeout(Duration::from_secs(120), async {
        let r = http.request(req).await.map_err(|e| e.to_string())?;
        let status = r.status();
        let body = r
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        if !status.is_success() {
            return Err(format!(
                "{url} answered {status}: {}",
                String::from_utf8_lossy(&body)
            ));
        }
        serde_json::from_slice(&body).map_err(|e| e.to_string())
    })
    .await
    .map_err(|_| format!("{url} did not answer"))?
}

/// Attaches `spec` (a built-in name or a `.wasm` path, with `=CONFIG` optionally) as the
/// shadow of the replay's endpoint on the router at `url`.
pub async fn attach_shadow(url: &str, token: &str, spec: &str) -> Result<(), String> {
    let (name, config) = spec.split_once('=').unwrap_or((spec, "{}"));
    let (target, body) = if switchyard_policy::builtin(name).is_some() {
        (
            format!("{url}{ENDPOINT}/shadow?builtin={name}"),
            Bytes::new(),
        )
    } else {
        let bytes = std::fs::read(name).map_err(|e| format!("cannot read {name}: {e}"))?;
        (format!("{url}{ENDPOINT}/shadow"), Bytes::from(bytes))
    };
    call(hyper::Method::PUT, &target, token, Some(config), body)
        .await
        .map(|_| ())
        .map_err(|e| format!("shadow {spec} refused: {e}"))
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// A shadow's tally from its admin API answer.
fn tally(s: &Value) -> ShadowTally {
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    let (b, c) = (&s["overlap_blocks"], &s["predicted_cost_total"]);
    ShadowTally {
        offered: u(&s["offered"]),
        dropped: u(&s["dropped"]),
        compared: u(&s["compared"]),
        agreed: u(&s["agreed"]),
        rejected: u(&s["rejected"]),
        live_rejected: u(&s["live_rejected"]),
        failures: u(&s["failures"]),
        shadow_overlap_blocks: u(&b["shadow"]),
        live_overlap_blocks: u(&b["live"]),
        best_overlap_blocks: u(&b["best"]),
        shadow_cost: f(&c["shadow"]),
        live_cost: f(&c["live"]),
        calls: u(&s["calls"]),
        call_seconds: f(&s["call_seconds"]),
    }
}

/// Reads every replica's telemetry (after waiting, at most 30 s, for their shadows to
/// finish the decisions queued) and sums it.
pub async fn read(urls: &[String], token: &str) -> Result<Telemetry, String> {
    let mut t = Telemetry::default();
    for url in urls {
        let deadline = Instant::now() + Duration::from_secs(30);
        let ep = loop {
            let all = call(
                hyper::Method::GET,
                &format!("{url}/admin/endpoints"),
                token,
                None,
                Bytes::new(),
            )
            .await?;
            let ep = all["endpoints"]
                .as_array()
                .and_then(|a| a.first())
                .cloned()
                .unwrap_or(Value::Null);
            let settled = ep["shadow"].is_null() || tally(&ep["shadow"]).settled();
            if settled || Instant::now() > deadline {
                break ep;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let q = &ep["quality"];
        t.routed += u(&q["routed"]);
        t.chosen_overlap_blocks += u(&q["chosen_overlap_blocks"]);
        t.best_overlap_blocks += u(&q["best_overlap_blocks"]);
        t.cache_reports += u(&q["cache_reports"]);
        t.predicted_cached_tokens += u(&q["predicted_cached_tokens"]);
        t.reported_cached_tokens += u(&q["reported_cached_tokens"]);
        t.unrouted += q["unrouted"]
            .as_object()
            .map_or(0, |m| m.values().map(u).sum());
        let s = &ep["shadow"];
        if !s.is_null() {
            let sh = t.shadow.get_or_insert_with(|| ShadowTelemetry {
                name: format!(
                    "{} {}",
                    s["name"].as_str().unwrap_or("?"),
                    s["version"].as_str().unwrap_or("?")
                ),
                ..ShadowTelemetry::default()
            });
            sh.tally.add(&tally(s));
        }
    }
    Ok(t)
}
