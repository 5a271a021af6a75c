//! Engine KV event batches written in each shape (the mock worker publishes them; tests use all three).

/// The shapes an engine may publish, for [`encode_batch`] (the mock worker publishes
/// vLLM's current shape; tests use all three).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Current vLLM: a map batch, map events tagged `"type"`.
    VllmMap,
    /// Older vLLM: positional batch and events.
    VllmArray,
    /// SGLang: positional, block hashes as *signed* integers, `attn_dp_rank`.
    Sglang,
}

/// A block-stored event to encode (`lora_name` and a `cache_salt` on the first block go
/// into `extra_keys` the way vLLM puts them).
#[derive(Debug, Clone, Default)]
pub struct StoredOut<'a> {
    /// Engine hashes.
    pub hashes: &'a [u64],
    /// Engine hash of the parent block.
    pub parent: Option<u64>,
    /// Tokens of the blocks.
    pub token_ids: &'a [u32],
    /// Tokens per block.
    pub block_size: u32,
    /// `"GPU"` when `None`.
    pub medium: Option<&'a str>,
    /// LoRA adapter.
    pub lora_name: Option<&'a str>,
    /// Tenant salt of the prompt (only when `parent` is `None`: it applies to block 0).
    pub cache_salt: Option<&'a str>,
}

/// An event to encode.
#[derive(Debug, Clone)]
pub enum EventOut<'a> {
    /// `BlockStored`.
    Stored(StoredOut<'a>),
    /// `BlockRemoved`.
    Removed(&'a [u64]),
    /// `AllBlocksCleared`.
    Cleared,
    /// An event of another type, with one integer field.
    Other(&'a str),
}

/// An event's start: a map of `fields` entries whose first is `type`, or an array of
/// `fields` entries whose first is the tag.
pub(super) fn header(w: &mut Vec<u8>, map: bool, fields: u32, tag: &str) {
    use rmp::encode as e;
    if map {
        e::write_map_len(w, fields).expect("vec");
        e::write_str(w, "type").expect("vec");
    } else {
        e::write_array_len(w, fields).expect("vec");
    }
    e::write_str(w, tag).expect("vec");
}

/// Encodes a batch the way the engine of `shape` does.
pub fn encode_batch(shape: Shape, ts: f64, rank: u32, events: &[EventOut<'_>]) -> Vec<u8> {
    use rmp::encode as e;
    let mut out = Vec::with_capacity(64 + events.len() * 64);
    let w = &mut out;
    let map = shape == Shape::VllmMap;
    if map {
        e::write_map_len(w, 3).expect("vec");
        e::write_str(w, "ts").expect("vec");
    } else {
        e::write_array_len(w, 3).expect("vec");
    }
    e::write_f64(w, ts).expect("vec");
    if map {
        e::write_str(w, "events").expect("vec");
    }
    e::write_array_len(w, events.len() as u32).expect("vec");
    let hash = |w: &mut Vec<u8>, h: u64| {
        if shape == Shape::Sglang {
            e::write_sint(w, h as i64).expect("vec");
        } else {
            e::write_uint(w, h).expect("vec");
        }
    };
    let hashes = |w: &mut Vec<u8>, hs: &[u64]| {
        e::write_array_len(w, hs.len() as u32).expect("vec");
        for &h in hs {
            hash(w, h);
        }
    };
    for ev in events {
        let key = |w: &mut Vec<u8>, k: &str| {
            if map {
                e::write_str(w, k).expect("vec");
            }
        };
        match ev {
            EventOut::Stored(s) => {
                let blocks = s.hashes.len();
                let with_extra = s.lora_name.is_some() || s.cache_salt.is_some();
                // vLLM omits defaults: no extra_keys / lora_name fields when unset.
                let fields =
                    6 + u32::from(s.lora_name.is_some() || with_extra) + u32::from(with_extra);
                header(w, map, fields + 1, "BlockStored");
                key(w, "block_hashes");
                hashes(w, s.hashes);
                key(w, "parent_block_hash");
                match s.parent {
                    Some(p) => hash(w, p),
                    None => e::write_nil(w).expect("vec"),
                }
                key(w, "token_ids");
                e::write_array_len(w, s.token_ids.len() as u32).expect("vec");
                for &t in s.token_ids {
                    e::write_uint(w, u64::from(t)).expect("vec");
                }
                key(w, "block_size");
                e::write_uint(w, u64::from(s.block_size)).expect("vec");
                key(w, "lora_id");
                e::write_nil(w).expect("vec");
                key(w, "medium");
                e::write_str(w, s.medium.unwrap_or("GPU")).expect("vec");
                if s.lora_name.is_some() || with_extra {
                    key(w, "lora_name");
                    match s.lora_name {
                        Some(n) => e::write_str(w, n).expect("vec"),
                        None => e::write_nil(w).expect("vec"),
                    }
                }
                if with_extra {
                    key(w, "extra_keys");
                    e::write_array_len(w, blocks as u32).expect("vec");
                    for i in 0..blocks {
                        let salt = s.cache_salt.filter(|_| i == 0 && s.parent.is_none());
                        let n = u32::from(s.lora_name.is_some()) + u32::from(salt.is_some());
                        if n == 0 {
                            e::write_nil(w).expect("vec");
                            continue;
                        }
                        e::write_array_len(w, n).expect("vec");
                        if let Some(l) = s.lora_name {
                            e::write_str(w, l).expect("vec");
                        }
                        if let Some(salt) = salt {
                            e::write_str(w, salt).expect("vec");
                        }
                    }
                }
            }
            EventOut::Removed(hs) => {
                header(w, map, 3, "BlockRemoved");
                key(w, "block_hashes");
                hashes(w, hs);
                key(w, "medium");
                e::write_str(w, "GPU").expect("vec");
            }
            EventOut::Cleared => {
                header(w, map, 1, "AllBlocksCleared");
            }
            EventOut::Other(tag) => {
                header(w, map, 2, tag);
                key(w, "value");
                e::write_uint(w, 1).expect("vec");
            }
        }
    }
    if map {
        e::write_str(w, "data_parallel_rank").expect("vec");
    }
    e::write_uint(w, u64::from(rank)).expect("vec");
    out
}
