//! Synthetic multi-turn traces in the Mooncake format, for shapes the published traces
//! lack: more conversations than workers, bursts of arrivals, short and long prompts
//! mixed. Deterministic for a seed.
//!
//! A conversation starts with one of a few shared system prompts, then each turn appends
//! the previous answer and a new user message to the history and resends all of it, as
//! chat clients do. Block IDs follow the Mooncake rule: a 512-token block keeps its ID in
//! later turns once it is full; a trailing partial block gets a fresh ID each turn (its
//! content changed). Arrivals are Poisson at `rate`, or in bursts of `burst` requests at
//! one instant; each arrival is the next turn of a conversation idle for at least
//! `think_secs`, or a new conversation when none is (or with `1 / turns` odds).

use serde::Serialize;

use super::trace::TRACE_BLOCK;

/// What to generate.
#[derive(Debug, Clone)]
pub struct SynthConfig {
    /// Requests in the trace.
    pub requests: usize,
    /// Mean arrivals per second (trace time).
    pub rate: f64,
    /// Requests arriving together (1: Poisson arrivals).
    pub burst: usize,
    /// Mean turns per conversation.
    pub turns: f64,
    /// Seconds a conversation waits between its turns, at least.
    pub think_secs: f64,
    /// Distinct system prompts shared by conversations.
    pub system_prompts: usize,
    /// Tokens of each system prompt.
    pub system_tokens: u32,
    /// Share of user messages that are long (a pasted document) rather than short.
    pub long_fraction: f64,
    /// Short user messages: tokens, uniform in this range.
    pub short_tokens: (u32, u32),
    /// Long user messages: tokens, uniform in this range.
    pub long_tokens: (u32, u32),
    /// A conversation's first user message, if it has its own range (a document the
    /// rest of the conversation is about); `None`: like any other message.
    pub first_tokens: Option<(u32, u32)>,
    /// Answers: tokens, uniform in this range.
    pub output_tokens: (u32, u32),
    /// Conversations are cut (a new one starts) past this many prompt tokens.
    pub max_prompt_tokens: u32,
    /// The seed.
    pub seed: u64,
}

impl Default for SynthConfig {
    fn default() -> Self {
        SynthConfig {
            requests: 1500,
            rate: 4.0,
            burst: 1,
            turns: 6.0,
            think_secs: 10.0,
            system_prompts: 8,
            system_tokens: 2048,
            long_fraction: 0.1,
            short_tokens: (50, 600),
            long_tokens: (4000, 16000),
            first_tokens: None,
            output_tokens: (50, 500),
            max_prompt_tokens: 64_000,
            seed: 1,
        }
    }
}

impl SynthConfig {
    /// Long conversations whose history fits in large caches: each starts with a
    /// 10–40k-token document and runs ~12 turns towards 100k tokens, resent every turn;
    /// the ~120 conversations of 1,500 requests hold ~8M distinct tokens, under half of
    /// four 65,536-block caches of 64 tokens. Arrivals at 6/s keep such a fleet busy
    /// with the prefill of new documents and the decode of long contexts.
    pub fn large_cache() -> SynthConfig {
        SynthConfig {
            rate: 6.0,
            turns: 12.0,
            think_secs: 5.0,
            system_prompts: 8,
            system_tokens: 2048,
            long_fraction: 0.05,
            short_tokens: (50, 2000),
            long_tokens: (4000, 16000),
            first_tokens: Some((10_000, 40_000)),
            output_tokens: (100, 800),
            max_prompt_tokens: 100_000,
            ..SynthConfig::default()
        }
    }
}

/// One line of the trace.
#[derive(Debug, Clone, Serialize)]
pub struct SynthRequest {
    /// Arrival, ms.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Generated tokens.
    pub output_length: u32,
    /// Prefix block IDs.
    pub hash_ids: Vec<u64>,
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        switchyard_cost_model::mix(self.0)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn range(&mut self, (lo, hi): (u32, u32)) -> u32 {
        lo + (self.next() % u64::from(hi.saturating_sub(lo) + 1)) as u32
    }

    fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }
}

struct Conversation {
    /// IDs of the history's full blocks.
    full: Vec<u64>,
    /// Tokens of history (prompt and answer of the last turn).
    tokens: u32,
    /// When its last turn arrived, seconds.
    last: f64,
}

/// Generates the trace.
pub fn generate(config: &SynthConfig) -> Vec<SynthRequest> {
    let mut rng = Rng(config.seed);
    let block = TRACE_BLOCK as u32;
    let mut next_id = 0u64;
    let mut fresh = || {
        next_id += 1;
        next_id
    };
    // System prompts: whole blocks of their own (a trailing partial block included).
    let systems: Vec<Vec<u64>> = (0..config.system_prompts.max(1))
        .map(|_| {
            (0..config.system_tokens.div_ceil(block))
                .map(|_| fresh())
                .collect()
        })
        .collect();
    let mut open: Vec<Conversation> = Vec::new();
    let mut out = Vec::with_capacity(config.requests);
    let mut now = 0.0;
    while out.len() < config.requests {
        now += rng.exp(config.burst.max(1) as f64 / config.rate.max(1e-3));
        for _ in 0..config.burst.max(1) {
            if out.len() >= config.requests {
                break;
            }
            let idle: Vec<usize> = (0..open.len())
                .filter(|&i| now - open[i].last >= config.think_secs)
                .collect();
            let new = idle.is_empty() || rng.unit() < 1.0 / config.turns.max(1.0);
            let i = if new {
                let system = &systems[(rng.next() % systems.len() as u64) as usize];
                // The system prompt's full blocks are shared; its tail is not full.
                let full_sys = (config.system_tokens / block) as usize;
                open.push(Conversation {
                    full: system[..full_sys].to_vec(),
                    tokens: config.system_tokens,
                    last: now,
                });
                open.len() - 1
            } else {
                idle[(rng.next() % idle.len() as u64) as usize]
            };
            let user = if let (true, Some(first)) = (new, config.first_tokens) {
                rng.range(first)
            } else if rng.unit() < config.long_fraction {
                rng.range(config.long_tokens)
            } else {
                rng.range(config.short_tokens)
            };
            let output = rng.range(config.output_tokens);
            let c = &mut open[i];
            let input = c.tokens + user;
            let total_blocks = input.div_ceil(block) as usize;
            let mut hash_ids = c.full.clone();
            hash_ids.truncate(total_blocks);
            while hash_ids.len() < total_blocks {
                hash_ids.push(fresh());
            }
            out.push(SynthRequest {
                timestamp: (now * 1000.0) as u64,
                input_length: input,
                output_length: output,
                hash_ids: hash_ids.clone(),
            });
            // The blocks this prompt filled stay; its partial tail will change.
            hash_ids.truncate((input / block) as usize);
            c.full = hash_ids;
            c.tokens = input + output;
            c.last = now;
            if c.tokens + config.short_tokens.0 > config.max_prompt_tokens {
                open.swap_remove(i);
            }
        }
        // Conversations idle far longer than their think time have ended.
        open.retain(|c| now - c.last < 20.0 * config.think_secs.max(1.0));
    }
    out
}

/// The trace as JSON lines.
pub fn to_jsonl(requests: &[SynthRequest]) -> String {
    let mut s = String::new();
    for r in requests {
        s.push_str(&serde_json::to_string(r).expect("serialisable"));
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::trace::TraceRequest;

    fn parsed(config: &SynthConfig) -> Vec<TraceRequest> {
        to_jsonl(&generate(config))
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    #[test]
    fn conversations_resend_their_history_as_a_shared_prefix() {
        let config = SynthConfig {
            requests: 400,
            ..SynthConfig::default()
        };
        let reqs = parsed(&config);
        assert_eq!(reqs.len(), 400);
        assert!(reqs.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        let block = TRACE_BLOCK as u32;
        for r in &reqs {
            assert_eq!(r.hash_ids.len(), r.input_length.div_ceil(block) as usize);
        }
        // A later turn starts with every full block of an earlier turn of its conversation.
        let extended = reqs
            .iter()
            .enumerate()
            .filter(|(i, r)| {
                reqs[..*i].iter().any(|p| {
                    let full = (p.input_length / block) as usize;
                    full > config.system_tokens as usize / TRACE_BLOCK
                        && r.hash_ids.len() > full
                        && r.hash_ids[..full] == p.hash_ids[..full]
                })
            })
            .count();
        assert!(extended > 200, "{extended} of 400 continue a conversation");
        // Conversations share system prompts and nothing else.
        let firsts: std::collections::HashSet<u64> = reqs.iter().map(|r| r.hash_ids[0]).collect();
        assert!(firsts.len() <= config.system_prompts, "{firsts:?}");
        // Deterministic.
        assert_eq!(to_jsonl(&generate(&config)), to_jsonl(&generate(&config)));
    }

    #[test]
    fn the_large_cache_shape_grows_long_conversations_that_fit_large_caches() {
        let reqs = parsed(&SynthConfig::large_cache());
        let block = TRACE_BLOCK as u64;
        let distinct: std::collections::HashSet<u64> = reqs
            .iter()
            .flat_map(|r| r.hash_ids.iter().copied())
            .collect();
        let distinct_tokens = distinct.len() as u64 * block;
        // Fits under half of four caches of 65,536 blocks of 64 tokens...
        assert!(distinct_tokens < 4 * 65_536 * 64 / 2, "{distinct_tokens}");
        // ...while the prompts resent add up to far more: most of every prompt is history.
        let sent: u64 = reqs.iter().map(|r| u64::from(r.input_length)).sum();
        assert!(
            sent > 5 * distinct_tokens,
            "{sent} sent, {distinct_tokens} distinct"
        );
        assert!(reqs.iter().any(|r| r.input_length > 80_000));
        assert!(reqs.iter().all(|r| r.input_length <= 100_000 + 40_000));
    }

    #[test]
    fn bursts_arrive_together_and_lengths_mix() {
        let reqs = parsed(&SynthConfig {
            requests: 300,
            burst: 25,
            long_fraction: 0.5,
            ..SynthConfig::default()
        });
        let mut instants: Vec<u64> = reqs.iter().map(|r| r.timestamp).collect();
        instants.dedup();
        assert_eq!(instants.len(), 12, "300 requests in bursts of 25");
        // First turns: the system prompt and one short or one long message.
        assert!(reqs.iter().any(|r| r.input_length <= 2048 + 600));
        assert!(
            reqs.iter()
                .any(|r| (2048 + 4000..=2048 + 16000).contains(&r.input_length))
        );
    }
}
