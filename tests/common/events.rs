//! A real HTTP server speaking the KV event stream protocol for a scripted worker cache.

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody, combinators::BoxBody};
use hyper::Response;
use hyper::body::Frame;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use switchyard::kv::events::KvEvent;
use tokio::sync::mpsc;

#[derive(Default)]
struct State {
    blocks: BTreeSet<u64>,
    seq: u64,
    streams: Vec<mpsc::UnboundedSender<Bytes>>,
    /// Every stream's snapshot is followed at once by a sequence gap (a broken publisher).
    gap_every_stream: bool,
}

/// A worker's cache and its event stream at `http://{addr}/events`.
#[derive(Clone)]
pub struct EventServer {
    pub url: String,
    state: Arc<Mutex<State>>,
    pub connections: Arc<AtomicU64>,
}

impl EventServer {
    pub async fn start(initial: &[u64]) -> EventServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State {
            blocks: initial.iter().copied().collect(),
            ..Default::default()
        }));
        let connections = Arc::new(AtomicU64::new(0));
        let server = EventServer {
            url: format!("http://{addr}/events"),
            state: state.clone(),
            connections: connections.clone(),
        };
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (state, connections) = (state.clone(), connections.clone());
                tokio::spawn(async move {
                    let service = service_fn(move |_req| {
                        connections.fetch_add(1, Ordering::SeqCst);
                        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
                        {
                            let mut s = state.lock();
                            let snapshot = KvEvent::Snapshot {
                                seq: s.seq,
                                block_size: 16,
                                blocks: s.blocks.iter().copied().collect(),
                            };
                            tx.send(Bytes::from(snapshot.to_line())).unwrap();
                            if s.gap_every_stream {
                                let gap = KvEvent::Cleared { seq: s.seq + 2 };
                                tx.send(Bytes::from(gap.to_line())).unwrap();
                            }
                            s.streams.push(tx);
                        }
                        let stream = futures_stream(rx);
                        let body: BoxBody<Bytes, Infallible> = StreamBody::new(stream).boxed();
                        async move { Ok::<_, Infallible>(Response::new(body)) }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        server
    }

    fn broadcast(s: &mut State, line: String) {
        s.streams
            .retain(|tx| tx.send(Bytes::from(line.clone())).is_ok());
    }

    pub fn store(&self, blocks: &[u64]) {
        let mut s = self.state.lock();
        s.seq += 1;
        s.blocks.extend(blocks);
        let line = KvEvent::Stored {
            seq: s.seq,
            parent: None,
            blocks: blocks.to_vec(),
        }
        .to_line();
        Self::broadcast(&mut s, line);
    }

    pub fn remove(&self, blocks: &[u64]) {
        let mut s = self.state.lock();
        s.seq += 1;
        for b in blocks {
            s.blocks.remove(b);
        }
        let line = KvEvent::Removed {
            seq: s.seq,
            blocks: blocks.to_vec(),
        }
        .to_line();
        Self::broadcast(&mut s, line);
    }

    /// Changes the cache without telling anyone (the event is "lost"), then stores
    /// `blocks` with the next sequence number: subscribers see a gap.
    pub fn lose_an_event_then_store(&self, lost: &[u64], blocks: &[u64]) {
        let mut s = self.state.lock();
        s.seq += 1;
        s.blocks.extend(lost);
        drop(s);
        self.store(blocks);
    }

    /// From now on every stream opens with a snapshot and, right after it, a gap.
    pub fn gap_every_stream(&self) {
        self.state.lock().gap_every_stream = true;
    }

    pub fn send_raw(&self, line: &str) {
        let mut s = self.state.lock();
        Self::broadcast(&mut s, line.to_string());
    }

    pub fn load(&self, used: u64, total: u64) {
        let mut s = self.state.lock();
        let line = KvEvent::Load {
            kv_used_blocks: used,
            kv_total_blocks: total,
            running: 1,
            waiting: 0,
            itl_sum_us: None,
            itl_count: None,
        }
        .to_line();
        Self::broadcast(&mut s, line);
    }

    /// Ends every open stream (as a worker restart or a network cut would).
    pub fn disconnect_all(&self) {
        self.state.lock().streams.clear();
    }

    pub fn blocks(&self) -> Vec<u64> {
        self.state.lock().blocks.iter().copied().collect()
    }
}

fn futures_stream(
    rx: mpsc::UnboundedReceiver<Bytes>,
) -> impl tokio_stream::Stream<Item = Result<Frame<Bytes>, Infallible>> + Send + Sync + 'static {
    use tokio_stream::StreamExt;
    tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(|b| Ok(Frame::data(b)))
}
