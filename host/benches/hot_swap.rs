//! B6: swap the policy repeatedly under load through the admin API: failed requests,
//! swap time (a cold compile of a never-seen policy, then cached swaps), and the policy
//! call time while swapping.
//!
//! Run: `cargo bench --bench hot_swap`

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, Full};
use switchyard::worker::{EngineConfig, FaultConfig, MockWorker, MockWorkerConfig, TimingModel};

const BODY: &str = r#"{"model":"mock","prompt":"swap under load, a short prompt","max_tokens":2}"#;

async fn put(c: &Http, url: &str, body: Vec<u8>) -> (bool, Duration) {
    let t = Instant::now();
    let req = hyper::Request::put(url)
        .header("authorization", "Bearer bench-admin-token")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let r = c.request(req).await.unwrap();
    let ok = r.status().is_success();
    let _ = r.into_body().collect().await;
    (ok, t.elapsed())
}

fn main() {
    let runtime = common::runtime(2);
    runtime.block_on(async {
        let swaps = if quick() { 6 } else { 200 };
        let mut workers = Vec::new();
        for _ in 0..3 {
            let engine = EngineConfig { block_size: 16, kv_blocks: 8192, max_batch: 64, speedup: 50.0, max_batched_tokens: switchyard::worker::DEFAULT_MAX_BATCHED_TOKENS, max_model_len: None, eos_period: 0, stream_interval: 1, timing: TimingModel::default() };
            let config = MockWorkerConfig { model: "mock".into(), engine, hash_seed: 0, fault: FaultConfig::NONE, tokenizer: None, zmq_events: None, tls: None, chat: None, api_key: None, pd: Default::default(), lora_adapters: Vec::new() };
            workers.push(MockWorker::bind(config, "127.0.0.1:0".parse().unwrap()).await.unwrap());
        }
        let cache = tempfile::tempdir().unwrap();
        let listen = format!("127.0.0.1:{}", free_port());
        let urls: Vec<String> = workers.iter().map(MockWorker::url).collect();
        let router = switchyard_with_cache(&["serve", "--listen", &listen, "--worker", &urls.join(","), "--model", "mock", "--kv-events", "true", "--admin-token", "bench-admin-token"], cache.path());
        let c = http();
        let url = format!("http://{listen}");
        wait_ok(&format!("{url}/ready")).await;
        let policy = format!("{url}/admin/endpoints/default/mock/generate/policy");
        let example = std::fs::read(env!("SWITCHYARD_SESSION_AFFINITY_WASM")).unwrap();

        // Cold: a policy this router (and its cache directory) has never compiled.
        let (ok, cold) = put(&c, &policy, example.clone()).await;
        assert!(ok, "the example policy was refused");

        let before = get_text(&c, &format!("{url}/metrics")).await;
        let stop = Arc::new(AtomicBool::new(false));
        let (c2, stop2, load_url) = (c.clone(), stop.clone(), format!("{url}/v1/completions"));
        let runner = tokio::spawn(async move { load(&c2, &load_url, BODY, 8, usize::MAX, Duration::from_secs(120), stop2).await });
        let mut times = Vec::new();
        let mut refused = 0;
        for i in 0..swaps {
            let (target, body) = match i % 3 {
                0 => (format!("{policy}?builtin=round-robin"), vec![]),
                1 => (policy.clone(), example.clone()),
                _ => (format!("{policy}?builtin=kv-cost"), vec![]),
            };
            let (ok, t) = put(&c, &target, body).await;
            refused += usize::from(!ok);
            times.push(t);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        stop.store(true, Ordering::Relaxed);
        let samples = runner.await.unwrap();
        let after = get_text(&c, &format!("{url}/metrics")).await;
        let ep = "{endpoint=\"default/mock/generate\"}";
        let calls = metric(&after, &format!("switchyard_policy_call_seconds_count{ep}")) - metric(&before, &format!("switchyard_policy_call_seconds_count{ep}"));
        // Decisions that found no idle instance (a fresh policy's pool not yet grown to the
        // concurrency): made by the fallback, never waiting for an instance.
        let no_warm = "switchyard_policy_fallbacks_total{endpoint=\"default/mock/generate\",reason=\"no_warm_instance\"}";
        let no_warm = metric(&after, no_warm) - metric(&before, no_warm);
        let secs = metric(&after, &format!("switchyard_policy_call_seconds_sum{ep}")) - metric(&before, &format!("switchyard_policy_call_seconds_sum{ep}"));
        times.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!("{swaps} swaps through the admin API (round-robin, session-affinity .wasm, kv-cost in turn) under 8 concurrent clients:");
        println!();
        println!("| requests | failed | swaps refused | cold swap (compile) | cached swap p50 | p99 | policy call mean during swaps | decided without a warm instance |");
        println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
        println!(
            "| {} | {} | {refused} | {:.1} ms | {:.2} ms | {:.2} ms | {:.2} µs | {no_warm} |",
            samples.len(),
            samples.iter().filter(|s| !s.ok).count(),
            ms(cold),
            ms(times[times.len() / 2]),
            ms(times[(times.len() - 1) * 99 / 100]),
            if calls > 0.0 { secs / calls * 1e6 } else { f64::NAN }
        );
        println!();
        println!("Swap times are the admin API's round trip: upload, load (compile or cache), configure, canary, swap.");
        drop(router);
        for w in workers {
            w.shutdown().await;
        }
    });
}
