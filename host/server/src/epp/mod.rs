//! The endpoint picker (`--epp-listen`): Envoy's external processing service
//! (`envoy.service.ext_proc.v3.ExternalProcessor`, gRPC) as the Gateway API Inference
//! Extension's endpoint picker protocol uses it. A gateway sends each request's headers
//! and body; the picker decides as the front door would (`proxy::pick`: the same
//! parsing, router, policy, queue and bookings) and answers the worker's `ip:port` in
//! the `x-gateway-destination-endpoint` header and the `envoy.lb` dynamic metadata;
//! the gateway carries the bytes. The answer's first bytes mark the prompt prefilled and
//! its end releases the booking; a stream that ends without them releases it too.
//!
//! Body mode: `FULL_DUPLEX_STREAMED` (the reference picker's): the body comes in chunks
//! and goes back, whole, once the pick is made; response chunks are passed through as
//! they come. Buffered modes (`BUFFERED`) are answered with the same pick.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders,
    ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse, body_mutation,
    processing_request::Request as In, processing_response::Response as Out,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use http_body_util::BodyExt;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::{Status, Streaming};

use crate::proxy::pick::{Picked, pick};
use crate::{ApiError, Gateway};
use switchyard_tokens::openai::Api;

/// The header and metadata key of the pick.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata namespace of the pick.
pub const NAMESPACE: &str = "envoy.lb";
/// The filter metadata namespace of a gateway's subset hint, and its key.
const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
const SUBSET: &str = "x-gateway-destination-endpoint-subset";

/// Serves the picker on `listen` until `stop` resolves.
pub async fn serve(
    gw: Arc<Gateway>,
    listen: SocketAddr,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    // gRPC health, as GIE's deployments probe it: `liveness` while the process answers;
    // `readiness` and the ext_proc service while the front door itself would be ready
    // (discovery done, not draining), checked every second.
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("liveness", tonic_health::ServingStatus::Serving)
        .await;
    let watch = gw.clone();
    let ready_task = tokio::spawn(async move {
        loop {
            let status = if watch.is_ready() {
                tonic_health::ServingStatus::Serving
            } else {
                tonic_health::ServingStatus::NotServing
            };
            for service in [
                "readiness",
                "envoy.service.ext_proc.v3.ExternalProcessor",
                "",
            ] {
                reporter.set_service_status(service, status).await;
            }
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
    });
    let served = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(ExternalProcessorServer::new(Picker { gw }))
        .serve_with_shutdown(listen, stop)
        .await;
    ready_task.abort();
    served
}

struct Picker {
    gw: Arc<Gateway>,
}

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: tonic::Request<Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Answers>, Status> {
        let input = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(exchange(self.gw.clone(), input, tx));
        Ok(tonic::Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// One request's exchange with the gateway.
#[derive(Default)]
struct Exchange {
    headers: Option<HttpHeaders>,
    body: Vec<u8>,
    /// The subset the gateway allows, if it sent one.
    subset: Option<Vec<String>>,
    picked: Option<Picked>,
    answered: bool,
}

async fn exchange(
    gw: Arc<Gateway>,
    mut input: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
) {
    let mut x = Exchange::default();
    while let Ok(Some(m)) = input.message().await {
        if x.subset.is_none() {
            x.subset = subset_hint(&m);
        }
        let answers = match m.request {
            Some(In::RequestHeaders(h)) => {
                let eos = h.end_of_stream;
                x.headers = Some(h);
                if eos {
                    decide(&gw, &mut x).await
                } else {
                    Vec::new()
                }
            }
            Some(In::RequestBody(b)) => {
                if x.body.len().saturating_add(b.body.len()) > gw.config.max_body_bytes {
                    let e = ApiError::TooLarge(gw.config.max_body_bytes);
                    vec![immediate(&e).await]
                } else {
                    x.body.extend_from_slice(&b.body);
                    if b.end_of_stream {
                        decide(&gw, &mut x).await
                    } else {
                        Vec::new()
                    }
                }
            }
            Some(In::ResponseHeaders(_)) => {
                vec![answer(Out::ResponseHeaders(HeadersResponse::default()))]
            }
            Some(In::ResponseBody(b)) => {
                if let Some(p) = &mut x.picked {
                    if !x.answered {
                        x.answered = true;
                        p.first_token();
                    }
                    if b.end_of_stream {
                        p.finish();
                    }
                }
                vec![answer(Out::ResponseBody(BodyResponse {
                    response: Some(streamed(b.body, b.end_of_stream)),
                }))]
            }
            Some(In::RequestTrailers(_)) => {
                vec![answer(Out::RequestTrailers(Default::default()))]
            }
            Some(In::ResponseTrailers(_)) => {
                if let Some(p) = &mut x.picked {
                    p.finish();
                }
                vec![answer(Out::ResponseTrailers(Default::default()))]
            }
            None => Vec::new(),
        };
        for a in answers {
            if tx.send(Ok(a)).await.is_err() {
                return;
            }
        }
    }
    // The stream ended: whatever was booked is released as `x` drops.
}

/// The pick for the request gathered so far: the headers answered with the destination,
/// then the body returned whole; or an immediate answer saying why not.
async fn decide(gw: &Arc<Gateway>, x: &mut Exchange) -> Vec<ProcessingResponse> {
    let Some(h) = &x.headers else {
        return vec![immediate(&ApiError::BadRequest(bad("no request headers"))).await];
    };
    let (parts, api) = match request_parts(h) {
        Ok(p) => p,
        Err(e) => return vec![immediate(&e).await],
    };
    let body = Bytes::from(std::mem::take(&mut x.body));
    let subset = x.subset.clone();
    let allowed = move |url: &str| {
        subset
            .as_ref()
            .is_none_or(|s| s.iter().any(|a| Some(a.as_str()) == host_port(url)))
    };
    let picked = match pick(gw, api, &parts, &body, &allowed).await {
        Ok(p) => p,
        Err(e) => return vec![immediate(&e).await],
    };
    let Some(dest) = host_port(&picked.url).map(str::to_string) else {
        return vec![immediate(&ApiError::Internal("a worker URL without host".into())).await];
    };
    x.picked = Some(picked);
    let mutation = CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers: vec![HeaderValueOption {
                header: Some(HeaderValue {
                    key: DESTINATION.into(),
                    raw_value: dest.clone().into_bytes(),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        }),
        clear_route_cache: true,
        ..Default::default()
    };
    let mut headers = answer(Out::RequestHeaders(HeadersResponse {
        response: Some(mutation),
    }));
    headers.dynamic_metadata = Some(destination_metadata(&dest));
    let mut out = vec![headers];
    if !x.headers.as_ref().is_some_and(|h| h.end_of_stream) {
        out.push(answer(Out::RequestBody(BodyResponse {
            response: Some(streamed(body.to_vec(), true)),
        })));
    }
    out
}

fn bad(message: &str) -> switchyard_tokens::openai::BadRequest {
    switchyard_tokens::openai::BadRequest {
        message: message.into(),
        param: None,
    }
}

/// The request's method, path and headers as the front door reads them, and its API.
fn request_parts(h: &HttpHeaders) -> Result<(hyper::http::request::Parts, Api), ApiError> {
    let mut builder = hyper::Request::builder();
    let mut path = None;
    if let Some(map) = &h.headers {
        for hv in &map.headers {
            let value = if hv.raw_value.is_empty() {
                hv.value.as_bytes()
            } else {
                hv.raw_value.as_slice()
            };
            match hv.key.as_str() {
                ":path" => path = Some(String::from_utf8_lossy(value).into_owned()),
                ":method" => builder = builder.method(value),
                k if k.starts_with(':') => {}
                k => builder = builder.header(k, value),
            }
        }
    }
    let path = path.ok_or_else(|| ApiError::BadRequest(bad("no :path header")))?;
    let api = match path.split('?').next() {
        Some("/v1/chat/completions") => Api::Chat,
        Some("/v1/completions") => Api::Completions,
        _ => {
            return Err(ApiError::NotFound(format!(
                "no endpoint picking for {path}"
            )));
        }
    };
    let (parts, ()) = builder
        .uri(path)
        .body(())
        .map_err(|e| ApiError::BadRequest(bad(&format!("request headers: {e}"))))?
        .into_parts();
    Ok((parts, api))
}

/// `host:port` of a worker's base URL.
fn host_port(url: &str) -> Option<&str> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let hp = rest.split('/').next()?;
    (!hp.is_empty()).then_some(hp)
}

/// The endpoints of the gateway's subset hint, if it sent one.
fn subset_hint(m: &ProcessingRequest) -> Option<Vec<String>> {
    let ns = m
        .metadata_context
        .as_ref()?
        .filter_metadata
        .get(SUBSET_NAMESPACE)?;
    let list = match ns.fields.get(SUBSET)?.kind.as_ref()? {
        Kind::ListValue(l) => l
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.clone()),
                _ => None,
            })
            .collect(),
        Kind::StringValue(s) => s.split(',').map(|s| s.trim().to_string()).collect(),
        _ => Vec::new(),
    };
    Some(list)
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

fn streamed(body: Vec<u8>, end_of_stream: bool) -> CommonResponse {
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

fn answer(out: Out) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(out),
        ..Default::default()
    }
}

/// The front door's answer to `e`, sent by the gateway in place of the request.
async fn immediate(e: &ApiError) -> ProcessingResponse {
    let response = e.response();
    let (parts, body) = response.into_parts();
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
