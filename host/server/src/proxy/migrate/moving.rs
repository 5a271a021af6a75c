//! A continuation placed and started: routed by the endpoint's policy on the prompt it
//! will be (the original and the answer so far), never on a worker that broke the stream,
//! and forwarded as the first attempt was.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use hyper::body::Incoming;

use crate::Gateway;
use crate::verdict::{self, Verdict};
use switchyard_ids::InstanceId;
use switchyard_router::{Ask, KvRouter, Placing};
use switchyard_tokens::ChatMessage;
use switchyard_tokens::openai::Prompt;

use super::super::forward::forward;
use super::super::tokenize::tokenize_prompt;
use super::super::{Booked, decided};
use super::super::{Booking, Failure, Forwarded};
use super::Resend;

/// A continuation to send.
pub(in crate::proxy) struct ContinueRequest {
    /// Where, and what it is routed on (with `text` after the prompt).
    pub(super) to: Resend,
    /// The exact prompt, at the token level (`None`: the text level).
    pub(super) tokens: Option<Vec<u32>>,
    pub(super) body: ContinueBody,
    pub(super) text: String,
    pub(super) exclude: Vec<InstanceId>,
}

/// A continuation's request body: built, or to be built off the async workers.
pub(in crate::proxy) enum ContinueBody {
    Ready(Bytes),
    Deferred(Box<super::bodies::BodyRecipe>),
}

impl ContinueRequest {
    /// It is sent as token IDs (exact), not as text.
    pub(in crate::proxy) fn token_level(&self) -> bool {
        self.tokens.is_some()
    }

    /// The body, built here if it was deferred (tests).
    #[cfg(test)]
    pub(super) fn body_now(&self) -> Bytes {
        match &self.body {
            ContinueBody::Ready(b) => b.clone(),
            ContinueBody::Deferred(r) => r.build(self.tokens.as_deref()).unwrap(),
        }
    }
}

/// A continuation that started on a worker.
pub(in crate::proxy) struct Moved {
    pub(in crate::proxy) worker: InstanceId,
    pub(in crate::proxy) booking: Booking,
    pub(in crate::proxy) predicted_blocks: u32,
    pub(in crate::proxy) first: Option<Bytes>,
    pub(in crate::proxy) upstream: Incoming,
}

/// Routes the continuation by the endpoint's policy (its own KV overlap; never to a
/// worker that broke the stream) and forwards it, trying further workers as the first
/// attempt would; returns once its first bytes came.
pub(in crate::proxy) async fn continue_stream(
    gw: Arc<Gateway>,
    router: Arc<KvRouter>,
    req: Box<ContinueRequest>,
) -> Result<Moved, String> {
    let body = match req.body {
        ContinueBody::Ready(b) => b,
        ContinueBody::Deferred(recipe) => {
            let ids = req.tokens.clone();
            crate::error::off_thread("the continuation's body", move || {
                recipe.build(ids.as_deref())
            })
            .await
            .map_err(|e| e.to_string())??
        }
    };
    // Routed on the prompt it will be: the original prompt and the answer so far,
    // rendered as the engine will render it.
    let to = req.to;
    let (context, open) = match (req.tokens, to.prompt) {
        (Some(t), _) => (Prompt::Tokens(t), false),
        (None, p) => match p {
            Prompt::Chat(mut m) => {
                match m.last_mut() {
                    Some(last) if to.continue_final => last.content.push_str(&req.text),
                    _ => m.push(ChatMessage {
                        role: "assistant".into(),
                        content: req.text,
                    }),
                }
                (Prompt::Chat(m), true)
            }
            Prompt::Text(t) => (Prompt::Text(t + &req.text), false),
            Prompt::Tokens(_) => return Err("a token prompt is not continued".into()),
        },
    };
    let tokens = tokenize_prompt(&gw, &context, open)
        .await
        .map_err(|e| format!("the continuation cannot be tokenized: {e}"))?;
    let hashes = router.hasher().keyed_hashes(
        &tokens,
        gw.config.served_by(&to.model).1,
        to.cache_salt.as_deref(),
    );
    let prompt_tokens = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
    let client = router.client().clone();
    let endpoint = router.endpoint().to_string();
    let mut exclude = req.exclude;
    let mut last: Option<String> = None;
    for _ in 0..gw.config.max_attempts.max(1) {
        // A continuation runs on one worker: on a fleet that splits prefill from
        // decode, a decode worker computes its prompt itself (where the handoff allows).
        let ask = Ask {
            session_key: to.session_key,
            ..Ask::new(prompt_tokens, &hashes)
        };
        let routed = router
            .place(&ask, &exclude, Instant::now(), Placing::Alone)
            .map_err(|e| match &last {
                None => format!("no worker could take it: {e}"),
                Some(last) => format!("{last}; and then no worker could take it: {e}"),
            })?;
        let Booked {
            routed, booking, ..
        } = decided(&gw, &endpoint, &router, routed);
        let worker = routed.worker;
        let Some(instance) = client.instance(worker) else {
            exclude.push(worker);
            continue;
        };
        let sent = forward(
            &gw,
            &instance.url,
            &to.path,
            &to.headers,
            body.clone(),
            gw.config.first_byte_timeout,
        )
        .await;
        match sent {
            Ok(Forwarded::Ok(_, first, upstream)) => {
                router.prefill_done(routed.request);
                router
                    .quality()
                    .continuations
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                verdict::apply(&gw, &client, worker, Verdict::Answered);
                return Ok(Moved {
                    worker,
                    booking,
                    predicted_blocks: routed.overlap_blocks,
                    first,
                    upstream,
                });
            }
            Ok(Forwarded::ClientError((parts, bytes))) => {
                // The worker cannot take a continuation (say, an engine without
                // `continue_final_message`): the request's limit, not the worker's fault.
                return Err(format!(
                    "the worker refused the continuation ({}): {}",
                    parts.status,
                    String::from_utf8_lossy(&bytes[..bytes.len().min(512)])
                ));
            }
            Err(f) => {
                let reason = f.reason();
                // A 5xx or a timeout counts against no one here: the stream's breaks
                // are charged once it ends (`relay`).
                match &f {
                    Failure::Unreachable(_) | Failure::Closed(_) => {
                        verdict::apply(&gw, &client, worker, Verdict::Unreachable(&reason));
                    }
                    Failure::Busy(_, retry_after) => {
                        verdict::apply(&gw, &client, worker, Verdict::Busy(*retry_after));
                    }
                    _ => {}
                }
                tracing::warn!(%endpoint, instance = %worker, %reason, "continuation attempt failed");
                exclude.push(worker);
                last = Some(reason);
            }
        }
    }
    Err(last.unwrap_or_else(|| "no worker was tried".into()))
}
