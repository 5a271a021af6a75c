//! Switchyard: a KV-cache-aware request router for LLM inference fleets whose routing
//! strategy is a sandboxed WebAssembly component.
//!
//! Modules, each with one job:
//! - [`ids`]: the newtypes every other module speaks in (`InstanceId`).
//! - [`discovery`]: which instances serve an endpoint (etcd or a fixed list), and worker
//!   registration in etcd. The only module that knows etcd.
//! - [`client`]: the per-endpoint `Client` — discovered and *available* instances,
//!   instance-down reports and re-admission — shared through `ClientRegistry`.
//! - [`http`]: the front door — OpenAI-compatible routes, the proxy with failover, the
//!   admin API, health and metrics. Never reads etcd.
//! - [`kv`]: block hashing, the KV overlap index, approximate mode, load tracking and the
//!   worker event format — pure data structures, no I/O, no clock.
//! - [`lines`]: newline-delimited records arriving in pieces (NDJSON and etcd watch
//!   streams), each byte searched once.
//! - [`policy`]: the Wasm policy runtime — loading, sandboxing, calling and hot-swapping
//!   routing policies, with the native `kv-cost` fallback. The only module that knows
//!   wasmtime.
//! - [`router`]: `KvRouter`, one per endpoint — candidates from the shared `Client`, the
//!   index and the load tracker, decided by the endpoint's policy — and the subscriber
//!   that keeps the index in step with the workers' KV event streams.
//! - `slot`: one unit of a bounded count, given back when dropped (the front door's
//!   limits, central mode's peers).
//! - [`serve`]: `switchyard serve` — discovery, clients, policies, routers and the front
//!   door wired together; [`config`] resolves its flags, environment and TOML file.
//! - [`tokens`]: text → token IDs (built-in or Hugging Face `tokenizer.json`) and the chat
//!   template; shared by the router and the mock worker.
//! - [`local`]: a whole fleet (mock workers + router) in one process, for the demo,
//!   replay and benchmarks.
//! - [`replay`]: replaying Mooncake traces through the real router, policy by policy.
//! - [`openai`]: the OpenAI-compatible request format and error bodies.
//! - [`worker`]: the mock worker, a simulated LLM engine (KV cache with LRU eviction,
//!   continuous batching, timing model, KV events, fault injection).

pub use switchyard_discovery as discovery;
pub use switchyard_router::client;
pub use switchyard_server::config;
#[cfg(test)]
mod fuzz;
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
