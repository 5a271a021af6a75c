//! The KV index kept in step with real worker event streams over HTTP, and the
//! endpoint's KvRouter deciding with the real kv-cost policy over a real Client.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::events::EventServer;
use switchyard::client::{Client, ClientConfig, HttpHealthCheck, OutlierConfig};
use switchyard::discovery::{DiscoveryUpdate, EndpointPath, InstanceInfo};
use switchyard::ids::{BlockHash, InstanceId};
use switchyard::kv::hash::BlockHasher;
use switchyard::policy::Decider;
use switchyard::router::{KvRouter, RouteError};

const PATIENCE: Duration = Duration::from_secs(30);

fn instance(id: u64, events_url: Option<String>) -> InstanceInfo {
    let url = format!("http://127.0.0.1:{}", 1 + id);
    InstanceInfo {
        events_url,
        ..InstanceInfo::new(InstanceId(id), EndpointPath::for_model("m"), url, "m", 16)
    }
}

fn router(instances: Vec<InstanceInfo>) -> (Arc<KvRouter>, Arc<Client>) {
    let client = Client::new(
        EndpointPath::for_model("m"),
        ClientConfig {
            probe_initial: Duration::from_secs(3600),
            probe_max: Duration::from_secs(3600),
            // These tests are about the index: no health checks, no ejection limits.
            outlier: OutlierConfig {
                base_ejection: Duration::from_secs(3600),
                max_ejection_share: 1.0,
                panic_threshold: 0.0,
                health_interval: None,
                ..OutlierConfig::default()
            },
        },
        Arc::new(HttpHealthCheck::new(Duration::from_secs(1))),
    );
    client.apply(DiscoveryUpdate::Reset(instances));
    let router = common::kv::kv_cost_router(client.clone(), 16);
    common::kv::follow_events(&router);
    (router, client)
}

/// Polls `f` until it holds (bounded by PATIENCE): there is no event to wait on for
/// "the index has caught up with a remote stream".
async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn hashes(v: &[u64]) -> Vec<BlockHash> {
    v.iter().map(|&b| BlockHash(b)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_then_deltas_land_in_the_index() {
    let worker = EventServer::start(&[1, 2, 3]).await;
    let (router, _client) = router(vec![instance(7, Some(worker.url.clone()))]);
    let w = InstanceId(7);
    eventually("the snapshot", || {
        router.cached_block_list(w) == hashes(&[1, 2, 3])
    })
    .await;
    worker.store(&[4, 5]);
    worker.remove(&[1]);
    eventually("the deltas", || {
        router.cached_block_list(w) == hashes(&[2, 3, 4, 5])
    })
    .await;
    worker.load(30, 100);
    eventually("the load report", || {
        router
            .load_of(w)
            .reported
            .is_some_and(|r| r.kv_used_blocks == 30)
    })
    .await;
    // The policy sees both signals, each from where it is true: the usage the engine
    // reported (its running requests hold 30 of 100 blocks) and the fullness of its
    // cache, which the router's index knows (4 blocks held of 100).
    let (candidates, _) = router.explain(64, &hashes(&[2, 3]));
    let row = candidates.row(0);
    assert_eq!(row.kv_usage, Some(0.3));
    assert_eq!(row.cache_fullness, Some(0.04));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_gap_forces_a_resync_that_matches_the_worker() {
    let worker = EventServer::start(&[1]).await;
    let (router, _client) = router(vec![instance(7, Some(worker.url.clone()))]);
    let w = InstanceId(7);
    eventually("the snapshot", || {
        router.cached_block_list(w) == hashes(&[1])
    })
    .await;
    // Block 9's event never reaches the router; the next one arrives with a gap.
    worker.lose_an_event_then_store(&[9], &[10]);
    eventually("the resync", || {
        router.cached_block_list(w) == hashes(&worker.blocks())
    })
    .await;
    assert_eq!(router.cached_block_list(w), hashes(&[1, 9, 10]));
    assert!(router.event_stats().gaps.load(Ordering::Relaxed) >= 1);
    assert!(worker.connections.load(Ordering::SeqCst) >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_stream_reconnects_and_malformed_lines_are_skipped() {
    let worker = EventServer::start(&[1]).await;
    let (router, _client) = router(vec![instance(7, Some(worker.url.clone()))]);
    let w = InstanceId(7);
    eventually("the snapshot", || {
        router.cached_block_list(w) == hashes(&[1])
    })
    .await;

    worker.send_raw("this is not json\n");
    worker.send_raw("{\"type\":\"stored\",\"seq\":\"x\"}\n");
    worker.store(&[2]);
    eventually("the event after the garbage", || {
        router.cached_block_list(w) == hashes(&[1, 2])
    })
    .await;
    assert_eq!(router.event_stats().malformed.load(Ordering::Relaxed), 2);

    worker.disconnect_all();
    worker.store(&[3]); // made while nobody listens
    eventually("the reconnection", || {
        router.cached_block_list(w) == hashes(&[1, 2, 3])
    })
    .await;
    assert!(router.event_stats().connects.load(Ordering::Relaxed) >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_cost_sends_a_cached_prefix_to_its_worker_and_never_to_a_reported_down_one() {
    let tokens: Vec<u32> = (0..64 * 16).map(|i| (i * 7 + 3) % 50_000).collect();
    let prompt: Vec<u64> = BlockHasher::new(16, 0)
        .hashes(&tokens)
        .iter()
        .map(|h| h.0)
        .collect();
    let a = EventServer::start(&[]).await;
    let b = EventServer::start(&prompt).await;
    let c = EventServer::start(&prompt[..8]).await;
    let (router, client) = router(vec![
        instance(0xa, Some(a.url.clone())),
        instance(0xb, Some(b.url.clone())),
        instance(0xc, Some(c.url.clone())),
    ]);
    eventually("the snapshots", || {
        router.cached_blocks(InstanceId(0xb)) == 64 && router.cached_blocks(InstanceId(0xc)) == 8
    })
    .await;

    let routed = router.route(&tokens, None, &[]).unwrap();
    assert_eq!(routed.worker, InstanceId(0xb));
    assert_eq!(routed.decision.decider, Decider::Policy);
    assert_eq!(routed.overlap_blocks, 64);
    // The booking shows up as load on B.
    assert_eq!(router.load_of(InstanceId(0xb)).in_flight, 1);
    router.finish(routed.request);
    assert_eq!(router.load_of(InstanceId(0xb)).in_flight, 0);

    assert!(client.report_instance_down(InstanceId(0xb), "connection refused"));
    let next = router.route(&tokens, None, &[]).unwrap();
    assert_eq!(
        next.worker,
        InstanceId(0xc),
        "the next best cache holder, never B"
    );
    router.finish(next.request);

    // Retries exclude the workers that already failed this request.
    let retry = router.route(&tokens, None, &[InstanceId(0xc)]).unwrap();
    assert_eq!(retry.worker, InstanceId(0xa));
    let err = router
        .route(&tokens, None, &[InstanceId(0xa), InstanceId(0xc)])
        .unwrap_err();
    assert!(
        matches!(err, RouteError::NoInstances { excluded: 2, .. }),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_without_events_get_caches_predicted_from_decisions() {
    // Workers without an event stream: the router predicts their caches.
    let (router, _client) = router((1..=4).map(|i| instance(i, None)).collect());
    let tokens: Vec<u32> = (0..40 * 16).collect();
    let first = router.route(&tokens, None, &[]).unwrap();
    assert_eq!(first.overlap_blocks, 0);
    router.finish(first.request);
    let second = router.route(&tokens, None, &[]).unwrap();
    assert_eq!(second.worker, first.worker);
    assert_eq!(second.overlap_blocks, 40);
}

/// `explain` decides as routing would but routes nothing: it is not counted among the
/// decisions made (`switchyard_decisions_total`, the policy's own count).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_explained_request_is_not_a_decision_made() {
    let (router, _client) = router((1..=2).map(|i| instance(i, None)).collect());
    let tokens: Vec<u32> = (0..4 * 16).collect();
    for _ in 0..3 {
        let (candidates, decision) = router.explain(64, &hashes(&[1, 2, 3, 4]));
        assert_eq!(candidates.len(), 2);
        assert!(matches!(
            decision.outcome,
            switchyard::policy::DecisionOutcome::Chosen(_)
        ));
    }
    let policy = router.policy();
    assert_eq!(
        (policy.totals().decisions, policy.status().decisions),
        (0, 0)
    );
    let routed = router.route(&tokens, None, &[]).unwrap();
    router.finish(routed.request);
    assert_eq!(
        (policy.totals().decisions, policy.status().decisions),
        (1, 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_available_instance_is_a_typed_error() {
    let (router, client) = router(vec![instance(1, None)]);
    client.report_instance_down(InstanceId(1), "test");
    let err = router.route(&[1, 2, 3], None, &[]).unwrap_err();
    assert!(
        matches!(err, RouteError::NoInstances { excluded: 0, .. }),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpredicted_cache_hits_are_counted_and_warned_about_once_however_many() {
    let (router, _client) = router(vec![instance(7, None)]);
    let block = 16u64;
    // Worst case: every response reports a cache the router did not predict.
    for _ in 0..10_000 {
        router.note_cache_report(0, 10 * block);
    }
    assert_eq!(router.unpredicted_cache_hits(), 10_000);
    assert_eq!(
        router.unpredicted_cache_warnings(),
        1,
        "rate-limited to one per 10 minutes"
    );
    // Small cached prefixes (under two blocks) and predicted hits are not evidence.
    router.note_cache_report(0, block);
    router.note_cache_report(3, 10 * block);
    assert_eq!(router.unpredicted_cache_hits(), 10_000);
}

/// A worker's feed task can be inside a write when the worker is removed (aborting a
/// task does not stop it mid-call): a batch that lands after the removal leaves nothing
/// of the worker behind — no blocks, no view, no capacity — and the others keep theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_landing_after_a_workers_removal_leaves_nothing_of_it() {
    use switchyard::kv::events::KvEvent;
    use switchyard::router::CacheView;
    let (gone, stays) = (InstanceId(1), InstanceId(2));
    let (router, client) = router(vec![instance(1, None), instance(2, None)]);
    let stored = |from: u64| KvEvent::Stored {
        seq: 0,
        parent: None,
        blocks: (from..from + 8).collect(),
    };
    router.apply_cache_event(gone, &stored(100));
    router.apply_cache_event(stays, &stored(200));
    assert_eq!(router.cached_blocks(gone), 8);
    client.apply(DiscoveryUpdate::Leave(gone));
    // The subscriber drops the worker's state once discovery no longer lists it.
    eventually("the removal applied", || router.cached_blocks(gone) == 0).await;
    // Then the batch its feed was applying lands.
    router.apply_cache_event(gone, &stored(300));
    assert_eq!(
        router.cached_blocks(gone),
        0,
        "a removed worker's blocks came back"
    );
    assert_eq!(router.cache_view(gone), CacheView::Approximate);
    assert_eq!(router.known_capacity(gone), None);
    assert_eq!(router.cached_blocks(stays), 8);
}

/// A publisher whose every stream opens with a sequence gap is resubscribed with
/// backoff, not in a tight loop: the subscriber's delays (20 ms doubling to 200 ms in
/// these tests) put at least 1.3 s between its first and tenth connection, where
/// resubscribing at once would take milliseconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_gaps_every_time_is_resubscribed_with_backoff() {
    let server = EventServer::start(&[1, 2]).await;
    server.gap_every_stream();
    let (router, _client) = router(vec![instance(1, Some(server.url.clone()))]);
    eventually("the first connection", || {
        server.connections.load(Ordering::SeqCst) >= 1
    })
    .await;
    let first = Instant::now();
    eventually("the tenth connection", || {
        server.connections.load(Ordering::SeqCst) >= 10
    })
    .await;
    let took = first.elapsed();
    // 20 + 40 + 80 + 160 + 200 × 5 ms of backoff between the first and the tenth.
    assert!(
        took >= Duration::from_millis(1300),
        "ten connections in {took:?}: no backoff"
    );
    assert!(router.event_stats().gaps.load(Ordering::Relaxed) >= 9);
}
