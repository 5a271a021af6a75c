//! What makes routing KV-aware, as pure data structures: no I/O, no Tokio, no clock
//! (time is passed in).
//!
//! - [`hash`]: token IDs → chained block hashes (`h[i] = H(h[i-1], block i)`).
//! - [`index`]: which worker caches which blocks; for a request, how many leading blocks
//!   each worker holds.
//! - [`approx`]: the same answer for workers that publish no KV events, predicted from
//!   the router's own decisions (TTL and size bound).
//! - [`load`]: per-worker active blocks, pending prefill tokens and in-flight requests.
//! - [`events`]: the wire format of a worker's KV event stream (Switchyard's NDJSON).
//! - [`engine_events`]: the msgpack batches vLLM and SGLang publish over ZMQ.
//! - [`engine_metrics`]: load from engines' Prometheus pages (vLLM's, SGLang's names).
//! - [`engine_view`]: one worker's engine-reported cache in the router's own hashes, with
//!   the sequence discipline of the engines' streams.

pub mod approx;
pub mod engine_events;
pub mod engine_metrics;
pub mod engine_view;
pub mod events;
pub mod hash;
pub mod index;
pub mod load;

/// A `BuildHasher` for keys that are already uniformly distributed hashes: the key's
/// own bits are the hash.
#[derive(Debug, Clone, Copy, Default)]
pub struct PassThrough;

/// The hasher built by [`PassThrough`].
#[derive(Debug, Clone, Copy, Default)]
pub struct PassThroughHasher(u64);

impl std::hash::Hasher for PassThroughHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only reached for keys other than a single u64; fold them in.
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 ^= n;
    }
}

impl std::hash::BuildHasher for PassThrough {
    type Hasher = PassThroughHasher;
    fn build_hasher(&self) -> PassThroughHasher {
        PassThroughHasher(0)
    }
}

/// A `BuildHasher` for `u64` keys that may not be uniformly distributed (engines' block
/// hashes: some are counters or small integers): one multiply and a fold.
#[derive(Debug, Clone, Copy, Default)]
pub struct Mixed;

/// The hasher built by [`Mixed`].
#[derive(Debug, Clone, Copy, Default)]
pub struct MixedHasher(u64);

impl std::hash::Hasher for MixedHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        let m = u128::from(self.0 ^ n ^ 0x243f_6a88_85a3_08d3) * 0x9e37_79b9_7f4a_7c15;
        self.0 = (m as u64) ^ ((m >> 64) as u64);
    }
}

impl std::hash::BuildHasher for Mixed {
    type Hasher = MixedHasher;
    fn build_hasher(&self) -> MixedHasher {
        MixedHasher(0)
    }
}
