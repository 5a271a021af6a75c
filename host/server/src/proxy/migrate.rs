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
//! stream's identity and its final `usage` to the whole answer's (ARCHITECTURE.md,
//! "Migration").

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::HeaderValue;
use serde_json::{Map, Value, json};

use crate::Gateway;
use switchyard_ids::InstanceId;
use switchyard_router::{KvRouter, Placing};
use switchyard_tokens::ChatMessage;
use switchyard_tokens::openai::{Api, CompletionRequest, Prompt};

use super::chunk::{self, Seen, token_ids};
use super::forward::forward;
use super::tokenize::tokenize_prompt;
use super::{Booking, Failure, Forwarded};

/// The most answer text kept per stream to continue it (~250k tokens); a longer answer
/// is relayed on, but not continued if it breaks.
pub const MAX_KEPT_TEXT: usize = 1 << 20;

/// The longest event kept whole while waiting for its end; a worker sending a longer one
/// has broken the stream, which is continued elsewhere (no engine sends a token's event
/// that large).
pub(super) const MAX_EVENT_BYTES: usize = 1 << 20;

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
    accept: Option<HeaderValue>,
    auth: Option<HeaderValue>,
    prompt: Prompt,
    /// The client's chat already continued its last message.
    continue_final: bool,
    cache_salt: Option<String>,
    session_key: Option<u64>,
}

impl Resend {
    /// `prompt` sent to no path with no headers (for the fuzzer and tests).
    fn bare(prompt: Prompt) -> Resend {
        Resend {
            path: String::new(),
            accept: None,
            auth: None,
            prompt,
            continue_final: false,
            cache_salt: None,
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
    max_tokens: u32,
    /// The original prompt's tokens (the router's count, which is the engine's when they
    /// share a tokenizer, as KV routing needs).
    prompt_tokens: u32,
    include_usage: bool,
    limit: u32,
    /// Migrations made so far.
    pub(super) used: u32,
    /// The answer so far (while it fits in [`MAX_KEPT_TEXT`]).
    text: String,
    /// Tokens sent to the client (one per chunk with text, as engines stream them).
    sent: u32,
    /// Tokens sent before the current worker's stream began.
    base: u32,
    head: Option<Head>,
    /// Why this stream can no longer be continued, once something made it so.
    blocked: Option<&'static str>,
    /// The current worker sent its final chunk (a `finish_reason`).
    pub(super) finished: bool,
    /// Workers whose stream broke (not by a stall, which counts at once), counted
    /// against them once another worker has finished the answer.
    pub(super) broken: Vec<(InstanceId, String)>,
    /// Workers not to continue on.
    exclude: Vec<InstanceId>,
    /// A partial event, waiting for its end.
    buf: Vec<u8>,
    /// When the last event reached the client before a break (the gap's start).
    pub(super) cut_at: Option<Instant>,
    /// Prompt tokens the continuations' workers prefilled (not found cached): what the
    /// migrations cost.
    pub(super) extra_prefill: u64,
    /// The current continuation's share of it, as its worker last reported.
    segment_prefill: u64,
    /// The prompt's token IDs, when the stream carries them (vLLM's `return_token_ids`).
    prompt_ids: Option<Vec<u32>>,
    /// The answer's token IDs, while every chunk with text carried its own.
    ids: Option<Vec<u32>>,
    /// The current worker continues at the token level (a completion of token IDs,
    /// whose chunks a chat stream gets as chat chunks).
    token_segment: bool,
}

impl Migration {
    /// The migration state of a streaming request, or `None` if it cannot be continued
    /// honestly (several choices, log probabilities, an echoed prompt, a token-ID prompt)
    /// or migration is off.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        gw: &Gateway,
        api: Api,
        path: &str,
        accept: Option<&HeaderValue>,
        auth: Option<&HeaderValue>,
        body: &Bytes,
        parsed: &CompletionRequest,
        session_key: Option<u64>,
        prompt_tokens: u32,
    ) -> Option<Box<Migration>> {
        let limit = gw.config.migration_limit;
        if limit == 0
            || !parsed.stream
            || parsed.n != 1
            || parsed.logprobs
            || parsed.echo
            || matches!(parsed.prompt, Prompt::Tokens(_))
        {
            return None;
        }
        let to = Resend {
            path: path.to_string(),
            accept: accept.cloned(),
            auth: auth.cloned(),
            prompt: parsed.prompt.clone(),
            continue_final: parsed.continue_final_message,
            cache_salt: parsed.cache_salt.clone(),
            session_key,
        };
        let mut m = Migration::fresh(api, body.clone(), to, limit);
        m.max_tokens = parsed.max_tokens;
        m.prompt_tokens = prompt_tokens;
        m.include_usage = parsed.include_usage;
        Some(Box::new(m))
    }

    /// A request's state before anything was relayed.
    fn fresh(api: Api, body: Bytes, to: Resend, limit: u32) -> Migration {
        Migration {
            api,
            to,
            body,
            max_tokens: 16,
            prompt_tokens: 0,
            include_usage: false,
            limit,
            used: 0,
            text: String::new(),
            sent: 0,
            base: 0,
            head: None,
            blocked: None,
            finished: false,
            broken: Vec::new(),
            exclude: Vec::new(),
            buf: Vec::new(),
            cut_at: None,
            extra_prefill: 0,
            segment_prefill: 0,
            prompt_ids: None,
            ids: Some(Vec::new()),
            token_segment: false,
        }
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
        if buf.len() > MAX_EVENT_BYTES && broke.is_none() {
            buf.clear();
            broke = Some(format!(
                "the worker sent an event longer than {MAX_EVENT_BYTES} bytes"
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
            self.finished = true;
            return Event::Pass;
        }
        // The usual chunk, once the stream's identity is noted and while nothing was
        // migrated, is read into a view of the fields it needs (`chunk`); what the view
        // leaves takes the full path below.
        if self.used == 0
            && self.head.is_some()
            && !(self.token_segment && self.api == Api::Chat)
            && let Some(choice) = chunk::read(self.api, &data)
        {
            if let Some(seen) = choice {
                self.note(seen);
            }
            return Event::Pass;
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
            self.observe(choice);
        }
        if self.used == 0 {
            return Event::Pass;
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
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

    /// Notes a choice's text, token and finish.
    fn observe(&mut self, choice: &Value) {
        self.note(Seen::of_value(self.api, choice));
    }

    fn note(&mut self, seen: Seen) {
        if seen.tool_call {
            self.blocked = Some("a tool call cannot be continued mid-argument");
        }
        if seen.reasoning {
            self.blocked = Some("a separate reasoning stream cannot be continued");
        }
        if let Some(p) = seen.piece.filter(|p| !p.is_empty()) {
            if let (Some(ids), Some(new)) = (&mut self.ids, seen.ids)
                && ids.len() + new.len() <= MAX_KEPT_IDS
            {
                ids.extend(new);
            } else {
                self.ids = None;
            }
            self.sent = self.sent.saturating_add(1);
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

    /// The worker's stream broke: a continuation request, and the worker excluded.
    pub(super) fn prepare(&mut self, worker: InstanceId) -> Result<Next, String> {
        self.exclude.push(worker);
        self.buf.clear();
        self.extra_prefill = self
            .extra_prefill
            .saturating_add(std::mem::take(&mut self.segment_prefill));
        self.used += 1;
        self.base = self.sent;
        let left = self.max_tokens.saturating_sub(self.sent);
        if left == 0 {
            // Everything asked for was sent; only the final chunk was lost.
            return Ok(Next::Finish(self.final_events()));
        }
        let tokens = match (&self.prompt_ids, &self.ids) {
            (Some(p), Some(ids)) => Some([p.as_slice(), ids].concat()),
            _ => None,
        };
        self.token_segment = tokens.is_some();
        let mut to = self.to.clone();
        let body = match &tokens {
            Some(t) => {
                to.path = "/v1/completions".into();
                self.token_body(t, left)?
            }
            None => self.continuation_body(left)?,
        };
        Ok(Next::Continue(Box::new(ContinueRequest {
            to,
            tokens,
            body,
            text: self.text.clone(),
            exclude: self.exclude.clone(),
        })))
    }

    /// A completion of `tokens` (the prompt's IDs and the answer's) with the client's
    /// sampling settings and `left` tokens to go: the exact continuation, for engines
    /// that stream token IDs.
    fn token_body(&self, tokens: &[u32], left: u32) -> Result<Bytes, String> {
        let asked: Map<String, Value> = serde_json::from_slice(&self.body)
            .map_err(|e| format!("the request cannot be read again: {e}"))?;
        let mut v = Map::new();
        for key in SAMPLING_FIELDS {
            if let Some(x) = asked.get(*key) {
                v.insert((*key).into(), x.clone());
            }
        }
        v.insert("prompt".into(), json!(tokens));
        v.insert("max_tokens".into(), left.into());
        v.insert("stream".into(), true.into());
        v.insert("return_token_ids".into(), true.into());
        if let Some(min) = asked.get("min_tokens").and_then(Value::as_u64) {
            v.insert(
                "min_tokens".into(),
                min.saturating_sub(u64::from(self.sent)).into(),
            );
        }
        serde_json::to_vec(&v)
            .map(Bytes::from)
            .map_err(|e| e.to_string())
    }

    /// The client's request with the answer so far appended and `left` tokens to go.
    fn continuation_body(&self, left: u32) -> Result<Bytes, String> {
        let mut v: Map<String, Value> = serde_json::from_slice(&self.body)
            .map_err(|e| format!("the request cannot be read again: {e}"))?;
        match self.api {
            Api::Chat => {
                let messages = v
                    .get_mut("messages")
                    .and_then(Value::as_array_mut)
                    .ok_or("the request has no messages")?;
                let open = self
                    .to
                    .continue_final
                    .then(|| messages.last_mut())
                    .flatten();
                if let Some(last) = open {
                    let before = match &self.to.prompt {
                        Prompt::Chat(m) => m.last().map(|m| m.content.clone()),
                        _ => None,
                    }
                    .unwrap_or_default();
                    last["content"] = Value::String(before + &self.text);
                } else {
                    messages.push(json!({"role": "assistant", "content": self.text}));
                }
                v.insert("continue_final_message".into(), true.into());
                v.insert("add_generation_prompt".into(), false.into());
            }
            Api::Completions => match v.get_mut("prompt") {
                Some(Value::String(p)) => p.push_str(&self.text),
                Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                    let p = a[0].as_str().unwrap_or_default().to_string();
                    a[0] = Value::String(p + &self.text);
                }
                _ => return Err("the prompt cannot be continued".into()),
            },
        }
        let mut set = false;
        for key in ["max_tokens", "max_completion_tokens"] {
            if v.get(key).is_some_and(|m| !m.is_null()) {
                v.insert(key.into(), left.into());
                set = true;
            }
        }
        if !set {
            v.insert("max_tokens".into(), left.into());
        }
        if let Some(min) = v.get("min_tokens").and_then(Value::as_u64) {
            let min = min.saturating_sub(u64::from(self.sent));
            v.insert("min_tokens".into(), min.into());
        }
        serde_json::to_vec(&v)
            .map(Bytes::from)
            .map_err(|e| e.to_string())
    }

    /// The engine's final chunk (and usage, and `[DONE]`) for an answer that was
    /// complete when its stream broke.
    fn final_events(&self) -> Bytes {
        let (id, created, model) = match &self.head {
            Some(h) => (h.id.clone(), h.created.clone(), h.model.clone()),
            None => (Value::Null, Value::Null, Value::Null),
        };
        let (object, choice) = match self.api {
            Api::Chat => (
                "chat.completion.chunk",
                json!({"index": 0, "delta": {}, "finish_reason": "length"}),
            ),
            Api::Completions => (
                "text_completion",
                json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "length"}),
            ),
        };
        let mut out = format!(
            "data: {}\n\n",
            json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]})
        );
        if self.include_usage {
            let usage = json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": self.sent,
                "total_tokens": u64::from(self.prompt_tokens) + u64::from(self.sent)});
            out.push_str(&format!(
                "data: {}\n\n",
                json!({"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": usage})
            ));
        }
        out.push_str("data: [DONE]\n\n");
        Bytes::from(out)
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

/// The request fields a token-level continuation carries over: sampling and stopping,
/// as vLLM's completions take them.
const SAMPLING_FIELDS: &[&str] = &[
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "stream_options",
    "cache_salt",
    "user",
];

/// A completion chunk reshaped as a chat chunk: its `text` becomes the delta's content.
fn completion_chunk_as_chat(v: &mut Value) {
    let Some(obj) = v.as_object_mut() else { return };
    obj.insert("object".into(), "chat.completion.chunk".into());
    if let Some(choice) = obj
        .get_mut("choices")
        .and_then(Value::as_array_mut)
        .and_then(|c| c.first_mut())
        .and_then(Value::as_object_mut)
    {
        let text = choice.remove("text");
        choice.remove("logprobs");
        choice.remove("prompt_token_ids");
        let mut delta = Map::new();
        if let Some(t) = text.filter(|t| t.as_str().is_some_and(|s| !s.is_empty())) {
            delta.insert("content".into(), t);
        }
        choice.insert("delta".into(), Value::Object(delta));
    }
}

/// The text-level continuation the router would send for a client's `body` on `api`
/// after `sent` tokens of `answer` (`None`: the request is not continued at all). For the
/// fuzzer and tests.
pub fn continuation_of(
    api: Api,
    body: &[u8],
    answer: &str,
    sent: u32,
) -> Option<Result<Bytes, String>> {
    let parsed = switchyard_tokens::openai::parse(api, body).ok()?;
    let mut to = Resend::bare(parsed.prompt.clone());
    to.continue_final = parsed.continue_final_message;
    let mut m = Migration::fresh(api, Bytes::copy_from_slice(body), to, 2);
    m.max_tokens = parsed.max_tokens;
    m.text = answer.to_string();
    m.sent = sent;
    let left = m.max_tokens.checked_sub(sent).filter(|l| *l > 0)?;
    Some(m.continuation_body(left))
}

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

/// Where an SSE event ends in `buf`, looking from `from`: (end of its text, start of the
/// next event).
fn find_event_end(buf: &[u8], from: usize) -> Option<(usize, usize)> {
    let mut i = from;
    while i < buf.len() {
        if buf[i] == b'\n' {
            if buf.get(i + 1) == Some(&b'\n') {
                return Some((i, i + 2));
            }
            if buf.get(i + 1) == Some(&b'\r') && buf.get(i + 2) == Some(&b'\n') {
                return Some((i, i + 3));
            }
        }
        i += 1;
    }
    None
}

/// The `data:` lines of an event, joined (`None`: it has none, e.g. a comment).
fn event_data(raw: &[u8]) -> Option<Cow<'_, str>> {
    let text = std::str::from_utf8(raw).ok()?;
    let mut data: Option<Cow<str>> = None;
    for line in text.lines() {
        let line = line.trim_end_matches('\r');
        if let Some(rest) = line.strip_prefix("data:") {
            let rest = rest.strip_prefix(' ').unwrap_or(rest);
            match &mut data {
                Some(d) => {
                    let d = d.to_mut();
                    d.push('\n');
                    d.push_str(rest);
                }
                None => data = Some(Cow::Borrowed(rest)),
            }
        }
    }
    data
}

/// An error event the worker is at fault for (a 5xx code or a server-error type), as
/// vLLM and SGLang send them mid-stream.
fn server_error(e: &Value) -> bool {
    let code = e.get("code").and_then(Value::as_u64).unwrap_or(0);
    let kind = e.get("type").and_then(Value::as_str).unwrap_or("");
    code >= 500
        || kind.eq_ignore_ascii_case("server_error")
        || kind.eq_ignore_ascii_case("InternalServerError")
        || kind.eq_ignore_ascii_case("internal_server_error")
}

/// A continuation to send.
pub(super) struct ContinueRequest {
    /// Where, and what it is routed on (with `text` after the prompt).
    to: Resend,
    /// The exact prompt, at the token level (`None`: the text level).
    tokens: Option<Vec<u32>>,
    body: Bytes,
    text: String,
    exclude: Vec<InstanceId>,
}

impl ContinueRequest {
    /// It is sent as token IDs (exact), not as text.
    pub(super) fn token_level(&self) -> bool {
        self.tokens.is_some()
    }
}

/// A continuation that started on a worker.
pub(super) struct Moved {
    pub(super) worker: InstanceId,
    pub(super) booking: Booking,
    pub(super) predicted_blocks: u32,
    pub(super) first: Option<Bytes>,
    pub(super) upstream: Incoming,
}

/// Routes the continuation by the endpoint's policy (its own KV overlap; never to a
/// worker that broke the stream) and forwards it, trying further workers as the first
/// attempt would; returns once its first bytes came.
pub(super) async fn continue_stream(
    gw: Arc<Gateway>,
    router: Arc<KvRouter>,
    req: Box<ContinueRequest>,
) -> Result<Moved, String> {
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
    let hashes = router
        .hasher()
        .salted_hashes(&tokens, to.cache_salt.as_deref());
    let prompt_tokens = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
    let client = router.client().clone();
    let endpoint = router.endpoint().to_string();
    let mut exclude = req.exclude;
    let mut last: Option<String> = None;
    for _ in 0..gw.config.max_attempts.max(1) {
        // A continuation runs on one worker: on a fleet that splits prefill from
        // decode, a decode worker computes its prompt itself (where the handoff allows).
        let routed = router
            .place(
                prompt_tokens,
                &hashes,
                to.session_key,
                &exclude,
                Instant::now(),
                Placing::Alone,
            )
            .map_err(|e| match &last {
                None => format!("no worker could take it: {e}"),
                Some(last) => format!("{last}; and then no worker could take it: {e}"),
            })?;
        gw.metrics
            .timings
            .decision(&endpoint, routed.decision_time, routed.decision.call_time);
        let booking = Booking {
            router: router.clone(),
            request: routed.request,
        };
        let worker = routed.worker;
        let Some(instance) = client.instance(worker) else {
            exclude.push(worker);
            continue;
        };
        let sent = forward(
            &gw,
            &instance.url,
            &to.path,
            to.accept.as_ref(),
            to.auth.as_ref(),
            req.body.clone(),
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
                client.record_success(worker);
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
                match &f {
                    Failure::Unreachable(_) | Failure::Closed(_) if gw.config.availability => {
                        client.report_instance_down(worker, &reason);
                    }
                    Failure::Busy(_, retry_after) => {
                        client.report_busy(worker, *retry_after);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_cut_at_blank_lines_whatever_the_chunks() {
        let mut buf = b"data: {\"a\":1}\n\ndata: [DO".to_vec();
        let (end, next) = find_event_end(&buf, 0).unwrap();
        assert_eq!(&buf[..end], b"data: {\"a\":1}");
        buf.drain(..next);
        assert_eq!(find_event_end(&buf, 0), None);
        assert_eq!(event_data(b"data: [DONE]").as_deref(), Some("[DONE]"));
        assert_eq!(event_data(b": a comment"), None);
        assert_eq!(
            event_data(b"event: x\r\ndata: {\r\ndata: }").as_deref(),
            Some("{\n}")
        );
    }

    #[test]
    fn a_server_error_event_breaks_the_stream_and_is_not_sent_on() {
        let ok = b"data: {\"id\":\"a\",\"choices\":[{\"index\":0,\"text\":\"x \",\"finish_reason\":null}]}\n\n";
        let err = b"data: {\"error\":{\"message\":\"engine died\",\"type\":\"InternalServerError\",\"code\":500}}\n\n";
        let (out, broke, kept, sent) = relay_events(Api::Completions, false, &[ok, err]);
        assert_eq!(out, ok, "the error event is not sent on");
        assert!(broke.unwrap().contains("engine died"));
        assert_eq!((kept, sent), (2, 1));
        // A client's error is the request's: sent on, no break.
        let bad = b"data: {\"error\":{\"message\":\"bad\",\"type\":\"BadRequestError\",\"code\":400}}\n\n";
        let (out, broke, _, _) = relay_events(Api::Completions, false, &[bad]);
        assert_eq!((out.as_slice(), broke), (&bad[..], None));
    }

    #[test]
    fn only_the_workers_own_errors_break_a_stream() {
        assert!(server_error(
            &json!({"message": "x", "type": "InternalServerError", "code": 500})
        ));
        assert!(server_error(&json!({"type": "server_error", "code": null})));
        assert!(!server_error(
            &json!({"type": "BadRequestError", "code": 400})
        ));
    }
}
