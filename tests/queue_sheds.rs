//! Who gives way in a full queue, end to end (a real mock worker that runs one request at
//! a time, a real router process): a request of no configured tenant takes free places
//! only, whatever its class; and a newcomer that would not fit even after the requests
//! that may give way to it have gone takes none of their places.

mod common;

use common::http;
use common::queue::*;

/// A worker that runs one request at a time, kept busy, behind a router (with `extra`
/// flags and the configuration `toml`) that holds everything else in its queue.
async fn busy_fleet(
    toml: &str,
    extra: &[&str],
) -> (
    Vec<(common::procs::Proc, String)>,
    common::procs::Proc,
    String,
    tempfile::TempDir,
    Pending,
) {
    let fleet = workers(&["1"]).await;
    let (dir, config) = config_file(toml);
    let mut args = vec!["--saturation-max-in-flight", "1", "--config", &config];
    args.extend_from_slice(extra);
    let (r, url) = router(&fleet, &args).await;
    let c = http::client();
    let busy = spawn_post(&url, body("the running one", 300), vec![]);
    common::router::eventually("the worker to run the request", || async {
        stats(&c, &fleet[0].1).await["running"] == 1
    })
    .await;
    (fleet, r, url, dir, busy)
}

/// A configured tenant's batch jobs fill the queue; a flood of requests of no configured
/// tenant, of a more urgent class, sheds none of them: each is refused with 503
/// `fleet_full`, and the tenant's jobs are all served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anonymous_flood_sheds_no_configured_tenants_queued_request() {
    let tenants = "[[tenants]]\nname = \"batchco\"\nclass = \"low\"\n";
    let (_fleet, _r, url, _dir, busy) = busy_fleet(tenants, &["--queue-max", "4"]).await;
    let c = http::client();
    let mut jobs = Vec::new();
    for i in 0..4 {
        let h = vec![("x-switchyard-tenant", "batchco".to_string())];
        jobs.push(enqueue(&c, &url, body(&format!("nightly job {i}"), 20), h).await);
    }
    for i in 0..10 {
        let r = post(&c, &url, body(&format!("anonymous {i}"), 4), &[]).await;
        let (status, retry_after, code) = refusal(&r);
        assert_eq!((status, code.as_str()), (503, "fleet_full"), "{:?}", r.2);
        assert!(retry_after);
    }
    for j in jobs {
        let (status, _, answer, _) = j.await.unwrap();
        assert!(
            status.is_success(),
            "a queued job was shed: {status} {answer}"
        );
    }
    assert!(busy.await.unwrap().0.is_success());
}

/// A full queue's bytes: two batch jobs and two of a tenant's own requests. A newcomer
/// of that tenant whose body would not fit even with both batch jobs gone is refused,
/// and the batch jobs keep their places (they are served, not shed for nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_gives_no_place_away_for_a_request_it_then_refuses() {
    let tenants = "[[tenants]]\nname = \"batchco\"\nclass = \"low\"\n\n[[tenants]]\nname = \"app\"\nmax_class = \"high\"\n";
    let extra = ["--queue-max", "64", "--queue-max-bytes", "6000"];
    let (_fleet, _r, url, _dir, busy) = busy_fleet(tenants, &extra).await;
    let c = http::client();
    // ~1,300 bytes each: four of them fill 6,000 bytes but for ~800.
    let sized = |tag: &str| body(&format!("{tag} {}", "x".repeat(1200)), 4);
    let mut waiting = Vec::new();
    for (tenant, class) in [
        ("batchco", "low"),
        ("batchco", "low"),
        ("app", "high"),
        ("app", "high"),
    ] {
        let h = vec![
            ("x-switchyard-tenant", tenant.to_string()),
            ("x-switchyard-priority", class.to_string()),
        ];
        waiting.push(enqueue(&c, &url, sized(tenant), h).await);
    }
    // 4,000 bytes: with both batch jobs gone, 2,600 + 4,000 still pass 6,000.
    let big = body(&format!("big {}", "y".repeat(4000)), 4);
    let headers = [
        ("x-switchyard-tenant", "app"),
        ("x-switchyard-priority", "high"),
    ];
    let r = post(&c, &url, big, &headers).await;
    assert_eq!(refusal(&r).0, 503, "{:?}", r.2);
    assert!(
        (queued(&c, &url).await - 4.0).abs() < f64::EPSILON,
        "the queue gave places away for a request it refused"
    );
    for w in waiting {
        let (status, _, answer, _) = w.await.unwrap();
        assert!(status.is_success(), "{status} {answer}");
    }
    assert!(busy.await.unwrap().0.is_success());
}
