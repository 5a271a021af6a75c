//! Text to token IDs, shared by the router and the mock worker so that both cut a prompt
//! into the same blocks.
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

pub mod chat;
pub mod prefix;

pub use chat::{ChatFormat, ChatTemplateError};
pub use prefix::PrefixTokenizer;

use std::path::Path;

/// Vocabulary size of the built-in tokenizer.
pub const BUILTIN_VOCAB: u32 = 100_000;

/// A tokenizer.
pub enum Tokenizer {
    /// The file-free default.
    Builtin,
    /// A Hugging Face tokenizer.
    HuggingFace(Box<tokenizers::Tokenizer>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tokenizer::Builtin => f.write_str("Tokenizer::Builtin"),
            Tokenizer::HuggingFace(_) => f.write_str("Tokenizer::HuggingFace"),
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
        tokenizers::Tokenizer::from_file(path)
            .map(|t| Tokenizer::HuggingFace(Box::new(t)))
            .map_err(|e| TokenizerError(format!("cannot load {}: {e}", path.display())))
    }

    /// The `tokenizer.json` at `path`, shareable; `None` without a path (the caller's
    /// default: the built-in one).
    pub fn from_file_if_any(
        path: Option<&Path>,
    ) -> Result<Option<std::sync::Arc<Tokenizer>>, TokenizerError> {
        path.map(|p| Tokenizer::from_file(p).map(std::sync::Arc::new))
            .transpose()
    }

    /// Token IDs of `text`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        match self {
            Tokenizer::Builtin => Ok(builtin_encode(text)),
            Tokenizer::HuggingFace(t) => t
                .encode_fast(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TokenizerError(e.to_string())),
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
