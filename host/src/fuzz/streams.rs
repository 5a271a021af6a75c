//! Fuzz targets for what a worker streams: its events as the relay reads them, a chunk
//! as the typed view reads it, and the token IDs taken out of an event the router asked
//! for them on.

use super::*;

/// A worker's event stream as a migratable relay reads it, cut into two chunks
/// anywhere: never a panic; before a migration exactly a prefix of what the worker
/// sent (whole events only); the answer kept within its bound.
#[test]
fn worker_streams() {
    use crate::tokens::openai::Api;
    let chat = |t: &str| {
        format!(
            r#"data: {{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{{"index":0,"delta":{{"content":"{t}"}},"finish_reason":null}}]}}"#
        )
    };
    let seeds = texts(&[
        &format!(
            "{}\n\n{}\n\ndata: {{\"id\":\"c1\",\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"length\"}}],\"usage\":{{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}}}\n\ndata: [DONE]\n\n",
            chat("lorem "),
            chat("ipsum ")
        ),
        "data: {\"id\":\"x\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"amet \",\"finish_reason\":null}]}\r\n\r\n: comment\n\n",
        "data: {\"error\":{\"message\":\"boom\",\"type\":\"InternalServerError\",\"code\":500}}\n\n",
        "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0}]}}]}\n\nevent: x\ndata: [DONE]\n\n",
    ]);
    fuzz("worker-stream", seeds, false, |input| {
        let cut = input.len() / 3;
        let chunks = [&input[..cut], &input[cut..]];
        for api in [Api::Chat, Api::Completions] {
            let (out, broke, kept, _) = crate::http::proxy::relay_events(api, false, &chunks);
            if broke.is_none() {
                assert!(input.starts_with(&out), "only whole events, as sent");
            }
            assert!(kept <= crate::http::proxy::MAX_KEPT_TEXT);
            let (out, _, _, _) = crate::http::proxy::relay_events(api, true, &chunks);
            assert!(
                out.is_empty() || out.ends_with(b"\n\n") || out.ends_with(b"\n\r\n"),
                "whole events after a migration"
            );
        }
        true
    });
}

/// A streamed chunk read by the relay's typed view: never a panic, and whatever the
/// view reads, the full `Value` path reads alike.
#[test]
fn stream_chunks() {
    use crate::tokens::openai::Api;
    let seeds = texts(&[
        r#"{"id":"c1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" the","logprobs":null,"finish_reason":null,"token_ids":[279]}]}"#,
        r#"{"id":"c1","choices":[{"index":0,"delta":{"role":"assistant","content":"Hi \"x\"\n"},"finish_reason":null}]}"#,
        r#"{"choices":[{"delta":{"tool_calls":[{"index":0}],"reasoning_content":"r"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3}}"#,
        r#"{"choices":[{"text":"a","token_ids":[1,4294967296],"prompt_token_ids":[1]}],"error":null}"#,
    ]);
    fuzz("stream-chunk", seeds, true, |input| {
        let Ok(data) = std::str::from_utf8(input) else {
            return false;
        };
        for api in [Api::Chat, Api::Completions] {
            assert!(crate::http::proxy::view_agrees(api, data));
        }
        true
    });
}

/// An event without the token IDs the router asked for: never a panic; what is taken
/// out is exactly the IDs (the event read as JSON is the input read as JSON less them),
/// and nothing is rewritten that had none.
#[test]
fn stripped_events() {
    use serde_json::Value;
    let seeds = texts(&[
        r#"{"id":"c","prompt_token_ids":[1,2],"choices":[{"index":0,"delta":{"role":"assistant","content":""},"token_ids":[],"finish_reason":null}]}"#,
        r#"{"choices":[{"text":" \u00e9","prompt_token_ids":[7],"token_ids":[42,4294967296]},{"token_ids":1.5e3}],"usage":null}"#,
        r#"{"choices":"x","token_ids":{"a":[1]},"z":-0.0}"#,
    ]);
    fuzz("stripped-event", seeds, true, |input| {
        let Ok(data) = std::str::from_utf8(input) else {
            return false;
        };
        let Some(out) = crate::http::proxy::strip_token_ids(data) else {
            return false;
        };
        let mut want: Value = serde_json::from_str(data).expect("stripped only JSON");
        let got: Value = serde_json::from_str(&out).expect("the stripped event is JSON");
        let obj = want.as_object_mut().expect("an object");
        obj.remove("prompt_token_ids");
        if let Some(choices) = obj.get_mut("choices").and_then(Value::as_array_mut)
            && choices.iter().all(Value::is_object)
        {
            for c in choices.iter_mut().filter_map(Value::as_object_mut) {
                c.remove("prompt_token_ids");
                c.remove("token_ids");
            }
        }
        assert_eq!(got, want, "{data} became {out}");
        true
    });
}
