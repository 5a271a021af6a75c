//! The KV events real engines publish: vLLM's and SGLang's msgpack batches (the ZMQ
//! transport is in `router::engine_subscriber`). Pure decoding and encoding, no I/O.
//!
//! One ZMQ message is `[topic, seq as 8 bytes big-endian, payload]`; the payload is a
//! batch, either positional `[ts, [events], rank]` (older vLLM, SGLang) or a map
//! `{ts, events, data_parallel_rank}` (current vLLM). Events are maps tagged `"type"`
//! (current vLLM) or positional arrays beginning with the tag (older vLLM, SGLang):
//!
//! | tag | positional fields after the tag |
//! | --- | --- |
//! | `BlockStored` | `block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id`, `medium`, `lora_name`, `extra_keys` |
//! | `BlockRemoved` | `block_hashes`, `medium` |
//! | `AllBlocksCleared` | — |
//!
//! Optional fields may be absent, unknown fields are ignored, unknown event types are
//! reported as [`EngineEvent::Unknown`]. Engine block hashes are unsigned (vLLM) or signed
//! (SGLang) 64-bit integers, or byte strings; all become a `u64` ([`engine_hash`]). They
//! depend on each engine process's random seed, so the router never indexes them: it
//! re-hashes `token_ids` with its own chain (`kv::engine_view`).

use rmpv::ValueRef;

/// A decoding failure: the payload is not a batch of the shape above.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not an engine KV event batch: {0}")]
pub struct DecodeError(pub String);

fn bad(why: impl Into<String>) -> DecodeError {
    DecodeError(why.into())
}

/// One decoded batch.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineBatch {
    /// The engine's wall-clock time of the batch, seconds since the epoch.
    pub ts: f64,
    /// Its data-parallel rank, when the engine says.
    pub rank: Option<u32>,
    /// The events, in order.
    pub events: Vec<EngineEvent>,
}

/// Where a block lives. Only GPU blocks count as cached for routing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Medium {
    /// The engine's GPU cache (also when the event names no medium).
    Gpu,
    /// Another tier (`"CPU"`, `"DISK"`, …): offloaded copies.
    Other(String),
}

/// Blocks that became cached.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredBlocks {
    /// The engine's hashes of the blocks, in prompt order.
    pub hashes: Vec<u64>,
    /// The engine's hash of the block before the first one (none for a prompt's start).
    pub parent: Option<u64>,
    /// The blocks' tokens, `hashes.len() × block_size` of them.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// Where the blocks are.
    pub medium: Medium,
    /// Per block: a hash of the engine's extra keys (LoRA name, multimodal IDs,
    /// `cache_salt`, …), 0 for none. Empty when the event carries none at all.
    pub extra: Vec<u64>,
    /// The KV cache group (hybrid models publish one event per group); 0 when absent.
    pub group: u32,
}

/// One engine event.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// `BlockStored`.
    Stored(StoredBlocks),
    /// `BlockRemoved`.
    Removed {
        /// The engine's hashes.
        hashes: Vec<u64>,
        /// Where they were.
        medium: Medium,
        /// The KV cache group.
        group: u32,
    },
    /// `AllBlocksCleared`.
    Cleared,
    /// An event type this router does not know (counted and skipped).
    Unknown(String),
}

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
fn decode_events(rd: &[u8]) -> Result<(Vec<EngineEvent>, &[u8]), DecodeError> {
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

/// One msgpack value, undecoded: exactly its bytes.
#[derive(Debug, Clone, Copy)]
struct Raw<'a>(&'a [u8]);

/// A container's parts, and the bytes after the container.
type Parts<'a, T> = Result<Option<(Vec<T>, &'a [u8])>, DecodeError>;

impl<'a> Raw<'a> {
    /// The value at the start of `buf`, and what follows it.
    fn split(buf: &'a [u8]) -> Result<(Raw<'a>, &'a [u8]), DecodeError> {
        let mut rest = buf;
        skip(&mut rest)?;
        let len = buf.len() - rest.len();
        Ok((Raw(&buf[..len]), rest))
    }

    /// The value, decoded (containers are materialised: for scalars and small values).
    fn value(self) -> Result<ValueRef<'a>, DecodeError> {
        let mut rd = self.0;
        rmpv::decode::read_value_ref(&mut rd).map_err(|e| bad(e.to_string()))
    }

    /// The element count and first element, if an array.
    fn array(self) -> Result<Option<(u32, &'a [u8])>, DecodeError> {
        self.header(0x90, [0xdc, 0xdd])
    }

    /// The entry count and first entry, if a map.
    fn map(self) -> Result<Option<(u32, &'a [u8])>, DecodeError> {
        self.header(0x80, [0xde, 0xdf])
    }

    /// A container's count and what follows its header, if its marker is the `fix` form
    /// (count in the low nibble) or one of the 16- and 32-bit forms.
    fn header(self, fix: u8, wide: [u8; 2]) -> Result<Option<(u32, &'a [u8])>, DecodeError> {
        let (&marker, rest) = self.0.split_first().ok_or_else(truncated)?;
        let width = match marker {
            _ if marker & 0xf0 == fix => return Ok(Some((u32::from(marker & 0x0f), rest))),
            _ if marker == wide[0] => 2,
            _ if marker == wide[1] => 4,
            _ => return Ok(None),
        };
        let (len, rest) = rest.split_at_checked(width).ok_or_else(truncated)?;
        Ok(Some((big_endian(len) as u32, rest)))
    }

    /// The elements, if an array, and what follows the array.
    fn items(self) -> Parts<'a, Raw<'a>> {
        let Some((n, mut rd)) = self.array()? else {
            return Ok(None);
        };
        let mut out = Vec::with_capacity((n as usize).min(rd.len()));
        for _ in 0..n {
            let (v, rest) = Raw::split(rd)?;
            out.push(v);
            rd = rest;
        }
        Ok(Some((out, rd)))
    }

    /// The key-value pairs, if a map, and what follows the map.
    fn entries(self) -> Parts<'a, (Raw<'a>, Raw<'a>)> {
        let Some((n, mut rd)) = self.map()? else {
            return Ok(None);
        };
        let mut out = Vec::with_capacity((n as usize).min(rd.len()));
        for _ in 0..n {
            let (k, rest) = Raw::split(rd)?;
            let (v, rest) = Raw::split(rest)?;
            out.push((k, v));
            rd = rest;
        }
        Ok(Some((out, rd)))
    }

    /// Whether it is nil.
    fn is_nil(self) -> bool {
        self.0.first() == Some(&0xc0)
    }

    /// The string, if a string (keys and tags: read without a decoder).
    fn str(self) -> Option<&'a str> {
        let (&marker, rest) = self.0.split_first()?;
        let (len, rest) = match marker {
            0xa0..=0xbf => (usize::from(marker & 0x1f), rest),
            0xd9 => (usize::from(*rest.first()?), &rest[1..]),
            _ => {
                return match self.value().ok()? {
                    ValueRef::String(s) => s.into_str(),
                    _ => None,
                };
            }
        };
        std::str::from_utf8(rest.get(..len)?).ok()
    }
}

fn truncated() -> DecodeError {
    bad("truncated msgpack")
}

/// A big-endian unsigned integer of up to 8 bytes.
fn big_endian(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0u64, |v, b| v << 8 | u64::from(*b))
}

/// Moves `rd` past one msgpack value (containers included, without recursion). Markers
/// are matched as bytes: this walks every token of a batch, so it is kept tight.
fn skip(rd: &mut &[u8]) -> Result<(), DecodeError> {
    // A big-endian length of `n` bytes.
    let len = |rd: &mut &[u8], n: usize| -> Result<u64, DecodeError> {
        let (head, rest) = rd.split_at_checked(n).ok_or_else(truncated)?;
        *rd = rest;
        Ok(big_endian(head))
    };
    let mut pending: u64 = 1;
    while pending > 0 {
        pending -= 1;
        let (&marker, rest) = rd.split_first().ok_or_else(truncated)?;
        *rd = rest;
        let data: u64 = match marker {
            // fixint, nil, false, true
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => 0,
            0x80..=0x8f => {
                pending += 2 * u64::from(marker & 0x0f);
                0
            }
            0x90..=0x9f => {
                pending += u64::from(marker & 0x0f);
                0
            }
            0xa0..=0xbf => u64::from(marker & 0x1f),
            0xcc | 0xd0 => 1,
            0xcd | 0xd1 => 2,
            0xca | 0xce | 0xd2 => 4,
            0xcb | 0xcf | 0xd3 => 8,
            0xc4 | 0xd9 => len(rd, 1)?,
            0xc5 | 0xda => len(rd, 2)?,
            0xc6 | 0xdb => len(rd, 4)?,
            0xdc => {
                pending += len(rd, 2)?;
                0
            }
            0xdd => {
                pending += len(rd, 4)?;
                0
            }
            0xde => {
                pending += 2 * len(rd, 2)?;
                0
            }
            0xdf => {
                pending += 2 * len(rd, 4)?;
                0
            }
            0xd4 => 2,
            0xd5 => 3,
            0xd6 => 5,
            0xd7 => 9,
            0xd8 => 17,
            0xc7 => len(rd, 1)? + 1,
            0xc8 => len(rd, 2)? + 1,
            0xc9 => len(rd, 4)? + 1,
            0xc1 => return Err(bad("a reserved msgpack marker")),
        };
        if data > 0 {
            let data = usize::try_from(data).map_err(|_| truncated())?;
            *rd = rd.get(data..).ok_or_else(truncated)?;
        }
    }
    Ok(())
}

/// A scalar field's value (`None` when absent).
fn scalar(v: Option<Raw<'_>>) -> Result<Option<ValueRef<'_>>, DecodeError> {
    v.map(Raw::value).transpose()
}

fn field<'a>(m: &[(Raw<'a>, Raw<'a>)], name: &str) -> Option<Raw<'a>> {
    m.iter()
        .find(|(k, _)| k.str() == Some(name))
        .map(|(_, v)| *v)
}

fn as_str<'b>(v: &'b ValueRef<'_>) -> Option<&'b str> {
    match v {
        ValueRef::String(s) => s.as_str(),
        _ => None,
    }
}

fn as_u64(v: &ValueRef<'_>) -> Option<u64> {
    match v {
        ValueRef::Integer(i) => i.as_u64(),
        _ => None,
    }
}

fn as_f64(v: &ValueRef<'_>) -> Option<f64> {
    match v {
        ValueRef::F64(f) => Some(*f),
        ValueRef::F32(f) => Some(f64::from(*f)),
        ValueRef::Integer(i) => i.as_f64(),
        _ => None,
    }
}

fn is_nil(v: Option<&ValueRef<'_>>) -> bool {
    matches!(v, None | Some(ValueRef::Nil))
}

/// The named fields of one event, whichever shape it came in.
struct Fields<'a> {
    tag: &'a str,
    positional: Option<Vec<Raw<'a>>>,
    map: Option<Vec<(Raw<'a>, Raw<'a>)>>,
}

impl<'a> Fields<'a> {
    /// Field `name`, at `index` after the tag in the positional shape.
    fn get(&self, name: &str, index: usize) -> Option<Raw<'a>> {
        match (&self.positional, &self.map) {
            (Some(p), _) => p.get(index + 1).copied(),
            (_, Some(m)) => field(m, name),
            _ => None,
        }
    }

    /// A scalar field, decoded.
    fn scalar(&self, name: &str, index: usize) -> Result<Option<ValueRef<'a>>, DecodeError> {
        scalar(self.get(name, index))
    }

    /// `group_idx` (maps only), 0 when absent.
    fn group(&self) -> Result<u32, DecodeError> {
        let g = scalar(self.map.as_ref().and_then(|m| field(m, "group_idx")))?;
        Ok(group(g.as_ref()))
    }
}

/// The event at the start of `rd`, and what follows it.
fn decode_event(rd: &[u8]) -> Result<(EngineEvent, &[u8]), DecodeError> {
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

fn fields_event(f: &Fields<'_>) -> Result<EngineEvent, DecodeError> {
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

fn hashes(v: Option<Raw<'_>>) -> Result<Vec<u64>, DecodeError> {
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
fn token_ids(v: Option<Raw<'_>>) -> Result<Vec<u32>, DecodeError> {
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

fn medium(v: Option<&ValueRef<'_>>) -> Result<Medium, DecodeError> {
    match v {
        None | Some(ValueRef::Nil) => Ok(Medium::Gpu),
        Some(m) => match as_str(m) {
            Some(s) if s.eq_ignore_ascii_case("GPU") => Ok(Medium::Gpu),
            Some(s) => Ok(Medium::Other(s.chars().take(32).collect())),
            None => Err(bad("medium is not a string")),
        },
    }
}

fn group(v: Option<&ValueRef<'_>>) -> u32 {
    v.and_then(as_u64)
        .map_or(0, |g| g.min(u64::from(u32::MAX)) as u32)
}

/// Per-block extra-key hashes. `extra_keys` (one entry per block, each a tuple or nil)
/// when the event has it; otherwise the LoRA adapter, as vLLM would put it in each
/// block's extra keys (`lora_name`; SGLang's numeric `lora_id` when there is no name).
fn extras(
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

/// One element of a block's extra keys, built by the router for a request (so that its
/// hashes match the engine's): see [`extra_hash`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtraKey<'a> {
    /// A string (LoRA name, `cache_salt`).
    Str(&'a str),
    /// An integer.
    Int(i64),
}

/// The hash of a block's extra keys, as [`decode_batch`] computes it from an event's
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
struct ExtraHasher(Vec<u8>);

impl ExtraHasher {
    fn list_start(&mut self, n: usize) {
        self.0.push(b'l');
        self.0.extend_from_slice(&(n as u64).to_le_bytes());
    }
    fn bytes(&mut self, tag: u8, b: &[u8]) {
        self.0.push(tag);
        self.0.extend_from_slice(&(b.len() as u64).to_le_bytes());
        self.0.extend_from_slice(b);
    }
    fn int(&mut self, i: i64) {
        self.0.push(b'i');
        self.0.extend_from_slice(&i.to_le_bytes());
    }
    fn value(&mut self, v: &ValueRef<'_>) {
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
    fn finish(&self) -> u64 {
        // Never 0, which means "no extra keys".
        xxhash_rust::xxh3::xxh3_64(&self.0).max(1)
    }
}

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
fn header(w: &mut Vec<u8>, map: bool, fields: u32, tag: &str) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn stored<'a>(hashes: &'a [u64], parent: Option<u64>, tokens: &'a [u32]) -> EventOut<'a> {
        EventOut::Stored(StoredOut {
            hashes,
            parent,
            token_ids: tokens,
            block_size: 2,
            ..Default::default()
        })
    }

    #[test]
    fn every_shape_decodes_to_the_same_events() {
        let tokens = [1, 2, 3, 4];
        let big = u64::MAX - 5; // past i64::MAX: SGLang sends it negative
        let (stored_hashes, removed) = ([big, 7], [big]);
        let events = [
            stored(&stored_hashes, Some(3), &tokens),
            EventOut::Removed(&removed),
            EventOut::Cleared,
            EventOut::Other("SomethingNew"),
        ];
        for shape in [Shape::VllmMap, Shape::VllmArray, Shape::Sglang] {
            let batch = decode_batch(&encode_batch(shape, 12.5, 1, &events)).unwrap();
            assert_eq!(batch.ts, 12.5, "{shape:?}");
            assert_eq!(batch.rank, Some(1), "{shape:?}");
            assert_eq!(
                batch.events,
                vec![
                    EngineEvent::Stored(StoredBlocks {
                        hashes: vec![big, 7],
                        parent: Some(3),
                        token_ids: tokens.to_vec(),
                        block_size: 2,
                        medium: Medium::Gpu,
                        extra: vec![],
                        group: 0,
                    }),
                    EngineEvent::Removed {
                        hashes: vec![big],
                        medium: Medium::Gpu,
                        group: 0,
                    },
                    EngineEvent::Cleared,
                    EngineEvent::Unknown("SomethingNew".into()),
                ],
                "{shape:?}"
            );
        }
    }

    type Field<'a> = (&'a str, &'a dyn Fn(&mut Vec<u8>));

    /// Writes a map with the given (key, value-writer) pairs.
    fn map(w: &mut Vec<u8>, fields: &[Field<'_>]) {
        rmp::encode::write_map_len(w, fields.len() as u32).unwrap();
        for (k, f) in fields {
            rmp::encode::write_str(w, k).unwrap();
            f(w);
        }
    }

    #[test]
    fn missing_optional_fields_unknown_fields_and_byte_hashes_are_accepted() {
        use rmp::encode as e;
        let mut w = Vec::new();
        let event = |w: &mut Vec<u8>| {
            map(
                w,
                &[
                    ("type", &|w| {
                        e::write_str(w, "BlockStored").map(drop).unwrap()
                    }),
                    ("block_hashes", &|w| {
                        e::write_array_len(w, 1).unwrap();
                        e::write_bin(w, &[9u8; 32]).unwrap();
                    }),
                    ("token_ids", &|w| {
                        e::write_array_len(w, 2).unwrap();
                        e::write_uint(w, 5).unwrap();
                        e::write_uint(w, 6).unwrap();
                    }),
                    ("block_size", &|w| e::write_uint(w, 2).map(drop).unwrap()),
                    ("kv_cache_spec_kind", &|w| {
                        e::write_str(w, "full").map(drop).unwrap()
                    }),
                    ("group_idx", &|w| e::write_uint(w, 1).map(drop).unwrap()),
                ],
            )
        };
        map(
            &mut w,
            &[
                ("ts", &|w| e::write_f64(w, 1.0).unwrap()),
                ("events", &|w| {
                    e::write_array_len(w, 1).unwrap();
                    event(w);
                }),
            ],
        );
        let batch = decode_batch(&w).unwrap();
        assert_eq!(batch.rank, None);
        let EngineEvent::Stored(s) = &batch.events[0] else {
            panic!("{batch:?}")
        };
        assert_eq!(s.hashes, vec![xxhash_rust::xxh3::xxh3_64(&[9u8; 32])]);
        assert_eq!(
            (s.parent, s.medium.clone(), s.group),
            (None, Medium::Gpu, 1)
        );
    }

    #[test]
    fn token_ids_are_read_in_every_integer_encoding() {
        let batch = |write_tokens: &dyn Fn(&mut Vec<u8>)| {
            let mut w = Vec::new();
            rmp::encode::write_array_len(&mut w, 2).unwrap();
            rmp::encode::write_f64(&mut w, 0.0).unwrap();
            rmp::encode::write_array_len(&mut w, 1).unwrap();
            rmp::encode::write_array_len(&mut w, 5).unwrap();
            rmp::encode::write_str(&mut w, "BlockStored").unwrap();
            rmp::encode::write_array_len(&mut w, 1).unwrap();
            rmp::encode::write_uint(&mut w, 9).unwrap();
            rmp::encode::write_nil(&mut w).unwrap();
            write_tokens(&mut w);
            rmp::encode::write_uint(&mut w, 5).unwrap();
            decode_batch(&w)
        };
        let ok = batch(&|w| {
            rmp::encode::write_array_len(w, 5).unwrap();
            rmp::encode::write_pfix(w, 5).unwrap();
            rmp::encode::write_u8(w, 200).unwrap();
            rmp::encode::write_u16(w, 60_000).unwrap();
            rmp::encode::write_i32(w, 7).unwrap();
            rmp::encode::write_u64(w, 4_000_000_000).unwrap();
        })
        .unwrap();
        let EngineEvent::Stored(s) = &ok.events[0] else {
            panic!("{ok:?}")
        };
        assert_eq!(s.token_ids, vec![5, 200, 60_000, 7, 4_000_000_000]);
        for bad_token in [
            &(|w: &mut Vec<u8>| rmp::encode::write_i8(w, -1).map(|_| ()).unwrap())
                as &dyn Fn(&mut Vec<u8>),
            &|w| rmp::encode::write_u64(w, 1 << 33).unwrap(),
            &|w| rmp::encode::write_f64(w, 1.0).unwrap(),
        ] {
            let err = batch(&|w| {
                rmp::encode::write_array_len(w, 5).unwrap();
                for _ in 0..4 {
                    rmp::encode::write_pfix(w, 1).unwrap();
                }
                bad_token(w);
            })
            .unwrap_err();
            assert!(err.to_string().contains("token ID"), "{err}");
        }
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for payload in [
            &b""[..],
            b"\xc1",
            b"\x93\x01",
            b"\x92\xcb\0\0\0\0\0\0\0\0\x91\x01",
        ] {
            assert!(decode_batch(payload).is_err(), "{payload:?}");
        }
        // A BlockStored without tokens.
        let mut w = Vec::new();
        rmp::encode::write_array_len(&mut w, 2).unwrap();
        rmp::encode::write_f64(&mut w, 0.0).unwrap();
        rmp::encode::write_array_len(&mut w, 1).unwrap();
        rmp::encode::write_array_len(&mut w, 2).unwrap();
        rmp::encode::write_str(&mut w, "BlockStored").unwrap();
        rmp::encode::write_array_len(&mut w, 0).unwrap();
        assert!(decode_batch(&w).is_err());
        // Every truncation of a valid batch, and an array claiming 4G elements.
        let tokens: Vec<u32> = (0..32).map(|t| t * 70_000).collect();
        let valid = encode_batch(
            Shape::VllmMap,
            1.0,
            0,
            &[EventOut::Stored(StoredOut {
                hashes: &[u64::MAX, 7],
                token_ids: &tokens,
                block_size: 16,
                lora_name: Some("a"),
                cache_salt: Some("s"),
                ..Default::default()
            })],
        );
        assert!(decode_batch(&valid).is_ok());
        for cut in 0..valid.len() {
            assert!(decode_batch(&valid[..cut]).is_err(), "cut at {cut}");
        }
        assert!(decode_batch(b"\xdd\xff\xff\xff\xff\x01").is_err());
    }

    #[test]
    fn lora_and_salt_give_extra_hashes_a_router_can_reproduce() {
        let tokens = [1, 2, 3, 4];
        let ev = EventOut::Stored(StoredOut {
            hashes: &[1, 2],
            parent: None,
            token_ids: &tokens,
            block_size: 2,
            lora_name: Some("adapter-a"),
            cache_salt: Some("tenant-1"),
            ..Default::default()
        });
        let batch = decode_batch(&encode_batch(Shape::VllmMap, 0.0, 0, &[ev])).unwrap();
        let EngineEvent::Stored(s) = &batch.events[0] else {
            panic!()
        };
        assert_eq!(
            s.extra,
            vec![
                extra_hash(&[ExtraKey::Str("adapter-a"), ExtraKey::Str("tenant-1")]),
                extra_hash(&[ExtraKey::Str("adapter-a")]),
            ]
        );
        // Positional events without extra_keys: the adapter name alone, on every block.
        let ev = EventOut::Stored(StoredOut {
            hashes: &[1, 2],
            token_ids: &tokens,
            block_size: 2,
            lora_name: Some("adapter-a"),
            ..Default::default()
        });
        let mut bytes = encode_batch(Shape::VllmArray, 0.0, 0, &[ev]);
        let batch = decode_batch(&bytes).unwrap();
        let EngineEvent::Stored(s) = &batch.events[0] else {
            panic!()
        };
        assert_eq!(s.extra, vec![extra_hash(&[ExtraKey::Str("adapter-a")]); 2]);
        bytes.clear();
        assert_eq!(extra_hash(&[]), 0);
    }

    #[test]
    fn other_media_are_kept_apart() {
        let tokens = [1, 2];
        let ev = EventOut::Stored(StoredOut {
            hashes: &[1],
            token_ids: &tokens,
            block_size: 2,
            medium: Some("CPU"),
            ..Default::default()
        });
        let batch = decode_batch(&encode_batch(Shape::VllmMap, 0.0, 0, &[ev])).unwrap();
        let EngineEvent::Stored(s) = &batch.events[0] else {
            panic!()
        };
        assert_eq!(s.medium, Medium::Other("CPU".into()));
    }
}
