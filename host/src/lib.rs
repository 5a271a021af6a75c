//! Switchyard: a KV-cache-aware request router for LLM inference fleets whose routing
//! strategy is a sandboxed WebAssembly component.
//!
//! This library is a facade: each module below is a crate of the workspace (ARCHITECTURE.md
//! has the floors and what each may use), re-exported under one name so that the
//! `switchyard` binary, the integration tests and the benchmarks read as one API.
//!
//! - [`ids`] (`switchyard-ids`): instances, blocks, requests, endpoints.
//! - [`kv`] (`switchyard-kv`): block hashing, the overlap index, approximate mode, load
//!   tracking and event decoding — pure, no I/O, no clock.
//! - [`tokens`], [`openai`] (`switchyard-tokens`): text to token IDs, chat templates, the
//!   OpenAI-compatible request format.
//! - [`net`] (`switchyard-net`): the outbound connector and TLS, error chains, `Lines`,
//!   `Slot`.
//! - [`policy`] (`switchyard-policy`): the Wasm policy runtime, the only crate that knows
//!   wasmtime.
//! - [`discovery`] (`switchyard-discovery`): etcd or a fixed list, registration, signed
//!   policy pushes; the only crate that knows etcd.
//! - [`router`], [`client`] (`switchyard-router`): the per-endpoint `Client` with outlier
//!   detection, `KvRouter`, and the subscribers that feed it.
//! - [`worker`] (`switchyard-worker`): the mock worker, a simulated LLM engine.
//! - [`http`], [`serve`], [`config`] (`switchyard-server`): the front door, the admin API,
//!   metrics, and `switchyard serve` with its configuration.
//! - [`local`], [`replay`] (`switchyard-lab`): fleets in one process, traces and replay.

pub use switchyard_discovery as discovery;
pub use switchyard_router::client;
pub use switchyard_server::config;
#[cfg(test)]
mod fuzz;
pub use switchyard_bounded as bounded;
pub use switchyard_ids as ids;
pub use switchyard_kv as kv;
pub use switchyard_lab::local;
pub use switchyard_lab::replay;
pub use switchyard_net as net;
pub use switchyard_policy as policy;
pub use switchyard_router as router;
pub use switchyard_server as http;
pub use switchyard_server::serve;
pub use switchyard_tokens as tokens;
pub use switchyard_tokens::openai;
pub use switchyard_worker as worker;
