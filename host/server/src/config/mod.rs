//! `switchyard serve` configuration: command-line flags, environment variables
//! (`SWITCHYARD_*`, named beside each flag) and an optional TOML file (`--config`),
//! resolved once into a typed [`ServeConfig`]. A flag or variable beats the file, the
//! file beats the default. Unknown keys in the file are errors.
//!
//! - `flags`: the flags and their variables ([`ServeArgs`]);
//! - `file`: the TOML file ([`FileConfig`]) and static workers;
//! - `secrets`: the admin token and etcd's credentials, read from files or variables;
//! - `kube`: Kubernetes discovery's flags and how the API server is reached;
//! - `resolve`: the merge into [`ServeConfig`].

mod file;
mod flags;
mod kube;
mod lora;
mod overload;
mod resolve;
mod secrets;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::GatewayConfig;
use switchyard_discovery::EndpointPath;
use switchyard_discovery::etcd::EtcdConfig;
use switchyard_policy::RuntimeConfig;
use switchyard_router::client::ClientConfig;

pub use file::{EndpointFile, FileConfig, PolicySpec, StaticWorker};
pub use flags::ServeArgs;
pub use kube::KubeArgs;
pub use secrets::{EtcdAccessArgs, MIN_ADMIN_TOKEN_BYTES};

/// Where workers come from.
#[derive(Debug, Clone)]
pub enum DiscoveryConfig {
    /// etcd.
    Etcd(EtcdConfig),
    /// A Kubernetes API server: a GIE InferencePool or a pod selector.
    Kube(Box<switchyard_discovery::kube::KubeConfig>),
    /// A fixed list.
    Static {
        /// The workers.
        workers: Vec<StaticWorker>,
        /// Their model.
        model: String,
        /// Their block size.
        block_size: u32,
        /// Whether they serve `/v1/kv_events`.
        kv_events: bool,
        /// Their health endpoint's path.
        health_path: String,
    },
}

/// Everything `serve` needs, validated.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Listen address.
    pub listen: SocketAddr,
    /// Discovery.
    pub discovery: DiscoveryConfig,
    /// The policy of endpoints without their own.
    pub default_policy: PolicySpec,
    /// Per-endpoint policies.
    pub endpoint_policies: BTreeMap<EndpointPath, PolicySpec>,
    /// Reload file policies on change.
    pub watch: bool,
    /// Tokenizer file, if not built-in.
    pub tokenizer: Option<PathBuf>,
    /// Chat template file, if not the one beside the tokenizer (or ChatML).
    pub chat_template: Option<PathBuf>,
    /// Budget of the tokenizer's prefix cache, tokens (0: off).
    pub tokenizer_cache_tokens: usize,
    /// The front door.
    pub gateway: GatewayConfig,
    /// The policy runtime.
    pub runtime: RuntimeConfig,
    /// Re-admission probing.
    pub client: ClientConfig,
    /// Shutdown grace period.
    pub shutdown_grace: Duration,
    /// Predicted caches of workers without an event stream.
    pub approximate: switchyard_router::Approximate,
    /// How often workers' engine metrics are read (`None`: never).
    pub engine_metrics: Option<Duration>,
    /// Addresses of the SUB sockets engines connect to (central mode), rank by rank.
    pub kv_events_bind: Vec<String>,
    /// The budget for engines' KV event input, bytes.
    pub kv_events_memory: u64,
    /// The key of the router's block-hash chain (see `--kv-hash-key`).
    pub kv_hash_key: u64,
    /// Whether clients' `Authorization` header goes on to workers, by default.
    pub forward_authorization: bool,
    /// Per-endpoint exceptions to `forward_authorization`.
    pub endpoint_forward_authorization: BTreeMap<EndpointPath, bool>,
    /// How long a model with no instances is answered 503 and its endpoint kept.
    pub endpoint_grace: Duration,
    /// Where the admin API is served, if not on `listen`.
    pub admin_listen: Option<SocketAddr>,
    /// Where the endpoint picker is served, if anywhere.
    pub epp_listen: Option<SocketAddr>,
    /// Other workers named after each pick, for the gateway's retries.
    pub epp_fallbacks: usize,
    /// Name the endpoint that served in each answer's headers.
    pub epp_report_served: bool,
    /// The picker's TLS certificate and key, if it serves TLS.
    pub epp_tls: Option<crate::epp::EppTls>,
    /// Keys whose signed etcd pushes are applied (none: every push is).
    pub policy_trusted_keys: Vec<switchyard_discovery::signing::PublicKey>,
    /// When a worker is saturated.
    pub saturation: switchyard_router::Saturation,
}

pub(super) fn flag_or_file<T>(flag: Vec<T>, file: Vec<T>) -> Vec<T> {
    if flag.is_empty() { file } else { flag }
}

/// The longest time any setting may name: a year. Past it, `Instant::now() + d` can
/// overflow (a panic on every decision that uses it), and no operator means it.
pub const MAX_SETTING_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// A duration setting given in `unit`s (`from` builds it), checked against
/// [`MAX_SETTING_DURATION`]; `default` when unset.
pub(super) fn bounded(
    name: &str,
    value: Option<u64>,
    from: fn(u64) -> Duration,
    default: Duration,
) -> Result<Duration, ConfigError> {
    let Some(v) = value else { return Ok(default) };
    let d = from(v);
    if d > MAX_SETTING_DURATION {
        return Err(ConfigError(format!(
            "{name} = {v} is longer than a year ({} s), the most any duration may be",
            MAX_SETTING_DURATION.as_secs()
        )));
    }
    Ok(d)
}

/// A configuration problem, said plainly.
#[derive(Debug, thiserror::Error)]
#[error("configuration: {0}")]
pub struct ConfigError(pub String);
