//! The admin API. Every route needs `Authorization: Bearer <admin token>`; without a
//! configured token the admin API is off (401). `GET /admin/ui` is the admin page: it
//! takes the token once in `?token=` and sets a cookie that lets the page read (GET
//! only) the routes below.
//!
//! | route | does |
//! | --- | --- |
//! | `GET /admin/endpoints` | every endpoint: its policy, history, shadow, decision quality and instances |
//! | `GET /admin/trends` | every endpoint's last five minutes, a point a second: decisions/s, overlap against the best, decision time p50/p99, shadow agreement, in flight |
//! | `GET /admin/endpoints/{ns}/{component}/{endpoint}/policy` | the current policy: name, version, sha256, loaded at, decisions, failures, fallbacks |
//! | `PUT /admin/endpoints/{path}/policy` | body: a `.wasm` component (or `?builtin=NAME`); config in the `x-policy-config` header; validated (canary) before the swap, 400 with the reason if refused |
//! | `POST /admin/endpoints/{path}/policy/rollback` | back to the previous policy |
//! | `PUT /admin/endpoints/{path}/shadow` | body as for `policy` (and `?sample=0.25` for a share of the decisions); validated, then decides beside the live policy without serving |
//! | `GET /admin/endpoints/{path}/shadow` | the shadow and how its decisions compare with the live policy's (`null` if none) |
//! | `DELETE /admin/endpoints/{path}/shadow` | removes the shadow |
//! | `POST /admin/endpoints/{path}/shadow/promote` | the shadow becomes the live policy in one step (the live one becomes the rollback target) |
//! | `GET /admin/endpoints/{path}/quality` | the live decisions' quality: overlap achieved against the best available, predicted against reported cached tokens, decisions per worker, requests not routed by kind |
//! | `GET /admin/endpoints/{path}/instances` | instances with availability, load and where their cache view comes from |
//! | `POST /admin/endpoints/{path}/explain` | body: an OpenAI completion or chat request; answers what the router would do with it (prompt tokens and blocks, every candidate's overlap, load and cache view, the chosen worker and who decided) without forwarding it |

use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};

use super::{ApiError, Body, Gateway, json_response};
use switchyard_discovery::EndpointPath;
use switchyard_policy::{
    LoadedPolicy, PolicyError, PolicyHandle, PolicyInfo, PolicySource, PolicyStatus,
};
use switchyard_router::KvRouter;
use switchyard_router::client::Availability;
use switchyard_router::shadow::ShadowStatus;

use switchyard_policy::MAX_POLICY_BYTES;

/// The cookie the admin page's reads carry: the sha256 of the admin token, never the
/// token itself. It grants GET requests only, so a page another site opens cannot
/// change a policy with it (and it is `SameSite=Strict` besides).
const UI_COOKIE: &str = "switchyard_admin";

fn sha256_hex(text: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(text)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Constant time, length included: both sides are hashed first, so neither how much
/// matches nor how long the token is shows in the time taken.
fn same_secret(given: &str, token: &str) -> bool {
    use sha2::Digest;
    let (a, b) = (sha2::Sha256::digest(given), sha2::Sha256::digest(token));
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

fn cookie<'a>(req: &'a Request<Incoming>, name: &str) -> Option<&'a str> {
    req.headers()
        .get_all(hyper::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|kv| {
            let (k, v) = kv.trim().split_once('=')?;
            (k == name).then_some(v)
        })
}

fn admin_token(gw: &Gateway) -> Result<&str, ApiError> {
    gw.config
        .admin_token
        .as_deref()
        .ok_or(ApiError::Unauthorized(
            "the admin API is disabled (start the router with --admin-token-file or SWITCHYARD_ADMIN_TOKEN)",
        ))
}

fn authorized(gw: &Gateway, req: &Request<Incoming>) -> Result<(), ApiError> {
    let token = admin_token(gw)?;
    let bearer = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, rest) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
        });
    match bearer {
        Some(given) if same_secret(given, token) => Ok(()),
        Some(_) => Err(ApiError::Unauthorized("wrong bearer token")),
        None => match cookie(req, UI_COOKIE) {
            Some(c) if req.method() == Method::GET && same_secret(c, &sha256_hex(token)) => Ok(()),
            Some(_) if req.method() != Method::GET => Err(ApiError::Unauthorized(
                "the admin page's cookie only reads: changes need the bearer token",
            )),
            _ => Err(ApiError::Unauthorized("missing bearer token")),
        },
    }
}

/// The admin page, embedded in the binary: no build step, no files beside the router.
const UI_PAGE: &str = include_str!("ui.html");

/// `GET /admin/ui`: the page, to a browser that shows the admin token once, in
/// `?token=` (the page then takes it out of the address) or already holds the page's
/// cookie; anyone else gets a 401 page asking for the token.
fn ui(gw: &Gateway, req: &Request<Incoming>) -> Response<Body> {
    let html = |status: StatusCode, body: String, set_cookie: Option<String>| {
        let mut b = Response::builder()
            .status(status)
            .header("content-type", "text/html; charset=utf-8")
            .header("cache-control", "no-store")
            .header("x-frame-options", "DENY")
            .header("referrer-policy", "no-referrer");
        if let Some(c) = set_cookie {
            b = b.header(hyper::header::SET_COOKIE, c);
        }
        b.body(super::full_body(body)).expect("valid response")
    };
    let refused = |why: &str| {
        html(
            StatusCode::UNAUTHORIZED,
            format!(
                "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>Switchyard: admin token required</title></head>\
                 <body style=\"font:15px system-ui;margin:40px\"><h1>Admin token required</h1><p id=\"why\">{why}</p>\
                 <form method=\"get\" action=\"/admin/ui\"><input type=\"password\" name=\"token\" placeholder=\"admin token\" autofocus> \
                 <button>Open</button></form></body></html>"
            ),
            None,
        )
    };
    let Ok(token) = admin_token(gw) else {
        return refused(
            "The admin API is disabled: start the router with --admin-token-file or SWITCHYARD_ADMIN_TOKEN.",
        );
    };
    let query_token = req.uri().query().and_then(|q| {
        form_urlencoded::parse(q.as_bytes())
            .find(|(k, _)| k == "token")
            .map(|(_, v)| v.into_owned())
    });
    if let Some(given) = query_token {
        if !same_secret(&given, token) {
            return refused("That admin token is wrong.");
        }
        let cookie = format!(
            "{UI_COOKIE}={}; Path=/admin; HttpOnly; SameSite=Strict",
            sha256_hex(token)
        );
        return html(StatusCode::OK, UI_PAGE.to_string(), Some(cookie));
    }
    match authorized(gw, req) {
        Ok(()) => html(StatusCode::OK, UI_PAGE.to_string(), None),
        Err(_) => refused("Open this page with the router's admin token."),
    }
}

pub(crate) async fn handle(
    gw: &Arc<Gateway>,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    if req.uri().path() == "/admin/ui" && req.method() == Method::GET {
        return Ok(ui(gw, &req));
    }
    authorized(gw, &req)?;
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    if path == "/admin/trends" && method == Method::GET {
        let all: serde_json::Map<String, Value> = gw
            .fleet
            .routers()
            .iter()
            .map(|r| {
                let ep = r.endpoint().to_string();
                let points = json!(gw.metrics.trends.points(&ep));
                (ep, points)
            })
            .collect();
        return Ok(json_response(StatusCode::OK, &Value::Object(all)));
    }
    if path == "/admin/endpoints" && method == Method::GET {
        let all: Vec<Value> = gw
            .fleet
            .routers()
            .iter()
            .map(|r| endpoint_json(r))
            .collect();
        return Ok(json_response(StatusCode::OK, &json!({"endpoints": all})));
    }
    let rest = path
        .strip_prefix("/admin/endpoints/")
        .ok_or_else(|| ApiError::NotFound(path.clone()))?;
    let (endpoint, action) = split_action(rest).ok_or_else(|| ApiError::NotFound(path.clone()))?;
    let endpoint: EndpointPath = endpoint
        .parse()
        .map_err(|e: switchyard_discovery::KeyError| ApiError::Refused(e.to_string()))?;
    let router = gw
        .fleet
        .router(&endpoint)
        .ok_or_else(|| ApiError::NotFound(format!("endpoint {endpoint}")))?;
    match (method, action) {
        (Method::GET, "policy") => Ok(json_response(
            StatusCode::OK,
            &status_json(&router.policy().status()),
        )),
        (Method::GET, "instances") => Ok(json_response(StatusCode::OK, &instances_json(&router))),
        (Method::PUT | Method::POST, "policy") => upload(gw, &router, req).await,
        (Method::POST, "explain") => explain(gw, &router, req).await,
        (Method::GET, "shadow") => Ok(json_response(
            StatusCode::OK,
            &router
                .shadow_status()
                .map_or(Value::Null, |s| shadow_json(&s)),
        )),
        (Method::PUT | Method::POST, "shadow") => upload_shadow(gw, &router, req).await,
        (Method::DELETE, "shadow") => match router.detach_shadow() {
            Some(status) => Ok(json_response(StatusCode::OK, &shadow_json(&status))),
            None => Err(ApiError::Refused(
                "there is no shadow policy to remove".into(),
            )),
        },
        (Method::POST, "shadow/promote") => {
            let r = router.clone();
            match blocking("promote", move || r.promote_shadow()).await? {
                Some(Ok(status)) => Ok(json_response(StatusCode::OK, &status_json(&status))),
                Some(Err(e)) => Err(ApiError::Refused(format!(
                    "not promoted; the live policy keeps serving: {e}"
                ))),
                None => Err(ApiError::Refused(
                    "there is no shadow policy to promote".into(),
                )),
            }
        }
        (Method::GET, "quality") => Ok(json_response(StatusCode::OK, &quality_json(&router))),
        (Method::POST, "policy/rollback") => match router.policy().rollback() {
            Some(status) => Ok(json_response(StatusCode::OK, &status_json(&status))),
            None => Err(ApiError::Refused(
                "there is no previous policy to roll back to".into(),
            )),
        },
        (m, a) => Err(ApiError::NotFound(format!("{m} {a} on {endpoint}"))),
    }
}

/// `ns/comp/ep/policy/rollback` → (`ns/comp/ep`, `policy/rollback`).
fn split_action(rest: &str) -> Option<(&str, &str)> {
    let mut slashes = rest.match_indices('/').map(|(i, _)| i);
    let third = slashes.nth(2)?;
    Some((&rest[..third], &rest[third + 1..]))
}

/// A policy as an upload names it: a built-in's name, or `.wasm` bytes; with its
/// configuration (`x-policy-config`) and, for a shadow, the share of decisions
/// (`?sample=`).
struct Upload {
    builtin: Option<String>,
    bytes: bytes::Bytes,
    config: String,
    sample: f64,
}

fn query_value<'a>(req: &'a Request<Incoming>, key: &str) -> Option<&'a str> {
    req.uri().query().and_then(|q| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
    })
}

async fn read_upload(gw: &Gateway, req: Request<Incoming>) -> Result<Upload, ApiError> {
    let config = req
        .headers()
        .get("x-policy-config")
        .map(|v| {
            v.to_str()
                .map(str::to_string)
                .map_err(|_| ApiError::Refused("x-policy-config must be text".into()))
        })
        .transpose()?
        .unwrap_or_else(|| "{}".to_string());
    let builtin = query_value(&req, "builtin").map(str::to_string);
    // Only a built-in's name: never a path on the router's disk.
    if let Some(name) = &builtin
        && switchyard_policy::builtin(name).is_none()
    {
        let known: Vec<&str> = switchyard_policy::BUILTINS.iter().map(|b| b.name).collect();
        return Err(ApiError::Refused(format!(
            "`builtin={}` is not a built-in policy (built-ins: {})",
            switchyard_policy::guest_text(name),
            known.join(", ")
        )));
    }
    let sample = match query_value(&req, "sample") {
        None => 1.0,
        Some(v) => match v.parse::<f64>() {
            Ok(x) if x > 0.0 && x <= 1.0 => x,
            _ => {
                return Err(ApiError::Refused(format!(
                    "`sample={}` must be a share of the decisions in (0, 1]",
                    switchyard_policy::guest_text(v)
                )));
            }
        },
    };
    // Within the body budget and a deadline like any body; an upload may take a minute.
    let limits = super::body::Limits {
        max: MAX_POLICY_BYTES,
        total: gw.config.max_body_bytes_total,
        deadline: gw.config.client_idle_timeout.max(Duration::from_secs(60)),
    };
    let (bytes, _held) = super::body::read(req.into_body(), &gw.bodies, limits).await?;
    Ok(Upload {
        builtin,
        bytes,
        config,
        sample,
    })
}

impl Upload {
    /// Loads the uploaded policy; a refusal is counted on `handle`.
    fn load(&self, handle: &PolicyHandle, source: &str) -> Result<LoadedPolicy, PolicyError> {
        match &self.builtin {
            Some(name) => handle.engine().load_spec(name, &self.config),
            None => handle.engine().load(
                PolicySource::Uploaded(source.into()),
                &self.bytes,
                &self.config,
            ),
        }
        .inspect_err(|e| handle.refused(e))
    }
}

/// Runs `f` (a compile, a canary: milliseconds of CPU) off the async workers.
async fn blocking<T: Send + 'static>(
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Refused(format!("{what} panicked: {e}")))
}

async fn upload(
    gw: &Gateway,
    router: &Arc<KvRouter>,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let u = read_upload(gw, req).await?;
    let handle = router.policy().clone();
    let result = blocking("policy load", move || {
        handle.swap(u.load(&handle, "admin API")?)
    })
    .await?;
    match result {
        Ok(status) => Ok(json_response(StatusCode::OK, &status_json(&status))),
        Err(e) => Err(ApiError::Refused(format!(
            "policy refused; the current policy keeps serving: {e}"
        ))),
    }
}

/// `PUT .../shadow`: loads a policy like an upload and attaches it as the shadow.
async fn upload_shadow(
    gw: &Gateway,
    router: &Arc<KvRouter>,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let u = read_upload(gw, req).await?;
    let router = router.clone();
    let result = blocking("shadow load", move || {
        router.attach_shadow(u.load(router.policy(), "admin API (shadow)")?, u.sample)
    })
    .await?;
    match result {
        Ok(status) => Ok(json_response(StatusCode::OK, &shadow_json(&status))),
        Err(e) => Err(ApiError::Refused(format!(
            "shadow refused; nothing changed: {e}"
        ))),
    }
}

/// Largest request body `explain` reads.
const MAX_EXPLAIN_BYTES: usize = 32 << 20;

async fn explain(
    gw: &Arc<Gateway>,
    router: &Arc<KvRouter>,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let limits = super::body::Limits {
        max: MAX_EXPLAIN_BYTES,
        total: gw.config.max_body_bytes_total,
        deadline: gw.config.client_idle_timeout,
    };
    let (body, _held) = super::body::read(req.into_body(), &gw.bodies, limits).await?;
    // A chat request has `messages`; anything else is read as a completion request.
    let api = match serde_json::from_slice::<Value>(&body) {
        Ok(v) if v.get("messages").is_some() => switchyard_tokens::openai::Api::Chat,
        _ => switchyard_tokens::openai::Api::Completions,
    };
    let parsed = switchyard_tokens::openai::parse(api, &body).map_err(ApiError::BadRequest)?;
    let tokens = super::proxy::tokenize(gw, &parsed.prompt).await?;
    let hashes = router
        .hasher()
        .salted_hashes(&tokens, parsed.cache_salt.as_deref());
    let prompt_tokens = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
    let (candidates, decision) = router.explain(prompt_tokens, &hashes);
    let snap = router.client().snapshot();
    let rows: Vec<Value> = (0..candidates.len())
        .map(|i| {
            let c = candidates.row(i);
            json!({
                "id": c.id.to_string(),
                "url": snap.instances.get(&c.id).map(|s| s.info.url.clone()),
                "overlap_blocks": c.overlap_blocks,
                "active_blocks": c.active_blocks,
                "pending_prefill_tokens": c.pending_prefill_tokens,
                "in_flight": c.in_flight,
                "kv_usage": c.kv_usage,
                "cache_view": router.cache_view(c.id),
            })
        })
        .collect();
    let (chosen, rejected) = match &decision.outcome {
        switchyard_policy::DecisionOutcome::Chosen(id) => (Some(id.to_string()), None),
        switchyard_policy::DecisionOutcome::Rejected(r) => (None, Some(r.reason.clone())),
        switchyard_policy::DecisionOutcome::NoCandidates => (None, None),
    };
    let status = router.policy().status();
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "endpoint": router.endpoint().to_string(),
            "model": parsed.model,
            "prompt_tokens": prompt_tokens,
            "prompt_blocks": hashes.len(),
            "block_size": router.hasher().block_size(),
            "candidates": rows,
            "chosen": chosen,
            "rejected": rejected,
            "decided_by": match decision.decider {
                switchyard_policy::Decider::Policy => "policy",
                switchyard_policy::Decider::Fallback => "fallback",
            },
            "policy": {"name": status.info.name, "version": status.info.version, "generation": decision.generation},
            "failure": decision.failure.map(|f| f.to_string()),
        }),
    ))
}

fn secs(t: std::time::SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A policy's identity — name, version, sha256, source, configuration — with `rest`.
fn identified(info: &PolicyInfo, rest: Value) -> Value {
    let mut all = json!({
        "name": info.name,
        "version": info.version,
        "sha256": info.sha256,
        "source": info.source.to_string(),
        "config": info.config,
    });
    if let (Value::Object(all), Value::Object(rest)) = (&mut all, rest) {
        all.extend(rest);
    }
    all
}

/// The admin API's view of a policy's status.
pub fn status_json(s: &PolicyStatus) -> Value {
    identified(
        &s.info,
        json!({
            "loaded_at": secs(s.info.loaded_at),
            "load_ms": s.info.load_time.as_secs_f64() * 1e3,
            "compiled": format!("{:?}", s.info.cache),
            "generation": s.generation,
            "active_since": secs(s.active_since),
            "decisions": s.decisions,
            "failures": s.failures,
            "fallbacks": s.fallbacks,
            "rejections": s.rejections,
            "rollbacks": s.rollbacks,
            "previous": s.previous.as_ref().map(|p| json!({"name": p.name, "version": p.version, "sha256": p.sha256})),
            "last_good": s.last_good.as_ref().map(|p| json!({"name": p.name, "version": p.version, "sha256": p.sha256})),
            "proven": s.proven,
            "guest_log": {"logged": s.guest_log_lines.0, "suppressed": s.guest_log_lines.1},
        }),
    )
}

fn instances_json(r: &KvRouter) -> Value {
    let snap = r.client().snapshot();
    let list: Vec<Value> = snap
        .instances
        .iter()
        .map(|(id, st)| {
            let load = r.load_of(*id);
            let (available, down) = match &st.availability {
                Availability::Available => (true, Value::Null),
                Availability::Down { since, reason, failed_probes, kind, ejected_for } => (
                    false,
                    json!({"since": secs(*since), "reason": reason, "failed_probes": failed_probes, "kind": format!("{kind:?}").to_lowercase(), "ejected_for_secs": ejected_for.as_secs_f64()}),
                ),
            };
            json!({
                "id": id.to_string(),
                "url": st.info.url,
                "model": st.info.model,
                "events": st.info.events_url.is_some() || st.info.engine_events.is_some(),
                "kv_events": st.info.engine_events.as_ref().map(|e| &e.endpoint),
                "cache_view": r.cache_view(*id),
                "cache_view_counts": r.view_status(*id).map(|v| json!({
                    "stored_blocks": v.counts.stored_blocks,
                    "removed_blocks": v.counts.removed_blocks,
                    "wrong_block_size": v.counts.wrong_block_size,
                    "unknown_parent": v.counts.unknown_parent,
                    "bad_tokens": v.counts.bad_tokens,
                    "other_tier": v.counts.other_tier,
                    "unknown_type": v.counts.unknown_type,
                    "lost_gaps": v.counts.lost_gaps,
                    "restarts": v.counts.restarts,
                    "malformed": v.malformed,
                    "replay_failures": v.replay_failures,
                })),
                "available": available,
                "down": down,
                "probation": st.health.on_probation(),
                "ejections": st.health.ejections(),
                "consecutive_failures": st.health.consecutive_failures(),
                "held_until": st.held_until.map(secs),
                "in_flight": load.in_flight,
                "booked": load.booked,
                "reported_running": load.reported.map(|l| l.running),
                "reported_waiting": load.reported.map(|l| l.waiting),
                "active_blocks": load.active_blocks,
                "pending_prefill_tokens": load.pending_prefill_tokens,
                "kv_usage": load.reported.and_then(|l| l.kv_usage()),
                "cached_blocks": r.cached_blocks(*id),
            })
        })
        .collect();
    json!({"endpoint": r.endpoint().to_string(), "panic": snap.panic, "instances": list})
}

fn endpoint_json(r: &KvRouter) -> Value {
    json!({
        "endpoint": r.endpoint().to_string(),
        "policy": status_json(&r.policy().status()),
        "history": history_json(r),
        "shadow": r.shadow_status().map_or(Value::Null, |s| shadow_json(&s)),
        "quality": quality_json(r),
        "instances": instances_json(r)["instances"],
    })
}

/// The endpoint's policy changes, oldest first.
fn history_json(r: &KvRouter) -> Value {
    r.policy()
        .changes()
        .iter()
        .map(|c| {
            json!({
                "at": secs(c.at),
                "kind": c.kind,
                "policy": c.policy,
                "sha256": c.sha256,
                "detail": c.detail,
            })
        })
        .collect()
}

/// A shadow: its identity and what it did since it was attached.
pub fn shadow_json(s: &ShadowStatus) -> Value {
    let t = &s.tally;
    identified(
        &s.info,
        json!({
            "sample": s.sample,
            "attached_at": secs(s.attached_at),
            "offered": t.offered,
            "dropped": t.dropped,
            "compared": t.compared,
            "agreed": t.agreed,
            "agreement": t.agreement(),
            "rejected": t.rejected,
            "live_rejected": t.live_rejected,
            "failures": t.failures,
            "overlap_ratio": {"shadow": t.shadow_overlap_ratio(), "live": t.live_overlap_ratio()},
            "overlap_blocks": {"shadow": t.shadow_overlap_blocks, "live": t.live_overlap_blocks, "best": t.best_overlap_blocks},
            "predicted_cost_total": {"shadow": t.shadow_cost, "live": t.live_cost},
            "mean_predicted_cost": {"shadow": t.shadow_mean_cost(), "live": t.live_mean_cost()},
            "calls": t.calls,
            "call_seconds": t.call_seconds,
            "mean_call_us": t.mean_call().map(|d| d.as_secs_f64() * 1e6),
        }),
    )
}

/// The live policy's decision quality over the endpoint's life.
fn quality_json(r: &KvRouter) -> Value {
    use std::sync::atomic::Ordering::Relaxed;
    let q = r.quality();
    let unrouted: serde_json::Map<String, Value> = switchyard_router::quality::UNROUTED
        .iter()
        .zip(&q.unrouted)
        .map(|(k, n)| ((*k).to_string(), json!(n.load(Relaxed))))
        .collect();
    let by_instance: serde_json::Map<String, Value> = q
        .by_instance()
        .into_iter()
        .map(|(id, n)| (id.to_string(), json!(n)))
        .collect();
    json!({
        "routed": q.routed.load(Relaxed),
        "chosen_overlap_blocks": q.chosen_overlap_blocks.load(Relaxed),
        "best_overlap_blocks": q.best_overlap_blocks.load(Relaxed),
        "overlap_ratio": q.overlap_ratio(),
        "cache_reports": q.cache_reports.load(Relaxed),
        "predicted_cached_tokens": q.predicted_cached_tokens.load(Relaxed),
        "reported_cached_tokens": q.reported_cached_tokens.load(Relaxed),
        "unrouted": unrouted,
        "decisions_by_instance": by_instance,
        "decisions": r.policy().totals().decisions,
    })
}

#[cfg(test)]
mod tests {
    use super::split_action;

    #[test]
    fn admin_paths_split_into_endpoint_and_action() {
        assert_eq!(split_action("a/b/c/policy"), Some(("a/b/c", "policy")));
        assert_eq!(
            split_action("a/b/c/policy/rollback"),
            Some(("a/b/c", "policy/rollback"))
        );
        assert_eq!(split_action("a/b/c"), None);
    }
}
