//! The policy sandbox: the only capabilities a guest gets.
//!
//! A policy is an ordinary `wasm32-wasip2` component, so it imports WASI. Every import
//! is satisfied, but none reaches the host:
//! - no preopened directories, no environment variables, no arguments, no stdin;
//! - sockets, UDP and name lookup are denied;
//! - both clocks are frozen at zero (a policy gets time only through the request);
//! - stdout and stderr go to the host's log, line by line, rate-limited per policy.
//!
//! Policies are called synchronously on the host's async worker threads, where WASI's
//! stock "blocking" stream and poll functions cannot run (they would start a nested
//! async runtime). The `wasi:io` interfaces are therefore implemented here without
//! blocking: output to the guest log is always ready, and a guest that would really
//! wait (on a pollable that is not ready) traps, which the runtime treats as a policy
//! failure. A policy has nothing to wait for.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;
use wasmtime::ResourceLimiter;
use wasmtime::component::{HasData, Linker, Resource, ResourceTable};
use wasmtime_wasi::cli::{IsTerminal, StdoutStream, WasiCli, WasiCliView};
use wasmtime_wasi::clocks::{WasiClocks, WasiClocksView};
use wasmtime_wasi::filesystem::{WasiFilesystem, WasiFilesystemView};
use wasmtime_wasi::p2::bindings::sync::io::{poll as sync_poll, streams as sync_streams};
use wasmtime_wasi::p2::bindings::{cli, clocks, filesystem, random, sockets};
use wasmtime_wasi::random::WasiRandom;
use wasmtime_wasi::sockets::{WasiSockets, WasiSocketsView};
use wasmtime_wasi::{
    HostMonotonicClock, HostWallClock, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView,
};
use wasmtime_wasi_io::bindings::wasi::io::poll as async_poll;
use wasmtime_wasi_io::bindings::wasi::io::streams as async_streams;
use wasmtime_wasi_io::poll::{DynPollable, Pollable};
use wasmtime_wasi_io::streams::{
    DynInputStream, DynOutputStream, OutputStream, StreamError, StreamResult,
};

/// The data of one guest instance's `Store`.
pub(crate) struct HostState {
    wasi: WasiCtx,
    table: ResourceTable,
    pub(crate) limits: InstanceLimits,
}

impl HostState {
    pub(crate) fn new(log: &Arc<GuestLog>, limits: InstanceLimits) -> HostState {
        let wasi = WasiCtxBuilder::new()
            .stdout(LogSink {
                log: log.clone(),
                stream: "stdout",
            })
            .stderr(LogSink {
                log: log.clone(),
                stream: "stderr",
            })
            .wall_clock(FrozenClock)
            .monotonic_clock(FrozenClock)
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .build();
        HostState {
            wasi,
            table: ResourceTable::new(),
            limits,
        }
    }
}

/// The linear memory all policy instances of a process hold together, and its cap.
#[derive(Debug)]
pub(crate) struct MemoryBudget {
    used: AtomicUsize,
    cap: usize,
}

impl MemoryBudget {
    pub(crate) fn new(cap: usize) -> Arc<MemoryBudget> {
        Arc::new(MemoryBudget {
            used: AtomicUsize::new(0),
            cap,
        })
    }

    /// Bytes held by live instances now.
    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }
}

/// One instance's resource limits: its own memory cap, its share of the process-wide
/// [`MemoryBudget`] (returned when the instance is dropped), and fixed bounds on tables,
/// instances and memories. Growth past a limit traps (it never fails silently inside
/// the guest), so the call is counted as a policy failure.
pub(crate) struct InstanceLimits {
    memory_cap: usize,
    budget: Arc<MemoryBudget>,
    /// Bytes this instance has taken from the budget.
    held: usize,
    /// The last growth granted, given back if the allocation itself then fails.
    last_grant: usize,
}

impl InstanceLimits {
    pub(crate) fn new(memory_cap: usize, budget: Arc<MemoryBudget>) -> InstanceLimits {
        InstanceLimits {
            memory_cap,
            budget,
            held: 0,
            last_grant: 0,
        }
    }
}

impl Drop for InstanceLimits {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.held, Ordering::Relaxed);
    }
}

impl ResourceLimiter for InstanceLimits {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.memory_cap || maximum.is_some_and(|max| desired > max) {
            wasmtime::bail!("forcing trap when growing memory to {desired} bytes (over the limit)");
        }
        let grow = desired.saturating_sub(current);
        let budget = &self.budget;
        let taken = budget
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                used.checked_add(grow).filter(|&total| total <= budget.cap)
            });
        if taken.is_err() {
            wasmtime::bail!(
                "forcing trap when growing memory to {desired} bytes: all policy instances \
                 together would pass the memory limit of {} bytes",
                budget.cap
            );
        }
        self.held += grow;
        self.last_grant = grow;
        Ok(true)
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.budget
            .used
            .fetch_sub(self.last_grant, Ordering::Relaxed);
        self.held -= self.last_grant;
        self.last_grant = 0;
        Err(error.context("forcing a memory growth failure to be a trap"))
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > MAX_TABLE_ELEMENTS || maximum.is_some_and(|max| desired > max) {
            wasmtime::bail!("forcing trap when growing table to {desired} elements");
        }
        Ok(true)
    }

    fn table_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        Err(error.context("forcing a table growth failure to be a trap"))
    }

    fn instances(&self) -> usize {
        64
    }

    fn tables(&self) -> usize {
        64
    }

    fn memories(&self) -> usize {
        4
    }
}

const MAX_TABLE_ELEMENTS: usize = 1 << 16;

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// Adds every WASI 0.2 interface to `linker`, as described in the module doc.
pub(crate) fn add_to_linker(l: &mut Linker<HostState>) -> wasmtime::Result<()> {
    type T = HostState;
    clocks::wall_clock::add_to_linker::<T, WasiClocks>(l, T::clocks)?;
    clocks::monotonic_clock::add_to_linker::<T, FrozenMonotonic>(l, |t| {
        FrozenTimers(&mut t.table)
    })?;
    filesystem::preopens::add_to_linker::<T, WasiFilesystem>(l, T::filesystem)?;
    wasmtime_wasi::p2::bindings::sync::filesystem::types::add_to_linker::<T, WasiFilesystem>(
        l,
        T::filesystem,
    )?;
    random::random::add_to_linker::<T, WasiRandom>(l, |t| t.wasi.random())?;
    random::insecure::add_to_linker::<T, WasiRandom>(l, |t| t.wasi.random())?;
    random::insecure_seed::add_to_linker::<T, WasiRandom>(l, |t| t.wasi.random())?;
    cli::exit::add_to_linker::<T, WasiCli>(l, T::cli)?;
    cli::environment::add_to_linker::<T, WasiCli>(l, T::cli)?;
    cli::stdin::add_to_linker::<T, WasiCli>(l, T::cli)?;
    cli::stdout::add_to_linker::<T, WasiCli>(l, T::cli)?;
    cli::stderr::add_to_linker::<T, WasiCli>(l, T::cli)?;
    cli::terminal_input::add_to_linker::<T, WasiCli>(l, T::cli)?;
    cli::terminal_output::add_to_linker::<T, WasiCli>(l, T::cli)?;
    cli::terminal_stdin::add_to_linker::<T, WasiCli>(l, T::cli)?;
    cli::terminal_stdout::add_to_linker::<T, WasiCli>(l, T::cli)?;
    cli::terminal_stderr::add_to_linker::<T, WasiCli>(l, T::cli)?;
    sockets::tcp_create_socket::add_to_linker::<T, WasiSockets>(l, T::sockets)?;
    sockets::instance_network::add_to_linker::<T, WasiSockets>(l, T::sockets)?;
    sockets::network::add_to_linker::<T, WasiSockets>(l, &Default::default(), T::sockets)?;
    sockets::ip_name_lookup::add_to_linker::<T, WasiSockets>(l, T::sockets)?;
    wasmtime_wasi::p2::bindings::sync::sockets::tcp::add_to_linker::<T, WasiSockets>(
        l,
        T::sockets,
    )?;
    wasmtime_wasi::p2::bindings::sync::sockets::udp::add_to_linker::<T, WasiSockets>(
        l,
        T::sockets,
    )?;
    wasmtime_wasi::p2::bindings::sync::sockets::udp_create_socket::add_to_linker::<T, NoUdp>(
        l,
        |_| DeniedUdp,
    )?;
    wasmtime_wasi_io::bindings::wasi::io::error::add_to_linker::<T, TableIo>(l, |t| &mut t.table)?;
    sync_poll::add_to_linker::<T, NonBlockingIo>(l, |t| NonBlocking(&mut t.table))?;
    sync_streams::add_to_linker::<T, NonBlockingIo>(l, |t| NonBlocking(&mut t.table))?;
    Ok(())
}

/// `wasi:io/error`, straight from the resource table.
struct TableIo;

impl HasData for TableIo {
    type Data<'a> = &'a mut ResourceTable;
}

/// `wasi:sockets/udp-create-socket`, refused here: wasmtime-wasi's synchronous version
/// enters a Tokio runtime to create the socket, which panics on the router's worker
/// threads (a runtime within a runtime) before the policy could even be told no.
struct NoUdp;

impl HasData for NoUdp {
    type Data<'a> = DeniedUdp;
}

struct DeniedUdp;

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
struct FrozenMonotonic;

impl HasData for FrozenMonotonic {
    type Data<'a> = FrozenTimers<'a>;
}

struct FrozenTimers<'a>(&'a mut ResourceTable);

/// A clock subscription: ready now (a zero wait), or never.
struct Deadline {
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
struct NonBlockingIo;

impl HasData for NonBlockingIo {
    type Data<'a> = NonBlocking<'a>;
}

pub(crate) struct NonBlocking<'a>(&'a mut ResourceTable);

fn would_block(what: &str) -> wasmtime::Error {
    wasmtime::format_err!("the policy would block in {what}; policies may not wait")
}

/// Polls a readiness future once; `true` when it is ready now.
fn ready_now<F: Future>(fut: F) -> bool {
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

type Out = Resource<DynOutputStream>;
type In = Resource<DynInputStream>;

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
struct FrozenClock;

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

struct Bucket {
    tokens: f64,
    last: Instant,
    suppressed_since_last: u64,
}

/// Longest line logged; the rest of a longer line is dropped.
const MAX_LINE: usize = 1024;

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
struct LogSink {
    log: Arc<GuestLog>,
    stream: &'static str,
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
struct LogStream {
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
