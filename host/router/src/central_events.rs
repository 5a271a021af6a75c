//! The central mode of engine KV events: the router binds SUB sockets and the engines
//! connect to them (vLLM's `endpoint` without `*`, e.g. `tcp://router:5557`), each
//! publishing under a topic that names its worker. A worker whose `kv_events` is
//! [`BOUND`] is fed from here: its batches are routed by (topic, rank) to the worker's
//! feed, which treats them exactly as batches from its own SUB socket (sequence checks,
//! replay, incomplete views).
//!
//! One socket per data-parallel rank: the `r`-th bound address receives rank `r` (an
//! engine's rank `r` connects to its endpoint's port plus `r`). Discipline: a feed's
//! queue is bounded ([`QUEUE`] batches) and a full queue drops the batch, which the feed
//! then sees as a sequence gap (replayed or marked incomplete), so one slow worker never
//! holds up the others; batches of a topic no worker claims are counted and skipped; a
//! topic claimed twice is refused to the second claimant, which stays approximate.
//! Each bound address takes at most [`MAX_PEERS`] engine connections at once, each read
//! through the router's bounded ZMTP ([`super::zmtp`]); one past its bounds is closed and
//! counted, and the others go on.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::mpsc;

use super::zmtp::{Connection, KV_EVENT_LIMITS, SocketType, tcp_address};
use switchyard_bounded::budget::{Budget, Grant};

use switchyard_ids::InstanceId;

/// The `kv_events` of a worker whose engine connects to the router's bound sockets.
pub const BOUND: &str = switchyard_discovery::EngineEventSource::BOUND;

/// Batches queued per (topic, rank) before new ones are dropped (and become a gap).
pub const QUEUE: usize = 4096;

/// Engine connections open at once per bound address (an engine holds one per rank);
/// more are closed as they arrive.
pub const MAX_PEERS: usize = 1024;

type Route = (String, u32);
/// A batch as it arrived: `(seq, payload)`, its bytes held against the router's budget
/// for event input until the feed has handled it.
type Batch = (u64, Bytes, Grant);

/// The router's bound SUB sockets and where their batches go.
pub struct CentralEvents {
    addresses: Vec<String>,
    routes: Mutex<HashMap<Route, Holder>>,
    /// The next claim's number.
    claims: AtomicU64,
    /// Batches whose topic no worker claims.
    pub unrouted: AtomicU64,
    /// Batches dropped because a worker's queue was full.
    pub dropped: AtomicU64,
    /// Batches that were not `[topic, seq, payload]`.
    pub malformed: AtomicU64,
    /// Connections closed for breaking the protocol or its bounds, or refused past
    /// [`MAX_PEERS`].
    pub refused: AtomicU64,
}

impl std::fmt::Debug for CentralEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CentralEvents")
            .field("addresses", &self.addresses)
            .finish_non_exhaustive()
    }
}

/// Who holds a route.
struct Holder {
    worker: InstanceId,
    /// The claim that made it: only that claim's drop removes it.
    claim: u64,
    /// Where its batches go.
    tx: mpsc::Sender<Batch>,
}

/// A worker's claim on a topic: its batches, until dropped.
pub struct Claim {
    hub: Arc<CentralEvents>,
    route: Route,
    id: u64,
    /// `(seq, payload, bytes held)` of each batch.
    pub batches: mpsc::Receiver<Batch>,
}

impl Drop for Claim {
    fn drop(&mut self) {
        // Racing: the same worker may have claimed the route again (a new feed) before
        // this one's drop; only the claim that holds it removes it.
        let mut routes = self.hub.routes.lock();
        if routes.get(&self.route).is_some_and(|h| h.claim == self.id) {
            routes.remove(&self.route);
        }
    }
}

impl CentralEvents {
    /// Binds a SUB socket (every topic) at each of `addresses` (`tcp://HOST:PORT`; the
    /// `r`-th for rank `r`) and starts receiving.
    pub async fn bind(addresses: &[String], budget: Budget) -> Result<Arc<CentralEvents>, String> {
        let hub = Arc::new(CentralEvents {
            addresses: addresses.to_vec(),
            routes: Mutex::new(HashMap::new()),
            claims: AtomicU64::new(0),
            unrouted: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            malformed: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        });
        for (rank, address) in addresses.iter().enumerate() {
            let tcp = tcp_address(address).map_err(|e| e.to_string())?;
            let listener = tokio::net::TcpListener::bind(&tcp)
                .await
                .map_err(|e| format!("cannot bind the KV events socket {address}: {e}"))?;
            let bound = listener
                .local_addr()
                .map_err(|e| format!("KV events socket {address}: {e}"))?;
            tracing::info!(%bound, rank, "receiving engines' KV events (central mode)");
            tokio::spawn(accept(
                Arc::downgrade(&hub),
                listener,
                rank as u32,
                budget.clone(),
            ));
        }
        Ok(hub)
    }

    /// The addresses bound, rank by rank.
    pub fn addresses(&self) -> &[String] {
        &self.addresses
    }

    /// Claims `topic`'s batches of `rank` for `worker`. A topic another worker holds is
    /// refused (two engines under one topic would look like restarts of one).
    pub fn claim(
        self: &Arc<Self>,
        topic: &str,
        rank: u32,
        worker: InstanceId,
    ) -> Result<Claim, String> {
        if rank as usize >= self.addresses.len() {
            return Err(format!(
                "rank {rank} has no bound socket (--kv-events-bind gives {}, one per rank)",
                self.addresses.len()
            ));
        }
        let route = (topic.to_string(), rank);
        let mut routes = self.routes.lock();
        if let Some(Holder { worker: holder, .. }) = routes.get(&route)
            && *holder != worker
        {
            return Err(format!(
                "topic `{topic}` is already the events of worker {holder}"
            ));
        }
        let (tx, rx) = mpsc::channel(QUEUE);
        let id = self.claims.fetch_add(1, Ordering::Relaxed);
        routes.insert(
            route.clone(),
            Holder {
                worker,
                claim: id,
                tx,
            },
        );
        Ok(Claim {
            hub: self.clone(),
            route,
            id,
            batches: rx,
        })
    }

    fn dispatch(&self, rank: u32, topic: &[u8], seq: u64, payload: Bytes, held: Grant) {
        let topic = String::from_utf8_lossy(topic);
        let sender = self
            .routes
            .lock()
            .get(&(topic.to_string(), rank))
            .map(|h| h.tx.clone());
        let Some(tx) = sender else {
            let n = self.unrouted.fetch_add(1, Ordering::Relaxed) + 1;
            if n <= 10 || n.is_multiple_of(10_000) {
                tracing::warn!(%topic, rank, unrouted = n, "KV events under a topic no worker names; skipped (set the worker's `topic`)");
            }
            return;
        };
        if tx.try_send((seq, payload, held)).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Accepts engines' connections on one bound address while the hub lives.
async fn accept(
    hub: std::sync::Weak<CentralEvents>,
    listener: tokio::net::TcpListener,
    rank: u32,
    budget: Budget,
) {
    let peers = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // EMFILE and friends: wait instead of spinning.
                tracing::debug!(rank, error = %e, "central KV events accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(h) = hub.upgrade() else { return };
        let Some(peer_slot) = switchyard_bounded::slot::Slot::take(&peers, MAX_PEERS) else {
            h.refused.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        drop(h);
        let (hub, budget) = (hub.clone(), budget.clone());
        tokio::spawn(async move {
            let peer = stream.peer_addr().ok();
            if let Err(e) = receive(&hub, stream, rank, budget).await
                && let Some(h) = hub.upgrade()
            {
                let n = h.refused.fetch_add(1, Ordering::Relaxed) + 1;
                if n <= 10 || n.is_multiple_of(1000) {
                    tracing::warn!(rank, ?peer, error = %e, refused = n, "closed a KV events connection");
                }
            }
            drop(peer_slot);
        });
    }
}

/// Reads one engine's connection until it ends: `Ok` when the peer closed it or the hub
/// is gone, the error when the peer broke the protocol or its bounds.
async fn receive(
    hub: &std::sync::Weak<CentralEvents>,
    stream: tokio::net::TcpStream,
    rank: u32,
    budget: Budget,
) -> Result<(), super::zmtp::ZmtpError> {
    super::zmtp::tune(&stream);
    let mut sub = Connection::handshake(stream, SocketType::Sub, KV_EVENT_LIMITS)
        .await?
        .with_budget(budget);
    sub.subscribe(b"").await?;
    loop {
        let (msg, held) = match sub.recv_held().await {
            Ok(m) => m,
            Err(e) if e.broke_bounds() => return Err(e),
            Err(_) => return Ok(()),
        };
        let Some(hub) = hub.upgrade() else {
            return Ok(());
        };
        // Exactly `[topic, seq, payload]`: the topic names the worker.
        let parsed = (msg.len() == 3)
            .then(|| super::zmtp::topic_frames(msg))
            .flatten()
            .and_then(|(topic, seq, payload)| Some((topic?, seq, payload)));
        match parsed {
            Some((topic, seq, payload)) => hub.dispatch(rank, &topic, seq, payload, held),
            None => {
                hub.malformed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hub bound on a free loopback port, and the port.
    async fn bound_hub() -> (Arc<CentralEvents>, u16) {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let hub = CentralEvents::bind(&[format!("tcp://127.0.0.1:{port}")], Budget::new(1 << 30))
            .await
            .unwrap();
        (hub, port)
    }

    /// A worker whose feed never drains loses batches past its queue (each a gap its
    /// sequence discipline handles), counted; other workers' batches still go through.
    #[tokio::test]
    async fn a_full_queue_drops_and_counts_without_holding_up_others() {
        let (hub, _) = bound_hub().await;
        let stuck = hub.claim("stuck", 0, InstanceId(1)).unwrap();
        let mut live = hub.claim("live", 0, InstanceId(2)).unwrap();
        for seq in 0..(QUEUE as u64 + 10) {
            hub.dispatch(0, b"stuck", seq, Bytes::new(), Grant::default());
        }
        assert_eq!(hub.dropped.load(Ordering::Relaxed), 10);
        hub.dispatch(0, b"live", 0, Bytes::from_static(b"x"), Grant::default());
        assert_eq!(live.batches.try_recv().unwrap().0, 0);
        // A dropped claim frees its topic.
        drop(stuck);
        assert!(hub.claim("stuck", 0, InstanceId(3)).is_ok());
        // A worker's new claim survives the drop of its old one.
        let old = hub.claim("w", 0, InstanceId(4)).unwrap();
        let mut new = hub.claim("w", 0, InstanceId(4)).unwrap();
        drop(old);
        hub.dispatch(0, b"w", 7, Bytes::new(), Grant::default());
        assert_eq!(
            new.batches.try_recv().unwrap().0,
            7,
            "the old claim's drop took the route"
        );
    }

    /// Anyone who reaches the bound port is read within the bounds: a peer whose first
    /// frame header declares 2^62 bytes is closed and counted, and an engine connecting
    /// next still gets its batches through.
    #[tokio::test]
    async fn a_hostile_peer_on_the_bound_port_is_closed_and_counted() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (hub, port) = bound_hub().await;
        let mut hostile = super::super::zmtp::hello(b"PUB");
        hostile.push(0x02);
        hostile.extend_from_slice(&(1u64 << 62).to_be_bytes());
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        s.write_all(&hostile).await.unwrap();
        // The router closes it: reads end.
        let mut sink = vec![0u8; 1024];
        while s.read(&mut sink).await.is_ok_and(|n| n > 0) {}
        // Counted just after the close: wait for the count, bounded.
        for _ in 0..500 {
            if hub.refused.load(Ordering::Relaxed) == 1 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(hub.refused.load(Ordering::Relaxed), 1);
        // An engine after it is heard.
        let mut claim = hub.claim("w", 0, InstanceId(1)).unwrap();
        let mut engine = super::super::zmtp::hello(b"PUB");
        for (flags, body) in [
            (1u8, &b"w"[..]),
            (1, &5u64.to_be_bytes()[..]),
            (0, &b"batch"[..]),
        ] {
            engine.extend_from_slice(&[flags, body.len() as u8]);
            engine.extend_from_slice(body);
        }
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        s.write_all(&engine).await.unwrap();
        let (seq, payload, _) = claim.batches.recv().await.unwrap();
        assert_eq!((seq, &payload[..]), (5, &b"batch"[..]));
    }
}
