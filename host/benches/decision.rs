//! One full routing decision — hash a 1,024-token prompt, query the KV index (~1M cached
//! blocks), build the candidates with their load, and decide — at 8, 64 and 1,024
//! workers: through the Wasm `kv-cost` policy and through the same logic native, in one
//! run.
//!
//! Run: `cargo bench --bench decision` (prints a table).

mod common;

use common::Rng;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use switchyard::client::{Client, ClientConfig, HttpHealthCheck};
use switchyard::discovery::{DiscoveryUpdate, EndpointPath, InstanceInfo};
use switchyard::ids::InstanceId;
use switchyard::kv::events::KvEvent;
use switchyard::policy::{
    Decider, DecisionOutcome, PolicyEngine, PolicyHandle, Request, RuntimeConfig, native,
};
use switchyard::router::{KvRouter, KvRouterConfig};

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e6
}

fn main() {
    let quick = !std::env::args().any(|a| a == "--bench");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let _guard = runtime.enter();
    let engine = PolicyEngine::new(RuntimeConfig::default()).unwrap();
    let mut rng = Rng(11);
    let tokens: Vec<u32> = (0..1024).map(|_| (rng.next() % 100_000) as u32).collect();

    println!(
        "| workers | Wasm kv-cost p50 | p99 | native kv-cost p50 | p99 | Wasm / native (p50) |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: |");
    for workers in [8u64, 64, 1024] {
        let client = Client::new(
            EndpointPath::for_model("bench"),
            ClientConfig::default(),
            Arc::new(HttpHealthCheck::new(Duration::from_secs(1))),
        );
        client.apply(DiscoveryUpdate::Reset(
            (0..workers)
                .map(|i| InstanceInfo {
                    id: InstanceId(i),
                    endpoint: EndpointPath::for_model("bench"),
                    url: format!("http://127.0.0.1:{}", 10_000 + i),
                    model: "bench".into(),
                    block_size: 16,
                    events_url: None,
                    engine_events: None,
                    health_path: "/health".into(),
                    registration: 1,
                })
                .collect(),
        ));
        let policy = Arc::new(
            PolicyHandle::new(engine.clone(), engine.load_spec("kv-cost", "{}").unwrap()).unwrap(),
        );
        let router = KvRouter::new(client, policy.clone(), KvRouterConfig::new(16));
        // ~1M cached blocks over the workers, plus the prompt's prefix on a few.
        let per_worker = (1usize << 20) / workers as usize;
        for w in 0..workers {
            let mut left = per_worker;
            while left > 0 {
                let n = left.min(64);
                let blocks = (0..n).map(|_| rng.next()).collect();
                router.apply_cache_event(
                    InstanceId(w),
                    &KvEvent::Stored {
                        seq: 0,
                        parent: None,
                        blocks,
                    },
                );
                left -= n;
            }
        }
        let prompt: Vec<u64> = router
            .hasher()
            .hashes(&tokens)
            .iter()
            .map(|h| h.0)
            .collect();
        router.apply_cache_event(
            InstanceId(3 % workers),
            &KvEvent::Stored {
                seq: 0,
                parent: None,
                blocks: prompt.clone(),
            },
        );
        router.apply_cache_event(
            InstanceId(5 % workers),
            &KvEvent::Stored {
                seq: 0,
                parent: None,
                blocks: prompt[..32].to_vec(),
            },
        );

        let iters = if quick { 10 } else { 20_000 };
        let config = native::Config::default();
        let measure = |wasm: bool| {
            let mut times = Vec::with_capacity(iters);
            for i in 0..iters {
                let t = Instant::now();
                let hashes = router.hasher().hashes(black_box(&tokens));
                let (candidates, _) = router.candidates(&hashes, &[]);
                let req = Request {
                    prompt_tokens: 1024,
                    prompt_blocks: hashes.len() as u32,
                    block_size: 16,
                    seed: i as u64 + 1,
                    ..Default::default()
                };
                let chosen = if wasm {
                    let d = policy.decide(req, &candidates);
                    assert_eq!(d.decider, Decider::Policy);
                    match d.outcome {
                        DecisionOutcome::Chosen(id) => id,
                        other => panic!("{other:?}"),
                    }
                } else {
                    native::choose(&config, &req, &candidates).unwrap()
                };
                times.push(t.elapsed());
                black_box(chosen);
            }
            times.sort();
            (percentile(&times, 0.5), percentile(&times, 0.99))
        };
        let (wasm50, wasm99) = measure(true);
        let (nat50, nat99) = measure(false);
        println!(
            "| {workers} | {wasm50:.2} µs | {wasm99:.2} µs | {nat50:.2} µs | {nat99:.2} µs | {:.2} |",
            wasm50 / nat50
        );
    }
}
