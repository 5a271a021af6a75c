//! Typed etcd keys: the one place they are built and parsed.
//!
//! An instance key is `{root}/instances/{namespace}/{component}/{endpoint}/{id:x}`; an
//! endpoint's prefix is the same without the ID (and with the trailing `/`).

use std::fmt;
use std::str::FromStr;

use switchyard_ids::InstanceId;
pub use switchyard_ids::{EndpointPath, KeyError};

/// The etcd key of one registered instance.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct InstanceKey {
    /// The key space's root (e.g. `switchyard`); may itself contain `/`.
    pub root: String,
    /// The endpoint the instance serves.
    pub endpoint: EndpointPath,
    /// The instance.
    pub id: InstanceId,
}

impl fmt::Display for InstanceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.endpoint.etcd_prefix(&self.root), self.id)
    }
}

impl FromStr for InstanceKey {
    type Err = KeyError;

    fn from_str(s: &str) -> Result<Self, KeyError> {
        let bad = || KeyError::BadKey(s.to_string());
        // Split from the right: the root may contain `/`, the rest may not.
        let mut parts = s.rsplitn(6, '/');
        let id = parts.next().ok_or_else(bad)?;
        let ep = parts.next().ok_or_else(bad)?;
        let comp = parts.next().ok_or_else(bad)?;
        let ns = parts.next().ok_or_else(bad)?;
        if parts.next() != Some("instances") {
            return Err(bad());
        }
        let root = parts.next().ok_or_else(bad)?;
        if root.is_empty() || id.is_empty() || id.len() > 16 {
            return Err(bad());
        }
        let id: InstanceId = id.parse().map_err(|_| bad())?;
        let endpoint = EndpointPath::new(ns, comp, ep).map_err(|_| bad())?;
        Ok(InstanceKey {
            root: root.to_string(),
            endpoint,
            id,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn seg() -> impl Strategy<Value = String> {
        "[A-Za-z0-9_.-]{1,12}"
    }

    proptest! {
        #[test]
        fn instance_keys_round_trip(
            root in "[a-z]{1,6}(/[a-z]{1,6}){0,2}",
            ns in seg(), comp in seg(), ep in seg(), id: u64,
        ) {
            let key = InstanceKey {
                root,
                endpoint: EndpointPath::new(&ns, &comp, &ep).unwrap(),
                id: InstanceId(id),
            };
            let text = key.to_string();
            prop_assert!(text.starts_with(&key.endpoint.etcd_prefix(&key.root)));
            prop_assert_eq!(text.parse::<InstanceKey>().unwrap(), key);
        }


        #[test]
        fn parsing_arbitrary_text_never_panics(s in ".{0,80}") {
            let _ = s.parse::<InstanceKey>();
            let _ = s.parse::<EndpointPath>();
        }
    }

    #[test]
    fn malformed_keys_are_rejected() {
        for bad in [
            "",
            "switchyard/instances/a/b/c",
            "switchyard/instances/a/b/c/",
            "switchyard/instances/a/b/c/zz",
            "switchyard/instances/a/b/c/12345678901234567",
            "switchyard/other/a/b/c/1f",
            "/instances/a/b/c/1f",
            "switchyard/instances/a b/b/c/1f",
        ] {
            assert!(bad.parse::<InstanceKey>().is_err(), "{bad:?} parsed");
        }
        assert_eq!(
            "sy/instances/default/llama/generate/1f"
                .parse::<InstanceKey>()
                .unwrap()
                .id,
            InstanceId(0x1f)
        );
    }
}
