//! Service discovery: which worker instances serve an endpoint.
//!
//! A [`Discovery`] source streams [`DiscoveryUpdate`]s for one endpoint: a `Reset` with
//! the full set on every (re-)list, then `Insert` / `Remove` as instances come and go.
//! Three sources exist: [`etcd`] (the distributed default: instances register
//! themselves under a lease), [`kube`] (a GIE `InferencePool` or a pod selector, read
//! from a Kubernetes API server) and [`fixed`] (instances given on the command line; no
//! service needed). Workers register with [`etcd_register`]; routing policies are distributed to
//! every router replica with [`etcd_policy`].
//!
//! Only this crate knows etcd and Kubernetes. Must not know: routing, policies, HTTP
//! serving.

pub mod etcd;
pub mod etcd_api;
pub mod etcd_policy;
pub mod etcd_register;
pub mod fixed;
pub mod key;
pub mod kube;
pub mod kube_api;
pub mod kubeconfig;
pub mod signing;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

pub use key::{EndpointPath, InstanceKey, KeyError};
use switchyard_ids::InstanceId;
pub use switchyard_ids::Role;

/// What discovery knows about one worker instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceInfo {
    /// The instance.
    pub id: InstanceId,
    /// The endpoint it serves.
    pub endpoint: EndpointPath,
    /// Its HTTP base URL, e.g. `http://10.0.0.7:8000`.
    pub url: String,
    /// The model it serves.
    pub model: String,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Where its KV event stream is, if it publishes one (Switchyard's NDJSON).
    pub events_url: Option<String>,
    /// Where its engine publishes KV events over ZMQ (vLLM, SGLang), if it does.
    pub engine_events: Option<std::sync::Arc<EngineEventSource>>,
    /// Path of its health endpoint (probed to re-admit it after a failure).
    pub health_path: String,
    /// Identifies one registration (etcd: the lease); a different value for the same ID
    /// means the instance registered again.
    pub registration: u64,
    /// What it does in a fleet that splits prefill from decode.
    pub role: Role,
    /// A prefill worker's bootstrap port (SGLang's disaggregation rendezvous); set, it
    /// makes the handoff SGLang's, unset vLLM's.
    pub bootstrap_port: Option<u16>,
}

impl InstanceInfo {
    /// A worker at `url` serving `model` for `endpoint`, with no event source (the router
    /// predicts its cache), its health at `/health`, in its first registration. For
    /// fixed fleets and embedders that know their workers without discovery.
    pub fn new(
        id: InstanceId,
        endpoint: EndpointPath,
        url: impl Into<String>,
        model: impl Into<String>,
        block_size: u32,
    ) -> InstanceInfo {
        InstanceInfo {
            id,
            endpoint,
            url: url.into(),
            model: model.into(),
            block_size,
            events_url: None,
            engine_events: None,
            health_path: "/health".into(),
            registration: 1,
            role: Role::Both,
            bootstrap_port: None,
        }
    }
}

/// Where a worker's engine publishes its KV events (vLLM's and SGLang's ZMQ publisher).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EngineEventSource {
    /// The PUB socket, e.g. `tcp://10.0.0.7:5557` (the router connects to it).
    pub endpoint: String,
    /// The replay (ROUTER) socket, e.g. `tcp://10.0.0.7:5558`, if the engine has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<String>,
    /// The topic the engine publishes under (`""`: every topic).
    #[serde(default)]
    pub topic: String,
    /// Data-parallel ranks: rank `r` publishes on the port of `endpoint` (and `replay`)
    /// plus `r`.
    #[serde(default = "one")]
    pub data_parallel_size: u32,
}

fn one() -> u32 {
    1
}

impl EngineEventSource {
    /// The `endpoint` of a worker whose engine connects to the router's bound sockets
    /// (central mode) instead of being connected to.
    pub const BOUND: &'static str = "bound";

    /// A source at `endpoint`, no replay, every topic, one rank.
    pub fn new(endpoint: impl Into<String>) -> EngineEventSource {
        EngineEventSource {
            endpoint: endpoint.into(),
            replay: None,
            topic: String::new(),
            data_parallel_size: 1,
        }
    }

    /// Checks the endpoints (`tcp://HOST:PORT`, or `bound` with a topic) and the rank
    /// count.
    pub fn validate(&self) -> Result<(), String> {
        let bound = self.endpoint == Self::BOUND;
        if bound && self.topic.is_empty() {
            return Err(
                "kv_events = \"bound\" needs the topic the engine publishes under, which names the worker"
                    .into(),
            );
        }
        let connected = (!bound).then_some(&self.endpoint);
        for e in connected.into_iter().chain(self.replay.as_ref()) {
            let Some(rest) = e.strip_prefix("tcp://") else {
                return Err(format!("KV event endpoint `{e}` is not tcp://HOST:PORT"));
            };
            let port_ok = rest
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if !port_ok || rest.contains('*') {
                return Err(format!(
                    "KV event endpoint `{e}` must be tcp://HOST:PORT with a host the router can reach"
                ));
            }
        }
        if !(1..=256).contains(&self.data_parallel_size) {
            return Err(format!(
                "data_parallel_size {} is not in 1..=256",
                self.data_parallel_size
            ));
        }
        Ok(())
    }

    /// `endpoint` with its port moved up by `rank` (as the engines do for their
    /// data-parallel ranks).
    pub fn for_rank(endpoint: &str, rank: u32) -> String {
        match endpoint.rsplit_once(':') {
            // A port past 65535 is left for the connection to refuse with its own error.
            Some((base, port)) => match port
                .parse::<u16>()
                .ok()
                .and_then(|p| u16::try_from(rank).ok().and_then(|r| p.checked_add(r)))
            {
                Some(p) => format!("{base}:{p}"),
                None => endpoint.to_string(),
            },
            None => endpoint.to_string(),
        }
    }
}

/// The JSON value stored under an instance's key. Unknown fields are ignored so that
/// newer workers can add some.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceRecord {
    /// The instance ID, hex (as in the key).
    pub instance_id: String,
    /// HTTP base URL.
    pub url: String,
    /// Model name.
    pub model: String,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV event stream URL, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events_url: Option<String>,
    /// The engine's ZMQ KV event publisher, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<EngineEventSource>,
    /// Health endpoint path.
    #[serde(default = "default_health_path")]
    pub health_path: String,
    /// The worker is stopping: written just before a graceful deregistration, so that
    /// routers tell it from a lease that expired.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub draining: bool,
    /// `prefill`, `decode` or `both` (absent: `both`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// A prefill worker's bootstrap port (SGLang's disaggregation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
}

fn default_health_path() -> String {
    "/health".to_string()
}

impl InstanceRecord {
    /// The record for `info`.
    pub fn from_info(info: &InstanceInfo) -> InstanceRecord {
        InstanceRecord {
            instance_id: info.id.to_string(),
            url: info.url.clone(),
            model: info.model.clone(),
            block_size: info.block_size,
            events_url: info.events_url.clone(),
            kv_events: info.engine_events.as_deref().cloned(),
            health_path: info.health_path.clone(),
            draining: false,
            role: (info.role != Role::Both).then(|| info.role.to_string()),
            bootstrap_port: info.bootstrap_port,
        }
    }

    /// Validates the record found under `key` and turns it into an [`InstanceInfo`].
    pub fn into_info(
        self,
        key: &InstanceKey,
        registration: u64,
    ) -> Result<InstanceInfo, DiscoveryError> {
        let bad = |why: String| DiscoveryError::BadValue {
            key: key.to_string(),
            why,
        };
        let id: InstanceId = self
            .instance_id
            .parse()
            .map_err(|_| bad(format!("instance_id `{}` is not hex", self.instance_id)))?;
        if id != key.id {
            return Err(bad(format!("instance_id {id} does not match the key")));
        }
        if !(self.url.starts_with("http://") || self.url.starts_with("https://")) {
            return Err(bad(format!("url `{}` is not an http(s) URL", self.url)));
        }
        if self.block_size == 0 {
            return Err(bad("block_size is 0".into()));
        }
        if let Some(src) = &self.kv_events {
            src.validate().map_err(bad)?;
        }
        let role = match &self.role {
            None => Role::Both,
            Some(r) => r.parse().map_err(bad)?,
        };
        if self.bootstrap_port == Some(0) {
            return Err(bad("bootstrap_port is 0".into()));
        }
        Ok(InstanceInfo {
            id,
            endpoint: key.endpoint.clone(),
            url: self.url.trim_end_matches('/').to_string(),
            model: self.model,
            block_size: self.block_size,
            events_url: self.events_url,
            engine_events: self.kv_events.map(std::sync::Arc::new),
            health_path: self.health_path,
            registration,
            role,
            bootstrap_port: self.bootstrap_port,
        })
    }
}

/// One change to an endpoint's set of instances.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoveryUpdate {
    /// The complete set (sent on every list and re-list).
    Reset(Vec<InstanceInfo>),
    /// An instance appeared or its record changed.
    Insert(InstanceInfo),
    /// Discovery no longer lists an instance (e.g. its lease expired): it may still be
    /// serving.
    Remove(InstanceId),
    /// An instance deregistered gracefully: it is gone.
    Leave(InstanceId),
}

/// Discovery failures. None of them is fatal: sources retry and keep the last set.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DiscoveryError {
    /// etcd could not be reached or answered with an error.
    #[error("etcd at {endpoints}: {why}")]
    Etcd {
        /// The etcd endpoints tried.
        endpoints: String,
        /// What went wrong.
        why: String,
    },
    /// A key under the prefix is not an instance key.
    #[error(transparent)]
    BadKey(#[from] KeyError),
    /// An instance's value is not a valid record.
    #[error("bad instance record at {key}: {why}")]
    BadValue {
        /// The key.
        key: String,
        /// What is wrong with it.
        why: String,
    },
}

/// A source of instances for endpoints.
pub trait Discovery: Send + Sync + 'static {
    /// Starts streaming updates for `endpoint` into `tx`; the task ends when `tx`'s
    /// receiver is dropped.
    fn watch(
        &self,
        endpoint: EndpointPath,
        tx: mpsc::UnboundedSender<DiscoveryUpdate>,
    ) -> tokio::task::JoinHandle<()>;
}
