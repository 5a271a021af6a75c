//! The server-sent events of a worker's stream, as the relay cuts and reads them.

use std::borrow::Cow;

use serde_json::Value;

/// Where an SSE event ends in `buf`, looking from `from`: (end of its text, start of the
/// next event).
pub(super) fn find_event_end(buf: &[u8], from: usize) -> Option<(usize, usize)> {
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
pub(super) fn event_data(raw: &[u8]) -> Option<Cow<'_, str>> {
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
pub(super) fn server_error(e: &Value) -> bool {
    let code = e.get("code").and_then(Value::as_u64).unwrap_or(0);
    let kind = e.get("type").and_then(Value::as_str).unwrap_or("");
    code >= 500
        || kind.eq_ignore_ascii_case("server_error")
        || kind.eq_ignore_ascii_case("InternalServerError")
        || kind.eq_ignore_ascii_case("internal_server_error")
}
