//! An admitted request's answer as vLLM writes it: whole (one JSON object) or streamed
//! (SSE chunks, then the usage asked for, then `[DONE]`).

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper::{Response, StatusCode};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::engine::{Engine, Output};
use switchyard_tokens::openai::Api;

use super::pd::{self, Leg};
use super::reply::json_response;
use super::words::{filler, word_id};
use super::{Body, Fault, Shared};

/// What an admitted request's answer is made of.
pub(super) struct Answer {
    pub(super) api: Api,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) prompt_tokens: u32,
    pub(super) cached_tokens: u32,
    /// The first generated word ([`super::generate::first_word`]).
    pub(super) first: u32,
    pub(super) max_tokens: u32,
    /// Whether the answer ends by the model's end-of-sequence token (else at its limit).
    pub(super) stops: bool,
    pub(super) fault: Fault,
    /// The fault's `after_tokens`.
    pub(super) strike: Option<u32>,
    /// A prefill leg's KV, kept for its decode worker once the answer is done.
    pub(super) keep: Option<pd::Keep>,
    /// The engine's tokens for this request.
    pub(super) out: mpsc::UnboundedReceiver<Output>,
}

/// How a stream is cut into chunks and what it carries beside the text.
pub(super) struct Streaming {
    /// Tokens per chunk after the first (vLLM's `stream_interval`).
    pub(super) interval: usize,
    /// The token count after which the stream is cut (an injected fault).
    pub(super) cut_at: Option<u32>,
    pub(super) include_usage: bool,
    /// The prompt's token IDs, for the first chunk (`return_token_ids`).
    pub(super) prompt_ids: Option<Vec<u32>>,
}

/// The `finish_reason` of an answer that ended by the model's end-of-sequence token
/// (`stops`) or at its limit.
fn finish_reason(stops: bool) -> &'static str {
    if stops { "stop" } else { "length" }
}

impl Answer {
    fn usage(&self, completion: u32) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }

    /// The whole answer once the engine has generated it; a vLLM prefill leg's carries
    /// the `kv_transfer_params` its decode worker fetches the KV with.
    pub(super) async fn whole(mut self, shared: &Shared, leg: &Leg) -> Response<Body> {
        let mut text = String::new();
        let mut n = 0;
        while let Some(o) = self.out.recv().await {
            match o {
                Output::Token(i) => {
                    if self.fault == Fault::Crash && self.strike.is_some_and(|s| n >= s) {
                        tracing::error!("fault injection: crashing mid-answer");
                        std::process::exit(3);
                    }
                    text.push_str(filler(self.first, i));
                    n += 1;
                }
                Output::Done => break,
                _ => {}
            }
        }
        let transfer = self.keep.take().map(|k| {
            let blocks = k.ready(&shared.engine);
            pd::vllm_params(
                match leg {
                    Leg::Prefill { key, .. } => key,
                    _ => "",
                },
                blocks,
                &shared.addr.ip().to_string(),
                shared.addr.port(),
                &shared.model,
            )
        });
        let finish = finish_reason(self.stops);
        let (object, choice) = match self.api {
            Api::Chat => (
                "chat.completion",
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}),
            ),
            Api::Completions => (
                "text_completion",
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish}),
            ),
        };
        let mut answer = json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage(n)});
        if let (Some(params), Leg::Prefill { vllm: true, .. }) = (transfer, leg) {
            answer["kv_transfer_params"] = params;
        }
        json_response(StatusCode::OK, answer)
    }

    /// The answer as an SSE stream, written by a task of its own as the engine
    /// generates; the client leaving cancels the request.
    pub(super) fn stream(self, engine: Arc<Engine>, how: Streaming) -> Response<Body> {
        let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(16);
        tokio::spawn(self.write(engine, how, tx));
        Response::builder()
            .header("content-type", "text/event-stream")
            .header("cache-control", "no-cache")
            .body(StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed())
            .expect("valid response")
    }

    /// vLLM's stream: a chat opens with the role and empty content; every token has a
    /// chunk of its own (also one with no text: a lone byte of a character), the last
    /// carrying the finish reason; then the usage asked for, with no choices; then
    /// `[DONE]`. With `stream_interval`: the first token alone, then every `interval`
    /// tokens, and what is left with the finish.
    async fn write(
        mut self,
        engine: Arc<Engine>,
        mut how: Streaming,
        tx: mpsc::Sender<Result<Frame<Bytes>, std::io::Error>>,
    ) {
        let mut n = 0u32;
        let (mut pending_text, mut pending_ids) = (String::new(), Vec::new());
        let mut opening = true;
        while let Some(o) = self.out.recv().await {
            let bytes = match o {
                Output::Token(i) => {
                    if self.fault == Fault::Stall && n >= self.strike.unwrap_or(1) {
                        // Silent, with the connection open, until the client leaves.
                        tx.closed().await;
                        return;
                    }
                    if self.fault == Fault::Crash && self.strike.is_some_and(|s| n >= s) {
                        tracing::error!("fault injection: crashing mid-stream");
                        std::process::exit(3);
                    }
                    if how.cut_at.is_some_and(|c| n >= c) {
                        let _ = tx
                            .send(Err(std::io::Error::other("injected fault: stream cut")))
                            .await;
                        return;
                    }
                    n += 1;
                    pending_text.push_str(filler(self.first, i));
                    pending_ids.push(word_id(self.first, i));
                    let last = i + 1 >= self.max_tokens;
                    if !(opening || pending_ids.len() >= how.interval || last) {
                        continue;
                    }
                    let text = std::mem::take(&mut pending_text);
                    let ids = std::mem::take(&mut pending_ids);
                    let out = self.chunks(&mut how, opening, last, text, ids);
                    opening = false;
                    Bytes::from(out)
                }
                Output::Done => {
                    if let Some(k) = self.keep.take() {
                        k.ready(&engine);
                    }
                    let mut tail = String::new();
                    if how.include_usage {
                        tail.push_str(&event(json!({"id": self.id, "object": self.chunk_object(), "created": self.created, "model": self.model, "choices": [], "usage": self.usage(n)})));
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
    }

    fn chunk_object(&self) -> &'static str {
        if self.api == Api::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        }
    }

    fn chunk(&self, choice: Value) -> Value {
        json!({"id": self.id, "object": self.chunk_object(), "created": self.created, "model": self.model, "choices": [choice]})
    }

    /// The events for one chunk of tokens (`text`, `ids`): a chat's opening chunk first
    /// when `opening`; the finish reason when `last`.
    fn chunks(
        &self,
        how: &mut Streaming,
        opening: bool,
        last: bool,
        text: String,
        ids: Vec<u32>,
    ) -> String {
        let finish = last.then(|| finish_reason(self.stops));
        let mut choice = match self.api {
            Api::Chat => {
                json!({"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": finish})
            }
            Api::Completions => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
            }
        };
        let mut out = String::new();
        if let Some(p) = &mut how.prompt_ids {
            choice["token_ids"] = json!(ids);
            if opening && self.api == Api::Completions {
                // Where vLLM puts them: the completion's first choice.
                choice["prompt_token_ids"] = json!(std::mem::take(p));
            }
        }
        if opening && self.api == Api::Chat {
            let mut open = self.chunk(
                json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}),
            );
            if let Some(p) = &mut how.prompt_ids {
                // ... and the chat's opening chunk.
                open["prompt_token_ids"] = json!(std::mem::take(p));
            }
            out.push_str(&event(open));
        }
        out.push_str(&event(self.chunk(choice)));
        out
    }
}

/// One SSE event.
fn event(v: Value) -> String {
    format!("data: {v}\n\n")
}
