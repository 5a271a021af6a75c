//! Faults behind a real gateway (Envoy 1.40 in front of Switchyard's endpoint picker,
//! `tests/common/gateway.rs`): a worker killed, failing or shedding load, every request
//! failing everywhere, the picker itself killed. What the gateway's client sees, and
//! what the picker learns from the answers, with the front door's discipline.

mod common;

use serde_json::json;

use common::gateway::*;
use common::http;
use common::procs::mock_worker;
use common::router::{available, eventually, instance, metric};
use common::serve::worker_finished;

/// A worker killed under the gateway: the picker names a fallback after its pick
/// (`--epp-fallbacks 1`), Envoy's override_host policy retries down that list, so the
/// client never sees the dead worker; the picker hears where the answer came from, and
/// the dead worker, probed, leaves the picks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_is_retried_on_the_fallback_then_left_out() {
    if common::gateway::no_envoy() {
        return;
    }
    let mut workers = [mock_worker(&[]).await, mock_worker(&[]).await];
    let urls: Vec<String> = workers.iter().map(|(_, u)| u.clone()).collect();
    let (_router, router, epp) = picker(&[&urls[0], &urls[1]], &["--epp-fallbacks", "1"]).await;
    let pool = [addr(&urls[0]), addr(&urls[1])];
    let spec = Spec {
        pool: Some(&pool),
        ..REFERENCE
    };
    let (_envoy, gateway, _dir) = envoy(epp, &spec).await;
    let c = http::client();
    let turn = |t: &str| json!({"model": "mock", "prompt": conversation(t), "max_tokens": 2});
    let (status, answer) = complete(&c, &gateway, turn("first")).await;
    assert!(status.is_success(), "{status}: {answer}");
    let held = usize::from(worker_finished(&c, &urls[0]).await == 0);
    let other = 1 - held;
    workers[held].0.kill();
    // The conversation's worker is gone: its next turns are answered by the other.
    for t in ["second", "third"] {
        let (status, answer) = complete(&c, &gateway, turn(t)).await;
        assert!(status.is_success(), "{t}: {status} {answer}");
    }
    assert_eq!(worker_finished(&c, &urls[other]).await, 2);
    assert!(metric(&c, &router, "switchyard_epp_moved_total", "").await >= 1.0);
    // Probed and found dead, it leaves the picks; nothing is moved any more.
    let dead = urls[held].clone();
    eventually("the dead worker to leave the picks", || async {
        served(&c, &gateway, 1, "meanwhile").await;
        instance(&c, &router, &dead).await["available"] == false
    })
    .await;
    let moved = metric(&c, &router, "switchyard_epp_moved_total", "").await;
    served(&c, &gateway, 4, "after").await;
    assert_eq!(
        metric(&c, &router, "switchyard_epp_moved_total", "").await,
        moved
    );
    eventually("the bookings to be released", || async {
        metric(&c, &router, "switchyard_instance_in_flight", "").await == 0.0
    })
    .await;
}

/// A worker that answers 500 to everything, behind the gateway: the picker reads each
/// answer's status and the endpoint that served it (Envoy's `upstream.address`), and
/// outlier detection ejects the worker after its run of failures; then every request
/// is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_worker_is_ejected_from_what_the_gateway_reports() {
    if common::gateway::no_envoy() {
        return;
    }
    let (_bad, bad) = mock_worker(&["--fault", "error"]).await;
    let (_good, good) = mock_worker(&[]).await;
    let (_router, router, epp) = picker(&[&bad, &good], &[]).await;
    let pool = [addr(&bad), addr(&good)];
    let spec = Spec {
        pool: Some(&pool),
        ..REFERENCE
    };
    let (_envoy, gateway, _dir) = envoy(epp, &spec).await;
    let c = http::client();
    let failed = std::sync::atomic::AtomicUsize::new(0);
    eventually("the failing worker to be ejected", || async {
        let body = json!({"model": "mock", "prompt": "try", "max_tokens": 2});
        if !complete(&c, &gateway, body).await.0.is_success() {
            failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        instance(&c, &router, &bad).await["available"] == false
    })
    .await;
    assert!(
        failed.into_inner() >= 1,
        "the failing worker was never picked"
    );
    served(&c, &gateway, 6, "after").await;
}

/// The worst case of the answers' feedback: every request fails on every worker (as if
/// every request were poison). The gateway's client hears the workers' own 500s, and
/// outlier detection, fed from what Envoy reports, never ejects more than the endpoint's
/// share (half of two workers: one), so the fleet is never emptied by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_on_every_worker_never_eject_past_the_share() {
    if common::gateway::no_envoy() {
        return;
    }
    let (_a, a) = mock_worker(&["--fault", "error"]).await;
    let (_b, b) = mock_worker(&["--fault", "error"]).await;
    let (_router, router, epp) = picker(&[&a, &b], &[]).await;
    let pool = [addr(&a), addr(&b)];
    let spec = Spec {
        pool: Some(&pool),
        ..REFERENCE
    };
    let (_envoy, gateway, _dir) = envoy(epp, &spec).await;
    let c = http::client();
    for i in 0..20 {
        let body = json!({"model": "mock", "prompt": format!("poison {i}"), "max_tokens": 2});
        let (status, answer) = complete(&c, &gateway, body).await;
        assert_eq!(status, 500, "{i}: not the worker's own answer: {answer}");
    }
    assert!(
        metric(&c, &router, "switchyard_upstream_failures_total", "").await >= 20.0,
        "the failures were not counted"
    );
    assert_eq!(
        available(&c, &router).await,
        1,
        "ejection went past the endpoint's share (or nothing was ejected)"
    );
}

/// A worker shedding load (503 with `Retry-After`) behind the gateway is busy, not
/// dead: after its first refusal it is left alone for its `Retry-After`, every request
/// then goes to the other worker, and it is never ejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_shedding_load_through_the_gateway_is_skipped_not_ejected() {
    if common::gateway::no_envoy() {
        return;
    }
    let (_busy, busy) = mock_worker(&[
        "--fault",
        "status",
        "--fault-status",
        "503",
        "--fault-retry-after-secs",
        "60",
    ])
    .await;
    let (_free, free) = mock_worker(&[]).await;
    let (_router, router, epp) = picker(&[&busy, &free], &["--policy", "round-robin"]).await;
    let pool = [addr(&busy), addr(&free)];
    let spec = Spec {
        pool: Some(&pool),
        ..REFERENCE
    };
    let (_envoy, gateway, _dir) = envoy(epp, &spec).await;
    let c = http::client();
    // Round-robin reaches the shedding worker within two requests.
    let mut refused = 0;
    for i in 0..2 {
        let body = json!({"model": "mock", "prompt": format!("first {i}"), "max_tokens": 2});
        if complete(&c, &gateway, body).await.0 == 503 {
            refused += 1;
        }
    }
    assert_eq!(refused, 1, "the shedding worker was not picked once");
    served(&c, &gateway, 8, "then").await;
    assert_eq!(worker_finished(&c, &free).await, 9);
    let state = instance(&c, &router, &busy).await;
    assert_eq!(
        state["available"], true,
        "a busy worker was ejected: {state}"
    );
}

/// The picker killed: a gateway with `failure_mode_allow: true` fails open to its own
/// balancing over the pool (requests still served), one with `false` fails closed (an
/// error, no request sent anywhere unpicked). Envoy keeps a copy of the body to fail
/// open with only when it buffers it (`BUFFERED`); in full duplex the body is the
/// picker's once a chunk is sent, so there a dead picker fails closed whatever the
/// setting (docs/gateway.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_picker_killed_the_gateway_fails_open_or_closed_as_configured() {
    if common::gateway::no_envoy() {
        return;
    }
    let (_a, a) = mock_worker(&[]).await;
    let (_b, b) = mock_worker(&[]).await;
    let (mut router, _, epp) = picker(&[&a, &b], &[]).await;
    let pool = [addr(&a), addr(&b)];
    let open = Spec {
        pool: Some(&pool),
        fail_open: true,
        body_mode: "BUFFERED",
        ..REFERENCE
    };
    let closed = Spec {
        pool: Some(&pool),
        ..REFERENCE
    };
    let (_e1, open, _d1) = envoy(epp, &open).await;
    let (_e2, closed, _d2) = envoy(epp, &closed).await;
    let c = http::client();
    served(&c, &open, 2, "open").await;
    served(&c, &closed, 2, "closed").await;
    router.kill();
    served(&c, &open, 4, "open, picker gone").await;
    let before = worker_finished(&c, &a).await + worker_finished(&c, &b).await;
    let body = json!({"model": "mock", "prompt": "no picker", "max_tokens": 2});
    let (status, answer) = complete(&c, &closed, body).await;
    assert!(status.is_server_error(), "{status}: {answer}");
    let after = worker_finished(&c, &a).await + worker_finished(&c, &b).await;
    assert_eq!(before, after, "a request went on unpicked");
}
