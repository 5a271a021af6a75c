//! The router following engines' own KV events over ZMQ: a publisher written from vLLM's
//! and SGLang's format with their own libraries (`tests/fixtures/kv_publisher.py`: pyzmq
//! and msgspec, random engine hashes) in every shape they publish, a real KvRouter and
//! Client, and the subscriber a router runs.

mod common;

use std::time::{Duration, Instant};

use serde_json::json;

use common::engine::*;
use switchyard::router::CacheView;

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
        let hashes = router.hasher().keyed_hashes(&a, None, salt);
        router.candidates(&hashes, &[]).0.overlap_of(W).unwrap_or(0)
    };
    eventually("the salted blocks", || on(Some("tenant-1")) == 5).await;
    assert_eq!(on(Some("tenant-2")), 0, "another tenant's salt");
    assert_eq!(on(None), 0, "no salt");
}
