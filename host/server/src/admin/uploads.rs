//! Policies and shadows uploaded through the admin API (bounded, off the async threads),
//! and `explain`: a request's candidates and decision without sending it.

use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use serde_json::{Value, json};

use crate::{ApiError, Body, Gateway, json_response};
use switchyard_policy::{LoadedPolicy, PolicyError, PolicyHandle, PolicySource};
use switchyard_router::KvRouter;

use switchyard_policy::MAX_POLICY_BYTES;

use super::views::{shadow_json, status_json};

/// A policy as an upload names it: a built-in's name, or `.wasm` bytes; with its
/// configuration (`x-policy-config`) and, for a shadow, the share of decisions
/// (`?sample=`).
pub(super) struct Upload {
    builtin: Option<String>,
    bytes: bytes::Bytes,
    config: String,
    sample: f64,
}

pub(super) fn query_value<'a>(req: &'a Request<Incoming>, key: &str) -> Option<&'a str> {
    req.uri().query().and_then(|q| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
    })
}

pub(super) async fn read_upload(gw: &Gateway, req: Request<Incoming>) -> Result<Upload, ApiError> {
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
    let limits = crate::body::Limits {
        max: MAX_POLICY_BYTES,
        deadline: gw.config.client_idle_timeout.max(Duration::from_secs(60)),
    };
    let (bytes, _held) = crate::body::read(req.into_body(), &gw.bodies, limits).await?;
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
pub(super) async fn blocking<T: Send + 'static>(
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Refused(format!("{what} panicked: {e}")))
}

pub(super) async fn upload(
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
pub(super) async fn upload_shadow(
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
pub(super) const MAX_EXPLAIN_BYTES: usize = 32 << 20;

pub(super) async fn explain(
    gw: &Arc<Gateway>,
    router: &Arc<KvRouter>,
    req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let limits = crate::body::Limits {
        max: MAX_EXPLAIN_BYTES,
        deadline: gw.config.client_idle_timeout,
    };
    let (body, _held) = crate::body::read(req.into_body(), &gw.bodies, limits).await?;
    // A chat request has `messages`; anything else is read as a completion request.
    let api = match serde_json::from_slice::<Value>(&body) {
        Ok(v) if v.get("messages").is_some() => switchyard_tokens::openai::Api::Chat,
        _ => switchyard_tokens::openai::Api::Completions,
    };
    let parsed = switchyard_tokens::openai::parse(api, &body).map_err(ApiError::BadRequest)?;
    let tokens = crate::proxy::tokenize(gw, &parsed.prompt, parsed.continue_final_message).await?;
    let hashes = router.hasher().keyed_hashes(
        &tokens,
        gw.config.served_by(&parsed.model).1,
        parsed.cache_salt.as_deref(),
    );
    let prompt_tokens = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
    let (candidates, decision) = router.explain(prompt_tokens, &hashes);
    let snap = router.client().snapshot();
    let rows: Vec<Value> = (0..candidates.len())
        .map(|i| {
            let c = candidates.row(i);
            json!({
                "id": c.id.to_string(),
                "url": snap.instances.get(&c.id).map(|s| s.info.url.clone()),
                "role": c.role.as_str(),
                "overlap_blocks": c.overlap_blocks,
                "active_blocks": c.active_blocks,
                "pending_prefill_tokens": c.pending_prefill_tokens,
                "in_flight": c.in_flight,
                "kv_usage": c.kv_usage,
                "cache_fullness": c.cache_fullness,
                "cache_view": router.cache_view(c.id),
                "saturated": router.saturation_of(c.id),
                "predicted_ttft_ms": c.predicted_ttft_ms,
                "predicted_tpot_ms": c.predicted_tpot_ms,
            })
        })
        .collect();
    let (chosen, rejected) = match &decision.outcome {
        switchyard_policy::DecisionOutcome::Chosen(id) => (Some(id.to_string()), None),
        switchyard_policy::DecisionOutcome::Rejected(r) => (None, Some(r.reason.clone())),
        switchyard_policy::DecisionOutcome::NoCandidates => (None, None),
    };
    let status = router.policy().status();
    // Whether the request would wait in the router's queue, and why.
    let saturated = router.saturated();
    let waiting = gw
        .queues()
        .into_iter()
        .find(|(e, _)| e == router.endpoint())
        .map_or(0, |(_, q)| q.depth().0.iter().sum::<usize>());
    let would_wait = gw.config.overload.queue_max > 0
        && (waiting > 0 || (!saturated.is_empty() && saturated.len() == candidates.len()));
    let wait_why = if !would_wait {
        Value::Null
    } else if waiting > 0 {
        json!(format!(
            "{waiting} requests are waiting in the router's queue; this one would wait behind those of its class and more urgent ones"
        ))
    } else {
        json!(
            "every worker is saturated (see each candidate's `saturated`): it would wait in the router's queue until one has room"
        )
    };
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "endpoint": router.endpoint().to_string(),
            "model": parsed.model,
            "prompt_tokens": prompt_tokens,
            "prompt_blocks": hashes.len(),
            // A continuation (of the client's own assistant message, or of a migrated
            // stream: the router sends those in this form) is rendered open-ended.
            "continuation": parsed.continue_final_message,
            "block_size": router.hasher().block_size(),
            "candidates": rows,
            "chosen": chosen,
            // A split request: `chosen` decodes, this worker prefills.
            "prefill": decision.prefill.map(|id| id.to_string()),
            "rejected": rejected,
            "decided_by": match decision.decider {
                switchyard_policy::Decider::Policy => "policy",
                switchyard_policy::Decider::Fallback => "fallback",
            },
            "policy": {"name": status.info.name, "version": status.info.version, "generation": decision.generation},
            "failure": decision.failure.map(|f| f.to_string()),
            "would_wait": would_wait,
            "wait_reason": wait_why,
        }),
    ))
}
