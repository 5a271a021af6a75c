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

use super::reply::{error, json_response, read_body};
use super::{Body, Fault, Shared};

/// Deterministic filler text for generated token `i`.
pub(super) fn filler(i: u32) -> &'static str {
    const WORDS: [&str; 8] = [
        "lorem ",
        "ipsum ",
        "dolor ",
        "sit ",
        "amet ",
        "consectetur ",
        "adipiscing ",
        "elit ",
    ];
    WORDS[i as usize % WORDS.len()]
}

pub(super) async fn completion(
    shared: Arc<Shared>,
    api: Api,
    req: Request<Incoming>,
) -> Response<Body> {
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
                None,
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
            Some("model_not_found"),
        );
    }
    let (fault, faults) = shared.fault_for_request();
    shared.update_refuse();
    if let Some(marker) = faults.marker.as_deref()
        && !marker.is_empty()
        && body.windows(marker.len()).any(|w| w == marker.as_bytes())
    {
        return faults.status_answer("injected fault: this prompt fails on every worker");
    }
    if faults.first_token_delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(faults.first_token_delay_ms)).await;
    }
    match fault {
        Fault::Crash => {
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
                Some("injected_fault"),
            );
        }
        Fault::Status => return faults.status_answer("injected fault"),
        Fault::Stall if !parsed.stream => return std::future::pending().await,
        Fault::None | Fault::CutStream | Fault::Stall => {}
    }
    let tokens = match &parsed.prompt {
        Prompt::Tokens(t) => Ok(t.clone()),
        Prompt::Text(t) => shared.tokenizer.encode(t),
        Prompt::Chat(m) => shared
            .tokenizer
            .render_chat(m)
            .and_then(|text| shared.tokenizer.encode(&text)),
    };
    let tokens = match tokens {
        Ok(t) if !t.is_empty() => t,
        Ok(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "the prompt is empty",
                "invalid_request_error",
                Some("prompt"),
                None,
            );
        }
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &e.to_string(),
                "invalid_request_error",
                Some("prompt"),
                None,
            );
        }
    };
    let prompt_tokens = tokens.len() as u32;
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
    let mut out = shared.engine.submit(
        blocks,
        block_tokens,
        salt.map(Arc::from),
        prompt_tokens,
        parsed.max_tokens,
    );
    let cached_tokens = match out.recv().await {
        Some(Output::Admitted { cached_tokens }) => cached_tokens,
        Some(Output::TooLarge { needed }) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("the request needs {needed} KV blocks, more than this worker has"),
                "invalid_request_error",
                Some("prompt"),
                Some("context_length_exceeded"),
            );
        }
        _ => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "engine stopped",
                "server_error",
                None,
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
                    text.push_str(filler(i));
                    n += 1;
                }
                Output::Done => break,
                _ => {}
            }
        }
        let choice = match api {
            Api::Chat => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
            }
            Api::Completions => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length"})
            }
        };
        let object = if api == Api::Chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        return json_response(
            StatusCode::OK,
            json!({"id": id, "object": object, "created": created, "model": shared.model, "choices": [choice], "usage": usage(n)}),
        );
    }
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(16);
    let model = shared.model.clone();
    let max_tokens = parsed.max_tokens;
    let include_usage = parsed.include_usage;
    tokio::spawn(async move {
        let object = if api == Api::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let chunk = |choice: serde_json::Value| {
            let v = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
            Bytes::from(format!("data: {v}\n\n"))
        };
        let mut n = 0u32;
        while let Some(o) = out.recv().await {
            let bytes = match o {
                Output::Token(i) => {
                    if fault == Fault::Stall && n >= 1 {
                        // Silent, with the connection open, until the client leaves.
                        tx.closed().await;
                        return;
                    }
                    if fault == Fault::CutStream && n >= max_tokens / 2 {
                        let _ = tx
                            .send(Err(std::io::Error::other("injected fault: stream cut")))
                            .await;
                        return;
                    }
                    n += 1;
                    match api {
                        Api::Chat if i == 0 => chunk(
                            json!({"index": 0, "delta": {"role": "assistant", "content": filler(i)}, "finish_reason": null}),
                        ),
                        Api::Chat => chunk(
                            json!({"index": 0, "delta": {"content": filler(i)}, "finish_reason": null}),
                        ),
                        Api::Completions => chunk(
                            json!({"index": 0, "text": filler(i), "logprobs": null, "finish_reason": null}),
                        ),
                    }
                }
                Output::Done => {
                    let last = match api {
                        Api::Chat => {
                            chunk(json!({"index": 0, "delta": {}, "finish_reason": "length"}))
                        }
                        Api::Completions => chunk(
                            json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "length"}),
                        ),
                    };
                    let mut tail = last.to_vec();
                    if include_usage {
                        let v = json!({"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": usage(n)});
                        tail.extend_from_slice(format!("data: {v}\n\n").as_bytes());
                    }
                    tail.extend_from_slice(b"data: [DONE]\n\n");
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
