//! Who may use the admin API: the bearer token, compared in constant time, and the admin
//! page's cookie (the token's sha256, good for reads only); and the page itself.

use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};

use crate::{ApiError, Body, Gateway};

/// The cookie the admin page's reads carry: the sha256 of the admin token, never the
/// token itself. It grants GET requests only, so a page another site opens cannot
/// change a policy with it (and it is `SameSite=Strict` besides).
pub(super) const UI_COOKIE: &str = "switchyard_admin";

pub(super) fn sha256_hex(text: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(text)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Constant time, length included: both sides are hashed first, so neither how much
/// matches nor how long the token is shows in the time taken.
pub(super) fn same_secret(given: &str, token: &str) -> bool {
    use sha2::Digest;
    let (a, b) = (sha2::Sha256::digest(given), sha2::Sha256::digest(token));
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

pub(super) fn cookie<'a>(req: &'a Request<Incoming>, name: &str) -> Option<&'a str> {
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

pub(super) fn admin_token(gw: &Gateway) -> Result<&str, ApiError> {
    gw.config
        .admin_token
        .as_deref()
        .ok_or(ApiError::Unauthorized(
            "the admin API is disabled (start the router with --admin-token-file or SWITCHYARD_ADMIN_TOKEN)",
        ))
}

pub(super) fn authorized(gw: &Gateway, req: &Request<Incoming>) -> Result<(), ApiError> {
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
pub(super) const UI_PAGE: &str = include_str!("../ui.html");

/// `GET /admin/ui`: the page, to a browser that shows the admin token once, in
/// `?token=` (the page then takes it out of the address) or already holds the page's
/// cookie; anyone else gets a 401 page asking for the token.
pub(super) fn ui(gw: &Gateway, req: &Request<Incoming>) -> Response<Body> {
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
        b.body(crate::full_body(body)).expect("valid response")
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
