//! The endpoint picker against a gateway that does not behave: a raw ext_proc client
//! (gRPC, as Envoy speaks it) that picks and never forwards, never reads its answers,
//! reports one answer's status again and again, or reports Envoy's own 503 for a pick
//! it could not reach, or opens more connections and streams than it may. The picker's
//! port holds as the front door does: bookings live only while a real exchange does, a
//! peer that stops reading is cut off, one answer counts once, a dead pick is probed
//! out, and connections and streams are bounded.

mod common;

use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
    processing_request::Request, processing_response::Response,
};
use serde_json::json;
use switchyard::http::epp::protocol::{DESTINATION, SERVED, header_map};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use common::gateway::picker;
use common::procs::mock_worker;
use common::router::{eventually, instance, metric};

/// `FULL_DUPLEX_STREAMED`, both ways.
const FULL_DUPLEX: i32 = 4;

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(header_map(pairs)),
            end_of_stream,
            ..Default::default()
        })),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: FULL_DUPLEX,
            response_body_mode: FULL_DUPLEX,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn request_body(body: Vec<u8>) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body,
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// The answer's headers as the gateway reports them: its status, and the endpoint that
/// served it when `served` names one.
fn response_headers(status: &str, served: Option<&str>) -> ProcessingRequest {
    let mut pairs = vec![(":status", status)];
    if let Some(s) = served {
        pairs.push((SERVED, s));
    }
    let mut m = headers(&pairs, false);
    m.protocol_config = None;
    if let Some(Request::RequestHeaders(h)) = m.request.take() {
        m.request = Some(Request::ResponseHeaders(h));
    }
    m
}

/// An exchange opened as a gateway opens one: what it sends, what it is answered.
struct Exchange {
    send: mpsc::Sender<ProcessingRequest>,
    answers: tonic::Streaming<ProcessingResponse>,
}

async fn open(epp: u16) -> Exchange {
    try_open(epp).await.unwrap()
}

/// [`open`], or why the picker would not take the exchange.
async fn try_open(epp: u16) -> Result<Exchange, String> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{epp}"))
        .unwrap()
        .connect()
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let mut client = ExternalProcessorClient::new(channel);
    let (send, rx) = mpsc::channel(64);
    let answers = client
        .process(ReceiverStream::new(rx))
        .await
        .map_err(|e| format!("process: {e}"))?
        .into_inner();
    Ok(Exchange { send, answers })
}

/// A completion's headers and body, sent for a pick; the pick's answers read. The
/// picked endpoint (`host:port`).
async fn pick(x: &mut Exchange, prompt: &str) -> String {
    pick_as(x, prompt, false).await
}

/// [`pick`], for a streamed answer when `stream`.
async fn pick_as(x: &mut Exchange, prompt: &str, stream: bool) -> String {
    let body =
        json!({"model": "mock", "prompt": prompt, "max_tokens": 4, "stream": stream}).to_string();
    let h = [
        (":method", "POST"),
        (":path", "/v1/completions"),
        ("content-type", "application/json"),
    ];
    x.send.send(headers(&h, false)).await.unwrap();
    x.send.send(request_body(body.into_bytes())).await.unwrap();
    // The headers' answer (with the destination) and the body's.
    let first = x.answers.message().await.unwrap().expect("an answer");
    x.answers.message().await.unwrap().expect("an answer");
    let Some(Response::RequestHeaders(h)) = first.response else {
        panic!("not the headers' answer: {first:?}");
    };
    let set = h
        .response
        .and_then(|r| r.header_mutation)
        .map(|m| m.set_headers);
    set.into_iter()
        .flatten()
        .filter_map(|o| o.header)
        .find(|h| h.key == DESTINATION)
        .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
        .expect("a destination")
}

/// A pick the gateway never forwards (it sends nothing more, and keeps its stream open)
/// holds its booking for a stream's first-byte timeout, not the request timeout: one stalled
/// stream per worker does not leave the fleet saturated for ten minutes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pick_never_forwarded_releases_its_booking_at_the_first_byte_timeout() {
    let (_a, a) = mock_worker(&[]).await;
    let (_b, b) = mock_worker(&[]).await;
    let (_r, router, epp) = picker(&[&a, &b], &["--first-byte-timeout-secs", "2"]).await;
    let c = common::http::client();
    let mut stalled = Vec::new();
    for i in 0..2 {
        let mut x = open(epp).await;
        pick_as(&mut x, &format!("stalled {i}"), true).await;
        stalled.push(x);
    }
    let in_flight = "switchyard_instance_in_flight";
    assert_eq!(
        metric(&c, &router, in_flight, "").await,
        2.0,
        "both picks booked"
    );
    eventually("the unforwarded picks' bookings to be released", || async {
        metric(&c, &router, in_flight, "").await == 0.0
    })
    .await;
    assert_eq!(stalled.len(), 2, "the streams are still open");
}

/// A gateway that stops reading its stream: the picker's answers (the body handed back
/// in chunks) fill the stream and wait; past the write deadline the exchange ends and
/// its booking goes with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_that_never_reads_its_answers_is_cut_off() {
    // A model whose context holds the long prompt below (1.6M tokens).
    let (_a, a) = mock_worker(&["--kv-blocks", "262144"]).await;
    let extra = [
        "--client-idle-timeout-secs",
        "2",
        "--max-body-bytes",
        "16777216",
        "--max-prompt-tokens",
        "4194304",
    ];
    let (_r, router, epp) = picker(&[&a], &extra).await;
    let c = common::http::client();
    let x = open(epp).await;
    // 4 MiB of prompt: 64 chunks handed back, never read.
    let prompt = "word ".repeat(800_000);
    let body = json!({"model": "mock", "prompt": prompt, "max_tokens": 4}).to_string();
    let h = [(":method", "POST"), (":path", "/v1/completions")];
    x.send.send(headers(&h, false)).await.unwrap();
    x.send.send(request_body(body.into_bytes())).await.unwrap();
    let in_flight = "switchyard_instance_in_flight";
    eventually("the pick to be booked", || async {
        metric(&c, &router, in_flight, "").await == 1.0
    })
    .await;
    eventually(
        "the unread exchange to end and release its booking",
        || async { metric(&c, &router, in_flight, "").await == 0.0 },
    )
    .await;
    drop(x);
}

/// One answer's status reported again and again in one exchange (a buggy or hostile
/// gateway) counts once: five 500s do not eject the worker at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_answer_reported_five_times_counts_once() {
    let (_a, a) = mock_worker(&[]).await;
    let (_b, b) = mock_worker(&[]).await;
    let (_r, router, epp) = picker(&[&a, &b], &[]).await;
    let c = common::http::client();
    let mut x = open(epp).await;
    let picked = pick(&mut x, "replayed").await;
    for _ in 0..5 {
        x.send
            .send(response_headers("500", Some(&picked)))
            .await
            .unwrap();
        x.answers.message().await.unwrap().expect("an answer");
    }
    let mut failures = 0;
    for w in [&a, &b] {
        failures += instance(&c, &router, w).await["consecutive_failures"]
            .as_u64()
            .unwrap();
    }
    assert_eq!(failures, 1, "one answer counted more than once");
    for w in [&a, &b] {
        assert_eq!(instance(&c, &router, w).await["available"], true);
    }
}

/// GIE's reference gateway (one endpoint, no fallback) answers a pick it cannot reach
/// with its own 503, no `Retry-After`: the pick is probed, found dead, and leaves the
/// picks, rather than taken for busy and picked again after its pause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_pick_reported_as_the_gateways_503_is_probed_out() {
    let (mut dead, a) = mock_worker(&[]).await;
    let (_b, b) = mock_worker(&[]).await;
    let (_r, router, epp) = picker(&[&a, &b], &["--policy", "round-robin"]).await;
    let c = common::http::client();
    dead.kill();
    // Round-robin: within two picks, one is the dead worker's.
    for i in 0..2 {
        let mut x = open(epp).await;
        pick(&mut x, &format!("to a dead worker {i}")).await;
        // Envoy's local reply: no endpoint served it, no Retry-After.
        x.send.send(response_headers("503", None)).await.unwrap();
        x.answers.message().await.unwrap().expect("an answer");
    }
    eventually("the dead worker to be reported down", || async {
        instance(&c, &router, &a).await["available"] == false
    })
    .await;
    assert_eq!(instance(&c, &router, &b).await["available"], true);
}

/// Picks hold the front door's `--max-in-flight` slots until their answers end: past it
/// a gateway's request is shed with 429 (GIE's "dropped under load") and a front-door
/// request with 503, and a slot freed by a finished exchange is taken again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picks_hold_the_front_doors_in_flight_bound() {
    let (_a, a) = mock_worker(&[]).await;
    let (_r, router, epp) = picker(&[&a], &["--max-in-flight", "1"]).await;
    let c = common::http::client();
    let mut held = open(epp).await;
    pick(&mut held, "holds the slot").await;
    // A second pick: refused at once.
    let mut x = open(epp).await;
    let body = json!({"model": "mock", "prompt": "no slot", "max_tokens": 4}).to_string();
    let h = [(":method", "POST"), (":path", "/v1/completions")];
    x.send.send(headers(&h, false)).await.unwrap();
    x.send.send(request_body(body.into_bytes())).await.unwrap();
    let refused = x.answers.message().await.unwrap().expect("an answer");
    let Some(Response::ImmediateResponse(r)) = refused.response else {
        panic!("not refused: {refused:?}");
    };
    assert_eq!(r.status.map(|s| s.code), Some(429), "{}", r.details);
    // The front door shares the bound.
    let (status, _, _) = common::http::send(
        &c,
        hyper::Method::POST,
        &format!("{router}/v1/completions"),
        &[("content-type", "application/json")],
        json!({"model": "mock", "prompt": "front door", "max_tokens": 4}).to_string(),
        common::router::PATIENCE,
    )
    .await
    .unwrap();
    assert_eq!(status, 503);
    // The held exchange ends: its slot is free for the next pick.
    drop(held);
    eventually("a pick once the slot is freed", || async {
        let mut x = open(epp).await;
        let body = json!({"model": "mock", "prompt": "again", "max_tokens": 4}).to_string();
        x.send.send(headers(&h, false)).await.unwrap();
        x.send.send(request_body(body.into_bytes())).await.unwrap();
        let first = x.answers.message().await.unwrap().expect("an answer");
        matches!(first.response, Some(Response::RequestHeaders(_)))
    })
    .await;
}

/// The picker's port has `--max-connections` of its own, as the front door does: a
/// connection past them is refused (and counted), and a freed slot takes the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_bound_are_refused_on_the_pickers_port() {
    let (_a, a) = mock_worker(&[]).await;
    let (_r, router, epp) = picker(&[&a], &["--max-connections", "1"]).await;
    let mut held = open(epp).await;
    pick(&mut held, "the one connection").await;
    let refused = try_open(epp).await;
    assert!(refused.is_err(), "a second connection was served");
    let c = common::http::client();
    assert!(metric(&c, &router, "switchyard_refused_connections_total", "").await >= 1.0);
    drop(held);
    eventually("a freed slot to take the next connection", || async {
        match try_open(epp).await {
            Ok(mut x) => {
                pick(&mut x, "the next connection").await;
                true
            }
            Err(_) => false,
        }
    })
    .await;
}

/// One connection carries at most `MAX_STREAMS_PER_CONNECTION` exchanges at once: a
/// peer opening more waits for one to end (HTTP/2's own limit, which clients honour)
/// instead of the picker taking on thousands of tasks for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_carries_a_bounded_number_of_exchanges() {
    use switchyard::http::epp::MAX_STREAMS_PER_CONNECTION;
    let (_a, a) = mock_worker(&[]).await;
    let (_r, _router, epp) = picker(&[&a], &[]).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{epp}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let exchange = |channel: tonic::transport::Channel| async move {
        let (send, rx) = mpsc::channel(1);
        let answers = ExternalProcessorClient::new(channel)
            .process(ReceiverStream::new(rx))
            .await
            .map(tonic::Response::into_inner);
        (send, answers)
    };
    let mut open = Vec::new();
    for _ in 0..MAX_STREAMS_PER_CONNECTION {
        let (send, answers) = exchange(channel.clone()).await;
        open.push((send, answers.expect("an exchange within the bound")));
    }
    let past = tokio::spawn(exchange(channel.clone()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!past.is_finished(), "an exchange past the bound was taken");
    // One ends (its request stream closed): the waiting one is taken.
    let (send, answers) = open.pop().unwrap();
    drop(send);
    drop(answers);
    let (_send, answers) = tokio::time::timeout(Duration::from_secs(30), past)
        .await
        .expect("taken once a stream ended")
        .unwrap();
    answers.expect("an exchange");
}

/// Messages the picker is still receiving count in the front door's budget of bodies
/// held (`--max-body-bytes-total`): tonic gathers a message whole before the exchange
/// sees it, so streams that each send most of a large message and stop would otherwise
/// hold that memory past every bound (and a stream past the budget is ended). Five
/// streams holding 768 KiB each of a budget 1,000 bytes larger leave no room for a
/// 2 KiB body at the front door (503); once they end, it is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_messages_on_the_pickers_port_are_held_within_the_body_budget() {
    use bytes::Bytes;
    use http_body_util::StreamBody;
    use hyper::body::Frame;
    type Chunks = StreamBody<ReceiverStream<Result<Frame<Bytes>, std::convert::Infallible>>>;
    let (_a, a) = mock_worker(&[]).await;
    // What the five streams will hold, and room for 1,000 bytes more.
    let sent: usize = 5 * (5 + (768 << 10));
    let budget = (sent + 1000).to_string();
    let (_r, router, epp) = picker(&[&a], &["--max-body-bytes-total", &budget]).await;
    let c = common::http::client();
    let big =
        json!({"model": "mock", "prompt": "hi", "max_tokens": 2, "user": "u".repeat(2 << 10)})
            .to_string();
    let front = |c: common::http::HttpClient, body: String, url: String| async move {
        common::http::send(
            &c,
            hyper::Method::POST,
            &format!("{url}/v1/completions"),
            &[("content-type", "application/json")],
            body,
            Duration::from_secs(30),
        )
        .await
        .unwrap()
        .0
    };
    assert_eq!(front(c.clone(), big.clone(), router.clone()).await, 200);

    let h2: hyper_util::client::legacy::Client<_, Chunks> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build_http();
    let mut streams = Vec::new();
    for _ in 0..5 {
        let (tx, rx) = mpsc::channel(32);
        let req = hyper::Request::post(format!(
            "http://127.0.0.1:{epp}/envoy.service.ext_proc.v3.ExternalProcessor/Process"
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(StreamBody::new(ReceiverStream::new(rx)))
        .unwrap();
        let answer = tokio::spawn(h2.request(req));
        // A message of 1 MiB announced, 768 KiB of it sent, the rest never.
        let mut header = vec![0u8];
        header.extend_from_slice(&(1u32 << 20).to_be_bytes());
        tx.send(Ok(Frame::data(Bytes::from(header)))).await.unwrap();
        for _ in 0..12 {
            let chunk = Bytes::from(vec![7u8; 64 << 10]);
            tx.send(Ok(Frame::data(chunk))).await.unwrap();
        }
        streams.push((tx, answer));
    }
    // Every byte sent is received and held (the gauge of bodies held says so)...
    eventually("the picker to hold the partial messages", || async {
        metric(&c, &router, "switchyard_request_body_bytes_held", "").await >= sent as f64
    })
    .await;
    // ... so the front door has no room for a body the budget would take otherwise.
    assert_eq!(front(c.clone(), big.clone(), router.clone()).await, 503);
    drop(streams);
    eventually("the budget given back once the streams end", || {
        let (c, big, url) = (c.clone(), big.clone(), router.clone());
        async move { front(c, big, url).await == 200 }
    })
    .await;
}
