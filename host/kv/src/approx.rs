//! Approximate mode, for workers that publish no KV events (any OpenAI-compatible
//! server): the router records each of its own decisions as "this worker now caches this
//! prompt's blocks", for a while. Entries expire after a TTL, and past a size bound the
//! oldest are evicted first — a rough stand-in for the worker's own LRU.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::index::OverlapIndex;
use switchyard_ids::{BlockHash, InstanceId};

/// Predicted cache contents.
#[derive(Debug)]
pub struct ApproxIndex {
    index: OverlapIndex,
    ttl: Duration,
    max_blocks: usize,
    /// Every recording, oldest first; an entry is stale once `expiry` no longer
    /// matches `live` (the block was recorded again later).
    queue: VecDeque<(Instant, InstanceId, BlockHash)>,
    live: HashMap<(InstanceId, BlockHash), Instant>,
}

impl ApproxIndex {
    /// Predictions live for `ttl`; at most `max_blocks` (worker, block) pairs are kept.
    pub fn new(ttl: Duration, max_blocks: usize) -> ApproxIndex {
        ApproxIndex {
            index: OverlapIndex::new(),
            ttl,
            max_blocks: max_blocks.max(1),
            queue: VecDeque::new(),
            live: HashMap::new(),
        }
    }

    /// Records that `worker` was sent a request with these blocks at `now`.
    pub fn record(&mut self, worker: InstanceId, blocks: &[BlockHash], now: Instant) {
        self.expire(now);
        let expiry = now + self.ttl;
        // A prediction is refreshed at most every ttl/8, so that the queue holds at most
        // about eight entries per prediction whatever the request rate.
        let step = self.ttl / 8;
        for &b in blocks {
            match self.live.get_mut(&(worker, b)) {
                Some(e) if expiry < *e + step => continue,
                Some(e) => *e = expiry,
                None => {
                    self.live.insert((worker, b), expiry);
                }
            }
            self.queue.push_back((expiry, worker, b));
        }
        self.index.stored(worker, blocks);
        while self.live.len() > self.max_blocks {
            self.pop_oldest();
        }
    }

    /// Drops every prediction that has expired by `now`.
    pub fn expire(&mut self, now: Instant) {
        while self
            .queue
            .front()
            .is_some_and(|(expiry, _, _)| *expiry <= now)
        {
            self.pop_oldest();
        }
    }

    fn pop_oldest(&mut self) {
        let Some((expiry, worker, block)) = self.queue.pop_front() else {
            return;
        };
        if self.live.get(&(worker, block)) == Some(&expiry) {
            self.live.remove(&(worker, block));
            self.index.removed(worker, &[block]);
        }
    }

    /// Forgets `worker`.
    pub fn remove_worker(&mut self, worker: InstanceId) {
        self.index.remove_worker(worker);
        self.live.retain(|(w, _), _| *w != worker);
    }

    /// Queued expiries (live and stale): at most about eight per prediction.
    pub fn backlog(&self) -> usize {
        self.queue.len()
    }

    /// Predicted (worker, block) pairs.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// True when nothing is predicted.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// The predicted index (query it with [`OverlapIndex::overlaps`]).
    pub fn index(&self) -> &OverlapIndex {
        &self.index
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(v: &[u64]) -> Vec<BlockHash> {
        v.iter().map(|&x| BlockHash(x)).collect()
    }

    #[test]
    fn predictions_expire_after_the_ttl_unless_refreshed() {
        let t0 = Instant::now();
        let mut a = ApproxIndex::new(Duration::from_secs(10), 100);
        a.record(InstanceId(1), &b(&[1, 2, 3]), t0);
        a.record(InstanceId(2), &b(&[1, 2]), t0 + Duration::from_secs(6));
        assert_eq!(
            a.index().overlap_map(&b(&[1, 2, 3])),
            vec![(InstanceId(1), 3), (InstanceId(2), 2)]
        );

        a.expire(t0 + Duration::from_secs(11));
        assert_eq!(
            a.index().overlap_map(&b(&[1, 2, 3])),
            vec![(InstanceId(2), 2)]
        );

        // Refreshing keeps it past its first expiry.
        a.record(InstanceId(2), &b(&[1, 2]), t0 + Duration::from_secs(12));
        a.expire(t0 + Duration::from_secs(17));
        assert_eq!(a.index().overlap_map(&b(&[1, 2])), vec![(InstanceId(2), 2)]);
        a.expire(t0 + Duration::from_secs(23));
        assert!(a.is_empty());
        assert_eq!(a.index().distinct_blocks(), 0);
    }

    #[test]
    fn a_million_decisions_over_the_same_prefixes_keep_memory_flat() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(120);
        let mut a = ApproxIndex::new(ttl, 1 << 20);
        let prefixes: Vec<Vec<BlockHash>> = (0..10u64)
            .map(|p| (0..4).map(|i| BlockHash(p << 32 | i)).collect())
            .collect();
        let mut peak = 0;
        for i in 0..1_000_000u64 {
            // 1 ms apart: 1,000 s in all, many TTLs.
            let now = t0 + Duration::from_millis(i);
            a.record(InstanceId(i % 4), &prefixes[(i % 10) as usize], now);
            peak = peak.max(a.backlog());
        }
        // Each of 4 workers was sent 5 of the prefixes, of 4 blocks each...
        assert_eq!(a.len(), 4 * 5 * 4);
        // ...and the queue stays within a small multiple of that, however many requests.
        assert!(peak <= 9 * a.len(), "backlog peaked at {peak}");
        // Refreshes still keep hot predictions alive past their first expiry.
        assert_eq!(
            a.index().overlap_map(&prefixes[0]).len(),
            2,
            "prefix 0 goes to workers 0 and 2"
        );
    }

    #[test]
    fn the_size_bound_evicts_the_oldest_first() {
        let t0 = Instant::now();
        let mut a = ApproxIndex::new(Duration::from_secs(600), 4);
        a.record(InstanceId(1), &b(&[1, 2]), t0);
        a.record(InstanceId(2), &b(&[5, 6]), t0 + Duration::from_secs(1));
        a.record(InstanceId(3), &b(&[8]), t0 + Duration::from_secs(2));
        assert_eq!(a.len(), 4);
        assert_eq!(
            a.index().worker_blocks(InstanceId(1)),
            1,
            "block 1 of worker 1 went first"
        );
        assert!(a.index().holds(InstanceId(1), BlockHash(2)));
        assert!(!a.index().holds(InstanceId(1), BlockHash(1)));
    }
}
