//! A lean encoder for byte-level BPE `tokenizer.json`s (GPT-2's family: Llama 3, Qwen,
//! Mistral's newer models, and what `tools/bpe-tokenizer.sh` writes), giving the same IDs
//! as the `tokenizers` crate at a fraction of its cost.
//!
//! `tokenizers` builds an `Encoding` for every call: offsets, alignments and a `String`
//! per token, most of its time in the allocator. The router wants only IDs, so this path
//! runs the same steps without the bookkeeping:
//! 1. added tokens (`<|im_start|>`...) are cut out, leftmost-longest, the unnormalized
//!    ones first and then the normalized ones, as `tokenizers` does;
//! 2. what is left is split by the pre-tokenizer's regexes (pieces between matches kept,
//!    as `Split` with `Isolated` does), see [`Splitter`];
//! 3. each piece is looked up in a word cache, and on a miss its bytes become their
//!    tokens and are merged by the model's merges, lowest rank first, leftmost among equals,
//!    with `tokenizers`' own algorithm (see [`Merges`]) but on token IDs, without its
//!    per-character vocabulary lookups, its second cache and a `String` per token.
//!
//! Only shapes it knows are taken (see [`ByteLevelBpe::new`]); anything else stays with
//! `tokenizers`. The discipline around it is in [`super::Tokenizer`]: sample texts must
//! come out equal at load, and one call in [`super::AUDIT_EVERY`] is checked while serving.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::hash::BuildHasher;
use std::sync::{Mutex, MutexGuard, TryLockError};

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use serde_json::Value;

/// The model's maps, on the hot path: a fast hash, seeded per process.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// Pieces longer than this (bytes) are not cached.
const MAX_WORD: usize = 128;

/// Words per cache generation: at most twice this many are held.
const WORDS: usize = 1 << 16;

/// GPT-2's pre-tokenizer pattern, which `ByteLevel` with `use_regex` applies.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The byte-level BPE steps of one `tokenizer.json`.
pub(crate) struct ByteLevelBpe {
    /// Added tokens and their IDs: unnormalized ones, then normalized ones.
    added: [Option<(AhoCorasick, Vec<u32>)>; 2],
    /// Pre-tokenizer regexes, applied in turn.
    splits: Vec<Splitter>,
    /// The normalizer is NFC: only ASCII text, which NFC leaves unchanged, is taken.
    nfc: bool,
    /// GPT-2's byte-to-character table.
    byte_chars: [char; 256],
    merges: Merges,
    words: Mutex<Words>,
    /// Hashes pieces for `words`, seeded per process.
    hasher: foldhash::fast::RandomState,
}

/// The BPE model, by token ID.
struct Merges {
    /// The token of each byte's character.
    bytes: [u32; 256],
    /// Rank (place in the file's list) and product of each mergeable pair of tokens.
    pairs: HashMap<(u32, u32), (u32, u32)>,
    /// With `ignore_merges`, the vocabulary: a piece that is a token is not merged.
    whole: Option<HashMap<Box<str>, u32>>,
}

/// One symbol of a word being merged: a token and its live neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: usize,
    next: usize,
    live: bool,
}

/// No neighbour.
const NONE: usize = usize::MAX;

/// Buffers reused across the words of one call.
#[derive(Default)]
struct Buffers {
    symbols: Vec<Symbol>,
    /// Pending merges, lowest (rank, position) first, with the product they expect.
    queue: BinaryHeap<Reverse<(u32, usize, u32)>>,
    mapped: String,
}

impl Merges {
    fn new(model: &Value, byte_chars: &[char; 256]) -> Result<Merges, String> {
        for key in ["continuing_subword_prefix", "end_of_word_suffix"] {
            if !field(model, key).as_str().is_none_or(str::is_empty) {
                return Err(format!("BPE with {key}"));
            }
        }
        if !is_false(field(model, "byte_fallback")) {
            return Err("BPE with byte_fallback".into());
        }
        let vocab: HashMap<Box<str>, u32> = field(model, "vocab")
            .as_object()
            .ok_or("a BPE without a vocabulary")?
            .iter()
            .map(|(k, v)| {
                let id = v.as_u64().and_then(|id| u32::try_from(id).ok());
                Ok((k.as_str().into(), id.ok_or("a vocabulary ID")?))
            })
            .collect::<Result<_, String>>()?;
        let id = |token: &str| {
            vocab
                .get(token)
                .copied()
                .ok_or_else(|| format!("{token:?} is not in the vocabulary"))
        };
        let mut bytes = [0; 256];
        for (b, c) in bytes.iter_mut().zip(byte_chars) {
            *b = id(c.encode_utf8(&mut [0; 4]))?;
        }
        // As `tokenizers` reads them: pairs, or "a b" lines after any "#version" line;
        // a pair listed twice keeps its last rank.
        let listed = field(model, "merges")
            .as_array()
            .ok_or("a BPE without merges")?;
        let mut pairs = HashMap::default();
        let lines = listed
            .iter()
            .filter(|m| !m.as_str().is_some_and(|l| l.starts_with("#version")));
        for (rank, m) in lines.enumerate() {
            let (a, b) = match (m.as_str(), m.as_array().map(Vec::as_slice)) {
                (Some(line), _) => match line.split(' ').collect::<Vec<_>>()[..] {
                    [a, b] => (a, b),
                    _ => return Err(format!("merge {line:?}")),
                },
                (None, Some([a, b])) => (
                    a.as_str().ok_or("a merge of non-strings")?,
                    b.as_str().ok_or("a merge of non-strings")?,
                ),
                _ => return Err(format!("merge {m}")),
            };
            let rank = u32::try_from(rank).map_err(|_| "too many merges")?;
            pairs.insert((id(a)?, id(b)?), (rank, id(&format!("{a}{b}"))?));
        }
        let whole = (field(model, "ignore_merges").as_bool() == Some(true)).then_some(vocab);
        Ok(Merges {
            bytes,
            pairs,
            whole,
        })
    }

    /// The tokens of `piece` into `out`: `tokenizers`' `Word::merge_all` on a queue of
    /// merges ordered by rank then position, an entry whose pair has since changed skipped.
    fn tokenize(
        &self,
        piece: &[u8],
        byte_chars: &[char; 256],
        s: &mut Buffers,
        out: &mut Vec<u32>,
    ) {
        if let Some(vocab) = &self.whole {
            s.mapped.clear();
            s.mapped
                .extend(piece.iter().map(|&b| byte_chars[usize::from(b)]));
            if let Some(&id) = vocab.get(s.mapped.as_str()) {
                out.push(id);
                return;
            }
        }
        let n = piece.len();
        s.symbols.clear();
        s.symbols
            .extend(piece.iter().enumerate().map(|(i, &b)| Symbol {
                id: self.bytes[usize::from(b)],
                prev: i.checked_sub(1).unwrap_or(NONE),
                next: if i + 1 < n { i + 1 } else { NONE },
                live: true,
            }));
        s.queue.clear();
        for (i, w) in s.symbols.windows(2).enumerate() {
            if let Some(&(rank, id)) = self.pairs.get(&(w[0].id, w[1].id)) {
                s.queue.push(Reverse((rank, i, id)));
            }
        }
        let sym = &mut s.symbols;
        while let Some(Reverse((_, pos, product))) = s.queue.pop() {
            let cur = sym[pos];
            if !cur.live || cur.next == NONE {
                continue;
            }
            let right = sym[cur.next];
            if self
                .pairs
                .get(&(cur.id, right.id))
                .is_none_or(|&(_, id)| id != product)
            {
                continue;
            }
            sym[pos].id = product;
            sym[pos].next = right.next;
            sym[cur.next].live = false;
            if right.next != NONE {
                sym[right.next].prev = pos;
                if let Some(&(rank, id)) = self.pairs.get(&(product, sym[right.next].id)) {
                    s.queue.push(Reverse((rank, pos, id)));
                }
            }
            if cur.prev != NONE
                && let Some(&(rank, id)) = self.pairs.get(&(sym[cur.prev].id, product))
            {
                s.queue.push(Reverse((rank, cur.prev, id)));
            }
        }
        out.extend(sym.iter().filter(|s| s.live).map(|s| s.id));
    }
}

/// The usual pre-tokenizer patterns (GPT-2's, Llama 3's, Qwen's, tiktoken's) end in
/// `\s+(?!\S)|\s+`: a whitespace run before a word leaves its last character to the word.
/// The lookahead makes `fancy-regex` run its backtracking VM over the whole text, most of
/// this path's time, so such a pattern runs on the `regex` crate's automata without it,
/// and the lookahead is applied afterwards: a whitespace run of two or more characters
/// that the last alternative matched, followed by more text, gives up its last character.
enum Splitter {
    /// Any other pattern, as `tokenizers` runs it.
    Fancy(fancy_regex::Regex),
    Plain {
        /// The pattern with `\s+` for its last two alternatives.
        re: regex::Regex,
        /// The alternatives before them: a whitespace run one of these matched is kept.
        earlier: Option<regex::Regex>,
    },
}

/// How the usual patterns end.
const LOOKAHEAD_TAIL: &str = r"|\s+(?!\S)|\s+";

impl Splitter {
    fn new(pattern: &str) -> Result<Splitter, String> {
        let plain = pattern.strip_suffix(LOOKAHEAD_TAIL).and_then(|head| {
            let re = regex::Regex::new(&format!("{head}|\\s+")).ok()?;
            let earlier = if head.is_empty() {
                None
            } else {
                Some(regex::Regex::new(head).ok()?)
            };
            Some(Splitter::Plain { re, earlier })
        });
        match plain {
            Some(p) => Ok(p),
            None => fancy_regex::Regex::new(pattern)
                .map(Splitter::Fancy)
                .map_err(|e| format!("pattern {pattern:?}: {e}")),
        }
    }

    /// Calls `piece` with each match of `text` and each stretch between matches, in order.
    fn split(
        &self,
        text: &str,
        mut piece: impl FnMut(&str) -> Result<(), String>,
    ) -> Result<(), String> {
        let mut prev = 0;
        let mut pos = 0;
        while pos <= text.len() {
            let (start, end) = match self {
                Splitter::Fancy(re) => match re.find_from_pos(text, pos) {
                    Ok(Some(m)) => (m.start(), m.end()),
                    Ok(None) => break,
                    Err(e) => return Err(e.to_string()),
                },
                Splitter::Plain { re, earlier } => {
                    let Some(m) = re.find_at(text, pos) else {
                        break;
                    };
                    let (start, mut end) = (m.start(), m.end());
                    let run = m.as_str();
                    if end < text.len()
                        && run.chars().all(char::is_whitespace)
                        && run.chars().nth(1).is_some()
                        && earlier.as_ref().is_none_or(|e| {
                            e.find_at(text, start).is_none_or(|e| e.start() != start)
                        })
                    {
                        end = start + run.char_indices().last().map_or(0, |(i, _)| i);
                    }
                    (start, end)
                }
            };
            if prev < start {
                piece(&text[prev..start])?;
            }
            if start < end {
                piece(&text[start..end])?;
                pos = end;
            } else {
                // An empty match: move on a character.
                pos = end + text[end..].chars().next().map_or(1, char::len_utf8);
            }
            prev = end;
        }
        if prev < text.len() {
            piece(&text[prev..])?;
        }
        Ok(())
    }
}

/// Token IDs of recent pieces, in two generations: when the newer one is full it becomes
/// the older and the older is emptied, so the cache is bounded and a piece in use stays.
#[derive(Default)]
struct Words {
    new: Generation,
    old: Generation,
}

/// A generation's pieces and IDs live in two buffers that keep their memory across
/// rollovers: once grown, an insert allocates nothing and a rollover frees nothing.
#[derive(Default)]
struct Generation {
    table: hashbrown::HashTable<Entry>,
    text: String,
    ids: Vec<u32>,
}

/// A piece's hash and where its text and IDs are in the generation's buffers.
#[derive(Clone, Copy)]
struct Entry {
    hash: u64,
    text: (u32, u32),
    ids: (u32, u32),
}

/// `len` items from `start` in a buffer. Generations hold at most [`WORDS`] pieces of at
/// most [`MAX_WORD`] bytes (and as many IDs), far below `u32::MAX`.
fn span(start: usize, len: usize) -> (u32, u32) {
    (start as u32, (start + len) as u32)
}

fn at<T>(buf: &[T], (start, end): (u32, u32)) -> &[T] {
    &buf[start as usize..end as usize]
}

impl Generation {
    fn find(&self, hash: u64, piece: &str) -> Option<&[u32]> {
        self.table
            .find(hash, |e| {
                at(self.text.as_bytes(), e.text) == piece.as_bytes()
            })
            .map(|e| at(&self.ids, e.ids))
    }

    fn insert(&mut self, hash: u64, piece: &str, ids: &[u32]) {
        let entry = Entry {
            hash,
            text: span(self.text.len(), piece.len()),
            ids: span(self.ids.len(), ids.len()),
        };
        self.text.push_str(piece);
        self.ids.extend_from_slice(ids);
        self.table.insert_unique(hash, entry, |e| e.hash);
    }

    fn clear(&mut self) {
        self.table.clear();
        self.text.clear();
        self.ids.clear();
    }
}

impl Words {
    /// The IDs of `piece` (whose hash is `hash`) into `out`, if held.
    fn get(&mut self, hash: u64, piece: &str, out: &mut Vec<u32>) -> bool {
        if let Some(ids) = self.new.find(hash, piece) {
            out.extend_from_slice(ids);
            return true;
        }
        let Some(ids) = self.old.find(hash, piece) else {
            return false;
        };
        let start = out.len();
        out.extend_from_slice(ids);
        self.insert(hash, piece, &out[start..]);
        true
    }

    fn insert(&mut self, hash: u64, piece: &str, ids: &[u32]) {
        if self.new.table.len() >= WORDS {
            std::mem::swap(&mut self.new, &mut self.old);
            self.new.clear();
        }
        self.new.insert(hash, piece, ids);
    }
}

/// One call's merge buffers and its hold on the word cache.
struct Scratch<'a> {
    buffers: Buffers,
    hold: Hold<'a>,
}

/// A call's hold on the word cache: taken at the call's first cacheable piece and given
/// back every [`HOLD`] pieces, and never waited for: while another call holds it, pieces
/// are merged without it (and not added to it).
struct Hold<'a> {
    words: &'a Mutex<Words>,
    held: Option<MutexGuard<'a, Words>>,
    /// Pieces looked up since the cache was taken.
    uses: u32,
}

/// Pieces a call looks up in the word cache before giving it back.
const HOLD: u32 = 64;

impl Hold<'_> {
    fn words(&mut self) -> Option<&mut Words> {
        if self.uses >= HOLD {
            self.held = None;
            self.uses = 0;
        }
        if self.held.is_none() {
            self.held = match self.words.try_lock() {
                Ok(w) => Some(w),
                Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
                Err(TryLockError::WouldBlock) => None,
            };
        }
        let w = self.held.as_deref_mut()?;
        self.uses += 1;
        Some(w)
    }
}

/// GPT-2's table: printable bytes map to themselves, the rest to 256 and up, in order.
fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).expect("below the surrogates")
        };
    }
    table
}

fn field<'a>(v: &'a Value, key: &str) -> &'a Value {
    v.get(key).unwrap_or(&Value::Null)
}

fn is_false(v: &Value) -> bool {
    matches!(v, Value::Null | Value::Bool(false))
}

/// The regexes of a pre-tokenizer, if this path can run it, into `out`; whether it has a
/// `ByteLevel` step.
fn pre_tokenizer_splits(v: &Value, out: &mut Vec<Splitter>) -> Result<bool, String> {
    match field(v, "type").as_str() {
        Some("ByteLevel") => {
            if !is_false(field(v, "add_prefix_space")) {
                return Err("ByteLevel with add_prefix_space".into());
            }
            if field(v, "use_regex").as_bool() != Some(false) {
                out.push(Splitter::new(GPT2_PATTERN)?);
            }
            Ok(true)
        }
        Some("Split") => {
            if field(v, "behavior").as_str() != Some("Isolated") || !is_false(field(v, "invert")) {
                return Err("a Split other than Isolated".into());
            }
            let pattern = field(v, "pattern");
            let p = match (
                field(pattern, "Regex").as_str(),
                field(pattern, "String").as_str(),
            ) {
                (Some(p), _) => p.to_string(),
                (None, Some(s)) => fancy_regex::escape(s).into_owned(),
                _ => return Err("a Split without a pattern".into()),
            };
            out.push(Splitter::new(&p)?);
            Ok(false)
        }
        Some("Sequence") => field(v, "pretokenizers")
            .as_array()
            .ok_or("a Sequence without pretokenizers")?
            .iter()
            .try_fold(false, |seen, p| Ok(pre_tokenizer_splits(p, out)? || seen)),
        other => Err(format!("pre-tokenizer {other:?}")),
    }
}

impl ByteLevelBpe {
    /// The lean path for `json` (a `tokenizer.json`), or why it cannot take it: the model
    /// must be a BPE without dropout; the pre-tokenizer `ByteLevel` (without a prefix
    /// space) or a sequence of `Split` (isolated) and `ByteLevel`; the normalizer none or
    /// NFC; added tokens without strip or single-word rules; no truncation or padding.
    pub(crate) fn new(json: &str) -> Result<ByteLevelBpe, String> {
        let v: Value = serde_json::from_str(json).map_err(|e| e.to_string())?;
        let model = field(&v, "model");
        if field(model, "type").as_str() != Some("BPE") {
            return Err(format!("model {:?}", field(model, "type")));
        }
        if field(model, "dropout").as_f64().is_some_and(|d| d > 0.0) {
            return Err("BPE dropout".into());
        }
        for key in ["truncation", "padding"] {
            if !field(&v, key).is_null() {
                return Err(format!("{key} is set"));
            }
        }
        let nfc = match field(field(&v, "normalizer"), "type").as_str() {
            None => false,
            Some("NFC") => true,
            Some(other) => return Err(format!("normalizer {other}")),
        };
        let mut splits = Vec::new();
        if !pre_tokenizer_splits(field(&v, "pre_tokenizer"), &mut splits)? {
            return Err("no ByteLevel pre-tokenizer".into());
        }
        let mut groups: [(Vec<String>, Vec<u32>); 2] = Default::default();
        for t in field(&v, "added_tokens").as_array().into_iter().flatten() {
            if ["lstrip", "rstrip", "single_word"]
                .iter()
                .any(|k| !is_false(field(t, k)))
            {
                return Err("an added token with strip or single-word rules".into());
            }
            let (Some(content), Some(id)) = (field(t, "content").as_str(), field(t, "id").as_u64())
            else {
                return Err("an added token without content or id".into());
            };
            if content.is_empty() {
                continue;
            }
            let g = &mut groups[usize::from(field(t, "normalized").as_bool() == Some(true))];
            g.0.push(content.to_string());
            g.1.push(u32::try_from(id).map_err(|_| "an added token's id")?);
        }
        let added = groups.map(|(contents, ids)| {
            (!contents.is_empty()).then(|| {
                let ac = AhoCorasickBuilder::new()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(&contents)
                    .expect("literal patterns");
                (ac, ids)
            })
        });
        let byte_chars = byte_chars();
        Ok(ByteLevelBpe {
            added,
            splits,
            nfc,
            merges: Merges::new(model, &byte_chars)?,
            byte_chars,
            words: Mutex::new(Words::default()),
            hasher: Default::default(),
        })
    }

    /// Runs `f` while the word cache is taken, as another call holding it would, and
    /// returns the number of pieces the cache held before and after.
    #[cfg(test)]
    pub(crate) fn with_words_taken<R>(&self, f: impl FnOnce() -> R) -> (R, usize, usize) {
        let held = |w: &Words| w.new.table.len() + w.old.table.len();
        let words = self.words.lock().unwrap();
        let before = held(&words);
        let r = f();
        let after = held(&words);
        (r, before, after)
    }

    /// Token IDs of `text`, or `None` for text this path does not take (non-ASCII under
    /// NFC).
    pub(crate) fn encode(&self, text: &str) -> Option<Result<Vec<u32>, String>> {
        if self.nfc && !text.is_ascii() {
            return None;
        }
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut scratch = Scratch {
            buffers: Buffers::default(),
            hold: Hold {
                words: &self.words,
                held: None,
                uses: 0,
            },
        };
        Some(
            self.added_tokens(0, text, &mut scratch, &mut out)
                .map(|()| out),
        )
    }

    fn added_tokens(
        &self,
        level: usize,
        text: &str,
        s: &mut Scratch,
        out: &mut Vec<u32>,
    ) -> Result<(), String> {
        let Some(group) = self.added.get(level) else {
            return self.pieces(0, text, s, out);
        };
        let Some((ac, ids)) = group else {
            return self.added_tokens(level + 1, text, s, out);
        };
        let mut prev = 0;
        for m in ac.find_iter(text) {
            if prev < m.start() {
                self.added_tokens(level + 1, &text[prev..m.start()], s, out)?;
            }
            out.push(ids[m.pattern().as_usize()]);
            prev = m.end();
        }
        if prev < text.len() {
            self.added_tokens(level + 1, &text[prev..], s, out)?;
        }
        Ok(())
    }

    fn pieces(
        &self,
        level: usize,
        text: &str,
        s: &mut Scratch,
        out: &mut Vec<u32>,
    ) -> Result<(), String> {
        match self.splits.get(level) {
            Some(re) => re.split(text, |p| self.pieces(level + 1, p, s, out)),
            None => {
                self.word(text, s, out);
                Ok(())
            }
        }
    }

    fn word(&self, piece: &str, s: &mut Scratch, out: &mut Vec<u32>) {
        if piece.is_empty() {
            return;
        }
        let mut words = if piece.len() <= MAX_WORD {
            s.hold.words()
        } else {
            None
        };
        let hash = self.hasher.hash_one(piece);
        if let Some(w) = &mut words
            && w.get(hash, piece, out)
        {
            return;
        }
        let start = out.len();
        self.merges
            .tokenize(piece.as_bytes(), &self.byte_chars, &mut s.buffers, out);
        if let Some(w) = words {
            w.insert(hash, piece, &out[start..]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_table_is_gpt2s() {
        let t = byte_chars();
        assert_eq!(t[usize::from(b'a')], 'a');
        assert_eq!(t[usize::from(b' ')], 'Ġ');
        assert_eq!(t[usize::from(b'\n')], 'Ċ');
        let distinct: std::collections::HashSet<char> = t.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }

    #[test]
    fn the_word_cache_holds_at_most_two_generations_and_keeps_pieces_in_use() {
        let mut w = Words::default();
        let hasher = foldhash::fast::RandomState::default();
        let get = |w: &mut Words, piece: &str| {
            let mut out = Vec::new();
            w.get(hasher.hash_one(piece), piece, &mut out)
                .then_some(out)
        };
        w.insert(hasher.hash_one("hot"), "hot", &[7, 8]);
        // A stream of distinct pieces, five generations' worth, the hot one read all along.
        let mut text_capacity = 0;
        for i in 0..5 * WORDS as u32 {
            let piece = i.to_string();
            w.insert(hasher.hash_one(&piece), &piece, &[i]);
            if i % 1000 == 0 {
                assert_eq!(get(&mut w, "hot"), Some(vec![7, 8]), "a piece in use stays");
            }
            assert!(w.new.table.len() + w.old.table.len() <= 2 * WORDS);
            if i == 2 * WORDS as u32 {
                text_capacity = w.new.text.capacity() + w.old.text.capacity();
            }
        }
        assert_eq!(get(&mut w, "0"), None, "an old piece nobody read is gone");
        assert_eq!(
            get(&mut w, &(5 * WORDS - 1).to_string()),
            Some(vec![5 * WORDS as u32 - 1])
        );
        // Once grown, the buffers are reused: later generations (longer numbers) added
        // at most one byte per piece.
        let now = w.new.text.capacity() + w.old.text.capacity();
        assert!(
            now <= text_capacity + 2 * WORDS,
            "{now} against {text_capacity}"
        );
    }

    #[test]
    fn shapes_it_cannot_run_say_why() {
        let vocab = serde_json::to_string(
            &byte_chars()
                .iter()
                .enumerate()
                .map(|(id, c)| (c.to_string(), id))
                .collect::<std::collections::HashMap<_, _>>(),
        )
        .unwrap();
        let base = |pre: &str, extra: &str| {
            format!(
                r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[{extra}],
                "normalizer":null,"pre_tokenizer":{pre},"post_processor":null,"decoder":null,
                "model":{{"type":"BPE","dropout":null,"vocab":{vocab},"merges":[]}}}}"#
            )
        };
        let bl = r#"{"type":"ByteLevel","add_prefix_space":false,"use_regex":true}"#;
        assert!(ByteLevelBpe::new(&base(bl, "")).is_ok());
        let prefix = r#"{"type":"ByteLevel","add_prefix_space":true,"use_regex":true}"#;
        let e = ByteLevelBpe::new(&base(prefix, "")).err().unwrap();
        assert!(e.contains("add_prefix_space"), "{e}");
        let meta = r#"{"type":"Metaspace","replacement":"▁"}"#;
        assert!(ByteLevelBpe::new(&base(meta, "")).is_err());
        let lstrip = r#"{"id":5,"content":"<mask>","lstrip":true,"rstrip":false,"single_word":false,"normalized":false,"special":true}"#;
        let e = ByteLevelBpe::new(&base(bl, lstrip)).err().unwrap();
        assert!(e.contains("strip"), "{e}");
    }
}
