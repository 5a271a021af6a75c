//! Discovery and the shared Client against a real etcd process.

mod common;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::etcd::Etcd;
use common::health::HealthServer;
use switchyard::client::{
    Availability, Client, ClientConfig, ClientRegistry, HttpHealthCheck, OutlierConfig,
};
use switchyard::discovery::etcd::{EtcdConfig, EtcdDiscovery};
use switchyard::discovery::etcd_api::EtcdApi;
use switchyard::discovery::etcd_register::Registration;
use switchyard::discovery::{EndpointPath, InstanceInfo, InstanceKey, InstanceRecord};
use switchyard::ids::InstanceId;
use tokio::sync::watch;

/// Upper bound for waiting on an event that should come much sooner.
const PATIENCE: Duration = Duration::from_secs(30);

fn config(etcd: &Etcd) -> EtcdConfig {
    EtcdConfig {
        timeout: Duration::from_secs(1),
        backoff_initial: Duration::from_millis(100),
        backoff_max: Duration::from_secs(1),
        ..EtcdConfig::new(vec![etcd.url()])
    }
}

fn registry(etcd: &Etcd) -> ClientRegistry {
    ClientRegistry::new(
        Arc::new(EtcdDiscovery::new(config(etcd))),
        Arc::new(HttpHealthCheck::new(Duration::from_secs(1))),
        client_config(),
    )
}

fn client_config() -> ClientConfig {
    ClientConfig {
        probe_initial: Duration::from_millis(100),
        probe_max: Duration::from_millis(400),
        // Discovery is what these tests watch: no active health checks, and the first
        // probe 100 ms after an ejection.
        outlier: OutlierConfig {
            base_ejection: Duration::from_millis(100),
            health_interval: None,
            ..OutlierConfig::default()
        },
    }
}

fn endpoint() -> EndpointPath {
    EndpointPath::for_model("test-model")
}

fn info(id: u64, url: &str) -> InstanceInfo {
    InstanceInfo {
        registration: 0,
        ..InstanceInfo::new(InstanceId(id), endpoint(), url, "test-model", 16)
    }
}

async fn bounded<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(PATIENCE, f)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

async fn wait_available(rx: &mut watch::Receiver<Arc<[InstanceId]>>, want: &[u64], what: &str) {
    let want: Vec<InstanceId> = want.iter().map(|&i| InstanceId(i)).collect();
    bounded(what, rx.wait_for(|a| **a == *want)).await.unwrap();
}

fn api(etcd: &Etcd) -> EtcdApi {
    EtcdApi::new(&[etcd.url()], Duration::from_secs(5))
}

async fn put_record(etcd: &Etcd, info: &InstanceInfo) {
    let key = InstanceKey {
        root: "switchyard".into(),
        endpoint: info.endpoint.clone(),
        id: info.id,
    };
    api(etcd)
        .put(
            &key.to_string(),
            serde_json::to_string(&InstanceRecord::from_info(info))
                .unwrap()
                .as_bytes(),
            None,
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_instance_appears_and_a_graceful_stop_removes_it_at_once() {
    let etcd = Etcd::start();
    let registry = registry(&etcd);
    let client = registry.client(&endpoint());
    assert!(
        Arc::ptr_eq(&client, &registry.client(&endpoint())),
        "one Client per endpoint"
    );
    let mut rx = client.subscribe();

    // A long TTL: only the revoke on a graceful stop can remove it within PATIENCE.
    let mut reg = Registration::start(
        config(&etcd),
        &info(0xa1, "http://127.0.0.1:9"),
        Duration::from_secs(60),
    );
    reg.wait_registered(PATIENCE).await.unwrap();
    wait_available(&mut rx, &[0xa1], "the registration").await;
    let seen = client.instance(InstanceId(0xa1)).unwrap();
    assert_eq!(seen.url, "http://127.0.0.1:9");
    assert_eq!(seen.model, "test-model");

    reg.stop().await;
    wait_available(&mut rx, &[], "the deregistration").await;
    assert!(client.snapshot().instances.is_empty());
}

fn switchyard(args: &[&str]) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard"));
    cmd.args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    cmd
}

/// A keep-alive that fails (etcd frozen past one call's timeout) is retried on the same
/// lease: the registration keeps its lease, which routers read as the same registration,
/// instead of registering anew (which would re-admit an ejected worker unprobed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_keep_alive_keeps_the_same_lease() {
    let etcd = Etcd::start();
    // TTL 6 s: keep-alives every 2 s, each call given 1 s.
    let mut reg = Registration::start(
        config(&etcd),
        &info(0xc1, "http://127.0.0.1:9"),
        Duration::from_secs(6),
    );
    let lease = reg.wait_registered(PATIENCE).await.unwrap();
    // Frozen over the first keep-alive (due at 2 s, timed out at 3 s), not past the TTL.
    etcd.signal("STOP");
    tokio::time::sleep(Duration::from_millis(3500)).await;
    etcd.signal("CONT");
    // The lease is renewed: its time to live is back near the full 6 s.
    let time_to_live = || async {
        let v = api(&etcd)
            .call(
                "/v3/lease/timetolive",
                serde_json::json!({"ID": lease.to_string()}),
            )
            .await
            .unwrap();
        v["TTL"]
            .as_str()
            .and_then(|t| t.parse::<i64>().ok())
            .unwrap_or(-1)
    };
    let deadline = std::time::Instant::now() + PATIENCE;
    while time_to_live().await < 5 {
        assert!(
            std::time::Instant::now() < deadline,
            "the lease was never renewed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        reg.lease(),
        Some(lease),
        "registered again under a new lease"
    );
    let (kvs, _) = api(&etcd)
        .range_prefix("switchyard/instances/")
        .await
        .unwrap();
    assert_eq!(kvs.len(), 1);
    assert_eq!(kvs[0].lease, lease);
    reg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_register_process_expires_with_its_lease_and_a_stopped_one_leaves_at_once() {
    let etcd = Etcd::start();
    let registry = registry(&etcd);
    let client = registry.client(&endpoint());
    let mut rx = client.subscribe();
    let url = etcd.url();

    let mut crashing = switchyard(&[
        "register",
        "--etcd",
        &url,
        "--url",
        "http://127.0.0.1:9",
        "--model",
        "test-model",
        "--ttl",
        "2",
        "--instance-id",
        "b1",
    ])
    .spawn()
    .unwrap();
    let mut stopping = switchyard(&[
        "register",
        "--etcd",
        &url,
        "--url",
        "http://127.0.0.1:10",
        "--model",
        "test-model",
        "--ttl",
        "60",
        "--instance-id",
        "b2",
    ])
    .spawn()
    .unwrap();
    wait_available(&mut rx, &[0xb1, 0xb2], "both registrations").await;

    // `switchyard instances` lists them.
    let out = switchyard(&["instances", "--etcd", &url]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        text.contains("b1") && text.contains("b2") && text.contains("2 instance(s)"),
        "{text}"
    );

    // SIGKILL: nothing revokes the lease; it expires after its 2 s TTL.
    crashing.kill().unwrap();
    crashing.wait().unwrap();
    wait_available(&mut rx, &[0xb2], "the crashed registration to expire").await;

    // SIGTERM: the lease (60 s TTL) is revoked at once.
    let status = std::process::Command::new("kill")
        .args(["-TERM", &stopping.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let mut stdout = String::new();
    use std::io::Read;
    stopping
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    assert!(stopping.wait().unwrap().success());
    assert!(stdout.contains("deregistered"), "{stdout}");
    wait_available(&mut rx, &[], "the stopped registration to leave").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reported_down_instance_returns_after_its_health_endpoint_answers_and_not_before() {
    let etcd = Etcd::start();
    let health = HealthServer::start().await;
    let registry = registry(&etcd);
    let client = registry.client(&endpoint());
    let mut rx = client.subscribe();
    let mut watchers = vec![client.subscribe(), client.subscribe()];

    put_record(&etcd, &info(1, &health.url())).await;
    put_record(&etcd, &info(2, "http://127.0.0.1:9")).await;
    wait_available(&mut rx, &[1, 2], "both instances").await;

    assert!(client.report_instance_down(InstanceId(1), "connection refused"));
    // Every receiver sees the smaller set before the caller's next step.
    for w in &mut watchers {
        assert_eq!(**w.borrow_and_update(), [InstanceId(2)]);
    }
    // Discovery still lists it.
    assert!(client.instance(InstanceId(1)).is_some());

    // The probe hits a 503 several times; the instance stays out.
    bounded("failed probes", async {
        while health.hits.load(Ordering::SeqCst) < 3 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(*client.available(), [InstanceId(2)]);
    match &client.snapshot().instances[&InstanceId(1)].availability {
        Availability::Down {
            reason,
            failed_probes,
            ..
        } => {
            assert_eq!(reason, "connection refused");
            assert!(*failed_probes >= 2);
        }
        other => panic!("{other:?}"),
    }

    health.healthy.store(true, Ordering::SeqCst);
    wait_available(&mut rx, &[1, 2], "re-admission after a healthy probe").await;
    assert_eq!(
        client
            .counters()
            .readmitted_by_probe
            .load(Ordering::Relaxed),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_keeps_its_set_while_etcd_is_down_then_converges() {
    let mut etcd = Etcd::start();
    // Through a proxy that counts connections: the watcher's retries are the event to
    // wait on while etcd is down.
    let proxy = common::etcd::FreezingProxy::start(&etcd.url()).await;
    let registry = ClientRegistry::new(
        Arc::new(EtcdDiscovery::new(EtcdConfig {
            endpoints: vec![proxy.url.clone()],
            ..config(&etcd)
        })),
        Arc::new(HttpHealthCheck::new(Duration::from_secs(1))),
        client_config(),
    );
    let client: Arc<Client> = registry.client(&endpoint());
    let mut rx = client.subscribe();
    put_record(&etcd, &info(1, "http://127.0.0.1:9")).await;
    put_record(&etcd, &info(2, "http://127.0.0.1:10")).await;
    wait_available(&mut rx, &[1, 2], "both instances").await;

    etcd.stop();
    // The watcher notices and retries three times: nothing is lost meanwhile.
    let before = proxy.accepted();
    bounded("three reconnection attempts", async {
        while proxy.accepted() < before + 3 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(*client.available(), [InstanceId(1), InstanceId(2)]);
    assert_eq!(client.snapshot().instances.len(), 2);

    etcd.restart();
    // Changes made while the client was disconnected.
    put_record(&etcd, &info(3, "http://127.0.0.1:11")).await;
    let c = api(&etcd);
    let key1 = InstanceKey {
        root: "switchyard".into(),
        endpoint: endpoint(),
        id: InstanceId(1),
    };
    c.delete(&key1.to_string(), false).await.unwrap();
    wait_available(&mut rx, &[2, 3], "convergence after the restart").await;

    // And the watch is live again.
    put_record(&etcd, &info(4, "http://127.0.0.1:12")).await;
    wait_available(&mut rx, &[2, 3, 4], "a change after reconnecting").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_keys_and_values_are_skipped_and_the_watch_goes_on() {
    let etcd = Etcd::start();
    let prefix = endpoint().etcd_prefix("switchyard");
    let c = api(&etcd);
    // Present at list time.
    c.put(&format!("{prefix}not-hex"), b"{}", None)
        .await
        .unwrap();
    c.put(&format!("{prefix}a"), b"not json", None)
        .await
        .unwrap();
    put_record(&etcd, &info(1, "http://127.0.0.1:9")).await;

    let registry = registry(&etcd);
    let client = registry.client(&endpoint());
    let mut rx = client.subscribe();
    wait_available(&mut rx, &[1], "the valid instance").await;

    // Arriving through the watch.
    let mut wrong_id = InstanceRecord::from_info(&info(2, "http://127.0.0.1:9"));
    wrong_id.instance_id = "ff".into();
    c.put(
        &format!("{prefix}2"),
        serde_json::to_string(&wrong_id).unwrap().as_bytes(),
        None,
    )
    .await
    .unwrap();
    let mut bad_url = InstanceRecord::from_info(&info(3, "ftp://x"));
    bad_url.url = "ftp://x".into();
    c.put(
        &format!("{prefix}3"),
        serde_json::to_string(&bad_url).unwrap().as_bytes(),
        None,
    )
    .await
    .unwrap();
    c.put(&format!("{prefix}zz/extra"), b"{}", None)
        .await
        .unwrap();
    c.delete(&format!("{prefix}not-hex"), false).await.unwrap();
    put_record(&etcd, &info(5, "http://127.0.0.1:9")).await;
    wait_available(&mut rx, &[1, 5], "the next valid instance").await;
    assert_eq!(client.snapshot().instances.len(), 2);
}

/// A watch asked to start at a revision etcd has compacted away is canceled with the
/// compaction's revision: the watch ends with that error (the discovery loop then
/// re-lists, which `the_client_keeps_its_set_while_etcd_is_down_then_converges` covers),
/// and the Client fed by discovery, re-listing, converges on what etcd holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_from_a_compacted_revision_ends_saying_so_and_discovery_relists() {
    let etcd = Etcd::start();
    let api = api(&etcd);
    let mut revision = 0;
    for i in 0..10u64 {
        put_record(&etcd, &info(100 + i, "http://127.0.0.1:9")).await;
        revision = api.range_prefix("switchyard/").await.unwrap().1;
    }
    api.call(
        "/v3/kv/compaction",
        serde_json::json!({"revision": revision.to_string(), "physical": true}),
    )
    .await
    .unwrap();
    let prefix = "switchyard/instances/";
    let mut watch = api.watch_prefix(prefix, &[], revision - 5).await.unwrap();
    let err = bounded("the canceled watch", watch.next())
        .await
        .expect_err("a watch from a compacted revision ends");
    assert!(err.to_string().contains("compacted"), "{err}");
    // Discovery started after the compaction lists, then watches from the listing.
    let registry = registry(&etcd);
    let client = registry.client(&endpoint());
    let mut rx = client.subscribe();
    let all: Vec<u64> = (100..110).collect();
    wait_available(&mut rx, &all, "the instances after the compaction").await;
}

/// A worker's role and bootstrap port travel through etcd as it registered them; a record
/// naming a role that does not exist is skipped like any malformed one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_role_travels_through_etcd() {
    use switchyard::discovery::Role;
    let etcd = Etcd::start();
    let prefill = InstanceInfo {
        role: Role::Prefill,
        bootstrap_port: Some(8998),
        ..info(1, "http://127.0.0.1:9")
    };
    let decode = InstanceInfo {
        role: Role::Decode,
        ..info(2, "http://127.0.0.1:10")
    };
    let mut reg = Registration::start(config(&etcd), &prefill, Duration::from_secs(60));
    bounded("the registration", reg.wait_registered(PATIENCE))
        .await
        .unwrap();
    put_record(&etcd, &decode).await;
    let mut bad = InstanceRecord::from_info(&info(3, "http://127.0.0.1:11"));
    bad.role = Some("verifier".into());
    api(&etcd)
        .put(
            &format!("{}3", endpoint().etcd_prefix("switchyard")),
            serde_json::to_string(&bad).unwrap().as_bytes(),
            None,
        )
        .await
        .unwrap();

    let registry = registry(&etcd);
    let client = registry.client(&endpoint());
    let mut rx = client.subscribe();
    wait_available(&mut rx, &[1, 2], "the two valid workers").await;
    let p = client.instance(InstanceId(1)).unwrap();
    assert_eq!((p.role, p.bootstrap_port), (Role::Prefill, Some(8998)));
    let d = client.instance(InstanceId(2)).unwrap();
    assert_eq!((d.role, d.bootstrap_port), (Role::Decode, None));
    assert!(
        client.instance(InstanceId(3)).is_none(),
        "an unknown role is refused"
    );
    reg.stop().await;
}
