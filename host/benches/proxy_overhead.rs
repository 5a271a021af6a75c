//! B3: what the router adds. The same load — fixed concurrency, small non-streaming
//! requests — is sent to a zero-latency mock worker directly, then through `switchyard
//! serve` (a separate process, so its CPU time is its own), in one run. Then streams of
//! 200 tokens through two routers, one that can migrate them (the default: it reads
//! every event) and one with `--migration-limit 0` (it passes bytes through), in turns:
//! the router CPU per stream is what watching a stream costs.
//!
//! Run: `cargo bench --bench proxy_overhead`

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use common::*;
use switchyard::worker::{EngineConfig, FaultConfig, MockWorker, MockWorkerConfig, TimingModel};

const BODY: &str = r#"{"model":"mock","prompt":"Hello there, a short prompt.","max_tokens":1}"#;
const STREAM: &str = r#"{"model":"mock","prompt":"Hello there, a short prompt.","max_tokens":200,"stream":true,"stream_options":{"include_usage":true}}"#;

fn main() {
    let runtime = common::runtime(1);
    runtime.block_on(async {
        let quick = quick();
        let zero = TimingModel { prefill_us_per_token: 0.0, decode_base_us: 0.0, decode_us_per_seq: 0.0 };
        let worker = MockWorker::bind(
            MockWorkerConfig {
                model: "mock".into(),
                engine: EngineConfig { block_size: 16, kv_blocks: 1 << 16, max_batch: 256, speedup: 1.0, max_batched_tokens: 0, max_model_len: None, eos_period: 0, stream_interval: 1, timing: zero },
                hash_seed: 0,
                fault: FaultConfig::NONE,
                tokenizer: None,
                zmq_events: None, tls: None,
            chat: None,
            api_key: None,
            pd: Default::default(),
                lora_adapters: Vec::new(),
            },
            "127.0.0.1:0".parse().unwrap(),
        )
        .await
        .unwrap();
        let cache = tempfile::tempdir().unwrap();
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let router = switchyard_with_cache(&["serve", "--listen", &listen, "--worker", &worker.url(), "--model", "mock"], cache.path());
        let c = http();
        let router_url = format!("http://{listen}");
        wait_ok(&format!("{router_url}/ready")).await;

        let (concurrency, count) = if quick { (2, 50) } else { (8, 20_000) };
        let limit = Duration::from_secs(60);
        let never = Arc::new(AtomicBool::new(false));
        // Warm both paths (connections, policy instances).
        load(&c, &format!("{}/v1/completions", worker.url()), BODY, concurrency, 200, limit, never.clone()).await;
        load(&c, &format!("{router_url}/v1/completions"), BODY, concurrency, 200, limit, never.clone()).await;

        let t = std::time::Instant::now();
        let direct = load(&c, &format!("{}/v1/completions", worker.url()), BODY, concurrency, count, limit, never.clone()).await;
        let direct_wall = t.elapsed();
        let cpu_before = cpu_time(router.0.id());
        let t = std::time::Instant::now();
        let routed = load(&c, &format!("{router_url}/v1/completions"), BODY, concurrency, count, limit, never.clone()).await;
        let routed_wall = t.elapsed();
        let cpu = cpu_time(router.0.id()) - cpu_before;

        let ok = |s: &[Sample]| s.iter().filter(|x| x.ok).count();
        println!("{count} requests at concurrency {concurrency}, non-streaming, 1 output token, zero-latency mock worker:");
        println!();
        println!("| path | ok | failed | throughput | p50 | p99 |");
        println!("| --- | ---: | ---: | ---: | ---: | ---: |");
        for (name, s, wall) in [("direct to worker", &direct, direct_wall), ("through switchyard", &routed, routed_wall)] {
            println!(
                "| {name} | {} | {} | {:.0} req/s | {:.0} µs | {:.0} µs |",
                ok(s),
                s.len() - ok(s),
                ok(s) as f64 / wall.as_secs_f64(),
                percentile_us(s, 0.5),
                percentile_us(s, 0.99)
            );
        }
        println!();
        println!(
            "added by the router: p50 {:.0} µs, p99 {:.0} µs; router CPU {:.1} µs per request ({:.2} s over {} requests)",
            percentile_us(&routed, 0.5) - percentile_us(&direct, 0.5),
            percentile_us(&routed, 0.99) - percentile_us(&direct, 0.99),
            cpu.as_secs_f64() * 1e6 / ok(&routed).max(1) as f64,
            cpu.as_secs_f64(),
            ok(&routed)
        );
        drop(router);

        // Streams: a router that can migrate them beside one that cannot, in turns.
        let mut routers = Vec::new();
        let worker_url = worker.url();
        for extra in [&[][..], &["--migration-limit", "0"][..]] {
            let listen = format!("127.0.0.1:{}", free_port());
            let mut args = vec!["serve", "--listen", &listen, "--worker", &worker_url, "--model", "mock"];
            args.extend_from_slice(extra);
            let p = switchyard_with_cache(&args, cache.path());
            let url = format!("http://{listen}/v1/completions");
            wait_ok(&format!("http://{listen}/ready")).await;
            load(&c, &url, STREAM, concurrency, 20, limit, never.clone()).await;
            routers.push((p, url));
        }
        let streams = if quick { 10 } else { 1000 };
        let mut cpu = [Duration::ZERO; 2];
        let mut done = [0usize; 2];
        for _round in 0..2 {
            for (i, (p, url)) in routers.iter().enumerate() {
                let before = cpu_time(p.0.id());
                let s = load(&c, url, STREAM, concurrency, streams / 2, limit, never.clone()).await;
                cpu[i] += cpu_time(p.0.id()) - before;
                done[i] += ok(&s);
            }
        }
        println!();
        println!("{streams} streams of 200 tokens per router at concurrency {concurrency}, in two turns each:");
        println!();
        println!("| router | streams ok | router CPU per stream |");
        println!("| --- | ---: | ---: |");
        for (i, name) in ["migration on (default: every event read)", "`--migration-limit 0` (bytes passed through)"].iter().enumerate() {
            println!("| {name} | {} | {:.0} µs |", done[i], cpu[i].as_secs_f64() * 1e6 / done[i].max(1) as f64);
        }
        drop(routers);
        worker.shutdown().await;
    });
}
