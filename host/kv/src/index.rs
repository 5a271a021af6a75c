//! The overlap index: which worker caches which blocks.
//!
//! Because block hashes are chained, a hash names a whole prefix, so a flat map from
//! block hash to the set of workers holding it is a prefix tree in disguise: the
//! request's hashes, walked in order, descend it. Worker sets are bitsets over dense
//! worker slots (one 64-bit word per 64 workers), so a query is one map lookup and a
//! few word operations per block, and stops as soon as no worker matches.
//!
//! Each worker's own block set is kept too, to remove a worker or clear its cache.

use std::collections::{HashMap, HashSet};

use smallvec::SmallVec;

use super::Keyed;
use switchyard_ids::{BlockHash, InstanceId};

/// A set of worker slots. Missing high words are zero.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct SlotSet(SmallVec<[u64; 2]>);

impl SlotSet {
    fn insert(&mut self, slot: usize) {
        let (w, b) = (slot / 64, slot % 64);
        if self.0.len() <= w {
            self.0.resize(w + 1, 0);
        }
        self.0[w] |= 1 << b;
    }

    fn remove(&mut self, slot: usize) {
        let (w, b) = (slot / 64, slot % 64);
        if let Some(word) = self.0.get_mut(w) {
            *word &= !(1 << b);
        }
    }

    fn is_empty(&self) -> bool {
        self.0.iter().all(|&w| w == 0)
    }

    /// Calls `f` for every slot in `self` and not in `other`, then keeps only the
    /// slots in both.
    fn retain_in(&mut self, other: &SlotSet, mut dropped: impl FnMut(usize)) {
        for (i, word) in self.0.iter_mut().enumerate() {
            let keep = *word & other.0.get(i).copied().unwrap_or(0);
            let mut gone = *word & !keep;
            while gone != 0 {
                dropped(i * 64 + gone.trailing_zeros() as usize);
                gone &= gone - 1;
            }
            *word = keep;
        }
    }

    fn for_each(&self, mut f: impl FnMut(usize)) {
        for (i, &word) in self.0.iter().enumerate() {
            let mut w = word;
            while w != 0 {
                f(i * 64 + w.trailing_zeros() as usize);
                w &= w - 1;
            }
        }
    }
}

#[derive(Debug)]
struct Worker {
    id: InstanceId,
    held: HashSet<BlockHash, Keyed>,
}

/// Which worker caches which blocks. Pure and synchronous; the caller serialises access.
#[derive(Debug, Default)]
pub struct OverlapIndex {
    slot_of: HashMap<InstanceId, usize>,
    workers: Vec<Option<Worker>>,
    free_slots: Vec<usize>,
    blocks: HashMap<BlockHash, SlotSet, Keyed>,
}

impl OverlapIndex {
    /// An empty index.
    pub fn new() -> OverlapIndex {
        OverlapIndex::default()
    }

    fn slot(&mut self, worker: InstanceId) -> usize {
        if let Some(&s) = self.slot_of.get(&worker) {
            return s;
        }
        let fresh = Worker {
            id: worker,
            held: HashSet::default(),
        };
        let s = match self.free_slots.pop() {
            Some(s) => {
                self.workers[s] = Some(fresh);
                s
            }
            None => {
                self.workers.push(Some(fresh));
                self.workers.len() - 1
            }
        };
        self.slot_of.insert(worker, s);
        s
    }

    /// `worker` now caches `blocks` (hashes of consecutive blocks; the parent chain is
    /// implied by the hashes themselves).
    pub fn stored(&mut self, worker: InstanceId, blocks: &[BlockHash]) {
        let s = self.slot(worker);
        let held = &mut self.workers[s].as_mut().expect("slot is live").held;
        held.reserve(blocks.len());
        for &b in blocks {
            if held.insert(b) {
                self.blocks.entry(b).or_default().insert(s);
            }
        }
    }

    /// `worker` evicted `blocks`.
    pub fn removed(&mut self, worker: InstanceId, blocks: &[BlockHash]) {
        let Some(&s) = self.slot_of.get(&worker) else {
            return;
        };
        let held = &mut self.workers[s].as_mut().expect("slot is live").held;
        for b in blocks {
            if held.remove(b) {
                unlink(&mut self.blocks, *b, s);
            }
        }
    }

    /// `worker` dropped its whole cache (it stays known, holding nothing).
    pub fn cleared(&mut self, worker: InstanceId) {
        let Some(&s) = self.slot_of.get(&worker) else {
            return;
        };
        let held = std::mem::take(&mut self.workers[s].as_mut().expect("slot is live").held);
        for b in held {
            unlink(&mut self.blocks, b, s);
        }
    }

    /// Forgets `worker` and everything it held.
    pub fn remove_worker(&mut self, worker: InstanceId) {
        self.cleared(worker);
        if let Some(s) = self.slot_of.remove(&worker) {
            self.workers[s] = None;
            self.free_slots.push(s);
        }
    }

    /// Blocks `worker` holds.
    pub fn worker_blocks(&self, worker: InstanceId) -> usize {
        self.slot_of
            .get(&worker)
            .map_or(0, |&s| self.workers[s].as_ref().map_or(0, |w| w.held.len()))
    }

    /// Every block `worker` holds, sorted.
    pub fn worker_block_list(&self, worker: InstanceId) -> Vec<BlockHash> {
        let mut v: Vec<BlockHash> = self
            .slot_of
            .get(&worker)
            .and_then(|&s| self.workers[s].as_ref())
            .map(|w| w.held.iter().copied().collect())
            .unwrap_or_default();
        v.sort_unstable();
        v
    }

    /// Whether `worker` holds `block`.
    pub fn holds(&self, worker: InstanceId, block: BlockHash) -> bool {
        self.slot_of.get(&worker).is_some_and(|&s| {
            self.workers[s]
                .as_ref()
                .is_some_and(|w| w.held.contains(&block))
        })
    }

    /// Distinct blocks held by at least one worker.
    pub fn distinct_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Known workers.
    pub fn workers(&self) -> impl Iterator<Item = InstanceId> + '_ {
        self.slot_of.keys().copied()
    }

    /// For a request's block hashes, calls `f(worker, n)` for every worker holding its
    /// first `n >= 1` blocks (the longest such `n`). Workers holding no leading block are
    /// not reported.
    pub fn overlaps(&self, request: &[BlockHash], mut f: impl FnMut(InstanceId, u32)) {
        let Some(first) = request.first().and_then(|b| self.blocks.get(b)) else {
            return;
        };
        let mut active = first.clone();
        let id = |s: usize| self.workers[s].as_ref().expect("a set slot is live").id;
        for (i, b) in request.iter().enumerate().skip(1) {
            let Some(set) = self.blocks.get(b) else {
                active.for_each(|s| f(id(s), i as u32));
                return;
            };
            active.retain_in(set, |s| f(id(s), i as u32));
            if active.is_empty() {
                return;
            }
        }
        active.for_each(|s| f(id(s), request.len() as u32));
    }

    /// [`OverlapIndex::overlaps`] collected, sorted by worker.
    pub fn overlap_map(&self, request: &[BlockHash]) -> Vec<(InstanceId, u32)> {
        let mut out = Vec::new();
        self.overlaps(request, |w, n| out.push((w, n)));
        out.sort_unstable();
        out
    }
}

/// Takes slot `s` out of block `b`'s set, dropping the entry when it empties.
fn unlink(blocks: &mut HashMap<BlockHash, SlotSet, Keyed>, b: BlockHash, s: usize) {
    if let Some(set) = blocks.get_mut(&b) {
        set.remove(s);
        if set.is_empty() {
            blocks.remove(&b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// The obvious model: each worker's set of blocks.
    #[derive(Default)]
    struct Naive(BTreeMap<InstanceId, HashSet<BlockHash>>);

    impl Naive {
        fn overlaps(&self, request: &[BlockHash]) -> Vec<(InstanceId, u32)> {
            self.0
                .iter()
                .map(|(w, held)| {
                    (
                        *w,
                        request.iter().take_while(|b| held.contains(b)).count() as u32,
                    )
                })
                .filter(|(_, n)| *n > 0)
                .collect()
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Stored(u64, Vec<u64>),
        Removed(u64, Vec<u64>),
        Cleared(u64),
        RemoveWorker(u64),
        Query(Vec<u64>),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few workers (some past 64, to cross word boundaries) and few blocks, so that
        // operations collide often.
        let worker = prop_oneof![0u64..6, 60u64..70, 126u64..131];
        let blocks = proptest::collection::vec(0u64..24, 0..12);
        prop_oneof![
            4 => (worker.clone(), blocks.clone()).prop_map(|(w, b)| Op::Stored(w, b)),
            2 => (worker.clone(), blocks.clone()).prop_map(|(w, b)| Op::Removed(w, b)),
            1 => worker.clone().prop_map(Op::Cleared),
            1 => worker.prop_map(Op::RemoveWorker),
            3 => blocks.prop_map(Op::Query),
        ]
    }

    fn hashes(v: &[u64]) -> Vec<BlockHash> {
        v.iter().map(|&b| BlockHash(b)).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn matches_the_naive_model(ops in proptest::collection::vec(op(), 1..120)) {
            let mut index = OverlapIndex::new();
            let mut naive = Naive::default();
            for op in ops {
                match op {
                    Op::Stored(w, b) => {
                        index.stored(InstanceId(w), &hashes(&b));
                        naive.0.entry(InstanceId(w)).or_default().extend(hashes(&b));
                    }
                    Op::Removed(w, b) => {
                        index.removed(InstanceId(w), &hashes(&b));
                        if let Some(held) = naive.0.get_mut(&InstanceId(w)) {
                            for h in hashes(&b) { held.remove(&h); }
                        }
                    }
                    Op::Cleared(w) => {
                        index.cleared(InstanceId(w));
                        if let Some(held) = naive.0.get_mut(&InstanceId(w)) { held.clear(); }
                    }
                    Op::RemoveWorker(w) => {
                        index.remove_worker(InstanceId(w));
                        naive.0.remove(&InstanceId(w));
                    }
                    Op::Query(b) => {
                        prop_assert_eq!(index.overlap_map(&hashes(&b)), naive.overlaps(&hashes(&b)));
                    }
                }
                for (w, held) in &naive.0 {
                    prop_assert_eq!(index.worker_blocks(*w), held.len());
                }
                let distinct: HashSet<_> = naive.0.values().flatten().collect();
                prop_assert_eq!(index.distinct_blocks(), distinct.len());
            }
        }
    }

    #[test]
    fn overlap_counts_leading_blocks_only() {
        let mut index = OverlapIndex::new();
        index.stored(InstanceId(1), &hashes(&[1, 2, 3, 4]));
        index.stored(InstanceId(2), &hashes(&[1, 2]));
        index.stored(InstanceId(3), &hashes(&[2, 3, 4]));
        assert_eq!(
            index.overlap_map(&hashes(&[1, 2, 3, 9])),
            vec![(InstanceId(1), 3), (InstanceId(2), 2)]
        );
        assert!(index.overlap_map(&hashes(&[7, 1])).is_empty());
        assert!(index.overlap_map(&[]).is_empty());
    }
}
