//! Admission on a fleet that splits prefill from decode. A request waits in the router's
//! queue when it has nowhere to go below saturation: with vLLM's handoff a decode worker
//! may serve a request by itself, so a full prefill pool holds only the requests the
//! policy would split; with SGLang's (a prefill worker with a bootstrap port) every
//! request needs a prefill worker, and a full prefill pool holds them all.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use switchyard_discovery::Role;
use switchyard_ids::{BlockHash, InstanceId};
use switchyard_router::{Ask, KvRouter, KvRouterConfig, RouteError, Routed, Saturation};

use common::{BLOCK, router_over, worker};

/// Prefill worker 1, decode workers 2 and 3 (with `bootstrap`, SGLang's handoff). Any
/// prompt routed to a worker and not yet prefilled saturates it.
fn split(bootstrap: bool) -> Arc<KvRouter> {
    let mut prefill = worker(1);
    prefill.role = Role::Prefill;
    prefill.bootstrap_port = bootstrap.then_some(8998);
    let decode = [2, 3].map(|id| {
        let mut w = worker(id);
        w.role = Role::Decode;
        w
    });
    let mut config = KvRouterConfig::new(BLOCK);
    config.saturation = Saturation {
        prefill_tokens: 1,
        wait: Duration::ZERO,
        ..Saturation::default()
    };
    let workers = std::iter::once(prefill).chain(decode).collect();
    router_over(workers, "{}", config).0
}

/// A prompt of `blocks` full blocks no other request shares.
fn prompt(router: &KvRouter, seed: u32, blocks: u32) -> (u32, Vec<BlockHash>) {
    let tokens: Vec<u32> = (0..blocks * BLOCK).map(|i| seed * 100_000 + i).collect();
    (tokens.len() as u32, router.hasher().hashes(&tokens))
}

/// A request arriving (may be held), non-streamed or streamed alike.
fn arrive(router: &KvRouter, seed: u32, blocks: u32) -> Result<Routed, RouteError> {
    let (tokens, hashes) = prompt(router, seed, blocks);
    router.try_place(&Ask::new(tokens, &hashes), Instant::now())
}

/// A request leaving the queue.
fn leave_queue(router: &KvRouter, seed: u32, blocks: u32) -> Result<Routed, RouteError> {
    let (tokens, hashes) = prompt(router, seed, blocks);
    router.dispatch(&Ask::new(tokens, &hashes), Instant::now())
}

/// A request placed on its arrival, then leaving the queue: each way of placing it.
type Place = fn(&KvRouter, u32, u32) -> Result<Routed, RouteError>;
const BOTH_WAYS: [Place; 2] = [arrive, leave_queue];

/// The request was held (it waits in the router's queue); else `why`, with where it went.
fn assert_held(placed: Result<Routed, RouteError>, why: &str) {
    assert!(
        matches!(placed, Err(RouteError::Saturated { .. })),
        "{why}: {:?}",
        placed.map(|r| (r.worker, r.prefill.map(|p| p.worker)))
    );
}

/// A long prompt (1,024 tokens, past kv-cost's 1,000 it runs alone without a look at
/// the queues) on the idle fleet is split: the prefill pool is then full.
fn fill_the_prefill_pool(router: &KvRouter) {
    let first = arrive(router, 1, 64).expect("an idle fleet places");
    assert_eq!(
        first.prefill.map(|p| p.worker),
        Some(InstanceId(1)),
        "the long prompt was not split"
    );
    assert!(router.saturation_of(InstanceId(1)).is_some());
}

#[tokio::test]
async fn a_full_prefill_pool_does_not_hold_a_request_a_decode_worker_serves_alone() {
    let router = split(false);
    fill_the_prefill_pool(&router);
    // A short prompt runs on a decode worker by itself: it is placed, not held.
    for (seed, go) in (2..).zip(BOTH_WAYS) {
        let short = go(&router, seed, 8).expect("a decode worker had room");
        assert!(short.prefill.is_none(), "split onto the full prefill pool");
        assert_ne!(short.worker, InstanceId(1));
    }
}

#[tokio::test]
async fn a_request_the_policy_splits_waits_while_the_prefill_pool_is_full() {
    let router = split(false);
    // Short prompts on the decode workers first (their prefill done): each decoding
    // request there is one a lone prefill would stall, so the policy splits long ones.
    for seed in 10..14 {
        let r = arrive(&router, seed, 8).expect("an idle fleet places");
        router.prefill_done(r.request);
    }
    for id in [2, 3] {
        assert!(
            router.load_of(InstanceId(id)).in_flight >= 1,
            "decode worker {id} has nothing decoding"
        );
    }
    fill_the_prefill_pool(&router);
    for (seed, go) in (20..).zip(BOTH_WAYS) {
        assert_held(
            go(&router, seed, 64),
            "a split was sent to the full prefill pool",
        );
    }
}

#[tokio::test]
async fn with_sglangs_handoff_a_full_prefill_pool_holds_every_request() {
    let router = split(true);
    fill_the_prefill_pool(&router);
    for (seed, go) in (2..).zip(BOTH_WAYS) {
        assert_held(
            go(&router, seed, 8),
            "a decode worker served alone without its prefill worker",
        );
    }
}
