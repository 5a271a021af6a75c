//! What a streamed chunk is read for while no migration has happened: a choice's text,
//! its token IDs, whether it ends the answer or cannot be continued. Most chunks of a
//! stream are read this way, into a few typed fields, instead of into a `serde_json::Value`
//! tree (a map and a string per field, for every token relayed). Anything this view
//! cannot read as typed, or a chunk that needs more (an error, the prompt's token IDs),
//! fails or says so, and the caller reads it the full way: the view never decides
//! differently from the full path, it only decides sooner.

use std::marker::PhantomData;

use serde::de::{IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::Value;

use switchyard_tokens::openai::Api;

/// What a choice of a chunk says, read either way.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Seen {
    /// Its text (`delta.content` for chat, `text` for completions), if a string.
    pub(super) piece: Option<String>,
    /// Its token IDs (`token_ids`), if an array of IDs.
    pub(super) ids: Option<Vec<u32>>,
    /// A chat delta carried tool calls.
    pub(super) tool_call: bool,
    /// A chat delta carried a separate reasoning text.
    pub(super) reasoning: bool,
    /// `finish_reason` is set.
    pub(super) finished: bool,
    /// A chat delta named the role (the stream's opening chunk, which stands for no
    /// token).
    pub(super) role: bool,
}

/// A chunk as the view reads it: its first choice, and whether it reports `usage`.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct View {
    pub(super) choice: Option<Seen>,
    pub(super) usage: bool,
}

impl Seen {
    /// The tokens the chunk stands for: its token IDs where it carries them, else one
    /// for a chunk with text, and for one whose text is empty (vLLM streams a token that
    /// ends inside a character, or a special token, with no text) unless it is the
    /// stream's opening chunk (the role) or its closing one (a `finish_reason` and no
    /// text). An engine sending several tokens in a chunk without their IDs
    /// (speculative decoding) is counted one.
    pub(super) fn tokens(&self) -> usize {
        match (&self.ids, &self.piece) {
            (Some(ids), _) => ids.len(),
            (None, Some(p)) if !p.is_empty() => 1,
            (None, Some(_)) => usize::from(!self.role && !self.finished),
            (None, None) => 0,
        }
    }

    /// A choice read from a `Value` (the full path).
    pub(super) fn of_value(api: Api, choice: &Value) -> Seen {
        let mut seen = Seen::default();
        let piece = match api {
            Api::Chat => {
                let delta = choice.get("delta");
                seen.tool_call = delta
                    .and_then(|d| d.get("tool_calls"))
                    .is_some_and(|t| !t.is_null());
                seen.role = delta
                    .and_then(|d| d.get("role"))
                    .is_some_and(|r| !r.is_null());
                seen.reasoning = delta.is_some_and(|d| {
                    ["reasoning_content", "reasoning"].iter().any(|k| {
                        d.get(k)
                            .and_then(Value::as_str)
                            .is_some_and(|s| !s.is_empty())
                    })
                });
                delta.and_then(|d| d.get("content")).and_then(Value::as_str)
            }
            Api::Completions => choice.get("text").and_then(Value::as_str),
        };
        seen.piece = piece.map(str::to_owned);
        seen.ids = choice.get("token_ids").and_then(token_ids);
        seen.finished = choice.get("finish_reason").is_some_and(|f| !f.is_null());
        seen
    }
}

/// Token IDs from a JSON array (`None` if it holds anything else).
pub(super) fn token_ids(v: &Value) -> Option<Vec<u32>> {
    v.as_array()?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect()
}

/// A chunk as the view reads it. A field of another type than these fails the whole
/// read (and the chunk takes the full path); unknown fields are skipped unparsed.
#[derive(Deserialize)]
struct ChunkView {
    #[serde(default)]
    error: Present,
    #[serde(default)]
    prompt_token_ids: Present,
    #[serde(default)]
    choices: Option<Vec<Object<ChoiceView>>>,
    #[serde(default)]
    usage: Option<IgnoredAny>,
}

#[derive(Deserialize)]
struct ChoiceView {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    delta: Option<Object<DeltaView>>,
    #[serde(default)]
    token_ids: Option<Vec<u64>>,
    #[serde(default)]
    finish_reason: Option<IgnoredAny>,
    #[serde(default)]
    prompt_token_ids: Present,
}

#[derive(Deserialize, Default)]
struct DeltaView {
    #[serde(default)]
    role: Option<IgnoredAny>,
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    tool_calls: Option<IgnoredAny>,
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    reasoning: Option<String>,
}

/// A struct read only from a JSON object: serde's derive also reads one from an array,
/// field by field in order, where the full path finds no fields.
struct Object<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Object<T>, D::Error> {
        struct Fields<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for Fields<T> {
            type Value = T;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
            }
        }
        d.deserialize_map(Fields(PhantomData)).map(Object)
    }
}

/// Whether a field was there at all, whatever its value (even `null`).
#[derive(Default)]
struct Present(bool);

impl<'de> Deserialize<'de> for Present {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Present, D::Error> {
        IgnoredAny::deserialize(d).map(|_| Present(true))
    }
}

/// The first choice of a chunk (`Some(None)`: a chunk without one), or `None` when the
/// chunk must be read the full way: it is not the shape the view reads, or it carries an
/// error or the prompt's token IDs.
pub(super) fn read(api: Api, data: &str) -> Option<View> {
    let Object(chunk) = serde_json::from_str::<Object<ChunkView>>(data).ok()?;
    if chunk.error.0 || chunk.prompt_token_ids.0 {
        return None;
    }
    let usage = chunk.usage.is_some();
    let Some(Object(choice)) = chunk.choices.and_then(|c| c.into_iter().next()) else {
        return Some(View {
            choice: None,
            usage,
        });
    };
    if choice.prompt_token_ids.0 {
        return None;
    }
    let mut seen = Seen {
        finished: choice.finish_reason.is_some(),
        ..Seen::default()
    };
    seen.ids = choice
        .token_ids
        .and_then(|ids| ids.into_iter().map(|t| u32::try_from(t).ok()).collect());
    match api {
        Api::Chat => {
            let delta = choice.delta.map(|Object(d)| d).unwrap_or_default();
            seen.tool_call = delta.tool_calls.is_some();
            seen.role = delta.role.is_some();
            seen.reasoning = [&delta.reasoning_content, &delta.reasoning]
                .iter()
                .any(|r| r.as_deref().is_some_and(|s| !s.is_empty()));
            seen.piece = delta.content;
        }
        Api::Completions => seen.piece = choice.text,
    }
    Some(View {
        choice: Some(seen),
        usage,
    })
}

/// Whether the view reads `data` as the full path does (`true` also when it leaves the
/// chunk to the full path). For the fuzzer (`switchyard`'s `fuzz.rs`) and tests.
pub fn view_agrees(api: Api, data: &str) -> bool {
    let Some(seen) = read(api, data) else {
        return true;
    };
    let full = serde_json::from_str::<Value>(data).ok().map(|v| View {
        choice: v
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first())
            .map(|c| Seen::of_value(api, c)),
        usage: v.get("usage").is_some_and(|u| !u.is_null()),
    });
    full == Some(seen)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chunks as vLLM and SGLang stream them, and odd ones.
    const CHUNKS: &[&str] = &[
        r#"{"id":"c1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" the","logprobs":null,"finish_reason":null,"token_ids":[279]}]}"#,
        r#"{"id":"c1","choices":[{"index":0,"text":"\n\"quoted\"","finish_reason":"length","token_ids":[198, 4294967296]}],"usage":null}"#,
        r#"{"id":"c1","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}"#,
        r#"{"id":"c1","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
        r#"{"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]},"finish_reason":null}]}"#,
        r#"{"id":"c1","choices":[{"index":0,"delta":{"tool_calls":null,"content":"x"}}]}"#,
        r#"{"id":"c1","choices":[{"index":0,"delta":{"reasoning_content":"think"}}]}"#,
        r#"{"id":"c1","choices":[{"index":0,"delta":{"reasoning":""},"finish_reason":"stop"}]}"#,
        r#"{"id":"c1","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}"#,
        r#"{"id":"c1","choices":null}"#,
        r#"{"id":"c1"}"#,
        r#"{"choices":[{"text":5}]}"#,
        r#"{"choices":[{"text":"a","token_ids":[-1]}]}"#,
        r#"{"choices":[{"text":"a","token_ids":"no"}]}"#,
        r#"{"choices":[{"delta":{"content":7}}]}"#,
        r#"{"choices":"none"}"#,
        r#"{"choices":[3]}"#,
        r#"{"choices":[{"delta":["x"],"finish_reason":"stop"}]}"#,
        r#"{"choices":[["a",null]]}"#,
        r#"{"choices":[{"text":"a"}],"choices":[{"text":"b"}]}"#,
        r#"{"choices":[{"text":"a","prompt_token_ids":[1,2]}]}"#,
        r#"{"prompt_token_ids":null,"choices":[{"text":"a"}]}"#,
        r#"{"error":null}"#,
        r#"{"error":{"code":500,"message":"boom"}}"#,
        r#"[1,2]"#,
        r#"not json"#,
    ];

    #[test]
    fn the_view_reads_what_the_full_path_reads_or_leaves_the_chunk_to_it() {
        let mut viewed = 0;
        for api in [Api::Chat, Api::Completions] {
            for chunk in CHUNKS {
                assert!(view_agrees(api, chunk), "{api:?}: {chunk}");
                viewed += usize::from(read(api, chunk).is_some());
            }
        }
        // The usual chunks take the view; errors and prompt IDs never do.
        assert!(viewed >= 16, "{viewed}");
        for chunk in [CHUNKS[0], CHUNKS[2], CHUNKS[8]] {
            assert!(read(Api::Chat, chunk).is_some(), "{chunk}");
        }
        for chunk in &CHUNKS[20..] {
            assert!(read(Api::Completions, chunk).is_none(), "{chunk}");
        }
    }
}
