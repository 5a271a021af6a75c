//! A request leaves the router's queue for the worker the policy places it on, once that
//! worker is below saturation: a worker freed elsewhere does not take a request whose
//! prompt another worker holds (which would prefill it again there and saturate that
//! worker in turn), and takes one it is the best place for. Embedded router core, real
//! kv-cost `.wasm`, each worker's latency model taught by requests timed here.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use switchyard_ids::{BlockHash, InstanceId, RequestId};
use switchyard_router::{Ask, KvRouter, KvRouterConfig, Placing, RouteError, Routed, Saturation};

use common::{BLOCK, router_over, worker};

const ONE: InstanceId = InstanceId(1);
const TWO: InstanceId = InstanceId(2);

/// Workers 1 and 2; a worker whose requests ahead would hold a new one a millisecond
/// from its first token is saturated.
fn fleet() -> Arc<KvRouter> {
    let mut config = KvRouterConfig::new(BLOCK);
    config.saturation = Saturation {
        wait: Duration::from_millis(1),
        ..Saturation::default()
    };
    router_over(vec![worker(1), worker(2)], "{}", config).0
}

/// A prompt of `blocks` full blocks: `seed`'s document, the same for every length.
fn prompt(router: &KvRouter, seed: u32, blocks: u32) -> (u32, Vec<BlockHash>) {
    let tokens: Vec<u32> = (0..blocks * BLOCK).map(|i| seed * 100_000 + i).collect();
    (tokens.len() as u32, router.hasher().hashes(&tokens))
}

/// Places a prompt on `on` (the other worker excluded); its request.
fn place_on(router: &KvRouter, on: InstanceId, seed: u32, blocks: u32) -> RequestId {
    let other = if on == ONE { TWO } else { ONE };
    let (tokens, hashes) = prompt(router, seed, blocks);
    let routed = router
        .place(
            &Ask::new(tokens, &hashes),
            &[other],
            Instant::now(),
            Placing::Any,
        )
        .unwrap();
    assert_eq!(routed.worker, on);
    routed.request
}

fn dispatch(router: &KvRouter, seed: u32, blocks: u32) -> Result<Routed, RouteError> {
    let (tokens, hashes) = prompt(router, seed, blocks);
    router.dispatch(&Ask::new(tokens, &hashes), Instant::now())
}

/// Each worker's model learns that a request waits ~5 ms for its first token.
fn teach(router: &KvRouter) {
    for (i, w) in [ONE, TWO, ONE, TWO, ONE, TWO].into_iter().enumerate() {
        let request = place_on(router, w, 1_000 + i as u32, 2);
        std::thread::sleep(Duration::from_millis(5));
        router.prefill_done(request);
        router.complete(request, Some(1));
    }
    for w in [ONE, TWO] {
        assert_eq!(router.saturation_of(w), None, "an idle worker");
    }
}

#[tokio::test]
async fn a_queued_request_waits_for_the_worker_holding_its_prompt_not_any_freed_one() {
    let router = fleet();
    teach(&router);
    // Worker 1 holds a long document (its request done).
    let doc = place_on(&router, ONE, 1, 64);
    router.prefill_done(doc);
    router.complete(doc, Some(1));
    // Both workers get a prompt each, not yet prefilled: both saturated.
    let on_one = place_on(&router, ONE, 2, 8);
    let on_two = place_on(&router, TWO, 3, 8);
    for w in [ONE, TWO] {
        assert!(
            router.saturation_of(w).is_some(),
            "worker {w:?} not saturated"
        );
    }
    // A question on the document arrives: it waits.
    let (tokens, hashes) = prompt(&router, 1, 65);
    assert!(matches!(
        router.try_place(&Ask::new(tokens, &hashes), Instant::now()),
        Err(RouteError::Saturated { .. })
    ));
    // Worker 2 frees up first. The question stays queued for worker 1, where the
    // document is; a prompt no one holds leaves for worker 2.
    router.prefill_done(on_two);
    assert_eq!(router.saturation_of(TWO), None);
    let placed = dispatch(&router, 1, 65);
    assert!(
        matches!(placed, Err(RouteError::Saturated { .. })),
        "the question left for {:?}",
        placed.map(|r| r.worker)
    );
    let fresh = dispatch(&router, 4, 8).expect("a worker has room");
    assert_eq!(fresh.worker, TWO);
    router.finish(fresh.request);
    // Worker 1 frees up: the question goes there, its document cached.
    router.prefill_done(on_one);
    let placed = dispatch(&router, 1, 65).expect("its worker has room");
    assert_eq!(placed.worker, ONE);
    assert_eq!(placed.overlap_blocks, 64);
}
