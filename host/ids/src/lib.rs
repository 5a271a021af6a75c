//! The identifiers every Switchyard crate speaks in — instances, blocks, requests and
//! endpoints — converted to and from their wire forms here and nowhere else. The bottom
//! floor: it depends on nothing of Switchyard's.

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

/// What a worker does in a fleet that splits prefill from decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Role {
    /// Prefill and decode, the whole request (an aggregated worker; the default).
    #[default]
    Both,
    /// Computes prompts' KV and hands it to a decode worker.
    Prefill,
    /// Decodes from KV a prefill worker computed.
    Decode,
}

impl Role {
    /// Every role, in order.
    pub const ALL: [Role; 3] = [Role::Both, Role::Prefill, Role::Decode];

    /// The role's name: `both`, `prefill` or `decode`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| format!("role `{s}` is not one of both, prefill, decode"))
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn seg() -> impl Strategy<Value = String> {
        "[A-Za-z0-9_.-]{1,12}"
    }

    proptest! {
        #[test]
        fn endpoint_paths_round_trip(ns in seg(), comp in seg(), ep in seg()) {
            let path = EndpointPath::new(&ns, &comp, &ep).unwrap();
            prop_assert_eq!(path.to_string().parse::<EndpointPath>().unwrap(), path);
        }

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
