//! An embedded router core over a fleet it never contacts: the core only decides.

#![allow(dead_code)]

use std::sync::Arc;

use switchyard_discovery::{DiscoveryUpdate, EndpointPath, InstanceInfo};
use switchyard_ids::InstanceId;
use switchyard_policy::{PolicyEngine, PolicyHandle, RuntimeConfig};
use switchyard_router::client::{Client, ClientConfig, HealthCheck, HealthError, OutlierConfig};
use switchyard_router::{KvRouter, KvRouterConfig};

pub const BLOCK: u32 = 16;

/// The embedder's own health verdict. Here every probe fails, so a worker reported down
/// stays out for the whole test.
struct NeverBack;

#[async_trait::async_trait]
impl HealthCheck for NeverBack {
    async fn check(&self, _: &InstanceInfo) -> Result<(), HealthError> {
        Err(HealthError::Unhealthy("not back".into()))
    }
}

pub fn worker(id: u64) -> InstanceInfo {
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

/// A router with kv-cost on its defaults over workers 1..=n of `workers`.
pub fn embedded_router(workers: &[u64]) -> (Arc<KvRouter>, Arc<Client>) {
    let infos: Vec<InstanceInfo> = workers.iter().map(|&id| worker(id)).collect();
    router_over(infos, "{}", KvRouterConfig::new(BLOCK))
}

/// A router with kv-cost configured by `policy_config` over `workers`.
pub fn router_over(
    workers: Vec<InstanceInfo>,
    policy_config: &str,
    config: KvRouterConfig,
) -> (Arc<KvRouter>, Arc<Client>) {
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
    client.apply(DiscoveryUpdate::Reset(workers));
    let engine = PolicyEngine::new(RuntimeConfig {
        cache_dir: None,
        ..RuntimeConfig::default()
    })
    .unwrap();
    let policy = engine.load_spec("kv-cost", policy_config).unwrap();
    let policy = Arc::new(PolicyHandle::new(engine, policy).unwrap());
    let router = Arc::new(KvRouter::new(client.clone(), policy, config));
    (router, client)
}
