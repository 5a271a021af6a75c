//! The KV event stream a worker serves (documented in `docs/kv-events.md`).
//!
//! Newline-delimited JSON over one long HTTP response. The first line after connecting is
//! a `snapshot` of every block the worker caches; then `stored`, `removed` and `cleared`
//! events, each with the next sequence number; and `load` reports (no sequence number)
//! every second or so, which also keep the connection alive.

use serde::{Deserialize, Serialize};

use super::latency::EngineLatency;
use super::load::ReportedLoad;

/// One line of the stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum KvEvent {
    /// The worker's whole cache as of `seq`; the next event has `seq + 1`.
    Snapshot {
        /// Sequence number of the state this snapshot shows.
        seq: u64,
        /// Tokens per block.
        block_size: u32,
        /// Every cached block hash.
        blocks: Vec<u64>,
    },
    /// Blocks became cached. `blocks` are consecutive; the first one's parent is
    /// `parent` (absent for a prompt's first block).
    Stored {
        /// Sequence number.
        seq: u64,
        /// Hash of the block before `blocks[0]`, if any.
        #[serde(default)]
        parent: Option<u64>,
        /// Hashes, in prompt order.
        blocks: Vec<u64>,
    },
    /// Blocks were evicted.
    Removed {
        /// Sequence number.
        seq: u64,
        /// Hashes.
        blocks: Vec<u64>,
    },
    /// The whole cache was dropped.
    Cleared {
        /// Sequence number.
        seq: u64,
    },
    /// A load report.
    Load {
        /// KV blocks in use.
        kv_used_blocks: u64,
        /// KV blocks in total.
        kv_total_blocks: u64,
        /// Requests running.
        running: u32,
        /// Requests waiting.
        waiting: u32,
        /// Sum of the engine's inter-token latencies so far, microseconds (cumulative;
        /// absent from engines that do not measure it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        itl_sum_us: Option<u64>,
        /// How many inter-token latencies that sum holds (cumulative).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        itl_count: Option<u64>,
    },
}

impl KvEvent {
    /// The sequence number, for the events that carry one.
    pub fn seq(&self) -> Option<u64> {
        match self {
            KvEvent::Snapshot { seq, .. }
            | KvEvent::Stored { seq, .. }
            | KvEvent::Removed { seq, .. }
            | KvEvent::Cleared { seq } => Some(*seq),
            KvEvent::Load { .. } => None,
        }
    }

    /// The report in a `load` event.
    pub fn load(&self) -> Option<ReportedLoad> {
        match *self {
            KvEvent::Load {
                kv_used_blocks,
                kv_total_blocks,
                running,
                waiting,
                itl_sum_us,
                itl_count,
            } => Some(ReportedLoad {
                kv_used_blocks,
                kv_total_blocks,
                running,
                waiting,
                latency: itl_sum_us.zip(itl_count).map(|(sum, n)| EngineLatency {
                    itl_sum: sum as f64 / 1e6,
                    itl_count: n as f64,
                }),
            }),
            _ => None,
        }
    }

    /// One NDJSON line (with the trailing newline).
    pub fn to_line(&self) -> String {
        let mut s = serde_json::to_string(self).expect("events serialise");
        s.push('\n');
        s
    }
}

/// What a subscriber must do with the next event, given the last sequence number seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqCheck {
    /// Apply it.
    Apply,
    /// A snapshot: reset the worker's blocks, then apply.
    Reset,
    /// Events were missed: resubscribe for a fresh snapshot.
    Gap {
        /// The sequence number expected.
        expected: u64,
        /// The one received.
        got: u64,
    },
    /// Not a cache event (a load report).
    NotSequenced,
}

/// Checks `event` against `last` (the last applied sequence number; `None` before the
/// first snapshot, when only a snapshot is acceptable).
pub fn check_seq(last: Option<u64>, event: &KvEvent) -> SeqCheck {
    match (event, last, event.seq()) {
        (KvEvent::Snapshot { .. }, _, _) => SeqCheck::Reset,
        (_, _, None) => SeqCheck::NotSequenced,
        (_, None, Some(got)) => SeqCheck::Gap { expected: 0, got },
        // A stream at u64::MAX has nowhere to go: whatever follows is a gap (a resync).
        (_, Some(last), Some(got)) if last.checked_add(1) == Some(got) => SeqCheck::Apply,
        (_, Some(last), Some(got)) => SeqCheck::Gap {
            expected: last.saturating_add(1),
            got,
        },
    }
}

/// One event of every type: seeds for tests and fuzzers.
pub fn samples() -> [KvEvent; 6] {
    [
        KvEvent::Snapshot {
            seq: 4,
            block_size: 16,
            blocks: vec![1, u64::MAX],
        },
        KvEvent::Stored {
            seq: 5,
            parent: Some(1),
            blocks: vec![2, 3],
        },
        KvEvent::Removed {
            seq: 6,
            blocks: vec![3],
        },
        KvEvent::Cleared { seq: 7 },
        KvEvent::Load {
            kv_used_blocks: 3,
            kv_total_blocks: 10,
            running: 1,
            waiting: 0,
            itl_sum_us: None,
            itl_count: None,
        },
        KvEvent::Load {
            kv_used_blocks: 3,
            kv_total_blocks: 10,
            running: 1,
            waiting: 0,
            itl_sum_us: Some(120_000),
            itl_count: Some(10),
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip_and_unknown_fields_are_refused() {
        for e in samples() {
            let line = e.to_line();
            assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'));
            assert_eq!(serde_json::from_str::<KvEvent>(&line).unwrap(), e);
        }
        assert!(
            serde_json::from_str::<KvEvent>(r#"{"type":"stored","seq":1,"blocks":[],"extra":1}"#)
                .is_err()
        );
        assert!(serde_json::from_str::<KvEvent>(r#"{"type":"bogus","seq":1}"#).is_err());
    }

    #[test]
    fn sequence_gaps_are_detected() {
        let stored = |seq| KvEvent::Stored {
            seq,
            parent: None,
            blocks: vec![],
        };
        assert_eq!(
            check_seq(None, &stored(1)),
            SeqCheck::Gap {
                expected: 0,
                got: 1
            }
        );
        assert_eq!(
            check_seq(
                Some(4),
                &KvEvent::Snapshot {
                    seq: 9,
                    block_size: 16,
                    blocks: vec![]
                }
            ),
            SeqCheck::Reset
        );
        assert_eq!(check_seq(Some(4), &stored(5)), SeqCheck::Apply);
        assert_eq!(
            check_seq(Some(4), &stored(7)),
            SeqCheck::Gap {
                expected: 5,
                got: 7
            }
        );
        assert_eq!(
            check_seq(Some(4), &stored(4)),
            SeqCheck::Gap {
                expected: 5,
                got: 4
            }
        );
        assert_eq!(
            check_seq(
                Some(4),
                &KvEvent::Load {
                    kv_used_blocks: 0,
                    kv_total_blocks: 0,
                    running: 0,
                    waiting: 0,
                    itl_sum_us: None,
                    itl_count: None,
                }
            ),
            SeqCheck::NotSequenced
        );
    }
}
