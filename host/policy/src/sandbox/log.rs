//! A guest's stdout and stderr: cut into lines of at most 1 KiB, rate-limited per policy,
//! written to the host's log under the policy's name.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use parking_lot::Mutex;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi_io::poll::Pollable;
use wasmtime_wasi_io::streams::{OutputStream, StreamResult};

/// A policy's stdout and stderr, turned into rate-limited log lines.
///
/// Shared by every instance of one loaded policy. Lines past the rate are counted, not
/// logged; the count is logged with the next line that gets through.
pub(crate) struct GuestLog {
    policy: String,
    lines_per_sec: u32,
    bucket: Mutex<Bucket>,
    logged: AtomicU64,
    suppressed: AtomicU64,
}

pub(super) struct Bucket {
    tokens: f64,
    last: Instant,
    suppressed_since_last: u64,
}

/// Longest line logged; the rest of a longer line is dropped.
pub(super) const MAX_LINE: usize = 1024;

impl GuestLog {
    pub(crate) fn new(policy: &str, lines_per_sec: u32) -> Arc<GuestLog> {
        Arc::new(GuestLog {
            policy: policy.to_string(),
            lines_per_sec,
            bucket: Mutex::new(Bucket {
                tokens: f64::from(lines_per_sec),
                last: Instant::now(),
                suppressed_since_last: 0,
            }),
            logged: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        })
    }

    /// Lines written to the host log so far.
    pub(crate) fn logged(&self) -> u64 {
        self.logged.load(Ordering::Relaxed)
    }

    /// Lines dropped by the rate limit so far.
    pub(crate) fn suppressed(&self) -> u64 {
        self.suppressed.load(Ordering::Relaxed)
    }

    fn line(&self, stream: &str, line: &[u8]) {
        let now = Instant::now();
        let suppressed = {
            let mut b = self.bucket.lock();
            let rate = f64::from(self.lines_per_sec);
            b.tokens = (b.tokens + now.duration_since(b.last).as_secs_f64() * rate).min(rate);
            b.last = now;
            if b.tokens < 1.0 {
                b.suppressed_since_last += 1;
                self.suppressed.fetch_add(1, Ordering::Relaxed);
                return;
            }
            b.tokens -= 1.0;
            std::mem::take(&mut b.suppressed_since_last)
        };
        self.logged.fetch_add(1, Ordering::Relaxed);
        let text = String::from_utf8_lossy(&line[..line.len().min(MAX_LINE)]);
        if suppressed > 0 {
            tracing::warn!(target: "switchyard::policy::guest", policy = %self.policy, suppressed, "guest output rate-limited");
        }
        tracing::info!(target: "switchyard::policy::guest", policy = %self.policy, stream, "{text}");
    }
}

/// The factory WASI asks for a guest stdout/stderr stream.
pub(super) struct LogSink {
    pub(super) log: Arc<GuestLog>,
    pub(super) stream: &'static str,
}

impl IsTerminal for LogSink {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for LogSink {
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(tokio::io::sink())
    }
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(LogStream {
            log: self.log.clone(),
            stream: self.stream,
            pending: Vec::new(),
        })
    }
}

/// One open guest output stream: splits bytes into lines for [`GuestLog`].
pub(super) struct LogStream {
    log: Arc<GuestLog>,
    stream: &'static str,
    pending: Vec<u8>,
}

#[async_trait::async_trait]
impl Pollable for LogStream {
    async fn ready(&mut self) {}
}

impl OutputStream for LogStream {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        for &b in bytes.iter() {
            if b == b'\n' {
                self.log.line(self.stream, &self.pending);
                self.pending.clear();
            } else if self.pending.len() < MAX_LINE {
                self.pending.push(b);
            }
        }
        Ok(())
    }
    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }
    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(1 << 20)
    }
}

impl Drop for LogStream {
    fn drop(&mut self) {
        if !self.pending.is_empty() {
            self.log.line(self.stream, &self.pending);
        }
    }
}
