//! Mutation fuzzing of every parser of outside input, on the pinned stable toolchain.
//!
//! Coverage-guided fuzzers (cargo-fuzz, AFL++) need a nightly compiler, and this project
//! builds with one pinned stable toolchain, nothing else; so each target here is a
//! property test driven by a small mutation engine: valid inputs the project generates
//! itself (its own encoders: engines' msgpack batches in all three shapes, NDJSON event
//! lines, OpenAI bodies, etcd gateway answers, engines' `/metrics` pages and `/v1/models`
//! answers, ZMTP streams, workers' SSE streams and their chunks, prefill workers' handoff
//! answers, the handoff fields of requests and clients' overload headers)
//! are the seed corpus, and each case applies 1–8 mutations (bit flips, interesting
//! integers, insertions, deletions, duplications, splices with another seed,
//! truncation). A target fails on a panic or on a broken property (a bound exceeded, a
//! round trip that does not hold), and prints the input that did it, which then goes
//! into [`REGRESSIONS`] once fixed.
//!
//! Run each with more cases than CI's (`SWITCHYARD_FUZZ_CASES`, default 2,000 per target;
//! the seed from `SWITCHYARD_FUZZ_SEED` for a different run):
//!
//! ```sh
//! SWITCHYARD_FUZZ_CASES=200000 cargo test --release --lib fuzz:: -- --nocapture --test-threads 1
//! ```

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Inputs that once broke a target, kept so that they never do again: `(target, hex)`.
/// Both were found by these targets run against the code before the bounds of
/// docs/architecture/input.md: `Retry-After: 1e20` panicked in
/// `Duration::from_secs_f64`, and any sequenced NDJSON line after one at `u64::MAX`
/// overflowed `last + 1`.
const REGRESSIONS: &[(&str, &str)] = &[
    ("retry-after", "31653230"),
    (
        "ndjson",
        "7b2274797065223a2273746f726564222c22736571223a352c22706172656e74223a312c22626c6f636b73223a5b322c335d7d",
    ),
];

/// SplitMix64: deterministic, seedable.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Integers that sit on boundaries parsers get wrong.
const INTERESTING: &[u64] = &[
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 62,
    i64::MAX as u64,
    i64::MIN as u64,
    u64::MAX,
];

/// Largest input a mutation may make.
const MAX_INPUT: usize = 64 << 10;

fn mutate(rng: &mut Rng, seed: &[u8], corpus: &[Vec<u8>]) -> Vec<u8> {
    let mut d = seed.to_vec();
    for _ in 0..1 + rng.below(8) {
        let len = d.len();
        match rng.below(8) {
            0 if len > 0 => {
                let i = rng.below(len);
                d[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                d[i] = [0u8, 0xff, 0x7f, 0x80, 0xc0, 0xc1, b'"', b'\n', b'{', b'['][rng.below(10)];
            }
            2 => {
                let i = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                d.splice(i..i, bytes);
            }
            3 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(32));
                d.drain(i..i + n);
            }
            4 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(64));
                let piece = d[i..i + n].to_vec();
                let at = rng.below(len + 1);
                d.splice(at..at, piece);
            }
            5 if !corpus.is_empty() => {
                let other = &corpus[rng.below(corpus.len())];
                let cut = rng.below(len + 1);
                let from = rng.below(other.len() + 1);
                d.truncate(cut);
                d.extend_from_slice(&other[from..]);
            }
            6 if len > 0 => d.truncate(rng.below(len)),
            7 if len >= 8 => {
                let i = rng.below(len - 7);
                let v = INTERESTING[rng.below(INTERESTING.len())];
                let bytes = if rng.below(2) == 0 {
                    v.to_be_bytes()
                } else {
                    v.to_le_bytes()
                };
                d[i..i + 8].copy_from_slice(&bytes);
            }
            _ => {}
        }
    }
    d.truncate(MAX_INPUT);
    d
}

/// A structure-aware mutation of a JSON seed: one value somewhere in it replaced by
/// another of an awkward kind (huge, negative, fractional or past-u64 numbers, long or
/// odd strings, wrong types, emptied or doubled arrays, a key dropped or added).
fn mutate_json(rng: &mut Rng, seed: &[u8]) -> Option<Vec<u8>> {
    use serde_json::Value;
    let mut v: Value = serde_json::from_slice(seed).ok()?;
    fn count(v: &Value) -> usize {
        1 + match v {
            Value::Array(a) => a.iter().map(count).sum(),
            Value::Object(o) => o.values().map(count).sum(),
            _ => 0,
        }
    }
    /// The `n`-th value in pre-order.
    fn nth<'a>(v: &'a mut Value, n: &mut usize) -> Option<&'a mut Value> {
        if *n == 0 {
            return Some(v);
        }
        *n -= 1;
        match v {
            Value::Array(a) => a.iter_mut().find_map(|x| nth(x, n)),
            Value::Object(o) => o.values_mut().find_map(|x| nth(x, n)),
            _ => None,
        }
    }
    let replacement = |rng: &mut Rng, old: &Value| -> Value {
        match rng.below(12) {
            0 => Value::from(INTERESTING[rng.below(INTERESTING.len())]),
            1 => Value::from(-(rng.next() as i64 >> rng.below(63))),
            2 => serde_json::from_str("18446744073709551616").expect("number"),
            3 => Value::from(1e308 * if rng.below(2) == 0 { 1.0 } else { -1.0 }),
            4 => Value::from(0.5),
            5 => Value::from("x".repeat(rng.below(5000))),
            6 => Value::from("\u{0}\n\"\\\u{202e}ünï"),
            7 => Value::Null,
            8 => Value::from(rng.below(2) == 0),
            9 => match old {
                Value::Array(a) => {
                    let mut a = a.clone();
                    a.extend(a.clone());
                    Value::Array(a)
                }
                _ => Value::Array(vec![old.clone(); 1 + rng.below(3)]),
            },
            10 => match old {
                Value::Object(o) => {
                    let mut o = o.clone();
                    if let Some(k) = o.keys().nth(rng.below(o.len().max(1))).cloned() {
                        o.remove(&k);
                    }
                    o.insert(format!("extra{}", rng.below(3)), Value::from(1));
                    Value::Object(o)
                }
                _ => Value::Object(serde_json::Map::new()),
            },
            _ => Value::Array(Vec::new()),
        }
    };
    for _ in 0..1 + rng.below(3) {
        let mut n = rng.below(count(&v));
        if let Some(node) = nth(&mut v, &mut n) {
            let new = replacement(rng, node);
            *node = new;
        }
    }
    serde_json::to_vec(&v).ok()
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}

/// Runs `check` on the seeds, the kept regressions and mutated cases (for JSON seeds,
/// half of them structure-aware); fails with the first inputs that panicked. `check`
/// says whether the parser accepted the input, to show how deep the cases went.
fn fuzz(name: &str, seeds: Vec<Vec<u8>>, json: bool, check: impl Fn(&[u8]) -> bool) {
    let cases: usize = std::env::var("SWITCHYARD_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000);
    let seed: u64 = std::env::var("SWITCHYARD_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed);
    let mut rng = Rng(seed
        ^ name
            .bytes()
            .fold(0u64, |h, b| h.wrapping_mul(31) ^ u64::from(b)));
    let mut crashes: Vec<String> = Vec::new();
    let accepted = std::cell::Cell::new(0usize);
    let run = |input: &[u8], crashes: &mut Vec<String>| {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(input)));
        if let Ok(true) = outcome {
            accepted.set(accepted.get() + 1);
        }
        if let Err(e) = outcome {
            let why = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            if crashes.len() < 3 {
                crashes.push(format!("{why}: {}", hex(input)));
            } else {
                crashes.push(String::new());
            }
        }
    };
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    for s in &seeds {
        run(s, &mut crashes);
    }
    for (_, input) in REGRESSIONS.iter().filter(|(t, _)| *t == name) {
        run(&unhex(input), &mut crashes);
    }
    for _ in 0..cases {
        let base = &seeds[rng.below(seeds.len())];
        let structured = if json && rng.below(2) == 0 {
            mutate_json(&mut rng, base)
        } else {
            None
        };
        let input = structured.unwrap_or_else(|| mutate(&mut rng, base, &seeds));
        run(&input, &mut crashes);
    }
    std::panic::set_hook(previous);
    println!(
        "fuzz {name:<14} {:>9} inputs ({} seeds), {:>9} accepted by the parser, {} crashes",
        cases + seeds.len(),
        seeds.len(),
        accepted.get(),
        crashes.len()
    );
    let shown: Vec<&String> = crashes.iter().filter(|c| !c.is_empty()).collect();
    assert!(
        crashes.is_empty(),
        "{name}: {} crashes, first: {shown:#?}",
        crashes.len()
    );
}

/// A byte stream that reads a script and discards what is written to it.
struct Script {
    input: Vec<u8>,
    at: usize,
}

impl AsyncRead for Script {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let n = buf.remaining().min(self.input.len() - self.at);
        let at = self.at;
        buf.put_slice(&self.input[at..at + n]);
        self.at += n;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Script {
    fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        Poll::Ready(Ok(b.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Seeds from text.
fn texts(seeds: &[&str]) -> Vec<Vec<u8>> {
    seeds.iter().map(|s| s.as_bytes().to_vec()).collect()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime")
}

mod streams;
mod targets;
