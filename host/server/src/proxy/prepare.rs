//! A completion's first two stages: its body read into a request on its model's router
//! (parsed, tokenized, hashed, held to the context), then admitted by the overload queue
//! or refused.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::header::{ACCEPT, AUTHORIZATION};

use super::forward;
use super::tokenize::{BLOCKING_TOKENIZE_BYTES, tokenize};
use crate::queue::classes::Identity;
use crate::{ApiError, Gateway};
use switchyard_ids::BlockHash;
use switchyard_router::{Ask, KvRouter, Routed};
use switchyard_tokens::openai::{self, Api, CompletionRequest};

/// A request ready to place: parsed, on its model's router, tokenized and hashed.
pub(super) struct Prepared {
    pub(super) api: Api,
    /// The path it came on (and goes to the worker on).
    pub(super) path: String,
    pub(super) parsed: CompletionRequest,
    pub(super) router: Arc<KvRouter>,
    /// The client's headers a worker gets.
    pub(super) headers: forward::Outbound,
    /// The prompt's block hashes (salted with its `cache_salt`).
    pub(super) hashes: Vec<BlockHash>,
    pub(super) prompt_tokens: u32,
    /// The session's key, from the request's `user`.
    pub(super) session_key: Option<u64>,
    /// How long a worker has for its first byte: a stream's first token, a plain
    /// answer's end.
    pub(super) limit: Duration,
    /// Who it is (class, tenant, deadline) and its latency objectives.
    pub(super) who: Identity,
}

impl Prepared {
    /// The request as the router places it.
    pub(super) fn ask(&self) -> Ask<'_> {
        Ask {
            prompt_tokens: self.prompt_tokens,
            hashes: &self.hashes,
            session_key: self.session_key,
            stream: self.parsed.stream,
            max_tokens: self.parsed.limit(self.api),
            objectives: self.who.objectives,
        }
    }
}

/// Parses the body (off the async workers when large), finds its model's router,
/// tokenizes and hashes the prompt, and refuses a prompt no worker can take before
/// anything is booked or predicted: it must not cost the router its locks or its
/// prediction budget.
pub(super) async fn prepare(
    gw: &Arc<Gateway>,
    api: Api,
    req: &hyper::http::request::Parts,
    body: &Bytes,
) -> Result<Prepared, ApiError> {
    let b = body.clone();
    let large = body.len() > BLOCKING_TOKENIZE_BYTES;
    let parsed =
        crate::error::off_thread_if(large, "the request parser", move || openai::parse(api, &b))
            .await?
            .map_err(ApiError::BadRequest)?;
    let (served_by, lora) = gw.config.served_by(&parsed.model);
    let router = gw.fleet.router_for_model(served_by).ok_or_else(|| {
        if gw.fleet.model_known(served_by) {
            ApiError::ModelUnavailable(parsed.model.clone())
        } else {
            ApiError::UnknownModel(parsed.model.clone())
        }
    })?;
    let headers = forward::Outbound {
        accept: req.headers.get(ACCEPT).cloned(),
        // Kept only for endpoints whose workers may see clients' credentials.
        auth: req
            .headers
            .get(AUTHORIZATION)
            .cloned()
            .filter(|_| router.forwards_authorization()),
        request_id: None,
    };
    let who = gw
        .config
        .overload
        .identify(&req.headers, gw.config.request_timeout)
        .map_err(|message| {
            ApiError::BadRequest(openai::BadRequest {
                message,
                param: None,
            })
        })?;
    let tokens = tokenize(gw, &parsed.prompt, parsed.continue_final_message).await?;
    let context = router
        .context_len()
        .map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX));
    if tokens.len() > gw.config.max_prompt_tokens.min(context) {
        let limit = if context < gw.config.max_prompt_tokens {
            format!("the model's context is {context} tokens (its workers' max_model_len)")
        } else {
            format!(
                "this router takes at most {} (--max-prompt-tokens)",
                gw.config.max_prompt_tokens
            )
        };
        return Err(ApiError::BadRequest(openai::BadRequest {
            message: format!("the prompt has {} tokens; {limit}", tokens.len()),
            param: Some(
                if api == Api::Chat {
                    "messages"
                } else {
                    "prompt"
                }
                .into(),
            ),
        }));
    }
    let session_key = parsed
        .user
        .as_deref()
        .map(|u| xxhash_rust::xxh3::xxh3_64(u.as_bytes()));
    let hashes = router
        .hasher()
        .keyed_hashes(&tokens, lora, parsed.cache_salt.as_deref());
    let limit = if parsed.stream {
        gw.config.first_byte_timeout
    } else {
        gw.config.request_timeout
    };
    Ok(Prepared {
        api,
        path: req.uri.path().to_string(),
        prompt_tokens: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
        parsed,
        router,
        headers,
        hashes,
        session_key,
        limit,
        who,
    })
}

/// Past the fleet's capacity the request waits in the router's queue (`crate::queue`):
/// placed when a worker has room (`Some`), routed at once (`None`), or shed. While it
/// waits it holds no in-flight slot (`slot` is given back, and taken again when it is
/// placed, past the bound if need be: the queue's limits bound what waits), so one
/// saturated endpoint's queue cannot refuse requests to others.
pub(super) async fn admit(
    gw: &Arc<Gateway>,
    p: &Prepared,
    body_len: usize,
    slot: &mut Option<switchyard_bounded::slot::Slot>,
) -> Result<Option<Routed>, ApiError> {
    let Some(queue) = gw.queue_for(&p.router) else {
        return Ok(None);
    };
    let job = crate::queue::Job::of(&p.ask());
    use crate::queue::{Admission, Outcome};
    let outcome = match queue.admit(&p.who, job, body_len) {
        Admission::Now(outcome) => outcome,
        Admission::Queued(ticket) => {
            let count = slot.take().map(|s| s.count().clone());
            let outcome = ticket.wait().await;
            *slot = count.map(|c| switchyard_bounded::slot::Slot::force(&c));
            outcome
        }
    };
    match outcome {
        Outcome::Placed(placed) => Ok(Some(placed.take())),
        Outcome::Route => Ok(None),
        Outcome::Refused(e) => Err(e.into()),
        Outcome::Shed(s) => Err(ApiError::Shed(s)),
    }
}
