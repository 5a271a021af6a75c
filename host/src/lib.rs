//! Switchyard: a KV-cache-aware request router for LLM inference fleets whose routing
//! strategy is a sandboxed WebAssembly component.
//!
//! Modules, each with one job:
//! - [`ids`]: the newtypes every other module speaks in (`InstanceId`).
//! - [`policy`]: the Wasm policy runtime — loading, sandboxing, calling and hot-swapping
//!   routing policies, with the native `kv-cost` fallback. The only module that knows
//!   wasmtime.

pub mod ids;
pub mod policy;
