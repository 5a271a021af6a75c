//! What makes routing KV-aware, as pure data structures: no I/O, no Tokio, no clock
//! (time is passed in).
//!
//! - [`hash`]: token IDs → chained block hashes (`h[i] = H(h[i-1], block i)`).
//! - [`index`]: which worker caches which blocks; for a request, how many leading blocks
//!   each worker holds.
//! - [`approx`]: the same answer for workers that publish no KV events, predicted from
//!   the router's own decisions (TTL and size bound).
//! - [`load`]: per-worker active blocks, pending prefill tokens and in-flight requests.
//! - [`latency`]: per-worker predicted time to first token and per output token,
//!   learned online.
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
pub mod latency;
pub mod load;

/// The `BuildHasher` of every map keyed by block hashes, the router's or an engine's:
/// foldhash (a multiply and a fold per `u64`) with a random seed per map. Keys come from
/// outside — a worker's NDJSON stream names block hashes directly, an engine names its
/// own, a client's token-ID prompt chooses the router's — so an unkeyed function (the
/// key's own bits, or a fixed multiply) would let them be ground offline into one bucket,
/// making every insert under the index's write lock walk a long probe sequence.
pub type Keyed = foldhash::fast::RandomState;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    /// Keys chosen to share their low 48 bits (what a hash table buckets by, with an
    /// identity hash) land in different buckets, and two maps disagree on where.
    #[test]
    fn keys_ground_to_share_low_bits_spread_over_buckets() {
        let (a, b) = (Keyed::default(), Keyed::default());
        let keys: Vec<u64> = (0..10_000u64).map(|i| (i << 48) | 0x5eed).collect();
        let buckets = |s: &Keyed| {
            keys.iter()
                .map(|k| s.hash_one(switchyard_ids::BlockHash(*k)) & 0xffff)
                .collect::<std::collections::HashSet<_>>()
                .len()
        };
        assert!(buckets(&a) > 5_000, "{} buckets", buckets(&a));
        let same = keys
            .iter()
            .filter(|k| a.hash_one(**k) == b.hash_one(**k))
            .count();
        assert!(
            same < 10,
            "two maps share {same} hashes: the seed is not random"
        );
    }
}
