//! The router meeting real engines' other surfaces: workers registered with their event
//! sockets (the router binary), the engine's load from its metrics page, the model's chat
//! template making the router's blocks the engine's, and engines connecting to the
//! router's bound socket (central mode).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use common::engine::*;
use switchyard::client::{Client, ClientConfig, HttpHealthCheck};
use switchyard::discovery::{DiscoveryUpdate, EndpointPath, EngineEventSource};
use switchyard::ids::InstanceId;
use switchyard::router::CacheView;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_binary_follows_registered_workers_publishing_vllms_format() {
    use common::procs::{mock_worker, serve};
    // A real etcd; two mock worker processes publishing vLLM's ZMQ events (with replay
    // sockets, on free ports) register where their sockets are, as `switchyard register
    // --kv-events` does for a vLLM server.
    let etcd = common::etcd::Etcd::start();
    let mut workers = Vec::new();
    for _ in 0..2 {
        workers.push(
            mock_worker(&[
                "--etcd",
                &etcd.url(),
                "--zmq-events",
                "0",
                "--speedup",
                "100",
            ])
            .await,
        );
    }
    let (_router, rurl) = serve(&[
        "--etcd",
        &etcd.url(),
        "--admin-token",
        "t0ken-for-the-tests",
    ])
    .await;
    let explain_url = format!("{rurl}/admin/endpoints/default/mock/generate/explain");
    let prompt: String = (0..400).map(|i| format!("w{i} ")).collect();
    let request = json!({"model": "mock", "prompt": prompt, "max_tokens": 4});
    eventually_async("both views exact", || async {
        let e = admin_post(&explain_url, &request).await;
        e["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["cache_view"] == "events")
            .count()
            == 2
    })
    .await;
    let before = admin_post(&explain_url, &request).await;
    assert!(before["prompt_blocks"].as_u64().unwrap() >= 10, "{before}");
    assert!(
        before["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["overlap_blocks"] == 0),
        "{before}"
    );
    // Served once: the worker's engine publishes the blocks, and the router sees them
    // on that worker through its ZMQ events (not a prediction: the view is exact).
    let c = common::http::client();
    let (status, answer, _) =
        common::http::post_json(&c, &format!("{rurl}/v1/completions"), &request).await;
    assert!(status.is_success(), "{answer}");
    let blocks = before["prompt_blocks"].clone();
    eventually_async("the published blocks", || async {
        common::router::published(&admin_post(&explain_url, &request).await, &blocks)
    })
    .await;
    let after = admin_post(&explain_url, &request).await;
    let holder = after["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["overlap_blocks"] == blocks)
        .unwrap()["id"]
        .clone();
    assert_eq!(
        after["chosen"], holder,
        "kv-cost picks the worker holding the prompt: {after}"
    );
    assert_eq!(after["decided_by"], "policy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_load_is_read_from_the_workers_metrics_page() {
    let worker = switchyard::worker::MockWorker::bind(
        common::kv::mock_worker_config(777),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let client = Client::new(
        EndpointPath::for_model("m"),
        ClientConfig::default(),
        Arc::new(HttpHealthCheck::new(Duration::from_secs(1))),
    );
    let gone = InstanceId(8);
    // A worker that answers, but with no engine's gauges (not an engine).
    let plain = common::health::HealthServer::start().await;
    plain
        .healthy
        .store(true, std::sync::atomic::Ordering::SeqCst);
    // One worker serving vLLM's gauges, one whose address answers nothing, one plain.
    client.apply(DiscoveryUpdate::Reset(vec![
        instance(W, worker.url(), None),
        instance(
            gone,
            format!("http://127.0.0.1:{}", common::procs::free_port()),
            None,
        ),
        instance(InstanceId(9), plain.url(), None),
    ]));
    let router = common::kv::kv_cost_router(client, BLOCK);
    let started = std::time::Instant::now();
    switchyard::router::metrics_scraper::spawn(&router, Duration::from_millis(50));
    eventually("the scraped load", || {
        router
            .load_of(W)
            .reported
            .is_some_and(|r| r.kv_total_blocks == 777)
    })
    .await;
    assert_eq!(router.known_capacity(W), Some(777));
    let (c, _) = router.candidates(&[], &[]);
    assert_eq!(c.row(c.position(W).unwrap()).kv_usage, Some(0.0));
    // The worker that answers nothing (a busy or restarting engine) is asked again soon,
    // not after the 30 s a non-engine waits: at doubling waits (50, 100, 200 ms...).
    let failed = || {
        router
            .scrape_stats()
            .failed
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    eventually("the unreachable worker asked four times", || failed() >= 5).await;
    tokio::time::sleep(Duration::from_millis(1200).saturating_sub(started.elapsed())).await;
    // Not every 50 ms either (24 ticks by now): its attempts at 0, 50, 150, 350 and
    // 750 ms, and the plain worker's one.
    let n = failed();
    assert!(n <= 7, "{n} failed scrapes in {:?}", started.elapsed());
    assert!(router.load_of(gone).reported.is_none());
    // The plain worker's page was read once and is not asked for again so soon (its
    // `/v1/models` read aside).
    assert!(
        plain.hits.load(std::sync::atomic::Ordering::SeqCst) <= 2,
        "a page without gauges asked for again"
    );
}

/// The engine renders chats with the model's template. A router given the same template
/// (`--chat-template`) hashes the blocks the engine caches and sees the served chat's
/// whole prompt cached; a router rendering ChatML sees none of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_models_chat_template_makes_the_routers_blocks_the_engines() {
    use common::procs::{mock_worker, serve};
    let dir = tempfile::tempdir().unwrap();
    let template = dir.path().join("tokenizer_config.json");
    std::fs::write(&template, LLAMA3_CONFIG).unwrap();
    let template = template.to_str().unwrap();
    let etcd = common::etcd::Etcd::start();
    let _worker = mock_worker(&[
        "--etcd",
        &etcd.url(),
        "--zmq-events",
        "0",
        "--speedup",
        "100",
        "--chat-template",
        template,
    ])
    .await;
    let (_a, with_template) = serve(&[
        "--etcd",
        &etcd.url(),
        "--admin-token",
        "t0ken-for-the-tests",
        "--chat-template",
        template,
    ])
    .await;
    let (_b, chatml) = serve(&[
        "--etcd",
        &etcd.url(),
        "--admin-token",
        "t0ken-for-the-tests",
    ])
    .await;
    let explain = |router: &str| format!("{router}/admin/endpoints/default/mock/generate/explain");
    let system: String = (0..300).map(|i| format!("rule{i} ")).collect();
    let chat = json!({"model": "mock", "max_tokens": 4, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "Summarise."}]});
    for router in [&with_template, &chatml] {
        eventually_async("the view is exact", || async {
            admin_post(&explain(router), &chat).await["candidates"][0]["cache_view"] == "events"
        })
        .await;
    }
    let c = common::http::client();
    let (status, answer, _) =
        common::http::post_json(&c, &format!("{with_template}/v1/chat/completions"), &chat).await;
    assert!(status.is_success(), "{answer}");

    let blocks = admin_post(&explain(&with_template), &chat).await["prompt_blocks"].clone();
    assert!(blocks.as_u64().unwrap() >= 10, "{blocks}");
    eventually_async("the engine's blocks, seen through the template", || async {
        admin_post(&explain(&with_template), &chat).await["candidates"][0]["overlap_blocks"]
            == blocks
    })
    .await;
    let seen_by_chatml = admin_post(&explain(&chatml), &chat).await;
    assert_eq!(
        seen_by_chatml["candidates"][0]["overlap_blocks"], 0,
        "ChatML renders other text, so other blocks: {seen_by_chatml}"
    );
    // A conversation the template refuses is the client's error, not the worker's.
    let refusing = dir.path().join("mistral.jinja");
    std::fs::write(
        &refusing,
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}",
    )
    .unwrap();
    let (_r, strict) = serve(&[
        "--etcd",
        &etcd.url(),
        "--chat-template",
        refusing.to_str().unwrap(),
    ])
    .await;
    let (status, answer, _) =
        common::http::post_json(&c, &format!("{strict}/v1/chat/completions"), &chat).await;
    assert_eq!(status, hyper::StatusCode::BAD_REQUEST, "{answer}");
    assert!(
        answer.to_string().contains("System role not supported"),
        "{answer}"
    );
}

/// Central mode: the router binds one SUB socket and engines connect to it, each under a
/// topic naming its worker (vLLM's `endpoint` without `*`). Every worker gets its own
/// blocks, batches under a topic no worker names are counted and skipped, and a topic
/// cannot be claimed by two workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_connecting_to_the_routers_bound_socket_are_told_apart_by_topic() {
    use switchyard::router::central_events::CentralEvents;
    const W2: InstanceId = InstanceId(8);
    let address = format!("tcp://127.0.0.1:{}", common::procs::free_port());
    let budget = switchyard::bounded::budget::Budget::new(switchyard::router::DEFAULT_EVENT_MEMORY);
    let hub = CentralEvents::bind(std::slice::from_ref(&address), budget)
        .await
        .unwrap();
    let mut p1 = Publisher::start_with("vllm-map", &["--connect", &address, "--topic", "w1"]).await;
    let mut p2 = Publisher::start_with("sglang", &["--connect", &address, "--topic", "w2"]).await;
    let mut stray =
        Publisher::start_with("vllm-map", &["--connect", &address, "--topic", "nobody"]).await;
    let bound = |topic: &str, publisher: &Publisher| EngineEventSource {
        endpoint: "bound".into(),
        replay: Some(format!("tcp://127.0.0.1:{}", publisher.replay_port)),
        topic: topic.into(),
        data_parallel_size: 1,
    };
    let client = client_of(vec![
        instance(W, "http://127.0.0.1:9".into(), Some(bound("w1", &p1))),
        instance(W2, "http://127.0.0.1:10".into(), Some(bound("w2", &p2))),
    ]);
    let router = common::kv::kv_cost_router_with(
        client,
        switchyard::router::KvRouterConfig {
            central_events: Some(hub.clone()),
            ..switchyard::router::KvRouterConfig::new(BLOCK)
        },
    );
    common::kv::follow_events(&router);
    eventually("both views in sync", || {
        router.cache_view(W) == CacheView::Events && router.cache_view(W2) == CacheView::Events
    })
    .await;
    let (a, b) = (prompt(1, 8), prompt(2, 6));
    p1.send(json!({"op": "stored", "tokens": a})).await;
    p2.send(json!({"op": "stored", "tokens": b})).await;
    stray.send(json!({"op": "stored", "tokens": b})).await;
    let on = |id: InstanceId, tokens: &[u32]| {
        let (c, _) = router.candidates(&hashes(tokens), &[]);
        c.overlap_of(id).unwrap_or(0)
    };
    eventually("each engine's blocks on its own worker", || {
        on(W, &a) == 8 && on(W2, &b) == 6
    })
    .await;
    assert_eq!((on(W2, &a), on(W, &b)), (0, 0));
    // The stray engine's batches are skipped, and counted, once its connection is up (a
    // batch sent before it is lost, as with any PUB socket).
    let unrouted = || hub.unrouted.load(std::sync::atomic::Ordering::Relaxed);
    let deadline = Instant::now() + PATIENCE;
    while unrouted() == 0 {
        assert!(Instant::now() < deadline, "stray batches never counted");
        stray.send(json!({"op": "cleared"})).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        hub.claim("w1", 0, InstanceId(99)).is_err(),
        "a topic is one worker's"
    );
    assert!(
        hub.claim("w3", 1, InstanceId(99)).is_err(),
        "one socket, one rank"
    );
    assert_eq!(
        on(W, &a),
        8,
        "nothing the stray engine said reached a worker"
    );
}
