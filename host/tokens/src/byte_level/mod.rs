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
//! 3. a piece of one or two bytes (most of them in code, numbers and short words) is read
//!    from a table made at load; any other is looked up in a word cache, and on a miss its
//!    bytes become their tokens and are merged by the model's merges, lowest rank first,
//!    leftmost among equals, with `tokenizers`' own algorithm (see [`Merges`]) but on token
//!    IDs, without its per-character vocabulary lookups, its second cache and a `String`
//!    per token.
//!
//! Only shapes it knows are taken (see [`ByteLevelBpe::new`]); anything else stays with
//! `tokenizers`. The discipline around it is in [`super::Tokenizer`]: sample texts must
//! come out equal at load, and one call in [`super::AUDIT_EVERY`] is checked while serving.
//!
//! - `merges`: the vocabulary and merge ranks, and the merge itself;
//! - `splitter`: the pre-tokenizer's splits on the `regex` crate's automata;
//! - `words`: the two-generation word cache and its lock discipline.

mod merges;
mod splitter;
#[cfg(test)]
mod tests;
mod words;

use std::hash::BuildHasher;
use std::sync::Mutex;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use serde_json::Value;

use merges::{Buffers, Merges};
use splitter::Splitter;
use words::{Hold, Scratch, Words};

/// The model's maps, on the hot path: a fast hash, seeded per process.
pub(super) type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// Pieces longer than this (bytes) are not cached.
pub(super) const MAX_WORD: usize = 128;

/// Words per cache generation: at most twice this many are held.
pub(super) const WORDS: usize = 1 << 16;

/// GPT-2's pre-tokenizer pattern, which `ByteLevel` with `use_regex` applies.
pub(super) const GPT2_PATTERN: &str =
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

/// The parts of a `tokenizer.json` this path reads; the rest is skipped unparsed.
#[derive(serde::Deserialize)]
struct FileShape {
    #[serde(default)]
    truncation: Value,
    #[serde(default)]
    padding: Value,
    #[serde(default)]
    normalizer: Value,
    #[serde(default)]
    pre_tokenizer: Value,
    #[serde(default)]
    added_tokens: Value,
    model: ModelShape,
}

/// A model as this path reads it: a BPE's vocabulary straight into a hash map (`None`
/// when it is not a map, as a Unigram's list is: that model is then refused by its type).
#[derive(serde::Deserialize)]
pub(super) struct ModelShape {
    #[serde(rename = "type", default)]
    pub(super) kind: Value,
    #[serde(default)]
    pub(super) dropout: Value,
    #[serde(default)]
    pub(super) continuing_subword_prefix: Value,
    #[serde(default)]
    pub(super) end_of_word_suffix: Value,
    #[serde(default)]
    pub(super) byte_fallback: Value,
    #[serde(default)]
    pub(super) ignore_merges: Value,
    #[serde(default, deserialize_with = "vocab_if_a_map")]
    pub(super) vocab: Option<HashMap<Box<str>, u32>>,
    #[serde(default)]
    pub(super) merges: Value,
}

/// A vocabulary map of token → ID, or `None` for anything else (skipped).
fn vocab_if_a_map<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<HashMap<Box<str>, u32>>, D::Error> {
    struct Lenient;
    impl<'de> serde::de::Visitor<'de> for Lenient {
        type Value = Option<HashMap<Box<str>, u32>>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a vocabulary")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut m: A,
        ) -> Result<Self::Value, A::Error> {
            let mut vocab = HashMap::default();
            while let Some((token, id)) = m.next_entry::<Box<str>, u32>()? {
                vocab.insert(token, id);
            }
            Ok(Some(vocab))
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut s: A,
        ) -> Result<Self::Value, A::Error> {
            while s.next_element::<serde::de::IgnoredAny>()?.is_some() {}
            Ok(None)
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    }
    d.deserialize_any(Lenient)
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

/// Whether a normalizer this path can run is NFC (else none): no normalizer, NFC, or a
/// `Sequence` of those (DeepSeek's files have an empty one).
fn normalizer_is_nfc(v: &Value) -> Result<bool, String> {
    match field(v, "type").as_str() {
        None => Ok(false),
        Some("NFC") => Ok(true),
        Some("Sequence") => field(v, "normalizers")
            .as_array()
            .ok_or("a Sequence normalizer without normalizers")?
            .iter()
            .try_fold(false, |nfc, n| Ok(normalizer_is_nfc(n)? || nfc)),
        Some(other) => Err(format!("normalizer {other}")),
    }
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
        // Into the shape this path reads, not a `Value` tree: a large vocabulary as a
        // `Value` is a B-tree of strings, most of the load's time and its memory peak.
        let v: FileShape = serde_json::from_str(json).map_err(|e| e.to_string())?;
        let model = &v.model;
        if model.kind.as_str() != Some("BPE") {
            return Err(format!("model {:?}", model.kind));
        }
        if model.dropout.as_f64().is_some_and(|d| d > 0.0) {
            return Err("BPE dropout".into());
        }
        for (key, value) in [("truncation", &v.truncation), ("padding", &v.padding)] {
            if !value.is_null() {
                return Err(format!("{key} is set"));
            }
        }
        let nfc = normalizer_is_nfc(&v.normalizer)?;
        let mut splits = Vec::new();
        if !pre_tokenizer_splits(&v.pre_tokenizer, &mut splits)? {
            return Err("no ByteLevel pre-tokenizer".into());
        }
        let mut groups: [(Vec<String>, Vec<u32>); 2] = Default::default();
        for t in v.added_tokens.as_array().into_iter().flatten() {
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
            merges: Merges::new(v.model, &byte_chars)?,
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
        if piece.is_empty() || self.merges.short(piece.as_bytes(), out) {
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
