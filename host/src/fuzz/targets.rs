//! One fuzz target per parser of outside input, each seeded by the project's own
//! encoders (the engine's and the router's), with the checks each must pass.

use super::*;
use crate::kv::engine_events::{self, EventOut, Shape, StoredOut};
use crate::kv::events::KvEvent;
use crate::router::zmtp::{self, Connection, Limits, SocketType};

fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    if body.len() < 256 {
        f.extend_from_slice(&[flags, body.len() as u8]);
    } else {
        f.push(flags | 0x02);
        f.extend_from_slice(&(body.len() as u64).to_be_bytes());
    }
    f.extend_from_slice(body);
    f
}

fn batches() -> Vec<Vec<u8>> {
    let tokens: Vec<u32> = (0..32).collect();
    let hashes = [11u64, 12, u64::MAX - 1, 1 << 63];
    let mut out = Vec::new();
    for shape in [Shape::VllmMap, Shape::VllmArray, Shape::Sglang] {
        let stored = EventOut::Stored(StoredOut {
            hashes: &hashes,
            parent: Some(7),
            token_ids: &tokens,
            block_size: 8,
            lora_name: Some("adapter"),
            cache_salt: None,
            ..Default::default()
        });
        let first = EventOut::Stored(StoredOut {
            hashes: &hashes[..1],
            token_ids: &tokens[..8],
            block_size: 8,
            cache_salt: Some("tenant"),
            ..Default::default()
        });
        out.push(engine_events::encode_batch(
            shape,
            1.5,
            0,
            &[
                first,
                stored,
                EventOut::Removed(&hashes[1..]),
                EventOut::Cleared,
            ],
        ));
        out.push(engine_events::encode_batch(
            shape,
            2.0,
            3,
            &[EventOut::Other("X")],
        ));
    }
    out
}

/// ZMTP as the router reads it: a publisher's greeting, READY and messages (data,
/// PING, long frames); bounds small enough for the fuzzer to cross them.
#[test]
fn zmtp_streams() {
    let limits = Limits {
        max_frame: 4096,
        max_frames: 4,
        max_message: 6000,
        max_command: 512,
        ..zmtp::KV_EVENT_LIMITS
    };
    let hello = zmtp::hello(b"PUB");
    let mut seeds = Vec::new();
    let mut m = hello.clone();
    m.extend(frame(0x01, b"kv-events"));
    m.extend(frame(0x01, &7u64.to_be_bytes()));
    m.extend(frame(0x00, &batches()[0]));
    seeds.push(m);
    let mut m = hello.clone();
    let mut ping = vec![4];
    ping.extend_from_slice(b"PING\x00\x0actx");
    m.extend(frame(0x04, &ping));
    m.extend(frame(0x00, &[0x55; 300]));
    seeds.push(m);
    let rt = runtime();
    fuzz("zmtp", seeds, false, |input| {
        rt.block_on(async {
            let script = Script {
                input: input.to_vec(),
                at: 0,
            };
            let Ok(mut c) = Connection::handshake(script, SocketType::Sub, limits).await else {
                return false;
            };
            let mut messages = 0;
            for _ in 0..64 {
                let Ok(msg) = c.recv().await else { break };
                messages += 1;
                assert!(msg.len() <= limits.max_frames, "{} frames", msg.len());
                let total: usize = msg.iter().map(|f| f.len()).sum();
                assert!(total as u64 <= limits.max_message, "{total} bytes");
            }
            messages > 0
        })
    });
}

/// Engines' msgpack batches (vLLM's two shapes and SGLang's), decoded and applied to
/// a worker's view with a small entry bound.
#[test]
fn engine_batches() {
    fuzz("engine-batch", batches(), false, |input| {
        let Ok(batch) = engine_events::decode_batch(input) else {
            return false;
        };
        let mut view = crate::kv::engine_view::EngineView::new(8, 0, 256, 4);
        let rank = batch.rank.unwrap_or(0);
        let _ = view.apply(rank, 0, batch.ts, &batch.events);
        let _ = view.apply(rank, 1, batch.ts, &batch.events);
        assert!(view.held() <= 256 + 64, "{} held", view.held());
        true
    });
}

/// Switchyard's NDJSON event lines: parsed, sequence-checked, and a parsed line
/// survives a round trip.
#[test]
fn ndjson_lines() {
    let events = crate::kv::events::samples();
    let seeds = events
        .iter()
        .map(|e| serde_json::to_vec(e).expect("serialises"))
        .collect();
    fuzz("ndjson", seeds, true, |input| {
        let Ok(e) = serde_json::from_slice::<KvEvent>(input) else {
            return false;
        };
        for last in [None, Some(0), Some(u64::MAX), e.seq()] {
            let _ = crate::kv::events::check_seq(last, &e);
        }
        let again: KvEvent = serde_json::from_slice(&serde_json::to_vec(&e).expect("serialises"))
            .expect("round trip");
        assert_eq!(again, e);
        true
    });
}

/// OpenAI request bodies, both APIs, and the chat messages rendered and tokenized
/// as the router does.
#[test]
fn openai_bodies() {
    use crate::openai::Api;
    let seeds = texts(&[
        r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"},{"type":"text","text":"there"}]}],"stream":true,"max_tokens":5,"user":"u1"}"#,
        r#"{"model":"m","prompt":"once upon a time","max_tokens":3,"cache_salt":"t1"}"#,
        r#"{"model":"m","prompt":[1,2,3,4294967295],"stream":false}"#,
        r#"{"model":"m","prompt":["a","b"]}"#,
    ]);
    let tokenizer = crate::tokens::PrefixTokenizer::new(
        std::sync::Arc::new(crate::tokens::Tokenizer::builtin()),
        1 << 16,
    );
    fuzz("openai", seeds, true, |input| {
        let mut accepted = false;
        for api in [Api::Chat, Api::Completions] {
            let Ok(req) = crate::openai::parse(api, input) else {
                continue;
            };
            accepted = true;
            if let crate::openai::Prompt::Chat(m) = &req.prompt
                && let Ok(text) = tokenizer.render_chat(m)
            {
                let _ = tokenizer.encode(&text);
            }
            // A migrated stream's continuation of it is a request the same parser
            // takes, asking for what was left, ending with the answer so far.
            let answer = "lorem ipsum ";
            if let Some(Ok(next)) = crate::http::proxy::continuation_of(api, input, answer, 1) {
                let cont = crate::openai::parse(api, &next).expect("a continuation parses");
                // The limit left: one less than asked (or than a completion's
                // default); a chat that named none names none (the rest of its
                // context, as the engine counts it).
                let limit = req.limit(api);
                assert_eq!(cont.max_tokens, limit.map(|m| m - 1));
                match (&cont.prompt, &req.prompt) {
                    (crate::openai::Prompt::Chat(m), _) => {
                        assert!(cont.continue_final_message);
                        let last = m.last().expect("messages");
                        assert!(last.role == "assistant" && last.content.ends_with(answer));
                    }
                    (crate::openai::Prompt::Text(t), crate::openai::Prompt::Text(was)) => {
                        assert_eq!(*t, format!("{was}{answer}"));
                    }
                    (p, was) => panic!("{p:?} continued from {was:?}"),
                }
            }
        }
        accepted
    });
}

/// etcd gateway answers: ranges and watch lines.
#[test]
fn etcd_answers() {
    let seeds = texts(&[
        r#"{"header":{"revision":"42"},"kvs":[{"key":"c3cvaW5zdGFuY2VzL2E=","value":"e30=","create_revision":"3","mod_revision":"40","lease":"7587"}],"count":"1"}"#,
        r#"{"result":{"header":{"revision":"43"},"events":[{"kv":{"key":"YQ==","value":"Yg==","mod_revision":"43"}},{"type":"DELETE","kv":{"key":"Yw==","mod_revision":"43"}}]}}"#,
        r#"{"result":{"header":{"revision":"9"},"watch_id":"-1"}}"#,
        r#"{"result":{"canceled":true,"compact_revision":"12","cancel_reason":"compacted"}}"#,
        r#"{"error":{"grpc_code":14,"message":"unavailable"}}"#,
    ]);
    fuzz("etcd", seeds, true, |input| {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(input) else {
            return false;
        };
        let range = crate::discovery::etcd_api::range_answer(&v);
        let watch = crate::discovery::etcd_api::watch_answer(&v);
        range.is_ok_and(|(kvs, _)| !kvs.is_empty()) || watch.is_ok_and(|e| !e.is_empty())
    });
}

/// The Kubernetes API's answers discovery reads: pools, pods and watch lines.
#[test]
fn kube_answers() {
    use crate::discovery::kube::{Fleet, KubeConfig, KubeSource, pod_workers, pool_fleet};
    let seeds = texts(&[
        r#"{"metadata":{"resourceVersion":"7"},"spec":{"selector":{"matchLabels":{"app":"vllm"}},"targetPorts":[{"number":8000},{"number":8001}]}}"#,
        r#"{"metadata":{"uid":"u1","resourceVersion":"9"},"status":{"podIP":"10.0.0.7","conditions":[{"type":"Ready","status":"True"}]}}"#,
        r#"{"metadata":{"uid":"u2","deletionTimestamp":"2026-12-07T00:00:00Z"},"status":{"podIP":"fd00::1","conditions":[{"type":"Ready","status":"True"}]}}"#,
        r#"{"type":"MODIFIED","object":{"metadata":{"uid":"u1","resourceVersion":"10"}}}"#,
        r#"{"type":"ERROR","object":{"kind":"Status","code":410,"message":"too old resource version"}}"#,
    ]);
    let config = KubeConfig {
        api: crate::discovery::kube_api::KubeApi::new(
            "http://127.0.0.1:1",
            None,
            &Default::default(),
            std::time::Duration::from_secs(1),
        ),
        namespace: "default".into(),
        source: KubeSource::Pool("p".into()),
        model: "m".into(),
        block_size: 16,
        health_path: "/health".into(),
        backoff_initial: std::time::Duration::from_millis(1),
        backoff_max: std::time::Duration::from_millis(1),
        idle: std::time::Duration::from_secs(1),
    };
    let fleet = Fleet {
        selector: "a=b".into(),
        ports: vec![8000, 8001],
        pool_version: None,
    };
    let endpoint: crate::discovery::EndpointPath = "default/m/generate".parse().unwrap();
    fuzz("kube", seeds, true, |input| {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(input) else {
            return false;
        };
        let pool = pool_fleet(&v).is_ok();
        let pod = !pod_workers(&v, &fleet, &config, &endpoint).is_empty();
        let event = crate::discovery::kube_api::event(v).is_ok();
        pool || pod || event
    });
}

/// Kubeconfig files (YAML: anchors, aliases, base64 credentials, named contexts).
#[test]
fn kubeconfigs() {
    let seeds = texts(&[
        "current-context: a\nclusters:\n- name: c\n  cluster: {server: 'https://10.0.0.1:6443', certificate-authority-data: aGVsbG8=}\ncontexts:\n- name: a\n  context: {cluster: c, user: u, namespace: llm}\nusers:\n- name: u\n  user: {token: abc}\n",
        "current-context: a\nclusters:\n- &c {name: c, cluster: {server: 'http://h', certificate-authority: ca.crt}}\ncontexts:\n- {name: a, context: {cluster: c, user: u}}\nusers:\n- {name: u, user: {client-certificate: c.crt, client-key-data: a2V5}}\nx: [*c, *c, *c]\n",
    ]);
    let dir = std::path::Path::new("/k");
    fuzz("kubeconfig", seeds, true, |input| {
        let text = String::from_utf8_lossy(input);
        crate::discovery::kubeconfig::parse(&text, dir, None).is_ok()
    });
}

/// Engines' `/metrics` pages (vLLM's and SGLang's names).
#[test]
fn engine_metrics_pages() {
    let seeds = texts(&[
        "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 3.0\nvllm:num_requests_waiting{model_name=\"m\"} 1\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\nvllm:cache_config_info{num_gpu_blocks=\"2048\",block_size=\"16\"} 1.0\n",
        "sglang:num_running_reqs 2\nsglang:num_queue_reqs 0\nsglang:token_usage 0.5\nsglang:max_total_num_tokens 65536\n",
    ]);
    fuzz("metrics", seeds, false, |input| {
        let text = String::from_utf8_lossy(input);
        let mut accepted = false;
        for block_size in [0, 1, 16] {
            accepted |= crate::kv::engine_metrics::parse(&text, block_size).is_some();
        }
        accepted
    });
}

/// Engines' `/v1/models` answers, read for their context length and engine.
#[test]
fn models_answers() {
    let seeds = texts(&[
        r#"{"object":"list","data":[{"id":"m","object":"model","max_model_len":32768,"owned_by":"vllm"}]}"#,
        r#"{"object":"list","data":[{"id":"other","max_model_len":4096},{"id":"m","max_model_len":131072}]}"#,
    ]);
    fuzz("models", seeds, true, |input| {
        let Some(found) = crate::kv::engine_metrics::models(input, "m") else {
            return false;
        };
        assert_ne!(found.context, Some(0));
        found.context.is_some()
    });
}

/// `Retry-After` values: absent unless a finite, non-negative number; never a panic
/// however large.
#[test]
fn retry_after_headers() {
    let seeds = texts(&[
        "5",
        "0",
        "1e20",
        "18446744073709551616",
        "-1",
        "NaN",
        "inf",
        " 2.5 ",
    ]);
    fuzz("retry-after", seeds, false, |input| {
        let text = String::from_utf8_lossy(input);
        let Some(d) = crate::http::proxy::parse_retry_after(text.trim()) else {
            return false;
        };
        let secs: f64 = text.trim().parse().expect("only numbers are read");
        assert!(secs.is_finite() && secs >= 0.0);
        assert!(d == std::time::Duration::MAX || d.as_secs_f64() <= secs * 1.000_001 + 1e-9);
        true
    });
}

/// A client's overload headers (class, tenant, deadline, API key), each line of the
/// input one header's value: never a panic; a known class, a deadline within the cap;
/// the tenant a configured one or the default one, and never more urgent than its cap
/// (`anonymous` at most `normal`, `nightly` at most `low`).
#[test]
fn overload_headers() {
    use crate::http::queue::classes::{DEFAULT_TENANT, OverloadConfig, Tenant};
    use std::time::Duration;
    let seeds = texts(&[
        "high\nsearch\n1500\nBearer sk-1",
        "low\n\n99999999999\n",
        "normal\ntenant-with-a-very-long-name-that-goes-on-and-on-past-sixty-four-bytes-ok\n0\nbearer x",
        "urgent\nt\n-1\nBasic abc",
    ]);
    // SHA-256 of `sk-1`.
    const SK_1: [u8; 32] = [
        0x0f, 0x2c, 0x10, 0xbf, 0x3d, 0x12, 0x8c, 0x71, 0x9c, 0x6b, 0xfa, 0x4e, 0xcb, 0xae, 0x94,
        0xb7, 0xfc, 0xee, 0xba, 0xea, 0x6e, 0x44, 0x38, 0xfe, 0xf3, 0x8a, 0x90, 0xe5, 0xac, 0xc3,
        0x26, 0xf3,
    ];
    let tenant = |name: &str, key: Option<[u8; 32]>, class: &str, max: &str| Tenant {
        name: name.into(),
        weight: 2,
        api_key_sha256: key,
        class: Some(class.into()),
        max_class: Some(max.into()),
    };
    let config = OverloadConfig {
        tenants: vec![
            tenant("nightly", Some(SK_1), "low", "low"),
            tenant("search", None, "normal", "high"),
        ],
        ..OverloadConfig::default()
    };
    let cap = Duration::from_secs(600);
    fuzz("overload-headers", seeds, false, |input| {
        let mut values = input.split(|b| *b == b'\n');
        let mut headers = hyper::HeaderMap::new();
        for name in [
            "x-switchyard-priority",
            "x-switchyard-tenant",
            "x-switchyard-deadline-ms",
            "authorization",
        ] {
            let Some(v) = values.next() else { break };
            if let Ok(v) = hyper::header::HeaderValue::from_bytes(v) {
                headers.insert(name, v);
            }
        }
        let Ok(who) = config.identify(&headers, cap) else {
            return false;
        };
        assert!(who.class < config.classes.len());
        assert!(who.deadline <= cap);
        let most = match &*who.tenant {
            DEFAULT_TENANT => "normal",
            "nightly" => "low",
            "search" => "high",
            other => panic!("a tenant of its own: {other}"),
        };
        assert_eq!(who.known, &*who.tenant != DEFAULT_TENANT);
        assert!(
            who.class >= config.class_index(most).unwrap(),
            "raised past its cap"
        );
        true
    });
}

/// A gateway's ext_proc messages as the endpoint picker reads them (protobuf, as gRPC
/// delivers them): never a panic; the subset and the served endpoint within their
/// bounds; the request's parts parsed or refused with a client error.
#[test]
fn epp_messages() {
    use crate::http::epp::protocol;
    use crate::http::queue::classes::OverloadConfig;
    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        HttpHeaders, ProcessingRequest, ProtocolConfiguration, processing_request::Request,
    };
    use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
    use prost::Message;
    let headers = |pairs: &[(&str, &str)]| HttpHeaders {
        headers: Some(protocol::header_map(pairs)),
        end_of_stream: false,
        ..Default::default()
    };
    let text = |s: &str| Value {
        kind: Some(Kind::StringValue(s.into())),
    };
    let ns = |key: &str, v: Value| Struct {
        fields: [(key.to_string(), v)].into(),
    };
    let first = ProcessingRequest {
        request: Some(Request::RequestHeaders(headers(&[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("x-gateway-inference-objective", "low"),
            ("x-gateway-inference-fairness-id", "team"),
        ]))),
        metadata_context: Some(Metadata {
            filter_metadata: [(
                protocol::SUBSET_NAMESPACE.to_string(),
                ns(
                    protocol::SUBSET,
                    Value {
                        kind: Some(Kind::ListValue(ListValue {
                            values: vec![text("10.0.0.1:8000"), text("10.0.0.2:8000")],
                        })),
                    },
                ),
            )]
            .into(),
            ..Default::default()
        }),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: 4,
            response_body_mode: 4,
            ..Default::default()
        }),
        ..Default::default()
    };
    let response = ProcessingRequest {
        request: Some(Request::ResponseHeaders(headers(&[
            (":status", "503"),
            (protocol::SERVED, "10.0.0.1:8000"),
        ]))),
        metadata_context: Some(Metadata {
            filter_metadata: [(
                protocol::NAMESPACE.to_string(),
                ns(protocol::SERVED, text("10.0.0.2:8000")),
            )]
            .into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let seeds = vec![first.encode_to_vec(), response.encode_to_vec()];
    let overload = OverloadConfig::default();
    fuzz("epp", seeds, false, |input| {
        let Ok(m) = ProcessingRequest::decode(input) else {
            return false;
        };
        let _ = protocol::Mode::of(&m);
        if let Some(subset) = protocol::subset_hint(&m) {
            assert!(subset.len() <= 4096);
        }
        match &m.request {
            Some(Request::RequestHeaders(h)) => {
                if let Err(e) = protocol::request_parts(h, &overload) {
                    assert!(e.status().is_client_error(), "{e}");
                }
            }
            Some(Request::ResponseHeaders(h)) => {
                let _ = protocol::status(h);
                if let Some(s) = protocol::served(&m, Some(h)) {
                    assert!(s.len() <= 256);
                }
            }
            _ => {}
        }
        true
    });
}

/// A vLLM prefill worker's answer, read for its `kv_transfer_params`: never a panic;
/// read, they reach the decode worker's request unchanged and the client's fields stay.
#[test]
fn prefill_answers() {
    let seeds = texts(&[
        r#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"lorem ","finish_reason":"length"}],"usage":{"prompt_tokens":40,"completion_tokens":1},"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[0,1,2],"remote_engine_id":"e","remote_request_id":"r-1","remote_host":"10.0.0.7","remote_port":8000,"tp_size":1}}"#,
        r#"{"choices":[],"kv_transfer_params":null}"#,
        r#"{"kv_transfer_params":{"remote_block_ids":[18446744073709551615]}}"#,
    ]);
    let body = br#"{"model":"m","prompt":"hello","max_tokens":7,"stream":true}"#;
    fuzz("prefill-answer", seeds, true, |input| {
        let Ok(decode) = crate::http::proxy::vllm_handoff(body, input) else {
            return false;
        };
        let v: serde_json::Value = serde_json::from_slice(&decode).expect("JSON out");
        let answer: serde_json::Value = serde_json::from_slice(input).expect("read as JSON");
        // Compared as written (a float may not survive a second parse bit for bit).
        let params = serde_json::to_string(&answer["kv_transfer_params"]).unwrap();
        let written = String::from_utf8_lossy(&decode);
        assert!(
            written.contains(&format!("\"kv_transfer_params\":{params}")),
            "{written}"
        );
        assert_eq!(
            (&v["max_tokens"], &v["stream"]),
            (&serde_json::json!(7), &serde_json::json!(true))
        );
        true
    });
}

/// A request's handoff fields as a mock worker reads them, in every role and protocol:
/// never a panic; a handoff only where the role takes part in one.
#[test]
fn handoff_fields() {
    use crate::ids::Role;
    use crate::worker::server::pd::{Leg, leg};
    use crate::worker::{PdConfig, PdProtocol};
    let seeds = texts(&[
        r#"{"model":"m","prompt":"x","kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}"#,
        r#"{"model":"m","prompt":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"127.0.0.1","remote_port":8001,"remote_request_id":"8001-ab","remote_block_ids":[0,1]}}"#,
        r#"{"model":"m","messages":[],"bootstrap_host":"10.0.0.7","bootstrap_port":8998,"bootstrap_room":9223372036854775807}"#,
    ]);
    fuzz("handoff-fields", seeds, true, |input| {
        let mut any = false;
        for role in Role::ALL {
            for protocol in [PdProtocol::Vllm, PdProtocol::Sglang] {
                let pd = PdConfig {
                    role,
                    protocol,
                    ..PdConfig::default()
                };
                match leg(&pd, input, || "k".into()) {
                    Ok(Leg::Whole) | Err(_) => {}
                    Ok(Leg::Prefill { vllm, .. }) => {
                        assert!(role != Role::Decode);
                        assert!(vllm || role == Role::Prefill);
                        any = true;
                    }
                    Ok(Leg::Decode { vllm, .. }) => {
                        assert!(role != Role::Prefill);
                        assert!(vllm || role == Role::Decode);
                        any = true;
                    }
                }
            }
        }
        any
    });
}

/// What a policy returns as text (a rejection's reason, its name and version):
/// bounded and free of control characters wherever it goes.
#[test]
fn policy_texts() {
    use crate::policy::{MAX_GUEST_LABEL, MAX_GUEST_TEXT, guest_label, guest_text};
    let seeds = texts(&[
        "all busy",
        "kv-cost 0.2.0",
        "line\nbreak\u{7}",
        "ünïcödé ✓ 🚀",
    ]);
    fuzz("policy-text", seeds, false, |input| {
        let s = String::from_utf8_lossy(input);
        let text = guest_text(&s);
        assert!(text.len() <= MAX_GUEST_TEXT + '…'.len_utf8());
        assert!(!text.chars().any(char::is_control));
        let label = guest_label(&s);
        assert!(!label.is_empty() && label.chars().count() <= MAX_GUEST_LABEL);
        assert!(
            label
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-+:/@".contains(c))
        );
        true
    });
}
