//! One unit of a bounded count, given back when dropped: the front door's connections,
//! requests in flight and refusing tasks, and the engine connections of each central-mode
//! events address.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// One unit of `count`, taken only while fewer than the bound are out.
#[derive(Debug)]
pub struct Slot(Arc<AtomicUsize>);

impl Slot {
    /// A unit of `count`, if fewer than `max` are taken.
    pub fn take(count: &Arc<AtomicUsize>, max: usize) -> Option<Slot> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot(count.clone()))
    }

    /// A unit of `count` whatever the bound: for what was already admitted under
    /// another bound (a request placed from the router's queue, bounded by the queue's
    /// own limits) and must not be refused at the end of its wait.
    pub fn force(count: &Arc<AtomicUsize>) -> Slot {
        count.fetch_add(1, Ordering::AcqRel);
        Slot(count.clone())
    }

    /// The count it is a unit of.
    pub fn count(&self) -> &Arc<AtomicUsize> {
        &self.0
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}
