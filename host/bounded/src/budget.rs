//! A byte budget shared by everything that holds input from outside at once: what one
//! source may send is bounded per message elsewhere, and this bounds the sum, so that
//! many sources at their bound together (many peers, a queue of batches, a replay) cannot
//! take the process's memory. Bytes are taken before they are allocated and given back
//! when the [`Grant`] holding them is dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A budget of bytes (cheap to clone: clones share it).
#[derive(Debug, Clone)]
pub struct Budget {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    capacity: u64,
    used: AtomicU64,
}

impl Budget {
    /// A budget of `capacity` bytes.
    pub fn new(capacity: u64) -> Budget {
        Budget {
            inner: Arc::new(Inner {
                capacity,
                used: AtomicU64::new(0),
            }),
        }
    }

    /// Its size, in bytes.
    pub fn capacity(&self) -> u64 {
        self.inner.capacity
    }

    /// Bytes held now.
    pub fn used(&self) -> u64 {
        self.inner.used.load(Ordering::Acquire)
    }

    /// `bytes` of it, if that many are free.
    pub fn take(&self, bytes: u64) -> Option<Grant> {
        self.inner
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes)
                    .filter(|&total| total <= self.inner.capacity)
            })
            .ok()
            .map(|_| Grant {
                budget: Some(self.clone()),
                bytes,
            })
    }
}

/// Bytes taken from a [`Budget`], given back when dropped.
#[derive(Debug, Default)]
pub struct Grant {
    budget: Option<Budget>,
    bytes: u64,
}

impl Grant {
    /// The bytes it holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Holds `other`'s bytes too (they are given back together).
    pub fn absorb(&mut self, mut other: Grant) {
        if other.bytes == 0 {
            return;
        }
        match (&self.budget, &other.budget) {
            (None, _) => {
                self.budget = other.budget.take();
                self.bytes = std::mem::take(&mut other.bytes);
            }
            (Some(a), Some(b)) if Arc::ptr_eq(&a.inner, &b.inner) => {
                self.bytes += std::mem::take(&mut other.bytes);
            }
            // Another budget's bytes: given back when `other` drops here.
            _ => {}
        }
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        if let Some(b) = &self.budget {
            b.inner.used.fetch_sub(self.bytes, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_taken_within_the_capacity_and_given_back_on_drop() {
        let b = Budget::new(100);
        let g1 = b.take(60).unwrap();
        assert!(b.take(41).is_none(), "past the capacity");
        let mut g2 = b.take(40).unwrap();
        assert_eq!(b.used(), 100);
        assert!(b.take(1).is_none());
        drop(g1);
        assert_eq!(b.used(), 40);
        g2.absorb(b.take(10).unwrap());
        assert_eq!((g2.bytes(), b.used()), (50, 50));
        let mut empty = Grant::default();
        empty.absorb(g2);
        assert_eq!((empty.bytes(), b.used()), (50, 50));
        drop(empty);
        assert_eq!(b.used(), 0);
        assert!(b.take(u64::MAX).is_none(), "no overflow");
        assert_eq!(b.take(0).unwrap().bytes(), 0);
    }
}
