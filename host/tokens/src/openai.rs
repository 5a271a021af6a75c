//! The OpenAI-compatible wire format: request parsing and error bodies, shared by the
//! router's front door and the mock worker.

use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::ChatMessage;

/// The prompt of a request, as the client sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Text (`/v1/completions` with a string prompt).
    Text(String),
    /// Token IDs (`/v1/completions` with an array of integers).
    Tokens(Vec<u32>),
    /// Chat messages (`/v1/chat/completions`).
    Chat(Vec<ChatMessage>),
}

/// The fields of a completion request that routing and the mock engine use. The raw
/// body is forwarded unchanged.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    /// The model (selects the endpoint).
    pub model: String,
    /// The prompt.
    pub prompt: Prompt,
    /// Tokens to generate before the end-of-sequence token may end the answer (vLLM's
    /// `min_tokens`; 0 if unset).
    pub min_tokens: u32,
    /// Tokens to generate, if the client set a limit (`max_completion_tokens`, else
    /// `max_tokens`, the first that is not `null`, as vLLM reads them). `None` leaves it
    /// to the engine's default: [`default_max_tokens`].
    pub max_tokens: Option<u32>,
    /// Server-sent events instead of one JSON body.
    pub stream: bool,
    /// With `stream`, send a final chunk with `usage`.
    pub include_usage: bool,
    /// The OpenAI `user` field, used as the session key.
    pub user: Option<String>,
    /// vLLM's `cache_salt`: prompts with different salts never share cached blocks (the
    /// salt is mixed into the first block's hash, as the engine does).
    pub cache_salt: Option<String>,
    /// Chat: the last (assistant) message is left open and continued, with no generation
    /// prompt after it (vLLM's and SGLang's `continue_final_message` with
    /// `add_generation_prompt: false`).
    pub continue_final_message: bool,
    /// Choices asked for (`n`).
    pub n: u32,
    /// Log probabilities asked for (`logprobs` or `top_logprobs` on chat, a number on
    /// completions).
    pub logprobs: bool,
    /// Completions: the prompt is echoed before the answer.
    pub echo: bool,
    /// vLLM's `return_token_ids`: the stream carries the prompt's and each chunk's token
    /// IDs.
    pub return_token_ids: bool,
    /// The answer is held to a grammar: a `response_format` other than text, vLLM's
    /// `structured_outputs` or `guided_*` fields, SGLang's `regex`, `ebnf` or
    /// `json_schema`. An engine applies it from the first generated token, so an answer
    /// cut midway cannot be continued under it.
    pub constrained: bool,
}

/// The fields that hold an answer to a grammar ([`CompletionRequest::constrained`]).
const GRAMMAR_FIELDS: &[&str] = &[
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding",
    "regex",
    "ebnf",
    "json_schema",
    "structural_tag",
];

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

/// A request the server refuses, with an OpenAI error body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct BadRequest {
    /// What is wrong.
    pub message: String,
    /// The offending parameter, if one.
    pub param: Option<String>,
}

fn bad(message: impl Into<String>, param: &str) -> BadRequest {
    BadRequest {
        message: message.into(),
        param: Some(param.to_string()),
    }
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Parses a request body for `api`.
pub fn parse(api: Api, body: &[u8]) -> Result<CompletionRequest, BadRequest> {
    let v: Value = serde_json::from_slice(body).map_err(|e| BadRequest {
        message: format!("request body is not valid JSON: {e}"),
        param: None,
    })?;
    let obj = v.as_object().ok_or_else(|| BadRequest {
        message: "request body must be a JSON object".into(),
        param: None,
    })?;
    let model = obj
        .get("model")
        .and_then(Value::as_str)
        .filter(|m| !m.is_empty())
        .ok_or_else(|| {
            bad(
                "`model` is required and must be a non-empty string",
                "model",
            )
        })?
        .to_string();
    let prompt = prompt(api, obj)?;
    let max_tokens = max_tokens(obj)?;
    let min_tokens = match obj.get("min_tokens") {
        None | Some(Value::Null) => 0,
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| bad("`min_tokens` must be a non-negative integer", "min_tokens"))?,
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("`stream` must be a boolean", "stream")),
    };
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(v) => {
            serde_json::from_value::<StreamOptions>(v.clone())
                .map_err(|e| bad(format!("bad `stream_options`: {e}"), "stream_options"))?
                .include_usage
        }
    };
    let user = obj.get("user").and_then(Value::as_str).map(str::to_string);
    let cache_salt = match obj.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(_) => {
            return Err(bad("`cache_salt` must be a non-empty string", "cache_salt"));
        }
    };
    let flag = |key: &str| flag(obj, key);
    let continue_final_message = continue_final_message(api, obj, &prompt)?;
    let n = match obj.get("n") {
        None | Some(Value::Null) => 1,
        Some(v) => v
            .as_u64()
            .filter(|n| (1..=128).contains(n))
            .ok_or_else(|| bad("`n` must be an integer between 1 and 128", "n"))?
            as u32,
    };
    let logprobs = match obj.get("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(_) => true,
    } || obj.get("top_logprobs").is_some_and(|v| !v.is_null());
    let echo = flag("echo")?.unwrap_or(false);
    let return_token_ids = flag("return_token_ids")?.unwrap_or(false);
    let constrained = GRAMMAR_FIELDS
        .iter()
        .any(|k| obj.get(*k).is_some_and(|v| !v.is_null()))
        || obj
            .get("response_format")
            .is_some_and(|f| !f.is_null() && f.get("type").and_then(Value::as_str) != Some("text"));
    Ok(CompletionRequest {
        constrained,
        min_tokens,
        return_token_ids,
        continue_final_message,
        n,
        logprobs,
        echo,
        cache_salt,
        model,
        prompt,
        max_tokens,
        stream,
        include_usage,
        user,
    })
}

/// The request's prompt: a completion's text or token IDs, or a chat's messages.
fn prompt(api: Api, obj: &Map<String, Value>) -> Result<Prompt, BadRequest> {
    Ok(match api {
        Api::Completions => match obj.get("prompt") {
            Some(Value::String(s)) => Prompt::Text(s.clone()),
            Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_u64) => {
                Prompt::Tokens(
                    items
                        .iter()
                        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                        .collect::<Option<Vec<u32>>>()
                        .ok_or_else(|| bad("token IDs must fit in 32 bits", "prompt"))?,
                )
            }
            Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
                Prompt::Text(items[0].as_str().unwrap_or_default().to_string())
            }
            Some(_) => {
                return Err(bad(
                    "`prompt` must be a string or an array of token IDs",
                    "prompt",
                ));
            }
            None => return Err(bad("`prompt` is required", "prompt")),
        },
        Api::Chat => {
            let messages = obj
                .get("messages")
                .and_then(Value::as_array)
                .filter(|m| !m.is_empty())
                .ok_or_else(|| {
                    bad(
                        "`messages` is required and must be a non-empty array",
                        "messages",
                    )
                })?;
            let mut out = Vec::with_capacity(messages.len());
            for m in messages {
                let role = m
                    .get("role")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("every message needs a string `role`", "messages"))?;
                let content = match m.get("content") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => parts
                        .iter()
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .collect::<Vec<_>>()
                        .join("\n"),
                    Some(Value::Null) | None => String::new(),
                    Some(_) => {
                        return Err(bad(
                            "message `content` must be a string or an array of parts",
                            "messages",
                        ));
                    }
                };
                out.push(ChatMessage {
                    role: role.to_string(),
                    content,
                });
            }
            Prompt::Chat(out)
        }
    })
}

/// `max_completion_tokens`, else `max_tokens`: at least 1, at most 2^20.
fn max_tokens(obj: &Map<String, Value>) -> Result<Option<u32>, BadRequest> {
    let mut max_tokens = None;
    for key in ["max_completion_tokens", "max_tokens"] {
        match obj.get(key) {
            None | Some(Value::Null) => continue,
            Some(v) => {
                let n = v
                    .as_u64()
                    .filter(|n| (1..=1 << 20).contains(n))
                    .ok_or_else(|| {
                        bad(
                            format!("`{key}` must be an integer between 1 and 1048576"),
                            key,
                        )
                    })?;
                max_tokens = Some(n as u32);
                break;
            }
        }
    }
    Ok(max_tokens)
}

/// A boolean field, `None` when absent or null.
fn flag(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, BadRequest> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(bad(format!("`{key}` must be a boolean"), key)),
    }
}

/// vLLM's `continue_final_message`: a chat's last (assistant) message continued, with
/// no generation prompt.
fn continue_final_message(
    api: Api,
    obj: &Map<String, Value>,
    prompt: &Prompt,
) -> Result<bool, BadRequest> {
    let continue_final_message = flag(obj, "continue_final_message")?.unwrap_or(false);
    if continue_final_message {
        if api != Api::Chat {
            return Err(bad(
                "`continue_final_message` applies to chat completions",
                "continue_final_message",
            ));
        }
        if flag(obj, "add_generation_prompt")?.unwrap_or(true) {
            return Err(bad(
                "`continue_final_message` needs `add_generation_prompt: false`",
                "add_generation_prompt",
            ));
        }
        if let Prompt::Chat(m) = prompt
            && m.last().is_some_and(|m| m.role != "assistant")
        {
            return Err(bad(
                "`continue_final_message` needs an assistant message last",
                "messages",
            ));
        }
    }
    Ok(continue_final_message)
}

impl CompletionRequest {
    /// The answer's limit as an engine applies it to this request on `api`: the
    /// client's, else [`default_max_tokens`] (`None`: the rest of the context).
    pub fn limit(&self, api: Api) -> Option<u32> {
        self.max_tokens.or(default_max_tokens(api))
    }
}

/// What an engine generates for a request that sets no limit, as vLLM and SGLang do:
/// a completion 16 tokens (OpenAI's documented default), a chat the rest of the model's
/// context (`None`: the engine's `max_model_len` less the prompt).
pub fn default_max_tokens(api: Api) -> Option<u32> {
    match api {
        Api::Completions => Some(16),
        Api::Chat => None,
    }
}

/// An OpenAI error body.
pub fn error_body(message: &str, kind: &str, param: Option<&str>, code: Option<&str>) -> String {
    json!({ "error": { "message": message, "type": kind, "param": param, "code": code } })
        .to_string()
}

/// Finds `"prompt_tokens":N` and `"cached_tokens":M` (0 if absent) in the last `usage`
/// object of a response body or its tail (JSON or SSE).
pub fn scan_usage(tail: &[u8]) -> Option<(u64, u64)> {
    let usage = last_usage(tail)?;
    Some((
        usage_number(usage, "\"prompt_tokens\"")?,
        usage_number(usage, "\"cached_tokens\"").unwrap_or(0),
    ))
}

/// The answer's output tokens, from the `usage` in the last bytes of a response (JSON or
/// SSE), if it has one.
pub fn scan_completion_tokens(tail: &[u8]) -> Option<u64> {
    usage_number(last_usage(tail)?, "\"completion_tokens\"")
}

/// The text from the last `"usage"` of a response's tail on.
fn last_usage(tail: &[u8]) -> Option<&str> {
    let text = std::str::from_utf8(tail).ok().or_else(|| {
        // A multi-byte character cut at the start of the window: skip to a boundary.
        (1..4).find_map(|i| std::str::from_utf8(tail.get(i..)?).ok())
    })?;
    Some(&text[text.rfind("\"usage\"")?..])
}

/// The number after `key` in a `usage` object's text.
fn usage_number(usage: &str, key: &str) -> Option<u64> {
    let at = usage.find(key)? + key.len();
    let rest = usage[at..].trim_start_matches([' ', ':']);
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_found_in_json_and_sse_tails() {
        let body = br#"{"choices":[],"usage":{"completion_tokens":5,"prompt_tokens":62,"prompt_tokens_details":{"cached_tokens":48},"total_tokens":67}}"#;
        assert_eq!(scan_usage(body), Some((62, 48)));
        let sse = b"data: {\"usage\":{\"prompt_tokens\": 10}}\n\ndata: [DONE]\n\n";
        assert_eq!(scan_usage(sse), Some((10, 0)));
        assert_eq!(scan_usage(b"data: [DONE]\n\n"), None);
        assert_eq!(scan_completion_tokens(body), Some(5));
        assert_eq!(scan_completion_tokens(sse), None);
        assert_eq!(scan_completion_tokens(b"{\"usage\":null}"), None);
    }

    #[test]
    fn parses_the_common_shapes() {
        let r = parse(Api::Chat, br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"user":"u1"}"#).unwrap();
        assert_eq!(r.model, "m");
        assert!(r.stream && r.include_usage);
        assert_eq!(r.user.as_deref(), Some("u1"));
        assert_eq!(r.max_tokens, None);
        let r = parse(
            Api::Completions,
            br#"{"model":"m","prompt":[1,2,3],"max_tokens":5}"#,
        )
        .unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![1, 2, 3]));
        assert_eq!(r.max_tokens, Some(5));
        let r = parse(Api::Completions, br#"{"model":"m","prompt":"hello"}"#).unwrap();
        assert_eq!(r.prompt, Prompt::Text("hello".into()));
    }

    #[test]
    fn a_limit_is_the_first_of_the_two_fields_that_is_set() {
        // A chat that names no limit gets the rest of the context from the engine (not
        // 16, which is a completion's default only).
        let chat = |body: &[u8]| parse(Api::Chat, body).unwrap().max_tokens;
        let m = r#""model":"m","messages":[{"role":"user","content":"x"}]"#;
        assert_eq!(chat(format!("{{{m}}}").as_bytes()), None);
        assert_eq!(default_max_tokens(Api::Chat), None);
        assert_eq!(default_max_tokens(Api::Completions), Some(16));
        assert_eq!(
            chat(format!(r#"{{{m},"max_completion_tokens":null,"max_tokens":500}}"#).as_bytes()),
            Some(500)
        );
        assert_eq!(
            chat(format!(r#"{{{m},"max_completion_tokens":7,"max_tokens":500}}"#).as_bytes()),
            Some(7)
        );
        assert_eq!(
            chat(format!(r#"{{{m},"max_tokens":null}}"#).as_bytes()),
            None
        );
        let e = parse(
            Api::Chat,
            format!(r#"{{{m},"max_completion_tokens":0}}"#).as_bytes(),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_completion_tokens"));
    }

    #[test]
    fn a_grammar_is_noticed_in_any_of_the_engines_fields() {
        let m = r#""model":"m","messages":[{"role":"user","content":"x"}]"#;
        let constrained = |extra: &str| {
            parse(Api::Chat, format!("{{{m}{extra}}}").as_bytes())
                .unwrap()
                .constrained
        };
        assert!(!constrained(""));
        assert!(!constrained(r#","response_format":{"type":"text"}"#));
        assert!(!constrained(
            r#","response_format":null,"guided_json":null"#
        ));
        assert!(constrained(r#","response_format":{"type":"json_object"}"#));
        assert!(constrained(
            r#","response_format":{"type":"json_schema","json_schema":{"name":"a","schema":{}}}"#
        ));
        assert!(constrained(r#","structured_outputs":{"regex":"a+"}"#));
        assert!(constrained(r#","guided_choice":["a","b"]"#));
        assert!(constrained(r#","regex":"[0-9]+""#));
    }

    #[test]
    fn rejects_bad_requests_with_the_parameter() {
        for (api, body, param) in [
            (
                Api::Chat,
                &br#"{"messages":[{"role":"user","content":"x"}]}"#[..],
                Some("model"),
            ),
            (
                Api::Chat,
                br#"{"model":"m","messages":[]}"#,
                Some("messages"),
            ),
            (Api::Completions, br#"{"model":"m"}"#, Some("prompt")),
            (
                Api::Completions,
                br#"{"model":"m","prompt":[1,-2]}"#,
                Some("prompt"),
            ),
            (
                Api::Completions,
                br#"{"model":"m","prompt":"x","max_tokens":0}"#,
                Some("max_tokens"),
            ),
            (
                Api::Completions,
                br#"{"model":"m","prompt":"x","stream":"yes"}"#,
                Some("stream"),
            ),
            (Api::Completions, b"{not json", None),
            (Api::Completions, b"[1,2]", None),
        ] {
            let err = parse(api, body).unwrap_err();
            assert_eq!(err.param.as_deref(), param, "{err}");
        }
    }
}
