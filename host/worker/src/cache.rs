//! The simulated engine's KV cache: a fixed number of blocks, prefix reuse across
//! requests, blocks of running requests pinned, free blocks evicted least recently used
//! first. Every store and eviction is appended to an event log with per-worker sequence
//! numbers, the stream the router subscribes to. Pure: no I/O, no clock.

use std::collections::{BTreeMap, HashMap};

use switchyard_ids::BlockHash;
use switchyard_kv::events::KvEvent;

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Running requests using the block; evictable only at 0.
    pins: u32,
    /// Logical time of last use, the key in `lru` while unpinned.
    last_use: u64,
}

/// Not enough free blocks for a request right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheFull {
    /// Blocks needed.
    pub needed: usize,
    /// Blocks that could be freed.
    pub available: usize,
}

/// The blocks a running request holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Its prompt's block hashes (cached now, pinned).
    pub blocks: Vec<BlockHash>,
    /// Blocks it found already cached when admitted.
    pub cached: usize,
    /// Extra unhashed blocks (partial prompt block and generated tokens).
    pub private: usize,
}

/// A prompt's blocks' extra keys, as vLLM keys them: a LoRA adapter's name on every
/// block, a `cache_salt` on the first (the blocks' hashes already include them; the
/// events say them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockKeys {
    /// The adapter the request named, if not the base model.
    pub lora: Option<std::sync::Arc<str>>,
    /// The request's `cache_salt`.
    pub salt: Option<std::sync::Arc<str>>,
}

/// One change to the cache, as published: [`CacheEvent::to_wire`] is the NDJSON stream's
/// form; the ZMQ publisher sends the tokens too, as vLLM does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// Blocks became cached.
    Stored {
        /// Sequence number.
        seq: u64,
        /// The block before the first one.
        parent: Option<u64>,
        /// Hashes, in prompt order.
        blocks: Vec<u64>,
        /// Their tokens (`blocks × block_size`; empty when the request gave none).
        tokens: Vec<u32>,
        /// The request's `cache_salt`, when the run starts at the prompt's first block
        /// (where vLLM puts it in the block's extra keys).
        salt: Option<std::sync::Arc<str>>,
        /// The LoRA adapter the blocks were computed for (in every block's extra keys).
        lora: Option<std::sync::Arc<str>>,
    },
    /// Blocks were evicted.
    Removed {
        /// Sequence number.
        seq: u64,
        /// Hashes.
        blocks: Vec<u64>,
    },
}

impl CacheEvent {
    /// The NDJSON event.
    pub fn to_wire(&self) -> KvEvent {
        match self {
            CacheEvent::Stored {
                seq,
                parent,
                blocks,
                ..
            } => KvEvent::Stored {
                seq: *seq,
                parent: *parent,
                blocks: blocks.clone(),
            },
            CacheEvent::Removed { seq, blocks } => KvEvent::Removed {
                seq: *seq,
                blocks: blocks.clone(),
            },
        }
    }
}

/// A fixed-size KV cache.
#[derive(Debug)]
pub struct KvCache {
    capacity: usize,
    block_size: u32,
    blocks: HashMap<BlockHash, Entry>,
    /// Unpinned cached blocks by last use; the first is evicted first.
    lru: BTreeMap<u64, BlockHash>,
    /// Blocks held privately by running requests.
    private: usize,
    clock: u64,
    seq: u64,
    events: Vec<CacheEvent>,
}

impl KvCache {
    /// An empty cache of `capacity` blocks of `block_size` tokens.
    pub fn new(capacity: usize, block_size: u32) -> KvCache {
        KvCache {
            capacity,
            block_size,
            blocks: HashMap::new(),
            lru: BTreeMap::new(),
            private: 0,
            clock: 0,
            seq: 0,
            events: Vec::new(),
        }
    }

    /// Blocks in total.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks holding data: cached (in use or not) plus private. What admission can
    /// allocate without evicting is the rest.
    pub fn occupied(&self) -> usize {
        self.blocks.len() + self.private
    }

    /// Blocks held by running requests: their pinned prompt blocks plus their private
    /// ones. A cached block no request uses is free in this count, though it stays
    /// reusable until evicted: vLLM's `kv_cache_usage_perc` (its block pool counts such
    /// blocks in the free queue) and SGLang's `token_usage` (evictable radix-cache
    /// tokens left out) mean the same.
    pub fn active(&self) -> usize {
        self.blocks.len() - self.lru.len() + self.private
    }

    /// Blocks holding a cached prefix, in use or not.
    pub fn cached(&self) -> usize {
        self.blocks.len()
    }

    /// Leading blocks of `hashes` that are cached.
    pub fn cached_prefix(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count()
    }

    /// Admits a request: pins its blocks that are cached, stores the others (evicting
    /// least recently used free blocks as needed) and reserves `private` blocks. Only the
    /// leading cached run counts as reused (`Lease::cached`): a block after a miss must
    /// be recomputed anyway. `tokens` are the hashed blocks' tokens, published with the
    /// stored blocks (empty: none published).
    pub fn admit(
        &mut self,
        hashes: &[BlockHash],
        tokens: &[u32],
        private: usize,
    ) -> Result<Lease, CacheFull> {
        self.admit_keyed(hashes, tokens, &BlockKeys::default(), private)
    }

    /// [`KvCache::admit`] for a prompt hashed with extra keys: published with every
    /// stored run (the adapter), and with the run that starts at the first block (the
    /// salt).
    pub fn admit_keyed(
        &mut self,
        hashes: &[BlockHash],
        tokens: &[u32],
        keys: &BlockKeys,
        private: usize,
    ) -> Result<Lease, CacheFull> {
        let cached = self.cached_prefix(hashes);
        let present: Vec<bool> = hashes.iter().map(|h| self.blocks.contains_key(h)).collect();
        let needed = present.iter().filter(|p| !**p).count() + private;
        // Cached blocks that are free now would be pinned, not evicted: don't count them.
        let reusable = hashes
            .iter()
            .zip(&present)
            .filter(|(h, p)| **p && self.blocks[*h].pins == 0)
            .count();
        let free = self.capacity - self.occupied();
        let evictable = self.lru.len() - reusable;
        if needed > free + evictable {
            return Err(CacheFull {
                needed,
                available: free + evictable,
            });
        }
        for (h, p) in hashes.iter().zip(&present) {
            if *p {
                self.pin(*h);
            }
        }
        let mut evicted = Vec::new();
        while self.capacity - self.occupied() < needed {
            let (_, victim) = self.lru.pop_first().expect("counted as evictable");
            self.blocks.remove(&victim);
            evicted.push(victim.0);
        }
        if !evicted.is_empty() {
            self.seq += 1;
            self.events.push(CacheEvent::Removed {
                seq: self.seq,
                blocks: evicted,
            });
        }
        // Store the missing blocks, one `stored` event per consecutive run.
        let bs = self.block_size as usize;
        let tokens = if tokens.len() == hashes.len() * bs {
            tokens
        } else {
            &[]
        };
        let mut run: Vec<u64> = Vec::new();
        let mut run_start = 0;
        let mut parent: Option<u64> = None;
        for (i, (h, p)) in hashes.iter().zip(&present).enumerate() {
            if *p {
                self.flush_stored(&mut run, parent, tokens, run_start, keys);
                parent = Some(h.0);
                continue;
            }
            if run.is_empty() {
                parent = i.checked_sub(1).map(|j| hashes[j].0);
                run_start = i;
            }
            self.clock += 1;
            self.blocks.insert(
                *h,
                Entry {
                    pins: 1,
                    last_use: self.clock,
                },
            );
            run.push(h.0);
        }
        self.flush_stored(&mut run, parent, tokens, run_start, keys);
        self.private += private;
        Ok(Lease {
            blocks: hashes.to_vec(),
            cached,
            private,
        })
    }

    fn flush_stored(
        &mut self,
        run: &mut Vec<u64>,
        parent: Option<u64>,
        tokens: &[u32],
        start: usize,
        keys: &BlockKeys,
    ) {
        if !run.is_empty() {
            self.seq += 1;
            let bs = self.block_size as usize;
            let tokens = if tokens.is_empty() {
                Vec::new()
            } else {
                tokens[start * bs..(start + run.len()) * bs].to_vec()
            };
            self.events.push(CacheEvent::Stored {
                seq: self.seq,
                parent,
                blocks: std::mem::take(run),
                tokens,
                salt: if start == 0 { keys.salt.clone() } else { None },
                lora: keys.lora.clone(),
            });
        }
    }

    fn pin(&mut self, h: BlockHash) {
        let e = self.blocks.get_mut(&h).expect("pinning a cached block");
        if e.pins == 0 {
            self.lru.remove(&e.last_use);
        }
        e.pins += 1;
    }

    /// Releases a finished request's blocks: its prompt blocks stay cached, free to evict.
    /// They are released last block first, so that eviction takes a prompt's tail before
    /// its head and a shared prefix survives longest (as vLLM does).
    pub fn release(&mut self, lease: &Lease) {
        for h in lease.blocks.iter().rev() {
            self.clock += 1;
            let Some(e) = self.blocks.get_mut(h) else {
                continue;
            };
            e.pins -= 1;
            if e.pins == 0 {
                e.last_use = self.clock;
                self.lru.insert(self.clock, *h);
            }
        }
        self.private -= lease.private;
    }

    /// Drops every unpinned block.
    pub fn clear_free(&mut self) {
        let freed: Vec<u64> = std::mem::take(&mut self.lru)
            .into_values()
            .map(|h| h.0)
            .collect();
        for h in &freed {
            self.blocks.remove(&BlockHash(*h));
        }
        if !freed.is_empty() {
            self.seq += 1;
            self.events.push(CacheEvent::Removed {
                seq: self.seq,
                blocks: freed,
            });
        }
    }

    /// The snapshot a new subscriber starts from.
    pub fn snapshot(&self) -> KvEvent {
        let mut blocks: Vec<u64> = self.blocks.keys().map(|h| h.0).collect();
        blocks.sort_unstable();
        KvEvent::Snapshot {
            seq: self.seq,
            block_size: self.block_size,
            blocks,
        }
    }

    /// Takes the events appended since the last call.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.events)
    }

    /// Every cached block, sorted.
    pub fn cached_blocks(&self) -> Vec<BlockHash> {
        let mut v: Vec<BlockHash> = self.blocks.keys().copied().collect();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn h(v: &[u64]) -> Vec<BlockHash> {
        v.iter().map(|&x| BlockHash(x)).collect()
    }

    #[test]
    fn a_full_cache_evicts_least_recently_used_free_blocks_and_says_so() {
        let mut c = KvCache::new(4, 16);
        let a = c.admit(&h(&[1, 2]), &[], 0).unwrap();
        c.release(&a);
        let b = c.admit(&h(&[3, 4]), &[], 0).unwrap();
        c.release(&b);
        c.take_events();
        // Reusing block 1..2's prefix touches them; 4 and then 3 are now the oldest.
        let again = c.admit(&h(&[1, 2]), &[], 0).unwrap();
        assert_eq!(again.cached, 2);
        c.release(&again);
        let d = c.admit(&h(&[5]), &[], 1).unwrap();
        assert_eq!(
            c.take_events(),
            vec![
                CacheEvent::Removed {
                    seq: 3,
                    blocks: vec![4, 3]
                },
                CacheEvent::Stored {
                    seq: 4,
                    parent: None,
                    blocks: vec![5],
                    tokens: vec![],
                    salt: None,
                    lora: None,
                },
            ]
        );
        assert_eq!(c.cached_blocks(), h(&[1, 2, 5]));
        c.release(&d);
    }

    #[test]
    fn stored_runs_carry_their_own_tokens() {
        let mut c = KvCache::new(8, 2);
        let first = c.admit(&h(&[1]), &[10, 11], 0).unwrap();
        c.take_events();
        // Block 1 is cached: the run stored is blocks 2..3, with parent 1.
        c.admit(&h(&[1, 2, 3]), &[10, 11, 12, 13, 14, 15], 0)
            .unwrap();
        assert_eq!(
            c.take_events(),
            vec![CacheEvent::Stored {
                seq: 2,
                parent: Some(1),
                blocks: vec![2, 3],
                tokens: vec![12, 13, 14, 15],
                salt: None,
                lora: None,
            }]
        );
        c.release(&first);
        // A salted prompt's salt goes with the run that starts at its first block only.
        let salt: std::sync::Arc<str> = "tenant-a".into();
        c.admit_keyed(
            &h(&[20]),
            &[1, 2],
            &BlockKeys {
                salt: Some(salt.clone()),
                lora: None,
            },
            0,
        )
        .unwrap();
        c.admit_keyed(
            &h(&[20, 21]),
            &[1, 2, 3, 4],
            &BlockKeys {
                salt: Some(salt.clone()),
                lora: None,
            },
            0,
        )
        .unwrap();
        let salts: Vec<Option<std::sync::Arc<str>>> = c
            .take_events()
            .into_iter()
            .filter_map(|e| match e {
                CacheEvent::Stored { salt, .. } => Some(salt),
                CacheEvent::Removed { .. } => None,
            })
            .collect();
        assert_eq!(salts, vec![Some(salt), None]);
    }

    #[test]
    fn finished_requests_blocks_stay_cached_but_count_as_free() {
        let mut c = KvCache::new(8, 16);
        let a = c.admit(&h(&[1, 2, 3]), &[], 2).unwrap();
        assert_eq!((c.active(), c.cached(), c.occupied()), (5, 3, 5));
        // A second request sharing the prefix pins the shared blocks once.
        let b = c.admit(&h(&[1, 2, 4]), &[], 0).unwrap();
        assert_eq!((c.active(), c.cached()), (6, 4));
        c.release(&a);
        assert_eq!((c.active(), c.cached()), (3, 4));
        c.release(&b);
        assert_eq!((c.active(), c.cached(), c.occupied()), (0, 4, 4));
    }

    #[test]
    fn pinned_blocks_are_never_evicted() {
        let mut c = KvCache::new(3, 16);
        let running = c.admit(&h(&[1, 2]), &[], 0).unwrap();
        assert_eq!(
            c.admit(&h(&[7, 8]), &[], 0),
            Err(CacheFull {
                needed: 2,
                available: 1
            })
        );
        c.release(&running);
        assert!(c.admit(&h(&[7, 8]), &[], 0).is_ok());
    }

    proptest! {
        /// Applying the snapshot taken at any point and every event after it always
        /// reconstructs the cache exactly.
        #[test]
        fn snapshot_plus_deltas_reconstruct_the_cache(
            ops in proptest::collection::vec(
                (proptest::collection::vec(0u64..30, 0..6), 0usize..3, any::<bool>()), 1..80),
            snapshot_at in 0usize..80,
        ) {
            let mut c = KvCache::new(12, 16);
            let mut running: Vec<Lease> = Vec::new();
            let mut mirror: Option<(u64, BTreeSet<u64>)> = None;
            for (i, (blocks, private, finish_one)) in ops.into_iter().enumerate() {
                if i == snapshot_at.min(79) {
                    c.take_events();
                    let KvEvent::Snapshot { seq, blocks, .. } = c.snapshot() else { unreachable!() };
                    mirror = Some((seq, blocks.into_iter().collect()));
                }
                // A prompt's blocks are distinct (chained hashes never repeat).
                let mut seen = BTreeSet::new();
                let prompt: Vec<u64> = blocks.into_iter().filter(|b| seen.insert(*b)).collect();
                if let Ok(lease) = c.admit(&h(&prompt), &[], private) {
                    running.push(lease);
                }
                if finish_one && !running.is_empty() {
                    let lease = running.remove(0);
                    c.release(&lease);
                }
                prop_assert!(c.occupied() <= c.capacity());
                prop_assert!(c.active() <= c.occupied());
                if let Some((seq, set)) = &mut mirror {
                    for e in c.take_events() {
                        let e = e.to_wire();
                        prop_assert_eq!(e.seq(), Some(*seq + 1));
                        *seq += 1;
                        match e {
                            KvEvent::Stored { blocks, .. } => set.extend(blocks),
                            KvEvent::Removed { blocks, .. } => for b in blocks { set.remove(&b); },
                            other => prop_assert!(false, "unexpected {:?}", other),
                        }
                    }
                    let actual: BTreeSet<u64> = c.cached_blocks().iter().map(|b| b.0).collect();
                    prop_assert_eq!(&*set, &actual);
                }
            }
        }
    }
}
