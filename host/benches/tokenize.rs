//! Router CPU spent tokenizing prompts: a trace's prompts, in arrival order, through the
//! router's tokenizer with a conversation's earlier tokens reused and without.
//!
//! Run: `cargo bench --bench tokenize [-- TRACE.jsonl [TOKENIZER.json]]` (prints a table).
//! Without a trace it generates `switchyard trace-gen`'s default chat trace; without a
//! `tokenizer.json`, the built-in tokenizer. `tools/bpe-tokenizer.sh` writes a byte-level
//! BPE one.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use switchyard::replay::synth::{SynthConfig, generate};
use switchyard::replay::trace::{self, TraceRequest};
use switchyard::tokens::{PrefixTokenizer, Tokenizer, prefix::DEFAULT_BUDGET_TOKENS};

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let reqs: Vec<TraceRequest> = match args.first() {
        Some(path) => trace::read(&PathBuf::from(path)).expect("trace"),
        None => generate(&SynthConfig::default())
            .into_iter()
            .map(|r| TraceRequest {
                timestamp: r.timestamp,
                input_length: r.input_length,
                output_length: r.output_length,
                hash_ids: r.hash_ids,
            })
            .collect(),
    };
    let tokenizers: Vec<(&str, Tokenizer)> = match args.get(1) {
        Some(path) => {
            let path = PathBuf::from(path);
            vec![
                (
                    "tokenizers crate",
                    Tokenizer::crate_only(&path).expect("tokenizer"),
                ),
                ("lean", Tokenizer::from_file(&path).expect("tokenizer")),
            ]
        }
        None => vec![("built-in", Tokenizer::builtin())],
    };
    let prompts: Vec<String> = reqs.iter().map(trace::text).collect();
    let bytes: usize = prompts.iter().map(String::len).sum();
    println!(
        "{} prompts, {:.1} MiB of text, tokenizer {}",
        prompts.len(),
        bytes as f64 / f64::from(1 << 20),
        args.get(1).map_or("built-in", String::as_str)
    );
    println!(
        "| path | prompts | tokens | per request: mean | p50 | p99 | max | MiB/s of prompt | reuse hits |"
    );
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let runs = tokenizers.into_iter().flat_map(|(name, t)| {
        let t = Arc::new(t);
        [
            ("whole", 0),
            ("reusing earlier turns", DEFAULT_BUDGET_TOKENS),
        ]
        .map(|(label, budget)| (name, label, PrefixTokenizer::new(t.clone(), budget)))
    });
    for (name, label, t) in runs {
        let mut times = Vec::with_capacity(prompts.len());
        let mut tokens = 0usize;
        let start = Instant::now();
        for p in &prompts {
            let t0 = Instant::now();
            tokens += std::hint::black_box(t.encode(p).expect("encode")).len();
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        let total = start.elapsed().as_secs_f64();
        times.sort_by(f64::total_cmp);
        let q = |f: f64| times[((times.len() - 1) as f64 * f) as usize];
        let stats = t.stats();
        println!(
            "| {name} | {label} | {tokens} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {:.1} | {} of {} |",
            total * 1e3 / times.len() as f64,
            q(0.5),
            q(0.99),
            q(1.0),
            bytes as f64 / f64::from(1 << 20) / total,
            stats.hits,
            stats.hits + stats.misses,
        );
    }
}
