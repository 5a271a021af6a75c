//! A raw-TCP ZMTP publisher that greets like a PUB socket and then misbehaves: the
//! hostile peer of a worker's KV event socket, for tests and the chaos benchmark.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What a hostile publisher sends once its handshake is done.
#[derive(Debug, Clone, Copy)]
pub enum Hostile {
    /// One frame header declaring 2^62 bytes (10 bytes on the wire).
    HugeFrame,
    /// 1-byte frames flagged MORE, without end.
    EndlessMore,
}

/// A raw-TCP ZMTP publisher that greets like a PUB socket and then misbehaves; counts
/// the connections the router makes to it.
pub async fn hostile_publisher(mode: Hostile) -> (String, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let connections = Arc::new(AtomicU64::new(0));
    let counted = connections.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(misbehave(s, mode));
        }
    });
    (endpoint, connections)
}

async fn misbehave(mut s: TcpStream, mode: Hostile) {
    if s.write_all(&switchyard::router::zmtp::hello(b"PUB"))
        .await
        .is_err()
    {
        return;
    }
    let (mut read, mut write) = s.into_split();
    // Whatever the router sends (greeting, READY, subscription) is read and ignored.
    tokio::spawn(async move {
        let mut sink = vec![0u8; 4096];
        while read.read(&mut sink).await.is_ok_and(|n| n > 0) {}
    });
    match mode {
        Hostile::HugeFrame => {
            let mut frame = vec![0x02];
            frame.extend_from_slice(&(1u64 << 62).to_be_bytes());
            let _ = write.write_all(&frame).await;
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
        Hostile::EndlessMore => {
            // Bounded: 64 MiB of frames at most, or until the router hangs up.
            let chunk: Vec<u8> = std::iter::repeat_n([0x01u8, 1, b'x'], 4096)
                .flatten()
                .collect();
            for _ in 0..(64 << 20) / chunk.len() {
                if write.write_all(&chunk).await.is_err() {
                    return;
                }
            }
        }
    }
}
