//! Deterministic tests of the availability rules (paused time, scripted health).

use super::*;
use std::sync::atomic::AtomicBool;
use switchyard_discovery::DiscoveryUpdate;
use switchyard_discovery::EndpointPath;

/// A health check whose answer the test sets, counting the probes it answers.
#[derive(Default)]
struct Scripted {
    healthy: AtomicBool,
    probes: AtomicU64,
}

#[async_trait::async_trait]
impl HealthCheck for Scripted {
    async fn check(&self, _: &InstanceInfo) -> Result<(), HealthError> {
        self.probes.fetch_add(1, Ordering::SeqCst);
        if self.healthy.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(HealthError::Unhealthy("503".into()))
        }
    }
}

fn info(id: u64, registration: u64) -> InstanceInfo {
    let url = format!("http://127.0.0.1:{}", 9000 + id);
    InstanceInfo {
        registration,
        ..InstanceInfo::new(InstanceId(id), EndpointPath::for_model("m"), url, "m", 16)
    }
}

fn ids(v: &[u64]) -> Vec<InstanceId> {
    v.iter().map(|&i| InstanceId(i)).collect()
}

/// The rules of the tests below: ejections of any share, no active health checks, a
/// first ejection of 0.5 s, discovery believed at once (the tests that need otherwise
/// say so).
fn config() -> ClientConfig {
    ClientConfig {
        outlier: OutlierConfig {
            max_ejection_share: 1.0,
            panic_threshold: 0.0,
            base_ejection: Duration::from_millis(500),
            health_interval: None,
            discovery_grace: Duration::ZERO,
            ..OutlierConfig::default()
        },
        ..ClientConfig::default()
    }
}

fn client(health: Arc<Scripted>) -> Arc<Client> {
    Client::new(EndpointPath::for_model("m"), config(), health)
}

#[tokio::test(start_paused = true)]
async fn report_down_is_seen_by_every_receiver_before_it_returns() {
    let c = client(Arc::default());
    c.apply(DiscoveryUpdate::Reset(vec![
        info(1, 1),
        info(2, 1),
        info(3, 1),
    ]));
    let receivers: Vec<_> = (0..3).map(|_| c.subscribe()).collect();
    assert!(c.report_instance_down(InstanceId(2), "connection refused"));
    for rx in &receivers {
        assert_eq!(**rx.borrow(), *ids(&[1, 3]));
    }
    assert_eq!(*c.available(), *ids(&[1, 3]));
    // Discovery still lists it, with the reason.
    let snap = c.snapshot();
    match &snap.instances[&InstanceId(2)].availability {
        Availability::Down { reason, .. } => assert_eq!(reason, "connection refused"),
        other => panic!("{other:?}"),
    }
    // A second report changes nothing.
    assert!(!c.report_instance_down(InstanceId(2), "again"));
    assert!(!c.report_instance_down(InstanceId(9), "unknown"));
    assert_eq!(c.counters().reported_down.load(Ordering::Relaxed), 1);
}

#[tokio::test(start_paused = true)]
async fn a_down_instance_returns_only_after_its_health_probe_passes() {
    let health = Arc::new(Scripted::default());
    let c = client(health.clone());
    c.apply(DiscoveryUpdate::Reset(vec![info(1, 1), info(2, 1)]));
    c.report_instance_down(InstanceId(1), "timeout");
    let mut rx = c.subscribe();

    // Backoff 0.5 s, 1 s, 2 s, 4 s: four failed probes in 7.5 s, still down.
    tokio::time::sleep(Duration::from_millis(7600)).await;
    assert_eq!(health.probes.load(Ordering::SeqCst), 4);
    assert_eq!(*c.available(), *ids(&[2]));
    match &c.snapshot().instances[&InstanceId(1)].availability {
        Availability::Down { failed_probes, .. } => assert_eq!(*failed_probes, 4),
        other => panic!("{other:?}"),
    }

    health.healthy.store(true, Ordering::SeqCst);
    rx.wait_for(|a| a.contains(&InstanceId(1))).await.unwrap();
    assert_eq!(*c.available(), *ids(&[1, 2]));
    assert_eq!(health.probes.load(Ordering::SeqCst), 5);
    assert_eq!(c.counters().readmitted_by_probe.load(Ordering::Relaxed), 1);

    // Probing stopped.
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert_eq!(health.probes.load(Ordering::SeqCst), 5);
}

#[tokio::test(start_paused = true)]
async fn a_new_registration_readmits_and_a_relist_does_not() {
    let health = Arc::new(Scripted::default());
    let c = client(health.clone());
    c.apply(DiscoveryUpdate::Reset(vec![info(1, 10), info(2, 10)]));
    c.report_instance_down(InstanceId(1), "refused");

    // A re-list with the same registration keeps it down.
    c.apply(DiscoveryUpdate::Reset(vec![info(1, 10), info(2, 10)]));
    assert_eq!(*c.available(), *ids(&[2]));
    c.apply(DiscoveryUpdate::Insert(info(1, 10)));
    assert_eq!(*c.available(), *ids(&[2]));

    // The worker restarted and registered again: back at once, probing stops.
    c.apply(DiscoveryUpdate::Insert(info(1, 11)));
    assert_eq!(*c.available(), *ids(&[1, 2]));
    assert_eq!(
        c.counters().readmitted_by_discovery.load(Ordering::Relaxed),
        1
    );
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(health.probes.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn removal_by_discovery_leaves_both_sets_and_stops_probing() {
    let health = Arc::new(Scripted::default());
    let c = client(health.clone());
    c.apply(DiscoveryUpdate::Reset(vec![
        info(1, 1),
        info(2, 1),
        info(3, 1),
    ]));
    c.report_instance_down(InstanceId(1), "refused");
    c.apply(DiscoveryUpdate::Remove(InstanceId(1)));
    c.apply(DiscoveryUpdate::Reset(vec![info(2, 1)]));
    let snap = c.snapshot();
    assert_eq!(
        snap.instances.keys().copied().collect::<Vec<_>>(),
        ids(&[2])
    );
    assert_eq!(*snap.available, *ids(&[2]));
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(health.probes.load(Ordering::SeqCst), 0);
    // It can come back later as a new instance.
    c.apply(DiscoveryUpdate::Insert(info(1, 2)));
    assert_eq!(*c.available(), *ids(&[1, 2]));
}

/// The state the rules above define, computed the slow, obvious way.
#[derive(Default, Clone, PartialEq, Debug)]
struct Model {
    /// id -> (registration, available)
    instances: BTreeMap<u64, (u64, bool)>,
}

#[derive(Clone, Debug)]
enum Op {
    Reset(Vec<(u64, u64)>),
    Insert(u64, u64),
    Remove(u64),
    Down(u64),
}

impl Model {
    fn apply(&mut self, op: &Op) {
        let admit = |old: Option<&(u64, bool)>, reg: u64| match old {
            Some(&(r, avail)) if r == reg => (r, avail),
            _ => (reg, true),
        };
        match op {
            Op::Reset(list) => {
                let next = list
                    .iter()
                    .map(|&(id, reg)| (id, admit(self.instances.get(&id), reg)))
                    .collect();
                self.instances = next;
            }
            Op::Insert(id, reg) => {
                let state = admit(self.instances.get(id), *reg);
                self.instances.insert(*id, state);
            }
            Op::Remove(id) => {
                self.instances.remove(id);
            }
            Op::Down(id) => {
                if let Some(s) = self.instances.get_mut(id) {
                    s.1 = false;
                }
            }
        }
    }
}

fn observe(c: &Client) -> Model {
    let snap = c.snapshot();
    Model {
        instances: snap
            .instances
            .iter()
            .map(|(id, s)| {
                (
                    id.0,
                    (
                        s.info.registration,
                        s.availability == Availability::Available,
                    ),
                )
            })
            .collect(),
    }
}

#[test]
fn concurrent_reports_and_updates_never_tear_and_match_a_sequential_model() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let _guard = runtime.enter();
    // Probes never succeed and start late, so only the ops below change the state.
    let health = Arc::new(Scripted::default());
    let c = Client::new(
        EndpointPath::for_model("m"),
        ClientConfig {
            probe_initial: Duration::from_secs(3600),
            probe_max: Duration::from_secs(3600),
            outlier: OutlierConfig {
                base_ejection: Duration::from_secs(3600),
                ..config().outlier
            },
        },
        health,
    );
    let log = Mutex::new(Vec::<(u64, Op)>::new());
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        // Readers: every snapshot is internally consistent, and the watch channel
        // only ever shows a set that some snapshot had.
        for _ in 0..2 {
            s.spawn(|| {
                let rx = c.subscribe();
                while !stop.load(Ordering::Relaxed) {
                    let snap = c.snapshot();
                    let expected: Vec<InstanceId> = snap
                        .instances
                        .iter()
                        .filter(|(_, st)| st.availability == Availability::Available)
                        .map(|(id, _)| *id)
                        .collect();
                    assert_eq!(*snap.available, *expected, "torn snapshot {}", snap.version);
                    let seen = rx.borrow().clone();
                    assert!(seen.windows(2).all(|w| w[0] < w[1]));
                }
            });
        }
        let writers: Vec<_> = (0..4u64)
            .map(|t| {
                let (c, log) = (&c, &log);
                s.spawn(move || {
                    let mut rng = t * 7919 + 1;
                    let mut next = || {
                        rng = rng
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        rng >> 33
                    };
                    for _ in 0..2000 {
                        let op = match next() % 10 {
                            0 => Op::Reset(
                                (0..next() % 8).map(|_| (next() % 12, next() % 3)).collect(),
                            ),
                            1..=3 => Op::Insert(next() % 12, next() % 3),
                            4 => Op::Remove(next() % 12),
                            _ => Op::Down(next() % 12),
                        };
                        // The writer lock orders ops; record each op with the version it
                        // produced (or, for a report that changed nothing, the version
                        // it saw), under the same order.
                        // Every op is one writer step, which produces exactly one new
                        // version: sorting by version recovers the order they took effect.
                        let version = match &op {
                            Op::Reset(list) => c.apply(DiscoveryUpdate::Reset(
                                list.iter().map(|&(id, reg)| info(id, reg)).collect(),
                            )),
                            Op::Insert(id, reg) => {
                                c.apply(DiscoveryUpdate::Insert(info(*id, *reg)))
                            }
                            Op::Remove(id) => c.apply(DiscoveryUpdate::Remove(InstanceId(*id))),
                            Op::Down(id) => {
                                c.eject(InstanceId(*id), "test", DownKind::Unreachable).1
                            }
                        };
                        log.lock().push((version, op));
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
    });
    let mut log = log.into_inner();
    log.sort_by_key(|(version, _)| *version);
    assert_eq!(log.len(), 8000);
    assert!(
        log.windows(2).all(|w| w[0].0 < w[1].0),
        "two ops produced one version"
    );
    let mut model = Model::default();
    for (_, op) in &log {
        model.apply(op);
    }
    assert_eq!(observe(&c), model);
    assert_eq!(c.snapshot().version, 8000);
    let available: Vec<u64> = model
        .instances
        .iter()
        .filter(|(_, s)| s.1)
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(**c.subscribe().borrow(), *ids(&available));
}

fn capped(share: f64, panic: f64) -> ClientConfig {
    let mut c = config();
    c.outlier.max_ejection_share = share;
    c.outlier.panic_threshold = panic;
    c
}

#[tokio::test(start_paused = true)]
async fn no_more_than_the_share_is_ejected_and_panic_mode_skips_only_the_unreachable() {
    let c = Client::new(
        EndpointPath::for_model("m"),
        capped(0.5, 0.5),
        Arc::new(Scripted::default()),
    );
    c.apply(DiscoveryUpdate::Reset(
        (1..=4).map(|i| info(i, 1)).collect(),
    ));
    assert!(c.report_instance_down(InstanceId(1), "refused"));
    for _ in 0..3 {
        c.record_failure(InstanceId(2), "500");
    }
    // Two of four are out: the third ejection is refused, and counted.
    for _ in 0..3 {
        assert!(!c.record_failure(InstanceId(3), "500"));
    }
    assert!(!c.report_instance_down(InstanceId(4), "refused"));
    assert_eq!(*c.available(), *ids(&[3, 4]));
    assert_eq!(c.counters().ejections_refused.load(Ordering::Relaxed), 2);
    assert!(!c.snapshot().panic);

    // With every instance allowed out, panic mode routes over the failing ones but not
    // over the one that cannot be reached.
    let c = Client::new(
        EndpointPath::for_model("m"),
        capped(1.0, 0.5),
        Arc::new(Scripted::default()),
    );
    c.apply(DiscoveryUpdate::Reset(
        (1..=4).map(|i| info(i, 1)).collect(),
    ));
    c.report_instance_down(InstanceId(1), "refused");
    for id in [2, 3] {
        for _ in 0..3 {
            c.record_failure(InstanceId(id), "500");
        }
    }
    let snap = c.snapshot();
    assert!(snap.panic);
    assert_eq!(*snap.available, *ids(&[4]));
    assert_eq!(*snap.routable, *ids(&[2, 3, 4]));
    assert_eq!(c.counters().panics.load(Ordering::Relaxed), 1);
}

#[tokio::test(start_paused = true)]
async fn a_success_breaks_a_run_and_a_failure_on_probation_ejects_for_longer() {
    let health = Arc::new(Scripted::default());
    health.healthy.store(true, Ordering::SeqCst);
    let c = client(health.clone());
    c.apply(DiscoveryUpdate::Reset(vec![info(1, 1), info(2, 1)]));
    let one = InstanceId(1);
    c.record_failure(one, "500");
    c.record_failure(one, "500");
    c.record_success(one);
    c.record_failure(one, "500");
    c.record_failure(one, "500");
    assert_eq!(*c.available(), *ids(&[1, 2]), "no run of three yet");
    assert!(c.record_failure(one, "500"));
    assert_eq!(*c.available(), *ids(&[2]));

    // Out for 0.5 s, then the probe passes: back on probation.
    let mut rx = c.subscribe();
    rx.wait_for(|a| a.contains(&one)).await.unwrap();
    let snap = c.snapshot();
    assert!(snap.instances[&one].health.on_probation());
    // One failure on probation ejects again, for twice as long.
    assert!(c.record_failure(one, "500 again"));
    match &c.snapshot().instances[&one].availability {
        Availability::Down {
            ejected_for, kind, ..
        } => {
            assert_eq!(*ejected_for, Duration::from_secs(1));
            assert_eq!(*kind, DownKind::Failing);
        }
        other => panic!("{other:?}"),
    }
    let out = tokio::time::Instant::now();
    rx.wait_for(|a| a.contains(&one)).await.unwrap();
    assert!(out.elapsed() >= Duration::from_secs(1));
    // A success ends the probation.
    c.record_success(one);
    assert!(!c.snapshot().instances[&one].health.on_probation());
}

#[tokio::test(start_paused = true)]
async fn a_busy_instance_is_skipped_for_its_retry_after_and_stays_available() {
    let c = client(Arc::default());
    c.apply(DiscoveryUpdate::Reset(vec![info(1, 1), info(2, 1)]));
    let now = tokio::time::Instant::now().into_std();
    assert_eq!(
        c.report_busy(InstanceId(1), Some(Duration::from_secs(2))),
        Duration::from_secs(2)
    );
    assert_eq!(*c.available(), *ids(&[1, 2]));
    let busy = c.busy(now);
    assert_eq!(busy.len(), 1);
    assert_eq!(busy[0].0, InstanceId(1));
    assert!(c.busy(now + Duration::from_secs(3)).is_empty());
    // A Retry-After beyond the cap is capped.
    assert_eq!(
        c.report_busy(InstanceId(2), Some(Duration::from_secs(3600))),
        c.config().outlier.busy_max
    );
    assert_eq!(c.counters().reported_down.load(Ordering::Relaxed), 0);
}

#[tokio::test(start_paused = true)]
async fn discovery_removing_serving_instances_holds_them_until_grace_or_failure() {
    let health = Arc::new(Scripted::default());
    health.healthy.store(true, Ordering::SeqCst);
    let mut cfg = config();
    cfg.outlier.discovery_grace = Duration::from_secs(30);
    let c = Client::new(EndpointPath::for_model("m"), cfg, health.clone());
    c.apply(DiscoveryUpdate::Reset(vec![
        info(1, 1),
        info(2, 1),
        info(3, 1),
    ]));
    c.report_instance_down(InstanceId(3), "refused");
    // A mass lease expiry: every key deleted at once.
    c.apply(DiscoveryUpdate::Reset(vec![]));
    let snap = c.snapshot();
    assert_eq!(*snap.available, *ids(&[1, 2]), "serving instances are held");
    assert!(
        !snap.instances.contains_key(&InstanceId(3)),
        "a down one leaves"
    );
    assert_eq!(c.counters().held_removals.load(Ordering::Relaxed), 2);

    // Instance 1 registers again (a new lease): no longer held. Instance 2 fails: gone.
    c.apply(DiscoveryUpdate::Insert(info(1, 2)));
    assert!(c.snapshot().instances[&InstanceId(1)].held_until.is_none());
    c.report_instance_down(InstanceId(2), "refused");
    assert_eq!(*c.available(), *ids(&[1]));
    assert!(!c.snapshot().instances.contains_key(&InstanceId(2)));

    // A held instance leaves when the grace ends, and at once when it deregisters.
    c.apply(DiscoveryUpdate::Insert(info(4, 1)));
    c.apply(DiscoveryUpdate::Insert(info(5, 1)));
    c.apply(DiscoveryUpdate::Remove(InstanceId(4)));
    assert_eq!(*c.available(), *ids(&[1, 4, 5]));
    c.apply(DiscoveryUpdate::Leave(InstanceId(5)));
    assert_eq!(*c.available(), *ids(&[1, 4]));
    tokio::time::sleep(Duration::from_secs(31)).await;
    assert_eq!(*c.available(), *ids(&[1]));

    // A removed instance that does not answer its probe leaves at once.
    health.healthy.store(false, Ordering::SeqCst);
    c.apply(DiscoveryUpdate::Insert(info(6, 1)));
    c.apply(DiscoveryUpdate::Remove(InstanceId(6)));
    let mut rx = c.subscribe();
    rx.wait_for(|a| !a.contains(&InstanceId(6))).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn active_health_checks_eject_a_hung_instance_and_readmit_it_when_it_answers() {
    let health = Arc::new(Scripted::default());
    health.healthy.store(true, Ordering::SeqCst);
    let mut cfg = capped(0.5, 0.0);
    cfg.outlier.health_interval = Some(Duration::from_secs(1));
    let c = Client::new(EndpointPath::for_model("m"), cfg, health.clone());
    c.apply(DiscoveryUpdate::Reset(vec![info(1, 1), info(2, 1)]));
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(*c.available(), *ids(&[1, 2]));
    health.healthy.store(false, Ordering::SeqCst);
    let mut rx = c.subscribe();
    // Both fail their checks; the share cap keeps one of them in.
    rx.wait_for(|a| a.len() == 1).await.unwrap();
    assert!(matches!(
        c.snapshot()
            .instances
            .values()
            .find(|s| s.availability != Availability::Available)
            .unwrap()
            .availability,
        Availability::Down {
            kind: DownKind::Unhealthy,
            ..
        }
    ));
    health.healthy.store(true, Ordering::SeqCst);
    rx.wait_for(|a| a.len() == 2).await.unwrap();
}
