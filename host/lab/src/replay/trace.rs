//! Mooncake-format traces: one JSON object per line with `timestamp` (ms), `input_length`,
//! `output_length` and `hash_ids` (512-token prefix blocks).

use std::collections::HashSet;
use std::path::Path;

use serde::Deserialize;

/// Tokens per trace block.
pub const TRACE_BLOCK: usize = 512;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TraceRequest {
    /// Arrival, in milliseconds from the start.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Generated tokens.
    pub output_length: u32,
    /// Prefix block IDs.
    pub hash_ids: Vec<u64>,
}

/// Reads a trace, reporting the first malformed line by number.
pub fn read(path: &Path) -> Result<Vec<TraceRequest>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| format!("{}:{}: {e}", path.display(), i + 1))
        })
        .collect()
}

/// The prompt of `req`: each hash ID becomes the same deterministic 512 tokens wherever it
/// appears, so requests sharing IDs share token prefixes; cut to `input_length`.
pub fn tokens(req: &TraceRequest) -> Vec<u32> {
    let mut out = Vec::with_capacity(req.input_length as usize);
    'blocks: for &id in &req.hash_ids {
        for j in 0..TRACE_BLOCK as u64 {
            if out.len() >= req.input_length as usize {
                break 'blocks;
            }
            out.push(
                256 + (switchyard_cost_model::mix(
                    id.wrapping_mul(TRACE_BLOCK as u64).wrapping_add(j),
                ) % 99_000) as u32,
            );
        }
    }
    // A trace may list fewer blocks than its length needs; pad deterministically.
    let mut k = 0u64;
    while out.len() < req.input_length as usize {
        out.push(256 + (switchyard_cost_model::mix(u64::MAX - k) % 99_000) as u32);
        k += 1;
    }
    out
}

/// The prompt of `req` as text, for routers that match prefixes on text (the peers) as
/// well as on tokens: each hash ID becomes the same 256 four-letter words, each followed
/// by a space, wherever it appears. The builtin tokenizer reads a word and a space as one
/// token each, so a block is 512 tokens and a request is `input_length` tokens, and
/// requests sharing IDs share text and token prefixes alike.
pub fn text(req: &TraceRequest) -> String {
    const ALPHABET: &[u8; 36] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let len = req.input_length as usize;
    let mut out = String::with_capacity(len * 5 / 2 + 4);
    let word = |seed: u64, out: &mut String| {
        let bits = switchyard_cost_model::mix(seed);
        for k in 0..4 {
            out.push(ALPHABET[((bits >> (k * 8)) % 36) as usize] as char);
        }
    };
    let seeds = req
        .hash_ids
        .iter()
        .flat_map(|&id| {
            (0..TRACE_BLOCK as u64 / 2).map(move |j| id.wrapping_mul(TRACE_BLOCK as u64) + j)
        })
        .chain((0..).map(|k: u64| u64::MAX - k));
    for (i, seed) in seeds.take(len.div_ceil(2)).enumerate() {
        word(seed, &mut out);
        if 2 * i + 1 < len {
            out.push(' ');
        }
    }
    out
}

/// The share of prompt tokens an infinite cache could serve: each request's leading blocks
/// that some earlier request already had.
pub fn infinite_cache_bound(reqs: &[TraceRequest]) -> f64 {
    let mut seen: HashSet<u64> = HashSet::new();
    let (mut hit, mut total) = (0u64, 0u64);
    for r in reqs {
        let run = r.hash_ids.iter().take_while(|id| seen.contains(id)).count();
        hit += (run * TRACE_BLOCK).min(r.input_length as usize) as u64;
        total += u64::from(r.input_length);
        seen.extend(&r.hash_ids);
    }
    if total == 0 {
        0.0
    } else {
        hit as f64 / total as f64
    }
}

/// The share of prompt tokens a single LRU cache of `capacity_tokens` (the whole fleet's
/// KV capacity, pooled) could serve, counting each request's leading cached blocks: what
/// a perfect router could at best reach with the workers' capacity.
pub fn lru_cache_bound(reqs: &[TraceRequest], capacity_tokens: u64) -> f64 {
    use std::collections::{BTreeMap, HashMap};
    let capacity = (capacity_tokens / TRACE_BLOCK as u64) as usize;
    let mut last_use: HashMap<u64, u64> = HashMap::new();
    let mut lru: BTreeMap<u64, u64> = BTreeMap::new();
    let (mut hit, mut total, mut clock) = (0u64, 0u64, 0u64);
    for r in reqs {
        let run = r
            .hash_ids
            .iter()
            .take_while(|id| last_use.contains_key(id))
            .count();
        hit += (run * TRACE_BLOCK).min(r.input_length as usize) as u64;
        total += u64::from(r.input_length);
        for id in &r.hash_ids {
            clock += 1;
            if let Some(old) = last_use.insert(*id, clock) {
                lru.remove(&old);
            }
            lru.insert(clock, *id);
            while last_use.len() > capacity {
                let (_, victim) = lru.pop_first().expect("non-empty");
                last_use.remove(&victim);
            }
        }
    }
    if total == 0 {
        0.0
    } else {
        hit as f64 / total as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ids: &[u64], len: u32) -> TraceRequest {
        TraceRequest {
            timestamp: 0,
            input_length: len,
            output_length: 1,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn text_prompts_are_as_long_as_the_trace_says_and_share_prefixes() {
        let tokenizer = switchyard_tokens::Tokenizer::builtin();
        let a = text(&req(&[1, 2, 3], 1301));
        let b = text(&req(&[1, 2, 9], 1500));
        let (ta, tb) = (tokenizer.encode(&a).unwrap(), tokenizer.encode(&b).unwrap());
        assert_eq!((ta.len(), tb.len()), (1301, 1500));
        assert_eq!(ta[..1024], tb[..1024]);
        assert_ne!(ta[1024..1300], tb[1024..1300]);
        assert_eq!(a[..2560], b[..2560], "text prefixes match too");
        assert_eq!(text(&req(&[], 5)).len(), 14, "padding when the IDs run out");
    }

    #[test]
    fn shared_ids_give_shared_token_prefixes() {
        let a = tokens(&req(&[1, 2, 3], 1300));
        let b = tokens(&req(&[1, 2, 9], 1500));
        assert_eq!(a.len(), 1300);
        assert_eq!(b.len(), 1500);
        assert_eq!(a[..1024], b[..1024]);
        assert_ne!(a[1024..1300], b[1024..1300]);
    }

    #[test]
    fn the_bound_counts_leading_blocks_seen_before() {
        let reqs = [
            req(&[1, 2], 1024),
            req(&[1, 2, 3], 1500),
            req(&[4, 2], 1024),
        ];
        // Second request: 2 blocks (1024 tokens) of 1500 cached; others: none.
        let bound = infinite_cache_bound(&reqs);
        assert!((bound - 1024.0 / 3548.0).abs() < 1e-9, "{bound}");
    }

    #[test]
    fn a_small_cache_bounds_the_hit_rate_below_the_infinite_one() {
        let reqs: Vec<_> = (0..20u64).map(|i| req(&[i % 5, 100 + i], 1024)).collect();
        let infinite = infinite_cache_bound(&reqs);
        assert!((lru_cache_bound(&reqs, 1 << 30) - infinite).abs() < 1e-9);
        assert!(lru_cache_bound(&reqs, 2 * 512) < infinite);
    }

    #[test]
    fn malformed_lines_are_reported_with_their_number() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        std::fs::write(
            &p,
            "{\"timestamp\":0,\"input_length\":5,\"output_length\":1,\"hash_ids\":[1]}\nnot json\n",
        )
        .unwrap();
        let err = read(&p).unwrap_err();
        assert!(err.contains(":2:"), "{err}");
    }
}
