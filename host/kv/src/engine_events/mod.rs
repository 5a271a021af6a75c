//! The KV events real engines publish: vLLM's and SGLang's msgpack batches (the ZMQ
//! transport is in `router::engine_subscriber`). Pure decoding and encoding, no I/O.
//!
//! One ZMQ message is `[topic, seq as 8 bytes big-endian, payload]`; the payload is a
//! batch, either positional `[ts, [events], rank]` (older vLLM, SGLang) or a map
//! `{ts, events, data_parallel_rank}` (current vLLM). Events are maps tagged `"type"`
//! (current vLLM) or positional arrays beginning with the tag (older vLLM, SGLang):
//!
//! | tag | positional fields after the tag |
//! | --- | --- |
//! | `BlockStored` | `block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id`, `medium`, `lora_name`, `extra_keys` |
//! | `BlockRemoved` | `block_hashes`, `medium` |
//! | `AllBlocksCleared` | — |
//!
//! Optional fields may be absent, unknown fields are ignored, unknown event types are
//! reported as [`EngineEvent::Unknown`]. Engine block hashes are unsigned (vLLM) or signed
//! (SGLang) 64-bit integers, or byte strings; all become a `u64` ([`engine_hash`]). They
//! depend on each engine process's random seed, so the router never indexes them: it
//! re-hashes `token_ids` with its own chain (`kv::engine_view`).
//!
//! - `msgpack`: a bounded msgpack reader that walks values without materialising them;
//! - `decode`: batches and events, both shapes;
//! - `extra`: the extra keys of a block (LoRA, multimodal), hashed as the engines do;
//! - `encode`: the same batches written, for the mock worker and the tests.

mod decode;
mod encode;
mod extra;
mod msgpack;
#[cfg(test)]
mod tests;

pub use decode::{decode_batch, engine_hash};
pub use encode::{EventOut, Shape, StoredOut, encode_batch};
pub use extra::{ExtraKey, extra_hash};

/// A decoding failure: the payload is not a batch of the shape above.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not an engine KV event batch: {0}")]
pub struct DecodeError(pub String);

pub(crate) fn bad(why: impl Into<String>) -> DecodeError {
    DecodeError(why.into())
}

/// One decoded batch.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineBatch {
    /// The engine's wall-clock time of the batch, seconds since the epoch.
    pub ts: f64,
    /// Its data-parallel rank, when the engine says.
    pub rank: Option<u32>,
    /// The events, in order.
    pub events: Vec<EngineEvent>,
}

/// Where a block lives. Only GPU blocks count as cached for routing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Medium {
    /// The engine's GPU cache (also when the event names no medium).
    Gpu,
    /// Another tier (`"CPU"`, `"DISK"`, …): offloaded copies.
    Other(String),
}

/// Blocks that became cached.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredBlocks {
    /// The engine's hashes of the blocks, in prompt order.
    pub hashes: Vec<u64>,
    /// The engine's hash of the block before the first one (none for a prompt's start).
    pub parent: Option<u64>,
    /// The blocks' tokens, `hashes.len() × block_size` of them.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// Where the blocks are.
    pub medium: Medium,
    /// Per block: a hash of the engine's extra keys (LoRA name, multimodal IDs,
    /// `cache_salt`, …), 0 for none. Empty when the event carries none at all.
    pub extra: Vec<u64>,
    /// The KV cache group (hybrid models publish one event per group); 0 when absent.
    pub group: u32,
}

/// One engine event.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// `BlockStored`.
    Stored(StoredBlocks),
    /// `BlockRemoved`.
    Removed {
        /// The engine's hashes.
        hashes: Vec<u64>,
        /// Where they were.
        medium: Medium,
        /// The KV cache group.
        group: u32,
    },
    /// `AllBlocksCleared`.
    Cleared,
    /// An event type this router does not know (counted and skipped).
    Unknown(String),
}
