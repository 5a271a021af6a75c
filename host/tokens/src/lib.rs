//! Text to token IDs, shared by the router and the mock worker so that both cut a prompt
//! into the same blocks, and [`openai`], the OpenAI-compatible request format both read.
//!
//! - [`Tokenizer::builtin`] needs no files: text is split into words, numbers,
//!   punctuation and whitespace runs; words longer than four characters are cut into
//!   four-character pieces (about one token per four characters of English, like common
//!   BPE vocabularies); each piece maps to an ID by a hash. Deterministic, and equal text
//!   prefixes give equal token prefixes.
//! - [`Tokenizer::from_file`] loads a Hugging Face `tokenizer.json`.
//!
//! Chat messages are rendered into one prompt with the model's chat template, or ChatML
//! markers without one, see [`ChatFormat`].

mod byte_level;
pub mod chat;
pub mod openai;
pub mod prefix;

pub use chat::{ChatFormat, ChatTemplateError};
pub use prefix::PrefixTokenizer;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// One call in this many of a checked fast path (the lean byte-level encoder, a reused
/// prefix) is also done the plain way and compared.
pub const AUDIT_EVERY: u64 = 256;

/// A fast path's standing: on until an audit finds its tokens differ from the plain way's.
struct Audit {
    on: AtomicBool,
    mismatches: AtomicU64,
}

impl Audit {
    fn new(on: bool) -> Audit {
        Audit {
            on: AtomicBool::new(on),
            mismatches: AtomicU64::new(0),
        }
    }

    fn on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    fn turn_off(&self) {
        self.on.store(false, Ordering::Relaxed);
    }

    fn mismatches(&self) -> u64 {
        self.mismatches.load(Ordering::Relaxed)
    }

    /// `fast`, the fast path's `n`th result (from 1); every [`AUDIT_EVERY`]th is compared
    /// with `plain()`, and a difference turns the path off for good, is counted and
    /// logged (`warning`), and that call gets the plain tokens.
    fn check<E>(
        &self,
        n: u64,
        fast: Vec<u32>,
        plain: impl FnOnce() -> Result<Vec<u32>, E>,
        warning: &str,
    ) -> Result<Vec<u32>, E> {
        if !n.is_multiple_of(AUDIT_EVERY) {
            return Ok(fast);
        }
        let plain = plain()?;
        if plain != fast {
            self.mismatches.fetch_add(1, Ordering::Relaxed);
            self.turn_off();
            tracing::warn!("{warning}");
            return Ok(plain);
        }
        Ok(fast)
    }
}

/// A `tokenizer.json`'s size bound: the largest models ship 10–35 MB.
pub const MAX_TOKENIZER_FILE: u64 = 64 << 20;

/// A chat template's (or `tokenizer_config.json`'s) size bound.
pub const MAX_TEMPLATE_FILE: u64 = 16 << 20;

/// A file the operator named, at most `limit` bytes of UTF-8 (a path naming `/dev/zero`
/// or a huge file by mistake is refused, not read to exhaustion).
pub(crate) fn read_text(path: &Path, limit: u64) -> Result<String, String> {
    switchyard_bounded::files::read_to_string(path, limit)
}

/// Vocabulary size of the built-in tokenizer.
pub const BUILTIN_VOCAB: u32 = 100_000;

/// A tokenizer.
pub enum Tokenizer {
    /// The file-free default.
    Builtin,
    /// A Hugging Face tokenizer.
    HuggingFace(Box<HuggingFace>),
}

/// A `tokenizer.json`, with the lean byte-level path when it takes this file.
pub struct HuggingFace {
    hf: tokenizers::Tokenizer,
    /// The lean path, used while `audit` says it agrees with `hf`.
    fast: Option<byte_level::ByteLevelBpe>,
    audit: Audit,
    fast_calls: AtomicU64,
}

impl HuggingFace {
    fn new(hf: tokenizers::Tokenizer, json: &str, path: &Path) -> HuggingFace {
        let t = HuggingFace::unchecked(hf, json, path);
        if t.fast.is_some() && !t.fast_agrees() {
            tracing::warn!(
                "{}: the lean byte-level path differs from the tokenizers crate on sample texts; \
                 using the tokenizers crate",
                path.display()
            );
            t.audit.turn_off();
        }
        t
    }

    /// `hf` with the lean path for `json` (normally the same file), not yet compared.
    fn unchecked(hf: tokenizers::Tokenizer, json: &str, path: &Path) -> HuggingFace {
        let fast = byte_level::ByteLevelBpe::new(json)
            .inspect_err(|why| {
                tracing::info!(
                    "{}: tokenized by the tokenizers crate ({why} is not byte-level BPE's lean path)",
                    path.display()
                )
            })
            .ok();
        HuggingFace {
            hf,
            audit: Audit::new(fast.is_some()),
            fast,
            fast_calls: AtomicU64::new(0),
        }
    }

    /// Whether the lean path gives the same IDs as `tokenizers` on sample texts: prose,
    /// code, chat markers, whitespace runs, numbers, contractions and non-ASCII.
    fn fast_agrees(&self) -> bool {
        const SAMPLES: &[&str] = &[
            "The router keeps each conversation on the worker that holds its cache.",
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
            "fn main() {\n    let x = 1234567;\n\tx += 1; // don't\n}\n\n\n",
            "  leading   and trailing spaces   ",
            "I'm sure they'll say it's what we'd do, 'tis THE'S.",
            "café naïve 日本語のテキスト 🙂 Ω≈ç √ 1,234.56e-7",
            "<|endoftext|><|endoftext|>a<|im_end|>",
            "\r\n\r\n  \t \u{a0}x\u{200b}y",
            "",
        ];
        // A text the lean path does not take (non-ASCII under NFC) goes the plain way.
        SAMPLES.iter().all(|s| match (self.plain(s), self.lean(s)) {
            (_, None) => true,
            (Ok(a), Some(Ok(b))) => a == b,
            _ => false,
        })
    }

    fn plain(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.hf
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError(e.to_string()))
    }

    fn lean(&self, text: &str) -> Option<Result<Vec<u32>, TokenizerError>> {
        let fast = self.fast.as_ref()?;
        fast.encode(text).map(|r| r.map_err(TokenizerError))
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        if !self.audit.on() {
            return self.plain(text);
        }
        let Some(ids) = self.lean(text) else {
            return self.plain(text);
        };
        let n = self.fast_calls.fetch_add(1, Ordering::Relaxed) + 1;
        self.audit.check(
            n,
            ids?,
            || self.plain(text),
            "the lean byte-level tokenizer differed from the tokenizers crate: \
             using the tokenizers crate from now on",
        )
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tokenizer::Builtin => f.write_str("Tokenizer::Builtin"),
            Tokenizer::HuggingFace(t) => f
                .debug_struct("Tokenizer::HuggingFace")
                .field("lean", &t.audit.on())
                .finish(),
        }
    }
}

/// A tokenizer could not be loaded or failed to encode.
#[derive(Debug, thiserror::Error)]
#[error("tokenizer: {0}")]
pub struct TokenizerError(String);

impl From<ChatTemplateError> for TokenizerError {
    fn from(e: ChatTemplateError) -> TokenizerError {
        TokenizerError(e.to_string())
    }
}

impl TokenizerError {
    /// A tokenization task that did not finish.
    pub fn from_panic(e: tokio::task::JoinError) -> TokenizerError {
        TokenizerError(format!("tokenization failed: {e}"))
    }
}

impl Tokenizer {
    /// The built-in tokenizer.
    pub fn builtin() -> Tokenizer {
        Tokenizer::Builtin
    }

    /// Loads a Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Tokenizer, TokenizerError> {
        let err = |e: &dyn std::fmt::Display| {
            TokenizerError(format!("cannot load {}: {e}", path.display()))
        };
        let json = read_text(path, MAX_TOKENIZER_FILE).map_err(|e| err(&e))?;
        let hf: tokenizers::Tokenizer = json.parse().map_err(|e| err(&e))?;
        Ok(Tokenizer::HuggingFace(Box::new(HuggingFace::new(
            hf, &json, path,
        ))))
    }

    /// Loads a `tokenizer.json` to run on the `tokenizers` crate alone, without the lean
    /// byte-level path (for comparisons).
    pub fn crate_only(path: &Path) -> Result<Tokenizer, TokenizerError> {
        let t = Tokenizer::from_file(path)?;
        if let Tokenizer::HuggingFace(hf) = &t {
            hf.audit.turn_off();
        }
        Ok(t)
    }

    /// The `tokenizer.json` at `path`, shareable; `None` without a path (the caller's
    /// default: the built-in one).
    pub fn from_file_if_any(
        path: Option<&Path>,
    ) -> Result<Option<std::sync::Arc<Tokenizer>>, TokenizerError> {
        path.map(|p| Tokenizer::from_file(p).map(std::sync::Arc::new))
            .transpose()
    }

    /// Audits that found the lean byte-level path's IDs wrong (it is then off).
    pub fn lean_mismatches(&self) -> u64 {
        match self {
            Tokenizer::Builtin => 0,
            Tokenizer::HuggingFace(t) => t.audit.mismatches(),
        }
    }

    /// Token IDs of `text`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        match self {
            Tokenizer::Builtin => Ok(builtin_encode(text)),
            Tokenizer::HuggingFace(t) => t.encode(text),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Word,
    Space,
    Other,
}

fn class(c: char) -> Class {
    if c.is_alphanumeric() || c == '_' {
        Class::Word
    } else if c.is_whitespace() {
        Class::Space
    } else {
        Class::Other
    }
}

fn piece_id(piece: &str) -> u32 {
    256 + (xxhash_rust::xxh3::xxh3_64(piece.as_bytes()) % u64::from(BUILTIN_VOCAB - 256)) as u32
}

fn builtin_encode(text: &str) -> Vec<u32> {
    let mut out = Vec::with_capacity(text.len() / 4 + 1);
    let mut start = 0;
    let mut chars = text.char_indices().peekable();
    while let Some((_, c)) = chars.next() {
        let cls = class(c);
        let next = chars.peek().map(|&(_, n)| class(n));
        // A run ends where the class changes; punctuation is one token per character.
        if cls == Class::Other || next != Some(cls) {
            let end = chars.peek().map_or(text.len(), |&(j, _)| j);
            let run = &text[start..end];
            if cls == Class::Word {
                let mut piece_start = 0;
                for (n, (j, _)) in run.char_indices().enumerate() {
                    if n > 0 && n % 4 == 0 {
                        out.push(piece_id(&run[piece_start..j]));
                        piece_start = j;
                    }
                }
                out.push(piece_id(&run[piece_start..]));
            } else {
                out.push(piece_id(run));
            }
            start = end;
        }
    }
    out
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`...
    pub role: String,
    /// The text (multi-part content joined with newlines).
    pub content: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_is_deterministic_and_prefix_stable() {
        let t = Tokenizer::builtin();
        let a = t
            .encode("You are a helpful assistant. Summarise the following report:")
            .unwrap();
        let b = t
            .encode("You are a helpful assistant. Summarise the following report: Q3 revenue")
            .unwrap();
        assert_eq!(
            a,
            t.encode("You are a helpful assistant. Summarise the following report:")
                .unwrap()
        );
        assert_eq!(&b[..a.len()], &a[..]);
        assert!(a.iter().all(|&id| (256..BUILTIN_VOCAB).contains(&id)));
        // Roughly a token per four characters of English, punctuation apart.
        let text = "The quick brown fox jumps over the lazy dog. ".repeat(20);
        let n = t.encode(&text).unwrap().len();
        assert!(
            n > text.len() / 6 && n < text.len() / 2,
            "{n} tokens for {} chars",
            text.len()
        );
        assert!(t.encode("").unwrap().is_empty());
        assert!(!t.encode("日本語のテキスト").unwrap().is_empty());
    }

    #[test]
    fn a_hugging_face_tokenizer_json_is_loaded_and_used() {
        // A minimal word-level tokenizer in the `tokenizer.json` format.
        let json = r#"{
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2, "!": 3}, "unk_token": "[UNK]"}
        }"#;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, json).unwrap();
        let t = Tokenizer::from_file(&path).unwrap();
        assert_eq!(t.encode("hello world !").unwrap(), vec![1, 2, 3]);
        assert_eq!(t.encode("hello there").unwrap(), vec![1, 0]);
        let err = Tokenizer::from_file(&dir.path().join("missing.json")).unwrap_err();
        assert!(err.to_string().contains("missing.json"), "{err}");
        // A path naming an endless source is refused at the bound, not read forever.
        let err = Tokenizer::from_file(Path::new("/dev/zero")).unwrap_err();
        assert!(err.to_string().contains("larger than"), "{err}");
    }

    /// A byte-level BPE `tokenizer.json` (1,000 tokens, ChatML's markers added) trained
    /// on this crate's sources, as `tools/bpe-tokenizer.sh` makes a larger one.
    fn byte_level_json() -> serde_json::Value {
        use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        let mut t = tokenizers::Tokenizer::new(BPE::default());
        t.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
        let mut trainer: tokenizers::models::TrainerWrapper = BpeTrainerBuilder::new()
            .vocab_size(1000)
            .show_progress(false)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .special_tokens(
                ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
                    .map(|s| tokenizers::AddedToken::from(s, true))
                    .to_vec(),
            )
            .build()
            .into();
        let corpus = [
            include_str!("lib.rs"),
            include_str!("prefix.rs"),
            include_str!("chat.rs"),
        ];
        t.train(&mut trainer, corpus.iter()).unwrap();
        serde_json::from_str(&t.to_string(false).unwrap()).unwrap()
    }

    /// Texts mixing what the pre-tokenizer patterns treat apart: words, numbers,
    /// contractions, punctuation, whitespace runs of every kind, non-ASCII, chat markers
    /// whole and broken.
    fn mixed_texts() -> Vec<String> {
        const PARTS: &[&str] = &[
            "router",
            "The",
            "cache",
            "x",
            "1",
            "2024",
            "123456",
            "3.14",
            "'s",
            "'T",
            "'ll",
            "don't",
            "I'M",
            ",",
            ".",
            "!?",
            "()",
            "{",
            "};",
            "->",
            "::",
            "#",
            "\"",
            " ",
            "  ",
            "   ",
            "\n",
            "\n\n",
            "\n    ",
            "\t",
            "\r\n",
            " \n ",
            "\u{a0}",
            "\u{3000}",
            "café",
            "naïve",
            "日本語",
            "🙂",
            "Ω",
            "e\u{301}",
            "<|im_start|>",
            "<|im_end|>",
            "<|im_",
            "|>",
            "<|endoftext|>",
            "user\n",
            "\u{200b}",
        ];
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        (0..400)
            .map(|i| {
                let mut s = String::new();
                for _ in 0..(i % 40 + 1) {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    s.push_str(PARTS[(seed >> 33) as usize % PARTS.len()]);
                }
                s
            })
            .collect()
    }

    fn hugging_face(json: &serde_json::Value) -> HuggingFace {
        let text = json.to_string();
        let hf: tokenizers::Tokenizer = text.parse().unwrap();
        HuggingFace::new(hf, &text, Path::new("test.json"))
    }

    #[test]
    fn the_lean_byte_level_path_gives_the_tokenizers_crates_ids() {
        let gpt2 = byte_level_json();
        // Llama 3's and Qwen's shape: a Split regex, then ByteLevel without its own.
        let mut llama3 = gpt2.clone();
        llama3["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
             "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]});
        llama3["model"]["ignore_merges"] = true.into();
        let mut qwen = llama3.clone();
        qwen["normalizer"] = serde_json::json!({"type": "NFC"});
        // DeepSeek V3's shape: digits and CJK runs split off first, its own pattern, and
        // an empty normalizer sequence.
        let mut deepseek = gpt2.clone();
        deepseek["normalizer"] = serde_json::json!({"type": "Sequence", "normalizers": []});
        deepseek["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false},
            {"type": "Split", "pattern": {"Regex": "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+"}, "behavior": "Isolated", "invert": false},
            {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"},
             "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]});
        // A pattern without the usual ending runs on fancy-regex.
        let mut other = gpt2.clone();
        other["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"String": "\n"}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]});
        // Normalized added tokens are cut out after the unnormalized ones.
        let mut normalized = gpt2.clone();
        normalized["added_tokens"][2]["normalized"] = true.into();
        for (name, json) in [
            ("gpt2", &gpt2),
            ("llama3", &llama3),
            ("qwen", &qwen),
            ("deepseek", &deepseek),
            ("other", &other),
            ("normalized", &normalized),
        ] {
            let t = hugging_face(json);
            assert!(t.audit.on(), "{name}: the lean path is on");
            for text in mixed_texts() {
                let plain = t.plain(&text).unwrap();
                match t.lean(&text) {
                    Some(lean) => assert_eq!(lean.unwrap(), plain, "{name}: {text:?}"),
                    None => assert!(name == "qwen" && !text.is_ascii(), "{name}: {text:?}"),
                }
                assert_eq!(t.encode(&text).unwrap(), plain, "{name}: {text:?}");
            }
        }
        // Every text of two bytes, whose pieces the lean path reads from its table instead
        // of merging, on a vocabulary that merges pairs and on one that takes whole tokens
        // first.
        let twos = (0u8..128)
            .flat_map(|a| (0u8..128).map(move |b| String::from_utf8(vec![a, b]).unwrap()))
            .chain(('\u{80}'..='\u{7ff}').map(String::from));
        for (name, json) in [("gpt2", &gpt2), ("llama3", &llama3)] {
            let t = hugging_face(json);
            for text in twos.clone() {
                let lean = t.lean(&text).unwrap().unwrap();
                assert_eq!(lean, t.plain(&text).unwrap(), "{name}: {text:?}");
            }
        }
        // Shapes it does not know stay with the tokenizers crate, and still tokenize.
        let mut prefix_space = gpt2.clone();
        prefix_space["pre_tokenizer"]["add_prefix_space"] = true.into();
        let t = hugging_face(&prefix_space);
        assert!(t.fast.is_none());
        assert!(!t.encode("hello world").unwrap().is_empty());
    }

    #[test]
    fn a_call_that_finds_the_word_cache_taken_neither_waits_nor_errs() {
        let t = hugging_face(&byte_level_json());
        let fast = t.fast.as_ref().unwrap();
        let text = mixed_texts().concat();
        let plain = t.plain(&text).unwrap();
        // The cache is taken (here by this very thread, so a call that waited for it
        // would never return): the call merges every piece itself and adds none.
        let (lean, before, after) = fast.with_words_taken(|| fast.encode(&text));
        assert_eq!(lean.unwrap().unwrap(), plain);
        assert_eq!(before, after, "nothing is added while the cache is taken");
        // Given back, the cache is used and grows again.
        assert_eq!(fast.encode(&text).unwrap().unwrap(), plain);
        let ((), _, grown) = fast.with_words_taken(|| ());
        assert!(grown > after, "{grown} pieces against {after}");
    }

    #[test]
    fn a_lean_path_that_disagrees_is_turned_off() {
        let json = byte_level_json();
        let text = json.to_string();
        // The lean path built for a file without the chat markers: it cuts `<|im_end|>`
        // into bytes where the tokenizers crate gives one added token.
        let mut unmarked = json.clone();
        unmarked["added_tokens"] = serde_json::json!([]);
        let wrong =
            || HuggingFace::unchecked(text.parse().unwrap(), &unmarked.to_string(), Path::new("t"));
        let marked = "<|im_start|>user\nhello<|im_end|>";
        // At load, the samples show it.
        let t = {
            let t = wrong();
            assert!(!t.fast_agrees());
            HuggingFace::new(text.parse().unwrap(), &text, Path::new("t"))
        };
        assert!(t.audit.on(), "the right file agrees");
        // Had the samples missed it, the audit catches it within AUDIT_EVERY calls,
        // answers that call with the crate's IDs, and turns the lean path off.
        let t = wrong();
        let plain = t.plain(marked).unwrap();
        for _ in 1..AUDIT_EVERY {
            assert_ne!(t.encode(marked).unwrap(), plain);
        }
        assert_eq!(t.encode(marked).unwrap(), plain, "the audited call");
        assert!(!t.audit.on());
        assert_eq!(t.audit.mismatches(), 1);
        assert_eq!(t.encode(marked).unwrap(), plain);
    }

    #[test]
    fn chat_rendering_keeps_earlier_turns_as_a_prefix() {
        let m = |role: &str, content: &str| ChatMessage {
            role: role.into(),
            content: content.into(),
        };
        let render = |m: &[ChatMessage]| ChatFormat::ChatMl.render(m).unwrap();
        let first = render(&[m("system", "Be brief."), m("user", "Hi")]);
        let second = render(&[
            m("system", "Be brief."),
            m("user", "Hi"),
            m("assistant", "Hello!"),
            m("user", "More"),
        ]);
        assert_eq!(
            first,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let shared = first.trim_end_matches("<|im_start|>assistant\n");
        assert!(second.starts_with(shared));
    }
}
