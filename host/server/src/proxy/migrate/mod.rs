//! Migration: a stream that breaks after it started (the worker gone, stalled, or sending
//! a server error) is continued on another worker, and the client sees one stream.
//!
//! While a continuable stream runs, [`Migration`] watches its events: the answer so far
//! (bounded), the tokens sent, the first event's `id`, `created` and `model`, and
//! whether the engine's final chunk came. When the stream breaks, the request is sent
//! again to another worker with the answer so far appended — as token IDs when the
//! stream carried them (vLLM's `return_token_ids`: a completion of the prompt's IDs and
//! the answer's, exact), else as text (chat: an open assistant message with
//! `continue_final_message`; completions: after the prompt) — and `max_tokens` reduced by
//! what was sent; the continuation is routed by the endpoint's policy with its
//! own KV overlap, never to a worker that broke it. Its events are rewritten to the first
//! stream's identity and its final `usage` to the whole answer's
//! (docs/architecture/availability.md, "Migration").

use bytes::Bytes;
use serde_json::{Value, json};

use crate::Gateway;
use switchyard_ids::InstanceId;
use switchyard_tokens::openai::{self, Api, CompletionRequest, Prompt};

use super::chunk::{self, Seen, token_ids};
use super::forward::Outbound;
use super::tokenize::BLOCKING_TOKENIZE_BYTES;
use bodies::completion_chunk_as_chat;
use sse::{event_data, find_event_end, server_error};

mod asked;
mod bodies;
mod moving;
mod sse;

pub use asked::strip_token_ids;
pub use bodies::continuation_of;
pub(super) use moving::{ContinueBody, ContinueRequest, Moved, continue_stream};

/// The most answer text kept per stream to continue it (~250k tokens); a longer answer
/// is relayed on, but not continued if it breaks.
pub const MAX_KEPT_TEXT: usize = 1 << 20;

/// The longest event kept whole while waiting for its end, beside what the prompt's
/// token IDs take ([`event_limit`]); a worker sending a longer one has broken the stream,
/// which is continued elsewhere (no engine sends a token's event that large).
pub(super) const MAX_EVENT_BYTES: usize = 1 << 20;

/// The longest event a stream of a request of `body_len` bytes may send: vLLM's first
/// chunk with `return_token_ids` carries every prompt token's ID (up to 11 bytes each,
/// and a prompt has at most about as many tokens as its request has bytes), so the bound
/// grows with the request instead of failing long prompts.
pub(super) fn event_limit(body_len: usize) -> usize {
    MAX_EVENT_BYTES.saturating_add(body_len.saturating_mul(12))
}

/// Why a stream broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Break {
    /// The connection failed or closed before the engine's final chunk.
    Reset,
    /// The worker was silent for the idle timeout.
    Stall,
    /// The worker sent a server-error event.
    ErrorEvent,
    /// The worker left discovery (a graceful stop) and was still streaming after the
    /// drain grace.
    Drain,
    /// The worker was ejected and the stream went silent.
    Ejected,
}

impl Break {
    pub(super) fn label(self) -> &'static str {
        match self {
            Break::Reset => "reset",
            Break::Stall => "stall",
            Break::ErrorEvent => "error_event",
            Break::Drain => "drain",
            Break::Ejected => "ejected",
        }
    }

    /// A break to count against its worker once another has finished the answer (and
    /// towards the request's own fault). A stall counts at once; a drain is no fault; an
    /// ejection was counted by what ejected it.
    pub(super) fn is_failure(self) -> bool {
        matches!(self, Break::Reset | Break::ErrorEvent)
    }
}

/// The first stream's identity, which every continuation's events take.
struct Head {
    id: Value,
    created: Value,
    model: Value,
}

/// Where and how a request is sent again, and what its continuation is routed on.
#[derive(Clone)]
pub(super) struct Resend {
    path: String,
    headers: Outbound,
    prompt: Prompt,
    /// The client's chat already continued its last message.
    continue_final: bool,
    cache_salt: Option<String>,
    /// The model the client named (a LoRA adapter keys its blocks).
    model: String,
    session_key: Option<u64>,
}

impl Resend {
    /// The client's request `parsed`, to be sent again to `path` with its headers.
    pub(super) fn new(
        path: &str,
        headers: &Outbound,
        parsed: &CompletionRequest,
        session_key: Option<u64>,
    ) -> Resend {
        Resend {
            path: path.to_string(),
            // A continuation is a request of its own (no split's request ID).
            headers: Outbound {
                request_id: None,
                ..headers.clone()
            },
            prompt: parsed.prompt.clone(),
            continue_final: parsed.continue_final_message,
            cache_salt: parsed.cache_salt.clone(),
            model: parsed.model.clone(),
            session_key,
        }
    }

    /// `prompt` sent to no path with no headers (for the fuzzer and tests).
    fn bare(prompt: Prompt) -> Resend {
        Resend {
            path: String::new(),
            headers: Outbound::default(),
            prompt,
            continue_final: false,
            cache_salt: None,
            model: String::new(),
            session_key: None,
        }
    }
}

/// What it takes to continue one request, and how far its answer has come.
pub(super) struct Migration {
    api: Api,
    to: Resend,
    /// The client's request body, and the fields read from it.
    body: Bytes,
    /// The answer's limit in tokens: the client's, or the engine's default for a
    /// completion (16); `None` for a chat that set none (the rest of the context).
    max_tokens: Option<u32>,
    /// The model's context (its workers' `max_model_len`), if the router knows it.
    context_len: Option<u32>,
    /// The original prompt's tokens (the router's count, which is the engine's when they
    /// share a tokenizer, as KV routing needs).
    prompt_tokens: u32,
    include_usage: bool,
    limit: u32,
    /// Migrations made so far.
    pub(super) used: u32,
    /// The answer so far (while it fits in [`MAX_KEPT_TEXT`]).
    text: String,
    /// Tokens sent to the client: each chunk's token IDs where it carries them, else one
    /// per chunk that stands for a token, with text or not ([`Seen::tokens`]).
    sent: u32,
    /// Tokens sent before the current worker's stream began.
    base: u32,
    /// Of `sent`, the tokens since the last chunk with text: the first bytes of a
    /// character, whose text the client has not got yet (a text-level continuation
    /// generates them again).
    textless: u32,
    head: Option<Head>,
    /// Why this stream can no longer be continued, once something made it so.
    blocked: Option<&'static str>,
    /// The engine ended the answer (a chunk with a `finish_reason`).
    finished: bool,
    /// The stream's `[DONE]` came.
    done: bool,
    /// A chunk with `usage` came.
    usage_seen: bool,
    /// Workers whose stream broke (not by a stall, which counts at once), counted
    /// against them once another worker has finished the answer.
    pub(super) broken: Vec<(InstanceId, String)>,
    /// Workers not to continue on.
    exclude: Vec<InstanceId>,
    /// A partial event, waiting for its end.
    buf: Vec<u8>,
    /// The longest event taken ([`event_limit`]).
    max_event: usize,
    /// When the last event reached the client before a break (the gap's start).
    pub(super) cut_at: Option<std::time::Instant>,
    /// Prompt tokens the continuations' workers prefilled (not found cached): what the
    /// migrations cost.
    pub(super) extra_prefill: u64,
    /// The current continuation's share of it, as its worker last reported.
    segment_prefill: u64,
    /// The prompt's token IDs, when the stream carries them (vLLM's `return_token_ids`).
    prompt_ids: Option<Vec<u32>>,
    /// The answer's token IDs, while every chunk that stood for tokens carried its own.
    ids: Option<Vec<u32>>,
    /// The current worker continues at the token level (a completion of token IDs,
    /// whose chunks a chat stream gets as chat chunks).
    token_segment: bool,
    /// The router asked the worker for token IDs (`return_token_ids`), which the client
    /// did not: they are taken out of every event it is sent.
    strip_ids: bool,
}

impl Migration {
    /// The migration state of a streaming request, or `None` if it cannot be continued
    /// honestly (several choices, log probabilities, an echoed prompt, a token-ID prompt,
    /// an answer held to a grammar) or migration is off. `context_len` is the model's
    /// context, if known.
    pub(super) fn new(
        gw: &Gateway,
        api: Api,
        to: Resend,
        body: &Bytes,
        parsed: &CompletionRequest,
        prompt_tokens: u32,
        context_len: Option<u32>,
    ) -> Option<Box<Migration>> {
        if !Migration::continuable(gw, parsed) {
            return None;
        }
        let mut m = Migration::fresh(api, body.clone(), to, gw.config.migration_limit);
        m.max_tokens = parsed.limit(api);
        m.context_len = context_len;
        m.prompt_tokens = prompt_tokens;
        m.include_usage = parsed.include_usage;
        Some(Box::new(m))
    }

    /// Whether a stream of `parsed` can be continued: migration is on and nothing makes
    /// the request impossible to continue honestly ([`Migration::new`]).
    fn continuable(gw: &Gateway, parsed: &CompletionRequest) -> bool {
        gw.config.migration_limit > 0
            && parsed.stream
            && parsed.n == 1
            && !parsed.logprobs
            && !parsed.echo
            && !parsed.constrained
            && !matches!(parsed.prompt, Prompt::Tokens(_))
    }

    /// `body` asking a worker for token IDs (`return_token_ids`), if the router asks for
    /// them: the request can be continued, migration is set to be exact
    /// (`--migration-token-ids`, on by default) and the client did not name the field
    /// itself (the router then strips what it asked for from the stream).
    pub(super) fn ask_token_ids(
        gw: &Gateway,
        parsed: &CompletionRequest,
        body: &Bytes,
    ) -> Option<Bytes> {
        if !gw.config.migration_token_ids || !Migration::continuable(gw, parsed) {
            return None;
        }
        asked::with_token_ids(body)
    }

    /// The router asked the worker for token IDs the client did not ask for: they are
    /// taken out of the stream.
    pub(super) fn ids_asked(mut self: Box<Migration>, asked: bool) -> Box<Migration> {
        self.strip_ids = asked;
        self
    }

    /// A request's state before anything was relayed.
    fn fresh(api: Api, body: Bytes, to: Resend, limit: u32) -> Migration {
        Migration {
            api,
            to,
            max_event: event_limit(body.len()),
            body,
            max_tokens: openai::default_max_tokens(api),
            context_len: None,
            prompt_tokens: 0,
            include_usage: false,
            limit,
            used: 0,
            text: String::new(),
            sent: 0,
            base: 0,
            textless: 0,
            head: None,
            blocked: None,
            finished: false,
            done: false,
            usage_seen: false,
            broken: Vec::new(),
            exclude: Vec::new(),
            buf: Vec::new(),
            cut_at: None,
            extra_prefill: 0,
            segment_prefill: 0,
            prompt_ids: None,
            ids: Some(Vec::new()),
            token_segment: false,
            strip_ids: false,
        }
    }

    /// The engine ended the answer: a break now loses only its closing events.
    pub(super) fn complete(&self) -> bool {
        self.finished || self.done
    }

    /// Takes a chunk of the worker's stream; returns the complete events to send to the
    /// client (rewritten after a migration), and a break if the worker sent a server
    /// error event (which is not sent on).
    pub(super) fn take(&mut self, data: &[u8]) -> (Bytes, Option<String>) {
        let mut buf = std::mem::take(&mut self.buf);
        // What was scanned before holds no event's end: a long event arriving in small
        // chunks is scanned once, not once per chunk.
        let mut skip = buf.len().saturating_sub(2);
        buf.extend_from_slice(data);
        let mut out = Vec::new();
        let mut broke = None;
        let mut start = 0;
        while let Some((end, next)) = find_event_end(&buf[start..], std::mem::take(&mut skip)) {
            let (event, next) = (&buf[start..start + end], start + next);
            if broke.is_none() {
                match self.event(event) {
                    Event::Pass => out.extend_from_slice(&buf[start..next]),
                    Event::Rewritten(b) => out.extend_from_slice(&b),
                    Event::Broke(why) => broke = Some(why),
                }
            }
            start = next;
        }
        buf.drain(..start);
        if buf.len() > self.max_event && broke.is_none() {
            buf.clear();
            broke = Some(format!(
                "the worker sent an event longer than {} bytes",
                self.max_event
            ));
        }
        self.buf = buf;
        (Bytes::from(out), broke)
    }

    fn event(&mut self, raw: &[u8]) -> Event {
        let Some(data) = event_data(raw) else {
            return Event::Pass;
        };
        if data.trim() == "[DONE]" {
            // The end of an OpenAI stream, even one whose chunks gave no finish_reason.
            self.done = true;
            return Event::Pass;
        }
        // The usual chunk, once the stream's identity is noted and while nothing was
        // migrated, is read into a view of the fields it needs (`chunk`); what the view
        // leaves takes the full path below.
        if self.used == 0
            && self.head.is_some()
            && !(self.token_segment && self.api == Api::Chat)
            && let Some(view) = chunk::read(self.api, &data)
        {
            self.usage_seen |= view.usage;
            if let Some(seen) = view.choice {
                self.note(seen);
            }
            return self.pass(&data);
        }
        let Ok(mut v) = serde_json::from_str::<Value>(&data) else {
            return Event::Pass;
        };
        if let Some(e) = v.get("error") {
            if server_error(e) {
                return Event::Broke(format!(
                    "the worker sent an error event: {}",
                    e.get("message").and_then(Value::as_str).unwrap_or("")
                ));
            }
            self.blocked = Some("the worker refused the request");
            return Event::Pass;
        }
        if self.token_segment && self.api == Api::Chat {
            completion_chunk_as_chat(&mut v);
        }
        if self.used == 0 && self.prompt_ids.is_none() && self.ids.is_some() {
            let ids = v
                .get("prompt_token_ids")
                .or_else(|| v.pointer("/choices/0/prompt_token_ids"));
            self.prompt_ids = ids.and_then(token_ids).filter(|p| p.len() <= MAX_KEPT_IDS);
            if let Some(p) = &self.prompt_ids {
                // The engine's own count.
                self.prompt_tokens = u32::try_from(p.len()).unwrap_or(u32::MAX);
            }
        }
        if self.head.is_none() {
            self.head = Some(Head {
                id: v.get("id").cloned().unwrap_or(Value::Null),
                created: v.get("created").cloned().unwrap_or(Value::Null),
                model: v.get("model").cloned().unwrap_or(Value::Null),
            });
        }
        if let Some(choice) = v
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first())
        {
            self.note(Seen::of_value(self.api, choice));
        }
        let usage = v.get("usage").filter(|u| !u.is_null());
        self.usage_seen |= usage.is_some();
        if self.used == 0 {
            return self.pass(&data);
        }
        if let Some(u) = usage {
            let prompt = u.get("prompt_tokens").and_then(Value::as_u64).unwrap_or(0);
            let cached = u
                .get("prompt_tokens_details")
                .and_then(|d| d.get("cached_tokens"))
                .and_then(Value::as_u64)
                .unwrap_or(0);
            // The last report wins (an engine may report usage on every chunk).
            self.segment_prefill = prompt.saturating_sub(cached);
        }
        self.rewrite(&mut v);
        Event::Rewritten(Bytes::from(format!("data: {v}\n\n")))
    }

    /// An event of the first stream, sent on: as the worker wrote it, or without the
    /// token IDs the router asked for.
    fn pass(&self, data: &str) -> Event {
        match self
            .strip_ids
            .then(|| asked::strip_token_ids(data))
            .flatten()
        {
            Some(stripped) => Event::Rewritten(Bytes::from(format!("data: {stripped}\n\n"))),
            None => Event::Pass,
        }
    }

    /// Notes a choice's text, tokens and finish.
    fn note(&mut self, seen: Seen) {
        if seen.tool_call {
            self.blocked = Some("a tool call cannot be continued mid-argument");
        }
        if seen.reasoning {
            self.blocked = Some("a separate reasoning stream cannot be continued");
        }
        let tokens = seen.tokens();
        match (&mut self.ids, &seen.ids) {
            (Some(ids), Some(new)) if ids.len() + new.len() <= MAX_KEPT_IDS => {
                ids.extend_from_slice(new)
            }
            // Tokens whose IDs the chunk did not carry: the answer's IDs are unknown.
            (Some(_), None) if tokens == 0 => {}
            _ => self.ids = None,
        }
        let tokens = u32::try_from(tokens).unwrap_or(u32::MAX);
        self.sent = self.sent.saturating_add(tokens);
        if seen.piece.as_ref().is_some_and(|p| !p.is_empty()) {
            self.textless = 0;
        } else {
            self.textless = self.textless.saturating_add(tokens);
        }
        if let Some(p) = seen.piece.filter(|p| !p.is_empty()) {
            if self.text.len() + p.len() > MAX_KEPT_TEXT {
                self.blocked = Some("the answer is longer than the router keeps to continue it");
                self.text = String::new();
            } else if self.blocked.is_none() {
                self.text.push_str(&p);
            }
        }
        if seen.finished {
            self.finished = true;
        }
    }

    /// A continuation's event in the first stream's identity, its usage the whole
    /// answer's.
    fn rewrite(&self, v: &mut Value) {
        let Some(obj) = v.as_object_mut() else { return };
        if let Some(h) = &self.head {
            obj.insert("id".into(), h.id.clone());
            obj.insert("created".into(), h.created.clone());
            obj.insert("model".into(), h.model.clone());
        }
        // The prompt's IDs came with the first stream's first chunk (a continuation's
        // would be the prompt and the answer so far).
        obj.remove("prompt_token_ids");
        if let Some(choice) = obj
            .get_mut("choices")
            .and_then(Value::as_array_mut)
            .and_then(|c| c.first_mut())
            .and_then(Value::as_object_mut)
        {
            choice.remove("prompt_token_ids");
            if self.strip_ids {
                choice.remove("token_ids");
            }
            if let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) {
                // The role came with the first stream's first chunk.
                delta.remove("role");
            }
        }
        if let Some(usage) = obj.get_mut("usage").and_then(Value::as_object_mut) {
            let completion = self.base.saturating_add(
                usage
                    .get("completion_tokens")
                    .and_then(Value::as_u64)
                    .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX)),
            );
            let cached = usage
                .get("prompt_tokens_details")
                .and_then(|d| d.get("cached_tokens"))
                .and_then(Value::as_u64)
                .map(|c| c.min(u64::from(self.prompt_tokens)));
            usage.insert("prompt_tokens".into(), self.prompt_tokens.into());
            usage.insert("completion_tokens".into(), completion.into());
            usage.insert(
                "total_tokens".into(),
                (u64::from(self.prompt_tokens) + u64::from(completion)).into(),
            );
            if let Some(c) = cached {
                usage.insert("prompt_tokens_details".into(), json!({"cached_tokens": c}));
            }
        }
    }

    /// Prompt tokens the continuations' workers prefilled, once the stream has ended.
    /// Tokens the current worker's stream has sent (its segment of the answer).
    pub(super) fn segment_tokens(&self) -> u32 {
        self.sent.saturating_sub(self.base)
    }

    pub(super) fn prefill_spent(&mut self) -> u64 {
        self.extra_prefill
            .saturating_add(std::mem::take(&mut self.segment_prefill))
    }

    /// Why this stream cannot be continued now, if it cannot (`None`: it can).
    pub(super) fn refusal(&self) -> Option<(&'static str, String)> {
        if let Some(why) = self.blocked {
            return Some(("not_continuable", why.to_string()));
        }
        if self.broken.len() >= 2 {
            return Some((
                "poison",
                format!(
                    "it broke on {} workers: treated as the request's own fault",
                    self.broken.len()
                ),
            ));
        }
        if self.used >= self.limit {
            return Some((
                "limit",
                format!("it was moved {} times (--migration-limit)", self.used),
            ));
        }
        None
    }

    /// The tokens still to generate: of the client's limit, else of the context
    /// (`None`: unknown, left to the engine's default).
    fn left(&self) -> Option<u32> {
        match self.max_tokens {
            Some(max) => Some(max.saturating_sub(self.sent)),
            // The rest of the context, counted exactly only with the engine's own
            // count of the prompt.
            None => self.prompt_ids.as_ref().and(self.context_len).map(|c| {
                c.saturating_sub(self.prompt_tokens)
                    .saturating_sub(self.sent)
            }),
        }
    }

    /// The worker's stream broke: a continuation request, and the worker excluded.
    pub(super) fn prepare(&mut self, worker: InstanceId) -> Result<Next, String> {
        self.exclude.push(worker);
        self.buf.clear();
        self.extra_prefill = self
            .extra_prefill
            .saturating_add(std::mem::take(&mut self.segment_prefill));
        self.used += 1;
        // At the text level the answer so far is its text: tokens that gave none yet (a
        // character's first bytes) are generated again, so they are not counted as sent.
        // A completion of token IDs has a default of its own (16): it needs the limit.
        let token_level = self.prompt_ids.is_some() && self.ids.is_some() && self.left().is_some();
        if !token_level {
            self.sent = self.sent.saturating_sub(std::mem::take(&mut self.textless));
        }
        self.base = self.sent;
        let left = self.left();
        if left == Some(0) {
            // Everything asked for was sent; only the final chunk was lost.
            return Ok(Next::Finish(self.closing_events(true)));
        }
        let tokens = match (&self.prompt_ids, &self.ids) {
            (Some(p), Some(ids)) if token_level => Some([p.as_slice(), ids].concat()),
            _ => None,
        };
        self.token_segment = tokens.is_some();
        let mut to = self.to.clone();
        if tokens.is_some() {
            to.path = "/v1/completions".into();
        }
        // Past 8 KiB the request is parsed and written again off the async workers, in
        // the continuation's task.
        let recipe = self.recipe(left);
        let body = if self.body.len() > BLOCKING_TOKENIZE_BYTES {
            ContinueBody::Deferred(Box::new(recipe))
        } else {
            ContinueBody::Ready(recipe.build(tokens.as_deref())?)
        };
        Ok(Next::Continue(Box::new(ContinueRequest {
            to,
            tokens,
            body,
            text: self.text.clone(),
            exclude: self.exclude.clone(),
        })))
    }

    /// A break after the engine ended the answer: the closing events it did not send.
    pub(super) fn close(&mut self) -> Bytes {
        self.buf.clear();
        self.closing_events(false)
    }
}

/// What the relay makes of a worker's stream cut into `chunks`, for a request on `api`
/// that has (`migrated`) or has not been continued yet: the bytes sent to the client,
/// the break seen (if any), the answer text kept and the tokens counted. For the fuzzer
/// (`switchyard`'s `fuzz.rs`) and tests.
pub fn relay_events(
    api: Api,
    migrated: bool,
    chunks: &[&[u8]],
) -> (Vec<u8>, Option<String>, usize, u32) {
    let body = Bytes::from_static(br#"{"model":"m","prompt":"p","max_tokens":100}"#);
    let mut m = Migration::fresh(api, body, Resend::bare(Prompt::Text("p".into())), 2);
    m.used = u32::from(migrated);
    let mut out = Vec::new();
    for c in chunks {
        let (o, broke) = m.take(c);
        out.extend_from_slice(&o);
        if broke.is_some() {
            return (out, broke, m.text.len(), m.sent);
        }
    }
    (out, None, m.text.len(), m.sent)
}

/// The most token IDs kept per stream to continue it at the token level (the prompt's,
/// and the answer's).
pub(super) const MAX_KEPT_IDS: usize = 1 << 20;

/// What a chunk's events became.
enum Event {
    /// Sent on as the worker wrote it.
    Pass,
    /// Sent on rewritten (a continuation's).
    Rewritten(Bytes),
    /// A server error from the worker: the stream broke.
    Broke(String),
}

/// After a break: continue on another worker, or end with the final chunk.
pub(super) enum Next {
    Continue(Box<ContinueRequest>),
    Finish(Bytes),
}

#[cfg(test)]
mod tests;
