//! Engine KV event ingestion (vLLM's ZMQ format):
//! 1. decoded-and-applied blocks per second on one core: msgpack batches of `BlockStored`
//!    events (16 blocks of 16 tokens each, chained, with evictions), decoded, re-hashed
//!    into the router's chain and applied to the overlap index;
//! 2. the lag from publish to visible in a router's index, through real ZMQ sockets over
//!    TCP (a pure-Rust PUB socket in this process, the router's subscriber): p50/p99 of
//!    the time until a just-published prompt's blocks are found.
//!
//! Run: `cargo bench --bench engine_events` (prints a table).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

use switchyard::client::{Client, ClientConfig, HttpHealthCheck};
use switchyard::discovery::{DiscoveryUpdate, EndpointPath, EngineEventSource, InstanceInfo};
use switchyard::ids::InstanceId;
use switchyard::kv::engine_events::{EventOut, Shape, StoredOut, decode_batch, encode_batch};
use switchyard::kv::engine_view::{EngineView, IndexOp};
use switchyard::kv::hash::BlockHasher;
use switchyard::kv::index::OverlapIndex;
use switchyard::policy::{PolicyEngine, PolicyHandle, RuntimeConfig};
use switchyard::router::{KvRouter, KvRouterConfig};

const BLOCK: u32 = 16;
const BLOCKS_PER_EVENT: usize = 16;

/// `n` batches of one `BlockStored` each (a new prompt of 16 blocks), every 4th batch
/// also removing an earlier prompt's blocks, with engine hashes from a counter.
fn batches(n: usize) -> Vec<Vec<u8>> {
    let mut out = Vec::with_capacity(n);
    let mut next_hash = 1u64;
    let mut earlier: Vec<Vec<u64>> = Vec::new();
    for i in 0..n {
        let tokens: Vec<u32> = (0..BLOCKS_PER_EVENT as u32 * BLOCK)
            .map(|t| (i as u32).wrapping_mul(7919).wrapping_add(t))
            .collect();
        let hashes: Vec<u64> = (0..BLOCKS_PER_EVENT as u64)
            .map(|k| next_hash + k)
            .collect();
        next_hash += BLOCKS_PER_EVENT as u64;
        let stored = EventOut::Stored(StoredOut {
            hashes: &hashes,
            token_ids: &tokens,
            block_size: BLOCK,
            ..Default::default()
        });
        let removed = if i % 4 == 3 {
            earlier.drain(..1).next()
        } else {
            None
        };
        let mut events = vec![stored];
        if let Some(r) = &removed {
            events.push(EventOut::Removed(r));
        }
        out.push(encode_batch(Shape::VllmMap, i as f64, 0, &events));
        earlier.push(hashes);
    }
    out
}

fn ingestion() {
    let n = 20_000;
    let payloads = batches(n);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let mut view = EngineView::new(BLOCK, 0, 1 << 24, 1);
        let mut index = OverlapIndex::new();
        let w = InstanceId(1);
        let started = Instant::now();
        for (seq, p) in payloads.iter().enumerate() {
            let batch = decode_batch(p).expect("valid");
            for op in view.apply(0, seq as u64, batch.ts, &batch.events) {
                match op {
                    IndexOp::Stored(b) => index.stored(w, &b),
                    IndexOp::Removed(b) => index.removed(w, &b),
                }
            }
        }
        best = best.min(started.elapsed().as_secs_f64());
        assert_eq!(view.counts().stored_blocks, (n * BLOCKS_PER_EVENT) as u64);
    }
    let blocks = (n * BLOCKS_PER_EVENT) as f64;
    let started = Instant::now();
    for p in &payloads {
        std::hint::black_box(decode_batch(p).expect("valid"));
    }
    let decode = started.elapsed().as_secs_f64();
    println!(
        "| of which msgpack decoding | {:.2} M blocks/s | {:.0} ns/block | |",
        blocks / decode / 1e6,
        decode / blocks * 1e9
    );
    println!(
        "| decode + re-hash + apply, one core | {:.2} M blocks/s | {:.0} ns/block | {} batches of {} blocks × {} tokens |",
        blocks / best / 1e6,
        best / blocks * 1e9,
        n,
        BLOCKS_PER_EVENT,
        BLOCK
    );
}

fn lag() {
    let rt = common::runtime(2);
    rt.block_on(async {
        let mut publisher = PubSocket::new();
        let endpoint = publisher.bind("tcp://127.0.0.1:0").await.unwrap();
        let port = match endpoint {
            zeromq::Endpoint::Tcp(_, port) => port,
            other => panic!("{other}"),
        };
        let id = InstanceId(1);
        let client = Client::new(
            EndpointPath::for_model("bench"),
            ClientConfig::default(),
            Arc::new(HttpHealthCheck::new(Duration::from_secs(1))),
        );
        let source = EngineEventSource::new(format!("tcp://127.0.0.1:{port}"));
        let endpoint = EndpointPath::for_model("bench");
        client.apply(DiscoveryUpdate::Reset(vec![InstanceInfo {
            engine_events: Some(Arc::new(source)),
            ..InstanceInfo::new(id, endpoint, "http://127.0.0.1:9", "bench", BLOCK)
        }]));
        let engine = PolicyEngine::new(RuntimeConfig::default()).unwrap();
        let policy = Arc::new(
            PolicyHandle::new(engine.clone(), engine.load_spec("kv-cost", "{}").unwrap()).unwrap(),
        );
        let router = Arc::new(KvRouter::new(client, policy, KvRouterConfig::new(BLOCK)));
        switchyard::router::subscriber::spawn(&router, Default::default());
        let hasher = BlockHasher::new(BLOCK, 0);
        let mut lags = Vec::new();
        let rounds = 2_000u32;
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seq = 0u64;
        let mut round = 0u32;
        while round < rounds && Instant::now() < deadline {
            let tokens: Vec<u32> = (0..4 * BLOCK).map(|t| round * 1000 + t).collect();
            let hashes: Vec<u64> = (0..4).map(|k| u64::from(round) * 4 + k + 1).collect();
            let payload = encode_batch(
                Shape::VllmMap,
                f64::from(round),
                0,
                &[EventOut::Stored(StoredOut {
                    hashes: &hashes,
                    token_ids: &tokens,
                    block_size: BLOCK,
                    ..Default::default()
                })],
            );
            let want = hasher.hashes(&tokens);
            let mut msg = ZmqMessage::from(Bytes::new());
            msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
            msg.push_back(Bytes::from(payload));
            let sent = Instant::now();
            publisher.send(msg).await.unwrap();
            seq += 1;
            // Until the subscription is up, published batches are lost (a slow joiner):
            // those rounds are not counted.
            let give_up = sent + Duration::from_millis(500);
            loop {
                let (c, _) = router.candidates(&want, &[]);
                if c.overlap_of(id) == Some(4) {
                    if round > 0 || seq > 1 {
                        lags.push(sent.elapsed());
                    }
                    round += 1;
                    break;
                }
                if Instant::now() > give_up {
                    break;
                }
                tokio::task::yield_now().await;
            }
        }
        lags.sort();
        let q = |p: f64| lags[((lags.len() as f64 * p) as usize).min(lags.len() - 1)];
        println!(
            "| publish → visible in the index, ZMQ over TCP | p50 {:.0} µs | p99 {:.0} µs | {} prompts of 4 blocks |",
            q(0.5).as_secs_f64() * 1e6,
            q(0.99).as_secs_f64() * 1e6,
            lags.len()
        );
    });
}

fn main() {
    println!("| engine KV events | figure | per unit | workload |");
    println!("| --- | ---: | ---: | --- |");
    ingestion();
    lag();
}
