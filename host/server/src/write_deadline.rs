//! A client connection whose writes must make progress: a client that stops reading (its
//! receive window full, the router's send buffer full) for longer than the client
//! timeout gets its connection closed, which ends the response, gives back its in-flight
//! slot and drops the upstream request. Without it a streaming client that stops reading
//! holds both for as long as the worker generates.
//!
//! Only a write the kernel refuses starts the clock, and any progress stops it: a slow
//! but reading client is never cut, and a response that waits on its worker is the
//! stream idle timeout's business, not this one's.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// `S` with writes that fail with `TimedOut` once stalled for `limit`.
pub struct WriteDeadline<S> {
    inner: S,
    limit: Duration,
    /// Started by the first refused write of a stall; cleared by any progress.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteDeadline<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, limit: Duration) -> WriteDeadline<S> {
        WriteDeadline {
            inner,
            limit,
            stalled: None,
        }
    }

    /// The wrapped stream.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    fn pending<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let limit = self.limit;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing for {limit:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn progress<T>(&mut self, r: Poll<io::Result<T>>, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        match r {
            Poll::Ready(r) => {
                self.stalled = None;
                Poll::Ready(r)
            }
            Poll::Pending => self.pending(cx),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteDeadline<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.progress(r, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.progress(r, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.progress(r, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.progress(r, cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// A peer that never reads: writes fill the pipe, then fail once stalled for the
    /// limit (paused time).
    #[tokio::test(start_paused = true)]
    async fn a_peer_that_never_reads_times_out_and_one_that_reads_does_not() {
        let (near, far) = tokio::io::duplex(1024);
        let mut w = WriteDeadline::new(near, Duration::from_secs(5));
        let chunk = vec![0u8; 512];
        let e = async {
            loop {
                w.write_all(&chunk).await?;
            }
            #[allow(unreachable_code)]
            Ok::<(), io::Error>(())
        }
        .await
        .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        drop(far);

        let (near, mut far) = tokio::io::duplex(1024);
        let mut w = WriteDeadline::new(near, Duration::from_secs(5));
        let reader = tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let mut buf = vec![0u8; 256];
            let mut total = 0;
            // Reads slowly: 256 bytes every 4 s, under the 5 s limit.
            while total < 8192 {
                tokio::time::sleep(Duration::from_secs(4)).await;
                total += far.read(&mut buf).await.unwrap();
            }
        });
        for _ in 0..16 {
            w.write_all(&chunk).await.unwrap();
        }
        drop(w);
        reader.await.unwrap();
    }
}
