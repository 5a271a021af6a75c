//! The mock worker's KV events in vLLM's own format: a ZMQ PUB socket sending
//! `[topic, seq (8 bytes big-endian), msgpack batch]` and a ROUTER replay socket that
//! answers a start sequence number with every buffered batch from there, then
//! `[-1, empty]` (`vllm/distributed/kv_events.py`). Batches are vLLM's current map shape;
//! block hashes are the engine's own, seeded at random per process as vLLM's are, so the
//! router must re-hash the published tokens to use them.

use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::broadcast;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::cache::CacheEvent;
use switchyard_kv::engine_events::{EventOut, Shape, StoredOut, encode_batch};

/// Batches kept for replay (vLLM's default `buffer_steps`).
pub const REPLAY_BUFFER: usize = 10_000;

/// Where to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZmqEventsConfig {
    /// The PUB socket's address (port 0: any free port).
    pub publish: SocketAddr,
    /// The replay socket's address, if any.
    pub replay: Option<SocketAddr>,
    /// The topic.
    pub topic: String,
}

/// A running publisher.
pub struct ZmqPublisher {
    /// The PUB socket's bound address.
    pub publish: SocketAddr,
    /// The replay socket's bound address.
    pub replay: Option<SocketAddr>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for ZmqPublisher {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// Starts publishing `events` (the engine's cache events) for blocks of `block_size`.
pub fn start(
    config: &ZmqEventsConfig,
    events: broadcast::Receiver<CacheEvent>,
    block_size: u32,
) -> std::io::Result<ZmqPublisher> {
    let listener = |addr: SocketAddr| -> std::io::Result<std::net::TcpListener> {
        let l = std::net::TcpListener::bind(addr)?;
        l.set_nonblocking(true)?;
        Ok(l)
    };
    let publish = listener(config.publish)?;
    let replay = config.replay.map(listener).transpose()?;
    let publish_addr = publish.local_addr()?;
    let replay_addr = replay.as_ref().map(|l| l.local_addr()).transpose()?;
    let buffer: Buffer = Arc::new(Mutex::new(VecDeque::new()));
    let mut tasks = vec![tokio::spawn(publish_loop(
        publish,
        events,
        config.topic.clone(),
        block_size,
        buffer.clone(),
    ))];
    if let Some(l) = replay {
        tasks.push(tokio::spawn(replay_loop(l, buffer)));
    }
    Ok(ZmqPublisher {
        publish: publish_addr,
        replay: replay_addr,
        tasks,
    })
}

/// This process's engine hash of a block (the router's hash, seeded at random).
fn engine_hash(seed: u64, h: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(&h.to_le_bytes(), seed)
}

async fn publish_loop(
    listener: std::net::TcpListener,
    mut events: broadcast::Receiver<CacheEvent>,
    topic: String,
    block_size: u32,
    buffer: Buffer,
) {
    let mut socket = PubSocket::new();
    if let Err(e) = socket.bind_listener(listener).await {
        tracing::error!(error = %e, "cannot serve the ZMQ KV event socket");
        return;
    }
    let seed = std::collections::hash_map::RandomState::new().hash_one(0x5eedu64);
    let topic = Bytes::from(topic.into_bytes());
    let mut seq = 0u64;
    loop {
        let mut batch = match events.recv().await {
            Ok(e) => vec![e],
            Err(broadcast::error::RecvError::Lagged(n)) => {
                // Events were lost before publishing: skip a sequence number, so that
                // subscribers see a gap no replay can fill and stop trusting their view.
                tracing::warn!(lost = n, "ZMQ KV event publisher fell behind the engine");
                seq += 1;
                continue;
            }
            Err(broadcast::error::RecvError::Closed) => return,
        };
        while batch.len() < 256 {
            match events.try_recv() {
                Ok(e) => batch.push(e),
                Err(_) => break,
            }
        }
        let hashes: Vec<(Vec<u64>, Option<u64>)> = batch
            .iter()
            .map(|e| match e {
                CacheEvent::Stored { blocks, parent, .. } => (
                    blocks.iter().map(|h| engine_hash(seed, *h)).collect(),
                    parent.map(|p| engine_hash(seed, p)),
                ),
                CacheEvent::Removed { blocks, .. } => {
                    (blocks.iter().map(|h| engine_hash(seed, *h)).collect(), None)
                }
            })
            .collect();
        let out: Vec<EventOut<'_>> = batch
            .iter()
            .zip(&hashes)
            .map(|(e, (hs, parent))| match e {
                CacheEvent::Stored {
                    tokens, salt, lora, ..
                } => EventOut::Stored(StoredOut {
                    hashes: hs,
                    parent: *parent,
                    token_ids: tokens,
                    block_size,
                    cache_salt: salt.as_deref(),
                    lora_name: lora.as_deref(),
                    ..Default::default()
                }),
                CacheEvent::Removed { .. } => EventOut::Removed(hs),
            })
            .collect();
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let payload = Bytes::from(encode_batch(Shape::VllmMap, ts, 0, &out));
        let mut msg = ZmqMessage::from(topic.clone());
        msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        msg.push_back(payload.clone());
        {
            let mut b = buffer.lock();
            if b.len() == REPLAY_BUFFER {
                b.pop_front();
            }
            b.push_back((seq, payload));
        }
        seq += 1;
        if let Err(e) = socket.send(msg).await {
            tracing::debug!(error = %e, "ZMQ KV event not sent");
        }
    }
}

async fn replay_loop(listener: std::net::TcpListener, buffer: Buffer) {
    let mut socket = RouterSocket::new();
    if let Err(e) = socket.bind_listener(listener).await {
        tracing::error!(error = %e, "cannot serve the ZMQ KV event replay socket");
        return;
    }
    loop {
        let Ok(request) = socket.recv().await else {
            continue;
        };
        // [client identity, empty delimiter, start seq]
        let frames = request.into_vec();
        let [client, _, start] = &frames[..] else {
            tracing::debug!(frames = frames.len(), "malformed ZMQ replay request");
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(&start[..]).map(u64::from_be_bytes) else {
            continue;
        };
        let batches: Vec<(u64, Bytes)> = buffer
            .lock()
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        let reply = |seq: Bytes, payload: Bytes| {
            let mut m = ZmqMessage::from(client.clone());
            m.push_back(Bytes::new());
            m.push_back(seq);
            m.push_back(payload);
            m
        };
        for (seq, payload) in batches {
            if socket
                .send(reply(Bytes::copy_from_slice(&seq.to_be_bytes()), payload))
                .await
                .is_err()
            {
                break;
            }
        }
        let _ = socket
            .send(reply(
                Bytes::copy_from_slice(&(-1i64).to_be_bytes()),
                Bytes::new(),
            ))
            .await;
    }
}
