//! Faults of discovery that must not become outages, end to end: workers all gone, an
//! endpoint released and back, a model on two endpoints, a frozen etcd watch. Real etcd,
//! mock-worker processes, router process and HTTP.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::etcd::Etcd;
use common::faults::*;
use common::http::{self, post_json};
use common::procs::{mock_worker, serve};
use common::router::{TOKEN, admin_get_text, available, eventually, instance, metric};
use hyper::StatusCode;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_whose_workers_are_all_gone_answers_503_until_one_returns() {
    let etcd = Etcd::start();
    let (w, _) = mock_worker(&["--etcd", &etcd.url(), "--speedup", "100"]).await;
    let (_router, url) = serve(&["--etcd", &etcd.url(), "--admin-token", TOKEN]).await;
    let c = http::client();
    let (s, _, body) = complete(&c, &url, &chat("hi", 1, false)).await;
    assert_eq!(s, StatusCode::OK, "{body}");
    // A graceful stop deregisters the worker at once.
    w.terminate();
    eventually("the model to lose its worker", || async {
        let (s, _, _) = complete(&c, &url, &chat("hi", 1, false)).await;
        s == StatusCode::SERVICE_UNAVAILABLE
    })
    .await;
    let (s, h, body) = complete(&c, &url, &chat("hi", 1, false)).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(h.contains_key("retry-after"));
    assert!(body.contains("no_available_worker"), "{body}");
    let (_w2, _) = mock_worker(&["--etcd", &etcd.url(), "--speedup", "100"]).await;
    eventually("a new worker to serve the model", || async {
        complete(&c, &url, &chat("hi", 1, false)).await.0 == StatusCode::OK
    })
    .await;
    // A model never seen is still 404.
    let (s, _, _) = post_json(
        &c,
        &format!("{url}/v1/chat/completions"),
        &json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

/// An endpoint whose workers have all been gone for the grace period is released: its
/// router, Client and metrics series are gone and the model is unknown (404); when a
/// worker registers again the endpoint is set up anew and serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_gone_past_its_grace_is_released_and_comes_back_anew() {
    let etcd = Etcd::start();
    let (w, _) = mock_worker(&["--etcd", &etcd.url(), "--speedup", "100"]).await;
    let (_router, url) = serve(&[
        "--etcd",
        &etcd.url(),
        "--admin-token",
        TOKEN,
        "--endpoint-grace-secs",
        "1",
    ])
    .await;
    let c = http::client();
    assert_eq!(
        complete(&c, &url, &chat("hi", 1, false)).await.0,
        StatusCode::OK
    );
    let series = |c: http::HttpClient, url: String| async move {
        let (_, body) = http::get(&c, &format!("{url}/metrics")).await;
        String::from_utf8_lossy(&body).contains("endpoint=\"default/mock/generate\"")
    };
    assert!(series(c.clone(), url.clone()).await);
    w.terminate();
    eventually("the endpoint released after its grace", || async {
        let gone = complete(&c, &url, &chat("hi", 1, false)).await.0 == StatusCode::NOT_FOUND;
        gone && !series(c.clone(), url.clone()).await
    })
    .await;
    let (s, endpoints) = admin_get_text(&c, &format!("{url}/admin/endpoints")).await;
    assert_eq!(s, StatusCode::OK);
    assert!(!endpoints.contains("default/mock/generate"), "{endpoints}");
    let (_w2, _) = mock_worker(&["--etcd", &etcd.url(), "--speedup", "100"]).await;
    eventually("the endpoint set up anew", || async {
        complete(&c, &url, &chat("hi", 1, false)).await.0 == StatusCode::OK
    })
    .await;
}

/// A model served by two endpoints (two deployments of it) gets a router for each;
/// requests go to the one with available workers, so when one deployment's workers all
/// leave the model is still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_served_by_two_endpoints_is_routed_to_the_one_with_workers() {
    let etcd = Etcd::start();
    let (_blue, _) = mock_worker(&[
        "--etcd",
        &etcd.url(),
        "--speedup",
        "100",
        "--endpoint",
        "blue/mock/generate",
    ])
    .await;
    let (green, _) = mock_worker(&["--etcd", &etcd.url(), "--speedup", "100"]).await;
    let (_router, url) = serve(&["--etcd", &etcd.url(), "--admin-token", TOKEN]).await;
    let c = http::client();
    let endpoints = || async {
        admin_get_text(&c, &format!("{url}/admin/endpoints"))
            .await
            .1
    };
    eventually("a router for each endpoint", || async {
        let e = endpoints().await;
        e.contains("blue/mock/generate") && e.contains("default/mock/generate")
    })
    .await;
    assert_eq!(
        complete(&c, &url, &chat("hi", 1, false)).await.0,
        StatusCode::OK
    );
    green.terminate();
    // Once discovery has seen the green workers leave, every request is served by blue.
    eventually("the model served by the other endpoint", || async {
        for _ in 0..10 {
            if complete(&c, &url, &chat("hi", 1, false)).await.0 != StatusCode::OK {
                return false;
            }
        }
        true
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_etcd_and_a_mass_deregistration_lose_no_request() {
    let etcd = Etcd::start();
    let mut workers = Vec::new();
    for _ in 0..3 {
        workers.push(mock_worker(&["--etcd", &etcd.url(), "--speedup", "100", "--ttl", "2"]).await);
    }
    let (_router, url) = serve(&["--etcd", &etcd.url(), "--admin-token", TOKEN]).await;
    let c = http::client();
    eventually("three workers", || async { available(&c, &url).await == 3 }).await;
    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let served = Arc::new(AtomicU64::new(0));
    let load = {
        let (c, url, stop, failures, served) = (
            c.clone(),
            url.clone(),
            stop.clone(),
            failures.clone(),
            served.clone(),
        );
        tokio::spawn(async move {
            // Bounded: at most 5,000 requests.
            for i in 0..5000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let (s, _, body) = complete(&c, &url, &chat(&format!("q {i}"), 1, false)).await;
                if s == StatusCode::OK {
                    served.fetch_add(1, Ordering::Relaxed);
                } else {
                    failures.lock().push(format!("{s}: {body}"));
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Frozen past every lease's TTL.
    etcd.signal("STOP");
    tokio::time::sleep(Duration::from_secs(5)).await;
    etcd.signal("CONT");
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Then every registration disappears at once (a mass lease expiry, a bad deploy):
    // the workers still answer, so they keep serving for the grace period.
    switchyard::discovery::etcd_api::EtcdApi::new(&[etcd.url()], Duration::from_secs(5))
        .delete("switchyard/instances/", true)
        .await
        .unwrap();
    eventually("the removals held", || async {
        metric(&c, &url, "switchyard_held_removals_total", "").await >= 3.0
    })
    .await;
    assert_eq!(available(&c, &url).await, 3);
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    let failures = failures.lock().clone();
    assert!(
        failures.is_empty(),
        "{} failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(served.load(Ordering::Relaxed) > 50);
}

/// The connections carrying the router's etcd watches freeze without a close or a reset
/// (a member or NAT path that vanished) while every other call still succeeds. A worker
/// registered during the freeze must still be served: the watches check themselves
/// against etcd every 2 s on other connections, and one that has not delivered a change
/// etcd showed by the next check is re-listed and re-made. Bound: 15 s (two checks, a
/// re-list, and this machine's slack), well under the 30 s periodic re-listing of models.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_registered_while_the_watch_is_frozen_is_served() {
    let etcd = Etcd::start();
    let proxy = common::etcd::FreezingProxy::start(&etcd.url()).await;
    let (_a, _) = mock_worker(&["--etcd", &etcd.url(), "--speedup", "100"]).await;
    let (_router, url) = serve(&["--etcd", &proxy.url, "--admin-token", TOKEN]).await;
    let c = http::client();
    eventually("the first worker", || async {
        available(&c, &url).await == 1
    })
    .await;
    proxy.freeze_watches();
    let (_b, b_url) = mock_worker(&["--etcd", &etcd.url(), "--speedup", "100"]).await;
    let registered = Instant::now();
    while available(&c, &url).await < 2 {
        assert!(
            registered.elapsed() < Duration::from_secs(15),
            "a worker registered during the freeze was not discovered within 15 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let b = instance(&c, &url, &b_url).await;
    assert_eq!(b["available"], true, "{b}");
}
