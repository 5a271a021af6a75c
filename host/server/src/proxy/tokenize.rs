//! Prompts to token IDs for routing: long texts off the async threads.

use std::sync::Arc;
use std::time::Instant;

use crate::{ApiError, Gateway};
use switchyard_tokens::openai::{self, Prompt};
use switchyard_tokens::{PrefixTokenizer, TokenizerError};

/// Texts longer than this are tokenized on a blocking thread, off the async workers.
pub(super) const BLOCKING_TOKENIZE_BYTES: usize = 8 << 10;

/// The prompt's token IDs (text reuses a conversation's earlier tokens, see
/// [`PrefixTokenizer`](switchyard_tokens::PrefixTokenizer)); a chat whose last message is
/// continued (`continue_final`) is rendered as the engine renders it, without a
/// generation prompt; a prompt that cannot be tokenized is the client's error (400).
pub(crate) async fn tokenize(
    gw: &Arc<Gateway>,
    prompt: &Prompt,
    continue_final: bool,
) -> Result<Vec<u32>, ApiError> {
    tokenize_prompt(gw, prompt, continue_final)
        .await
        .map_err(|e| {
            ApiError::BadRequest(openai::BadRequest {
                message: e.to_string(),
                param: Some("prompt".into()),
            })
        })
}

pub(super) async fn tokenize_prompt(
    gw: &Arc<Gateway>,
    prompt: &Prompt,
    continue_final: bool,
) -> Result<Vec<u32>, TokenizerError> {
    let size = match prompt {
        Prompt::Tokens(t) => return Ok(t.clone()),
        Prompt::Text(t) => t.len(),
        Prompt::Chat(m) => m.iter().map(|m| m.content.len()).sum(),
    };
    let started = Instant::now();
    let tokens = if size > BLOCKING_TOKENIZE_BYTES {
        // Copied only to hand it to the blocking thread (a conversation is rendered
        // there too).
        let (tokenizer, prompt) = (gw.tokenizer.clone(), prompt.clone());
        tokio::task::spawn_blocking(move || encode(&tokenizer, &prompt, continue_final))
            .await
            .unwrap_or_else(|e| Err(TokenizerError::from_panic(e)))
    } else {
        encode(&gw.tokenizer, prompt, continue_final)
    };
    gw.metrics.timings.tokenize(started.elapsed());
    tokens
}

/// A prompt's token IDs: a conversation rendered with the chat template first.
pub(super) fn encode(
    tokenizer: &PrefixTokenizer,
    prompt: &Prompt,
    continue_final: bool,
) -> Result<Vec<u32>, TokenizerError> {
    match prompt {
        Prompt::Tokens(t) => Ok(t.clone()),
        Prompt::Text(t) => tokenizer.encode(t),
        Prompt::Chat(m) if continue_final => {
            tokenizer.encode(&tokenizer.render_chat_continuation(m)?)
        }
        Prompt::Chat(m) => tokenizer.encode(&tokenizer.render_chat(m)?),
    }
}
