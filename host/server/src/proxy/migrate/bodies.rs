//! What a migration sends: the continuation's request body (at the token level or as
//! text) and the closing events of an answer that was complete when its stream broke.

use bytes::Bytes;
use serde_json::{Map, Value, json};

use switchyard_tokens::openai::{self, Api};

use super::{Migration, Resend};

/// What a continuation's body is built from: the client's request, the answer so far
/// and what is left of it. Built on the relay's thread for a small request, off the async
/// workers for a large one (`ContinueBody::Deferred`: the whole request is parsed and
/// written again).
#[derive(Debug, Clone)]
pub(in crate::proxy) struct BodyRecipe {
    api: Api,
    /// The client's request body.
    body: Bytes,
    /// The client's chat continues its own last message.
    continue_final: bool,
    /// That message's content as the client sent it.
    last_message: Option<String>,
    /// The answer so far.
    text: String,
    /// Tokens sent so far.
    sent: u32,
    /// Tokens still to generate (`None`: left to the engine's default).
    left: Option<u32>,
}

impl BodyRecipe {
    /// The body: a completion of `tokens` at the token level, else the client's request
    /// with the answer so far appended.
    pub(in crate::proxy) fn build(&self, tokens: Option<&[u32]>) -> Result<Bytes, String> {
        match (tokens, self.left) {
            (Some(t), Some(left)) => self.token_body(t, left),
            _ => self.continuation_body(),
        }
    }

    /// A completion of `tokens` (the prompt's IDs and the answer's) with the client's
    /// sampling settings and `left` tokens to go: the exact continuation, for engines
    /// that stream token IDs. The limit is always set: a completion's own default (16)
    /// is not the chat's.
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

    /// The client's request with the answer so far appended and `left` tokens to go
    /// (`None`: no limit is set, and the engine gives what its default leaves — for a
    /// chat that named none, the rest of the context, as the first worker would have).
    fn continuation_body(&self) -> Result<Bytes, String> {
        let mut v: Map<String, Value> = serde_json::from_slice(&self.body)
            .map_err(|e| format!("the request cannot be read again: {e}"))?;
        match self.api {
            Api::Chat => {
                let messages = v
                    .get_mut("messages")
                    .and_then(Value::as_array_mut)
                    .ok_or("the request has no messages")?;
                let open = self.continue_final.then(|| messages.last_mut()).flatten();
                if let Some(last) = open {
                    let before = self.last_message.clone().unwrap_or_default();
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
        match self.left {
            Some(left) => {
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
            }
            None => {
                v.remove("max_tokens");
                v.remove("max_completion_tokens");
            }
        }
        if let Some(min) = v.get("min_tokens").and_then(Value::as_u64) {
            let min = min.saturating_sub(u64::from(self.sent));
            v.insert("min_tokens".into(), min.into());
        }
        serde_json::to_vec(&v)
            .map(Bytes::from)
            .map_err(|e| e.to_string())
    }
}

impl Migration {
    /// What the continuation's body is built from, `left` tokens to go.
    pub(super) fn recipe(&self, left: Option<u32>) -> BodyRecipe {
        BodyRecipe {
            api: self.api,
            body: self.body.clone(),
            continue_final: self.to.continue_final,
            last_message: match &self.to.prompt {
                openai::Prompt::Chat(m) => m.last().map(|m| m.content.clone()),
                _ => None,
            },
            text: self.text.clone(),
            sent: self.sent,
            left,
        }
    }

    /// The events an answer that ended lacks: its final chunk (`length`, when the
    /// engine's was lost with it), the usage the client asked for unless it came, and
    /// `[DONE]` unless it came.
    pub(super) fn closing_events(&self, final_chunk: bool) -> Bytes {
        let (id, created, model) = match &self.head {
            Some(h) => (h.id.clone(), h.created.clone(), h.model.clone()),
            None => (Value::Null, Value::Null, Value::Null),
        };
        let object = match self.api {
            Api::Chat => "chat.completion.chunk",
            Api::Completions => "text_completion",
        };
        let mut out = String::new();
        if final_chunk && !self.finished {
            let choice = match self.api {
                Api::Chat => json!({"index": 0, "delta": {}, "finish_reason": "length"}),
                Api::Completions => {
                    json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "length"})
                }
            };
            out.push_str(&format!(
                "data: {}\n\n",
                json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]})
            ));
        }
        if self.include_usage && !self.usage_seen {
            let usage = json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": self.sent,
                "total_tokens": u64::from(self.prompt_tokens) + u64::from(self.sent)});
            out.push_str(&format!(
                "data: {}\n\n",
                json!({"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": usage})
            ));
        }
        if !self.done {
            out.push_str("data: [DONE]\n\n");
        }
        Bytes::from(out)
    }
}

/// The request fields a token-level continuation carries over: sampling and stopping,
/// and the per-token constraints (bias, allowed and banned tokens), as vLLM's
/// completions take them. Grammars are not among them: a request held to one is not
/// continued (`CompletionRequest::constrained`).
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
    "length_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "priority",
    "stream_options",
    "cache_salt",
    "user",
];

/// A completion chunk reshaped as a chat chunk: its `text` becomes the delta's content.
pub(super) fn completion_chunk_as_chat(v: &mut Value) {
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
    let parsed = openai::parse(api, body).ok()?;
    let mut to = Resend::bare(parsed.prompt.clone());
    to.continue_final = parsed.continue_final_message;
    let mut m = Migration::fresh(api, Bytes::copy_from_slice(body), to, 2);
    m.max_tokens = parsed.limit(api);
    m.text = answer.to_string();
    m.sent = sent;
    let left = match m.max_tokens {
        Some(max) => Some(max.checked_sub(sent).filter(|l| *l > 0)?),
        None => None,
    };
    Some(m.recipe(left).build(None))
}
