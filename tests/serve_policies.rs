//! Policies changed on a running `switchyard serve`: swaps through the admin API and etcd
//! under load, a policy too big for one etcd value, a watched file. Real etcd, workers,
//! router and HTTP.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::http::{self, HttpClient, post_json};
use common::procs::{mock_worker, serve};
use common::router::{PATIENCE, TOKEN, admin_get, auth, eventually, metric};
use common::serve::*;
use hyper::{Method, StatusCode};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_policy_swaps_under_load_through_admin_and_etcd_fail_nothing() {
    let fleet = etcd_fleet(2, "100").await;
    let (etcd, url, c) = (&fleet.etcd, fleet.url.clone(), fleet.c.clone());
    let policy_url = format!("{url}/admin/endpoints/default/mock/generate/policy");
    let example = std::fs::read(common::guest("session_affinity")).unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let clients = load(url.clone(), 3, stop.clone());
    // Every counter of /metrics, read by Prometheus' own parser after every tenth swap,
    // never goes down (swaps and rollbacks reset nothing a scraper sees).
    let scrape = || scrape(&c, &url);
    // The endpoint's router (and its policy counters) exists from its first request.
    eventually("the endpoint's policy counters", || async {
        common::prom::counters(&scrape().await)
            .keys()
            .any(|k| k.starts_with("switchyard_decisions_total"))
    })
    .await;
    let counters = swaps_through_admin(&c, &url, &policy_url, &example).await;
    pushes_through_etcd(&c, &url, etcd, &policy_url, &example).await;

    // A policy whose name would close a label and forge a line: /metrics stays valid
    // and names it by its cleaned name.
    let loud = std::fs::read(common::guest("loud")).unwrap();
    let (s, _, b) = http::send(
        &c,
        Method::PUT,
        &policy_url,
        &[
            ("authorization", &auth()),
            ("x-policy-config", r#"{"after": 1000000}"#),
        ],
        loud,
        PATIENCE,
    )
    .await
    .unwrap();
    assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
    let samples = scrape().await;
    let info = samples
        .iter()
        .find(|s| s.name == "switchyard_policy_info")
        .expect("the policy's info is exposed");
    assert!(info.labels["policy"].starts_with("loud"), "{info:?}");
    assert!(!samples.iter().any(|s| s.name.contains("forged")));
    let now = common::prom::counters(&samples);
    for (series, before) in &counters {
        assert!(
            now.get(series).copied().unwrap_or(f64::NAN) >= *before,
            "{series}"
        );
    }

    stop.store(true, Ordering::Relaxed);
    let (ok, failed, errors) = clients.await.unwrap();
    assert_eq!(failed, 0, "{errors:?}");
    assert!(ok > 20, "only {ok} requests completed");
}

/// A policy of ~20 MB (a Python policy's size) pushed through etcd reaches every router
/// replica: stored in 1 MiB chunks, each router reads and verifies the whole, and both
/// serve it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_20_mb_policy_pushed_through_etcd_is_loaded_by_two_routers() {
    let fleet = etcd_fleet(1, "100").await;
    let (_second, second) = serve(&["--etcd", &fleet.etcd.url(), "--admin-token", TOKEN]).await;
    let c = &fleet.c;
    wait_available(c, &second, 1).await;
    let routers = [fleet.url.clone(), second];
    for r in &routers {
        // The endpoint's router exists from its first request.
        let (s, _, b) =
            http::post_json(c, &format!("{r}/v1/chat/completions"), &chat("hi", 2)).await;
        assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
    }
    let example = std::fs::read(common::guest("session_affinity")).unwrap();
    let big = padded(&example, 20 << 20);
    let config = switchyard::discovery::etcd::EtcdConfig::new(vec![fleet.etcd.url()]);
    let endpoint: switchyard::discovery::EndpointPath = "default/mock/generate".parse().unwrap();
    let pushed = switchyard::discovery::etcd_policy::PushedPolicy::new(&big, "{}");
    let sha = pushed.sha256.clone();
    switchyard::discovery::etcd_policy::push(&config, &endpoint, &pushed)
        .await
        .unwrap();
    let (chunks, _) = config
        .api()
        .range_prefix(&format!("switchyard/policy-blobs/{sha}/"))
        .await
        .unwrap();
    assert_eq!(chunks.len(), pushed.wasm_base64.len().div_ceil(1 << 20));
    for r in &routers {
        let url = format!("{r}/admin/endpoints/default/mock/generate/policy");
        eventually("the 20 MB policy on every router", || async {
            admin_get(c, &url).await["sha256"] == sha.as_str()
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watched_policy_file_is_reloaded_when_it_changes() {
    let (_w, worker) = mock_worker(&["--speedup", "100"]).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.wasm");
    std::fs::write(
        &file,
        switchyard::policy::builtin("round-robin").unwrap().wasm,
    )
    .unwrap();
    let (_router, url) = serve(&[
        "--worker",
        &worker,
        "--model",
        "mock",
        "--admin-token",
        TOKEN,
        "--policy",
        file.to_str().unwrap(),
        "--watch",
        "true",
    ])
    .await;
    let c = http::client();
    let policy_url = format!("{url}/admin/endpoints/default/mock/generate/policy");
    assert_eq!(admin_get(&c, &policy_url).await["name"], "round-robin");
    // A broken file is refused; the current policy stays.
    let refusals = "switchyard_policy_refusals_total";
    let before = metric(&c, &url, refusals, "").await;
    std::fs::write(&file, b"not wasm").unwrap();
    eventually("the broken file refused", || async {
        metric(&c, &url, refusals, "").await > before
    })
    .await;
    assert_eq!(admin_get(&c, &policy_url).await["name"], "round-robin");
    std::fs::write(
        &file,
        std::fs::read(common::guest("session_affinity")).unwrap(),
    )
    .unwrap();
    eventually("the reload", || async {
        admin_get(&c, &policy_url).await["name"] == "session-affinity"
    })
    .await;
    let (s, _, _) = post_json(
        &c,
        &format!("{url}/v1/chat/completions"),
        &chat("after the reload", 1),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
}

/// Every /metrics sample, read by Prometheus' own parser.
async fn scrape(c: &HttpClient, url: &str) -> Vec<common::prom::Sample> {
    let (s, _, b) = http::send(
        c,
        Method::GET,
        &format!("{url}/metrics"),
        &[],
        vec![],
        PATIENCE,
    )
    .await
    .unwrap();
    assert_eq!(s, StatusCode::OK);
    common::prom::parse(&String::from_utf8_lossy(&b))
}

/// A hundred swaps through the admin API (built-ins and a `.wasm` upload in turn), every
/// counter checked never to go down after every tenth, then a broken upload refused;
/// the counters last read.
async fn swaps_through_admin(
    c: &HttpClient,
    url: &str,
    policy_url: &str,
    example: &[u8],
) -> std::collections::BTreeMap<String, f64> {
    let scrape = || scrape(c, url);
    let mut counters = common::prom::counters(&scrape().await);
    for i in 0..100 {
        if i % 10 == 9 {
            let now = common::prom::counters(&scrape().await);
            for (series, before) in &counters {
                let after = now.get(series).copied().unwrap_or(f64::NAN);
                assert!(
                    after >= *before,
                    "{series} went from {before} to {after} at swap {i}"
                );
            }
            counters = now;
        }
        let (target, body): (String, Vec<u8>) = match i % 3 {
            0 => (format!("{policy_url}?builtin=round-robin"), vec![]),
            1 => (policy_url.to_string(), example.to_vec()),
            _ => (format!("{policy_url}?builtin=kv-cost"), vec![]),
        };
        let (s, _, b) = http::send(
            c,
            Method::PUT,
            &target,
            &[("authorization", &auth())],
            body,
            PATIENCE,
        )
        .await
        .unwrap();
        assert_eq!(
            s,
            StatusCode::OK,
            "swap {i}: {}",
            String::from_utf8_lossy(&b)
        );
    }
    let before = admin_get(c, policy_url).await;
    // A broken upload is refused with the reason and changes nothing.
    let (s, _, b) = http::send(
        c,
        Method::PUT,
        policy_url,
        &[("authorization", &auth())],
        &b"\0asm not really"[..],
        PATIENCE,
    )
    .await
    .unwrap();
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(
        String::from_utf8_lossy(&b).contains("current policy keeps serving"),
        "{}",
        String::from_utf8_lossy(&b)
    );
    assert_eq!(admin_get(c, policy_url).await["sha256"], before["sha256"]);
    counters
}

/// A hundred pushes through etcd, a bad push refused, and a policy too big for one etcd
/// value pushed in chunks (deleted once nothing refers to them).
async fn pushes_through_etcd(
    c: &HttpClient,
    url: &str,
    etcd: &common::etcd::Etcd,
    policy_url: &str,
    example: &[u8],
) {
    // Through etcd, as every replica would see it.
    let config = switchyard::discovery::etcd::EtcdConfig::new(vec![etcd.url()]);
    let endpoint: switchyard::discovery::EndpointPath = "default/mock/generate".parse().unwrap();
    let kv = switchyard::policy::builtin("kv-cost").unwrap().wasm;
    let rr = switchyard::policy::builtin("round-robin").unwrap().wasm;
    // 99 alternating built-ins, then the example policy, whose sha256 appears only once.
    let mut last = String::new();
    for i in 0..100 {
        let wasm = match i {
            99 => example,
            i if i % 2 == 0 => kv,
            _ => rr,
        };
        let pushed = switchyard::discovery::etcd_policy::PushedPolicy::new(wasm, "{}");
        last = pushed.sha256.clone();
        switchyard::discovery::etcd_policy::push(&config, &endpoint, &pushed)
            .await
            .unwrap();
    }
    eventually("the last pushed policy", || async {
        admin_get(c, policy_url).await["sha256"] == last.as_str()
    })
    .await;
    let generation = admin_get(c, policy_url).await["generation"]
        .as_u64()
        .unwrap();
    let refusals = "switchyard_policy_refusals_total";
    let before = metric(c, url, refusals, "").await;
    let bad = switchyard::discovery::etcd_policy::PushedPolicy::new(b"\0asm\x01\0\0\0", "{}");
    switchyard::discovery::etcd_policy::push(&config, &endpoint, &bad)
        .await
        .unwrap();
    eventually("the bad push refused", || async {
        metric(c, url, refusals, "").await > before
    })
    .await;
    let now = admin_get(c, policy_url).await;
    assert_eq!(
        now["sha256"],
        last.as_str(),
        "a bad pushed policy must not replace the current one"
    );
    assert_eq!(now["generation"].as_u64().unwrap(), generation);

    // A policy larger than etcd takes in one request (2.5 MiB: the example with a custom
    // section of padding) goes in chunks and is verified whole by the router.
    let big = padded(example, 5 << 19);
    let pushed = switchyard::discovery::etcd_policy::PushedPolicy::new(&big, "{}");
    let big_sha = pushed.sha256.clone();
    switchyard::discovery::etcd_policy::push(&config, &endpoint, &pushed)
        .await
        .unwrap();
    eventually("the chunked policy", || async {
        admin_get(c, policy_url).await["sha256"] == big_sha.as_str()
    })
    .await;
    let blobs = |config: &switchyard::discovery::etcd::EtcdConfig| {
        let api = config.api();
        async move {
            api.range_prefix("switchyard/policy-blobs/")
                .await
                .unwrap()
                .0
                .len()
        }
    };
    assert_eq!(
        blobs(&config).await,
        4,
        "2.5 MiB of .wasm is 3.3 MiB of base64"
    );
    // Once no entry refers to them, the next push deletes its chunks.
    let pushed = switchyard::discovery::etcd_policy::PushedPolicy::new(kv, "{}");
    switchyard::discovery::etcd_policy::push(&config, &endpoint, &pushed)
        .await
        .unwrap();
    assert_eq!(blobs(&config).await, 0);
    eventually("the last push applied", || async {
        admin_get(c, policy_url).await["sha256"] == pushed.sha256.as_str()
    })
    .await;
}
