//! The vocabulary and merge ranks read from a `tokenizer.json`, and the merge: the
//! `tokenizers` crate's algorithm on these tables, without its per-word allocations.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::{HashMap, ModelShape, is_false};

/// The BPE model, by token ID.
pub(super) struct Merges {
    /// The token of each byte's character.
    pub(super) bytes: [u32; 256],
    /// Rank (place in the file's list) and product of each mergeable pair of tokens.
    pub(super) pairs: HashMap<(u32, u32), (u32, u32)>,
    /// With `ignore_merges`, the vocabulary: a piece that is a token is not merged.
    pub(super) whole: Option<HashMap<Box<str>, u32>>,
    /// The token of each two-byte piece (indexed by its bytes, big-endian) plus one, or 0
    /// where its bytes stay two tokens: [`Merges::tokenize`]'s own results, so that the
    /// most frequent short pieces cost one read of a 256 KiB table instead of a word cache
    /// probe and a merge. `None` if a token's ID is `u32::MAX` (not representable here).
    pub(super) two: Option<Box<[u32]>>,
}

/// One symbol of a word being merged: a token and its live neighbours.
#[derive(Clone, Copy)]
pub(super) struct Symbol {
    pub(super) id: u32,
    pub(super) prev: usize,
    pub(super) next: usize,
    pub(super) live: bool,
}

/// No neighbour.
pub(super) const NONE: usize = usize::MAX;

/// Buffers reused across the words of one call.
#[derive(Default)]
pub(super) struct Buffers {
    pub(super) symbols: Vec<Symbol>,
    /// Pending merges, lowest (rank, position) first, with the product they expect.
    pub(super) queue: BinaryHeap<Reverse<(u32, usize, u32)>>,
    pub(super) mapped: String,
}

impl Merges {
    pub(super) fn new(model: ModelShape, byte_chars: &[char; 256]) -> Result<Merges, String> {
        for (key, value) in [
            (
                "continuing_subword_prefix",
                &model.continuing_subword_prefix,
            ),
            ("end_of_word_suffix", &model.end_of_word_suffix),
        ] {
            if !value.as_str().is_none_or(str::is_empty) {
                return Err(format!("BPE with {key}"));
            }
        }
        if !is_false(&model.byte_fallback) {
            return Err("BPE with byte_fallback".into());
        }
        let vocab = model.vocab.ok_or("a BPE without a vocabulary")?;
        let id = |token: &str| {
            vocab
                .get(token)
                .copied()
                .ok_or_else(|| format!("{token:?} is not in the vocabulary"))
        };
        let mut bytes = [0; 256];
        for (b, c) in bytes.iter_mut().zip(byte_chars) {
            *b = id(c.encode_utf8(&mut [0; 4]))?;
        }
        // As `tokenizers` reads them: pairs, or "a b" lines after any "#version" line;
        // a pair listed twice keeps its last rank.
        let listed = model.merges.as_array().ok_or("a BPE without merges")?;
        let mut pairs = HashMap::default();
        let lines = listed
            .iter()
            .filter(|m| !m.as_str().is_some_and(|l| l.starts_with("#version")));
        for (rank, m) in lines.enumerate() {
            let (a, b) = match (m.as_str(), m.as_array().map(Vec::as_slice)) {
                (Some(line), _) => match line.split(' ').collect::<Vec<_>>()[..] {
                    [a, b] => (a, b),
                    _ => return Err(format!("merge {line:?}")),
                },
                (None, Some([a, b])) => (
                    a.as_str().ok_or("a merge of non-strings")?,
                    b.as_str().ok_or("a merge of non-strings")?,
                ),
                _ => return Err(format!("merge {m}")),
            };
            let rank = u32::try_from(rank).map_err(|_| "too many merges")?;
            pairs.insert((id(a)?, id(b)?), (rank, id(&format!("{a}{b}"))?));
        }
        let whole = (model.ignore_merges.as_bool() == Some(true)).then_some(vocab);
        let mut merges = Merges {
            bytes,
            pairs,
            whole,
            two: None,
        };
        merges.two = merges.two_byte_table(byte_chars);
        Ok(merges)
    }

    fn two_byte_table(&self, byte_chars: &[char; 256]) -> Option<Box<[u32]>> {
        let mut s = Buffers::default();
        let mut out = Vec::with_capacity(2);
        let mut table = vec![0; 1 << 16];
        for (i, slot) in table.iter_mut().enumerate() {
            out.clear();
            self.tokenize(&(i as u16).to_be_bytes(), byte_chars, &mut s, &mut out);
            if let [id] = out[..] {
                *slot = id.checked_add(1)?;
            }
        }
        Some(table.into_boxed_slice())
    }

    /// The tokens of a piece of one or two bytes into `out`; `false` for a longer piece
    /// (or without the table), which then needs [`Merges::tokenize`].
    pub(super) fn short(&self, piece: &[u8], out: &mut Vec<u32>) -> bool {
        match (piece, &self.two) {
            (&[b], _) => out.push(self.bytes[usize::from(b)]),
            (&[a, b], Some(two)) => match two[usize::from(u16::from_be_bytes([a, b]))] {
                0 => out.extend([self.bytes[usize::from(a)], self.bytes[usize::from(b)]]),
                id => out.push(id - 1),
            },
            _ => return false,
        }
        true
    }

    /// The tokens of `piece` into `out`: `tokenizers`' `Word::merge_all` on a queue of
    /// merges ordered by rank then position, an entry whose pair has since changed skipped.
    pub(super) fn tokenize(
        &self,
        piece: &[u8],
        byte_chars: &[char; 256],
        s: &mut Buffers,
        out: &mut Vec<u32>,
    ) {
        if let Some(vocab) = &self.whole {
            s.mapped.clear();
            s.mapped
                .extend(piece.iter().map(|&b| byte_chars[usize::from(b)]));
            if let Some(&id) = vocab.get(s.mapped.as_str()) {
                out.push(id);
                return;
            }
        }
        let n = piece.len();
        s.symbols.clear();
        s.symbols
            .extend(piece.iter().enumerate().map(|(i, &b)| Symbol {
                id: self.bytes[usize::from(b)],
                prev: i.checked_sub(1).unwrap_or(NONE),
                next: if i + 1 < n { i + 1 } else { NONE },
                live: true,
            }));
        s.queue.clear();
        for (i, w) in s.symbols.windows(2).enumerate() {
            if let Some(&(rank, id)) = self.pairs.get(&(w[0].id, w[1].id)) {
                s.queue.push(Reverse((rank, i, id)));
            }
        }
        let sym = &mut s.symbols;
        while let Some(Reverse((_, pos, product))) = s.queue.pop() {
            let cur = sym[pos];
            if !cur.live || cur.next == NONE {
                continue;
            }
            let right = sym[cur.next];
            if self
                .pairs
                .get(&(cur.id, right.id))
                .is_none_or(|&(_, id)| id != product)
            {
                continue;
            }
            sym[pos].id = product;
            sym[pos].next = right.next;
            sym[cur.next].live = false;
            if right.next != NONE {
                sym[right.next].prev = pos;
                if let Some(&(rank, id)) = self.pairs.get(&(product, sym[right.next].id)) {
                    s.queue.push(Reverse((rank, pos, id)));
                }
            }
            if cur.prev != NONE
                && let Some(&(rank, id)) = self.pairs.get(&(sym[cur.prev].id, product))
            {
                s.queue.push(Reverse((rank, cur.prev, id)));
            }
        }
        out.extend(sym.iter().filter(|s| s.live).map(|s| s.id));
    }
}
