//! Accepted connections held to the listeners' bounds, the same on the front door and the
//! endpoint picker's port: a slot of `--max-connections` each (past it the connection is
//! refused), no Nagle, TCP keepalive (a peer gone without a reset is found by the
//! kernel), and writes that must make progress within the client timeout
//! ([`WriteDeadline`]: a peer that stops reading loses its connection, and what it held).

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::write_deadline::WriteDeadline;
use switchyard_bounded::slot::Slot;

/// An accepted connection within the bounds, holding its slot until it closes.
pub struct Accepted {
    io: WriteDeadline<TcpStream>,
    _slot: Slot,
}

/// `stream` within the bounds: a slot of the `max` counted in `connections`, keepalive,
/// and a write deadline of `write_limit`; the stream back when every slot is taken.
pub fn harden(
    stream: TcpStream,
    connections: &Arc<AtomicUsize>,
    max: usize,
    write_limit: Duration,
) -> Result<Accepted, TcpStream> {
    let _ = stream.set_nodelay(true);
    let Some(slot) = Slot::take(connections, max) else {
        return Err(stream);
    };
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(30))
        .with_interval(Duration::from_secs(10));
    let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive);
    Ok(Accepted {
        io: WriteDeadline::new(stream, write_limit),
        _slot: slot,
    })
}

impl AsyncRead for Accepted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Accepted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl tonic::transport::server::Connected for Accepted {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.get_ref().connect_info()
    }
}
