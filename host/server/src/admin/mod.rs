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
//!
//! - this module: the routes;
//! - `auth`: the bearer token, the page's cookie, and the page itself;
//! - `uploads`: policies and shadows uploaded, and `explain`;
//! - `views`: what the API answers, as JSON.

mod auth;
mod uploads;
mod views;

pub use views::{shadow_json, status_json};

use std::sync::Arc;

use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};

use crate::{ApiError, Body, Gateway, json_response};
use switchyard_discovery::EndpointPath;

use auth::{authorized, ui};
use uploads::{blocking, explain, upload, upload_shadow};
use views::{endpoint_json, instances_json, quality_json};

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
        let queues = gw.queues();
        let all: Vec<Value> = gw
            .fleet
            .routers()
            .iter()
            .map(|r| {
                let queue = queues.iter().find(|(e, _)| e == r.endpoint());
                endpoint_json(r, queue.map(|(_, q)| &**q))
            })
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
