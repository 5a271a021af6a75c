//! The router following engines' own KV events over ZMQ: a publisher written from vLLM's
//! and SGLang's format with their own libraries (`tests/fixtures/kv_publisher.py`: pyzmq
//! and msgspec, random engine hashes) in every shape they publish, a real KvRouter and
//! Client, and the subscriber a router runs.

mod common;

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use switchyard::client::{Client, ClientConfig, HttpHealthCheck, OutlierConfig};
use switchyard::discovery::{DiscoveryUpdate, EndpointPath, EngineEventSource, InstanceInfo};
use switchyard::ids::{BlockHash, InstanceId};
use switchyard::kv::hash::BlockHasher;
use switchyard::router::{CacheView, KvRouter};

const PATIENCE: Duration = Duration::from_secs(30);
const BLOCK: u32 = 16;
const W: InstanceId = InstanceId(7);

/// The Python publisher.
struct Publisher {
    _child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
    pub_port: u16,
    replay_port: u16,
}

impl Publisher {
    async fn start(shape: &str) -> Publisher {
        Publisher::start_with(shape, &[]).await
    }

    async fn start_with(shape: &str, extra: &[&str]) -> Publisher {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/kv_publisher.py"
        );
        let mut child = Command::new("python3")
            .args([script, "--shape", shape, "--block-size", &BLOCK.to_string()])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs (tools/test.sh installs it, with pyzmq and msgspec)");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(PATIENCE, stdout.next_line())
            .await
            .expect("the publisher starts")
            .unwrap()
            .expect("the publisher says ready (are pyzmq and msgspec installed?)");
        let ports: Vec<u16> = line
            .strip_prefix("ready ")
            .unwrap_or_else(|| panic!("{line}"))
            .split(' ')
            .map(|p| p.parse().unwrap())
            .collect();
        Publisher {
            _child: child,
            stdin,
            stdout,
            pub_port: ports[0],
            replay_port: ports[1],
        }
    }

    /// Sends a command; returns the next sequence number.
    async fn send(&mut self, cmd: serde_json::Value) -> u64 {
        let mut line = cmd.to_string();
        line.push('\n');
        self.stdin.write_all(line.as_bytes()).await.unwrap();
        let answer = tokio::time::timeout(PATIENCE, self.stdout.next_line())
            .await
            .expect("the publisher answers")
            .unwrap()
            .expect("the publisher is alive");
        answer.strip_prefix("ok ").unwrap().parse().unwrap()
    }

    fn source(&self, replay: bool) -> EngineEventSource {
        EngineEventSource {
            endpoint: format!("tcp://127.0.0.1:{}", self.pub_port),
            replay: replay.then(|| format!("tcp://127.0.0.1:{}", self.replay_port)),
            topic: "kv-events".into(),
            data_parallel_size: 1,
        }
    }
}

/// Worker `id` of model `m` at `url`, with its engine's KV event sockets if any.
fn instance(id: InstanceId, url: String, engine_events: Option<EngineEventSource>) -> InstanceInfo {
    InstanceInfo {
        id,
        endpoint: EndpointPath::for_model("m"),
        url,
        model: "m".into(),
        block_size: BLOCK,
        events_url: None,
        engine_events: engine_events.map(Arc::new),
        health_path: "/health".into(),
        registration: 1,
    }
}

/// A Client of model `m` over `instances` (no health probes: the workers' HTTP sides are
/// not what these tests are about).
fn client_of(instances: Vec<InstanceInfo>) -> Arc<Client> {
    let client = Client::new(
        EndpointPath::for_model("m"),
        ClientConfig {
            outlier: OutlierConfig {
                health_interval: None,
                ..OutlierConfig::default()
            },
            ..ClientConfig::default()
        },
        Arc::new(HttpHealthCheck::new(Duration::from_secs(1))),
    );
    client.apply(DiscoveryUpdate::Reset(instances));
    client
}

fn router(source: EngineEventSource) -> Arc<KvRouter> {
    let client = client_of(vec![instance(W, "http://127.0.0.1:9".into(), Some(source))]);
    let router = common::kv::kv_cost_router(client, BLOCK);
    common::kv::follow_events(&router);
    router
}

async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A prompt of `blocks` full blocks, distinct per `seed`.
fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| seed * 100_000 + i).collect()
}

fn hashes(tokens: &[u32]) -> Vec<BlockHash> {
    BlockHasher::new(BLOCK, 0).hashes(tokens)
}

fn sorted(mut v: Vec<BlockHash>) -> Vec<BlockHash> {
    v.sort_unstable();
    v
}

/// Leading blocks of `tokens` the router finds on the worker.
fn overlap(router: &KvRouter, tokens: &[u32]) -> u32 {
    let (c, _) = router.candidates(&hashes(tokens), &[]);
    c.overlap_of(W).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_engine_shape_lands_in_the_index_in_the_routers_own_hashes() {
    for shape in ["vllm-map", "vllm-array", "sglang"] {
        let mut publisher = Publisher::start(shape).await;
        let router = router(publisher.source(true));
        eventually(
            "the router in sync with an engine that published nothing",
            || router.cache_view(W) == CacheView::Events,
        )
        .await;
        let a = prompt(1, 4);
        publisher.send(json!({"op": "stored", "tokens": a})).await;
        eventually("the stored blocks", || overlap(&router, &a) == 4).await;
        // A longer prompt sharing `a`: only its new blocks are published, chained to
        // `a`'s last block by the engine's own hash.
        let mut b = a.clone();
        b.extend(prompt(2, 2));
        publisher
            .send(json!({"op": "stored", "tokens": b, "from_block": 4}))
            .await;
        eventually("the chained blocks", || overlap(&router, &b) == 6).await;
        assert_eq!(router.cached_block_list(W), sorted(hashes(&b)), "{shape}");
        publisher
            .send(json!({"op": "removed", "tokens": b, "blocks": [5]}))
            .await;
        eventually("the removal", || overlap(&router, &b) == 5).await;
        publisher.send(json!({"op": "unknown"})).await;
        // A block size other than the endpoint's is reported, not applied.
        let c = prompt(3, 2);
        publisher
            .send(json!({"op": "stored", "tokens": c, "block_size": 8}))
            .await;
        publisher.send(json!({"op": "cleared"})).await;
        eventually("the clear", || router.cached_block_list(W).is_empty()).await;
        let counts = router.view_status(W).unwrap().counts;
        assert_eq!(counts.unknown_type, 1, "{shape}");
        assert_eq!(counts.wrong_block_size, 1, "{shape}");
        assert_eq!(overlap(&router, &c), 0, "{shape}");
        assert_eq!(router.cache_view(W), CacheView::Events, "{shape}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_started_late_catches_up_from_the_replay_socket() {
    let mut publisher = Publisher::start("vllm-map").await;
    let a = prompt(1, 3);
    publisher.send(json!({"op": "stored", "tokens": a})).await;
    let router = router(publisher.source(true));
    eventually("the replayed blocks", || overlap(&router, &a) == 3).await;
    assert_eq!(router.cache_view(W), CacheView::Events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_filled_from_the_replay_socket() {
    let mut publisher = Publisher::start("vllm-map").await;
    let router = router(publisher.source(true));
    eventually("in sync", || router.cache_view(W) == CacheView::Events).await;
    let (a, b) = (prompt(1, 2), prompt(2, 2));
    // `a`'s batch never reaches the subscriber; `b`'s arrives after the gap.
    publisher
        .send(json!({"op": "stored", "tokens": a, "live": false}))
        .await;
    publisher.send(json!({"op": "stored", "tokens": b})).await;
    eventually("both prompts", || {
        overlap(&router, &a) == 2 && overlap(&router, &b) == 2
    })
    .await;
    let status = router.view_status(W).unwrap();
    assert_eq!(status.counts.lost_gaps, 0);
    assert!(status.complete);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_nobody_can_fill_makes_the_view_incomplete_until_the_cache_turns_over() {
    let mut publisher = Publisher::start("vllm-map").await;
    let router = router(publisher.source(true));
    let a = prompt(1, 4);
    publisher.send(json!({"op": "stored", "tokens": a})).await;
    eventually("a", || overlap(&router, &a) == 4).await;
    // A lost batch the replay buffer no longer holds.
    publisher.send(json!({"op": "forget"})).await;
    publisher
        .send(json!({"op": "stored", "tokens": prompt(2, 1), "live": false}))
        .await;
    publisher.send(json!({"op": "forget"})).await;
    let b = prompt(3, 2);
    publisher.send(json!({"op": "stored", "tokens": b})).await;
    eventually("the lost gap", || {
        router.cache_view(W) == CacheView::Incomplete
    })
    .await;
    // What the worker held before the gap may be gone: no longer promised. What came
    // after is known.
    assert_eq!(overlap(&router, &a), 0);
    assert_eq!(overlap(&router, &b), 2);
    assert_eq!(router.view_status(W).unwrap().counts.lost_gaps, 1);
    // While incomplete, the router's own decisions are predictions for the worker.
    let p = prompt(9, 3);
    let routed = router.route(&p, None, &[]).unwrap();
    router.finish(routed.request);
    assert_eq!(overlap(&router, &p), 3, "predicted from the decision");
    // The worker's cache turns over (as many blocks stored as it held at its peak).
    publisher
        .send(json!({"op": "stored", "tokens": prompt(4, 4)}))
        .await;
    eventually("complete again", || {
        router.cache_view(W) == CacheView::Events
    })
    .await;
    assert_eq!(overlap(&router, &p), 0, "predictions dropped once exact");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_engine_is_resynced() {
    let mut publisher = Publisher::start("sglang").await;
    let router = router(publisher.source(true));
    let (a, b, c) = (prompt(1, 2), prompt(2, 2), prompt(3, 3));
    publisher.send(json!({"op": "stored", "tokens": a})).await;
    publisher.send(json!({"op": "stored", "tokens": b})).await;
    eventually("before", || overlap(&router, &b) == 2).await;
    // A new engine process: sequence numbers from 0, new hashes, an empty cache.
    publisher.send(json!({"op": "restart"})).await;
    publisher.send(json!({"op": "stored", "tokens": c})).await;
    eventually("after", || overlap(&router, &c) == 3).await;
    assert_eq!(overlap(&router, &a), 0);
    assert_eq!(overlap(&router, &b), 0);
    let status = router.view_status(W).unwrap();
    assert_eq!(status.counts.restarts, 1);
    assert!(status.complete);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_replay_socket_a_late_router_is_incomplete_not_wrong() {
    let mut publisher = Publisher::start("vllm-array").await;
    publisher
        .send(json!({"op": "stored", "tokens": prompt(1, 2)}))
        .await;
    let router = router(publisher.source(false));
    eventually("the subscription", || {
        router.cache_view(W) == CacheView::Incomplete
    })
    .await;
    // Live batches arrive once the subscription is up; the first is past seq 0.
    let b = prompt(2, 2);
    let deadline = Instant::now() + PATIENCE;
    while overlap(&router, &b) < 2 {
        assert!(Instant::now() < deadline, "the live batch never arrived");
        publisher.send(json!({"op": "stored", "tokens": b})).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(router.cache_view(W), CacheView::Incomplete);
}

/// `POST url` with a JSON body and the admin token; the JSON answer.
async fn admin_post(url: &str, body: &serde_json::Value) -> serde_json::Value {
    let c = common::http::client();
    let (status, _, bytes) = common::http::send(
        &c,
        hyper::Method::POST,
        url,
        &[
            ("authorization", "Bearer t0ken-for-the-tests"),
            ("content-type", "application/json"),
        ],
        body.to_string(),
        PATIENCE,
    )
    .await
    .unwrap();
    assert!(
        status.is_success(),
        "{status}: {}",
        String::from_utf8_lossy(&bytes)
    );
    serde_json::from_slice(&bytes).unwrap()
}

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
        let e = admin_post(&explain_url, &request).await;
        e["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["overlap_blocks"] == blocks && c["cache_view"] == "events")
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

async fn eventually_async<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + PATIENCE;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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
    // One worker serving vLLM's gauges, one whose address answers nothing.
    client.apply(DiscoveryUpdate::Reset(vec![
        instance(W, worker.url(), None),
        instance(
            gone,
            format!("http://127.0.0.1:{}", common::procs::free_port()),
            None,
        ),
    ]));
    let router = common::kv::kv_cost_router(client, BLOCK);
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
    eventually("the failed scrape counted", || {
        router
            .scrape_stats()
            .failed
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    })
    .await;
    // Asked again only after a quiet period, not every 50 ms.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        router
            .scrape_stats()
            .failed
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert!(router.load_of(gone).reported.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_socket_that_never_answers_is_asked_once_not_at_every_gap() {
    // A "replay socket" that accepts connections and never says a word.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = silent.accept().await {
            held.push(conn);
        }
    });
    let mut publisher = Publisher::start("vllm-map").await;
    let mut source = publisher.source(false);
    source.replay = Some(format!("tcp://127.0.0.1:{silent_port}"));
    let router = router(source);
    // Every gap below would ask the replay socket, and each ask would wait out its timeout.
    for round in 0..3u32 {
        publisher
            .send(json!({"op": "stored", "tokens": prompt(10 + round, 1), "live": false}))
            .await;
        let b = prompt(20 + round, 1);
        let deadline = Instant::now() + PATIENCE;
        while overlap(&router, &b) < 1 {
            assert!(Instant::now() < deadline, "round {round} never arrived");
            publisher.send(json!({"op": "stored", "tokens": b})).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let status = router.view_status(W).unwrap();
    assert!(status.counts.lost_gaps >= 3, "{status:?}");
    assert_eq!(status.replay_failures, 1, "{status:?}");
}

/// A chat template unlike ChatML (Llama 3's shape), as a model's `tokenizer_config.json`.
const LLAMA3_CONFIG: &str = r#"{"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": "{{- bos_token }}\n{%- for message in messages %}\n{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n"}"#;

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
    let hub = CentralEvents::bind(std::slice::from_ref(&address))
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

/// vLLM's `cache_salt` keeps tenants apart: a prompt the engine stored under one salt is
/// found by a request with that salt only, not by another tenant's or an unsalted one,
/// because the router mixes the request's salt into the first block as the engine does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_salt_is_matched_only_by_its_own_tenant() {
    let mut publisher = Publisher::start("vllm-map").await;
    let router = router(publisher.source(true));
    eventually("in sync", || router.cache_view(W) == CacheView::Events).await;
    let a = prompt(1, 5);
    publisher
        .send(json!({"op": "stored", "tokens": a, "salt": "tenant-1"}))
        .await;
    let on = |salt: Option<&str>| {
        let hashes = router.hasher().salted_hashes(&a, salt);
        router.candidates(&hashes, &[]).0.overlap_of(W).unwrap_or(0)
    };
    eventually("the salted blocks", || on(Some("tenant-1")) == 5).await;
    assert_eq!(on(Some("tenant-2")), 0, "another tenant's salt");
    assert_eq!(on(None), 0, "no salt");
}
