//! Token IDs the router asks a vLLM worker for itself (`return_token_ids`, so that a
//! stream that breaks is continued exactly): the field added to the request, and taken
//! out of each event before the client, which did not ask for them, sees it. Only those
//! members go: the rest of the event is sent as the worker wrote it, in its order, byte
//! for byte.

use bytes::Bytes;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

/// The members a choice loses: the prompt's IDs (vLLM's first chunk of a completion)
/// and its own; an event loses the first (at the top of a chat's first chunk).
const TAKEN: [&str; 2] = ["prompt_token_ids", "token_ids"];

/// A JSON object's members in their order, each value unparsed.
struct Members<'a>(Vec<(String, &'a RawValue)>);

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Members<'de>, D::Error> {
        struct Fields;
        impl<'de> Visitor<'de> for Fields {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members<'de>, A::Error> {
                let mut members = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    members.push((key, map.next_value::<&'de RawValue>()?));
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(Fields)
    }
}

/// The field that asks for token IDs.
const FIELD: &[u8] = b"return_token_ids";

/// `body` (a request's JSON object) asking for token IDs, the field added first; `None`
/// when the body names the field anywhere already (the client's own choice), or is no
/// object with members.
pub(super) fn with_token_ids(body: &Bytes) -> Option<Bytes> {
    if memchr::memmem::find(body, FIELD).is_some() {
        return None;
    }
    let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
    let rest = &body[open + 1..];
    let next = rest.iter().find(|b| !b.is_ascii_whitespace())?;
    if body[open] != b'{' || *next == b'}' {
        return None;
    }
    let mut out = Vec::with_capacity(body.len() + FIELD.len() + 8);
    out.extend_from_slice(b"{\"return_token_ids\":true,");
    out.extend_from_slice(rest);
    Some(Bytes::from(out))
}

/// `data` (an event's JSON) without the token IDs (the prompt's at its top, [`TAKEN`] in
/// each of its choices when they are all objects); `None` when it has none to take or
/// is not an object, and is sent as it came.
pub fn strip_token_ids(data: &str) -> Option<String> {
    let Members(top) = serde_json::from_str(data).ok()?;
    let mut out = String::with_capacity(data.len());
    let mut taken = false;
    out.push('{');
    for (key, value) in top {
        if key == TAKEN[0] {
            taken = true;
            continue;
        }
        member(&mut out, &key);
        let choices = (key == "choices")
            .then(|| serde_json::from_str::<Vec<Members>>(value.get()).ok())
            .flatten();
        let Some(choices) = choices else {
            out.push_str(value.get());
            continue;
        };
        out.push('[');
        for (i, Members(choice)) in choices.into_iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push('{');
            for (key, value) in choice {
                if TAKEN.contains(&key.as_str()) {
                    taken = true;
                    continue;
                }
                member(&mut out, &key);
                out.push_str(value.get());
            }
            out.push('}');
        }
        out.push(']');
    }
    out.push('}');
    taken.then_some(out)
}

/// Writes `"key":` after a `{` or a member before it.
fn member(out: &mut String, key: &str) {
    if !out.ends_with('{') {
        out.push(',');
    }
    // A string always serialises.
    out.push_str(&serde_json::Value::from(key).to_string());
    out.push(':');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    #[test]
    fn the_ids_go_and_everything_else_stays_as_written() {
        let chat = r#"{"id":"c","object":"chat.completion.chunk","prompt_token_ids":[1,2,3],"choices":[{"index":0,"delta":{"role":"assistant","content":""},"token_ids":[],"finish_reason":null}]}"#;
        assert_eq!(
            strip_token_ids(chat).as_deref(),
            Some(
                r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#
            )
        );
        let completion = r#"{"choices":[{"text":" \u00e9t\u00e9 \"x\"","prompt_token_ids":[7],"token_ids":[42]}],"z":1,"a":{"token_ids":[9]}}"#;
        assert_eq!(
            strip_token_ids(completion).as_deref(),
            Some(r#"{"choices":[{"text":" \u00e9t\u00e9 \"x\""}],"z":1,"a":{"token_ids":[9]}}"#)
        );
        // Nothing to take, or no object: sent as it came.
        assert_eq!(strip_token_ids(r#"{"choices":[{"text":"a"}]}"#), None);
        assert_eq!(strip_token_ids("[DONE]"), None);
        assert_eq!(strip_token_ids(r#"{"a":1"#), None);
    }

    #[test]
    fn a_request_asks_for_ids_unless_it_named_the_field() {
        let asked = with_token_ids(&Bytes::from_static(b" {\"model\":\"m\",\"stream\":true}"));
        let v: Value = serde_json::from_slice(&asked.unwrap()).unwrap();
        assert_eq!(
            v,
            json!({"return_token_ids": true, "model": "m", "stream": true})
        );
        for own in [
            &br#"{"model":"m","return_token_ids":false}"#[..],
            br#"{"model":"m","prompt":"say return_token_ids"}"#,
            b"{ }",
            b"[1]",
            b"",
        ] {
            assert_eq!(with_token_ids(&Bytes::copy_from_slice(own)), None);
        }
    }

    #[test]
    fn a_key_needing_escapes_is_written_escaped() {
        let data = r#"{"we\"ird\u0001":1,"prompt_token_ids":[1]}"#;
        let out = strip_token_ids(data).unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v, json!({"we\"ird\u{1}": 1}));
    }
}
