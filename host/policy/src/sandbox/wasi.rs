//! The WASI a guest gets: sockets and UDP denied, clocks frozen at zero, and `wasi:io`
//! without blocking (a guest that would wait traps).

use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use wasmtime::component::{HasData, Resource, ResourceTable};
use wasmtime_wasi::p2::bindings::clocks;
use wasmtime_wasi::p2::bindings::sync::io::{poll as sync_poll, streams as sync_streams};
use wasmtime_wasi::{HostMonotonicClock, HostWallClock};
use wasmtime_wasi_io::bindings::wasi::io::poll as async_poll;
use wasmtime_wasi_io::bindings::wasi::io::streams as async_streams;
use wasmtime_wasi_io::poll::{DynPollable, Pollable};
use wasmtime_wasi_io::streams::{DynInputStream, DynOutputStream, StreamError, StreamResult};

/// `wasi:io/error`, straight from the resource table.
pub(super) struct TableIo;

impl HasData for TableIo {
    type Data<'a> = &'a mut ResourceTable;
}

/// `wasi:sockets/udp-create-socket`, refused here: wasmtime-wasi's synchronous version
/// enters a Tokio runtime to create the socket, which panics on the router's worker
/// threads (a runtime within a runtime) before the policy could even be told no.
pub(super) struct NoUdp;

impl HasData for NoUdp {
    type Data<'a> = DeniedUdp;
}

pub(super) struct DeniedUdp;

// Required by the bindings of `udp-create-socket` (which uses `network`'s types); the
// `network` interface itself is linked from wasmtime-wasi above, so these are never called.
impl wasmtime_wasi::p2::bindings::sockets::network::HostNetwork for DeniedUdp {
    fn drop(
        &mut self,
        _this: wasmtime::component::Resource<wasmtime_wasi::p2::Network>,
    ) -> wasmtime::Result<()> {
        Ok(())
    }
}

impl wasmtime_wasi::p2::bindings::sockets::network::Host for DeniedUdp {
    fn convert_error_code(
        &mut self,
        error: wasmtime_wasi::p2::SocketError,
    ) -> wasmtime::Result<wasmtime_wasi::p2::bindings::sockets::network::ErrorCode> {
        error.downcast()
    }

    fn network_error_code(
        &mut self,
        _err: wasmtime::component::Resource<wasmtime_wasi_io::bindings::wasi::io::error::Error>,
    ) -> wasmtime::Result<Option<wasmtime_wasi::p2::bindings::sockets::network::ErrorCode>> {
        Ok(None)
    }
}

impl wasmtime_wasi::p2::bindings::sync::sockets::udp_create_socket::Host for DeniedUdp {
    fn create_udp_socket(
        &mut self,
        _family: wasmtime_wasi::p2::bindings::sync::sockets::udp::IpAddressFamily,
    ) -> wasmtime_wasi::p2::SocketResult<wasmtime::component::Resource<wasmtime_wasi::p2::UdpSocket>>
    {
        Err(wasmtime_wasi::p2::bindings::sockets::network::ErrorCode::AccessDenied.into())
    }
}

/// `wasi:clocks/monotonic-clock`, frozen at zero and without timers: wasmtime-wasi's
/// version arms a Tokio timer for every subscription, which panics on a thread without
/// a runtime (`policy check`). Here a zero wait is ready at once and any other never is,
/// so a policy that sleeps is stopped by `poll` as blocking, wherever it runs.
pub(super) struct FrozenMonotonic;

impl HasData for FrozenMonotonic {
    type Data<'a> = FrozenTimers<'a>;
}

pub(super) struct FrozenTimers<'a>(pub(super) &'a mut ResourceTable);

/// A clock subscription: ready now (a zero wait), or never.
pub(super) struct Deadline {
    ready: bool,
}

#[async_trait::async_trait]
impl Pollable for Deadline {
    async fn ready(&mut self) {
        if !self.ready {
            std::future::pending::<()>().await;
        }
    }
}

impl FrozenTimers<'_> {
    fn subscribe(&mut self, ready: bool) -> wasmtime::Result<Resource<DynPollable>> {
        let deadline = self.0.push(Deadline { ready })?;
        wasmtime_wasi_io::poll::subscribe(self.0, deadline)
    }
}

impl clocks::monotonic_clock::Host for FrozenTimers<'_> {
    fn now(&mut self) -> wasmtime::Result<u64> {
        Ok(0)
    }

    fn resolution(&mut self) -> wasmtime::Result<u64> {
        Ok(1)
    }

    fn subscribe_instant(&mut self, when: u64) -> wasmtime::Result<Resource<DynPollable>> {
        // The clock stays at zero: only an instant not after it has come.
        self.subscribe(when == 0)
    }

    fn subscribe_duration(&mut self, duration: u64) -> wasmtime::Result<Resource<DynPollable>> {
        self.subscribe(duration == 0)
    }
}

/// `wasi:io` without blocking; see the module doc.
pub(super) struct NonBlockingIo;

impl HasData for NonBlockingIo {
    type Data<'a> = NonBlocking<'a>;
}

pub(crate) struct NonBlocking<'a>(pub(super) &'a mut ResourceTable);

pub(super) fn would_block(what: &str) -> wasmtime::Error {
    wasmtime::format_err!("the policy would block in {what}; policies may not wait")
}

/// Polls a readiness future once; `true` when it is ready now.
pub(super) fn ready_now<F: Future>(fut: F) -> bool {
    let mut fut = std::pin::pin!(fut);
    matches!(
        fut.as_mut().poll(&mut Context::from_waker(Waker::noop())),
        Poll::Ready(_)
    )
}

impl sync_poll::Host for NonBlocking<'_> {
    fn poll(&mut self, pollables: Vec<Resource<DynPollable>>) -> wasmtime::Result<Vec<u32>> {
        let mut ready = Vec::new();
        for (i, p) in pollables.iter().enumerate() {
            if ready_now(async_poll::HostPollable::ready(
                self.0,
                Resource::new_borrow(p.rep()),
            )) {
                ready.push(i as u32);
            }
        }
        if ready.is_empty() {
            return Err(would_block("wasi:io/poll.poll"));
        }
        Ok(ready)
    }
}

impl sync_poll::HostPollable for NonBlocking<'_> {
    fn ready(&mut self, p: Resource<DynPollable>) -> wasmtime::Result<bool> {
        let mut answer = false;
        let ready = ready_now(async {
            answer = async_poll::HostPollable::ready(self.0, p)
                .await
                .unwrap_or(false);
        });
        Ok(ready && answer)
    }
    fn block(&mut self, p: Resource<DynPollable>) -> wasmtime::Result<()> {
        if ready_now(async_poll::HostPollable::block(self.0, p)) {
            Ok(())
        } else {
            Err(would_block("wasi:io/poll.pollable.block"))
        }
    }
    fn drop(&mut self, p: Resource<DynPollable>) -> wasmtime::Result<()> {
        async_poll::HostPollable::drop(self.0, p)
    }
}

pub(super) type Out = Resource<DynOutputStream>;
pub(super) type In = Resource<DynInputStream>;

impl sync_streams::Host for NonBlocking<'_> {
    fn convert_stream_error(
        &mut self,
        err: StreamError,
    ) -> wasmtime::Result<sync_streams::StreamError> {
        Ok(
            match async_streams::Host::convert_stream_error(self.0, err)? {
                async_streams::StreamError::LastOperationFailed(e) => {
                    sync_streams::StreamError::LastOperationFailed(e)
                }
                async_streams::StreamError::Closed => sync_streams::StreamError::Closed,
            },
        )
    }
}

impl sync_streams::HostOutputStream for NonBlocking<'_> {
    fn drop(&mut self, s: Out) -> wasmtime::Result<()> {
        self.0.delete(s)?;
        Ok(())
    }
    fn check_write(&mut self, s: Out) -> StreamResult<u64> {
        async_streams::HostOutputStream::check_write(self.0, s)
    }
    fn write(&mut self, s: Out, bytes: Vec<u8>) -> StreamResult<()> {
        async_streams::HostOutputStream::write(self.0, s, bytes)
    }
    fn blocking_write_and_flush(&mut self, s: Out, bytes: Vec<u8>) -> StreamResult<()> {
        let stream = self.0.get_mut(&s)?;
        if stream.check_write()? < bytes.len() {
            return Err(StreamError::Trap(would_block(
                "output-stream.blocking-write-and-flush",
            )));
        }
        stream.write(Bytes::from(bytes))?;
        stream.flush()
    }
    fn blocking_write_zeroes_and_flush(&mut self, s: Out, len: u64) -> StreamResult<()> {
        self.blocking_write_and_flush(s, vec![0; len.min(4096) as usize])
    }
    fn subscribe(&mut self, s: Out) -> wasmtime::Result<Resource<DynPollable>> {
        async_streams::HostOutputStream::subscribe(self.0, s)
    }
    fn write_zeroes(&mut self, s: Out, len: u64) -> StreamResult<()> {
        async_streams::HostOutputStream::write_zeroes(self.0, s, len)
    }
    fn flush(&mut self, s: Out) -> StreamResult<()> {
        async_streams::HostOutputStream::flush(self.0, s)
    }
    fn blocking_flush(&mut self, s: Out) -> StreamResult<()> {
        async_streams::HostOutputStream::flush(self.0, s)
    }
    fn splice(&mut self, dst: Out, src: In, len: u64) -> StreamResult<u64> {
        async_streams::HostOutputStream::splice(self.0, dst, src, len)
    }
    fn blocking_splice(&mut self, dst: Out, src: In, len: u64) -> StreamResult<u64> {
        async_streams::HostOutputStream::splice(self.0, dst, src, len)
    }
}

impl sync_streams::HostInputStream for NonBlocking<'_> {
    fn drop(&mut self, s: In) -> wasmtime::Result<()> {
        self.0.delete(s)?;
        Ok(())
    }
    fn read(&mut self, s: In, len: u64) -> StreamResult<Vec<u8>> {
        async_streams::HostInputStream::read(self.0, s, len)
    }
    fn blocking_read(&mut self, s: In, len: u64) -> StreamResult<Vec<u8>> {
        async_streams::HostInputStream::read(self.0, s, len)
    }
    fn skip(&mut self, s: In, len: u64) -> StreamResult<u64> {
        async_streams::HostInputStream::skip(self.0, s, len)
    }
    fn blocking_skip(&mut self, s: In, len: u64) -> StreamResult<u64> {
        async_streams::HostInputStream::skip(self.0, s, len)
    }
    fn subscribe(&mut self, s: In) -> wasmtime::Result<Resource<DynPollable>> {
        async_streams::HostInputStream::subscribe(self.0, s)
    }
}

/// Both WASI clocks, stopped at zero.
pub(super) struct FrozenClock;

impl HostWallClock for FrozenClock {
    fn resolution(&self) -> Duration {
        Duration::from_secs(1)
    }
    fn now(&self) -> Duration {
        Duration::ZERO
    }
}

impl HostMonotonicClock for FrozenClock {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }
    fn now(&self) -> u64 {
        0
    }
}
