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
/// ARCHITECTURE.md's "Input from outside": `Retry-After: 1e20` panicked in
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

mod targets {
    use super::*;
    use crate::kv::engine_events::{self, EventOut, Shape, StoredOut};
    use crate::kv::events::KvEvent;
    use crate::router::zmtp::{self, Connection, Limits, SocketType};

    fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
        let mut f = Vec::new();
        if body.len() < 256 {
            f.extend_from_slice(&[flags, body.len() as u8]);
        } else {
            f.push(flags | 0x02);
            f.extend_from_slice(&(body.len() as u64).to_be_bytes());
        }
        f.extend_from_slice(body);
        f
    }

    fn batches() -> Vec<Vec<u8>> {
        let tokens: Vec<u32> = (0..32).collect();
        let hashes = [11u64, 12, u64::MAX - 1, 1 << 63];
        let mut out = Vec::new();
        for shape in [Shape::VllmMap, Shape::VllmArray, Shape::Sglang] {
            let stored = EventOut::Stored(StoredOut {
                hashes: &hashes,
                parent: Some(7),
                token_ids: &tokens,
                block_size: 8,
                lora_name: Some("adapter"),
                cache_salt: None,
                ..Default::default()
            });
            let first = EventOut::Stored(StoredOut {
                hashes: &hashes[..1],
                token_ids: &tokens[..8],
                block_size: 8,
                cache_salt: Some("tenant"),
                ..Default::default()
            });
            out.push(engine_events::encode_batch(
                shape,
                1.5,
                0,
                &[
                    first,
                    stored,
                    EventOut::Removed(&hashes[1..]),
                    EventOut::Cleared,
                ],
            ));
            out.push(engine_events::encode_batch(
                shape,
                2.0,
                3,
                &[EventOut::Other("X")],
            ));
        }
        out
    }

    /// ZMTP as the router reads it: a publisher's greeting, READY and messages (data,
    /// PING, long frames); bounds small enough for the fuzzer to cross them.
    #[test]
    fn zmtp_streams() {
        let limits = Limits {
            max_frame: 4096,
            max_frames: 4,
            max_message: 6000,
            max_command: 512,
            ..zmtp::KV_EVENT_LIMITS
        };
        let hello = zmtp::hello(b"PUB");
        let mut seeds = Vec::new();
        let mut m = hello.clone();
        m.extend(frame(0x01, b"kv-events"));
        m.extend(frame(0x01, &7u64.to_be_bytes()));
        m.extend(frame(0x00, &batches()[0]));
        seeds.push(m);
        let mut m = hello.clone();
        let mut ping = vec![4];
        ping.extend_from_slice(b"PING\x00\x0actx");
        m.extend(frame(0x04, &ping));
        m.extend(frame(0x00, &[0x55; 300]));
        seeds.push(m);
        let rt = runtime();
        fuzz("zmtp", seeds, false, |input| {
            rt.block_on(async {
                let script = Script {
                    input: input.to_vec(),
                    at: 0,
                };
                let Ok(mut c) = Connection::handshake(script, SocketType::Sub, limits).await else {
                    return false;
                };
                let mut messages = 0;
                for _ in 0..64 {
                    let Ok(msg) = c.recv().await else { break };
                    messages += 1;
                    assert!(msg.len() <= limits.max_frames, "{} frames", msg.len());
                    let total: usize = msg.iter().map(|f| f.len()).sum();
                    assert!(total as u64 <= limits.max_message, "{total} bytes");
                }
                messages > 0
            })
        });
    }

    /// Engines' msgpack batches (vLLM's two shapes and SGLang's), decoded and applied to
    /// a worker's view with a small entry bound.
    #[test]
    fn engine_batches() {
        fuzz("engine-batch", batches(), false, |input| {
            let Ok(batch) = engine_events::decode_batch(input) else {
                return false;
            };
            let mut view = crate::kv::engine_view::EngineView::new(8, 0, 256, 4);
            let rank = batch.rank.unwrap_or(0);
            let _ = view.apply(rank, 0, batch.ts, &batch.events);
            let _ = view.apply(rank, 1, batch.ts, &batch.events);
            assert!(view.held() <= 256 + 64, "{} held", view.held());
            true
        });
    }

    /// Switchyard's NDJSON event lines: parsed, sequence-checked, and a parsed line
    /// survives a round trip.
    #[test]
    fn ndjson_lines() {
        let events = crate::kv::events::samples();
        let seeds = events
            .iter()
            .map(|e| serde_json::to_vec(e).expect("serialises"))
            .collect();
        fuzz("ndjson", seeds, true, |input| {
            let Ok(e) = serde_json::from_slice::<KvEvent>(input) else {
                return false;
            };
            for last in [None, Some(0), Some(u64::MAX), e.seq()] {
                let _ = crate::kv::events::check_seq(last, &e);
            }
            let again: KvEvent =
                serde_json::from_slice(&serde_json::to_vec(&e).expect("serialises"))
                    .expect("round trip");
            assert_eq!(again, e);
            true
        });
    }

    /// OpenAI request bodies, both APIs, and the chat messages rendered and tokenized
    /// as the router does.
    #[test]
    fn openai_bodies() {
        use crate::openai::Api;
        let seeds = texts(&[
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"},{"type":"text","text":"there"}]}],"stream":true,"max_tokens":5,"user":"u1"}"#,
            r#"{"model":"m","prompt":"once upon a time","max_tokens":3,"cache_salt":"t1"}"#,
            r#"{"model":"m","prompt":[1,2,3,4294967295],"stream":false}"#,
            r#"{"model":"m","prompt":["a","b"]}"#,
        ]);
        let tokenizer = crate::tokens::PrefixTokenizer::new(
            std::sync::Arc::new(crate::tokens::Tokenizer::builtin()),
            1 << 16,
        );
        fuzz("openai", seeds, true, |input| {
            let mut accepted = false;
            for api in [Api::Chat, Api::Completions] {
                let Ok(req) = crate::openai::parse(api, input) else {
                    continue;
                };
                accepted = true;
                if let crate::openai::Prompt::Chat(m) = &req.prompt
                    && let Ok(text) = tokenizer.render_chat(m)
                {
                    let _ = tokenizer.encode(&text);
                }
                // A migrated stream's continuation of it is a request the same parser
                // takes, asking for what was left, ending with the answer so far.
                let answer = "lorem ipsum ";
                if let Some(Ok(next)) = crate::http::proxy::continuation_of(api, input, answer, 1) {
                    let cont = crate::openai::parse(api, &next).expect("a continuation parses");
                    // The limit left: one less than asked (or than a completion's
                    // default); a chat that named none names none (the rest of its
                    // context, as the engine counts it).
                    let limit = req.limit(api);
                    assert_eq!(cont.max_tokens, limit.map(|m| m - 1));
                    match (&cont.prompt, &req.prompt) {
                        (crate::openai::Prompt::Chat(m), _) => {
                            assert!(cont.continue_final_message);
                            let last = m.last().expect("messages");
                            assert!(last.role == "assistant" && last.content.ends_with(answer));
                        }
                        (crate::openai::Prompt::Text(t), crate::openai::Prompt::Text(was)) => {
                            assert_eq!(*t, format!("{was}{answer}"));
                        }
                        (p, was) => panic!("{p:?} continued from {was:?}"),
                    }
                }
            }
            accepted
        });
    }

    /// etcd gateway answers: ranges and watch lines.
    #[test]
    fn etcd_answers() {
        let seeds = texts(&[
            r#"{"header":{"revision":"42"},"kvs":[{"key":"c3cvaW5zdGFuY2VzL2E=","value":"e30=","create_revision":"3","mod_revision":"40","lease":"7587"}],"count":"1"}"#,
            r#"{"result":{"header":{"revision":"43"},"events":[{"kv":{"key":"YQ==","value":"Yg==","mod_revision":"43"}},{"type":"DELETE","kv":{"key":"Yw==","mod_revision":"43"}}]}}"#,
            r#"{"result":{"header":{"revision":"9"},"watch_id":"-1"}}"#,
            r#"{"result":{"canceled":true,"compact_revision":"12","cancel_reason":"compacted"}}"#,
            r#"{"error":{"grpc_code":14,"message":"unavailable"}}"#,
        ]);
        fuzz("etcd", seeds, true, |input| {
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(input) else {
                return false;
            };
            let range = crate::discovery::etcd_api::range_answer(&v);
            let watch = crate::discovery::etcd_api::watch_answer(&v);
            range.is_ok_and(|(kvs, _)| !kvs.is_empty()) || watch.is_ok_and(|e| !e.is_empty())
        });
    }

    /// Engines' `/metrics` pages (vLLM's and SGLang's names).
    #[test]
    fn engine_metrics_pages() {
        let seeds = texts(&[
            "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 3.0\nvllm:num_requests_waiting{model_name=\"m\"} 1\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\nvllm:cache_config_info{num_gpu_blocks=\"2048\",block_size=\"16\"} 1.0\n",
            "sglang:num_running_reqs 2\nsglang:num_queue_reqs 0\nsglang:token_usage 0.5\nsglang:max_total_num_tokens 65536\n",
        ]);
        fuzz("metrics", seeds, false, |input| {
            let text = String::from_utf8_lossy(input);
            let mut accepted = false;
            for block_size in [0, 1, 16] {
                accepted |= crate::kv::engine_metrics::parse(&text, block_size).is_some();
            }
            accepted
        });
    }

    /// Engines' `/v1/models` answers, read for their context length.
    #[test]
    fn models_answers() {
        let seeds = texts(&[
            r#"{"object":"list","data":[{"id":"m","object":"model","max_model_len":32768,"owned_by":"vllm"}]}"#,
            r#"{"object":"list","data":[{"id":"other","max_model_len":4096},{"id":"m","max_model_len":131072}]}"#,
        ]);
        fuzz("models", seeds, true, |input| {
            let Some(n) = crate::kv::engine_metrics::max_model_len(input, "m") else {
                return false;
            };
            assert!(n > 0);
            true
        });
    }

    /// `Retry-After` values: absent unless a finite, non-negative number; never a panic
    /// however large.
    #[test]
    fn retry_after_headers() {
        let seeds = texts(&[
            "5",
            "0",
            "1e20",
            "18446744073709551616",
            "-1",
            "NaN",
            "inf",
            " 2.5 ",
        ]);
        fuzz("retry-after", seeds, false, |input| {
            let text = String::from_utf8_lossy(input);
            let Some(d) = crate::http::proxy::parse_retry_after(text.trim()) else {
                return false;
            };
            let secs: f64 = text.trim().parse().expect("only numbers are read");
            assert!(secs.is_finite() && secs >= 0.0);
            assert!(d == std::time::Duration::MAX || d.as_secs_f64() <= secs * 1.000_001 + 1e-9);
            true
        });
    }

    /// A client's overload headers (class, tenant, deadline, API key), each line of the
    /// input one header's value: never a panic; a known class, a deadline within the
    /// cap, a tenant key of at most 64 bytes that never holds the API key.
    #[test]
    fn overload_headers() {
        use crate::http::queue::classes::OverloadConfig;
        use std::time::Duration;
        let seeds = texts(&[
            "high\nsearch\n1500\nBearer sk-1",
            "low\n\n99999999999\n",
            "normal\ntenant-with-a-very-long-name-that-goes-on-and-on-past-sixty-four-bytes-ok\n0\nbearer x",
            "urgent\nt\n-1\nBasic abc",
        ]);
        let config = OverloadConfig::default();
        let cap = Duration::from_secs(600);
        fuzz("overload-headers", seeds, false, |input| {
            let mut values = input.split(|b| *b == b'\n');
            let mut headers = hyper::HeaderMap::new();
            for name in [
                "x-switchyard-priority",
                "x-switchyard-tenant",
                "x-switchyard-deadline-ms",
                "authorization",
            ] {
                let Some(v) = values.next() else { break };
                if let Ok(v) = hyper::header::HeaderValue::from_bytes(v) {
                    headers.insert(name, v);
                }
            }
            let Ok(who) = config.identify(&headers, cap) else {
                return false;
            };
            assert!(who.class < config.classes.len());
            assert!(who.deadline <= cap);
            assert!(who.tenant.len() <= 64 || who.tenant.starts_with("key:"));
            if let Some(key) = headers
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .filter(|k| k.trim().len() > 3)
                && !headers.contains_key("x-switchyard-tenant")
            {
                assert!(
                    !who.tenant.contains(key.trim()),
                    "the key leaked into the tenant"
                );
            }
            true
        });
    }

    /// A worker's event stream as a migratable relay reads it, cut into two chunks
    /// anywhere: never a panic; before a migration exactly a prefix of what the worker
    /// sent (whole events only); the answer kept within its bound.
    #[test]
    fn worker_streams() {
        use crate::tokens::openai::Api;
        let chat = |t: &str| {
            format!(
                r#"data: {{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{{"index":0,"delta":{{"content":"{t}"}},"finish_reason":null}}]}}"#
            )
        };
        let seeds = texts(&[
            &format!(
                "{}\n\n{}\n\ndata: {{\"id\":\"c1\",\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"length\"}}],\"usage\":{{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}}}\n\ndata: [DONE]\n\n",
                chat("lorem "),
                chat("ipsum ")
            ),
            "data: {\"id\":\"x\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"amet \",\"finish_reason\":null}]}\r\n\r\n: comment\n\n",
            "data: {\"error\":{\"message\":\"boom\",\"type\":\"InternalServerError\",\"code\":500}}\n\n",
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0}]}}]}\n\nevent: x\ndata: [DONE]\n\n",
        ]);
        fuzz("worker-stream", seeds, false, |input| {
            let cut = input.len() / 3;
            let chunks = [&input[..cut], &input[cut..]];
            for api in [Api::Chat, Api::Completions] {
                let (out, broke, kept, _) = crate::http::proxy::relay_events(api, false, &chunks);
                if broke.is_none() {
                    assert!(input.starts_with(&out), "only whole events, as sent");
                }
                assert!(kept <= crate::http::proxy::MAX_KEPT_TEXT);
                let (out, _, _, _) = crate::http::proxy::relay_events(api, true, &chunks);
                assert!(
                    out.is_empty() || out.ends_with(b"\n\n") || out.ends_with(b"\n\r\n"),
                    "whole events after a migration"
                );
            }
            true
        });
    }

    /// A streamed chunk read by the relay's typed view: never a panic, and whatever the
    /// view reads, the full `Value` path reads alike.
    #[test]
    fn stream_chunks() {
        use crate::tokens::openai::Api;
        let seeds = texts(&[
            r#"{"id":"c1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" the","logprobs":null,"finish_reason":null,"token_ids":[279]}]}"#,
            r#"{"id":"c1","choices":[{"index":0,"delta":{"role":"assistant","content":"Hi \"x\"\n"},"finish_reason":null}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0}],"reasoning_content":"r"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3}}"#,
            r#"{"choices":[{"text":"a","token_ids":[1,4294967296],"prompt_token_ids":[1]}],"error":null}"#,
        ]);
        fuzz("stream-chunk", seeds, true, |input| {
            let Ok(data) = std::str::from_utf8(input) else {
                return false;
            };
            for api in [Api::Chat, Api::Completions] {
                assert!(crate::http::proxy::view_agrees(api, data));
            }
            true
        });
    }

    /// A vLLM prefill worker's answer, read for its `kv_transfer_params`: never a panic;
    /// read, they reach the decode worker's request unchanged and the client's fields stay.
    #[test]
    fn prefill_answers() {
        let seeds = texts(&[
            r#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"lorem ","finish_reason":"length"}],"usage":{"prompt_tokens":40,"completion_tokens":1},"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[0,1,2],"remote_engine_id":"e","remote_request_id":"r-1","remote_host":"10.0.0.7","remote_port":8000,"tp_size":1}}"#,
            r#"{"choices":[],"kv_transfer_params":null}"#,
            r#"{"kv_transfer_params":{"remote_block_ids":[18446744073709551615]}}"#,
        ]);
        let body = br#"{"model":"m","prompt":"hello","max_tokens":7,"stream":true}"#;
        fuzz("prefill-answer", seeds, true, |input| {
            let Ok(decode) = crate::http::proxy::vllm_handoff(body, input) else {
                return false;
            };
            let v: serde_json::Value = serde_json::from_slice(&decode).expect("JSON out");
            let answer: serde_json::Value = serde_json::from_slice(input).expect("read as JSON");
            // Compared as written (a float may not survive a second parse bit for bit).
            let params = serde_json::to_string(&answer["kv_transfer_params"]).unwrap();
            let written = String::from_utf8_lossy(&decode);
            assert!(
                written.contains(&format!("\"kv_transfer_params\":{params}")),
                "{written}"
            );
            assert_eq!(
                (&v["max_tokens"], &v["stream"]),
                (&serde_json::json!(7), &serde_json::json!(true))
            );
            true
        });
    }

    /// A request's handoff fields as a mock worker reads them, in every role and protocol:
    /// never a panic; a handoff only where the role takes part in one.
    #[test]
    fn handoff_fields() {
        use crate::ids::Role;
        use crate::worker::server::pd::{Leg, leg};
        use crate::worker::{PdConfig, PdProtocol};
        let seeds = texts(&[
            r#"{"model":"m","prompt":"x","kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}"#,
            r#"{"model":"m","prompt":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"127.0.0.1","remote_port":8001,"remote_request_id":"8001-ab","remote_block_ids":[0,1]}}"#,
            r#"{"model":"m","messages":[],"bootstrap_host":"10.0.0.7","bootstrap_port":8998,"bootstrap_room":9223372036854775807}"#,
        ]);
        fuzz("handoff-fields", seeds, true, |input| {
            let mut any = false;
            for role in Role::ALL {
                for protocol in [PdProtocol::Vllm, PdProtocol::Sglang] {
                    let pd = PdConfig {
                        role,
                        protocol,
                        ..PdConfig::default()
                    };
                    match leg(&pd, input, || "k".into()) {
                        Ok(Leg::Whole) | Err(_) => {}
                        Ok(Leg::Prefill { vllm, .. }) => {
                            assert!(role != Role::Decode);
                            assert!(vllm || role == Role::Prefill);
                            any = true;
                        }
                        Ok(Leg::Decode { vllm, .. }) => {
                            assert!(role != Role::Prefill);
                            assert!(vllm || role == Role::Decode);
                            any = true;
                        }
                    }
                }
            }
            any
        });
    }

    /// What a policy returns as text (a rejection's reason, its name and version):
    /// bounded and free of control characters wherever it goes.
    #[test]
    fn policy_texts() {
        use crate::policy::{MAX_GUEST_LABEL, MAX_GUEST_TEXT, guest_label, guest_text};
        let seeds = texts(&[
            "all busy",
            "kv-cost 0.2.0",
            "line\nbreak\u{7}",
            "ünïcödé ✓ 🚀",
        ]);
        fuzz("policy-text", seeds, false, |input| {
            let s = String::from_utf8_lossy(input);
            let text = guest_text(&s);
            assert!(text.len() <= MAX_GUEST_TEXT + '…'.len_utf8());
            assert!(!text.chars().any(char::is_control));
            let label = guest_label(&s);
            assert!(!label.is_empty() && label.chars().count() <= MAX_GUEST_LABEL);
            assert!(
                label
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-+:/@".contains(c))
            );
            true
        });
    }
}
