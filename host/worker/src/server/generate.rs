//! Completions and chat completions: the prompt through the engine, the answer streamed
//! (SSE) or whole, with the usage an engine reports.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use serde_json::json;
use tokio::sync::mpsc;

use crate::engine::Output;
use switchyard_tokens::openai::{self, Api, Prompt};

use super::pd::{self, Leg};
use super::reply::{error, json_response, read_body};
use super::{Body, Fault, Shared};

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
fn word_id(first: u32, i: u32) -> u32 {
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

pub(super) async fn completion(
    shared: Arc<Shared>,
    api: Api,
    req: Request<Incoming>,
) -> Response<Body> {
    let request_id = req
        .headers()
        .get("x-request-id")
        .map(|v| v.as_bytes().to_vec());
    let fresh_id = || {
        format!(
            "{}-{:x}",
            shared.addr.port(),
            shared.served.load(Ordering::Relaxed) ^ pd::process_nonce()
        )
    };
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(too_large) => return too_large,
    };
    let parsed = match openai::parse(api, &body) {
        Ok(p) => p,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &e.message,
                "invalid_request_error",
                e.param.as_deref(),
            );
        }
    };
    if parsed.model != shared.model {
        return error(
            StatusCode::NOT_FOUND,
            &format!(
                "The model `{}` does not exist (this worker serves `{}`)",
                parsed.model, shared.model
            ),
            "invalid_request_error",
            Some("model"),
        );
    }
    // vLLM's per-request `stream_interval`, at least the engine's own.
    let interval = match requested_interval(&body) {
        Ok(n) => n.max(shared.engine.config().stream_interval).max(1) as usize,
        Err(m) => {
            // vLLM's answer to a field its request model refuses.
            return error(
                StatusCode::BAD_REQUEST,
                &m,
                "Bad Request",
                Some("body.stream_interval"),
            );
        }
    };
    // A vLLM prefill keeps its KV under the request's ID.
    let leg = match pd::leg(&shared.pd, &body, || {
        pd::request_id(request_id.as_deref(), fresh_id)
    }) {
        Ok(l) => l,
        Err(m) => {
            return error(StatusCode::BAD_REQUEST, &m, "invalid_request_error", None);
        }
    };
    let (fault, faults) = shared.fault_for_request();
    shared.update_refuse();
    let marked = faults
        .marker
        .as_deref()
        .is_some_and(|m| !m.is_empty() && body.windows(m.len()).any(|w| w == m.as_bytes()));
    // Where this stream is cut, if it is: a marked prompt's, or the fault's.
    let mut cut_at = None;
    if marked {
        match faults.marker_after_tokens {
            None => {
                return faults.status_answer("injected fault: this prompt fails on every worker");
            }
            Some(n) => cut_at = Some(n),
        }
    }
    if faults.first_token_delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(faults.first_token_delay_ms)).await;
    }
    match fault {
        Fault::Crash if faults.after_tokens.is_none() => {
            tracing::error!("fault injection: crashing");
            std::process::exit(3);
        }
        Fault::Hang => return std::future::pending().await,
        Fault::Error | Fault::Refuse => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "injected fault",
                "server_error",
                None,
            );
        }
        Fault::Status => return faults.status_answer("injected fault"),
        Fault::Stall if !parsed.stream => return std::future::pending().await,
        Fault::None | Fault::CutStream | Fault::Stall | Fault::Crash => {}
    }
    let rendered = match &parsed.prompt {
        Prompt::Chat(m) if parsed.continue_final_message => {
            shared.tokenizer.render_chat_continuation(m).map(Some)
        }
        Prompt::Chat(m) => shared.tokenizer.render_chat(m).map(Some),
        Prompt::Text(_) | Prompt::Tokens(_) => Ok(None),
    };
    let tokens = rendered.and_then(|rendered| {
        let text: std::borrow::Cow<'_, str> = match (&parsed.prompt, rendered) {
            (Prompt::Tokens(t), _) => return Ok((t.clone(), first_word(None, t))),
            (Prompt::Text(t), _) => t.into(),
            (Prompt::Chat(_), r) => r.unwrap_or_default().into(),
        };
        let first = first_word(Some(&text), &[]);
        shared.tokenizer.encode(&text).map(|t| (t, first))
    });
    let (tokens, first) = match tokens {
        Ok((t, first)) if !t.is_empty() => (t, first),
        Ok(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "the prompt is empty",
                "invalid_request_error",
                Some("prompt"),
            );
        }
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &e.to_string(),
                "invalid_request_error",
                Some("prompt"),
            );
        }
    };
    let prompt_tokens = tokens.len() as u32;
    // The limits vLLM checks before it schedules anything (`input_tokens`, then
    // `max_tokens` against the context).
    let context = shared.engine.config().max_model_len();
    if u64::from(prompt_tokens) >= context {
        return error(
            StatusCode::BAD_REQUEST,
            &format!(
                "This model's maximum context length is {context} tokens. However, your prompt contains at least {prompt_tokens} input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt."
            ),
            "BadRequestError",
            Some("input_tokens"),
        );
    }
    if let Some(m) = parsed.max_tokens.filter(|m| u64::from(*m) > context) {
        return error(
            StatusCode::BAD_REQUEST,
            &format!(
                "max_tokens={m} cannot be greater than max_model_len={context}. Please request fewer output tokens."
            ),
            "BadRequestError",
            Some("max_tokens"),
        );
    }
    if let Some(m) = parsed.max_tokens.filter(|m| parsed.min_tokens > *m) {
        return error(
            StatusCode::BAD_REQUEST,
            &format!(
                "min_tokens must be less than or equal to max_tokens={m}, got {}.",
                parsed.min_tokens
            ),
            "BadRequestError",
            None,
        );
    }
    // The client's limit or the engine's default (a chat: the rest of the context), or
    // the model's own end, whichever comes first.
    let (mut max_tokens, mut stops) = shared
        .engine
        .config()
        .answer_len(prompt_tokens, parsed.limit(api));
    // vLLM's `return_token_ids`: the prompt's IDs in the first chunk, each token's in its.
    let mut prompt_ids = parsed.return_token_ids.then(|| tokens.clone());
    let salt = parsed.cache_salt.as_deref();
    let blocks = shared.hasher.salted_hashes(&tokens, salt);
    // The ZMQ publisher sends stored blocks' tokens, as vLLM does.
    let block_tokens = if shared.zmq.is_some() {
        let mut t = tokens.to_vec();
        t.truncate(blocks.len() * shared.hasher.block_size() as usize);
        t
    } else {
        Vec::new()
    };
    let salt: Option<Arc<str>> = salt.map(Arc::from);
    // A decode leg first receives the prompt's KV; a prefill leg keeps it for one.
    let mut received = None;
    let mut keep = None;
    match &leg {
        Leg::Whole => {}
        Leg::Decode {
            host,
            port,
            key,
            vllm,
        } => {
            let have = shared.engine.cached_prefix(&blocks);
            match pd::fetch(host, *port, key, have, !*vllm).await {
                Ok(n) => {
                    let n = n.min(blocks.len());
                    let bs = shared.hasher.block_size() as usize;
                    let toks = block_tokens.get(..n * bs).unwrap_or(&[]);
                    received = shared.engine.pin(&blocks[..n], toks, salt.as_ref());
                }
                Err(why) if *vllm => {
                    tracing::warn!(key, why, "KV transfer failed; recomputing the prompt here");
                }
                Err(why) => {
                    return error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        &format!("KV transfer failed: {why}"),
                        "server_error",
                        None,
                    );
                }
            }
        }
        Leg::Prefill { key, vllm } => {
            if !*vllm {
                // SGLang's prefill server computes the prompt and its first token only.
                (max_tokens, stops) = (1, false);
            }
            keep = Some(pd::Keep {
                guard: shared.handoffs.begin(&shared.engine, key),
                blocks: blocks.clone(),
                tokens: block_tokens.clone(),
                salt: salt.clone(),
            });
        }
    }
    let mut out = shared
        .engine
        .submit(blocks, block_tokens, salt, prompt_tokens, max_tokens);
    let first_out = out.recv().await;
    if let Some(lease) = received.take() {
        // Admitted (or refused): the received blocks are the request's own now.
        shared.engine.unpin(&lease);
    }
    let cached_tokens = match first_out {
        Some(Output::Admitted { cached_tokens }) => cached_tokens,
        Some(Output::TooLarge { needed }) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("the request needs {needed} KV blocks, more than this worker has"),
                "invalid_request_error",
                Some("prompt"),
            );
        }
        _ => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "engine stopped",
                "server_error",
                None,
            );
        }
    };
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let id = format!(
        "{}-{:x}",
        if api == Api::Chat { "chatcmpl" } else { "cmpl" },
        shared.served.load(Ordering::Relaxed)
    );
    let usage = move |completion: u32| {
        json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        })
    };
    if !parsed.stream {
        let mut text = String::new();
        let mut n = 0;
        while let Some(o) = out.recv().await {
            match o {
                Output::Token(i) => {
                    if fault == Fault::Crash && faults.after_tokens.is_some_and(|s| n >= s) {
                        tracing::error!("fault injection: crashing mid-answer");
                        std::process::exit(3);
                    }
                    text.push_str(filler(first, i));
                    n += 1;
                }
                Output::Done => break,
                _ => {}
            }
        }
        let transfer = keep.map(|k| {
            let blocks = k.ready(&shared.engine);
            pd::vllm_params(
                match &leg {
                    Leg::Prefill { key, .. } => key,
                    _ => "",
                },
                blocks,
                &shared.addr.ip().to_string(),
                shared.addr.port(),
                &shared.model,
            )
        });
        let finish = finish_reason(stops);
        let choice = match api {
            Api::Chat => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish})
            }
            Api::Completions => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
            }
        };
        let object = if api == Api::Chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        let mut answer = json!({"id": id, "object": object, "created": created, "model": shared.model, "choices": [choice], "usage": usage(n)});
        if let (Some(params), Leg::Prefill { vllm: true, .. }) = (transfer, &leg) {
            answer["kv_transfer_params"] = params;
        }
        return json_response(StatusCode::OK, answer);
    }
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(16);
    let model = shared.model.clone();
    let engine = shared.engine.clone();
    let include_usage = parsed.include_usage;
    let strike = faults.after_tokens;
    if fault == Fault::CutStream {
        cut_at = cut_at.or(Some(strike.unwrap_or(max_tokens / 2)));
    }
    tokio::spawn(async move {
        // vLLM's stream: a chat opens with the role and empty content; every token has a
        // chunk of its own (also one with no text: a lone byte of a character), the last
        // carrying the finish reason; then the usage asked for, with no choices; then
        // `[DONE]`.
        let object = if api == Api::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let event = |v: serde_json::Value| format!("data: {v}\n\n");
        let chunk = |choice: serde_json::Value| json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
        let mut n = 0u32;
        // vLLM's `--stream-interval`: the first token alone, then every `interval`
        // tokens, and what is left with the finish.
        let (mut pending_text, mut pending_ids) = (String::new(), Vec::new());
        let mut opening = true;
        while let Some(o) = out.recv().await {
            let bytes = match o {
                Output::Token(i) => {
                    if fault == Fault::Stall && n >= strike.unwrap_or(1) {
                        // Silent, with the connection open, until the client leaves.
                        tx.closed().await;
                        return;
                    }
                    if fault == Fault::Crash && strike.is_some_and(|s| n >= s) {
                        tracing::error!("fault injection: crashing mid-stream");
                        std::process::exit(3);
                    }
                    if cut_at.is_some_and(|c| n >= c) {
                        let _ = tx
                            .send(Err(std::io::Error::other("injected fault: stream cut")))
                            .await;
                        return;
                    }
                    n += 1;
                    pending_text.push_str(filler(first, i));
                    pending_ids.push(word_id(first, i));
                    let last = i + 1 >= max_tokens;
                    if !(opening || pending_ids.len() >= interval || last) {
                        continue;
                    }
                    let finish = last.then(|| finish_reason(stops));
                    let text = std::mem::take(&mut pending_text);
                    let ids = std::mem::take(&mut pending_ids);
                    let mut choice = match api {
                        Api::Chat => {
                            json!({"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": finish})
                        }
                        Api::Completions => {
                            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
                        }
                    };
                    let mut out = String::new();
                    if let Some(p) = &mut prompt_ids {
                        choice["token_ids"] = json!(ids);
                        if opening && api == Api::Completions {
                            // Where vLLM puts them: the completion's first choice.
                            choice["prompt_token_ids"] = json!(std::mem::take(p));
                        }
                    }
                    if opening && api == Api::Chat {
                        let mut open = chunk(
                            json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}),
                        );
                        if let Some(p) = &mut prompt_ids {
                            // ... and the chat's opening chunk.
                            open["prompt_token_ids"] = json!(std::mem::take(p));
                        }
                        out.push_str(&event(open));
                    }
                    opening = false;
                    out.push_str(&event(chunk(choice)));
                    Bytes::from(out)
                }
                Output::Done => {
                    if let Some(k) = keep.take() {
                        k.ready(&engine);
                    }
                    let mut tail = String::new();
                    if include_usage {
                        tail.push_str(&event(json!({"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": usage(n)})));
                    }
                    tail.push_str("data: [DONE]\n\n");
                    let _ = tx.send(Ok(Frame::data(Bytes::from(tail)))).await;
                    return;
                }
                _ => continue,
            };
            if tx.send(Ok(Frame::data(bytes))).await.is_err() {
                return; // the client went away; dropping `out` cancels the request
            }
        }
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed())
        .expect("valid response")
}

/// The request's `stream_interval` (vLLM's sampling parameter: tokens per chunk), 0 when
/// it names none.
fn requested_interval(body: &[u8]) -> Result<u32, String> {
    #[derive(serde::Deserialize)]
    struct Fields {
        stream_interval: Option<serde_json::Value>,
    }
    let Ok(Fields {
        stream_interval: Some(v),
    }) = serde_json::from_slice::<Fields>(body)
    else {
        return Ok(0);
    };
    if v.is_null() {
        return Ok(0);
    }
    match v.as_i64() {
        Some(n) if n >= 1 => Ok(u32::try_from(n).unwrap_or(u32::MAX)),
        _ => Err(format!(
            "1 validation error:\n  body.stream_interval: Input should be greater than or equal to 1, got {v}"
        )),
    }
}

/// The `finish_reason` of an answer that ended by the model's end-of-sequence token
/// (`stops`) or at its limit.
fn finish_reason(stops: bool) -> &'static str {
    if stops { "stop" } else { "length" }
}
