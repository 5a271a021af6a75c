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
//! 3. each piece is looked up in a word cache, and on a miss mapped to byte-level
//!    characters and merged by the tokenizer's own BPE model.
//!
//! Only shapes it knows are taken (see [`ByteLevelBpe::new`]); anything else stays with
//! `tokenizers`. The discipline around it is in [`super::Tokenizer`]: sample texts must
//! come out equal at load, and one call in [`super::AUDIT_EVERY`] is checked while serving.

use std::collections::HashMap;
use std::sync::Mutex;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use serde_json::Value;
use tokenizers::Model;
use tokenizers::models::bpe::BPE;

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
    words: Mutex<Words>,
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
/// the older and the older is dropped, so the cache is bounded and a piece in use stays.
#[derive(Default)]
struct Words {
    new: HashMap<Box<str>, Box<[u32]>>,
    old: HashMap<Box<str>, Box<[u32]>>,
}

impl Words {
    fn get(&mut self, piece: &str, out: &mut Vec<u32>) -> bool {
        if let Some(ids) = self.new.get(piece) {
            out.extend_from_slice(ids);
            return true;
        }
        match self.old.remove_entry(piece) {
            Some((k, ids)) => {
                out.extend_from_slice(&ids);
                self.insert(k, ids);
                true
            }
            None => false,
        }
    }

    fn insert(&mut self, piece: Box<str>, ids: Box<[u32]>) {
        if self.new.len() >= WORDS {
            self.old = std::mem::take(&mut self.new);
        }
        self.new.insert(piece, ids);
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
        Ok(ByteLevelBpe {
            added,
            splits,
            nfc,
            byte_chars: byte_chars(),
            words: Mutex::new(Words::default()),
        })
    }

    /// Token IDs of `text` through `model` (the tokenizer's own BPE), or `None` for text
    /// this path does not take (non-ASCII under NFC).
    pub(crate) fn encode(&self, model: &BPE, text: &str) -> Option<Result<Vec<u32>, String>> {
        if self.nfc && !text.is_ascii() {
            return None;
        }
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        Some(self.added_tokens(0, model, text, &mut out).map(|()| out))
    }

    fn added_tokens(
        &self,
        level: usize,
        model: &BPE,
        text: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), String> {
        let Some(group) = self.added.get(level) else {
            return self.pieces(0, model, text, out);
        };
        let Some((ac, ids)) = group else {
            return self.added_tokens(level + 1, model, text, out);
        };
        let mut prev = 0;
        for m in ac.find_iter(text) {
            if prev < m.start() {
                self.added_tokens(level + 1, model, &text[prev..m.start()], out)?;
            }
            out.push(ids[m.pattern().as_usize()]);
            prev = m.end();
        }
        if prev < text.len() {
            self.added_tokens(level + 1, model, &text[prev..], out)?;
        }
        Ok(())
    }

    fn pieces(
        &self,
        level: usize,
        model: &BPE,
        text: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), String> {
        match self.splits.get(level) {
            Some(re) => re.split(text, |p| self.pieces(level + 1, model, p, out)),
            None => self.word(model, text, out),
        }
    }

    fn word(&self, model: &BPE, piece: &str, out: &mut Vec<u32>) -> Result<(), String> {
        if piece.is_empty() {
            return Ok(());
        }
        let cached = piece.len() <= MAX_WORD;
        if cached && self.lock().get(piece, out) {
            return Ok(());
        }
        let mapped: String = piece
            .bytes()
            .map(|b| self.byte_chars[usize::from(b)])
            .collect();
        let ids: Box<[u32]> = model
            .tokenize(&mapped)
            .map_err(|e| e.to_string())?
            .iter()
            .map(|t| t.id)
            .collect();
        out.extend_from_slice(&ids);
        if cached {
            self.lock().insert(piece.into(), ids);
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Words> {
        self.words.lock().unwrap_or_else(|e| e.into_inner())
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
        let mut out = Vec::new();
        w.insert("hot".into(), [7].into());
        // A stream of distinct pieces, five generations' worth, the hot one read all along.
        for i in 0..5 * WORDS as u32 {
            w.insert(i.to_string().into(), [i].into());
            if i % 1000 == 0 {
                assert!(w.get("hot", &mut out), "a piece in use stays");
            }
            assert!(w.new.len() + w.old.len() <= 2 * WORDS);
        }
        assert!(!w.get("0", &mut out), "an old piece nobody read is gone");
        out.clear();
        assert!(w.get("hot", &mut out));
        assert_eq!(out, [7]);
    }

    #[test]
    fn shapes_it_cannot_run_say_why() {
        let base = |pre: &str, extra: &str| {
            format!(
                r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[{extra}],
                "normalizer":null,"pre_tokenizer":{pre},"post_processor":null,"decoder":null,
                "model":{{"type":"BPE","dropout":null,"vocab":{{}},"merges":[]}}}}"#
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
