//! In-process KV routers and mock workers for the tests that drive them directly.

use std::sync::Arc;
use std::time::Duration;

use switchyard::client::Client;
use switchyard::policy::{PolicyEngine, PolicyHandle};
use switchyard::router::subscriber::{self, SubscriberConfig};
use switchyard::router::{KvRouter, KvRouterConfig};
use switchyard::worker::{
    DEFAULT_MAX_BATCHED_TOKENS, EngineConfig, FaultConfig, MockWorkerConfig, TimingModel,
};

/// A router for `client`'s endpoint deciding with the built-in kv-cost policy.
pub fn kv_cost_router(client: Arc<Client>, block_size: u32) -> Arc<KvRouter> {
    kv_cost_router_with(client, KvRouterConfig::new(block_size))
}

/// A kv-cost router with its own configuration.
pub fn kv_cost_router_with(client: Arc<Client>, config: KvRouterConfig) -> Arc<KvRouter> {
    let engine = PolicyEngine::new(super::runtime()).unwrap();
    let policy = Arc::new(
        PolicyHandle::new(engine.clone(), engine.load_spec("kv-cost", "{}").unwrap()).unwrap(),
    );
    Arc::new(KvRouter::new(client, policy, config))
}

/// Follows `router`'s workers' KV events, reconnecting quickly (tests break streams on
/// purpose).
pub fn follow_events(router: &Arc<KvRouter>) {
    subscriber::spawn(
        router,
        SubscriberConfig {
            backoff_initial: Duration::from_millis(20),
            backoff_max: Duration::from_millis(200),
            idle_timeout: Duration::from_secs(5),
        },
    );
}

/// A mock worker serving `mock` with `kv_blocks` blocks of 16 tokens, 1,000× faster than
/// real time.
pub fn mock_worker_config(kv_blocks: usize) -> MockWorkerConfig {
    MockWorkerConfig {
        model: "mock".into(),
        engine: EngineConfig {
            block_size: 16,
            kv_blocks,
            max_batch: 8,
            speedup: 1000.0,
            max_batched_tokens: DEFAULT_MAX_BATCHED_TOKENS,
            max_model_len: None,
            eos_period: 0,
            stream_interval: 1,
            timing: TimingModel::default(),
        },
        hash_seed: 0,
        fault: FaultConfig::NONE,
        tokenizer: None,
        zmq_events: None,
        tls: None,
        chat: None,
        api_key: None,
        pd: Default::default(),
        lora_adapters: Vec::new(),
    }
}
