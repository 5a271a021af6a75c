//! The TOML file (`--config`) and the static worker syntax it shares with `--worker`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

use super::ConfigError;
use switchyard_discovery::{EngineEventSource, Role};

/// The TOML file. Same keys as the flags (snake_case), plus per-endpoint policies.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub(crate) listen: Option<SocketAddr>,
    #[serde(default)]
    pub(crate) etcd: Vec<String>,
    pub(crate) etcd_root: Option<String>,
    pub(crate) etcd_user: Option<String>,
    pub(crate) etcd_password_file: Option<PathBuf>,
    #[serde(default)]
    pub(crate) etcd_ca_files: Vec<PathBuf>,
    #[serde(default)]
    pub(crate) workers: Vec<WorkerEntry>,
    /// `[kube]`: Kubernetes discovery.
    pub(crate) kube: Option<super::kube::KubeFile>,
    pub(crate) model: Option<String>,
    pub(crate) kv_events: Option<bool>,
    pub(crate) kv_hash_key: Option<u64>,
    pub(crate) block_size: Option<u32>,
    pub(crate) policy: Option<String>,
    pub(crate) policy_config: Option<String>,
    pub(crate) watch: Option<bool>,
    pub(crate) admin_token: Option<String>,
    pub(crate) admin_token_file: Option<PathBuf>,
    pub(crate) admin_listen: Option<SocketAddr>,
    pub(crate) epp_listen: Option<SocketAddr>,
    pub(crate) epp_fallbacks: Option<usize>,
    pub(crate) epp_report_served: Option<bool>,
    pub(crate) epp_tls_cert: Option<PathBuf>,
    pub(crate) epp_tls_key: Option<PathBuf>,
    pub(crate) endpoint_grace_secs: Option<u64>,
    pub(crate) tokenizer: Option<PathBuf>,
    pub(crate) chat_template: Option<PathBuf>,
    pub(crate) tokenizer_cache_tokens: Option<usize>,
    pub(crate) max_body_bytes: Option<usize>,
    pub(crate) max_body_bytes_total: Option<usize>,
    pub(crate) max_prompt_tokens: Option<usize>,
    pub(crate) max_attempts: Option<usize>,
    pub(crate) migration_limit: Option<u32>,
    pub(crate) migration_token_ids: Option<bool>,
    pub(crate) drain_grace_secs: Option<u64>,
    pub(crate) connect_timeout_ms: Option<u64>,
    pub(crate) first_byte_timeout_secs: Option<u64>,
    pub(crate) shutdown_grace_secs: Option<u64>,
    pub(crate) policy_budget_ms: Option<u64>,
    pub(crate) policy_memory_mb: Option<usize>,
    pub(crate) policy_memory_total_mb: Option<usize>,
    pub(crate) policy_warm_instances: Option<usize>,
    #[serde(default)]
    pub(crate) policy_trusted_keys: Vec<PathBuf>,
    pub(crate) policy_cache: Option<PathBuf>,
    pub(crate) policy_may_reject_all: Option<bool>,
    pub(crate) availability: Option<bool>,
    pub(crate) request_timeout_secs: Option<u64>,
    pub(crate) stream_idle_timeout_secs: Option<u64>,
    pub(crate) client_idle_timeout_secs: Option<u64>,
    pub(crate) max_connections: Option<usize>,
    pub(crate) max_in_flight: Option<usize>,
    pub(crate) consecutive_failures: Option<u32>,
    pub(crate) max_ejection_percent: Option<u32>,
    pub(crate) panic_threshold_percent: Option<u32>,
    pub(crate) base_ejection_ms: Option<u64>,
    pub(crate) max_ejection_secs: Option<u64>,
    pub(crate) health_check_interval_ms: Option<u64>,
    pub(crate) prediction_ttl_secs: Option<f64>,
    pub(crate) prediction_max_blocks: Option<usize>,
    pub(crate) engine_metrics_ms: Option<u64>,
    pub(crate) discovery_grace_secs: Option<u64>,
    pub(crate) max_retry_after_secs: Option<u64>,
    pub(crate) outlier_detection: Option<bool>,
    pub(crate) health_path: Option<String>,
    pub(crate) forward_authorization: Option<bool>,
    #[serde(default)]
    pub(crate) ca_files: Vec<PathBuf>,
    #[serde(default)]
    pub(crate) kv_events_bind: Vec<String>,
    #[serde(default)]
    pub(crate) lora_adapters: Vec<String>,
    pub(crate) kv_events_memory_mib: Option<u64>,
    pub(crate) queue_max: Option<usize>,
    pub(crate) queue_max_bytes: Option<usize>,
    pub(crate) saturation_queued: Option<u32>,
    pub(crate) saturation_kv_usage: Option<f32>,
    pub(crate) saturation_max_in_flight: Option<u32>,
    pub(crate) saturation_prefill_tokens: Option<u64>,
    pub(crate) saturation_wait_ms: Option<u64>,
    pub(crate) saturation_batch_full: Option<bool>,
    pub(crate) tenant_header: Option<String>,
    /// `[[classes]]` tables: priority classes besides (or replacing) the built-ins.
    #[serde(default)]
    pub(crate) classes: Vec<super::overload::ClassTable>,
    /// `[[tenants]]` tables: tenants' weights, API keys and classes.
    #[serde(default)]
    pub(crate) tenants: Vec<super::overload::TenantTable>,
    /// `[endpoints."namespace/component/endpoint"]` tables.
    #[serde(default)]
    pub(crate) endpoints: BTreeMap<String, EndpointFile>,
}

/// Per-endpoint settings in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointFile {
    pub(crate) policy: Option<String>,
    pub(crate) policy_config: Option<String>,
    pub(crate) forward_authorization: Option<bool>,
}

/// A policy to load: a built-in name or a `.wasm` path, and its configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicySpec {
    /// Built-in name or path.
    pub spec: String,
    /// JSON configuration.
    pub config: String,
}

/// A `workers` entry of the TOML file: a URL (with optional `#kv_events=…`) or a table.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(crate) enum WorkerEntry {
    Url(String),
    Table(WorkerTable),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct WorkerTable {
    pub(crate) url: String,
    pub(crate) kv_events: Option<String>,
    pub(crate) kv_replay: Option<String>,
    #[serde(default)]
    pub(crate) topic: String,
    pub(crate) data_parallel_size: Option<u32>,
    #[serde(default)]
    pub(crate) role: Option<String>,
    pub(crate) bootstrap_port: Option<u16>,
}

/// A static worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticWorker {
    /// Base URL, without a trailing `/`.
    pub url: String,
    /// Its engine's ZMQ KV event publisher, if any.
    pub engine_events: Option<EngineEventSource>,
    /// What it does in a fleet that splits prefill from decode.
    pub role: Role,
    /// A prefill worker's bootstrap port (SGLang's disaggregation).
    pub bootstrap_port: Option<u16>,
}

impl StaticWorker {
    /// Parses `URL` or `URL#kv_events=…&kv_replay=…&topic=…&dp=N&role=…&bootstrap_port=P`.
    pub fn parse(s: &str) -> Result<StaticWorker, ConfigError> {
        let (url, options) = s.split_once('#').unwrap_or((s, ""));
        let mut table = WorkerTable {
            url: url.to_string(),
            kv_events: None,
            kv_replay: None,
            topic: String::new(),
            data_parallel_size: None,
            role: None,
            bootstrap_port: None,
        };
        for kv in options.split('&').filter(|kv| !kv.is_empty()) {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            match k {
                "kv_events" => table.kv_events = Some(v.to_string()),
                "kv_replay" => table.kv_replay = Some(v.to_string()),
                "topic" => table.topic = v.to_string(),
                "role" => table.role = Some(v.to_string()),
                "bootstrap_port" => {
                    table.bootstrap_port = Some(v.parse().map_err(|_| {
                        ConfigError(format!("worker `{s}`: bootstrap_port=`{v}` is not a port"))
                    })?)
                }
                "dp" | "data_parallel_size" => {
                    table.data_parallel_size = Some(v.parse().map_err(|_| {
                        ConfigError(format!("worker `{s}`: dp=`{v}` is not a number"))
                    })?)
                }
                _ => {
                    return Err(ConfigError(format!(
                        "worker `{s}`: unknown option `{k}` (known: kv_events, kv_replay, topic, dp, role, bootstrap_port)"
                    )));
                }
            }
        }
        StaticWorker::from_table(table)
    }

    pub(super) fn from_table(t: WorkerTable) -> Result<StaticWorker, ConfigError> {
        let url = t.url.trim_end_matches('/').to_string();
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(ConfigError(format!("worker `{url}` is not an http(s) URL")));
        }
        let engine_events = match t.kv_events {
            None if t.kv_replay.is_some() => {
                return Err(ConfigError(format!(
                    "worker `{url}`: kv_replay without kv_events"
                )));
            }
            None => None,
            Some(endpoint) => {
                let src = EngineEventSource {
                    endpoint,
                    replay: t.kv_replay,
                    topic: t.topic,
                    data_parallel_size: t.data_parallel_size.unwrap_or(1),
                };
                src.validate()
                    .map_err(|e| ConfigError(format!("worker `{url}`: {e}")))?;
                Some(src)
            }
        };
        let role = match t.role.as_deref() {
            None => Role::Both,
            Some(r) => r
                .parse()
                .map_err(|e| ConfigError(format!("worker `{url}`: {e}")))?,
        };
        if let Some(port) = t.bootstrap_port {
            if role != Role::Prefill {
                return Err(ConfigError(format!(
                    "worker `{url}`: bootstrap_port is a prefill worker's (role=prefill)"
                )));
            }
            if port == 0 {
                return Err(ConfigError(format!("worker `{url}`: bootstrap_port is 0")));
            }
        }
        Ok(StaticWorker {
            url,
            engine_events,
            role,
            bootstrap_port: t.bootstrap_port,
        })
    }
}
