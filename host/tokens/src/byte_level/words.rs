//! The word cache: two generations of pieces and their IDs in reused buffers, taken with
//! `try_lock` and never waited for.

use std::sync::{Mutex, MutexGuard, TryLockError};

use super::WORDS;
use super::merges::Buffers;

/// Token IDs of recent pieces, in two generations: when the newer one is full it becomes
/// the older and the older is emptied, so the cache is bounded and a piece in use stays.
#[derive(Default)]
pub(super) struct Words {
    pub(super) new: Generation,
    pub(super) old: Generation,
}

/// A generation's pieces and IDs live in two buffers that keep their memory across
/// rollovers: once grown, an insert allocates nothing and a rollover frees nothing.
#[derive(Default)]
pub(super) struct Generation {
    pub(super) table: hashbrown::HashTable<Entry>,
    pub(super) text: String,
    pub(super) ids: Vec<u32>,
}

/// A piece's hash and where its text and IDs are in the generation's buffers.
#[derive(Clone, Copy)]
pub(super) struct Entry {
    pub(super) hash: u64,
    pub(super) text: (u32, u32),
    pub(super) ids: (u32, u32),
}

/// `len` items from `start` in a buffer. Generations hold at most [`WORDS`] pieces of at
/// most [`MAX_WORD`] bytes (and as many IDs), far below `u32::MAX`.
pub(super) fn span(start: usize, len: usize) -> (u32, u32) {
    (start as u32, (start + len) as u32)
}

pub(super) fn at<T>(buf: &[T], (start, end): (u32, u32)) -> &[T] {
    &buf[start as usize..end as usize]
}

impl Generation {
    pub(super) fn find(&self, hash: u64, piece: &str) -> Option<&[u32]> {
        self.table
            .find(hash, |e| {
                at(self.text.as_bytes(), e.text) == piece.as_bytes()
            })
            .map(|e| at(&self.ids, e.ids))
    }

    pub(super) fn insert(&mut self, hash: u64, piece: &str, ids: &[u32]) {
        let entry = Entry {
            hash,
            text: span(self.text.len(), piece.len()),
            ids: span(self.ids.len(), ids.len()),
        };
        self.text.push_str(piece);
        self.ids.extend_from_slice(ids);
        self.table.insert_unique(hash, entry, |e| e.hash);
    }

    pub(super) fn clear(&mut self) {
        self.table.clear();
        self.text.clear();
        self.ids.clear();
    }
}

impl Words {
    /// The IDs of `piece` (whose hash is `hash`) into `out`, if held.
    pub(super) fn get(&mut self, hash: u64, piece: &str, out: &mut Vec<u32>) -> bool {
        if let Some(ids) = self.new.find(hash, piece) {
            out.extend_from_slice(ids);
            return true;
        }
        let Some(ids) = self.old.find(hash, piece) else {
            return false;
        };
        let start = out.len();
        out.extend_from_slice(ids);
        self.insert(hash, piece, &out[start..]);
        true
    }

    pub(super) fn insert(&mut self, hash: u64, piece: &str, ids: &[u32]) {
        if self.new.table.len() >= WORDS {
            std::mem::swap(&mut self.new, &mut self.old);
            self.new.clear();
        }
        self.new.insert(hash, piece, ids);
    }
}

/// One call's merge buffers and its hold on the word cache.
pub(super) struct Scratch<'a> {
    pub(super) buffers: Buffers,
    pub(super) hold: Hold<'a>,
}

/// A call's hold on the word cache: taken at the call's first cacheable piece and given
/// back every [`HOLD`] pieces, and never waited for: while another call holds it, pieces
/// are merged without it (and not added to it).
pub(super) struct Hold<'a> {
    pub(super) words: &'a Mutex<Words>,
    pub(super) held: Option<MutexGuard<'a, Words>>,
    /// Pieces looked up since the cache was taken.
    pub(super) uses: u32,
}

/// Pieces a call looks up in the word cache before giving it back.
pub(super) const HOLD: u32 = 64;

impl Hold<'_> {
    pub(super) fn words(&mut self) -> Option<&mut Words> {
        if self.uses >= HOLD {
            self.held = None;
            self.uses = 0;
        }
        if self.held.is_none() {
            self.held = match self.words.try_lock() {
                Ok(w) => Some(w),
                Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
                Err(TryLockError::WouldBlock) => None,
            };
        }
        let w = self.held.as_deref_mut()?;
        self.uses += 1;
        Some(w)
    }
}
