//! The admin page in a real browser (Debian's chromium, headless) against a running
//! router process in front of real mock workers: it lists the fleet's workers, shows a
//! policy swap and a shadow's agreement after traffic, and refuses without the token.
//! Also the operator's path through the admin API: shadow, read, promote.

mod common;

use std::process::Command;

use common::http::{self, HttpClient};
use common::procs::{mock_worker, serve};
use common::router::{PATIENCE, TOKEN, admin_get_text, admin_send, eventually};
use hyper::{Method, StatusCode};
use serde_json::{Value, json};

const EP: &str = "admin/endpoints/default/mock/generate";

/// The page as the browser has built it after its scripts ran (the DOM, not the HTML
/// sent).
fn browse(url: &str) -> String {
    let out = Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--virtual-time-budget=5000",
            "--dump-dom",
            url,
        ])
        .output()
        .expect("chromium runs (tools/test.sh installs Debian's chromium)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// An admin call with the token: the status and the JSON answer (a JSON string holding
/// the text when it is not JSON).
async fn admin(c: &HttpClient, method: Method, url: &str) -> (StatusCode, Value) {
    let (status, body) = admin_send(c, method, url).await;
    (
        status,
        serde_json::from_str(&body).unwrap_or_else(|_| json!(body)),
    )
}

/// An admin call that must succeed: its JSON answer.
async fn admin_ok(c: &HttpClient, method: Method, url: &str) -> Value {
    let (s, v) = admin(c, method, url).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v
}

/// The endpoint's shadow, once it has compared `n` decisions.
async fn shadow_after(c: &HttpClient, url: &str, n: u64) -> Value {
    eventually("the shadow to compare every decision", || {
        let (c, url) = (c.clone(), url.to_string());
        async move {
            admin(&c, Method::GET, &format!("{url}/{EP}/shadow"))
                .await
                .1["compared"]
                == n
        }
    })
    .await;
    admin(c, Method::GET, &format!("{url}/{EP}/shadow")).await.1
}

/// Sends `n` chat requests of `sessions` conversations; every one must succeed.
async fn traffic(c: &HttpClient, url: &str, sessions: usize, n: usize) {
    for i in 0..n {
        let text = format!(
            "session {} asks about caches and routing, with enough words to fill blocks",
            i % sessions
        );
        let (s, v, _) = http::post_json(
            c,
            &format!("{url}/v1/chat/completions"),
            &json!({"model": "mock", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_page_shows_the_fleet_a_swap_and_a_shadow_and_refuses_without_the_token() {
    let (_w1, u1) = mock_worker(&[]).await;
    let (_w2, u2) = mock_worker(&[]).await;
    let (_router, url) = serve(&[
        "--worker",
        &u1,
        "--worker",
        &u2,
        "--model",
        "mock",
        "--admin-token",
        TOKEN,
    ])
    .await;
    let c = http::client();
    traffic(&c, &url, 4, 12).await;
    admin_ok(
        &c,
        Method::PUT,
        &format!("{url}/{EP}/policy?builtin=round-robin"),
    )
    .await;
    admin_ok(
        &c,
        Method::PUT,
        &format!("{url}/{EP}/shadow?builtin=kv-cost"),
    )
    .await;
    traffic(&c, &url, 4, 20).await;
    // The shadow's comparison, as the API gives it once the shadow has caught up.
    let shadow = shadow_after(&c, &url, 20).await;
    let agreement = shadow["agreement"].as_f64().unwrap();

    let page = browse(&format!("{url}/admin/ui?token={TOKEN}"));
    let (_, instances) = admin(&c, Method::GET, &format!("{url}/{EP}/instances")).await;
    for i in instances["instances"].as_array().unwrap() {
        let id = i["id"].as_str().unwrap();
        assert!(
            page.contains(&format!("data-instance=\"{id}\"")),
            "worker {id} is listed\n{page}"
        );
        assert!(page.contains(i["url"].as_str().unwrap()));
    }
    assert!(
        page.contains("round-robin 0.1.0"),
        "the live policy after the swap\n{page}"
    );
    assert!(
        page.contains("data-kind=\"swap\""),
        "the swap is in the history\n{page}"
    );
    assert!(page.contains("data-kind=\"shadow\""), "{page}");
    let shown = format!("class=\"num shadow-agreement\">{:.1} %<", 100.0 * agreement);
    assert!(
        page.contains(&shown),
        "the shadow's agreement ({shown})\n{page}"
    );

    // Without the token, or with a wrong one: the refusal page, and no fleet.
    for bad in [
        format!("{url}/admin/ui"),
        format!("{url}/admin/ui?token=wrong"),
    ] {
        let page = browse(&bad);
        assert!(page.contains("Admin token required"), "{page}");
        assert!(!page.contains("data-instance"), "{page}");
    }
    let (s, _) = http::get(&c, &format!("{url}/admin/ui")).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pages_cookie_reads_but_never_changes_anything() {
    let (_w1, u1) = mock_worker(&[]).await;
    let (_router, url) = serve(&["--worker", &u1, "--model", "mock", "--admin-token", TOKEN]).await;
    let c = http::client();
    let (s, headers, _) = http::send(
        &c,
        Method::GET,
        &format!("{url}/admin/ui?token={TOKEN}"),
        &[],
        "",
        PATIENCE,
    )
    .await
    .unwrap();
    assert_eq!(s, StatusCode::OK);
    let set = headers["set-cookie"].to_str().unwrap().to_string();
    assert!(
        set.contains("HttpOnly") && set.contains("SameSite=Strict"),
        "{set}"
    );
    assert!(
        !set.contains(TOKEN),
        "the cookie is not the token itself: {set}"
    );
    let cookie = set.split(';').next().unwrap().to_string();
    let with_cookie = |method: Method, path: &str| {
        let (c, url, cookie) = (c.clone(), url.clone(), cookie.clone());
        let path = path.to_string();
        async move {
            http::send(
                &c,
                method,
                &format!("{url}/{path}"),
                &[("cookie", &cookie)],
                "",
                PATIENCE,
            )
            .await
            .unwrap()
            .0
        }
    };
    assert_eq!(
        with_cookie(Method::GET, "admin/endpoints").await,
        StatusCode::OK
    );
    assert_eq!(
        with_cookie(Method::GET, "admin/trends").await,
        StatusCode::OK
    );
    assert_eq!(with_cookie(Method::GET, "admin/ui").await, StatusCode::OK);
    assert_eq!(
        with_cookie(Method::PUT, &format!("{EP}/policy?builtin=round-robin")).await,
        StatusCode::UNAUTHORIZED,
        "a cookie another site could make a browser send must not swap a policy"
    );
    assert_eq!(
        with_cookie(Method::POST, &format!("{EP}/policy/rollback")).await,
        StatusCode::UNAUTHORIZED
    );
    let (_, v) = admin_get_text(&c, &format!("{url}/{EP}/policy")).await;
    assert!(v.contains("\"kv-cost\""), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_tries_a_shadow_reads_its_comparison_and_promotes_it() {
    let (_w1, u1) = mock_worker(&[]).await;
    let (_w2, u2) = mock_worker(&[]).await;
    let (_w3, u3) = mock_worker(&[]).await;
    let (_router, url) = serve(&[
        "--worker",
        &u1,
        "--worker",
        &u2,
        "--worker",
        &u3,
        "--model",
        "mock",
        "--admin-token",
        TOKEN,
    ])
    .await;
    let c = http::client();
    let (s, v) = admin(&c, Method::POST, &format!("{url}/{EP}/shadow/promote")).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "nothing to promote: {v}");
    let v = admin_ok(
        &c,
        Method::PUT,
        &format!("{url}/{EP}/shadow?builtin=round-robin&sample=1"),
    )
    .await;
    assert_eq!(v["name"], "round-robin");
    // A bad sample or a bad policy changes nothing.
    let (s, v) = admin(
        &c,
        Method::PUT,
        &format!("{url}/{EP}/shadow?builtin=round-robin&sample=2"),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (s, _, body) = http::send(
        &c,
        Method::PUT,
        &format!("{url}/{EP}/shadow"),
        &[("authorization", &format!("Bearer {TOKEN}"))],
        b"not a component".to_vec(),
        PATIENCE,
    )
    .await
    .unwrap();
    assert_eq!(
        s,
        StatusCode::BAD_REQUEST,
        "{}",
        String::from_utf8_lossy(&body)
    );
    let (_, v) = admin(&c, Method::GET, &format!("{url}/{EP}/shadow")).await;
    assert_eq!(
        v["name"], "round-robin",
        "the shadow attached first is still there"
    );

    // Five conversations over three workers, in turn: kv-cost keeps each on its worker,
    // round-robin would not. (Six would line up with round-robin's cycle: kv-cost's
    // first placements go round the empty workers in the same order, and each later
    // turn comes back to them in step.)
    traffic(&c, &url, 5, 36).await;
    let shadow = shadow_after(&c, &url, 36).await;
    let ratio = |who: &str| shadow["overlap_ratio"][who].as_f64().unwrap();
    assert!(ratio("shadow") < ratio("live"), "{shadow}");
    assert!(shadow["agreement"].as_f64().unwrap() < 1.0, "{shadow}");
    // The same comparison in /metrics.
    let (_, text) = http::get(&c, &format!("{url}/metrics")).await;
    let samples = common::prom::parse(&String::from_utf8_lossy(&text));
    let value = |name: &str| {
        samples
            .iter()
            .find(|s| {
                s.name == name
                    && s.labels
                        .get("shadow")
                        .is_some_and(|l| l == "round-robin@0.1.0")
            })
            .map(|s| s.value)
    };
    assert_eq!(value("switchyard_shadow_compared_total"), Some(36.0));
    assert_eq!(
        value("switchyard_shadow_agreements_total"),
        shadow["agreed"].as_f64()
    );

    let v = admin_ok(&c, Method::POST, &format!("{url}/{EP}/shadow/promote")).await;
    assert_eq!(v["name"], "round-robin");
    assert_eq!(v["previous"]["name"], "kv-cost");
    let (_, v) = admin(&c, Method::GET, &format!("{url}/{EP}/shadow")).await;
    assert_eq!(v, Value::Null);
    let (_, all) = admin(&c, Method::GET, &format!("{url}/admin/endpoints")).await;
    let kinds: Vec<&str> = all["endpoints"][0]["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds.last(), Some(&"promote"), "{kinds:?}");
    assert!(
        kinds.contains(&"refused"),
        "the bad upload is in the history: {kinds:?}"
    );
    // Served by the promoted policy: round-robin spreads the next requests evenly.
    let before = all["endpoints"][0]["quality"]["decisions_by_instance"].clone();
    traffic(&c, &url, 1, 6).await;
    let (_, all) = admin(&c, Method::GET, &format!("{url}/admin/endpoints")).await;
    let after = &all["endpoints"][0]["quality"]["decisions_by_instance"];
    for (id, n) in after.as_object().unwrap() {
        let was = before[id].as_u64().unwrap_or(0);
        assert_eq!(
            n.as_u64().unwrap() - was,
            2,
            "worker {id}: {before} -> {after}"
        );
    }
}

/// With every worker saturated, the page shows the queue: requests waiting per class and
/// the tenants they belong to, and why the worker gets no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_page_shows_the_queue_when_every_worker_is_saturated() {
    let (_w, u) = mock_worker(&["--max-num-seqs", "1"]).await;
    // The tenants, named by their header (as a gateway in front sets it); search may
    // ask for high.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("switchyard.toml");
    std::fs::write(
        &config,
        "[[tenants]]\nname = \"search\"\nmax_class = \"high\"\n\n[[tenants]]\nname = \"nightly\"\n",
    )
    .unwrap();
    let (_router, url) = serve(&[
        "--worker",
        &u,
        "--model",
        "mock",
        "--admin-token",
        TOKEN,
        "--saturation-max-in-flight",
        "1",
        "--config",
        config.to_str().unwrap(),
    ])
    .await;
    let send = |tenant: &'static str, priority: &'static str, max_tokens: u32| {
        let url = url.clone();
        tokio::spawn(async move {
            let body = json!({"model": "mock", "prompt": format!("{tenant} {priority}"), "max_tokens": max_tokens});
            http::send(
                &http::client(),
                Method::POST,
                &format!("{url}/v1/completions"),
                &[
                    ("content-type", "application/json"),
                    ("x-switchyard-tenant", tenant),
                    ("x-switchyard-priority", priority),
                ],
                body.to_string(),
                PATIENCE,
            )
            .await
        })
    };
    // One long request runs; three wait behind it.
    let running = send("search", "normal", 1500);
    let c = http::client();
    eventually("the long request to run", || {
        let (c, url) = (c.clone(), url.clone());
        async move {
            let (_, v) = admin(&c, Method::GET, &format!("{url}/{EP}/instances")).await;
            v["instances"][0]["saturated"].is_string()
        }
    })
    .await;
    let waiting = [
        send("search", "high", 2),
        send("nightly", "low", 2),
        send("nightly", "low", 2),
    ];
    eventually("three requests to wait", || {
        let (c, url) = (c.clone(), url.clone());
        async move {
            let (_, v) = admin(&c, Method::GET, &format!("{url}/admin/endpoints")).await;
            v["endpoints"][0]["queue"]["classes"]
                .as_array()
                .is_some_and(|cs| {
                    cs.iter()
                        .map(|c| c["waiting"].as_u64().unwrap())
                        .sum::<u64>()
                        == 3
                })
        }
    })
    .await;
    let page = browse(&format!("{url}/admin/ui?token={TOKEN}"));
    assert!(page.contains("3 waiting"), "{page}");
    assert!(page.contains("high 1 · normal 0 · low 2"), "{page}");
    assert!(page.contains("nightly 2 · search 1"), "{page}");
    assert!(page.contains("saturated: requests in flight"), "{page}");
    for w in waiting {
        w.abort();
    }
    running.abort();
}
