//! Shadow policies and decision-quality telemetry, on a real KvRouter over a real Client
//! deciding through real compiled policies: a shadow sees every live decision, never
//! changes one, is contained when it misbehaves, drops instead of blocking when it
//! falls behind, and is promoted in one step.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::guest;
use switchyard::client::{Client, ClientConfig, HttpHealthCheck, OutlierConfig};
use switchyard::discovery::{DiscoveryUpdate, EndpointPath, InstanceInfo};
use switchyard::ids::InstanceId;
use switchyard::policy::{Decider, PolicyEngine, PolicyHandle, RuntimeConfig};
use switchyard::router::shadow::{SHADOW_QUEUE, ShadowTally};
use switchyard::router::{KvRouter, KvRouterConfig};

const PATIENCE: Duration = Duration::from_secs(30);
const BLOCK: u32 = 16;

fn instance(id: u64) -> InstanceInfo {
    let url = format!("http://127.0.0.1:{}", 1 + id);
    InstanceInfo::new(
        InstanceId(id),
        EndpointPath::for_model("m"),
        url,
        "m",
        BLOCK,
    )
}

fn engine(budget: Duration) -> PolicyEngine {
    PolicyEngine::new(RuntimeConfig {
        call_budget: budget,
        // The live policies here never fail; a shadow's failures must not roll anything.
        ..common::runtime()
    })
    .unwrap()
}

/// A router over `workers` static instances (no events: the cache is predicted from
/// decisions) deciding with `live` (a built-in or a guest name).
fn router(workers: u64, live: &str, engine: &PolicyEngine) -> Arc<KvRouter> {
    let client = Client::new(
        EndpointPath::for_model("m"),
        ClientConfig {
            probe_initial: Duration::from_secs(3600),
            probe_max: Duration::from_secs(3600),
            outlier: OutlierConfig {
                health_interval: None,
                ..OutlierConfig::default()
            },
        },
        Arc::new(HttpHealthCheck::new(Duration::from_secs(1))),
    );
    client.apply(DiscoveryUpdate::Reset(
        (1..=workers).map(instance).collect(),
    ));
    let policy = load(engine, live);
    let handle = Arc::new(PolicyHandle::new(engine.clone(), policy).unwrap());
    Arc::new(KvRouter::new(client, handle, KvRouterConfig::new(BLOCK)))
}

fn load(engine: &PolicyEngine, spec: &str) -> switchyard::policy::LoadedPolicy {
    if switchyard::policy::builtin(spec).is_some() {
        engine.load_spec(spec, "{}").unwrap()
    } else {
        // Hostile guests behave on their canary (sequence 0) and misbehave after.
        engine.load_file(&guest(spec), r#"{"after": 1}"#).unwrap()
    }
}

/// The prompt of turn `turn` of session `session`: the session's own first block, then
/// one block per earlier turn, so each turn extends the last one's prefix.
fn prompt(session: u32, turn: u32) -> Vec<u32> {
    (0..=turn)
        .flat_map(|t| (0..BLOCK).map(move |i| session * 100_000 + t * 1_000 + i))
        .collect()
}

/// Routes `n` requests of `sessions` multi-turn sessions in turn, each finished before
/// the next (so load never outweighs the cache); returns the workers chosen.
fn drive(router: &KvRouter, sessions: u32, n: u32) -> Vec<InstanceId> {
    (0..n)
        .map(|i| {
            let routed = router
                .route(&prompt(i % sessions, i / sessions), None, &[])
                .expect("routed");
            router.prefill_done(routed.request);
            router.finish(routed.request);
            routed.worker
        })
        .collect()
}

/// Waits until the shadow has dealt with every decision offered to it.
fn settled(router: &KvRouter) -> ShadowTally {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let t = router.shadow_status().expect("a shadow is attached").tally;
        if t.settled() {
            return t;
        }
        assert!(
            Instant::now() < deadline,
            "the shadow never caught up: {t:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn achieved_overlap_is_all_of_the_best_for_kv_cost_and_less_for_round_robin() {
    let engine = engine(Duration::from_millis(500));
    let ratio = |live: &str| {
        let r = router(4, live, &engine);
        // Seven sessions over four workers: round-robin cannot line up with them.
        drive(&r, 7, 200);
        let q = r.quality();
        assert_eq!(
            q.routed.load(std::sync::atomic::Ordering::Relaxed),
            200,
            "{live}"
        );
        q.overlap_ratio().expect("decisions were made")
    };
    let kv_cost = ratio("kv-cost");
    let round_robin = ratio("round-robin");
    assert_eq!(
        kv_cost, 1.0,
        "kv-cost takes the cached prefix whenever load is even"
    );
    assert!(
        round_robin < 0.9,
        "round-robin ignores the cache: achieved {round_robin} of the best"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_that_never_agrees_is_measured_and_changes_no_decision() {
    let engine = engine(Duration::from_millis(500));
    // Live: always the first candidate; shadow: always the last.
    let r = router(3, "picks_first", &engine);
    let status = r.attach_shadow(load(&engine, "picks_last"), 1.0).unwrap();
    assert_eq!(status.info.name, "picks-last");
    let chosen = drive(&r, 4, 120);
    assert!(
        chosen.iter().all(|w| *w == InstanceId(1)),
        "every request went where the live policy sent it"
    );
    let t = settled(&r);
    assert_eq!((t.offered, t.compared, t.dropped), (120, 120, 0), "{t:?}");
    assert_eq!(t.agreement(), Some(0.0));
    // The shadow would have left the prefixes the live policy placed on worker 1.
    assert!(t.shadow_overlap_ratio().unwrap() < t.live_overlap_ratio().unwrap());
    assert_eq!(t.live_overlap_ratio(), Some(1.0));
    // The live path never heard of it.
    let live = r.policy().status();
    assert_eq!((live.failures, live.fallbacks), (0, 0));
    // A shadow deciding like the live policy agrees on everything.
    r.attach_shadow(load(&engine, "picks_first"), 1.0).unwrap();
    drive(&r, 4, 40);
    let t = settled(&r);
    assert_eq!((t.compared, t.agreed), (40, 40), "{t:?}");
    let kinds: Vec<&str> = r.policy().changes().iter().map(|c| c.kind).collect();
    assert_eq!(kinds, ["loaded", "shadow", "shadow"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_looping_or_trapping_shadow_is_contained_counted_and_never_felt_by_the_live_path() {
    let engine = engine(Duration::from_millis(20));
    for (hostile, reason) in [("spin_forever", "timeout"), ("panics", "trap")] {
        let r = router(2, "kv-cost", &engine);
        // Hostile guests behave on sequence 0: the live path's first decision.
        drive(&r, 1, 1);
        r.attach_shadow(load(&engine, hostile), 1.0).unwrap();
        let chosen = drive(&r, 2, 30);
        assert_eq!(chosen.len(), 30);
        let t = settled(&r);
        assert_eq!(t.failures, t.offered - t.dropped, "{hostile}: {t:?}");
        assert!(t.failures >= 1, "{hostile}: {t:?}");
        // Every live decision was the live policy's own: no failure, no fallback.
        let live = r.policy().status();
        assert_eq!((live.failures, live.fallbacks, live.decisions), (0, 0, 31));
        let counted = r
            .shadow_series()
            .all()
            .into_iter()
            .map(|(_, c)| {
                let i = switchyard::policy::CallFailure::REASONS
                    .iter()
                    .position(|x| *x == reason)
                    .unwrap();
                c.failures[i].load(std::sync::atomic::Ordering::Relaxed)
            })
            .sum::<u64>();
        assert_eq!(counted, t.failures, "{hostile} fails as a {reason}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_that_falls_behind_drops_decisions_instead_of_blocking_them() {
    // Each shadow call takes its whole 50 ms budget: far slower than the live path.
    let engine = engine(Duration::from_millis(50));
    let r = router(2, "kv-cost", &engine);
    drive(&r, 1, 1);
    r.attach_shadow(load(&engine, "spin_forever"), 1.0).unwrap();
    let n = (SHADOW_QUEUE * 3) as u32;
    drive(&r, 16, n);
    // Every decision was made while the shadow worked through a few: the live path
    // went on past a full queue.
    let t = r.shadow_status().unwrap().tally;
    assert_eq!(t.offered, u64::from(n));
    // At most a queue's worth waits, besides those the shadow took (one may be in its
    // hands): the rest were dropped.
    assert!(
        t.dropped >= u64::from(n) - SHADOW_QUEUE as u64 - t.calls - 1,
        "{t:?}"
    );
    // Removing it leaves nothing behind on the live side.
    let removed = r.detach_shadow().unwrap();
    assert_eq!(removed.info.name, "spin-forever");
    assert!(r.shadow_status().is_none());
    assert_eq!(r.policy().status().decisions, u64::from(n) + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sampled_shadow_sees_its_share_of_the_decisions() {
    let engine = engine(Duration::from_millis(500));
    let r = router(2, "kv-cost", &engine);
    let s = r.attach_shadow(load(&engine, "round-robin"), 0.25).unwrap();
    assert_eq!(s.sample, 0.25);
    drive(&r, 4, 200);
    let t = settled(&r);
    assert_eq!(t.offered, 50, "{t:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promote_makes_the_shadow_live_in_one_step_and_the_old_policy_the_rollback_target() {
    let engine = engine(Duration::from_millis(500));
    let r = router(3, "picks_first", &engine);
    assert!(r.promote_shadow().is_none(), "nothing to promote");
    r.attach_shadow(load(&engine, "picks_last"), 1.0).unwrap();
    drive(&r, 2, 10);
    settled(&r);
    let status = r.promote_shadow().unwrap().unwrap();
    assert_eq!(status.info.name, "picks-last");
    assert_eq!(status.previous.unwrap().name, "picks-first");
    assert!(r.shadow_status().is_none());
    let chosen = drive(&r, 2, 10);
    assert!(chosen.iter().all(|w| *w == InstanceId(3)), "{chosen:?}");
    let d = r.policy().decide(
        switchyard::policy::Request {
            prompt_blocks: 1,
            prompt_tokens: 16,
            block_size: BLOCK,
            ..Default::default()
        },
        &r.candidates(&[], &[]).0,
    );
    assert_eq!(d.decider, Decider::Policy);
    let kinds: Vec<&str> = r.policy().changes().iter().map(|c| c.kind).collect();
    assert_eq!(kinds, ["loaded", "shadow", "swap", "promote"]);
    // And the operator can go back.
    assert_eq!(r.policy().rollback().unwrap().info.name, "picks-first");
}

/// The admin page's trends keep five minutes (a point a second) however long the router
/// runs, and a point says what the second before it did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trends_keep_a_bounded_window_of_points() {
    use switchyard::http::metrics::{TREND_POINTS, Trends};
    let engine = engine(Duration::from_millis(500));
    let r = router(2, "kv-cost", &engine);
    let trends = Trends::default();
    let routers = [r.clone()];
    trends.sample(&routers);
    drive(&r, 2, 10);
    trends.sample(&routers);
    let points = trends.points(&r.endpoint().to_string());
    assert_eq!(points.len(), 1, "the first sample only sets the base");
    assert!(points[0].decisions_per_s > 0.0);
    // The point's overlap is the decisions' of that second: here every decision so far.
    assert!(points[0].overlap_ratio.is_some_and(|r| r > 0.5));
    assert_eq!(points[0].overlap_ratio, r.quality().overlap_ratio());
    for _ in 0..TREND_POINTS + 50 {
        trends.sample(&routers);
    }
    let points = trends.points(&r.endpoint().to_string());
    assert_eq!(points.len(), TREND_POINTS);
    assert_eq!(points.last().unwrap().decisions_per_s, 0.0);
    // An endpoint no longer routed leaves nothing behind.
    trends.sample(&[]);
    assert!(trends.points(&r.endpoint().to_string()).is_empty());
}
