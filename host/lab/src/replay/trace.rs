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

/// Common English words of one to four letters, most frequent first: the prompts' text.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "a", "in", "is", "it", "you", "that", "he", "was", "for", "on",
    "are", "with", "as", "I", "his", "they", "be", "at", "one", "have", "this", "from", "or",
    "had", "by", "not", "word", "but", "what", "some", "we", "can", "out", "were", "all", "when",
    "up", "use", "your", "how", "said", "an", "each", "she", "do", "then", "them", "like", "so",
    "her", "long", "make", "see", "him", "two", "has", "look", "more", "day", "go", "come", "did",
    "my", "no", "most", "who", "over", "know", "than", "call", "down", "side", "been", "now",
    "find", "any", "new", "work", "part", "take", "get", "made", "live", "back", "only", "year",
    "came", "show", "also", "good", "me", "give", "our", "name", "very", "just", "form", "help",
    "line", "turn", "much", "mean", "old", "move", "same", "tell", "boy", "why", "ask", "went",
    "men", "read", "need", "land", "home", "us", "hand", "big", "high", "such", "act", "put",
    "end", "does", "well", "must", "set", "off", "play", "air", "away", "even", "here", "want",
    "page", "left", "let", "try", "kind", "near", "last", "keep", "eye", "head", "food", "tree",
    "own", "city", "far", "hard", "open", "seem", "next", "sun", "few", "run", "life", "took",
    "both", "walk", "ease", "book", "once", "hear", "stop", "face", "feet", "car", "mile", "talk",
    "bird", "soon", "body", "dog", "song", "door", "wind", "ship", "area", "half", "rock", "fire",
    "told", "knew", "pass", "top", "cat", "king", "size", "code", "data", "file", "test", "user",
    "list", "type", "node", "key", "map", "path", "link", "task", "step", "rate", "cost",
];

/// The prompt of `req` as text, for routers that match prefixes on text (the peers) as
/// well as on tokens: each hash ID becomes the same 256 words, each followed by a space,
/// wherever it appears. Words are English-like, as prompts are: drawn from [`WORDS`] by
/// Zipf's law (one in eight a rarer word of two to four random letters), so a real
/// tokenizer sees words that repeat and cost about a token each. Every word has at most
/// four letters, so the builtin tokenizer reads a word and a space as one token each: a
/// block is 512 tokens and a request is `input_length` tokens, and requests sharing IDs
/// share text and token prefixes alike.
pub fn text(req: &TraceRequest) -> String {
    let len = req.input_length as usize;
    let mut out = String::with_capacity(len * 2 + 4);
    let seeds = req
        .hash_ids
        .iter()
        .flat_map(|&id| {
            (0..TRACE_BLOCK as u64 / 2).map(move |j| id.wrapping_mul(TRACE_BLOCK as u64) + j)
        })
        .chain((0..).map(|k: u64| u64::MAX - k));
    for (i, seed) in seeds.take(len.div_ceil(2)).enumerate() {
        word(switchyard_cost_model::mix(seed), &mut out);
        if 2 * i + 1 < len {
            out.push(' ');
        }
    }
    out
}

/// The word a seed's mixed bits choose, onto `out`.
fn word(bits: u64, out: &mut String) {
    if bits.is_multiple_of(8) {
        // A rarer word: two to four random letters.
        let letters = 2 + (bits >> 3) % 3;
        for k in 0..letters {
            out.push(char::from(b'a' + ((bits >> (8 + 8 * k)) % 26) as u8));
        }
        return;
    }
    // Zipf's law over the list: rank r with weight 1 / (r + 1), by inverting the
    // cumulative weight, ln(r + 1) / ln(n + 1), at a uniform point.
    let u = ((bits >> 11) as f64) / ((1u64 << 53) as f64);
    let n = WORDS.len() as f64;
    let rank = ((n + 1.0).powf(u) - 1.0) as usize;
    out.push_str(WORDS[rank.min(WORDS.len() - 1)]);
}

/// A request as the bounds count it: keys of its leading blocks (equal keys, equal
/// prefixes), the tokens a block holds, and the request's length in tokens.
#[derive(Debug, Clone)]
pub struct BlockView {
    keys: Vec<u64>,
    block: usize,
    len: usize,
}

impl BlockView {
    /// In the trace's own units: its hash IDs, [`TRACE_BLOCK`] tokens each (the built-in
    /// tokenizer reads [`text`] back into them).
    pub fn of_trace(req: &TraceRequest) -> BlockView {
        BlockView {
            keys: req.hash_ids.clone(),
            block: TRACE_BLOCK,
            len: req.input_length as usize,
        }
    }

    /// In a tokenizer's units: each full block of `block` tokens, keyed by the tokens up
    /// to its end, as engines key their caches (a partial last block is never cached).
    pub fn of_tokens(tokens: &[u32], block: usize) -> BlockView {
        let mut parent = 0;
        let keys = tokens
            .chunks_exact(block.max(1))
            .map(|b| {
                parent = switchyard_kv::hash::hash_block(parent, b);
                parent
            })
            .collect();
        BlockView {
            keys,
            block: block.max(1),
            len: tokens.len(),
        }
    }

    /// Tokens of the leading `run` blocks.
    fn hit(&self, run: usize) -> u64 {
        run.saturating_mul(self.block).min(self.len) as u64
    }
}

/// Each request's prompt tokens that no earlier request of the trace had (past its
/// leading blocks some earlier request already had): what it must prefill on a worker
/// holding everything the trace left before it.
pub fn never_seen_tokens(reqs: &[BlockView]) -> Vec<u64> {
    let mut seen: HashSet<u64> = HashSet::new();
    reqs.iter()
        .map(|r| {
            let run = r.keys.iter().take_while(|id| seen.contains(id)).count();
            seen.extend(&r.keys);
            r.len as u64 - r.hit(run)
        })
        .collect()
}

/// The share of prompt tokens an infinite cache could serve: each request's leading blocks
/// that some earlier request already had.
pub fn infinite_cache_bound(reqs: &[BlockView]) -> f64 {
    let mut seen: HashSet<u64> = HashSet::new();
    let (mut hit, mut total) = (0u64, 0u64);
    for r in reqs {
        let run = r.keys.iter().take_while(|id| seen.contains(id)).count();
        hit += r.hit(run);
        total += r.len as u64;
        seen.extend(&r.keys);
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
pub fn lru_cache_bound(reqs: &[BlockView], capacity_tokens: u64) -> f64 {
    use std::collections::{BTreeMap, HashMap};
    let mut last_use: HashMap<u64, u64> = HashMap::new();
    let mut lru: BTreeMap<u64, u64> = BTreeMap::new();
    let (mut hit, mut total, mut clock) = (0u64, 0u64, 0u64);
    for r in reqs {
        let capacity = (capacity_tokens / r.block as u64) as usize;
        let run = r
            .keys
            .iter()
            .take_while(|id| last_use.contains_key(id))
            .count();
        hit += r.hit(run);
        total += r.len as u64;
        for id in &r.keys {
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
        let words = |t: &str| t.split(' ').map(str::to_owned).collect::<Vec<_>>();
        let (wa, wb) = (words(&a), words(&b));
        assert_eq!(wa[..512], wb[..512], "text prefixes match too");
        assert_ne!(wa[512..650], wb[512..650]);
        let padded = text(&req(&[], 5));
        assert_eq!(tokenizer.encode(&padded).unwrap().len(), 5, "{padded:?}");
    }

    #[test]
    fn prompt_words_are_short_and_english_like() {
        assert!(
            WORDS
                .iter()
                .all(|w| (1..=4).contains(&w.len()) && w.chars().all(|c| c.is_ascii_alphabetic())),
            "every word is one builtin token"
        );
        // Over a long prompt the words repeat by Zipf's law: "the" is the most frequent,
        // and a few hundred distinct words make up most of the text.
        let t = text(&req(&(0..40).collect::<Vec<_>>(), 20_000));
        let mut counts = std::collections::HashMap::new();
        for w in t.split(' ') {
            *counts.entry(w).or_insert(0usize) += 1;
        }
        let top = counts.iter().max_by_key(|(_, n)| **n).unwrap();
        assert_eq!(*top.0, "the");
        assert!(
            counts.len() < 5_000,
            "{} distinct words in 10,000",
            counts.len()
        );
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
        let bound = infinite_cache_bound(&reqs.map(|r| BlockView::of_trace(&r)));
        assert!((bound - 1024.0 / 3548.0).abs() < 1e-9, "{bound}");
    }

    #[test]
    fn a_small_cache_bounds_the_hit_rate_below_the_infinite_one() {
        let reqs: Vec<_> = (0..20u64)
            .map(|i| BlockView::of_trace(&req(&[i % 5, 100 + i], 1024)))
            .collect();
        let infinite = infinite_cache_bound(&reqs);
        assert!((lru_cache_bound(&reqs, 1 << 30) - infinite).abs() < 1e-9);
        assert!(lru_cache_bound(&reqs, 2 * 512) < infinite);
    }

    #[test]
    fn in_a_tokenizers_units_full_blocks_of_a_shared_prefix_count() {
        let a: Vec<u32> = (0..200).collect();
        let mut b = a[..130].to_vec();
        b.extend(1000..1100);
        let views = [BlockView::of_tokens(&a, 64), BlockView::of_tokens(&b, 64)];
        // b shares 130 tokens with a: two full blocks of 64, the third differs; a's last
        // 8 tokens are a partial block, never cached.
        let bound = infinite_cache_bound(&views);
        assert!((bound - 128.0 / 430.0).abs() < 1e-9, "{bound}");
        assert!(
            lru_cache_bound(&views, 64) < bound,
            "one block of room keeps only the last"
        );
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
