//! Completions and chat completions: the prompt through the engine, the answer streamed
//! (SSE) or whole, with the usage an engine reports.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};

use crate::engine::Output;
use switchyard_tokens::openai::{self, Api, Prompt};

use super::answer::{Answer, Streaming};
use super::pd::{self, Leg};
use super::reply::{error, read_body};
use super::words::first_word;
use super::{Body, Fault, Shared};

/// A completion or chat completion, answered as vLLM answers it.
pub(super) async fn completion(
    shared: Arc<Shared>,
    api: Api,
    req: Request<Incoming>,
) -> Response<Body> {
    match generate(shared, api, req).await {
        Ok(r) | Err(r) => r,
    }
}

/// The request through the engine; `Err` is an answer before any token (a bad request,
/// an injected fault, an engine that cannot take it).
async fn generate(
    shared: Arc<Shared>,
    api: Api,
    req: Request<Incoming>,
) -> Result<Response<Body>, Response<Body>> {
    let Checked {
        body,
        parsed,
        interval,
        leg,
    } = check(&shared, api, req).await?;
    let (fault, faults) = shared.fault_for_request();
    shared.update_refuse();
    let (tokens, first) = prompt_tokens(&shared, &parsed).map_err(|r| *r)?;
    let marked = marked(&shared, &faults, &body, &parsed.prompt, &tokens);
    let mut cut_at = inject(fault, &faults, marked, parsed.stream).await?;
    let prompt_tokens = tokens.len() as u32;
    within_limits(&shared, &parsed, prompt_tokens).map_err(|r| *r)?;
    // The client's limit or the engine's default (a chat: the rest of the context), or
    // the model's own end, whichever comes first.
    let (mut max_tokens, mut stops) = shared
        .engine
        .config()
        .answer_len(prompt_tokens, parsed.limit(api));
    // vLLM's `return_token_ids`: the prompt's IDs in the first chunk, each token's in its.
    let prompt_ids = parsed.return_token_ids.then(|| tokens.clone());
    // vLLM's block keys: an adapter's name on every block, the salt on the first.
    let lora = (parsed.model != shared.model).then_some(parsed.model.as_str());
    let salt = parsed.cache_salt.as_deref();
    let blocks = shared.hasher.keyed_hashes(&tokens, lora, salt);
    // The ZMQ publisher sends stored blocks' tokens, as vLLM does.
    let block_tokens = if shared.zmq.is_some() {
        let mut t = tokens.to_vec();
        t.truncate(blocks.len() * shared.hasher.block_size() as usize);
        t
    } else {
        Vec::new()
    };
    let keys = crate::cache::BlockKeys {
        lora: lora.map(Arc::from),
        salt: salt.map(Arc::from),
    };
    let kv = KvOf {
        blocks: &blocks,
        tokens: &block_tokens,
        keys: &keys,
    };
    // A decode leg first receives the prompt's KV; a prefill leg keeps it for one.
    let received = receive(&shared, &leg, &kv).await?;
    let keep = match &leg {
        Leg::Prefill { key, vllm } => {
            if !*vllm {
                // SGLang's prefill server computes the prompt and its first token only.
                (max_tokens, stops) = (1, false);
            }
            Some(pd::Keep {
                guard: shared.handoffs.begin(&shared.engine, key),
                blocks: blocks.clone(),
                tokens: block_tokens.clone(),
                keys: keys.clone(),
            })
        }
        _ => None,
    };
    let mut out = shared
        .engine
        .submit(blocks, block_tokens, keys, prompt_tokens, max_tokens);
    let first_out = out.recv().await;
    if let Some(lease) = received {
        // Admitted (or refused): the received blocks are the request's own now.
        shared.engine.unpin(&lease);
    }
    let cached_tokens = match first_out {
        Some(Output::Admitted { cached_tokens }) => cached_tokens,
        Some(Output::TooLarge { needed }) => {
            return Err(error(
                StatusCode::BAD_REQUEST,
                &format!("the request needs {needed} KV blocks, more than this worker has"),
                "invalid_request_error",
                Some("prompt"),
            ));
        }
        _ => {
            return Err(error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "engine stopped",
                "server_error",
                None,
            ));
        }
    };
    let answer = Answer {
        api,
        id: format!(
            "{}-{:x}",
            if api == Api::Chat { "chatcmpl" } else { "cmpl" },
            shared.served.load(Ordering::Relaxed)
        ),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        // The model named, as vLLM answers (an adapter's name for an adapter).
        model: parsed.model.clone(),
        prompt_tokens,
        cached_tokens,
        first,
        max_tokens,
        stops,
        fault,
        strike: faults.after_tokens,
        keep,
        out,
    };
    if !parsed.stream {
        return Ok(answer.whole(&shared, &leg).await);
    }
    if fault == Fault::CutStream {
        cut_at = cut_at.or(Some(faults.after_tokens.unwrap_or(max_tokens / 2)));
    }
    let how = Streaming {
        interval,
        cut_at,
        include_usage: parsed.include_usage,
        prompt_ids,
    };
    Ok(answer.stream(shared.engine.clone(), how))
}

/// A request read and checked before the engine sees it.
struct Checked {
    body: Bytes,
    parsed: openai::CompletionRequest,
    /// Tokens per chunk after the first.
    interval: usize,
    leg: Leg,
}

/// The request read (bounded), parsed and checked against this worker: its model, its
/// `stream_interval`, its P/D leg.
async fn check(
    shared: &Shared,
    api: Api,
    req: Request<Incoming>,
) -> Result<Checked, Response<Body>> {
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
    let body = read_body(req).await?;
    let parsed = openai::parse(api, &body).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            &e.message,
            "invalid_request_error",
            e.param.as_deref(),
        )
    })?;
    if parsed.model != shared.model && !shared.lora_adapters.contains(&parsed.model) {
        return Err(error(
            StatusCode::NOT_FOUND,
            &format!(
                "The model `{}` does not exist (this worker serves `{}`)",
                parsed.model, shared.model
            ),
            "invalid_request_error",
            Some("model"),
        ));
    }
    // vLLM's per-request `stream_interval`, at least the engine's own.
    let interval = match requested_interval(&body) {
        Ok(n) => n.max(shared.engine.config().stream_interval).max(1) as usize,
        // vLLM's answer to a field its request model refuses.
        Err(m) => {
            return Err(error(
                StatusCode::BAD_REQUEST,
                &m,
                "Bad Request",
                Some("body.stream_interval"),
            ));
        }
    };
    // A vLLM prefill keeps its KV under the request's ID.
    let leg = pd::leg(&shared.pd, &body, || {
        pd::request_id(request_id.as_deref(), fresh_id)
    })
    .map_err(|m| error(StatusCode::BAD_REQUEST, &m, "invalid_request_error", None))?;
    Ok(Checked {
        body,
        parsed,
        interval,
        leg,
    })
}

/// The request carries the fault marker: in its body, or (a prompt of token IDs, as a
/// router's exact continuation sends) as the marker's tokens, so a request that fails on
/// every engine fails as tokens too.
fn marked(
    shared: &Shared,
    faults: &super::FaultConfig,
    body: &[u8],
    prompt: &Prompt,
    tokens: &[u32],
) -> bool {
    let Some(m) = faults.marker.as_deref().filter(|m| !m.is_empty()) else {
        return false;
    };
    if body.windows(m.len()).any(|w| w == m.as_bytes()) {
        return true;
    }
    let ids = match prompt {
        Prompt::Tokens(_) => shared.tokenizer.encode(m).unwrap_or_default(),
        _ => Vec::new(),
    };
    !ids.is_empty() && tokens.windows(ids.len()).any(|w| w == ids)
}

/// The injected fault acted on before the first token: an answer in its place, or where
/// the stream is to be cut (a marked prompt's).
async fn inject(
    fault: Fault,
    faults: &super::FaultConfig,
    marked: bool,
    stream: bool,
) -> Result<Option<u32>, Response<Body>> {
    let mut cut_at = None;
    if marked {
        match faults.marker_after_tokens {
            None => {
                return Err(
                    faults.status_answer("injected fault: this prompt fails on every worker")
                );
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
        Fault::Hang => Err(std::future::pending().await),
        Fault::Error | Fault::Refuse => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "injected fault",
            "server_error",
            None,
        )),
        Fault::Status => Err(faults.status_answer("injected fault")),
        Fault::Stall if !stream => Err(std::future::pending().await),
        Fault::None | Fault::CutStream | Fault::Stall | Fault::Crash => Ok(cut_at),
    }
}

/// The prompt's tokens (a chat rendered with the model's template) and the first word
/// the answer generates.
fn prompt_tokens(
    shared: &Shared,
    parsed: &openai::CompletionRequest,
) -> Result<(Vec<u32>, u32), Box<Response<Body>>> {
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
    match tokens {
        Ok((t, first)) if !t.is_empty() => Ok((t, first)),
        Ok(_) => Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "the prompt is empty",
            "invalid_request_error",
            Some("prompt"),
        ))),
        Err(e) => Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            &e.to_string(),
            "invalid_request_error",
            Some("prompt"),
        ))),
    }
}

/// The limits vLLM checks before it schedules anything (`input_tokens`, then
/// `max_tokens` against the context, then `min_tokens`).
fn within_limits(
    shared: &Shared,
    parsed: &openai::CompletionRequest,
    prompt_tokens: u32,
) -> Result<(), Box<Response<Body>>> {
    let context = shared.engine.config().max_model_len();
    if u64::from(prompt_tokens) >= context {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            &format!(
                "This model's maximum context length is {context} tokens. However, your prompt contains at least {prompt_tokens} input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt."
            ),
            "BadRequestError",
            Some("input_tokens"),
        )));
    }
    if let Some(m) = parsed.max_tokens.filter(|m| u64::from(*m) > context) {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            &format!(
                "max_tokens={m} cannot be greater than max_model_len={context}. Please request fewer output tokens."
            ),
            "BadRequestError",
            Some("max_tokens"),
        )));
    }
    if let Some(m) = parsed.max_tokens.filter(|m| parsed.min_tokens > *m) {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            &format!(
                "min_tokens must be less than or equal to max_tokens={m}, got {}.",
                parsed.min_tokens
            ),
            "BadRequestError",
            None,
        )));
    }
    Ok(())
}

/// A prompt's KV: its blocks, their tokens, their extra keys.
struct KvOf<'a> {
    blocks: &'a [switchyard_ids::BlockHash],
    tokens: &'a [u32],
    keys: &'a crate::cache::BlockKeys,
}

/// A decode leg's prompt KV fetched from its prefill worker and pinned until the
/// request is admitted (a vLLM decode recomputes what it cannot fetch; SGLang's fails).
async fn receive(
    shared: &Shared,
    leg: &Leg,
    kv: &KvOf<'_>,
) -> Result<Option<crate::cache::Lease>, Response<Body>> {
    let Leg::Decode {
        host,
        port,
        key,
        vllm,
    } = leg
    else {
        return Ok(None);
    };
    let have = shared.engine.cached_prefix(kv.blocks);
    match pd::fetch(host, *port, key, have, !*vllm).await {
        Ok(n) => {
            let n = n.min(kv.blocks.len());
            let bs = shared.hasher.block_size() as usize;
            let toks = kv.tokens.get(..n * bs).unwrap_or(&[]);
            Ok(shared.engine.pin(&kv.blocks[..n], toks, kv.keys))
        }
        Err(why) if *vllm => {
            tracing::warn!(key, why, "KV transfer failed; recomputing the prompt here");
            Ok(None)
        }
        Err(why) => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("KV transfer failed: {why}"),
            "server_error",
            None,
        )),
    }
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
