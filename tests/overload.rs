//! Past the fleet's capacity, end to end: real mock-worker processes with small batches
//! (their engines queue like vLLM's past `max_num_seqs`), a real router process, real
//! HTTP. Saturated workers get no new request while another has room; with every worker
//! saturated requests wait in the router and are placed when one frees, by class and
//! tenant; a full queue or a tenant over its share is refused with the right status and
//! `Retry-After`; a client that leaves the queue frees its place.

mod common;

use std::time::{Duration, Instant};

use serde_json::json;

use common::http;
use common::procs::serve;
use common::queue::*;
use common::router::{TOKEN, admin_get, eventually, instance, metric};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saturated_workers_get_no_new_request_while_another_has_room() {
    // A runs one request at a time, B many; round-robin would alternate between them.
    let fleet = workers(&["1", "64"]).await;
    let (a, b) = (&fleet[0].1, &fleet[1].1);
    let (_r, url) = router(
        &fleet,
        &["--policy", "round-robin", "--saturation-queued", "1"],
    )
    .await;
    let c = http::client();
    // Four long requests: A takes two, runs one and queues the other.
    let long: Vec<_> = (0..4)
        .map(|i| spawn_post(&url, body(&format!("long {i}"), 400), vec![]))
        .collect();
    eventually("A never queued a request", || async {
        stats(&c, a).await["waiting"].as_u64() == Some(1)
    })
    .await;
    // Its engine says so at its next load report: the router sees it saturated.
    eventually("the router to see A saturated", || async {
        instance(&c, &url, a).await["saturated"].is_string()
    })
    .await;
    let (a_before, b_before) = (taken(&c, a).await, taken(&c, b).await);
    for i in 0..6 {
        let (status, _, answer) = post(&c, &url, body(&format!("short {i}"), 4), &[]).await;
        assert!(status.is_success(), "{status}: {answer}");
    }
    assert_eq!(
        taken(&c, a).await,
        a_before,
        "a saturated worker received new requests while another had room"
    );
    assert_eq!(taken(&c, b).await, b_before + 6);
    assert!(
        queued(&c, &url).await == 0.0,
        "nothing waits while a worker has room"
    );
    for l in long {
        assert!(l.await.unwrap().0.is_success());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_worker_saturated_requests_wait_and_go_where_their_prefix_is() {
    let fleet = workers(&["1", "1"]).await;
    let (_r, url) = router(&fleet, &["--saturation-max-in-flight", "1"]).await;
    let c = http::client();
    // The prefix lands on one worker (A).
    let p = prompt("shared document");
    let (status, _, _) = post(&c, &url, body(&p, 1), &[]).await;
    assert!(status.is_success());
    let holder = if stats(&c, &fleet[0].1).await["finished"] == 1 {
        0
    } else {
        1
    };
    let (a, b) = (&fleet[holder].1, &fleet[1 - holder].1);
    // A gets a request on the prefix (its cache), ending in ~1.5 s; B an unrelated one
    // ending in ~5 s. Both are then saturated.
    let on_a = spawn_post(&url, body(&format!("{p} first question"), 150), vec![]);
    eventually("the worker to run the request", || async {
        stats(&c, a).await["running"] == 1
    })
    .await;
    let on_b = spawn_post(&url, body(&prompt("something else"), 500), vec![]);
    eventually("the worker to run the request", || async {
        stats(&c, b).await["running"] == 1
    })
    .await;
    // A third request on the prefix waits in the router, not in an engine.
    let q = spawn_post(&url, body(&format!("{p} second question"), 4), vec![]);
    eventually("the request did not wait in the router's queue", || async {
        queued(&c, &url).await == 1.0
    })
    .await;
    assert_eq!(stats(&c, a).await["waiting"], 0);
    assert_eq!(stats(&c, b).await["waiting"], 0);
    let (status, _, answer, _) = q.await.unwrap();
    assert!(status.is_success(), "{status}: {answer}");
    // Placed on A when it freed, with its prefix cached, while B was still busy.
    assert!(
        answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0)
            > 0,
        "{answer}"
    );
    assert_eq!(stats(&c, a).await["finished"], 3);
    assert_eq!(stats(&c, b).await["running"], 1, "B was still busy");
    assert_eq!(
        metric(&c, &url, "switchyard_queue_dispatched_total", "").await,
        1.0
    );
    assert!(
        metric(
            &c,
            &url,
            "switchyard_queue_wait_seconds_count",
            "class=\"normal\""
        )
        .await
            >= 1.0
    );
    assert!(on_a.await.unwrap().0.is_success());
    assert!(on_b.await.unwrap().0.is_success());
}

/// A tenant allowed `high` overtakes queued requests; a client asking for `high`
/// without that right is its tenant's class (`normal` for a client of no configured
/// tenant), behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_high_priority_request_overtakes_queued_batch_ones() {
    let fleet = workers(&["1"]).await;
    let (_dir, config) = config_file("[[tenants]]\nname = \"search\"\nmax_class = \"high\"\n");
    let (_r, url) = router(
        &fleet,
        &["--saturation-max-in-flight", "1", "--config", &config],
    )
    .await;
    let c = http::client();
    let busy = spawn_post(&url, body("the running one", 150), vec![]);
    eventually("the worker to run the request", || async {
        stats(&c, &fleet[0].1).await["running"] == 1
    })
    .await;
    let mut low = Vec::new();
    for i in 0..3 {
        let h = vec![("x-switchyard-priority", "low".into())];
        low.push(enqueue(&c, &url, body(&format!("batch job {i}"), 30), h).await);
    }
    let forged = enqueue(
        &c,
        &url,
        body("a client that says it is urgent", 30),
        vec![("x-switchyard-priority", "high".into())],
    )
    .await;
    let high = enqueue(
        &c,
        &url,
        body("an interactive user", 30),
        vec![
            ("x-switchyard-priority", "high".into()),
            ("x-switchyard-tenant", "search".into()),
        ],
    )
    .await;
    let (status, _, _, high_done) = high.await.unwrap();
    assert!(status.is_success());
    let (status, _, _, forged_done) = forged.await.unwrap();
    assert!(status.is_success());
    assert!(
        high_done < forged_done,
        "a client's own `high` was served as high: before the tenant allowed it"
    );
    for l in low {
        let (status, _, _, done) = l.await.unwrap();
        assert!(status.is_success());
        assert!(
            high_done < done && forged_done < done,
            "a batch request finished before a more urgent one"
        );
    }
    assert!(busy.await.unwrap().0.is_success());
    // Unknown classes are the client's mistake, said plainly.
    let (status, _, answer) = post(
        &c,
        &url,
        body("x", 1),
        &[("x-switchyard-priority", "urgent")],
    )
    .await;
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("high, normal, low")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_sheds_with_503_and_a_tenant_over_its_share_with_429() {
    let fleet = workers(&["1"]).await;
    let (_dir, config) = config_file("[[tenants]]\nname = \"a\"\n\n[[tenants]]\nname = \"b\"\n");
    let (_r, url) = router(
        &fleet,
        &[
            "--saturation-max-in-flight",
            "1",
            "--queue-max",
            "4",
            "--config",
            &config,
        ],
    )
    .await;
    let c = http::client();
    let busy = spawn_post(&url, body("the running one", 300), vec![]);
    eventually("the worker to run the request", || async {
        stats(&c, &fleet[0].1).await["running"] == 1
    })
    .await;
    let tenant = |t: &str| vec![("x-switchyard-tenant", t.to_string())];
    // Tenant A alone fills the queue.
    let mut a = Vec::new();
    for i in 0..4 {
        a.push(enqueue(&c, &url, body(&format!("a {i}"), 5), tenant("a")).await);
    }
    // Full, and A is the only tenant: the fleet is full (503), and the replica says it
    // is not ready.
    let full = post(&c, &url, body("a 5", 5), &[("x-switchyard-tenant", "a")]).await;
    assert_eq!(
        refusal(&full),
        (503, true, "fleet_full".into()),
        "{:?}",
        full.2
    );
    let (ready, _) = http::get(&c, &format!("{url}/ready")).await;
    assert_eq!(ready, 503);
    // Tenant B arrives: A holds more than its share, its newest request gives way.
    let b = spawn_post(&url, body("b 0", 5), tenant("b"));
    let displaced = a.pop().unwrap().await.unwrap();
    let displaced = (displaced.0, displaced.1, displaced.2);
    assert_eq!(
        refusal(&displaced),
        (429, true, "tenant_over_share".into()),
        "{:?}",
        displaced.2
    );
    // A, still over its share, is refused at once; B is served.
    let over = post(&c, &url, body("a 6", 5), &[("x-switchyard-tenant", "a")]).await;
    assert_eq!(refusal(&over), (429, true, "tenant_over_share".into()));
    assert!(b.await.unwrap().0.is_success());
    for r in a {
        assert!(r.await.unwrap().0.is_success());
    }
    assert!(busy.await.unwrap().0.is_success());
    assert_eq!(
        metric(
            &c,
            &url,
            "switchyard_queue_shed_total",
            "reason=\"tenant_over_share\""
        )
        .await,
        2.0
    );
    let (ready, _) = http::get(&c, &format!("{url}/ready")).await;
    assert_eq!(ready, 200, "ready again once the queue drained");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_client_that_leaves_frees_its_place_and_deadlines_are_kept() {
    let fleet = workers(&["1"]).await;
    let (_r, url) = router(
        &fleet,
        &["--saturation-max-in-flight", "1", "--queue-max", "1"],
    )
    .await;
    let c = http::client();
    let busy = spawn_post(&url, body("the running one", 500), vec![]);
    eventually("the worker to run the request", || async {
        stats(&c, &fleet[0].1).await["running"] == 1
    })
    .await;
    // A client waits in the queue, then gives up (its connection closes).
    let leaving = enqueue(&c, &url, body("impatient", 5), vec![]).await;
    leaving.abort();
    eventually("the client left but its place was kept", || async {
        queued(&c, &url).await == 0.0
    })
    .await;
    assert_eq!(
        metric(&c, &url, "switchyard_queue_left_total", "").await,
        1.0
    );
    // Its place is free: the next request waits rather than being refused, and one
    // whose deadline passes first is refused with 503.
    let started = Instant::now();
    let late = post(
        &c,
        &url,
        body("in a hurry", 5),
        &[("x-switchyard-deadline-ms", "300")],
    )
    .await;
    assert_eq!(
        refusal(&late),
        (503, true, "queue_deadline".into()),
        "{:?}",
        late.2
    );
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "refused at its deadline"
    );
    assert_eq!(
        metric(
            &c,
            &url,
            "switchyard_queue_shed_total",
            "reason=\"queue_deadline\""
        )
        .await,
        1.0
    );
    // The admin API shows the queue and why a request would wait.
    let endpoints = admin_get(&c, &format!("{url}/admin/endpoints")).await;
    let queue = &endpoints["endpoints"][0]["queue"];
    assert_eq!(queue["left_total"], 1, "{queue}");
    assert_eq!(queue["shed_total"]["queue_deadline"], 1, "{queue}");
    assert!(busy.await.unwrap().0.is_success());
    // Nothing waits and nothing is refused while the worker has room.
    for i in 0..3 {
        let (status, _, _) = post(&c, &url, body(&format!("after {i}"), 3), &[]).await;
        assert!(status.is_success());
    }
    assert_eq!(
        metric(&c, &url, "switchyard_queued_requests_total", "").await,
        2.0
    );
}

/// A client inventing a thousand tenants (a tenant header and an API key of its own on
/// every request) is one tenant, the default one: it takes free places only, and never
/// sheds a configured tenant's queued request, however far over its share that tenant
/// is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_inventing_a_thousand_tenants_sheds_no_one() {
    let fleet = workers(&["1"]).await;
    // The key is `sk-app`.
    let (_dir, config) = config_file(
        "[[tenants]]\nname = \"app\"\napi_key_sha256 = \"72016003589eb0bb8dbcc1fab3b1e74b81a25f06f79801b0b63fcf30be2e06c3\"\n",
    );
    let (_r, url) = router(
        &fleet,
        &[
            "--saturation-max-in-flight",
            "1",
            "--queue-max",
            "4",
            "--config",
            &config,
        ],
    )
    .await;
    let c = http::client();
    let busy = spawn_post(&url, body("the running one", 600), vec![]);
    eventually("the worker to run the request", || async {
        stats(&c, &fleet[0].1).await["running"] == 1
    })
    .await;
    let mut app = Vec::new();
    for i in 0..4 {
        let key = vec![("authorization", "Bearer sk-app".into())];
        app.push(enqueue(&c, &url, body(&format!("app {i}"), 3), key).await);
    }
    // The app holds the whole queue: over any share but its own alone.
    let mut refused = 0;
    for round in 0..125 {
        let attempts: Vec<_> = (0..8)
            .map(|i| {
                let n = round * 8 + i;
                spawn_post(
                    &url,
                    body(&format!("invented {n}"), 1),
                    vec![
                        ("x-switchyard-tenant", format!("tenant-{n}")),
                        ("authorization", format!("Bearer sk-invented-{n}")),
                    ],
                )
            })
            .collect();
        for a in attempts {
            let (status, headers, answer, _) = a.await.unwrap();
            assert_eq!(
                refusal(&(status, headers, answer.clone())),
                (503, true, "fleet_full".into()),
                "{answer}"
            );
            refused += 1;
        }
        if round % 25 == 0 {
            assert_eq!(queued(&c, &url).await, 4.0, "the app's requests stay");
        }
    }
    assert_eq!(refused, 1000);
    for r in app {
        let (status, _, answer, _) = r.await.unwrap();
        assert!(status.is_success(), "the app's request was shed: {answer}");
    }
    assert!(busy.await.unwrap().0.is_success());
    assert_eq!(
        metric(
            &c,
            &url,
            "switchyard_queue_shed_total",
            "reason=\"tenant_over_share\""
        )
        .await,
        0.0
    );
}

/// Requests waiting in one endpoint's queue hold no in-flight slot: with
/// `--max-in-flight 2`, a saturated model's queue of five does not refuse requests for
/// an idle model, and every queued request is served when its worker frees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_endpoints_queue_does_not_take_other_endpoints_slots() {
    let etcd = common::etcd::Etcd::start();
    // Two models, each its own endpoint (and queue).
    let worker = |model: &'static str, extra: &'static [&'static str]| {
        let etcd = etcd.url();
        async move {
            let listen = format!("127.0.0.1:{}", common::procs::free_port());
            let mut args = vec!["mock-worker", "--listen", &listen, "--model", model];
            args.extend(["--etcd", etcd.as_str()]);
            args.extend_from_slice(extra);
            let p = common::procs::switchyard(&args);
            let url = format!("http://{listen}");
            common::procs::wait_ok(&format!("{url}/v1/models")).await;
            (p, url)
        }
    };
    let (_busy_worker, busy_url) = worker("busy", &["--max-num-seqs", "1"]).await;
    let (_idle_worker, _) = worker("idle", &[]).await;
    let (_r, url) = serve(&[
        "--etcd",
        &etcd.url(),
        "--admin-token",
        TOKEN,
        "--max-in-flight",
        "2",
        "--saturation-max-in-flight",
        "1",
    ])
    .await;
    let c = http::client();
    let to = |model: &str, prompt: &str, max_tokens: u32| {
        json!({"model": model, "prompt": prompt, "max_tokens": max_tokens}).to_string()
    };
    eventually("both models to be served", || async {
        let (s1, _, _) = post(&c, &url, to("busy", "hello", 1), &[]).await;
        let (s2, _, _) = post(&c, &url, to("idle", "hello", 1), &[]).await;
        s1.is_success() && s2.is_success()
    })
    .await;
    let running = spawn_post(&url, to("busy", "the running one", 300), vec![]);
    eventually("the worker to run the request", || async {
        stats(&c, &busy_url).await["running"] == 1
    })
    .await;
    let mut waiting = Vec::new();
    for i in 0..5 {
        waiting.push(enqueue(&c, &url, to("busy", &format!("waits {i}"), 2), vec![]).await);
    }
    for i in 0..3 {
        let (status, _, answer) =
            post(&c, &url, to("idle", &format!("elsewhere {i}"), 2), &[]).await;
        assert!(status.is_success(), "{status}: {answer}");
    }
    assert!(running.await.unwrap().0.is_success());
    for w in waiting {
        let (status, _, answer, _) = w.await.unwrap();
        assert!(status.is_success(), "{status}: {answer}");
    }
}
