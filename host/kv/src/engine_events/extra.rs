//! A block's extra keys and their hash, byte for byte as the engines compute it.

use rmpv::ValueRef;

/// One element of a block's extra keys, built by the router for a request (so that its
/// hashes match the engine's): see [`extra_hash`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtraKey<'a> {
    /// A string (LoRA name, `cache_salt`).
    Str(&'a str),
    /// An integer.
    Int(i64),
}

/// The hash of a block's extra keys, as [`decode_batch`](super::decode_batch) computes it from an event's
/// `extra_keys` entry (a tuple of these keys); 0 for none.
pub fn extra_hash(keys: &[ExtraKey<'_>]) -> u64 {
    if keys.is_empty() {
        return 0;
    }
    let mut h = ExtraHasher::default();
    h.list_start(keys.len());
    for k in keys {
        match k {
            ExtraKey::Str(s) => h.bytes(b's', s.as_bytes()),
            ExtraKey::Int(i) => h.int(*i),
        }
    }
    h.finish()
}

/// A canonical serialisation of a msgpack value, hashed: equal values hash equal
/// whatever msgpack encoding widths the engine chose.
#[derive(Default)]
pub(super) struct ExtraHasher(Vec<u8>);

impl ExtraHasher {
    pub(super) fn list_start(&mut self, n: usize) {
        self.0.push(b'l');
        self.0.extend_from_slice(&(n as u64).to_le_bytes());
    }
    pub(super) fn bytes(&mut self, tag: u8, b: &[u8]) {
        self.0.push(tag);
        self.0.extend_from_slice(&(b.len() as u64).to_le_bytes());
        self.0.extend_from_slice(b);
    }
    pub(super) fn int(&mut self, i: i64) {
        self.0.push(b'i');
        self.0.extend_from_slice(&i.to_le_bytes());
    }
    pub(super) fn value(&mut self, v: &ValueRef<'_>) {
        match v {
            ValueRef::Nil => self.0.push(b'n'),
            ValueRef::Boolean(b) => self.0.extend_from_slice(&[b'b', u8::from(*b)]),
            ValueRef::Integer(i) => self.int(
                i.as_i64()
                    .unwrap_or_else(|| i.as_u64().map_or(0, |u| u as i64)),
            ),
            ValueRef::F32(f) => self.bytes(b'f', &f64::from(*f).to_le_bytes()),
            ValueRef::F64(f) => self.bytes(b'f', &f.to_le_bytes()),
            ValueRef::String(s) => self.bytes(b's', s.as_bytes()),
            ValueRef::Binary(b) => self.bytes(b'x', b),
            ValueRef::Array(a) => {
                self.list_start(a.len());
                for x in a {
                    self.value(x);
                }
            }
            ValueRef::Map(m) => {
                self.0.push(b'm');
                self.0.extend_from_slice(&(m.len() as u64).to_le_bytes());
                for (k, x) in m {
                    self.value(k);
                    self.value(x);
                }
            }
            ValueRef::Ext(t, b) => {
                self.0.push(b'e');
                self.0.push(*t as u8);
                self.bytes(b'x', b);
            }
        }
    }
    pub(super) fn finish(&self) -> u64 {
        // Never 0, which means "no extra keys".
        xxhash_rust::xxh3::xxh3_64(&self.0).max(1)
    }
}
