//! The words the mock generates: each token's text and ID, and the first word after a
//! context, so that the text is a function of the context alone.

/// The text of each token the mock generates, in this order. The last two spell "é " as a
/// byte-level tokenizer does: the first is a lone byte of the character, with no text of
/// its own until the next completes it, so its chunk carries no text (vLLM streams it
/// anyway, with its token ID; its text arrives with the next).
const WORDS: [&str; 10] = [
    "lorem ",
    "ipsum ",
    "dolor ",
    "sit ",
    "amet ",
    "consectetur ",
    "adipiscing ",
    "elit ",
    "",
    "é ",
];

/// Generated token `i`'s text when the first is word `first` ([`first_word`]).
pub(super) fn filler(first: u32, i: u32) -> &'static str {
    WORDS[(first as usize + i as usize) % WORDS.len()]
}

/// The token ID the mock reports for word `k` of [`WORDS`] (`return_token_ids`): ten
/// IDs of its own at the top of the built-in vocabulary.
const WORD_ID_BASE: u32 = switchyard_tokens::BUILTIN_VOCAB - WORDS.len() as u32;

/// Generated token `i`'s ID when the first is word `first`.
pub(super) fn word_id(first: u32, i: u32) -> u32 {
    WORD_ID_BASE + ((first as usize + i as usize) % WORDS.len()) as u32
}

/// The first word generated after `context` (the rendered prompt, or the token IDs of a
/// token prompt): the word after the one the text ends with, else one chosen by a hash of
/// the context. So the text generated is a function of the context alone, and a stream
/// cut after some words and continued elsewhere from the prompt plus those words (a
/// router's migration) goes on with exactly the words the first worker would have sent.
pub(super) fn first_word(text: Option<&str>, tokens: &[u32]) -> u32 {
    let hash = match text {
        Some(t) => {
            if let Some(k) = WORDS.iter().position(|w| !w.is_empty() && t.ends_with(w)) {
                return k as u32 + 1;
            }
            xxhash_rust::xxh3::xxh3_64(t.as_bytes())
        }
        None => {
            // A token prompt that ends with a generated word's ID goes on after it.
            if let Some(k) = tokens
                .last()
                .and_then(|t| t.checked_sub(WORD_ID_BASE))
                .filter(|k| (*k as usize) < WORDS.len())
            {
                return k + 1;
            }
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            for t in tokens {
                h.update(&t.to_le_bytes());
            }
            h.digest()
        }
    };
    (hash % WORDS.len() as u64) as u32
}
