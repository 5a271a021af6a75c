//! Tokenizing a prompt once per conversation instead of once per turn.
//!
//! A multi-turn chat resends its whole history with every turn, so most of each prompt's
//! text was tokenized before. [`PrefixTokenizer`] cuts a text at *cut points* that depend
//! only on the text before them (the first space between two letters after every
//! [`CHUNK`] bytes since the previous cut), remembers the tokens of each request's two
//! longest cut prefixes under a hash of each prefix, and on the next turn tokenizes only
//! what follows the longest remembered prefix. Two texts that share a prefix share its cut points, so the next
//! turn of a conversation finds the previous turn's entry.
//!
//! Concatenating the tokens of the pieces equals tokenizing the whole only when the
//! tokenizer never merges across a cut. That holds for the built-in tokenizer (a
//! whitespace run always starts a token) and for the usual BPE pre-tokenizers (see
//! [`cuts`]), but not for every `tokenizer.json`, so the discipline is:
//! - at construction, sample texts are tokenized both ways; any difference turns the
//!   cache off for good (logged once);
//! - while serving, one cache hit in [`AUDIT_EVERY`] is also tokenized whole and
//!   compared; a difference turns the cache off (logged, counted) and that request uses
//!   the whole-text tokens;
//! - the cache holds at most a budget of tokens, and evicts the oldest entries first; a
//!   request keeps its last two cuts (so an edited tail still finds the one before) and
//!   drops the entry it extended, so a conversation holds two entries.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Audit, ChatFormat, ChatMessage, Tokenizer, TokenizerError};

/// Bytes between cut points, at least (a cut waits for the next whitespace).
pub const CHUNK: usize = 2048;

pub use super::AUDIT_EVERY;

/// Default budget: 8 M tokens (32 MiB of token IDs).
pub const DEFAULT_BUDGET_TOKENS: usize = 8 << 20;

/// A tokenizer that reuses the tokens of text prefixes it has seen.
pub struct PrefixTokenizer {
    tokenizer: Arc<Tokenizer>,
    /// How chats become prompt text.
    chat: Arc<ChatFormat>,
    cache: Mutex<Cache>,
    /// Reuse is on while audits find the pieces' tokens equal to the whole's.
    audit: Audit,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl std::fmt::Debug for PrefixTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixTokenizer")
            .field("enabled", &self.enabled())
            .field("stats", &self.stats())
            .finish()
    }
}

/// What the cache did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixStats {
    /// Texts whose prefix was found.
    pub hits: u64,
    /// Texts tokenized from the start.
    pub misses: u64,
    /// Audits that found the pieces' tokens different from the whole's (the cache is
    /// then off).
    pub mismatches: u64,
    /// Tokens held.
    pub tokens: usize,
    /// Audits that found the lean byte-level tokenizer's IDs wrong (it is then off).
    pub lean_mismatches: u64,
}

#[derive(Default)]
struct Cache {
    /// Prefix hash → (prefix length in bytes, tokens of a longer or equal prefix, how
    /// many of them are this prefix's). A conversation's two entries share one
    /// allocation.
    entries: HashMap<u64, (usize, Arc<[u32]>, usize)>,
    /// Insertion order, for eviction.
    order: VecDeque<u64>,
    /// Tokens counted against the budget (shared allocations counted per entry).
    tokens: usize,
    budget: usize,
}

impl Cache {
    fn get(&self, hash: u64, len: usize) -> Option<(Arc<[u32]>, usize)> {
        self.entries
            .get(&hash)
            .filter(|(l, _, _)| *l == len)
            .map(|(_, t, n)| (t.clone(), *n))
    }

    fn remove(&mut self, hash: u64) {
        // Its place in `order` is skipped when reached.
        if let Some((_, _, n)) = self.entries.remove(&hash) {
            self.tokens -= n;
        }
    }

    fn insert(&mut self, hash: u64, len: usize, tokens: Arc<[u32]>, n: usize) {
        self.remove(hash);
        if n > self.budget {
            return;
        }
        while self.tokens + n > self.budget {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            self.remove(old);
        }
        self.tokens += n;
        self.entries.insert(hash, (len, tokens, n));
        self.order.push_back(hash);
        // Removed entries leave their hash in `order`: bounded by compacting.
        if self.order.len() > 2 * self.entries.len() + 1024 {
            let entries = &self.entries;
            self.order.retain(|h| entries.contains_key(h));
        }
    }
}

/// The cut points of `text`: byte offsets of a single ASCII space between two ASCII
/// letters (`word word`), each at least [`CHUNK`] bytes after the previous cut, and short
/// of the end.
///
/// Every pre-tokenizer in use ends a letter run at a space and starts the next piece with
/// it (GPT-2's and Llama 3's / cl100k's ` ?\p{L}+` and `[^\r\n\p{L}\p{N}]?\p{L}+`,
/// DeepSeek's and Qwen's variants, Metaspace's `▁word`), so no piece spans the cut and
/// BPE never merges across it. Any whitespace would not do: cl100k-style patterns put
/// punctuation and the newlines after it in one piece (`,\n`), and some put a space before
/// a newline with it.
fn cuts(text: &str) -> Vec<usize> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = CHUNK;
    while i + 1 < bytes.len() {
        // ASCII bytes on both sides: never inside a UTF-8 sequence.
        if bytes[i] == b' '
            && bytes[i - 1].is_ascii_alphabetic()
            && bytes[i + 1].is_ascii_alphabetic()
        {
            out.push(i);
            i += CHUNK;
        } else {
            i += 1;
        }
    }
    out
}

impl PrefixTokenizer {
    /// Wraps `tokenizer` with a cache of at most `budget_tokens` tokens (0: no cache).
    pub fn new(tokenizer: Arc<Tokenizer>, budget_tokens: usize) -> PrefixTokenizer {
        let t = Self::unchecked(tokenizer, budget_tokens);
        if t.enabled() && !t.cuts_are_exact() {
            tracing::warn!(
                "this tokenizer merges tokens across the space between two words: prompts are \
                 tokenized whole, without reusing a conversation's earlier tokens"
            );
            t.audit.turn_off();
        }
        t
    }

    /// Renders chats with `chat` instead of ChatML.
    pub fn with_chat(mut self, chat: Arc<ChatFormat>) -> PrefixTokenizer {
        self.chat = chat;
        self
    }

    /// How chats are rendered.
    pub fn chat(&self) -> &ChatFormat {
        &self.chat
    }

    /// The prompt text of a chat (the model's template, or ChatML); a chat the template
    /// refuses is the client's error.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, TokenizerError> {
        Ok(self.chat.render(messages)?)
    }

    /// The prompt text of a chat whose last message is continued
    /// ([`ChatFormat::render_continuation`]).
    pub fn render_chat_continuation(
        &self,
        messages: &[ChatMessage],
    ) -> Result<String, TokenizerError> {
        Ok(self.chat.render_continuation(messages)?)
    }

    fn unchecked(tokenizer: Arc<Tokenizer>, budget_tokens: usize) -> PrefixTokenizer {
        PrefixTokenizer {
            tokenizer,
            chat: Arc::new(ChatFormat::ChatMl),
            cache: Mutex::new(Cache {
                budget: budget_tokens,
                ..Cache::default()
            }),
            audit: Audit::new(budget_tokens > 0),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// The tokenizer underneath.
    pub fn inner(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Whether prefixes are reused.
    pub fn enabled(&self) -> bool {
        self.audit.on()
    }

    /// Counters.
    pub fn stats(&self) -> PrefixStats {
        PrefixStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            mismatches: self.audit.mismatches(),
            tokens: self.cache.lock().map_or(0, |c| c.tokens),
            lean_mismatches: self.tokenizer.lean_mismatches(),
        }
    }

    /// Whether cutting sample texts (prose, code, chat turns, odd spacing, non-ASCII)
    /// gives the same tokens as tokenizing them whole.
    fn cuts_are_exact(&self) -> bool {
        let words = [
            "The",
            "router",
            "keeps",
            "each",
            "conversation",
            "on",
            "the",
            "worker",
            "that",
            "holds",
            "its",
            "cache,",
            "fn",
            "main()",
            "{",
            "}",
            "x+=1;",
            "café",
            "日本語",
            "1234",
            "<|im_end|>",
            "<|im_start|>user",
            "🙂",
            "'s",
            "--flag",
            "don't",
        ];
        let gaps = [" ", "  ", "\n", "\n\n", "\t", " \n ", "   "];
        (0..4).all(|sample| {
            let mut text = String::new();
            let mut k = sample * 7;
            while text.len() < 3 * CHUNK + 100 {
                text.push_str(words[k % words.len()]);
                text.push_str(gaps[(k / 3 + sample) % gaps.len()]);
                k += 1;
            }
            let whole = self.tokenizer.encode(&text);
            let pieces = self.encode_pieces(&text, &cuts(&text));
            matches!((whole, pieces), (Ok(w), Ok(p)) if w == p)
        })
    }

    /// `text` tokenized piece by piece, cut at `cuts`.
    fn encode_pieces(&self, text: &str, cuts: &[usize]) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::new();
        let mut start = 0;
        for &c in cuts.iter().chain([&text.len()]) {
            out.extend(self.tokenizer.encode(&text[start..c])?);
            start = c;
        }
        Ok(out)
    }

    /// Token IDs of `text`, reusing a remembered prefix where there is one.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        if !self.enabled() || text.len() <= CHUNK {
            return self.tokenizer.encode(text);
        }
        let cuts = cuts(text);
        let Some(&longest) = cuts.last() else {
            return self.tokenizer.encode(text);
        };
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        let mut hashes = Vec::with_capacity(cuts.len());
        let mut start = 0;
        for &c in &cuts {
            hasher.update(&text.as_bytes()[start..c]);
            hashes.push(hasher.digest());
            start = c;
        }
        let found = {
            let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            (0..cuts.len())
                .rev()
                .find_map(|j| cache.get(hashes[j], cuts[j]).map(|t| (j, t)))
        };
        let (first, mut tokens) = match &found {
            Some((j, (t, n))) => (j + 1, t[..*n].to_vec()),
            None => (0, Vec::new()),
        };
        // The pieces up to the longest cut, counting the tokens at each cut.
        let mut at_cut = vec![0; cuts.len()];
        if let Some((j, (_, n))) = &found {
            at_cut[*j] = *n;
        }
        for k in first..cuts.len() {
            let start = if k == 0 { 0 } else { cuts[k - 1] };
            tokens.extend(self.tokenizer.encode(&text[start..cuts[k]])?);
            at_cut[k] = tokens.len();
        }
        // Remember the longest cut and the one before it (the next turn finds one of them
        // even if this text's last few KiB change, as when an answer is regenerated);
        // the entry they extend goes, so a conversation holds two entries, not one per
        // turn.
        let last = cuts.len() - 1;
        if found.as_ref().is_none_or(|(j, _)| *j < last) {
            let shared: Arc<[u32]> = tokens.as_slice().into();
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            // The entries this one extends: the one found and the cut before it (the
            // earlier turn's pair).
            if let Some((j, _)) = &found {
                // Not the two just inserted below (indices `last - 1` and `last`).
                let end = (*j + 1).min(last.saturating_sub(1));
                for &h in hashes.get(j.saturating_sub(1)..end).unwrap_or_default() {
                    cache.remove(h);
                }
            }
            if last > 0 {
                cache.insert(
                    hashes[last - 1],
                    cuts[last - 1],
                    shared.clone(),
                    at_cut[last - 1],
                );
            }
            cache.insert(hashes[last], longest, shared, at_cut[last]);
        }
        tokens.extend(self.tokenizer.encode(&text[longest..])?);
        if found.is_none() {
            self.misses.fetch_add(1, Ordering::Relaxed);
            return Ok(tokens);
        }
        let hit = self.hits.fetch_add(1, Ordering::Relaxed) + 1;
        self.audit.check(
            hit,
            tokens,
            || self.tokenizer.encode(text),
            "a prompt cut into pieces tokenized differently from the whole: \
             reusing earlier tokens is now off",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A conversation's prompt after `turns` turns: a long system prompt, then turns.
    fn conversation(turns: usize) -> String {
        let mut s = String::from("<|im_start|>system\n");
        for i in 0..400 {
            s.push_str(&format!("Rule {i}: answer briefly and cite sources. "));
        }
        s.push_str("<|im_end|>\n");
        for t in 0..turns {
            s.push_str(&format!(
                "<|im_start|>user\nQuestion {t}: {}<|im_end|>\n<|im_start|>assistant\nAnswer {t}: {}<|im_end|>\n",
                "why is the sky blue? ".repeat(30),
                "Rayleigh scattering of sunlight. ".repeat(40)
            ));
        }
        s.push_str("<|im_start|>assistant\n");
        s
    }

    #[test]
    fn later_turns_reuse_earlier_tokens_and_match_whole_tokenization() {
        let plain = Arc::new(Tokenizer::builtin());
        let t = PrefixTokenizer::new(plain.clone(), DEFAULT_BUDGET_TOKENS);
        assert!(t.enabled(), "the built-in tokenizer cuts exactly");
        for turns in 0..6 {
            let text = conversation(turns);
            assert_eq!(t.encode(&text).unwrap(), plain.encode(&text).unwrap());
        }
        let s = t.stats();
        assert_eq!((s.hits, s.misses, s.mismatches), (5, 1, 0), "{s:?}");
        // A conversation holds two entries (its last two cuts), not one per turn.
        assert!(s.tokens > 0);
        assert!(
            s.tokens <= 2 * plain.encode(&conversation(5)).unwrap().len(),
            "{s:?}"
        );
        // A different conversation shares nothing.
        let other = conversation(2).replace("Rule 0:", "Law 0:");
        assert_eq!(t.encode(&other).unwrap(), plain.encode(&other).unwrap());
        assert_eq!(t.stats().misses, 2);
    }

    #[test]
    fn an_edited_tail_still_reuses_the_prefix_before_it() {
        let plain = Arc::new(Tokenizer::builtin());
        let t = PrefixTokenizer::new(plain.clone(), DEFAULT_BUDGET_TOKENS);
        let first = conversation(3);
        t.encode(&first).unwrap();
        // The last 1,500 bytes are replaced (a regenerated answer), then the chat goes on.
        let edited = format!(
            "{}{}",
            &first[..first.len() - 1500],
            "A different answer, longer than the first one. ".repeat(80)
        );
        assert_eq!(t.encode(&edited).unwrap(), plain.encode(&edited).unwrap());
        assert_eq!(
            (t.stats().hits, t.stats().misses),
            (1, 1),
            "{:?}",
            t.stats()
        );
    }

    #[test]
    fn cut_points_depend_only_on_the_text_before_them() {
        let short = conversation(1);
        let long = conversation(3);
        let (a, b) = (cuts(&short), cuts(&long));
        let shared = a.iter().take_while(|&&c| c < short.len() - 100).count();
        assert!(shared > 2, "{a:?}");
        assert_eq!(a[..shared], b[..shared]);
        assert!(a.windows(2).all(|w| w[1] - w[0] >= CHUNK));
        assert!(cuts("short text").is_empty());
    }

    #[test]
    fn the_budget_bounds_what_is_held() {
        let plain = Arc::new(Tokenizer::builtin());
        let one = plain.encode(&conversation(1)).unwrap().len();
        let t = PrefixTokenizer::new(plain.clone(), one * 2);
        for i in 0..10 {
            let text = conversation(1).replace("Rule 0:", &format!("Variant {i}:"));
            t.encode(&text).unwrap();
            assert!(t.stats().tokens <= one * 2, "{:?}", t.stats());
        }
        assert!(t.stats().tokens > 0);
        let off = PrefixTokenizer::new(plain, 0);
        assert!(!off.enabled());
        off.encode(&conversation(2)).unwrap();
        assert_eq!(off.stats(), PrefixStats::default());
    }

    #[test]
    fn a_tokenizer_that_joins_punctuation_and_newlines_still_reuses_earlier_turns() {
        // cl100k's, Llama 3's and DeepSeek's patterns put punctuation and the newlines
        // after it in one piece (",\n" one token here): a cut at any whitespace would split
        // it, a cut between two words does not.
        let json = r#"{
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "post_processor": null, "decoder": null,
            "pre_tokenizer": {"type": "Split", "behavior": "Isolated", "invert": false,
                "pattern": {"Regex": " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": {"a": 0, "b": 1, " ": 2, ",": 3, "\n": 4, ",\n": 5, " a": 6},
                      "merges": [[",", "\n"], [" ", "a"]]}
        }"#;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, json).unwrap();
        let joining = Arc::new(Tokenizer::from_file(&path).unwrap());
        let t = PrefixTokenizer::new(joining.clone(), DEFAULT_BUDGET_TOKENS);
        assert!(
            t.enabled(),
            "cuts between words are exact for this tokenizer"
        );
        let turn = |n: usize| "ab ab,\nab ba,\n\nb a ".repeat(n);
        for n in [300, 400, 500] {
            let text = turn(n);
            assert_eq!(t.encode(&text).unwrap(), joining.encode(&text).unwrap());
        }
        let s = t.stats();
        assert_eq!((s.hits, s.misses, s.mismatches), (2, 1, 0), "{s:?}");
    }

    #[test]
    fn a_tokenizer_that_merges_across_whitespace_turns_the_cache_off() {
        // Whitespace-free word pieces: "a b" is one token, "a" + " b" are two.
        let json = r#"{
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": {"a": 0, " ": 1, "a ": 2, "b": 3, " a": 4},
                      "merges": [["a", " "], [" ", "a"]]}
        }"#;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, json).unwrap();
        let merging = Arc::new(Tokenizer::from_file(&path).unwrap());
        let text = "a ".repeat(3000);
        let whole = merging.encode(&text).unwrap();
        let t = PrefixTokenizer::new(merging.clone(), DEFAULT_BUDGET_TOKENS);
        assert!(!t.enabled(), "the construction check saw the merge");
        assert_eq!(t.encode(&text).unwrap(), whole);

        // Had the check missed it, the audit catches it within AUDIT_EVERY hits, answers
        // that request with the whole text's tokens, and turns the cache off.
        let t = PrefixTokenizer::unchecked(merging, DEFAULT_BUDGET_TOKENS);
        assert_ne!(t.encode(&text).unwrap(), whole, "cut tokens differ");
        for _ in 1..AUDIT_EVERY {
            assert_ne!(t.encode(&text).unwrap(), whole);
        }
        assert_eq!(t.encode(&text).unwrap(), whole, "the audited hit");
        assert!(!t.enabled());
        assert_eq!(t.stats().mismatches, 1);
        assert_eq!(t.encode(&text).unwrap(), whole);
    }
}
