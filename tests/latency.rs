//! Predicted latency, end to end: real mock-worker processes (their engines report their
//! inter-token latency on `/metrics`, as vLLM's do), a real router process, real HTTP.
//! Each worker's latency model learns from every kind of answer — whole (non-streamed)
//! ones, streams, both legs of a split — and the default overload signal it feeds holds
//! requests only past the fleet's capacity; a request's own latency objectives place it
//! where they would be met, or refuse it with `Retry-After` when no worker would.

mod common;

use serde_json::{Value, json};

use common::http::{self, HttpClient};
use common::procs::{Proc, mock_worker, serve};
use common::queue::{post, sized_prompt};
use common::router::{TOKEN, eventually, instance, metric};

/// A completion of a prompt of a few hundred tokens.
fn completion(tag: &str, max_tokens: u32, stream: bool) -> Value {
    sized(tag, 1500, max_tokens, stream)
}

fn sized(tag: &str, chars: usize, max_tokens: u32, stream: bool) -> Value {
    json!({"model": "mock", "prompt": sized_prompt(tag, chars), "max_tokens": max_tokens, "stream": stream})
}

/// Sends `each` requests from each of `clients` concurrent clients; every status.
async fn load(url: &str, clients: usize, each: usize, body: impl Fn(usize) -> Value) -> Vec<u16> {
    let mut tasks = Vec::new();
    for k in 0..clients {
        let url = url.to_string();
        let bodies: Vec<Value> = (0..each).map(|i| body(k * each + i)).collect();
        tasks.push(tokio::spawn(async move {
            let c = http::client();
            let mut statuses = Vec::new();
            for b in bodies {
                statuses.push(post(&c, &url, b.to_string(), &[]).await.0.as_u16());
            }
            statuses
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

/// A worker's latency model, as the admin API shows it.
async fn model(c: &HttpClient, url: &str, worker: &str) -> Value {
    instance(c, url, worker).await["latency_model"].clone()
}

/// A decode step of 20 ms at ten times the speed: an answer of 100 tokens takes ~0.2 s,
/// its prefill a few milliseconds.
const STAGE: &[&str] = &["--speedup", "10", "--decode-base-us", "20000"];

/// The default signal's second on the stage's clock (ten times the speed), and the
/// engines' pages read every 100 ms.
const ROUTER: &[&str] = &["--saturation-wait-ms", "100", "--engine-metrics-ms", "100"];

/// Whole answers' first byte is their end, not their first token. Taken for one, a
/// worker's "prefill" lasted its answers' whole duration, every worker past the wait
/// with two answers running, and requests queued in the router with the fleet far
/// below its capacity. Their first tokens are inferred instead (their duration less
/// their tokens at the engine's reported inter-token latency), and nothing waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_answers_below_capacity_wait_in_no_queue_and_teach_the_model() {
    let (fleet, _router, url) = pair(&["--max-num-seqs", "8"], &[]).await;
    let c = http::client();
    // Until both workers' models know their first tokens (TPOT from the engines' pages,
    // then TTFT inferred from whole answers): two clients.
    let mut round = 0;
    eventually("both workers' models to learn from whole answers", || {
        round += 1;
        let (c, url, fleet) = (&c, &url, &fleet);
        async move {
            let statuses = load(url, 2, 2, |i| {
                completion(&format!("warm {round} {i}"), 100, false)
            })
            .await;
            assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
            let mut known = true;
            for (_, w) in fleet {
                known &= model(c, url, w).await["samples"]["ttft"].as_u64() > Some(0);
            }
            known
        }
    })
    .await;
    // Six clients on two workers of eight slots: below capacity.
    let statuses = load(&url, 6, 4, |i| completion(&format!("load {i}"), 100, false)).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let queued = metric(&c, &url, "switchyard_queued_requests_total", "").await;
    assert_eq!(queued, 0.0, "requests waited in the router below capacity");
    for (_, w) in &fleet {
        let m = model(&c, &url, w).await;
        let per_1k = m["ttft_ms_per_1k_tokens"].as_f64();
        let per_request = m["ttft_ms_per_request"].as_f64().unwrap();
        // The prefill of a few hundred tokens is milliseconds; the answers took ~200.
        assert!(
            per_request < 100.0 && per_1k.is_none_or(|t| t < 100.0),
            "the model took answers for prefills: {m}"
        );
        assert!(m["error"]["e2e"]["predictions"].as_u64() > Some(0), "{m}");
        // The view shows the latest predictions beside what happened.
        let recent = m["recent"].as_array().unwrap();
        let last = recent.last().expect("predictions beside what happened");
        assert_eq!(last["of"], "e2e", "{last}");
        assert!(last["observed_ms"].as_f64() > Some(100.0), "{last}");
        assert!(last["predicted_ms"].is_number(), "{last}");
    }
    assert!(
        metric(
            &c,
            &url,
            "switchyard_predictions_compared_total",
            "of=\"e2e\""
        )
        .await
            > 0.0,
        "the predictions compared are exported"
    );
    let error = metric(&c, &url, "switchyard_prediction_error_total", "of=\"e2e\"").await;
    assert!(
        error.is_finite() && error >= 0.0,
        "the prediction error is exported"
    );
}

/// A decode-bound fleet past its engines' batches, the expected wait off: the engines
/// report their full batches and queues, and the router holds what they would queue,
/// where class and tenant order it; with the signal off too, the engines queue it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_answers_past_the_engines_batches_wait_in_the_router_not_in_the_engines() {
    for (extra, held) in [
        (&[][..], true),
        (&["--saturation-batch-full", "false"][..], false),
    ] {
        let flags = [
            &["--saturation-wait-ms", "0", "--engine-metrics-ms", "100"][..],
            extra,
        ]
        .concat();
        // Two workers of two slots each, eight clients.
        let (_fleet, _router, url) = pair_with(&["--max-num-seqs", "2"], &flags).await;
        let c = http::client();
        let statuses = load(&url, 8, 4, |i| {
            completion(&format!("flood {i}"), 100, false)
        })
        .await;
        assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
        let queued = metric(&c, &url, "switchyard_queued_requests_total", "").await;
        if held {
            assert!(
                queued > 0.0,
                "nothing waited in the router past the batches"
            );
        } else {
            assert_eq!(queued, 0.0, "the signal turned off still held requests");
        }
    }
}

/// Mock workers of a split fleet (vLLM's handoff) on the stage, prefill first.
async fn split_fleet(prefill_extra: &[&str]) -> (Vec<Proc>, Vec<String>, Vec<String>) {
    let mut procs = Vec::new();
    let (mut urls, mut specs) = (Vec::new(), Vec::new());
    for (role, extra) in [("prefill", prefill_extra), ("decode", &[][..])] {
        let mut args = vec!["--role", role, "--pd-protocol", "vllm"];
        args.extend_from_slice(STAGE);
        args.extend_from_slice(extra);
        let (p, url) = mock_worker(&args).await;
        specs.push(format!("{url}#role={role}"));
        urls.push(url);
        procs.push(p);
    }
    (procs, urls, specs)
}

/// A split fleet's prefill workers answer only once the prompt is computed, and their
/// answer is their first token: the prefill worker learns from it (it never did, so the
/// expected wait never held a split fleet), the decode worker from its first token
/// after the handoff. A burst past the prefill worker's capacity then waits in the
/// router, and every request is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_fleet_learns_from_both_legs_and_holds_a_burst_past_capacity() {
    // A slow prefill: 2 ms a token at ten times the speed, ~75 ms a prompt.
    let (_procs, urls, specs) = split_fleet(&["--prefill-us-per-token", "2000"]).await;
    let mut args = vec!["--model", "mock", "--admin-token", TOKEN];
    for s in &specs {
        args.extend(["--worker", s.as_str()]);
    }
    args.extend_from_slice(ROUTER);
    args.extend(["--policy-config", r#"{"max_local_prefill_tokens": 0}"#]);
    let (_router, url) = serve(&args).await;
    let c = http::client();
    for i in 0..10 {
        let body = completion(&format!("warm {i}"), 8, i % 2 == 0);
        let (status, _, text) = post(&c, &url, body.to_string(), &[]).await;
        assert!(status.is_success(), "{status}: {text}");
    }
    let (prefill, decode) = (
        model(&c, &url, &urls[0]).await,
        model(&c, &url, &urls[1]).await,
    );
    assert!(
        prefill["samples"]["ttft"].as_u64() >= Some(8)
            && prefill["ttft_ms_per_request"].is_number(),
        "the prefill worker learned nothing from its legs: {prefill}"
    );
    assert!(
        decode["samples"]["ttft"].as_u64() >= Some(4),
        "the decode worker learned nothing of its first tokens: {decode}"
    );
    let wait = instance(&c, &url, &urls[0]).await["expected_wait_ms"].clone();
    assert!(
        wait.is_u64(),
        "no expected wait on the prefill worker: {wait}"
    );
    // Twelve requests at once: ~0.9 s of prefill for one worker, past the 100 ms.
    let statuses = load(&url, 12, 1, |i| completion(&format!("burst {i}"), 8, false)).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let queued = metric(&c, &url, "switchyard_queued_requests_total", "").await;
    assert!(
        queued > 0.0,
        "the split fleet's burst never waited in the router"
    );
}

/// A router (with `extra` flags) in front of two stage workers (with `worker` flags).
async fn pair(worker: &[&str], extra: &[&str]) -> (Vec<(Proc, String)>, Proc, String) {
    pair_with(worker, &[ROUTER, extra].concat()).await
}

/// A router with `flags` alone (not [`ROUTER`]'s) in front of two stage workers.
async fn pair_with(worker: &[&str], flags: &[&str]) -> (Vec<(Proc, String)>, Proc, String) {
    let mut fleet = Vec::new();
    for _ in 0..2 {
        let mut args = STAGE.to_vec();
        args.extend_from_slice(worker);
        fleet.push(mock_worker(&args).await);
    }
    let mut args = vec!["--model", "mock", "--admin-token", TOKEN];
    for (_, w) in &fleet {
        args.extend(["--worker", w.as_str()]);
    }
    args.extend_from_slice(flags);
    let (router, url) = serve(&args).await;
    (fleet, router, url)
}

/// Streams of several prompt sizes until both workers' models predict a first token.
async fn warm(c: &HttpClient, url: &str, fleet: &[(Proc, String)]) {
    let mut round = 0;
    eventually("both workers' models to learn", || {
        round += 1;
        async move {
            load(url, 2, 2, |i| {
                sized(&format!("warm {round} {i}"), 400 + 800 * i, 8, true)
            })
            .await;
            let mut known = true;
            for (_, w) in fleet {
                known &= model(c, url, w).await["ttft_ms_per_request"].is_number();
            }
            known
        }
    })
    .await;
}

/// A request carries its own objectives (`x-slo-ttft-ms`, as llm-d's clients send them,
/// or its class's): with every worker busy past it, it is refused at once with 429 and a
/// `Retry-After`, and the refusal is counted; one no worker could meet even idle is served
/// as best it can be; a malformed one is the client's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_no_worker_would_serve_within_its_objective_is_refused_with_retry_after() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("switchyard.toml");
    std::fs::write(
        &config,
        "[[classes]]\nname = \"interactive\"\nrank = 3\ndeadline_ms = 1000\nttft_ms = 150\n",
    )
    .unwrap();
    // A slow prefill: 2 ms a token at ten times the speed.
    let slow = ["--prefill-us-per-token", "2000"];
    let (fleet, _router, url) = pair(&slow, &["--config", config.to_str().unwrap()]).await;
    let c = http::client();
    warm(&c, &url, &fleet).await;
    let (status, _, text) = post(
        &c,
        &url,
        sized("idle", 200, 4, false).to_string(),
        &[("x-slo-ttft-ms", "500")],
    )
    .await;
    assert!(
        status.is_success(),
        "an objective met while idle: {status} {text}"
    );
    // Eight long prompts at once (~0.6 s of prefill each): every worker has seconds of
    // prefill ahead of a new request.
    let busy: Vec<_> = (0..8)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move {
                let body = sized(&format!("long {i}"), 12_000, 4, true);
                post(&http::client(), &url, body.to_string(), &[]).await.0
            })
        })
        .collect();
    eventually("every worker to be predicted past 150 ms", || async {
        let mut past = true;
        for (_, w) in &fleet {
            past &= instance(&c, &url, w).await["expected_wait_ms"].as_u64() > Some(150);
        }
        past
    })
    .await;
    for headers in [
        &[("x-slo-ttft-ms", "150")][..],
        &[("x-switchyard-priority", "interactive")][..],
    ] {
        let (status, h, text) =
            post(&c, &url, sized("hurry", 200, 4, false).to_string(), headers).await;
        assert_eq!(
            status,
            hyper::StatusCode::TOO_MANY_REQUESTS,
            "{headers:?}: {text}"
        );
        assert!(
            text.to_string().contains("objectives_unmet")
                && text.to_string().contains("time to first token"),
            "{text}"
        );
        let after: u64 = h["retry-after"].to_str().unwrap().parse().unwrap();
        assert!((1..=60).contains(&after), "Retry-After {after}");
    }
    assert_eq!(
        metric(
            &c,
            &url,
            "switchyard_unrouted_requests_total",
            "kind=\"objectives\""
        )
        .await,
        2.0
    );
    // A microsecond is met by no worker even idle: not held against the load.
    let (status, _, text) = post(
        &c,
        &url,
        completion("hopeless", 4, false).to_string(),
        &[("x-slo-ttft-ms", "1")],
    )
    .await;
    assert!(
        status.is_success(),
        "an unattainable objective is served: {status} {text}"
    );
    let (status, _, text) = post(
        &c,
        &url,
        completion("bad", 4, false).to_string(),
        &[("x-slo-ttft-ms", "soon")],
    )
    .await;
    assert_eq!(status, hyper::StatusCode::BAD_REQUEST, "{text}");
    assert!(text.to_string().contains("x-slo-ttft-ms"), "{text}");
    for b in busy {
        assert!(b.await.unwrap().is_success());
    }
}
