//! B3: what the router adds. The same load — fixed concurrency, small non-streaming
//! requests — is sent to a zero-latency mock worker directly, then through `switchyard
//! serve` (a separate process, so its CPU time is its own), in one run. Then streams of
//! 200 tokens, of a short prompt and of a 4,000-token one, through three routers in
//! turns: the default, which can migrate them exactly (it asks the worker, vLLM by its
//! `/v1/models`, for token IDs and takes them out of every event), one that can migrate
//! them as text (`--migration-token-ids false`: it reads every event) and one with
//! `--migration-limit 0` (it passes bytes through). The router CPU per stream is what
//! watching a stream costs; the first event's size with and without the IDs, straight
//! from the worker, is what asking for them costs on the wire.
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

        // Streams: routers that migrate them exactly, as text, or not at all, in turns.
        let mut routers = Vec::new();
        let worker_url = worker.url();
        let setups: [&[&str]; 3] = [&[], &["--migration-token-ids", "false"], &["--migration-limit", "0"]];
        for extra in setups {
            let listen = format!("127.0.0.1:{}", free_port());
            let mut args = vec!["serve", "--listen", &listen, "--worker", &worker_url, "--model", "mock"];
            args.extend_from_slice(extra);
            let p = switchyard_with_cache(&args, cache.path());
            let url = format!("http://{listen}/v1/completions");
            wait_ok(&format!("http://{listen}/ready")).await;
            load(&c, &url, STREAM, concurrency, 20, limit, never.clone()).await;
            routers.push((p, url));
        }
        // The routers read the worker's `/v1/models` (vLLM) at their first engine scrape.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let long: &'static str = Box::leak(long_stream().into_boxed_str());
        let streams = if quick { 10 } else { 1000 };
        let mut cpu = [[Duration::ZERO; 3]; 2];
        let mut done = [[0usize; 3]; 2];
        for _round in 0..2 {
            for (k, body) in [STREAM, long].into_iter().enumerate() {
                for (i, (p, url)) in routers.iter().enumerate() {
                    let before = cpu_time(p.0.id());
                    let s = load(&c, url, body, concurrency, streams / 2, limit, never.clone()).await;
                    cpu[k][i] += cpu_time(p.0.id()) - before;
                    done[k][i] += ok(&s);
                }
            }
        }
        println!();
        println!("{streams} streams of 200 tokens per router and prompt at concurrency {concurrency}, in two turns each:");
        println!();
        println!("| router | streams ok (short, 4k prompt) | router CPU per stream, short prompt | 4,000-token prompt |");
        println!("| --- | ---: | ---: | ---: |");
        let names = ["default: exact migration (token IDs asked, taken out of every event)", "`--migration-token-ids false`: text migration (every event read)", "`--migration-limit 0` (bytes passed through)"];
        for (i, name) in names.iter().enumerate() {
            let per = |k: usize| cpu[k][i].as_secs_f64() * 1e6 / done[k][i].max(1) as f64;
            println!("| {name} | {}, {} | {:.0} µs | {:.0} µs |", done[0][i], done[1][i], per(0), per(1));
        }
        let first = |ids: bool| {
            let (c, url) = (c.clone(), format!("{worker_url}/v1/completions"));
            async move { first_event_bytes(&c, &url, long, ids).await }
        };
        println!();
        println!(
            "the 4,000-token prompt's first event, straight from the worker: {} bytes with the token IDs, {} without",
            first(true).await,
            first(false).await
        );
        drop(routers);
        worker.shutdown().await;
    });
}

/// A streamed completion of a 4,000-token prompt (the mock's built-in tokenizer: a word
/// and a space a token each).
fn long_stream() -> String {
    let prompt: Vec<String> = (0..2000).map(|i| format!("w{i}")).collect();
    serde_json::json!({"model": "mock", "prompt": prompt.join(" "), "max_tokens": 200, "stream": true,
        "stream_options": {"include_usage": true}})
    .to_string()
}

/// The size of the first event of `body`'s stream from `url`, asking for token IDs or not.
async fn first_event_bytes(c: &Http, url: &str, body: &str, ids: bool) -> usize {
    let mut v: serde_json::Value = serde_json::from_str(body).unwrap();
    v["return_token_ids"] = ids.into();
    let raw = post_text(c, url, &v.to_string()).await;
    raw.split("\n\n").next().map_or(0, str::len)
}
