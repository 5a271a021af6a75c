//! The endpoint picker protocol's messages: what a gateway's ext_proc request says (the
//! request's headers, the subset hint, the mode, the endpoint that served the answer)
//! and the answers the picker sends (the pick as a header and dynamic metadata, a
//! body passed back, an immediate answer). Pure functions of their input, fuzzed
//! (`switchyard fuzz epp`).

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, CommonResponse, HeaderMutation, HttpHeaders, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, StreamedBodyResponse, body_mutation,
    processing_response::Response as Out,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use hyper::header::HeaderValue as HttpValue;

use crate::ApiError;
use crate::queue::classes::{OverloadConfig, PRIORITY_HEADER};
use switchyard_tokens::openai::{Api, BadRequest};

/// The header and metadata key of the pick.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata namespace of the pick, and of the endpoint that served.
pub const NAMESPACE: &str = "envoy.lb";
/// The key under [`NAMESPACE`] (or the response header) naming the endpoint that served.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The filter metadata namespace of a gateway's subset hint, and its key.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The key of the subset hint.
pub const SUBSET: &str = "x-gateway-destination-endpoint-subset";
/// GIE's header naming a request's objective: read as its priority class when it names
/// one (capped as any priority a request asks for).
pub const OBJECTIVE: &str = "x-gateway-inference-objective";
/// GIE's header naming a request's fairness ID. It names a configured tenant only when
/// the operator makes it the tenant header (`tenant_header`), saying the gateway sets it
/// and clients cannot: otherwise anyone could name a keyless tenant (and its
/// `max_class`) through it.
pub const FAIRNESS: &str = "x-gateway-inference-fairness-id";
/// Where Envoy puts the attributes an ext_proc filter asks for.
const ATTRIBUTES: &str = "envoy.filters.http.ext_proc";
/// The attribute naming the upstream a response came from.
const UPSTREAM_ADDRESS: &str = "upstream.address";
/// Largest body chunk sent back to the gateway (Envoy's advice for streamed bodies).
pub const CHUNK: usize = 64 << 10;
/// Most header entries read from one message.
const MAX_HEADERS: usize = 256;
/// Most endpoints read from a subset hint.
const MAX_SUBSET: usize = 4096;

/// How the gateway sends the request body (the filter's `request_body_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `FULL_DUPLEX_STREAMED`: chunks as they come; the headers wait for the pick.
    FullDuplex,
    /// `BUFFERED`: the headers are answered at once, the body comes whole and its
    /// answer carries the pick.
    Buffered,
    /// A mode the picker cannot pick in (no body, or `STREAMED`: the headers would go
    /// upstream before the body is read).
    Unusable(i32),
}

impl Mode {
    /// The request body mode this message announces (only the first message of a
    /// stream does; a gateway that announces none is taken to stream in full duplex).
    pub fn of(m: &ProcessingRequest) -> Option<Mode> {
        let mode = m.protocol_config.as_ref()?.request_body_mode;
        Some(match BodySendMode::try_from(mode) {
            Ok(BodySendMode::FullDuplexStreamed) => Mode::FullDuplex,
            Ok(BodySendMode::Buffered) => Mode::Buffered,
            // A partial body (cut at Envoy's buffer limit, the rest never sent here)
            // cannot be parsed: refused, with the mode named, rather than read truncated.
            _ => Mode::Unusable(mode),
        })
    }

    /// Whether the response body comes in full duplex (each chunk answered with itself)
    /// rather than whole or not at all (answered with no mutation).
    pub fn response_full_duplex(m: &ProcessingRequest) -> Option<bool> {
        let mode = m.protocol_config.as_ref()?.response_body_mode;
        Some(mode == BodySendMode::FullDuplexStreamed as i32)
    }
}

/// A header's value: `raw_value`, else `value`.
fn value_of(h: &HeaderValue) -> &[u8] {
    if h.raw_value.is_empty() {
        h.value.as_bytes()
    } else {
        &h.raw_value
    }
}

/// The value of header `name` in `h`, if it is there.
pub fn header<'a>(h: &'a HttpHeaders, name: &str) -> Option<&'a [u8]> {
    h.headers
        .as_ref()?
        .headers
        .iter()
        .take(MAX_HEADERS)
        .find(|v| v.key.eq_ignore_ascii_case(name))
        .map(value_of)
}

pub(crate) fn bad(message: &str) -> BadRequest {
    BadRequest {
        message: message.into(),
        param: None,
    }
}

/// The request's method, path and headers as the front door reads them, and its API.
/// GIE's objective header stands in for the priority header when that is absent (and
/// the objective names a class); its fairness ID is a tenant only when it is the
/// configured tenant header ([`FAIRNESS`]).
pub fn request_parts(
    h: &HttpHeaders,
    overload: &OverloadConfig,
) -> Result<(hyper::http::request::Parts, Api), ApiError> {
    let mut builder = hyper::Request::builder();
    let mut path = None;
    let entries = h.headers.as_ref().map_or(&[][..], |m| &m.headers[..]);
    if entries.len() > MAX_HEADERS {
        return Err(ApiError::BadRequest(bad("more than 256 request headers")));
    }
    for hv in entries {
        let value = value_of(hv);
        match hv.key.as_str() {
            ":path" => path = Some(String::from_utf8_lossy(value).into_owned()),
            ":method" => builder = builder.method(value),
            k if k.starts_with(':') => {}
            k => builder = builder.header(k, value),
        }
    }
    let path = path.ok_or_else(|| ApiError::BadRequest(bad("no :path header")))?;
    let api = match path.split('?').next() {
        Some("/v1/chat/completions") => Api::Chat,
        Some("/v1/completions") => Api::Completions,
        _ => {
            let shown: String = path.chars().take(128).collect();
            return Err(ApiError::NotFound(format!(
                "no endpoint picking for {shown}"
            )));
        }
    };
    let (mut parts, ()) = builder
        .uri(path)
        .body(())
        .map_err(|e| ApiError::BadRequest(bad(&format!("request headers: {e}"))))?
        .into_parts();
    let headers = &mut parts.headers;
    let class = headers
        .get(OBJECTIVE)
        .and_then(|v| v.to_str().ok())
        .filter(|o| overload.class_index(o.trim()).is_some())
        .map(|o| o.trim().to_string());
    if let Some(class) = class
        && !headers.contains_key(PRIORITY_HEADER)
        && let Ok(v) = HttpValue::try_from(class)
    {
        headers.insert(PRIORITY_HEADER, v);
    }
    Ok((parts, api))
}

/// The endpoints of the gateway's subset hint, if it sent one (a list of `ip:port`, or
/// one comma-separated string).
pub fn subset_hint(m: &ProcessingRequest) -> Option<Vec<String>> {
    let ns = m
        .metadata_context
        .as_ref()?
        .filter_metadata
        .get(SUBSET_NAMESPACE)?;
    let list = match ns.fields.get(SUBSET)?.kind.as_ref() {
        Some(Kind::ListValue(l)) => l
            .values
            .iter()
            .take(MAX_SUBSET)
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.trim().to_string()),
                _ => None,
            })
            .collect(),
        Some(Kind::StringValue(s)) => s
            .split(',')
            .take(MAX_SUBSET)
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect(),
        _ => Vec::new(),
    };
    Some(list)
}

/// The endpoint that served the answer, as the gateway reports it: the `envoy.lb`
/// metadata's `x-gateway-destination-endpoint-served` (GIE's protocol), else Envoy's
/// `upstream.address` attribute (asked for with `response_attributes`), else the
/// response header of that name.
pub fn served(m: &ProcessingRequest, h: Option<&HttpHeaders>) -> Option<String> {
    let text = |v: &Value| match &v.kind {
        Some(Kind::StringValue(s)) if s.len() <= 256 => Some(s.trim().to_string()),
        _ => None,
    };
    let from_metadata = m
        .metadata_context
        .as_ref()
        .and_then(|c| c.filter_metadata.get(NAMESPACE))
        .and_then(|ns| ns.fields.get(SERVED))
        .and_then(text);
    let from_attribute = || {
        m.attributes
            .get(ATTRIBUTES)
            .and_then(|s| s.fields.get(UPSTREAM_ADDRESS))
            .and_then(text)
    };
    let from_header = || {
        h.and_then(|h| header(h, SERVED))
            .filter(|v| v.len() <= 256)
            .and_then(|v| std::str::from_utf8(v).ok())
            .map(|s| s.trim().to_string())
    };
    from_metadata
        .or_else(from_attribute)
        .or_else(from_header)
        .filter(|s| !s.is_empty())
}

/// The response status the gateway reports in the response headers.
pub fn status(h: &HttpHeaders) -> Option<u16> {
    let v = header(h, ":status")?;
    std::str::from_utf8(v).ok()?.trim().parse().ok()
}

/// Headers as a gateway's ext_proc message carries them (raw values), from name and
/// value pairs: how a client of the picker (the tests, the fuzzer) writes a request.
pub fn header_map(pairs: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).into(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    }
}

/// The pick's answer to the request headers: the destination header set, the route
/// cache cleared (the route is chosen again with it), and the same value in the
/// `envoy.lb` dynamic metadata.
pub fn pick_headers(dest: &str) -> (CommonResponse, Struct) {
    let mutation = CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers: vec![HeaderValueOption {
                header: Some(HeaderValue {
                    key: DESTINATION.into(),
                    raw_value: dest.as_bytes().to_vec(),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        }),
        clear_route_cache: true,
        ..Default::default()
    };
    (mutation, destination_metadata(dest))
}

fn destination_metadata(dest: &str) -> Struct {
    let inner = Struct {
        fields: [(
            DESTINATION.to_string(),
            Value {
                kind: Some(Kind::StringValue(dest.into())),
            },
        )]
        .into(),
    };
    Struct {
        fields: [(
            NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into(),
    }
}

/// The answer's headers naming the endpoint that served it ([`SERVED`]).
pub fn served_header(served: &str) -> CommonResponse {
    CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers: vec![HeaderValueOption {
                header: Some(HeaderValue {
                    key: SERVED.into(),
                    raw_value: served.as_bytes().to_vec(),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A body chunk passed back in full-duplex mode.
pub fn streamed(body: Vec<u8>, end_of_stream: bool) -> CommonResponse {
    CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(body_mutation::Mutation::StreamedResponse(
                StreamedBodyResponse {
                    body,
                    end_of_stream,
                    ..Default::default()
                },
            )),
        }),
        ..Default::default()
    }
}

/// A response message.
pub fn answer(out: Out) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(out),
        ..Default::default()
    }
}

/// The front door's answer to `e`, sent by the gateway in place of the request. A
/// request shed under load is 429, as GIE's protocol asks (503 is for no ready
/// endpoint; a gateway may retry that elsewhere, which only adds load here).
pub async fn immediate(e: &ApiError) -> ProcessingResponse {
    use http_body_util::BodyExt;
    use switchyard_router::RouteError;
    let response = e.response();
    let (mut parts, body) = response.into_parts();
    if matches!(
        e,
        ApiError::Shed(_)
            | ApiError::Overloaded(_)
            | ApiError::Route(RouteError::Saturated { .. } | RouteError::Busy { .. })
    ) {
        parts.status = hyper::StatusCode::TOO_MANY_REQUESTS;
    }
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let headers: Vec<HeaderValueOption> = parts
        .headers
        .iter()
        .map(|(k, v)| HeaderValueOption {
            header: Some(HeaderValue {
                key: k.as_str().into(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect();
    answer(Out::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(parts.status.as_u16()),
        }),
        headers: Some(HeaderMutation {
            set_headers: headers,
            ..Default::default()
        }),
        body: body.to_vec(),
        details: e.to_string(),
        ..Default::default()
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use std::time::Duration;

    fn headers(pairs: &[(&str, &str)]) -> HttpHeaders {
        HttpHeaders {
            headers: Some(header_map(pairs)),
            ..Default::default()
        }
    }

    #[test]
    fn gie_objective_stands_in_for_the_class_and_fairness_only_where_configured() {
        let overload = OverloadConfig::default();
        let h = headers(&[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            (OBJECTIVE, "low"),
            (FAIRNESS, "team-a"),
        ]);
        let (parts, api) = request_parts(&h, &overload).unwrap();
        assert_eq!(api, Api::Chat);
        assert_eq!(parts.headers[PRIORITY_HEADER], "low");
        // A fairness ID is not the tenant header unless the operator made it so: a
        // keyless tenant is not anyone's who sets it.
        assert!(!parts.headers.contains_key(overload.tenant_header.as_str()));
        let trusting = OverloadConfig {
            tenants: vec![crate::queue::classes::Tenant {
                name: "team-a".into(),
                weight: 1,
                api_key_sha256: None,
                class: None,
                max_class: Some("high".into()),
            }],
            tenant_header: FAIRNESS.into(),
            ..OverloadConfig::default()
        };
        let (parts, _) = request_parts(&h, &trusting).unwrap();
        let who = trusting
            .identify(&parts.headers, Duration::from_secs(60))
            .unwrap();
        assert_eq!(&*who.tenant, "team-a");
        let who = overload
            .identify(&parts.headers, Duration::from_secs(60))
            .unwrap();
        assert_eq!(&*who.tenant, crate::queue::classes::DEFAULT_TENANT);
        // An objective that names no class is not a priority (and not an error).
        let h = headers(&[(":path", "/v1/completions"), (OBJECTIVE, "summaries")]);
        let (parts, _) = request_parts(&h, &overload).unwrap();
        assert!(!parts.headers.contains_key(PRIORITY_HEADER));
        // The request's own priority header wins.
        let h = headers(&[
            (":path", "/v1/completions"),
            (OBJECTIVE, "low"),
            (PRIORITY_HEADER, "normal"),
        ]);
        let (parts, _) = request_parts(&h, &overload).unwrap();
        assert_eq!(parts.headers[PRIORITY_HEADER], "normal");
    }

    #[test]
    fn other_paths_are_not_picked_for() {
        let h = headers(&[(":path", "/v1/embeddings")]);
        let e = request_parts(&h, &OverloadConfig::default()).unwrap_err();
        assert_eq!(e.status(), 404);
        let e = request_parts(&headers(&[]), &OverloadConfig::default()).unwrap_err();
        assert_eq!(e.status(), 400);
    }

    fn with_metadata(ns: &str, key: &str, v: Kind) -> ProcessingRequest {
        let inner = Struct {
            fields: [(key.to_string(), Value { kind: Some(v) })].into(),
        };
        ProcessingRequest {
            metadata_context: Some(Metadata {
                filter_metadata: [(ns.to_string(), inner)].into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn the_subset_hint_is_a_list_or_a_comma_separated_string() {
        let list = Kind::ListValue(envoy_types::pb::google::protobuf::ListValue {
            values: vec![Value {
                kind: Some(Kind::StringValue("10.0.0.1:8000".into())),
            }],
        });
        let m = with_metadata(SUBSET_NAMESPACE, SUBSET, list);
        assert_eq!(subset_hint(&m), Some(vec!["10.0.0.1:8000".to_string()]));
        let m = with_metadata(
            SUBSET_NAMESPACE,
            SUBSET,
            Kind::StringValue("a:1, b:2".into()),
        );
        assert_eq!(subset_hint(&m), Some(vec!["a:1".into(), "b:2".into()]));
        // An empty hint is a subset of nothing, not no subset.
        let m = with_metadata(SUBSET_NAMESPACE, SUBSET, Kind::StringValue(String::new()));
        assert_eq!(subset_hint(&m), Some(Vec::new()));
        assert_eq!(subset_hint(&ProcessingRequest::default()), None);
    }

    #[test]
    fn the_served_endpoint_comes_from_metadata_then_the_attribute_then_a_header() {
        let m = with_metadata(NAMESPACE, SERVED, Kind::StringValue("10.0.0.2:80".into()));
        assert_eq!(served(&m, None).as_deref(), Some("10.0.0.2:80"));
        let mut m = ProcessingRequest::default();
        m.attributes.insert(
            ATTRIBUTES.into(),
            Struct {
                fields: [(
                    UPSTREAM_ADDRESS.to_string(),
                    Value {
                        kind: Some(Kind::StringValue("127.0.0.1:9".into())),
                    },
                )]
                .into(),
            },
        );
        assert_eq!(served(&m, None).as_deref(), Some("127.0.0.1:9"));
        let h = headers(&[(SERVED, "127.0.0.1:7"), (":status", "200")]);
        assert_eq!(
            served(&ProcessingRequest::default(), Some(&h)).as_deref(),
            Some("127.0.0.1:7")
        );
        assert_eq!(status(&h), Some(200));
    }
}
