//! Typed etcd keys: the one place they are built and parsed.
//!
//! An instance key is `{root}/instances/{namespace}/{component}/{endpoint}/{id:x}`; an
//! endpoint's prefix is the same without the ID (and with the trailing `/`).

use std::fmt;
use std::str::FromStr;

use crate::ids::InstanceId;

/// `namespace/component/endpoint`: one routable group of identical workers.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EndpointPath {
    namespace: String,
    component: String,
    endpoint: String,
}

/// Why a key or path could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// Not `namespace/component/endpoint`.
    #[error("`{0}` is not an endpoint path (expected namespace/component/endpoint)")]
    BadPath(String),
    /// A segment is empty or has characters other than `[A-Za-z0-9_.-]`.
    #[error("`{0}` is not a valid path segment (use letters, digits, `_`, `.`, `-`)")]
    BadSegment(String),
    /// Not `{root}/instances/{ns}/{comp}/{ep}/{id:x}`.
    #[error("`{0}` is not an instance key")]
    BadKey(String),
}

fn segment(s: &str) -> Result<String, KeyError> {
    let ok = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if ok {
        Ok(s.to_string())
    } else {
        Err(KeyError::BadSegment(s.to_string()))
    }
}

impl EndpointPath {
    /// Builds a path from its three segments.
    pub fn new(namespace: &str, component: &str, endpoint: &str) -> Result<Self, KeyError> {
        Ok(EndpointPath {
            namespace: segment(namespace)?,
            component: segment(component)?,
            endpoint: segment(endpoint)?,
        })
    }

    /// The default endpoint for a model: `default/{model}/generate`, with characters a
    /// segment cannot hold replaced by `-`.
    pub fn for_model(model: &str) -> EndpointPath {
        let slug: String = model
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        let slug = if slug.is_empty() {
            "model".to_string()
        } else {
            slug
        };
        EndpointPath {
            namespace: "default".into(),
            component: slug,
            endpoint: "generate".into(),
        }
    }

    /// The etcd prefix holding this endpoint's instances, ending in `/`.
    pub fn etcd_prefix(&self, root: &str) -> String {
        format!("{}/instances/{self}/", root.trim_end_matches('/'))
    }
}

impl fmt::Display for EndpointPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.namespace, self.component, self.endpoint)
    }
}

impl FromStr for EndpointPath {
    type Err = KeyError;

    fn from_str(s: &str) -> Result<Self, KeyError> {
        let parts: Vec<&str> = s.split('/').collect();
        match parts[..] {
            [ns, comp, ep] => EndpointPath::new(ns, comp, ep),
            _ => Err(KeyError::BadPath(s.to_string())),
        }
    }
}

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
        fn endpoint_paths_round_trip(ns in seg(), comp in seg(), ep in seg()) {
            let path = EndpointPath::new(&ns, &comp, &ep).unwrap();
            prop_assert_eq!(path.to_string().parse::<EndpointPath>().unwrap(), path);
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

    #[test]
    fn model_names_become_valid_endpoints() {
        let p = EndpointPath::for_model("meta-llama/Llama-3.1-8B Instruct");
        assert_eq!(
            p.to_string(),
            "default/meta-llama-Llama-3.1-8B-Instruct/generate"
        );
        assert_eq!(p.to_string().parse::<EndpointPath>().unwrap(), p);
    }
}
