//! The router core embedded without Switchyard's front door: another server (a gateway's
//! endpoint picker, a selection service) builds a `Client` from its own view of the
//! fleet, answers health checks its own way, and asks a `KvRouter` where each request
//! goes. Nothing here starts an HTTP server or reads etcd; this crate does not depend
//! on the one that would.

mod common;

use switchyard_ids::InstanceId;
use switchyard_router::RouteError;

use common::{BLOCK, embedded_router};

/// `blocks` full blocks of tokens that no other conversation shares.
fn conversation(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| seed * 100_000 + i).collect()
}

#[tokio::test]
async fn a_conversation_returns_to_the_worker_that_holds_its_prefix() {
    let (router, _client) = embedded_router(&[1, 2, 3]);
    let mut turn = conversation(7, 8);
    let first = router.route(&turn, None, &[]).unwrap();
    assert_eq!(first.overlap_blocks, 0);
    router.finish(first.request);
    for _ in 0..3 {
        // The next turn resends the history and adds to it.
        turn.extend(conversation(8, 2));
        let next = router.route(&turn, None, &[]).unwrap();
        assert_eq!(
            next.worker, first.worker,
            "the prefix's worker was passed over"
        );
        assert!(next.overlap_blocks >= 8, "overlap {}", next.overlap_blocks);
        router.finish(next.request);
    }
}

#[tokio::test]
async fn a_worker_reported_down_leaves_every_decision() {
    let (router, client) = embedded_router(&[1, 2, 3, 4]);
    let turn = conversation(3, 4);
    let first = router.route(&turn, None, &[]).unwrap();
    router.finish(first.request);
    assert!(client.report_instance_down(first.worker, "connection refused"));
    // Not even the conversation whose prefix it holds goes there now.
    let moved = router.route(&turn, None, &[]).unwrap();
    assert_ne!(moved.worker, first.worker);
    router.finish(moved.request);
    for seed in 10..30 {
        let routed = router.route(&conversation(seed, 2), None, &[]).unwrap();
        assert_ne!(routed.worker, first.worker);
        router.finish(routed.request);
    }
    // With the three others excluded (they failed this request), nothing is left.
    let others: Vec<InstanceId> = [1, 2, 3, 4]
        .map(InstanceId)
        .into_iter()
        .filter(|&w| w != first.worker)
        .collect();
    let err = router.route(&turn, None, &others).unwrap_err();
    assert!(matches!(err, RouteError::NoInstances { .. }), "{err}");
}
