//! The migration state read from streams as vLLM and SGLang send them, and the
//! continuations it builds.

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
    let bad =
        b"data: {\"error\":{\"message\":\"bad\",\"type\":\"BadRequestError\",\"code\":400}}\n\n";
    let (out, broke, _, _) = relay_events(Api::Completions, false, &[bad]);
    assert_eq!((out.as_slice(), broke), (&bad[..], None));
}

fn chat(body: &str) -> Migration {
    let parsed = switchyard_tokens::openai::parse(Api::Chat, body.as_bytes()).unwrap();
    let mut m = Migration::fresh(
        Api::Chat,
        Bytes::copy_from_slice(body.as_bytes()),
        Resend::bare(parsed.prompt),
        2,
    );
    m.max_tokens = parsed.max_tokens;
    m.include_usage = parsed.include_usage;
    m
}

fn events(m: &mut Migration, events: &[&str]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in events {
        let (o, broke) = m.take(format!("data: {e}\n\n").as_bytes());
        assert_eq!(broke, None);
        out.extend_from_slice(&o);
    }
    out
}

const ROLE: &str = r#"{"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],"prompt_token_ids":[1,2,3]}"#;

fn token(text: &str, ids: &[u32], finish: Option<&str>) -> String {
    json!({"id": "c", "choices": [{"index": 0, "delta": {"content": text},
        "finish_reason": finish, "token_ids": ids}]})
    .to_string()
}

#[test]
fn tokens_are_counted_from_their_ids_not_from_chunks_with_text() {
    let mut m = chat(
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":10,"stream":true}"#,
    );
    // vLLM: a token ending inside a character has no text; speculative decoding
    // sends several tokens in a chunk.
    events(
        &mut m,
        &[
            ROLE,
            &token(" a", &[7], None),
            &token("", &[195], None),
            &token("é b", &[169, 8, 9], None),
        ],
    );
    assert_eq!(m.sent, 5);
    assert_eq!(m.text, " aé b");
    // The continuation runs on the exact context and asks for what is left.
    let Ok(Next::Continue(req)) = m.prepare(InstanceId(1)) else {
        panic!("not continued");
    };
    let v: Value = serde_json::from_slice(&req.body_now()).unwrap();
    assert_eq!(v["prompt"], json!([1, 2, 3, 7, 195, 169, 8, 9]));
    assert_eq!(v["max_tokens"], 5);
    // Without IDs, a chunk is a token, text or not, but the role and a bare final
    // chunk are none.
    let mut m = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true}"#);
    let bare = |t: &str, f: Option<&str>| {
        json!({"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": f}]}).to_string()
    };
    events(
        &mut m,
        &[
            &bare("", None).replace("{\"content\"", "{\"role\":\"assistant\",\"content\""),
            &bare(" a", None),
            &bare("", None),
            &bare("é", None),
        ],
    );
    assert_eq!(m.sent, 3);
}

#[test]
fn at_the_text_level_a_character_cut_in_half_is_generated_again_not_counted() {
    // The stream broke after a token with no text (the first byte of "é"): the text
    // continuation carries " a" and asks for 4 more tokens, not 3, since the engine
    // generates that byte again; the client's usage then counts the answer once.
    let mut m = chat(
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":5,"stream":true}"#,
    );
    let bare = |t: &str| json!({"choices": [{"index": 0, "delta": {"content": t}}]}).to_string();
    events(&mut m, &[&bare(" a"), &bare("")]);
    assert_eq!(m.sent, 2);
    let Ok(Next::Continue(req)) = m.prepare(InstanceId(1)) else {
        panic!("not continued");
    };
    let v: Value = serde_json::from_slice(&req.body_now()).unwrap();
    assert_eq!(v["max_tokens"], 4, "{v}");
    assert_eq!(v["messages"][1]["content"], " a");
    assert_eq!(m.sent, 1);
    // With token IDs the continuation is exact: nothing is generated again.
    let mut m = chat(
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":5,"stream":true}"#,
    );
    events(
        &mut m,
        &[ROLE, &token(" a", &[7], None), &token("", &[195], None)],
    );
    let Ok(Next::Continue(req)) = m.prepare(InstanceId(1)) else {
        panic!("not continued");
    };
    let v: Value = serde_json::from_slice(&req.body_now()).unwrap();
    assert_eq!(v["max_tokens"], 3, "{v}");
    assert_eq!(v["prompt"], json!([1, 2, 3, 7, 195]));
}

#[test]
fn a_chat_without_a_limit_is_continued_to_the_end_of_its_context() {
    // Not 16 tokens: a chat's default is the rest of the context, which the engine
    // counts for the continuation as it did for the first worker.
    let mut m = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true}"#);
    m.head = Some(Head {
        id: json!("c"),
        created: json!(1),
        model: json!("m"),
    });
    let answer: Vec<String> = (0..20).map(|i| token(" w", &[100 + i], None)).collect();
    m.take(
        format!(
            "data: {}\n\n",
            r#"{"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#
        )
        .as_bytes(),
    );
    for a in &answer {
        m.take(format!("data: {a}\n\n").as_bytes());
    }
    assert_eq!(m.sent, 20);
    let Ok(Next::Continue(req)) = m.prepare(InstanceId(1)) else {
        panic!("a chat past 16 tokens was ended, not continued");
    };
    let v: Value = serde_json::from_slice(&req.body_now()).unwrap();
    assert!(
        v.get("max_tokens").is_none() && v.get("max_completion_tokens").is_none(),
        "{v}"
    );
    assert_eq!(v["continue_final_message"], true);
    // A completion's default is 16: past it, nothing is left.
    let body = br#"{"model":"m","prompt":"p","stream":true}"#;
    assert_eq!(continuation_of(Api::Completions, body, " w", 16), None);
    let next = continuation_of(Api::Completions, body, " w", 10)
        .unwrap()
        .unwrap();
    assert_eq!(
        serde_json::from_slice::<Value>(&next).unwrap()["max_tokens"],
        6
    );
}

#[test]
fn a_stream_that_ended_is_closed_not_continued() {
    let mut m = chat(
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}"#,
    );
    events(
        &mut m,
        &[
            ROLE,
            &token(" a", &[7], None),
            &token(" b", &[8], Some("stop")),
        ],
    );
    assert!(m.complete());
    // Reset before the usage and [DONE]: they are sent, nothing else.
    let closing = String::from_utf8(m.close().to_vec()).unwrap();
    assert!(!closing.contains("finish_reason"), "{closing}");
    assert!(closing.contains(r#""completion_tokens":2"#), "{closing}");
    assert!(closing.ends_with("data: [DONE]\n\n"), "{closing}");
    assert_eq!(m.used, 0);
    // After the usage and [DONE]: nothing more.
    events(
        &mut m,
        &[r#"{"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#],
    );
    m.take(b"data: [DONE]\n\n");
    assert!(m.close().is_empty());
}

#[test]
fn the_first_chunk_may_carry_every_prompt_token_id() {
    // vLLM's first chunk with `return_token_ids` on a 200k-token prompt: 1.4 MB.
    let ids: Vec<u32> = (0..200_000).map(|i| 100_000 + i).collect();
    let prompt = "w ".repeat(200_000);
    let body = json!({"model": "m", "prompt": prompt, "stream": true, "return_token_ids": true})
        .to_string();
    let mut m = Migration::fresh(
        Api::Completions,
        Bytes::from(body),
        Resend::bare(Prompt::Text(prompt)),
        2,
    );
    let first = json!({"id": "c", "choices": [{"index": 0, "text": " a", "token_ids": [1],
        "prompt_token_ids": ids, "finish_reason": null}]});
    let event = format!("data: {first}\n\n");
    assert!(event.len() > MAX_EVENT_BYTES);
    let mut out = Vec::new();
    for piece in event.as_bytes().chunks(64 * 1024) {
        let (o, broke) = m.take(piece);
        assert_eq!(broke, None);
        out.extend_from_slice(&o);
    }
    assert_eq!(out, event.as_bytes());
    assert_eq!(m.prompt_ids.as_ref().map(Vec::len), Some(200_000));
    // A short request's stream still may not send such an event.
    let partial = &event.as_bytes()[..event.len() - 2];
    let (_, broke, _, _) = relay_events(Api::Completions, false, &[partial]);
    assert!(broke.is_some_and(|b| b.contains("longer than")));
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
