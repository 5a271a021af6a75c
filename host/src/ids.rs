//! Identifier newtypes shared by every module, converted to and from their wire forms
//! here and nowhere else.

use std::fmt;
use std::str::FromStr;

/// A worker instance, unique within an endpoint. Shown in hex, as in etcd keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct InstanceId(pub u64);

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

impl FromStr for InstanceId {
    type Err = std::num::ParseIntError;

    /// Parses the hex form written by `Display`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        u64::from_str_radix(s, 16).map(InstanceId)
    }
}

/// The chained hash of one full KV block: equal hashes mean equal token prefixes up to
/// and including that block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct BlockHash(pub u64);

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// One routed request, for load accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct RequestId(pub u64);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn instance_id_round_trips(raw: u64) {
            let id = InstanceId(raw);
            prop_assert_eq!(id.to_string().parse::<InstanceId>().unwrap(), id);
        }
    }

    #[test]
    fn instance_id_rejects_garbage() {
        assert!("xyz".parse::<InstanceId>().is_err());
        assert!("".parse::<InstanceId>().is_err());
    }
}
