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
//!
//! - this module: the store's data, the memory limits, and the linker's imports;
//! - `wasi`: WASI denied, frozen and made non-blocking;
//! - `log`: the guest's output, line by line and rate-limited, into the host's log.

mod log;
mod wasi;

pub(crate) use log::GuestLog;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use wasmtime::ResourceLimiter;
use wasmtime::component::{Linker, ResourceTable};
use wasmtime_wasi::cli::{WasiCli, WasiCliView};
use wasmtime_wasi::clocks::{WasiClocks, WasiClocksView};
use wasmtime_wasi::filesystem::{WasiFilesystem, WasiFilesystemView};
use wasmtime_wasi::p2::bindings::sync::io::{poll as sync_poll, streams as sync_streams};
use wasmtime_wasi::p2::bindings::{cli, clocks, filesystem, random, sockets};
use wasmtime_wasi::random::WasiRandom;
use wasmtime_wasi::sockets::{WasiSockets, WasiSocketsView};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use log::LogSink;
use wasi::{
    DeniedUdp, FrozenClock, FrozenMonotonic, FrozenTimers, NoUdp, NonBlocking, NonBlockingIo,
    TableIo,
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
