//! One `choose` call through the policy runtime (warm instance from the pool, epoch
//! deadline, lowering the struct-of-arrays candidates, lifting and validating the
//! answer) against the same decision made by native `kv-cost`, at 8, 64 and 1,024
//! candidates.
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
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let engine = PolicyEngine::new(RuntimeConfig::default()).expect("engine");
    let kv_cost = engine.load_spec("kv-cost", "{}").expect("kv-cost");
    let round_robin = engine.load_spec("round-robin", "").expect("round-robin");
    let config = native::Config::default();
    let mut group = c.benchmark_group("choose");
    for n in [8u64, 64, 1024] {
        let cands = candidates(n);
        let mut req = Request {
            prompt_tokens: 1024,
            prompt_blocks: 64,
            block_size: 16,
            session_key: None,
            seed: 1,
            sequence: 0,
        };
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
}

#[allow(missing_docs)]
mod harness {
    criterion::criterion_group!(benches, super::bench);
}
criterion_main!(harness::benches);
