//! Switchyard: a KV-cache-aware request router for LLM inference fleets whose routing
//! strategy is a sandboxed WebAssembly component.
//!
//! Modules, each with one job:
//! - [`ids`]: the newtypes every other module speaks in (`InstanceId`).
//! - [`discovery`]: which instances serve an endpoint (etcd or a fixed list), and worker
//!   registration in etcd. The only module that knows etcd.
//! - [`client`]: the per-endpoint `Client` — discovered and *available* instances,
//!   instance-down reports and re-admission — shared through `ClientRegistry`.
//! - [`policy`]: the Wasm policy runtime — loading, sandboxing, calling and hot-swapping
//!   routing policies, with the native `kv-cost` fallback. The only module that knows
//!   wasmtime.

pub mod client;
pub mod discovery;
pub mod ids;
pub mod policy;
