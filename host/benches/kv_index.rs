//! KV overlap index throughput: stored blocks applied per second, and overlap queries for
//! a 64-block prompt at 8, 64 and 1,024 workers over an index of ~1M cached blocks.
//!
//! Run: `cargo bench --bench kv_index` (prints a table).

mod common;

use common::Rng;
use std::hint::black_box;
use std::time::{Duration, Instant};

use switchyard::ids::{BlockHash, InstanceId};
use switchyard::kv::index::OverlapIndex;

/// Median over `rounds` of the time per call of `f` (each round runs it `iters` times).
fn per_call(rounds: usize, iters: usize, mut f: impl FnMut()) -> Duration {
    let mut times: Vec<Duration> = (0..rounds)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed() / iters as u32
        })
        .collect();
    times.sort();
    times[rounds / 2]
}

const TOTAL_BLOCKS: usize = 1 << 20;

/// An index of ~1M blocks spread over `workers`, plus a 64-block prompt held in full by
/// `holders` of them.
fn build(workers: u64, holders: u64, rng: &mut Rng) -> (OverlapIndex, Vec<BlockHash>) {
    let mut index = OverlapIndex::new();
    let per_worker = TOTAL_BLOCKS / workers as usize;
    let mut chain = Vec::with_capacity(64);
    for w in 0..workers {
        let mut left = per_worker;
        while left > 0 {
            let n = left.min(64);
            chain.clear();
            chain.extend((0..n).map(|_| BlockHash(rng.next())));
            index.stored(InstanceId(w), &chain);
            left -= n;
        }
    }
    let prompt: Vec<BlockHash> = (0..64).map(|_| BlockHash(rng.next())).collect();
    for w in 0..holders {
        index.stored(InstanceId(w), &prompt);
    }
    (index, prompt)
}

fn main() {
    // `cargo bench` passes `--bench`; anything else (e.g. `cargo test --benches`) just
    // checks that this runs.
    let quick = !std::env::args().any(|a| a == "--bench");
    let mut rng = Rng(7);

    // Stored blocks per second: 64-block stored events into an index growing to 1M.
    let events: Vec<(InstanceId, Vec<BlockHash>)> = (0..TOTAL_BLOCKS / 64)
        .map(|i| {
            (
                InstanceId(i as u64 % 64),
                (0..64).map(|_| BlockHash(rng.next())).collect(),
            )
        })
        .collect();
    let rate = |events: &[(InstanceId, Vec<BlockHash>)]| {
        let mut best = Duration::MAX;
        for _ in 0..if quick { 1 } else { 5 } {
            let mut index = OverlapIndex::new();
            let t = Instant::now();
            for (w, blocks) in events {
                index.stored(*w, blocks);
            }
            best = best.min(t.elapsed());
            black_box(&index);
        }
        TOTAL_BLOCKS as f64 / best.as_secs_f64()
    };
    let stored_per_sec = rate(&events);
    // The same, with hashes a worker ground to share their low 32 bits (a hash table
    // bucketing by the key's own bits would put them all in one probe sequence).
    let colliding: Vec<(InstanceId, Vec<BlockHash>)> = events
        .iter()
        .map(|(w, blocks)| {
            (
                *w,
                blocks
                    .iter()
                    .map(|b| BlockHash((b.0 << 32) | 0x5eed))
                    .collect(),
            )
        })
        .collect();
    let colliding_per_sec = rate(&colliding);

    println!(
        "| workers | index blocks | query: 64-block prompt held by 1 worker | held by every worker | miss on block 1 |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: |");
    for workers in [8u64, 64, 1024] {
        let (index, prompt) = build(workers, workers, &mut rng);
        let (single, single_prompt) = build(workers, 1, &mut rng);
        let miss: Vec<BlockHash> = (0..64).map(|_| BlockHash(rng.next())).collect();
        let (rounds, iters) = if quick { (1, 10) } else { (7, 20_000) };
        let mut sink = 0u64;
        let q_single = per_call(rounds, iters, || {
            single.overlaps(black_box(&single_prompt), |_, n| sink += u64::from(n))
        });
        let q_all = per_call(rounds, iters, || {
            index.overlaps(black_box(&prompt), |_, n| sink += u64::from(n))
        });
        let q_miss = per_call(rounds, iters, || {
            index.overlaps(black_box(&miss), |_, n| sink += u64::from(n))
        });
        black_box(sink);
        println!(
            "| {workers} | {} | {:.3} µs | {:.3} µs | {:.3} µs |",
            index.distinct_blocks(),
            q_single.as_secs_f64() * 1e6,
            q_all.as_secs_f64() * 1e6,
            q_miss.as_secs_f64() * 1e6
        );
    }
    println!();
    println!(
        "stored events: {:.2} M blocks/s (1,048,576 blocks in 64-block events over 64 workers, one core)",
        stored_per_sec / 1e6
    );
    println!(
        "the same with hashes sharing their low 32 bits: {:.2} M blocks/s",
        colliding_per_sec / 1e6
    );
}
