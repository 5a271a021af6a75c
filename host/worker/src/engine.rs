//! The simulated engine: a continuous-batching scheduler over the [`KvCache`], with a
//! timing model where prefill time grows with *uncached* prompt tokens and decode time
//! with the batch size.
//!
//! Each step schedules work within a token budget (vLLM's `max_num_batched_tokens`,
//! SGLang's `chunked_prefill_size`), as vLLM's V1 scheduler does with chunked prefill: one
//! token for each running request that decodes, then the next chunk of each running
//! request still prefilling, then waiting requests in arrival order while the batch has
//! room, the cache can hold them and budget is left, each taking as much of its uncached
//! prompt as the budget allows. The step lasts
//!
//! ```text
//! prefill_us_per_token × (prompt tokens computed in this step)
//!   + decode_base_us + decode_us_per_seq × (running requests)
//! ```
//!
//! divided by `speedup`; every request that decoded produces one token, and a request
//! whose last chunk was computed produces its first. Finished or cancelled requests
//! release their blocks, which stay cached for later requests with the same prefix. A
//! budget of 0 computes every admitted prompt whole in the step that admits it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::{Notify, broadcast, mpsc};

use super::cache::CacheEvent;
use super::cache::{BlockKeys, KvCache, Lease};
use switchyard_ids::BlockHash;
use switchyard_kv::events::KvEvent;

/// Constants of the timing model, in microseconds of simulated time.
///
/// The defaults approximate an 8B-parameter model on one datacenter GPU: prefill at ~25k
/// tokens/s, and a decode step of ~10 ms growing by 0.15 ms per sequence in the batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimingModel {
    /// Prefill cost per uncached prompt token.
    pub prefill_us_per_token: f64,
    /// Fixed cost of a decode step.
    pub decode_base_us: f64,
    /// Added cost per sequence in the batch.
    pub decode_us_per_seq: f64,
}

impl Default for TimingModel {
    fn default() -> Self {
        TimingModel {
            prefill_us_per_token: 40.0,
            decode_base_us: 10_000.0,
            decode_us_per_seq: 150.0,
        }
    }
}

/// The engine's shape.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV cache size in blocks.
    pub kv_blocks: usize,
    /// Most requests running at once.
    pub max_batch: usize,
    /// Simulated time runs this many times faster than the model says.
    pub speedup: f64,
    /// Most tokens computed in one step (vLLM's `max_num_batched_tokens`, SGLang's
    /// `chunked_prefill_size`): a longer prompt is prefilled in chunks, between decode
    /// steps. 0: no budget, a prompt is prefilled whole.
    pub max_batched_tokens: u64,
    /// The timing model.
    pub timing: TimingModel,
    /// The model's context (vLLM's `max_model_len`): the longest prompt and answer
    /// together. `None`: what the KV cache holds ([`EngineConfig::capacity_tokens`]).
    pub max_model_len: Option<u64>,
    /// The simulated model ends its answer (its end-of-sequence token, `finish_reason`
    /// "stop") when prompt and answer together reach a multiple of this many tokens: an
    /// answer of 1 to `eos_period` tokens, the same whether it is generated whole or
    /// continued from a cut. 0: never, as with vLLM's `ignore_eos` (an answer runs to
    /// its limit).
    pub eos_period: u32,
    /// Tokens per streamed chunk, as vLLM's `--stream-interval`: the first token goes
    /// alone, then a chunk every this many tokens and one at the end (1: a chunk per
    /// token; above 1, chunks carry several tokens, as with speculative decoding).
    pub stream_interval: u32,
}

/// vLLM's default token budget for its OpenAI server on an H100-class GPU
/// (`EngineArgs.get_batch_defaults`, 0.8–0.11), and SGLang's default chunked prefill size
/// on such GPUs.
pub const DEFAULT_MAX_BATCHED_TOKENS: u64 = 8192;

impl EngineConfig {
    /// The tokens its KV cache holds.
    pub fn capacity_tokens(&self) -> u64 {
        self.kv_blocks as u64 * u64::from(self.block_size)
    }

    /// The model's context: the longest prompt and answer together.
    pub fn max_model_len(&self) -> u64 {
        self.max_model_len.unwrap_or_else(|| self.capacity_tokens())
    }

    /// How many tokens a prompt of `prompt_tokens` is answered with, and how the answer
    /// ends: the client's limit (`None`: a chat's default, the rest of the context) or
    /// the model's own end, whichever comes first. `true`: it ends by the model's
    /// end-of-sequence token ("stop"), else at the limit ("length").
    pub fn answer_len(&self, prompt_tokens: u32, limit: Option<u32>) -> (u32, bool) {
        let rest = u32::try_from(
            self.max_model_len()
                .saturating_sub(u64::from(prompt_tokens)),
        )
        .unwrap_or(u32::MAX);
        let limit = limit.map_or(rest, |l| l.min(rest));
        if self.eos_period == 0 {
            return (limit, false);
        }
        let natural = self.eos_period - prompt_tokens % self.eos_period;
        if natural <= limit {
            (natural, true)
        } else {
            (limit, false)
        }
    }
}

/// What a request's caller hears.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// The request was admitted; this many prompt tokens were found cached.
    Admitted {
        /// Cached prompt tokens.
        cached_tokens: u32,
    },
    /// The next generated token (its index).
    Token(u32),
    /// Generation finished.
    Done,
    /// The request can never run (it needs more blocks than the whole cache).
    TooLarge {
        /// Blocks needed.
        needed: usize,
    },
}

/// Cumulative counters of the engine's own step accounting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct EngineStats {
    /// Requests finished.
    pub finished: u64,
    /// Requests cancelled by their caller.
    pub cancelled: u64,
    /// Prompt tokens actually prefilled (computed, not cached).
    pub prefill_tokens: u64,
    /// Prompt tokens served from the cache (vLLM's `prefix_cache_hits`; its
    /// `prefix_cache_queries` are these plus `prefill_tokens`).
    pub cached_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Sum of the gaps between a request's consecutive tokens, microseconds of real time
    /// (vLLM's `inter_token_latency_seconds` histogram's sum).
    pub itl_sum_us: u64,
    /// How many such gaps (the histogram's count).
    pub itl_count: u64,
    /// Engine steps run.
    pub steps: u64,
    /// Requests running now.
    pub running: u64,
    /// Requests waiting now.
    pub waiting: u64,
    /// KV blocks held by running requests now. Cached blocks no request uses count as
    /// free, as vLLM and SGLang count them.
    pub kv_used_blocks: u64,
    /// KV blocks holding a cached prefix now, in use or not (what eviction depends on).
    pub kv_cached_blocks: u64,
    /// KV blocks in total.
    pub kv_total_blocks: u64,
    /// Prompt tokens of the requests waiting now (filled in by [`Engine::stats`]).
    pub waiting_prompt_tokens: u64,
    /// Prompt tokens admitted in the last step that admitted any, and how many of them
    /// were cached (SGLang's `cache_hit_rate` is the ratio, per prefill batch).
    pub last_batch_prompt_tokens: u64,
    /// See `last_batch_prompt_tokens`.
    pub last_batch_cached_tokens: u64,
}

impl EngineStats {
    /// The share of KV blocks held by running requests, in [0, 1].
    pub fn kv_usage(&self) -> f64 {
        if self.kv_total_blocks == 0 {
            0.0
        } else {
            (self.kv_used_blocks as f64 / self.kv_total_blocks as f64).min(1.0)
        }
    }

    /// SGLang's `cache_hit_rate`: cached over admitted prompt tokens in the last batch
    /// that admitted any.
    pub fn last_batch_hit_rate(&self) -> f64 {
        if self.last_batch_prompt_tokens == 0 {
            0.0
        } else {
            self.last_batch_cached_tokens as f64 / self.last_batch_prompt_tokens as f64
        }
    }
}

struct Waiting {
    blocks: Vec<BlockHash>,
    /// The hashed blocks' tokens (published with stored blocks), or empty.
    tokens: Vec<u32>,
    /// The prompt's extra keys (published with its blocks).
    keys: BlockKeys,
    prompt_tokens: u32,
    max_tokens: u32,
    out: mpsc::UnboundedSender<Output>,
}

struct Running {
    lease: Lease,
    /// Uncached prompt tokens not yet computed.
    prefill_left: u64,
    /// Tokens computed for it in the step under way (0: not scheduled).
    scheduled: u64,
    generated: u32,
    max_tokens: u32,
    out: mpsc::UnboundedSender<Output>,
    /// When its last token was produced.
    last_token: Option<tokio::time::Instant>,
}

struct State {
    cache: KvCache,
    waiting: VecDeque<Waiting>,
    running: Vec<Running>,
    stats: EngineStats,
}

/// A running simulated engine. Cheap to share (`Arc`).
pub struct Engine {
    config: EngineConfig,
    state: Mutex<State>,
    /// Shared with the scheduler task, which waits on it without keeping the engine alive.
    wake: Arc<Notify>,
    events: broadcast::Sender<CacheEvent>,
}

impl Engine {
    /// Starts the engine's scheduler task.
    pub fn start(config: EngineConfig) -> Arc<Engine> {
        let (events, _) = broadcast::channel(4096);
        let engine = Arc::new(Engine {
            state: Mutex::new(State {
                cache: KvCache::new(config.kv_blocks, config.block_size),
                waiting: VecDeque::new(),
                running: Vec::new(),
                stats: EngineStats {
                    kv_total_blocks: config.kv_blocks as u64,
                    ..Default::default()
                },
            }),
            config,
            wake: Arc::new(Notify::new()),
            events,
        });
        tokio::spawn(run(Arc::downgrade(&engine), engine.wake.clone()));
        engine
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Queues a request; outputs arrive on the returned receiver. Dropping the receiver
    /// cancels the request. `tokens` are the tokens of `blocks` (published with them when
    /// they are stored), or empty; `keys` are the prompt's extra keys (its blocks'
    /// hashes already include them).
    pub fn submit(
        &self,
        blocks: Vec<BlockHash>,
        tokens: Vec<u32>,
        keys: BlockKeys,
        prompt_tokens: u32,
        max_tokens: u32,
    ) -> mpsc::UnboundedReceiver<Output> {
        let (out, rx) = mpsc::unbounded_channel();
        self.state.lock().waiting.push_back(Waiting {
            blocks,
            tokens,
            keys,
            prompt_tokens,
            max_tokens,
            out,
        });
        self.wake.notify_one();
        rx
    }

    /// The cache snapshot and a receiver of every event after it, atomically.
    pub fn subscribe(&self) -> (KvEvent, broadcast::Receiver<CacheEvent>) {
        let state = self.state.lock();
        (state.cache.snapshot(), self.events.subscribe())
    }

    /// The engine's counters.
    pub fn stats(&self) -> EngineStats {
        let s = self.state.lock();
        EngineStats {
            // Summed when asked, not on every step: only load reports read it.
            waiting_prompt_tokens: s.waiting.iter().map(|w| u64::from(w.prompt_tokens)).sum(),
            ..s.stats
        }
    }

    /// Pins `blocks` (storing those not cached, with their `tokens`), as KV held for a
    /// handoff or just received from one; `None` when the cache cannot hold them.
    pub fn pin(&self, blocks: &[BlockHash], tokens: &[u32], keys: &BlockKeys) -> Option<Lease> {
        let mut s = self.state.lock();
        let lease = s.cache.admit_keyed(blocks, tokens, keys, 0).ok();
        self.publish(&mut s);
        lease
    }

    /// Releases blocks [`Engine::pin`] pinned: they stay cached, free to evict.
    pub fn unpin(&self, lease: &Lease) {
        let mut s = self.state.lock();
        s.cache.release(lease);
        self.publish(&mut s);
    }

    /// Leading blocks of `blocks` this engine's cache holds.
    pub fn cached_prefix(&self, blocks: &[BlockHash]) -> usize {
        self.state.lock().cache.cached_prefix(blocks)
    }

    /// Drops every cached block not in use.
    pub fn clear_cache(&self) {
        let mut s = self.state.lock();
        s.cache.clear_free();
        self.publish(&mut s);
    }

    fn publish(&self, s: &mut State) {
        for e in s.cache.take_events() {
            let _ = self.events.send(e);
        }
        s.stats.kv_used_blocks = s.cache.active() as u64;
        s.stats.kv_cached_blocks = s.cache.cached() as u64;
        s.stats.running = s.running.len() as u64;
        s.stats.waiting = s.waiting.len() as u64;
    }

    /// Schedules the next step within the token budget: decodes, the running prefills'
    /// next chunks, then what fits of the waiting. Returns the prompt tokens to compute.
    fn schedule(&self, s: &mut State) -> u64 {
        let bs = self.config.block_size;
        let mut budget = match self.config.max_batched_tokens {
            0 => u64::MAX,
            n => n,
        };
        let mut prefill = 0u64;
        for r in s.running.iter_mut().filter(|r| r.prefill_left == 0) {
            r.scheduled = u64::from(budget > 0);
            budget -= r.scheduled;
        }
        for r in s.running.iter_mut().filter(|r| r.prefill_left > 0) {
            r.scheduled = r.prefill_left.min(budget);
            budget -= r.scheduled;
            prefill += r.scheduled;
        }
        let mut batch = (0u64, 0u64);
        while s.running.len() < self.config.max_batch && budget > 0 {
            let Some(w) = s.waiting.front() else { break };
            if w.out.is_closed() {
                s.waiting.pop_front();
                s.stats.cancelled += 1;
                continue;
            }
            let hashed = w.blocks.len() as u32 * bs;
            let private =
                (w.prompt_tokens.saturating_sub(hashed) + w.max_tokens).div_ceil(bs) as usize;
            match s.cache.admit_keyed(&w.blocks, &w.tokens, &w.keys, private) {
                Ok(lease) => {
                    let w = s.waiting.pop_front().expect("peeked");
                    let cached_tokens = lease.cached as u32 * bs;
                    let uncached = u64::from(w.prompt_tokens - cached_tokens.min(w.prompt_tokens));
                    // A prompt found whole in the cache still computes its last token.
                    let chunk = uncached.max(1).min(budget);
                    budget -= chunk;
                    prefill += chunk.min(uncached);
                    s.stats.prefill_tokens += uncached;
                    s.stats.cached_tokens += u64::from(cached_tokens);
                    batch.0 += u64::from(w.prompt_tokens);
                    batch.1 += u64::from(cached_tokens.min(w.prompt_tokens));
                    let _ = w.out.send(Output::Admitted { cached_tokens });
                    s.running.push(Running {
                        lease,
                        prefill_left: uncached.max(1),
                        scheduled: chunk,
                        generated: 0,
                        max_tokens: w.max_tokens,
                        out: w.out,
                        last_token: None,
                    });
                }
                Err(full) if full.needed > s.cache.capacity() => {
                    let w = s.waiting.pop_front().expect("peeked");
                    let _ = w.out.send(Output::TooLarge {
                        needed: full.needed,
                    });
                }
                Err(_) => break,
            }
        }
        if batch.0 > 0 {
            (
                s.stats.last_batch_prompt_tokens,
                s.stats.last_batch_cached_tokens,
            ) = batch;
        }
        prefill
    }

    /// Ends the step: a token from each request that decoded or computed its prompt's
    /// last chunk; retires the finished and cancelled.
    fn emit(&self, s: &mut State) {
        let now = tokio::time::Instant::now();
        let mut i = 0;
        while i < s.running.len() {
            let r = &mut s.running[i];
            let ran = std::mem::take(&mut r.scheduled);
            r.prefill_left -= ran.min(r.prefill_left);
            // A token from a decode step, or at the end of the step that computed the
            // prompt's last chunk; without one, a caller gone meanwhile is cancelled.
            let (alive, done) = if ran > 0 && r.prefill_left == 0 {
                if let Some(last) = r.last_token.replace(now) {
                    let gap = now.saturating_duration_since(last).as_micros();
                    s.stats.itl_sum_us += u64::try_from(gap).unwrap_or(u64::MAX);
                    s.stats.itl_count += 1;
                }
                r.generated += 1;
                let alive = r.out.send(Output::Token(r.generated - 1)).is_ok();
                let done = r.generated >= r.max_tokens;
                if done && alive {
                    let _ = r.out.send(Output::Done);
                }
                (alive, done)
            } else {
                (!r.out.is_closed(), false)
            };
            if done || !alive {
                let r = s.running.swap_remove(i);
                s.cache.release(&r.lease);
                s.stats.generated_tokens += u64::from(r.generated);
                if alive {
                    s.stats.finished += 1;
                } else {
                    s.stats.cancelled += 1;
                }
            } else {
                i += 1;
            }
        }
    }
}

async fn run(engine: std::sync::Weak<Engine>, wake: Arc<Notify>) {
    loop {
        let Some(e) = engine.upgrade() else { return };
        let step = {
            let mut s = e.state.lock();
            let prefill = e.schedule(&mut s);
            e.publish(&mut s);
            if s.running.is_empty() {
                None
            } else {
                let t = &e.config.timing;
                let us = t.prefill_us_per_token * prefill as f64
                    + t.decode_base_us
                    + t.decode_us_per_seq * s.running.len() as f64;
                // Saturating: a timing model that asks for more than a Duration holds
                // sleeps "forever" instead of panicking.
                Some(
                    Duration::try_from_secs_f64(us / 1e6 / e.config.speedup.max(1e-9))
                        .unwrap_or(Duration::MAX),
                )
            }
        };
        match step {
            None => {
                let notified = wake.notified();
                drop(e);
                notified.await;
                continue;
            }
            Some(d) => {
                drop(e);
                if d >= Duration::from_micros(50) {
                    tokio::time::sleep(d).await;
                } else {
                    tokio::task::yield_now().await;
                }
            }
        }
        let Some(e) = engine.upgrade() else { return };
        let mut s = e.state.lock();
        s.stats.steps += 1;
        e.emit(&mut s);
        e.publish(&mut s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    fn engine(max_batched_tokens: u64) -> Arc<Engine> {
        Engine::start(EngineConfig {
            block_size: 16,
            kv_blocks: 8192,
            max_batch: 8,
            speedup: 1.0,
            max_batched_tokens,
            max_model_len: None,
            eos_period: 0,
            stream_interval: 1,
            timing: TimingModel::default(),
        })
    }

    fn blocks(first: u64, n: u64) -> Vec<BlockHash> {
        (first..first + n).map(BlockHash).collect()
    }

    /// While a 64k-token prompt prefills, a stream already decoding on the same engine:
    /// how many tokens it gets before the long prompt's first, and its longest gap.
    async fn decode_beside_long_prefill(max_batched_tokens: u64) -> (usize, Duration) {
        let e = engine(max_batched_tokens);
        let mut short = e.submit(blocks(1, 1), vec![], BlockKeys::default(), 16, 1_000);
        assert!(matches!(short.recv().await, Some(Output::Admitted { .. })));
        assert_eq!(short.recv().await, Some(Output::Token(0)));
        let mut long = e.submit(blocks(100, 4096), vec![], BlockKeys::default(), 65_536, 1);
        assert_eq!(
            long.recv().await,
            Some(Output::Admitted { cached_tokens: 0 })
        );
        let (mut tokens, mut gap, mut last) = (0, Duration::ZERO, Instant::now());
        loop {
            tokio::select! {
                biased;
                t = short.recv() => {
                    assert!(matches!(t, Some(Output::Token(_))));
                    tokens += 1;
                    gap = gap.max(last.elapsed());
                    last = Instant::now();
                }
                t = long.recv() => {
                    assert_eq!(t, Some(Output::Token(0)));
                    return (tokens, gap);
                }
            }
        }
    }

    /// As vLLM and SGLang do by default, a long prompt is prefilled in chunks of the step
    /// budget, so the streams already running keep getting tokens meanwhile instead of
    /// stalling for the whole prefill.
    #[tokio::test(start_paused = true)]
    async fn a_long_prefill_is_chunked_between_decode_steps() {
        let (tokens, gap) = decode_beside_long_prefill(DEFAULT_MAX_BATCHED_TOKENS).await;
        // 65,536 tokens at 8,191 a step (one token of each step is the decode's): 9 steps.
        assert!(tokens >= 8, "{tokens} tokens during the prefill");
        // Each step: at most 8,192 tokens of prefill (0.33 s) and a decode step.
        assert!(gap < Duration::from_millis(400), "a gap of {gap:?}");

        let (tokens, gap) = decode_beside_long_prefill(0).await;
        // The step under way when it arrived, and the one that prefills it whole.
        assert!(tokens <= 2, "{tokens} tokens during an unchunked prefill");
        assert!(gap > Duration::from_secs(2), "a gap of {gap:?}");
    }

    /// A caller that leaves mid-prefill is cancelled and its blocks freed, without waiting
    /// for the prefill to end.
    #[tokio::test(start_paused = true)]
    async fn leaving_mid_prefill_frees_the_request() {
        let e = engine(1024);
        let mut long = e.submit(blocks(100, 4096), vec![], BlockKeys::default(), 65_536, 8);
        assert!(matches!(long.recv().await, Some(Output::Admitted { .. })));
        assert_eq!(e.stats().running, 1);
        drop(long);
        // Two steps of 1,024 tokens: well before the 64 steps the prefill needs.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let stats = e.stats();
        assert_eq!(
            (stats.running, stats.cancelled, stats.kv_used_blocks),
            (0, 1, 0)
        );
    }
}
