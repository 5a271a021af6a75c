//! Mid-stream migration, end to end: real mock-worker processes killed, stalled or cut
//! while they stream, a real router process, real HTTP. A migrated stream must read
//! exactly as the same request's uninterrupted stream does (the mock's text is a function
//! of its context), with one identity, one final usage and `[DONE]`.

mod common;

use std::sync::Arc;

use serde_json::{Value, json};

use common::etcd::Etcd;
use common::http;
use common::procs::{mock_worker, serve};
use common::router::{TOKEN, admin_get, eventually, instance, instances, metric};
use common::streams::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_stream_costs_no_stream_its_text() {
    let (mut workers, _router, url) = fleet(&[&[], &[], &[]], &[]).await;
    let c = http::client();
    const STREAMS: usize = 30;
    const TOKENS: u32 = 150;
    let tasks = under_way(&c, &url, STREAMS, TOKENS).await;
    let in_flight_on_the_victim = metric(&c, &url, "switchyard_instance_in_flight", "").await;
    assert!(in_flight_on_the_victim > 0.0);
    workers[0].0.kill();
    let got = finished(tasks).await;
    let migrated = metric(
        &c,
        &url,
        "switchyard_migrations_total",
        "reason=\"reset\",outcome=\"continued\"",
    )
    .await;
    assert!(migrated >= 1.0, "some streams ran on the killed worker");
    assert_eq!(
        metric(&c, &url, "switchyard_migrated_streams_completed_total", "").await,
        migrated
    );
    // The endpoint's decisions say how many placed a continuation.
    let quality = admin_get(
        &c,
        &format!("{url}/admin/endpoints/default/mock/generate/quality"),
    )
    .await;
    assert_eq!(
        quality["continuations"].as_f64(),
        Some(migrated),
        "{quality}"
    );
    // The same requests again, uninterrupted, on the two workers left.
    let want = uninterrupted(&c, &url, STREAMS, TOKENS).await;
    assert_reads_as(&got, &want);
    for got in &got {
        assert_eq!(got.usage.map(|u| u.1), Some(u64::from(TOKENS)));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_stalls_mid_stream_is_left_after_the_idle_timeout() {
    let stall: &[&str] = &["--fault", "stall", "--fault-after-tokens", "10"];
    let (_workers, _router, url) = fleet(
        &[stall, &[]],
        &["--stream-idle-timeout-secs", "1", "--policy", "round-robin"],
    )
    .await;
    let c = http::client();
    // Two at once, taking turns: one lands on the stalling worker.
    let mut tasks = Vec::new();
    for i in 0..2 {
        let (c, url) = (c.clone(), url.clone());
        let (path, body) = request(i, 40);
        tasks.push(tokio::spawn(async move {
            stream(&c, &url, path, &body, 0, Arc::default()).await
        }));
    }
    let mut got = Vec::new();
    for t in tasks {
        got.push(read(&t.await.unwrap()));
    }
    assert_eq!(
        metric(
            &c,
            &url,
            "switchyard_migrations_total",
            "reason=\"stall\",outcome=\"continued\""
        )
        .await,
        1.0
    );
    // The stalling worker is out (stalls count against it at once); the healthy one
    // gives the reference.
    let want = uninterrupted(&c, &url, 2, 40).await;
    assert_reads_as(&got, &want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_breaks_every_worker_stops_after_two_and_ejects_no_one() {
    let poison: &[&str] = &[
        "--fault-marker",
        "POISON",
        "--fault-marker-after-tokens",
        "5",
    ];
    let (_workers, _router, url) =
        fleet(&[poison, poison, poison], &["--migration-limit", "5"]).await;
    let c = http::client();
    let body = json!({"model": "mock", "messages": [{"role": "user", "content": "POISON pill"}],
        "max_tokens": 40, "stream": true});
    let got = read(&stream(&c, &url, "/v1/chat/completions", &body, 0, Arc::default()).await);
    assert_eq!(got.errors.len(), 1, "{got:?}");
    assert!(
        got.errors[0].contains("the request's own fault"),
        "{}",
        got.errors[0]
    );
    assert!(!got.done);
    assert_eq!(
        metric(
            &c,
            &url,
            "switchyard_migrations_total",
            "reason=\"reset\",outcome=\"poison\""
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(&c, &url, "switchyard_poison_requests_total", "").await,
        1.0
    );
    // Every worker still serves, and nobody was counted against.
    let listed = instances(&c, &url).await;
    for i in listed["instances"].as_array().unwrap() {
        assert_eq!(i["available"], true, "{i}");
        assert_eq!(i["consecutive_failures"], 0, "{i}");
    }
    let ok = read(
        &stream(
            &c,
            &url,
            "/v1/chat/completions",
            &request(0, 20).1,
            0,
            Arc::default(),
        )
        .await,
    );
    assert!(ok.done && ok.errors.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_migration_off_a_broken_stream_ends_with_an_error_event() {
    let cut: &[&str] = &["--fault", "cut-stream", "--fault-after-tokens", "5"];
    let (_workers, _router, url) = fleet(&[cut, cut], &["--migration-limit", "0"]).await;
    let c = http::client();
    let got = read(
        &stream(
            &c,
            &url,
            "/v1/chat/completions",
            &request(0, 40).1,
            0,
            Arc::default(),
        )
        .await,
    );
    assert_eq!(got.errors.len(), 1, "{got:?}");
    assert!(got.errors[0].contains("stream broke"), "{}", got.errors[0]);
    assert!(!got.done);
    assert_eq!(got.tokens, 5, "the five tokens sent before the break");
    assert_eq!(
        metric(&c, &url, "switchyard_migrations_total", "").await,
        0.0
    );
}

/// Sends requests `0..10`, each shaped by `shape`, through a fleet whose first worker
/// cuts its streams, until one lands there: that stream ends with an error event and
/// is not continued.
async fn a_cut_stream_is_not_continued(shape: impl Fn(usize) -> (&'static str, Value)) {
    let cut: &[&str] = &["--fault", "cut-stream", "--fault-after-tokens", "5"];
    let (_workers, _router, url) = fleet(&[cut, &[]], &[]).await;
    let c = http::client();
    for i in 0..10 {
        let (path, body) = shape(i);
        let got = read(&stream(&c, &url, path, &body, 0, Arc::default()).await);
        if !got.errors.is_empty() {
            assert!(!got.done);
            assert_eq!(continued(&c, &url).await, 0.0);
            return;
        }
    }
    panic!("no request reached the cutting worker");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_asking_for_log_probabilities_is_not_continued() {
    a_cut_stream_is_not_continued(|i| {
        let (path, mut body) = request(i, 20);
        body["logprobs"] = if path.contains("chat") {
            json!(true)
        } else {
            json!(1)
        };
        (path, body)
    })
    .await;
}

/// A stream that breaks on a lone worker cannot be continued (no worker is left): no
/// other worker can confirm the break was the worker's, and it counts against it, as a
/// lone 5xx does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_break_nobody_else_can_continue_counts_against_its_worker() {
    let cut: &[&str] = &["--fault", "cut-stream", "--fault-after-tokens", "5"];
    let (workers, _router, url) = fleet(&[cut], &[]).await;
    let c = http::client();
    let (path, body) = request(0, 20);
    let got = read(&stream(&c, &url, path, &body, 0, Arc::default()).await);
    assert!(
        !got.errors.is_empty() && !got.done,
        "the stream ends with an error event"
    );
    let w = instance(&c, &url, &workers[0].1).await;
    assert_eq!(w["consecutive_failures"], 1, "{w}");
}

/// An answer held to a grammar is not continued: the next engine would start the
/// grammar over in mid-answer (a second JSON object after half of the first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_held_to_a_grammar_is_not_continued() {
    a_cut_stream_is_not_continued(|i| {
        let (_, mut body) = request(i, 20);
        body["response_format"] = json!({"type": "json_object"});
        body["messages"] = json!([{"role": "user", "content": format!("give me JSON {i}")}]);
        body.as_object_mut().unwrap().remove("prompt");
        ("/v1/chat/completions", body)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_workers_streams_finish_elsewhere_after_the_drain_grace() {
    let etcd = Etcd::start();
    // The draining worker would go on for half a minute; the router moves its streams
    // after one second.
    let (draining, _) = mock_worker(&["--etcd", &etcd.url(), "--shutdown-grace-secs", "30"]).await;
    let (_stays, _) = mock_worker(&["--etcd", &etcd.url()]).await;
    let (_router, url) = serve(&[
        "--etcd",
        &etcd.url(),
        "--admin-token",
        TOKEN,
        "--policy",
        "round-robin",
        "--drain-grace-secs",
        "1",
    ])
    .await;
    let c = http::client();
    eventually("both workers discovered", || async {
        instances(&c, &url).await["instances"]
            .as_array()
            .is_some_and(|i| i.len() == 2)
    })
    .await;
    const TOKENS: u32 = 400;
    let tasks = under_way(&c, &url, 2, TOKENS).await;
    draining.terminate();
    let got = finished(tasks).await;
    assert_eq!(
        metric(
            &c,
            &url,
            "switchyard_migrations_total",
            "reason=\"drain\",outcome=\"continued\""
        )
        .await,
        1.0
    );
    let want = uninterrupted(&c, &url, 2, TOKENS).await;
    assert_reads_as(&got, &want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_answer_whose_worker_dies_mid_generation_is_run_again_whole() {
    let crash: &[&str] = &["--fault", "crash", "--fault-after-tokens", "5"];
    let (mut workers, _router, url) = fleet(&[crash, &[]], &["--policy", "round-robin"]).await;
    let c = http::client();
    // Until one lands on the worker that dies after five tokens (bounded).
    let mut i = 0;
    while workers[0].0.0.try_wait().unwrap().is_none() {
        assert!(i < 8, "no request reached the crashing worker");
        let body = json!({"model": "mock", "prompt": format!("plain {i}"), "max_tokens": 30});
        let (s, v, raw) = http::post_json(&c, &format!("{url}/v1/completions"), &body).await;
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&raw));
        assert_eq!(v["usage"]["completion_tokens"], 30);
        // The same answer, straight from the worker left.
        let (_, want, _) =
            http::post_json(&c, &format!("{}/v1/completions", workers[1].1), &body).await;
        assert_eq!(v["choices"][0]["text"], want["choices"][0]["text"]);
        i += 1;
        // The crash is seen once the process has exited.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // The closed connection was tried again on the same (dead) worker, then elsewhere.
    assert!(metric(&c, &url, "switchyard_retries_total", "").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continued_chat_is_routed_on_the_prompt_the_engine_renders() {
    let (workers, _router, url) = fleet(&[&[]], &[]).await;
    let c = http::client();
    // The form a migrated chat's continuation takes.
    let body = json!({"model": "mock", "max_tokens": 3, "continue_final_message": true,
        "add_generation_prompt": false,
        "messages": [{"role": "user", "content": "Tell a story"},
                     {"role": "assistant", "content": "Once upon a time there "}]});
    let (status, _, raw) = http::send(
        &c,
        hyper::Method::POST,
        &format!("{url}/admin/endpoints/default/mock/generate/explain"),
        &[("authorization", &common::router::auth())],
        body.to_string(),
        std::time::Duration::from_secs(30),
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&raw));
    let explained: Value = serde_json::from_slice(&raw).unwrap();
    assert_eq!(explained["continuation"], true, "{explained}");
    let (_, answer, _) =
        http::post_json(&c, &format!("{}/v1/chat/completions", workers[0].1), &body).await;
    assert_eq!(
        explained["prompt_tokens"], answer["usage"]["prompt_tokens"],
        "the router counts the tokens the engine renders"
    );
    // The same chat with a generation prompt after the answer is longer.
    let mut closed = body.clone();
    closed
        .as_object_mut()
        .unwrap()
        .remove("continue_final_message");
    closed
        .as_object_mut()
        .unwrap()
        .remove("add_generation_prompt");
    let (_, other, _) = http::post_json(
        &c,
        &format!("{}/v1/chat/completions", workers[0].1),
        &closed,
    )
    .await;
    assert!(other["usage"]["prompt_tokens"].as_u64() > answer["usage"]["prompt_tokens"].as_u64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_workers_streams_move_once_health_checks_eject_it() {
    // The idle timeout is a minute; health checks every 200 ms eject the frozen worker
    // (two failed 2 s probes), and its silent streams move then.
    let (workers, _router, url) = fleet(
        &[&[], &[]],
        &[
            "--policy",
            "round-robin",
            "--health-check-interval-ms",
            "200",
        ],
    )
    .await;
    let c = http::client();
    const TOKENS: u32 = 200;
    let tasks = under_way(&c, &url, 2, TOKENS).await;
    let pid = workers[0].0.0.id().to_string();
    let signal = |sig: &str| {
        std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
    };
    assert!(signal("-STOP").success());
    let got = finished(tasks).await;
    assert!(signal("-CONT").success());
    assert_eq!(
        metric(
            &c,
            &url,
            "switchyard_migrations_total",
            "reason=\"ejected\",outcome=\"continued\""
        )
        .await,
        1.0
    );
    let want = uninterrupted(&c, &workers[1].1, 2, TOKENS).await;
    assert_reads_as(&got, &want);
}
