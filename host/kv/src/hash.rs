//! Block hashing. A prompt's token IDs are cut into blocks of `block_size` tokens; each
//! full block is hashed together with its parent's hash (XXH3-64 seeded with the parent),
//! so a block hash identifies the whole prefix that ends with it. The trailing partial
//! block is not hashed: engines never share it.
//!
//! The router and the mock worker call the same code, so their hashes agree.

use switchyard_ids::BlockHash;

/// Hashes token IDs into chained block hashes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHasher {
    block_size: usize,
    seed: u64,
}

impl BlockHasher {
    /// A hasher for blocks of `block_size` tokens (at least 1); `seed` is the first
    /// block's parent and separates hash spaces (e.g. per model).
    pub fn new(block_size: u32, seed: u64) -> BlockHasher {
        BlockHasher {
            block_size: block_size.max(1) as usize,
            seed,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size as u32
    }

    /// The hashes of every full block of `tokens`.
    pub fn hashes(&self, tokens: &[u32]) -> Vec<BlockHash> {
        let mut out = Vec::with_capacity(tokens.len() / self.block_size);
        self.hashes_into(tokens, &mut out);
        out
    }

    /// The hashes of a prompt for a LoRA adapter and/or with a `cache_salt` (vLLM's
    /// tenant isolation), as vLLM keys its blocks: every block's extra keys hold the
    /// adapter's name, and the first block's the salt after it, so the whole chain
    /// differs from other adapters', other salts' and plain prompts'. Without either,
    /// [`BlockHasher::hashes`].
    pub fn keyed_hashes(
        &self,
        tokens: &[u32],
        lora: Option<&str>,
        salt: Option<&str>,
    ) -> Vec<BlockHash> {
        use crate::engine_events::{ExtraKey, extra_hash};
        if lora.is_none() && salt.is_none() {
            return self.hashes(tokens);
        }
        let adapter: Vec<ExtraKey<'_>> = lora.map(ExtraKey::Str).into_iter().collect();
        let first: Vec<ExtraKey<'_>> = adapter
            .iter()
            .copied()
            .chain(salt.map(ExtraKey::Str))
            .collect();
        let (first, rest) = (extra_hash(&first), extra_hash(&adapter));
        let mut out = Vec::with_capacity(tokens.len() / self.block_size);
        let mut parent = self.seed;
        for (i, block) in tokens.chunks_exact(self.block_size).enumerate() {
            parent = hash_block(parent, block);
            let extra = if i == 0 { first } else { rest };
            if extra != 0 {
                parent = mix(parent, extra);
            }
            out.push(BlockHash(parent));
        }
        out
    }

    /// Appends the hashes of every full block of `tokens` to `out`.
    pub fn hashes_into(&self, tokens: &[u32], out: &mut Vec<BlockHash>) {
        let mut parent = self.seed;
        for block in tokens.chunks_exact(self.block_size) {
            parent = hash_block(parent, block);
            out.push(BlockHash(parent));
        }
    }
}

/// `H(parent, block)`: XXH3-64 of the block's tokens (little-endian u32s), seeded with
/// the parent hash.
pub fn hash_block(parent: u64, block: &[u32]) -> u64 {
    if cfg!(target_endian = "little") {
        xxhash_rust::xxh3::xxh3_64_with_seed(bytemuck::cast_slice(block), parent)
    } else {
        let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, parent)
    }
}

/// A block's hash with its extra keys' hash (LoRA adapter, `cache_salt`) mixed in.
pub fn mix(h: u64, extra: u64) -> u64 {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&h.to_le_bytes());
    b[8..].copy_from_slice(&extra.to_le_bytes());
    xxhash_rust::xxh3::xxh3_64(&b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn only_full_blocks_are_hashed() {
        let h = BlockHasher::new(4, 0);
        assert_eq!(h.hashes(&[1, 2, 3]).len(), 0);
        assert_eq!(h.hashes(&[1, 2, 3, 4]).len(), 1);
        assert_eq!(h.hashes(&[1, 2, 3, 4, 5, 6, 7]).len(), 1);
        assert_eq!(h.hashes(&(0..16).collect::<Vec<_>>()).len(), 4);
    }

    proptest! {
        #[test]
        fn equal_hashes_mean_equal_prefixes(
            common in proptest::collection::vec(0u32..50, 0..40),
            a in proptest::collection::vec(0u32..50, 0..20),
            b in proptest::collection::vec(0u32..50, 0..20),
        ) {
            let h = BlockHasher::new(4, 7);
            let ta: Vec<u32> = common.iter().chain(&a).copied().collect();
            let tb: Vec<u32> = common.iter().chain(&b).copied().collect();
            let (ha, hb) = (h.hashes(&ta), h.hashes(&tb));
            // Shared full blocks hash the same...
            let shared = common.len() / 4;
            prop_assert_eq!(&ha[..shared], &hb[..shared]);
            // ...and a block hash matches only where the whole prefix matches.
            for i in 0..ha.len().min(hb.len()) {
                let same_prefix = ta[..(i + 1) * 4] == tb[..(i + 1) * 4];
                prop_assert_eq!(ha[i] == hb[i], same_prefix);
            }
        }
    }

    #[test]
    fn the_seed_separates_hash_spaces() {
        let tokens: Vec<u32> = (0..32).collect();
        assert_ne!(
            BlockHasher::new(16, 1).hashes(&tokens),
            BlockHasher::new(16, 2).hashes(&tokens)
        );
    }
}
