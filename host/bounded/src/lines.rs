//! Newline-delimited records arriving in pieces (a worker's NDJSON event stream, etcd's
//! watch stream): each byte is searched for a newline once, and the lines handed out are
//! dropped from the buffer once per piece received, not once per line — so a piece
//! holding many lines, or a line arriving in many pieces, costs time linear in its bytes.
//!
//! Pure: the caller reads the stream and bounds what it may hold ([`Lines::pending`]).

/// The buffer of a newline-delimited stream.
#[derive(Debug, Default)]
pub struct Lines {
    buf: Vec<u8>,
    /// Bytes of `buf` already searched for a newline.
    scanned: usize,
    /// Bytes of `buf` already handed out as lines.
    consumed: usize,
}

impl Lines {
    /// Appends a piece of the stream (first dropping the lines already handed out).
    pub fn push(&mut self, data: &[u8]) {
        if self.consumed > 0 {
            self.buf.drain(..self.consumed);
            self.scanned -= self.consumed;
            self.consumed = 0;
        }
        self.buf.extend_from_slice(data);
    }

    /// The next whole line, without its newline; `None` until more of the stream arrives.
    pub fn next_line(&mut self) -> Option<&[u8]> {
        let Some(i) = self.buf[self.scanned..].iter().position(|&b| b == b'\n') else {
            self.scanned = self.buf.len();
            return None;
        };
        let (start, end) = (self.consumed, self.scanned + i);
        (self.scanned, self.consumed) = (end + 1, end + 1);
        Some(&self.buf[start..end])
    }

    /// Bytes received and not yet handed out: the line still arriving. What a caller
    /// bounds.
    pub fn pending(&self) -> usize {
        self.buf.len() - self.consumed
    }

    /// What is left once the stream has ended: a last line without a newline.
    pub fn rest(&self) -> &[u8] {
        &self.buf[self.consumed..]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_split_across_pieces_come_out_whole_and_in_order() {
        let mut l = Lines::default();
        l.push(b"one\ntw");
        assert_eq!(l.next_line(), Some(&b"one"[..]));
        assert_eq!(l.next_line(), None);
        assert_eq!(l.pending(), 2);
        l.push(b"o\n\nthree");
        assert_eq!(l.next_line(), Some(&b"two"[..]));
        assert_eq!(l.next_line(), Some(&b""[..]));
        assert_eq!(l.next_line(), None);
        assert_eq!(l.pending(), 5);
        assert_eq!(l.rest(), b"three");
        l.push(b"\n");
        assert_eq!(l.next_line(), Some(&b"three"[..]));
        assert_eq!(l.pending(), 0);
    }
}
