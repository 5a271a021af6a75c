//! One worker's cache as its engine reports it (`kv::engine_events`), translated into the
//! router's own block hashes, with the sequence discipline of the engines' ZMQ streams.
//! Pure: the subscriber does the I/O and applies the returned [`IndexOp`]s.
//!
//! - **Re-hashing.** Each stored block's router hash is `H(parent's router hash, its
//!   tokens)` (`kv::hash`), mixed with the block's extra keys (LoRA adapter, `cache_salt`,
//!   multimodal IDs) when it has any, so tenants and adapters never share blocks. The
//!   parent's router hash comes from a per-rank map *engine hash → router hash*, which
//!   also resolves `BlockRemoved`. The engine's own hashes (seeded per process) are never
//!   indexed.
//! - **Data-parallel ranks** each have their own sequence and map; a block counts as held
//!   by the worker while any rank holds it.
//! - **Sequence numbers** ([`EngineView::check`]): the next one applies; a jump is a gap
//!   (the caller asks the replay socket for it); a repeated number with a timestamp no
//!   newer than the last applied batch is a duplicate (a replay overlapping live
//!   messages); one with a newer timestamp means the engine restarted (seq starts again at
//!   0), which clears the rank.
//! - **Incomplete views**: a gap nobody could fill drops what the rank was known to hold
//!   (keeping stale blocks would promise hits that are gone) and marks the view
//!   incomplete; the router then blends its own predictions in for the worker. The view
//!   is complete again once the rank has stored, since the gap, as many blocks as its
//!   cache holds (its peak before the gap, or the worker's reported cache size if larger):
//!   its cache has turned over. A clear or a restart completes it too. A router that
//!   joined mid-stream without a replay socket knows neither size: only the worker's
//!   reported cache size, a clear or a restart make its view exact.

use std::collections::HashMap;

use super::Keyed;
use super::engine_events::{EngineEvent, Medium, StoredBlocks};
use super::hash::{hash_block, mix};
use switchyard_ids::BlockHash;

/// A change to apply to the overlap index, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IndexOp {
    /// The worker now holds these blocks.
    Stored(Vec<BlockHash>),
    /// The worker no longer holds these blocks.
    Removed(Vec<BlockHash>),
}

/// What to do with a batch, given its sequence number and timestamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqVerdict {
    /// The next batch: apply it.
    Apply,
    /// Already applied (a replay overlapped the live stream): skip it.
    Duplicate,
    /// Batches `from..to` are missing: fetch them from the replay socket first.
    Gap {
        /// First missing sequence number.
        from: u64,
        /// This batch's.
        to: u64,
    },
    /// The engine restarted: [`EngineView::restart`] the rank, then treat the batch as the
    /// first of a new stream.
    Restart,
}

/// Why a stored event was not applied, and other counts a user would look at.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ViewCounts {
    /// Blocks applied as stored.
    pub stored_blocks: u64,
    /// Blocks applied as removed.
    pub removed_blocks: u64,
    /// Stored events refused for a block size other than the endpoint's.
    pub wrong_block_size: u64,
    /// Stored events whose parent block was never seen (after a gap), not applied.
    pub unknown_parent: u64,
    /// Stored events whose token count is not blocks × block size, not applied.
    pub bad_tokens: u64,
    /// Events of media other than the GPU, or of KV cache groups other than 0, skipped.
    pub other_tier: u64,
    /// Events of types this router does not know, skipped.
    pub unknown_type: u64,
    /// Gaps the replay socket could not fill (each makes the view incomplete).
    pub lost_gaps: u64,
    /// Engine restarts seen (sequence numbers starting again).
    pub restarts: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    router: u64,
    /// Counted in the worker's blocks (false after a lost gap, until stored again).
    held: bool,
}

#[derive(Debug, Default)]
struct Rank {
    /// Last applied (seq, ts).
    last: Option<(u64, f64)>,
    /// Engine hash → router hash of every GPU block the rank holds, or held before a
    /// lost gap (the engine may still hold it, and name it as a parent).
    map: HashMap<u64, Entry, Keyed>,
    /// Entries held now.
    held: usize,
    peak: usize,
    /// Since a lost gap: (blocks held at the rank's peak before it, blocks stored since).
    gap: Option<(usize, usize)>,
    /// The rank's stream has been followed from its start, or from a gap (then
    /// `gap` says how much is missing).
    synced: bool,
}

/// One worker's engine-reported cache.
#[derive(Debug)]
pub struct EngineView {
    block_size: u32,
    seed: u64,
    /// Most engine-hash entries kept for the worker (all ranks together; less once its
    /// cache size is known, [`EngineView::entry_limit`]): past it the rank being written
    /// is cleared and marked incomplete (a stream that removes nothing would otherwise
    /// grow without bound).
    max_entries: usize,
    ranks: HashMap<u32, Rank>,
    /// Ranks the worker has (`0..expected_ranks`).
    expected_ranks: u32,
    /// Blocks a rank must store after a gap before its view counts as complete again,
    /// at least (its cache size, when known).
    capacity_hint: usize,
    /// Router hash → how many ranks hold it.
    refs: HashMap<u64, u32, Keyed>,
    counts: ViewCounts,
}

impl EngineView {
    /// A view for an endpoint with `block_size`-token blocks and hash chain `seed`.
    /// `ranks` data-parallel ranks publish.
    pub fn new(block_size: u32, seed: u64, max_entries: usize, ranks: u32) -> EngineView {
        EngineView {
            block_size,
            seed,
            max_entries: max_entries.max(1),
            ranks: HashMap::new(),
            expected_ranks: ranks.max(1),
            capacity_hint: 0,
            refs: HashMap::default(),
            counts: ViewCounts::default(),
        }
    }

    /// Counters.
    pub fn counts(&self) -> ViewCounts {
        self.counts
    }

    /// Whether the view is exact: every rank followed from the start of its stream, with
    /// no unfilled gap since its last refill.
    pub fn complete(&self) -> bool {
        (0..self.expected_ranks).all(|r| {
            self.ranks
                .get(&r)
                .is_some_and(|r| r.synced && self.refilled(r))
        })
    }

    /// Whether `r` has stored, since its lost gap, as many blocks as its cache holds (its
    /// peak before the gap, or the worker's cache size when known and larger). With
    /// neither known (a router that joined mid-stream), only a clear or a restart
    /// completes it.
    fn refilled(&self, r: &Rank) -> bool {
        match r.gap {
            None => true,
            Some((peak, stored)) => {
                let target = peak.max(self.capacity_hint);
                target > 0 && stored >= target
            }
        }
    }

    /// Engine-hash entries over all ranks.
    fn entries(&self) -> usize {
        self.ranks.values().map(|r| r.map.len()).sum()
    }

    /// Most engine-hash entries the worker may make the router keep, over all its ranks:
    /// twice its reported cache size plus 64k (entries outlive a lost gap) when known,
    /// never more than `max_entries` — a worker cannot multiply it by claiming ranks.
    fn entry_limit(&self) -> usize {
        match self.capacity_hint {
            0 => self.max_entries,
            c => c
                .saturating_mul(2)
                .saturating_add(1 << 16)
                .min(self.max_entries),
        }
    }

    /// The worker's cache size in blocks, when known (from its load reports): a rank that
    /// lost a gap is complete again after storing at least this many blocks.
    pub fn set_capacity_hint(&mut self, blocks: usize) {
        self.capacity_hint = blocks;
    }

    /// The engine of `rank` has published nothing yet (its replay buffer is empty): its
    /// view, empty, is exact.
    pub fn synced_empty(&mut self, rank: u32) {
        let r = self.ranks.entry(rank).or_default();
        if r.last.is_none() {
            r.synced = true;
        }
    }

    /// Blocks the worker holds (distinct router hashes over all ranks).
    pub fn held(&self) -> usize {
        self.refs.len()
    }

    /// The last sequence number applied for `rank`.
    pub fn last_seq(&self, rank: u32) -> Option<u64> {
        self.ranks.get(&rank).and_then(|r| r.last).map(|(s, _)| s)
    }

    /// Checks a batch's sequence number against `rank`'s last.
    pub fn check(&self, rank: u32, seq: u64, ts: f64) -> SeqVerdict {
        match self.ranks.get(&rank).and_then(|r| r.last) {
            None if seq == 0 => SeqVerdict::Apply,
            None => SeqVerdict::Gap { from: 0, to: seq },
            Some((last, _)) if last.checked_add(1) == Some(seq) => SeqVerdict::Apply,
            // `seq > last`, so `last + 1` cannot overflow.
            Some((last, _)) if seq > last => SeqVerdict::Gap {
                from: last + 1,
                to: seq,
            },
            Some((_, last_ts)) if ts <= last_ts => SeqVerdict::Duplicate,
            Some(_) => SeqVerdict::Restart,
        }
    }

    /// The engine of `rank` restarted: everything it held is gone, and so are its hashes.
    pub fn restart(&mut self, rank: u32) -> Vec<IndexOp> {
        self.counts.restarts += 1;
        let ops = self.drop_rank_blocks(rank);
        let r = self.ranks.entry(rank).or_default();
        r.map.clear();
        r.last = None;
        r.peak = 0;
        r.gap = None;
        r.synced = false;
        ops
    }

    /// A gap in `rank`'s stream could not be filled; the next batch to apply is `seq`.
    /// Drops what the rank was known to hold and marks the view incomplete.
    pub fn lost_gap(&mut self, rank: u32, seq: u64) -> Vec<IndexOp> {
        self.counts.lost_gaps += 1;
        let ops = self.drop_rank_blocks(rank);
        let r = self.ranks.entry(rank).or_default();
        r.gap = Some((r.peak, 0));
        r.synced = true;
        r.last = seq.checked_sub(1).map(|s| (s, f64::NEG_INFINITY));
        ops
    }

    /// Takes every block of `rank` out of the worker's set; keeps the hash map (the
    /// engine still knows those blocks: later events may name them as parents).
    fn drop_rank_blocks(&mut self, rank: u32) -> Vec<IndexOp> {
        let Some(r) = self.ranks.get_mut(&rank) else {
            return Vec::new();
        };
        let mut gone = Vec::new();
        if r.held > 0 {
            for e in r.map.values_mut().filter(|e| e.held) {
                e.held = false;
                if release(&mut self.refs, e.router) {
                    gone.push(BlockHash(e.router));
                }
            }
        }
        r.held = 0;
        if gone.is_empty() {
            Vec::new()
        } else {
            vec![IndexOp::Removed(gone)]
        }
    }

    /// Applies a batch that [`EngineView::check`] said to apply; returns the index changes.
    pub fn apply(&mut self, rank: u32, seq: u64, ts: f64, events: &[EngineEvent]) -> Vec<IndexOp> {
        let mut ops = Vec::new();
        for e in events {
            match e {
                EngineEvent::Stored(s) => self.stored(rank, s, &mut ops),
                EngineEvent::Removed {
                    hashes,
                    medium,
                    group,
                } => {
                    if *medium != Medium::Gpu || *group != 0 {
                        self.counts.other_tier += 1;
                        continue;
                    }
                    let r = self.ranks.entry(rank).or_default();
                    let mut gone = Vec::new();
                    for h in hashes {
                        let Some(e) = r.map.remove(h) else { continue };
                        if e.held {
                            self.counts.removed_blocks += 1;
                            r.held -= 1;
                            if release(&mut self.refs, e.router) {
                                gone.push(BlockHash(e.router));
                            }
                        }
                    }
                    if !gone.is_empty() {
                        ops.push(IndexOp::Removed(gone));
                    }
                }
                EngineEvent::Cleared => {
                    ops.extend(self.drop_rank_blocks(rank));
                    let r = self.ranks.entry(rank).or_default();
                    r.map.clear();
                    r.gap = None;
                    r.synced = true;
                }
                EngineEvent::Unknown(_) => self.counts.unknown_type += 1,
            }
        }
        let r = self.ranks.entry(rank).or_default();
        if r.last.is_none() && seq == 0 {
            r.synced = true;
        }
        r.last = Some((seq, ts));
        ops
    }

    fn stored(&mut self, rank: u32, s: &StoredBlocks, ops: &mut Vec<IndexOp>) {
        if s.medium != Medium::Gpu || s.group != 0 {
            self.counts.other_tier += 1;
            return;
        }
        if s.block_size != self.block_size {
            self.counts.wrong_block_size += 1;
            return;
        }
        let bs = self.block_size as usize;
        if s.token_ids.len() != s.hashes.len() * bs
            || !(s.extra.is_empty() || s.extra.len() == s.hashes.len())
        {
            self.counts.bad_tokens += 1;
            return;
        }
        if self.ranks.contains_key(&rank)
            && self.entries().saturating_add(s.hashes.len()) > self.entry_limit()
        {
            // Runaway stream: start over rather than grow.
            let mut dropped = self.drop_rank_blocks(rank);
            ops.append(&mut dropped);
            let r = self.ranks.get_mut(&rank).expect("checked");
            r.map.clear();
            r.gap = Some((r.peak, 0));
            self.counts.lost_gaps += 1;
        }
        let r = self.ranks.entry(rank).or_default();
        let mut parent = match s.parent {
            None => self.seed,
            Some(p) => match r.map.get(&p) {
                Some(e) => e.router,
                None => {
                    self.counts.unknown_parent += 1;
                    return;
                }
            },
        };
        let mut added = Vec::new();
        for (i, (engine, tokens)) in s
            .hashes
            .iter()
            .zip(s.token_ids.chunks_exact(bs))
            .enumerate()
        {
            let mut h = hash_block(parent, tokens);
            if let Some(&extra) = s.extra.get(i)
                && extra != 0
            {
                h = mix(h, extra);
            }
            parent = h;
            let previous = r.map.insert(
                *engine,
                Entry {
                    router: h,
                    held: true,
                },
            );
            match previous {
                // Stored again without a removal in between: already held.
                Some(p) if p.held && p.router == h => continue,
                Some(p) if p.held => {
                    if release(&mut self.refs, p.router) {
                        ops.push(IndexOp::Removed(vec![BlockHash(p.router)]));
                    }
                }
                _ => r.held += 1,
            }
            self.counts.stored_blocks += 1;
            let n = self.refs.entry(h).or_insert(0);
            *n += 1;
            if *n == 1 {
                added.push(BlockHash(h));
            }
        }
        r.peak = r.peak.max(r.held);
        if let Some((_, stored)) = r.gap.as_mut() {
            *stored += s.hashes.len();
        }
        if !added.is_empty() {
            ops.push(IndexOp::Stored(added));
        }
    }
}

/// Drops one reference; whether it was the last.
fn release(refs: &mut HashMap<u64, u32, Keyed>, h: u64) -> bool {
    match refs.get_mut(&h) {
        Some(n) if *n > 1 => {
            *n -= 1;
            false
        }
        Some(_) => {
            refs.remove(&h);
            true
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::BlockHasher;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> EngineEvent {
        EngineEvent::Stored(StoredBlocks {
            hashes: hashes.to_vec(),
            parent,
            token_ids: tokens.to_vec(),
            block_size: 2,
            medium: Medium::Gpu,
            extra: vec![],
            group: 0,
        })
    }

    fn added(ops: &[IndexOp]) -> Vec<BlockHash> {
        ops.iter()
            .flat_map(|o| match o {
                IndexOp::Stored(v) => v.clone(),
                IndexOp::Removed(_) => vec![],
            })
            .collect()
    }

    #[test]
    fn engine_hashes_become_the_routers_chain() {
        let hasher = BlockHasher::new(2, 9);
        let tokens = [1, 2, 3, 4, 5, 6];
        let want = hasher.hashes(&tokens);
        let mut v = EngineView::new(2, 9, 1000, 1);
        // Two events, the second chained to the first by the engine's own hash.
        let ops = v.apply(0, 0, 1.0, &[stored(&[0xaa, 0xbb], None, &tokens[..4])]);
        assert_eq!(added(&ops), want[..2]);
        let ops = v.apply(0, 1, 2.0, &[stored(&[0xcc], Some(0xbb), &tokens[4..])]);
        assert_eq!(added(&ops), want[2..]);
        assert_eq!(v.held(), 3);
        let ops = v.apply(
            0,
            2,
            3.0,
            &[EngineEvent::Removed {
                hashes: vec![0xcc, 0x99],
                medium: Medium::Gpu,
                group: 0,
            }],
        );
        assert_eq!(ops, vec![IndexOp::Removed(vec![want[2]])]);
        let ops = v.apply(0, 3, 4.0, &[EngineEvent::Cleared]);
        let [IndexOp::Removed(gone)] = &ops[..] else {
            panic!("{ops:?}")
        };
        let mut gone = gone.clone();
        gone.sort();
        let mut first_two = want[..2].to_vec();
        first_two.sort();
        assert_eq!(gone, first_two);
        assert_eq!(v.held(), 0);
    }

    #[test]
    fn an_unknown_parent_or_a_wrong_block_size_is_refused_and_counted() {
        let mut v = EngineView::new(2, 0, 1000, 1);
        assert!(
            v.apply(0, 0, 1.0, &[stored(&[1], Some(77), &[1, 2])])
                .is_empty()
        );
        let mut wrong = stored(&[1], None, &[1, 2, 3, 4]);
        if let EngineEvent::Stored(s) = &mut wrong {
            s.block_size = 4;
        }
        assert!(v.apply(0, 1, 1.0, &[wrong]).is_empty());
        assert!(
            v.apply(0, 2, 1.0, &[stored(&[1], None, &[1, 2, 3])])
                .is_empty()
        );
        let c = v.counts();
        assert_eq!(
            (c.unknown_parent, c.wrong_block_size, c.bad_tokens),
            (1, 1, 1)
        );
        assert_eq!(v.held(), 0);
    }

    #[test]
    fn sequence_verdicts() {
        let mut v = EngineView::new(2, 0, 1000, 1);
        assert_eq!(v.check(0, 0, 1.0), SeqVerdict::Apply);
        assert_eq!(v.check(0, 3, 1.0), SeqVerdict::Gap { from: 0, to: 3 });
        v.apply(0, 0, 10.0, &[]);
        v.apply(0, 1, 11.0, &[]);
        assert_eq!(v.check(0, 2, 12.0), SeqVerdict::Apply);
        assert_eq!(v.check(0, 5, 12.0), SeqVerdict::Gap { from: 2, to: 5 });
        assert_eq!(v.check(0, 1, 11.0), SeqVerdict::Duplicate);
        assert_eq!(v.check(0, 0, 50.0), SeqVerdict::Restart);
        // Ranks are independent.
        assert_eq!(v.check(1, 0, 1.0), SeqVerdict::Apply);
    }

    #[test]
    fn a_lost_gap_drops_the_rank_and_a_refill_completes_it() {
        let mut v = EngineView::new(2, 0, 1000, 1);
        v.apply(0, 0, 1.0, &[stored(&[1, 2], None, &[1, 2, 3, 4])]);
        assert!(v.complete());
        let ops = v.lost_gap(0, 9);
        assert!(matches!(&ops[..], [IndexOp::Removed(b)] if b.len() == 2));
        assert!(!v.complete());
        assert_eq!(v.check(0, 9, 2.0), SeqVerdict::Apply);
        // The old parent still resolves; one block stored of the two needed.
        v.apply(0, 9, 2.0, &[stored(&[3], Some(2), &[5, 6])]);
        assert!(!v.complete());
        v.apply(0, 10, 3.0, &[stored(&[4], None, &[7, 8])]);
        assert!(v.complete());
        assert_eq!(v.held(), 2);
    }

    #[test]
    fn ranks_share_blocks_by_reference() {
        let mut v = EngineView::new(2, 0, 1000, 2);
        // Two ranks store the same tokens under their own engine hashes.
        let a = added(&v.apply(0, 0, 1.0, &[stored(&[10], None, &[1, 2])]));
        let b = added(&v.apply(1, 0, 1.0, &[stored(&[20], None, &[1, 2])]));
        assert_eq!(a.len(), 1);
        assert!(b.is_empty(), "already held through rank 0");
        let ops = v.restart(0);
        assert!(ops.is_empty(), "rank 1 still holds it");
        let ops = v.apply(
            1,
            1,
            2.0,
            &[EngineEvent::Removed {
                hashes: vec![20],
                medium: Medium::Gpu,
                group: 0,
            }],
        );
        assert_eq!(ops, vec![IndexOp::Removed(a)]);
    }

    #[test]
    fn salts_separate_tenants() {
        let mut v = EngineView::new(2, 0, 1000, 1);
        let with = |extra: u64, engine: u64| {
            EngineEvent::Stored(StoredBlocks {
                hashes: vec![engine],
                parent: None,
                token_ids: vec![1, 2],
                block_size: 2,
                medium: Medium::Gpu,
                extra: vec![extra],
                group: 0,
            })
        };
        let a = added(&v.apply(0, 0, 1.0, &[with(5, 1)]));
        let b = added(&v.apply(0, 1, 1.0, &[with(6, 2)]));
        let plain = added(&v.apply(0, 2, 1.0, &[with(0, 3)]));
        assert_eq!(plain, BlockHasher::new(2, 0).hashes(&[1, 2]));
        assert!(a != b && a != plain && b != plain);
    }

    /// Blocks an engine stored for an adapter (its name in every block's extra keys, a
    /// salt after it in the first's) are the blocks a request for that adapter and salt
    /// hashes to: prefix matching holds for adapters.
    #[test]
    fn an_adapters_blocks_are_the_ones_its_requests_hash_to() {
        use crate::engine_events::{ExtraKey, extra_hash};
        let tokens = [1, 2, 3, 4, 5, 6];
        for (lora, salt) in [
            (Some("sql"), None),
            (Some("sql"), Some("t1")),
            (None, Some("t1")),
        ] {
            let mut v = EngineView::new(2, 0, 1000, 1);
            let first: Vec<ExtraKey<'_>> =
                lora.into_iter().chain(salt).map(ExtraKey::Str).collect();
            let rest: Vec<ExtraKey<'_>> = lora.into_iter().map(ExtraKey::Str).collect();
            let stored = EngineEvent::Stored(StoredBlocks {
                hashes: vec![10, 11, 12],
                parent: None,
                token_ids: tokens.to_vec(),
                block_size: 2,
                medium: Medium::Gpu,
                extra: vec![extra_hash(&first), extra_hash(&rest), extra_hash(&rest)],
                group: 0,
            });
            let applied = added(&v.apply(0, 0, 1.0, &[stored]));
            let hasher = BlockHasher::new(2, 0);
            assert_eq!(
                applied,
                hasher.keyed_hashes(&tokens, lora, salt),
                "{lora:?} {salt:?}"
            );
            assert_ne!(applied, hasher.keyed_hashes(&tokens, Some("other"), salt));
            assert_ne!(applied, hasher.hashes(&tokens));
        }
    }

    #[test]
    fn a_stream_that_never_removes_stays_bounded() {
        let mut v = EngineView::new(1, 0, 100, 1);
        for i in 0..10_000u64 {
            v.apply(0, i, i as f64, &[stored(&[i], None, &[i as u32])]);
        }
        assert!(v.held() <= 100);
        assert!(v.ranks[&0].map.len() <= 100);
    }

    /// The bound is the worker's, not each rank's: 256 ranks that never remove hold no
    /// more than one would (plus one batch), and a reported cache size lowers it.
    #[test]
    fn many_ranks_share_one_bound_scaled_to_the_cache_size() {
        let mut v = EngineView::new(1, 0, 1000, 256);
        for i in 0..20_000u64 {
            let rank = (i % 256) as u32;
            let seq = i / 256;
            v.apply(rank, seq, i as f64, &[stored(&[i], None, &[i as u32])]);
        }
        assert!(v.entries() <= 1001, "{} entries", v.entries());
        let mut v = EngineView::new(1, 0, 1 << 20, 1);
        v.set_capacity_hint(10);
        assert_eq!(v.entry_limit(), 20 + (1 << 16));
        for i in 0..100_000u64 {
            v.apply(0, i, i as f64, &[stored(&[i], None, &[i as u32])]);
        }
        assert!(v.entries() <= 20 + (1 << 16) + 1, "{} entries", v.entries());
    }

    /// A sequence number at u64::MAX neither panics nor wraps to look like the start.
    #[test]
    fn a_sequence_at_u64_max_is_a_gap_not_a_wrap() {
        let mut v = EngineView::new(1, 0, 100, 1);
        v.apply(0, u64::MAX, 1.0, &[]);
        assert_eq!(v.check(0, 0, 0.5), SeqVerdict::Duplicate);
        assert_eq!(v.check(0, 0, 2.0), SeqVerdict::Restart);
    }
}
