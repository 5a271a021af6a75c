//! The router core embedded without Switchyard's front door: another server (a gateway's
//! endpoint picker, a selection service) builds a `Client` from its own view of the
//! fleet, answers health checks its own way, and asks a `KvRouter` where each request
//! goes. Nothing here starts an HTTP server or reads etcd; this crate does not depend
//! on the one that would.

use std::sync::Arc;

use switchyard_discovery::{DiscoveryUpdate, EndpointPath, InstanceInfo};
use switchyard_ids::InstanceId;
use switchyard_policy::{PolicyEngine, PolicyHandle, RuntimeConfig};
use switchyard_router::client::{Client, ClientConfig, HealthCheck, HealthError, OutlierConfig};
use switchyard_router::{KvRouter, KvRouterConfig, RouteError};

const BLOCK: u32 = 16;

/// The embedder's own health verdict. Here every probe fails, so a worker reported down
/// stays out for the whole test.
struct NeverBack;

#[async_trait::async_trait]
impl HealthCheck for NeverBack {
    async fn check(&self, _: &InstanceInfo) -> Result<(), HealthError> {
        Err(HealthError::Unhealthy("not back".into()))
    }
}

fn worker(id: u64) -> InstanceInfo {
    // Never contacted: the core only decides.
    let url = format!("http://192.0.2.{id}:8000");
    InstanceInfo::new(
        InstanceId(id),
        EndpointPath::for_model("m"),
        url,
        "m",
        BLOCK,
    )
}

fn embedded_router(workers: &[u64]) -> (Arc<KvRouter>, Arc<Client>) {
    let client = Client::new(
        EndpointPath::for_model("m"),
        ClientConfig {
            // Health is probed only to re-admit a worker reported down.
            outlier: OutlierConfig {
                health_interval: None,
                ..OutlierConfig::default()
            },
            ..ClientConfig::default()
        },
        Arc::new(NeverBack),
    );
    client.apply(DiscoveryUpdate::Reset(
        workers.iter().map(|&id| worker(id)).collect(),
    ));
    let engine = PolicyEngine::new(RuntimeConfig {
        cache_dir: None,
        ..RuntimeConfig::default()
    })
    .unwrap();
    let policy = engine.load_spec("kv-cost", "{}").unwrap();
    let policy = Arc::new(PolicyHandle::new(engine, policy).unwrap());
    let router = Arc::new(KvRouter::new(
        client.clone(),
        policy,
        KvRouterConfig::new(BLOCK),
    ));
    (router, client)
}

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
