//! `switchyard mock-worker`: a simulated LLM engine on the CPU, behaving like a vLLM
//! worker where routing can tell the difference — prefix caching with LRU eviction, a
//! continuous-batching scheduler whose prefill time grows with *uncached* prompt tokens,
//! a KV event stream, load reports, etcd registration, and fault injection.
//!
//! - [`cache`]: the KV cache (pure).
//! - [`engine`]: the scheduler and timing model.
//! - [`server`]: the OpenAI-compatible HTTP server, event stream and admin endpoints.
//! - [`zmq`]: the KV events again, in vLLM's ZMQ format with its replay socket.

pub mod cache;
pub mod engine;
pub mod server;
pub mod zmq;

pub use engine::{DEFAULT_MAX_BATCHED_TOKENS, EngineConfig, EngineStats, TimingModel};
pub use server::{Fault, FaultConfig, MockWorker, MockWorkerConfig, PdConfig, PdProtocol};
