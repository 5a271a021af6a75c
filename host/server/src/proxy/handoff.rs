//! Split requests: what the prefill worker and the decode worker are sent, in the handoff
//! protocol of the fleet's engines (docs/disaggregation.md says which versions).
//!
//! - **vLLM** (its disaggregated proxy and KV connector): the prefill worker first, with
//!   `kv_transfer_params` asking for a remote decode, `max_tokens` 1 and no streaming;
//!   then the client's request to the decode worker with the `kv_transfer_params` the
//!   prefill answer returned. The prefill is kept by the prefill worker until a decode
//!   worker pulls it, so a decode worker that fails before its first byte is replaced
//!   with the same parameters (the next one pulls what is left, or recomputes).
//! - **SGLang** (its disaggregation module): the client's request to both at once, with
//!   `bootstrap_host` and `bootstrap_port` (the prefill worker's) and a fresh
//!   `bootstrap_room`; the decode worker's answer is the client's. A room serves one
//!   handoff, so a failed leg re-runs both.

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use serde_json::{Map, Value, json};

use switchyard_discovery::InstanceInfo;

/// Longest prefill answer read (one token and the transfer parameters).
pub(super) const MAX_PREFILL_ANSWER: usize = 1 << 20;

/// How a split request is handed from its prefill worker to its decode worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Protocol {
    /// vLLM's KV connector: prefill, then decode with its parameters.
    Vllm,
    /// SGLang's bootstrap rendezvous at the prefill worker's `host:port`.
    Sglang { host: String, port: u16 },
}

impl Protocol {
    /// The protocol of a split whose prefill worker is `prefill`: SGLang's when it has a
    /// bootstrap port, vLLM's otherwise.
    pub(super) fn of(prefill: &InstanceInfo) -> Protocol {
        match prefill.bootstrap_port {
            Some(port) => Protocol::Sglang {
                host: host_of(&prefill.url),
                port,
            },
            None => Protocol::Vllm,
        }
    }
}

/// The `host[:port]` of an `http(s)://[user@]host[:port][/...]` URL (what a gateway
/// names a worker by), if it has one.
pub(crate) fn authority(url: &str) -> Option<&str> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    (!authority.is_empty()).then_some(authority)
}

/// The host of an `http(s)://host[:port][/...]` URL (brackets kept for IPv6).
fn host_of(url: &str) -> String {
    let authority = authority(url).unwrap_or("");
    if authority.starts_with('[') {
        return authority
            .split_once(']')
            .map_or(authority.to_string(), |(h, _)| format!("{h}]"));
    }
    authority
        .rsplit_once(':')
        .map_or(authority, |(h, _)| h)
        .to_string()
}

/// The client's body as a JSON object (the front door parsed it already: an object),
/// read once per split and shared by both legs' requests.
pub(super) fn object(body: &[u8]) -> Result<Map<String, Value>, String> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err("the request body is not a JSON object".into()),
        Err(e) => Err(format!("the request body is not JSON: {e}")),
    }
}

fn bytes(m: Map<String, Value>) -> Bytes {
    Bytes::from(serde_json::to_vec(&Value::Object(m)).expect("a JSON map serialises"))
}

/// vLLM: the prefill worker's request — the client's, computing the prompt and one
/// token, not streamed, asking to keep the KV for a remote decode.
pub(super) fn vllm_prefill_body(body: &Map<String, Value>) -> Bytes {
    let mut m = body.clone();
    m.insert("max_tokens".into(), json!(1));
    if m.contains_key("max_completion_tokens") {
        m.insert("max_completion_tokens".into(), json!(1));
    }
    m.insert("stream".into(), json!(false));
    m.remove("stream_options");
    // A minimum above the one token asked for is refused (vLLM's proxy drops them).
    m.remove("min_tokens");
    m.remove("min_completion_tokens");
    m.insert(
        "kv_transfer_params".into(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    bytes(m)
}

/// vLLM: the `kv_transfer_params` of a prefill worker's answer.
pub(super) fn vllm_transfer_params(answer: &[u8]) -> Result<Value, String> {
    let v: Value = serde_json::from_slice(answer)
        .map_err(|e| format!("the prefill answer is not JSON: {e}"))?;
    match v.get("kv_transfer_params") {
        Some(p @ Value::Object(_)) => Ok(p.clone()),
        Some(_) => Err("the prefill answer's kv_transfer_params is not an object".into()),
        None => Err("the prefill answer has no kv_transfer_params (is the worker's KV connector configured?)".into()),
    }
}

/// vLLM: the decode worker's request — the client's, with the prefill's parameters.
pub(super) fn vllm_decode_body(mut body: Map<String, Value>, params: Value) -> Bytes {
    body.insert("kv_transfer_params".into(), params);
    bytes(body)
}

/// SGLang: the request both workers get — the client's, naming the rendezvous.
pub(super) fn sglang_body(body: &[u8], host: &str, port: u16, room: u64) -> Result<Bytes, String> {
    let mut m = object(body)?;
    m.insert("bootstrap_host".into(), json!(host));
    m.insert("bootstrap_port".into(), json!(port));
    m.insert("bootstrap_room".into(), json!(room));
    Ok(bytes(m))
}

/// A fresh bootstrap room: a non-negative 63-bit number (SGLang's routers draw them the
/// same way), unlike any other this process drew.
pub(super) fn fresh_room() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    static SEED: std::sync::OnceLock<RandomState> = std::sync::OnceLock::new();
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    SEED.get_or_init(RandomState::new).hash_one(n) & (u64::MAX >> 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vllm_prefill_computes_one_token_and_keeps_the_kv() {
        let b = vllm_prefill_body(
            &object(br#"{"model":"m","prompt":"hi","max_tokens":50,"min_tokens":20,"min_completion_tokens":20,"stream":true,"stream_options":{"include_usage":true}}"#)
                .unwrap(),
        );
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["max_tokens"], 1);
        assert_eq!(v["stream"], false);
        assert!(v.get("stream_options").is_none());
        assert!(v.get("max_completion_tokens").is_none());
        assert!(v.get("min_tokens").is_none() && v.get("min_completion_tokens").is_none());
        assert_eq!(v["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(v["prompt"], "hi");
        let b =
            vllm_prefill_body(&object(br#"{"messages":[],"max_completion_tokens":9}"#).unwrap());
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["max_completion_tokens"], 1);
    }

    #[test]
    fn the_vllm_decode_gets_the_prefills_parameters() {
        let params = vllm_transfer_params(
            br#"{"choices":[],"kv_transfer_params":{"do_remote_prefill":true,"remote_port":7}}"#,
        )
        .unwrap();
        let b = vllm_decode_body(object(br#"{"prompt":"hi","stream":true}"#).unwrap(), params);
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["kv_transfer_params"]["remote_port"], 7);
        assert_eq!(v["stream"], true);
        assert!(vllm_transfer_params(br#"{"choices":[]}"#).is_err());
        assert!(vllm_transfer_params(br#"{"kv_transfer_params":3}"#).is_err());
        assert!(vllm_transfer_params(b"not json").is_err());
    }

    #[test]
    fn sglang_requests_name_the_prefill_workers_room() {
        let b = sglang_body(br#"{"prompt":"hi"}"#, "10.0.0.7", 8998, 42).unwrap();
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(
            (
                &v["bootstrap_host"],
                &v["bootstrap_port"],
                &v["bootstrap_room"]
            ),
            (&json!("10.0.0.7"), &json!(8998), &json!(42))
        );
        let (a, b) = (fresh_room(), fresh_room());
        assert_ne!(a, b);
        assert!(a <= i64::MAX as u64 && b <= i64::MAX as u64);
    }

    #[test]
    fn the_bootstrap_host_is_the_prefill_urls_host() {
        assert_eq!(host_of("http://10.0.0.7:8000"), "10.0.0.7");
        assert_eq!(host_of("https://p.example/v1"), "p.example");
        assert_eq!(host_of("http://[::1]:8000"), "[::1]");
        assert_eq!(host_of("http://u:pw@h:1"), "h");
        // What a gateway names a worker by: its host and port, no credentials or path.
        assert_eq!(
            authority("http://u:pw@10.0.0.7:8000/v1"),
            Some("10.0.0.7:8000")
        );
        assert_eq!(authority("http://[::1]:8000"), Some("[::1]:8000"));
        assert_eq!(authority("http:///v1"), None);
    }
}
