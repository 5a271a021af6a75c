//! A msgpack reader for untrusted payloads: every length is checked against what is left before anything is read or allocated.

use rmpv::ValueRef;

use super::{DecodeError, bad};
/// One msgpack value, undecoded: exactly its bytes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Raw<'a>(pub(super) &'a [u8]);

/// A container's parts, and the bytes after the container.
type Parts<'a, T> = Result<Option<(Vec<T>, &'a [u8])>, DecodeError>;

impl<'a> Raw<'a> {
    /// The value at the start of `buf`, and what follows it.
    pub(super) fn split(buf: &'a [u8]) -> Result<(Raw<'a>, &'a [u8]), DecodeError> {
        let mut rest = buf;
        skip(&mut rest)?;
        let len = buf.len() - rest.len();
        Ok((Raw(&buf[..len]), rest))
    }

    /// The value, decoded (containers are materialised: for scalars and small values).
    pub(super) fn value(self) -> Result<ValueRef<'a>, DecodeError> {
        let mut rd = self.0;
        rmpv::decode::read_value_ref(&mut rd).map_err(|e| bad(e.to_string()))
    }

    /// The element count and first element, if an array.
    pub(super) fn array(self) -> Result<Option<(u32, &'a [u8])>, DecodeError> {
        self.header(0x90, [0xdc, 0xdd])
    }

    /// The entry count and first entry, if a map.
    pub(super) fn map(self) -> Result<Option<(u32, &'a [u8])>, DecodeError> {
        self.header(0x80, [0xde, 0xdf])
    }

    /// A container's count and what follows its header, if its marker is the `fix` form
    /// (count in the low nibble) or one of the 16- and 32-bit forms.
    pub(super) fn header(
        self,
        fix: u8,
        wide: [u8; 2],
    ) -> Result<Option<(u32, &'a [u8])>, DecodeError> {
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
    pub(super) fn items(self) -> Parts<'a, Raw<'a>> {
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
    pub(super) fn entries(self) -> Parts<'a, (Raw<'a>, Raw<'a>)> {
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
    pub(super) fn is_nil(self) -> bool {
        self.0.first() == Some(&0xc0)
    }

    /// The string, if a string (keys and tags: read without a decoder).
    pub(super) fn str(self) -> Option<&'a str> {
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

pub(super) fn truncated() -> DecodeError {
    bad("truncated msgpack")
}

/// A big-endian unsigned integer of up to 8 bytes.
pub(super) fn big_endian(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0u64, |v, b| v << 8 | u64::from(*b))
}

/// Moves `rd` past one msgpack value (containers included, without recursion). Markers
/// are matched as bytes: this walks every token of a batch, so it is kept tight.
pub(super) fn skip(rd: &mut &[u8]) -> Result<(), DecodeError> {
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
pub(super) fn scalar(v: Option<Raw<'_>>) -> Result<Option<ValueRef<'_>>, DecodeError> {
    v.map(Raw::value).transpose()
}

pub(super) fn field<'a>(m: &[(Raw<'a>, Raw<'a>)], name: &str) -> Option<Raw<'a>> {
    m.iter()
        .find(|(k, _)| k.str() == Some(name))
        .map(|(_, v)| *v)
}

pub(super) fn as_str<'b>(v: &'b ValueRef<'_>) -> Option<&'b str> {
    match v {
        ValueRef::String(s) => s.as_str(),
        _ => None,
    }
}

pub(super) fn as_u64(v: &ValueRef<'_>) -> Option<u64> {
    match v {
        ValueRef::Integer(i) => i.as_u64(),
        _ => None,
    }
}

pub(super) fn as_f64(v: &ValueRef<'_>) -> Option<f64> {
    match v {
        ValueRef::F64(f) => Some(*f),
        ValueRef::F32(f) => Some(f64::from(*f)),
        ValueRef::Integer(i) => i.as_f64(),
        _ => None,
    }
}

pub(super) fn is_nil(v: Option<&ValueRef<'_>>) -> bool {
    matches!(v, None | Some(ValueRef::Nil))
}
