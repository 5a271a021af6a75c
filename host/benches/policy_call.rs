//! One `choose` call through the policy runtime (warm instance from the pool, epoch
//! deadline, lowering the struct-of-arrays candidates, lifting and validating the
//! answer) against the same decision made by native `kv-cost`, at 8, 64 and 1,024
//! candidates.
//!
//! The `choose-cold` group times one call after the caches were flushed (a 64 MiB
//! sweep) and the thread slept 1 ms, as a live router's calls are: between two
//! decisions the proxy, the relays and the other processes on the cores run, and the
//! instance's memory, the runtime's code and the branch predictors go cold.
//!
//! Run: `cargo bench --bench policy_call`

use criterion::{BenchmarkId, Criterion, criterion_main};
use std::hint::black_box;
use switchyard::ids::InstanceId;
use switchyard::policy::{CandidateRow, Candidates, PolicyEngine, Request, RuntimeConfig, native};

fn candidates(n: u64) -> Candidates {
    (0..n)
        .map(|i| CandidateRow {
            id: InstanceId(0x1000 + i),
            overlap_blocks: ((i * 7) % 64) as u32,
            active_blocks: ((i * 13) % 500) as u32,
            pending_prefill_tokens: ((i * 31) % 4) as u32 * 256,
            in_flight: (i % 9) as u32,
            kv_usage: Some(0.4),
            cache_fullness: Some(0.9),
            role: switchyard::ids::Role::Both,
            predicted_ttft_ms: Some(40.0 + (i % 4) as f32 * 50.0),
            predicted_tpot_ms: Some(10.0 + (i % 9) as f32),
        })
        .collect()
}

/// A 1,024-token prompt.
fn request() -> Request {
    Request {
        prompt_tokens: 1024,
        prompt_blocks: 64,
        block_size: 16,
        session_key: None,
        seed: 1,
        sequence: 0,
        decode_alone: false,
        max_tokens: Some(256),
        ttft_objective_ms: None,
        tpot_objective_ms: None,
    }
}

fn bench(c: &mut Criterion) {
    let engine = PolicyEngine::new(RuntimeConfig::default()).expect("engine");
    let kv_cost = engine.load_spec("kv-cost", "{}").expect("kv-cost");
    let round_robin = engine.load_spec("round-robin", "").expect("round-robin");
    let config = native::Config::default();
    let mut group = c.benchmark_group("choose");
    for n in [8u64, 64, 1024] {
        let cands = candidates(n);
        let mut req = request();
        group.bench_with_input(BenchmarkId::new("wasm-kv-cost", n), &cands, |b, cands| {
            b.iter(|| {
                req.seed = req.seed.wrapping_add(1);
                black_box(kv_cost.call(&req, cands).expect("call"))
            })
        });
        group.bench_with_input(
            BenchmarkId::new("wasm-round-robin", n),
            &cands,
            |b, cands| {
                b.iter(|| {
                    req.sequence += 1;
                    black_box(round_robin.call(&req, cands).expect("call"))
                })
            },
        );
        group.bench_with_input(BenchmarkId::new("native-kv-cost", n), &cands, |b, cands| {
            b.iter(|| {
                req.seed = req.seed.wrapping_add(1);
                black_box(native::choose(&config, &req, cands))
            })
        });
    }
    group.finish();

    // Criterion sizes its loops by the timed part alone, which would make these run
    // for hours (each call waits for a sweep and a sleep): a fixed count instead.
    let mut sweep = vec![0u8; 64 << 20];
    let mut cold = |call: &mut dyn FnMut()| {
        let mut took: Vec<f64> = (0..300)
            .map(|_| {
                for i in (0..sweep.len()).step_by(64) {
                    sweep[i] = sweep[i].wrapping_add(1);
                }
                black_box(&sweep);
                std::thread::sleep(std::time::Duration::from_millis(1));
                let started = std::time::Instant::now();
                call();
                started.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        took.sort_by(f64::total_cmp);
        (took[took.len() / 2], took[took.len() * 99 / 100])
    };
    println!("\nchoose-cold: one call after a 64 MiB cache sweep and a 1 ms sleep (300 calls)");
    println!("| policy | candidates | p50 | p99 |\n| --- | ---: | ---: | ---: |");
    for n in [4u64, 64] {
        let cands = candidates(n);
        let req = request();
        for (name, policy) in [
            ("wasm kv-cost", &kv_cost),
            ("wasm round-robin", &round_robin),
        ] {
            let (p50, p99) = cold(&mut || {
                black_box(policy.call(&req, &cands).expect("call"));
            });
            println!("| {name} | {n} | {p50:.2} µs | {p99:.2} µs |");
        }
        let (p50, p99) = cold(&mut || {
            black_box(native::choose(&config, &req, &cands));
        });
        println!("| native kv-cost | {n} | {p50:.2} µs | {p99:.2} µs |");
    }
}

#[allow(missing_docs)]
mod harness {
    criterion::criterion_group!(benches, super::bench);
}
criterion_main!(harness::benches);
