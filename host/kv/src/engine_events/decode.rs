//! Engine KV event batches decoded: the map and positional shapes, unknown fields and types skipped.

use rmpv::ValueRef;

use super::extra::ExtraHasher;
use super::msgpack::*;
use super::*;
/// An engine block hash as a `u64`: unsigned integers as they are, signed ones by their
/// two's-complement bits (so SGLang's `-1` and vLLM's `2^64 - 1` agree), byte strings by
/// their XXH3-64.
pub fn engine_hash(v: &ValueRef<'_>) -> Option<u64> {
    match v {
        ValueRef::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|x| x as u64)),
        ValueRef::Binary(b) => Some(xxhash_rust::xxh3::xxh3_64(b)),
        ValueRef::String(s) => Some(xxhash_rust::xxh3::xxh3_64(s.as_bytes())),
        _ => None,
    }
}

/// Decodes one payload.
///
/// The payload is walked lazily ([`Raw`]): containers are not materialised, and token IDs
/// are read straight from their msgpack array, so a batch costs no allocation per token.
pub fn decode_batch(payload: &[u8]) -> Result<EngineBatch, DecodeError> {
    // One pass: the events are decoded where they are met (every other value is only
    // skipped), so token arrays are walked twice in all (skipped, then read).
    let (mut ts, mut events, mut rank) = (None, None, None);
    if let Some((n, mut rd)) = Raw(payload).array()? {
        for i in 0..n {
            if i == 1 {
                let (e, rest) = decode_events(rd)?;
                events = Some(e);
                rd = rest;
                continue;
            }
            let (v, rest) = Raw::split(rd)?;
            match i {
                0 => ts = Some(v),
                2 => rank = Some(v),
                _ => {}
            }
            rd = rest;
        }
    } else if let Some((n, mut rd)) = Raw(payload).map()? {
        for _ in 0..n {
            let (k, rest) = Raw::split(rd)?;
            rd = rest;
            let name = k.str();
            if name == Some("events") {
                let (e, rest) = decode_events(rd)?;
                events = Some(e);
                rd = rest;
                continue;
            }
            let (v, rest) = Raw::split(rd)?;
            rd = rest;
            match name {
                Some("ts") => ts = Some(v),
                Some("data_parallel_rank") => rank = Some(v),
                Some("attn_dp_rank") if rank.is_none() => rank = Some(v),
                _ => {}
            }
        }
    } else {
        return Err(bad("the batch is neither an array nor a map"));
    }
    let ts = scalar(ts)?
        .as_ref()
        .and_then(as_f64)
        .ok_or_else(|| bad("no `ts`"))?;
    let events = events.ok_or_else(|| bad("no `events` array"))?;
    let rank = scalar(rank)?.as_ref().and_then(as_u64).map(|r| r as u32);
    Ok(EngineBatch { ts, rank, events })
}

/// The events array at the start of `rd`, and what follows it.
pub(super) fn decode_events(rd: &[u8]) -> Result<(Vec<EngineEvent>, &[u8]), DecodeError> {
    let Some((n, mut rd)) = Raw(rd).array()? else {
        return Err(bad("no `events` array"));
    };
    let mut out = Vec::with_capacity((n as usize).min(rd.len()));
    for _ in 0..n {
        let (event, rest) = decode_event(rd)?;
        out.push(event);
        rd = rest;
    }
    Ok((out, rd))
}

/// The event at the start of `rd`, and what follows it.
pub(super) fn decode_event(rd: &[u8]) -> Result<(EngineEvent, &[u8]), DecodeError> {
    let v = Raw(rd);
    let (f, rest) = if let Some((a, rest)) = v.items()? {
        let f = Fields {
            tag: a
                .first()
                .and_then(|t| t.str())
                .ok_or_else(|| bad("an event without a tag"))?,
            positional: Some(a),
            map: None,
        };
        (f, rest)
    } else if let Some((m, rest)) = v.entries()? {
        let f = Fields {
            tag: field(&m, "type")
                .and_then(Raw::str)
                .ok_or_else(|| bad("an event without `type`"))?,
            positional: None,
            map: Some(m),
        };
        (f, rest)
    } else {
        return Err(bad("an event is neither an array nor a map"));
    };
    Ok((fields_event(&f)?, rest))
}

pub(super) fn fields_event(f: &Fields<'_>) -> Result<EngineEvent, DecodeError> {
    match f.tag {
        "BlockStored" => {
            let hashes = hashes(f.get("block_hashes", 0))?;
            let parent = match f.scalar("parent_block_hash", 1)? {
                None | Some(ValueRef::Nil) => None,
                Some(p) => Some(engine_hash(&p).ok_or_else(|| bad("bad parent_block_hash"))?),
            };
            let token_ids = token_ids(f.get("token_ids", 2))?;
            let block_size = f
                .scalar("block_size", 3)?
                .as_ref()
                .and_then(as_u64)
                .and_then(|b| u32::try_from(b).ok())
                .filter(|b| *b > 0)
                .ok_or_else(|| bad("BlockStored without a block_size"))?;
            let lora_id = f.scalar("lora_id", 4)?;
            let medium = medium(f.scalar("medium", 5)?.as_ref())?;
            let lora_name = f.scalar("lora_name", 6)?;
            // Small per-block tuples: decoded whole.
            let extra_keys = match f.get("extra_keys", 7) {
                Some(r) if !r.is_nil() => Some(r.value()?),
                _ => None,
            };
            let extra = extras(
                extra_keys.as_ref(),
                lora_name.as_ref(),
                lora_id.as_ref(),
                hashes.len(),
            )?;
            Ok(EngineEvent::Stored(StoredBlocks {
                hashes,
                parent,
                token_ids,
                block_size,
                medium,
                extra,
                group: f.group()?,
            }))
        }
        "BlockRemoved" => Ok(EngineEvent::Removed {
            hashes: hashes(f.get("block_hashes", 0))?,
            medium: medium(f.scalar("medium", 1)?.as_ref())?,
            group: f.group()?,
        }),
        "AllBlocksCleared" => Ok(EngineEvent::Cleared),
        other => Ok(EngineEvent::Unknown(other.chars().take(64).collect())),
    }
}

pub(super) fn hashes(v: Option<Raw<'_>>) -> Result<Vec<u64>, DecodeError> {
    let (items, _) = v
        .map(Raw::items)
        .transpose()?
        .flatten()
        .ok_or_else(|| bad("no block_hashes array"))?;
    items
        .into_iter()
        .map(|h| {
            h.value()
                .ok()
                .and_then(|h| engine_hash(&h))
                .ok_or_else(|| bad("a block hash is neither an integer nor bytes"))
        })
        .collect()
}

/// Token IDs read straight from their array.
pub(super) fn token_ids(v: Option<Raw<'_>>) -> Result<Vec<u32>, DecodeError> {
    let Some((n, mut rd)) = v.map(Raw::array).transpose()?.flatten() else {
        return Err(bad("BlockStored without token_ids"));
    };
    let not_u32 = || bad("a token ID is not a u32");
    let mut out = Vec::with_capacity((n as usize).min(rd.len()));
    for _ in 0..n {
        let (&marker, rest) = rd.split_first().ok_or_else(not_u32)?;
        // Any integer encoding of a value in 0..2^32.
        let (width, signed) = match marker {
            0x00..=0x7f => {
                out.push(u32::from(marker));
                rd = rest;
                continue;
            }
            0xcc => (1, false),
            0xcd => (2, false),
            0xce => (4, false),
            0xcf => (8, false),
            0xd0 => (1, true),
            0xd1 => (2, true),
            0xd2 => (4, true),
            0xd3 => (8, true),
            _ => return Err(not_u32()),
        };
        let (bytes, rest) = rest.split_at_checked(width).ok_or_else(not_u32)?;
        let value = big_endian(bytes);
        let negative = signed && bytes[0] & 0x80 != 0;
        out.push(
            u32::try_from(value)
                .ok()
                .filter(|_| !negative)
                .ok_or_else(not_u32)?,
        );
        rd = rest;
    }
    Ok(out)
}

pub(super) fn medium(v: Option<&ValueRef<'_>>) -> Result<Medium, DecodeError> {
    match v {
        None | Some(ValueRef::Nil) => Ok(Medium::Gpu),
        Some(m) => match as_str(m) {
            Some(s) if s.eq_ignore_ascii_case("GPU") => Ok(Medium::Gpu),
            Some(s) => Ok(Medium::Other(s.chars().take(32).collect())),
            None => Err(bad("medium is not a string")),
        },
    }
}

/// The named fields of one event, whichever shape it came in.
pub(super) struct Fields<'a> {
    pub(super) tag: &'a str,
    pub(super) positional: Option<Vec<Raw<'a>>>,
    pub(super) map: Option<Vec<(Raw<'a>, Raw<'a>)>>,
}

impl<'a> Fields<'a> {
    /// Field `name`, at `index` after the tag in the positional shape.
    pub(super) fn get(&self, name: &str, index: usize) -> Option<Raw<'a>> {
        match (&self.positional, &self.map) {
            (Some(p), _) => p.get(index + 1).copied(),
            (_, Some(m)) => field(m, name),
            _ => None,
        }
    }

    /// A scalar field, decoded.
    pub(super) fn scalar(
        &self,
        name: &str,
        index: usize,
    ) -> Result<Option<ValueRef<'a>>, DecodeError> {
        scalar(self.get(name, index))
    }

    /// `group_idx` (maps only), 0 when absent.
    pub(super) fn group(&self) -> Result<u32, DecodeError> {
        let g = scalar(self.map.as_ref().and_then(|m| field(m, "group_idx")))?;
        Ok(group(g.as_ref()))
    }
}

pub(super) fn group(v: Option<&ValueRef<'_>>) -> u32 {
    v.and_then(as_u64)
        .map_or(0, |g| g.min(u64::from(u32::MAX)) as u32)
}

/// Per-block extra-key hashes. `extra_keys` (one entry per block, each a tuple or nil)
/// when the event has it; otherwise the LoRA adapter, as vLLM would put it in each
/// block's extra keys (`lora_name`; SGLang's numeric `lora_id` when there is no name).
pub(super) fn extras(
    extra_keys: Option<&ValueRef<'_>>,
    lora_name: Option<&ValueRef<'_>>,
    lora_id: Option<&ValueRef<'_>>,
    blocks: usize,
) -> Result<Vec<u64>, DecodeError> {
    if let Some(ValueRef::Array(per_block)) = extra_keys {
        if per_block.len() != blocks {
            return Err(bad(format!(
                "extra_keys has {} entries for {blocks} blocks",
                per_block.len()
            )));
        }
        return Ok(per_block
            .iter()
            .map(|k| match k {
                ValueRef::Nil => 0,
                ValueRef::Array(items) if items.is_empty() => 0,
                other => {
                    let mut h = ExtraHasher::default();
                    h.value(other);
                    h.finish()
                }
            })
            .collect());
    }
    let adapter = match (lora_name, lora_id) {
        (Some(n), _) if !is_nil(Some(n)) => Some(n),
        (_, Some(id)) if !is_nil(Some(id)) && as_u64(id) != Some(0) => Some(id),
        _ => None,
    };
    Ok(match adapter {
        None => Vec::new(),
        Some(a) => {
            let mut h = ExtraHasher::default();
            h.list_start(1);
            h.value(a);
            vec![h.finish(); blocks]
        }
    })
}
