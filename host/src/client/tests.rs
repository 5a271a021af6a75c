//! Deterministic tests of the availability rules (paused time, scripted health).

use super::*;
use crate::discovery::EndpointPath;
use std::sync::atomic::AtomicBool;

/// A health check whose answer the test sets, counting the probes it answers.
#[derive(Default)]
struct Scripted {
    healthy: AtomicBool,
    probes: AtomicU64,
}

#[async_trait::async_trait]
impl HealthCheck for Scripted {
    async fn check(&self, _: &InstanceInfo) -> Result<(), String> {
        self.probes.fetch_add(1, Ordering::SeqCst);
        if self.healthy.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err("503".into())
        }
    }
}

fn info(id: u64, registration: u64) -> InstanceInfo {
    InstanceInfo {
        id: InstanceId(id),
        endpoint: EndpointPath::for_model("m"),
        url: format!("http://127.0.0.1:{}", 9000 + id),
        model: "m".into(),
        block_size: 16,
        events_url: None,
        health_path: "/health".into(),
        registration,
    }
}

fn ids(v: &[u64]) -> Vec<InstanceId> {
    v.iter().map(|&i| InstanceId(i)).collect()
}

fn client(health: Arc<Scripted>) -> Arc<Client> {
    Client::new(
        EndpointPath::for_model("m"),
        ClientConfig::default(),
        health,
    )
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
                            Op::Down(id) => c.report_down_at(InstanceId(*id), "test").1,
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
