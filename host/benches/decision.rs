//! One full routing decision — hash a 1,024-token prompt, query the KV index (~1M cached
//! blocks), build the candidates with their load, and decide — at 8, 64 and 1,024
//! workers: through the Wasm `kv-cost` policy and through the same logic native, in one
//! run.
//!
//! Then the whole live path (`KvRouter::route`: candidates, decision, booking) at 64
//! workers with a shadow policy attached and without, interleaved in one run: what a
//! shadow costs the live path.
//!
//! Run: `cargo bench --bench decision` (prints two tables).

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
    let runtime = common::runtime(1);
    let _guard = runtime.enter();
    let engine = PolicyEngine::new(RuntimeConfig::default()).unwrap();
    let mut rng = Rng(11);
    let tokens: Vec<u32> = (0..1024).map(|_| (rng.next() % 100_000) as u32).collect();

    println!(
        "| workers | Wasm kv-cost p50 | p99 | native kv-cost p50 | p99 | Wasm / native (p50) |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut shadowed = None;
    for workers in [8u64, 64, 1024] {
        let client = Client::new(
            EndpointPath::for_model("bench"),
            ClientConfig::default(),
            Arc::new(HttpHealthCheck::new(Duration::from_secs(1))),
        );
        client.apply(DiscoveryUpdate::Reset(
            (0..workers)
                .map(|i| {
                    let url = format!("http://127.0.0.1:{}", 10_000 + i);
                    let endpoint = EndpointPath::for_model("bench");
                    InstanceInfo::new(InstanceId(i), endpoint, url, "bench", 16)
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
        if workers == 64 {
            shadowed = Some((router, engine.clone(), tokens.clone()));
        }
    }
    let (router, engine, tokens) = shadowed.expect("64 workers ran");
    shadow_cost(&router, &engine, &tokens, quick);
}

/// The live path with and without a shadow: blocks of decisions alternate between the
/// two, so that drift (frequency, other processes) falls on both alike.
fn shadow_cost(router: &KvRouter, engine: &PolicyEngine, tokens: &[u32], quick: bool) {
    let (blocks, per_block) = if quick { (2, 10) } else { (20, 1_000) };
    let mut without = Vec::new();
    let mut with = Vec::new();
    let mut looping = Vec::new();
    let route = |times: &mut Vec<Duration>| {
        for _ in 0..per_block {
            let t = Instant::now();
            let routed = router.route(black_box(tokens), None, &[]).unwrap();
            times.push(t.elapsed());
            router.finish(routed.request);
        }
    };
    // A test policy that behaves on its canary, then never returns: every call runs to
    // the call budget, so its queue fills and it drops nearly everything.
    let spin = std::path::Path::new(env!("SWITCHYARD_SPIN_FOREVER_WASM"));
    for _ in 0..blocks {
        route(&mut without);
        router
            .attach_shadow(engine.load_spec("round-robin", "{}").unwrap(), 1.0)
            .unwrap();
        route(&mut with);
        router
            .attach_shadow(engine.load_file(spin, r#"{"after": 1}"#).unwrap(), 1.0)
            .unwrap();
        route(&mut looping);
        router.detach_shadow();
    }
    let series = router.shadow_series().all();
    let tally_of = |name: &str| {
        series
            .iter()
            .find(|(label, _)| label.starts_with(name))
            .expect("the shadow ran")
            .1
            .tally()
    };
    let (tally, spun) = (tally_of("round-robin@"), tally_of("spin-forever@"));
    without.sort();
    with.sort();
    looping.sort();
    println!();
    println!("| live path (route), 64 workers | p50 | p99 | decisions |");
    println!("| --- | ---: | ---: | ---: |");
    for (name, t) in [
        ("no shadow", &without),
        ("round-robin shadow, every decision", &with),
        ("looping shadow (each call stopped at its budget)", &looping),
    ] {
        println!(
            "| {name} | {:.2} µs | {:.2} µs | {} |",
            percentile(t, 0.5),
            percentile(t, 0.99),
            t.len()
        );
    }
    println!(
        "\nshadow: {} offered, {} compared, {} dropped at its full queue, {} failed; its own call {:.2} µs mean",
        tally.offered,
        tally.compared,
        tally.dropped,
        tally.failures,
        tally.mean_call().map_or(0.0, |d| d.as_secs_f64() * 1e6)
    );
    println!(
        "looping shadow: {} offered, {} dropped at its full queue, {} calls stopped at the budget (the rest dropped undecided at each removal)",
        spun.offered, spun.dropped, spun.failures
    );
}
