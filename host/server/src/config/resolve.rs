//! Flags, variables and the file merged into one [`ServeConfig`]: a flag or variable
//! beats the file, the file beats the default.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::GatewayConfig;
use switchyard_discovery::EndpointPath;
use switchyard_discovery::etcd::EtcdConfig;
use switchyard_policy::RuntimeConfig;
use switchyard_router::client::{ClientConfig, OutlierConfig};

use super::file::WorkerEntry;
use super::secrets::admin_token;
use super::*;

/// The config file's size bound: a TOML file of settings is kilobytes.
const MAX_CONFIG_FILE: u64 = 1 << 20;

impl ServeArgs {
    /// Merges flags, environment and the file.
    pub fn resolve(self) -> Result<ServeConfig, ConfigError> {
        let file: FileConfig = match &self.config {
            Some(path) => {
                let text = switchyard_bounded::files::read_to_string(path, MAX_CONFIG_FILE)
                    .map_err(|e| ConfigError(format!("cannot read {}: {e}", path.display())))?;
                toml::from_str(&text)
                    .map_err(|e| ConfigError(format!("{}: {e}", path.display())))?
            }
            None => FileConfig::default(),
        };
        let etcd = flag_or_file(self.etcd, file.etcd);
        let workers: Vec<StaticWorker> = if self.workers.is_empty() {
            file.workers
                .into_iter()
                .map(|w| match w {
                    WorkerEntry::Url(u) => StaticWorker::parse(&u),
                    WorkerEntry::Table(t) => StaticWorker::from_table(t),
                })
                .collect::<Result<_, _>>()?
        } else {
            self.workers
                .iter()
                .map(|w| StaticWorker::parse(w))
                .collect::<Result<_, _>>()?
        };
        let discovery = match (etcd.is_empty(), workers.is_empty()) {
            (false, true) => DiscoveryConfig::Etcd(
                EtcdAccessArgs {
                    etcd_user: self.etcd_access.etcd_user.clone().or(file.etcd_user),
                    etcd_password_file: self
                        .etcd_access
                        .etcd_password_file
                        .clone()
                        .or(file.etcd_password_file),
                    etcd_ca_files: flag_or_file(
                        self.etcd_access.etcd_ca_files.clone(),
                        file.etcd_ca_files,
                    ),
                }
                .apply(EtcdConfig {
                    root: self
                        .etcd_root
                        .or(file.etcd_root)
                        .unwrap_or_else(|| "switchyard".into()),
                    ..EtcdConfig::new(etcd)
                })?,
            ),
            (true, false) => DiscoveryConfig::Static {
                workers,
                model: self
                    .model
                    .or(file.model)
                    .unwrap_or_else(|| "mock-model".into()),
                block_size: self.block_size.or(file.block_size).unwrap_or(16).max(1),
                kv_events: self.kv_events.or(file.kv_events).unwrap_or(false),
                health_path: self
                    .health_path
                    .clone()
                    .or(file.health_path.clone())
                    .unwrap_or_else(|| "/health".into()),
            },
            (false, false) => {
                return Err(ConfigError(
                    "give either --etcd or --worker, not both".into(),
                ));
            }
            (true, true) => {
                return Err(ConfigError(
                    "no workers: give --etcd URL or --worker URL".into(),
                ));
            }
        };
        let default_policy = PolicySpec {
            spec: self
                .policy
                .or(file.policy)
                .unwrap_or_else(|| "kv-cost".into()),
            config: self
                .policy_config
                .or(file.policy_config)
                .unwrap_or_else(|| "{}".into()),
        };
        let mut endpoint_policies = BTreeMap::new();
        let mut endpoint_forward_authorization = BTreeMap::new();
        for (path, ep) in file.endpoints {
            let endpoint: EndpointPath = path
                .parse()
                .map_err(|e| ConfigError(format!("[endpoints.\"{path}\"]: {e}")))?;
            if let Some(forward) = ep.forward_authorization {
                endpoint_forward_authorization.insert(endpoint.clone(), forward);
            }
            if ep.policy.is_none() && ep.policy_config.is_none() {
                continue;
            }
            let spec = PolicySpec {
                spec: ep.policy.unwrap_or_else(|| default_policy.spec.clone()),
                config: ep.policy_config.unwrap_or_else(|| "{}".into()),
            };
            endpoint_policies.insert(endpoint, spec);
        }
        let kv_events_bind = flag_or_file(self.kv_events_bind, file.kv_events_bind);
        for address in &kv_events_bind {
            if !address.starts_with("tcp://") || !address.contains(':') {
                return Err(ConfigError(format!(
                    "--kv-events-bind `{address}` is not tcp://HOST:PORT"
                )));
            }
        }
        /// Each migration prefills the prompt and the answer so far again.
        const MAX_MIGRATION_LIMIT: u32 = 16;
        let (overload, saturation) = super::overload::resolve(super::overload::Raw {
            queue_max: self.queue_max.or(file.queue_max),
            queue_max_bytes: self.queue_max_bytes.or(file.queue_max_bytes),
            saturation_queued: self.saturation_queued.or(file.saturation_queued),
            saturation_kv_usage: self.saturation_kv_usage.or(file.saturation_kv_usage),
            saturation_max_in_flight: self
                .saturation_max_in_flight
                .or(file.saturation_max_in_flight),
            saturation_prefill_tokens: self
                .saturation_prefill_tokens
                .or(file.saturation_prefill_tokens),
            saturation_wait_ms: self.saturation_wait_ms.or(file.saturation_wait_ms),
            tenant_header: self.tenant_header.or(file.tenant_header),
            classes: file.classes,
            tenants: file.tenants,
        })?;
        let defaults = GatewayConfig::default();
        let ca_files = flag_or_file(self.ca_files, file.ca_files);
        let tls = switchyard_net::upstream::Tls::with_ca_files(&ca_files)
            .map_err(|e| ConfigError(e.to_string()))?;
        let gateway = GatewayConfig {
            tls,
            max_body_bytes: self
                .max_body_bytes
                .or(file.max_body_bytes)
                .unwrap_or(defaults.max_body_bytes),
            max_body_bytes_total: self
                .max_body_bytes_total
                .or(file.max_body_bytes_total)
                .unwrap_or(defaults.max_body_bytes_total),
            max_prompt_tokens: self
                .max_prompt_tokens
                .or(file.max_prompt_tokens)
                .unwrap_or(defaults.max_prompt_tokens)
                .max(1),
            max_attempts: self
                .max_attempts
                .or(file.max_attempts)
                .unwrap_or(defaults.max_attempts)
                .max(1),
            migration_limit: match self.migration_limit.or(file.migration_limit) {
                None => defaults.migration_limit,
                Some(n) if n <= MAX_MIGRATION_LIMIT => n,
                Some(n) => {
                    return Err(ConfigError(format!(
                        "migration_limit = {n}: at most {MAX_MIGRATION_LIMIT} (each migration prefills the prompt again)"
                    )));
                }
            },
            drain_grace: bounded(
                "drain_grace_secs",
                self.drain_grace_secs.or(file.drain_grace_secs),
                Duration::from_secs,
                defaults.drain_grace,
            )?,
            connect_timeout: bounded(
                "connect_timeout_ms",
                self.connect_timeout_ms.or(file.connect_timeout_ms),
                Duration::from_millis,
                defaults.connect_timeout,
            )?,
            first_byte_timeout: bounded(
                "first_byte_timeout_secs",
                self.first_byte_timeout_secs
                    .or(file.first_byte_timeout_secs),
                Duration::from_secs,
                defaults.first_byte_timeout,
            )?,
            admin_token: admin_token(
                self.admin_token_on_command_line,
                file.admin_token,
                self.admin_token.or_else(|| {
                    std::env::var("SWITCHYARD_ADMIN_TOKEN")
                        .ok()
                        .filter(|t| !t.is_empty())
                }),
                self.admin_token_file.or(file.admin_token_file),
            )?,
            availability: self.availability.or(file.availability).unwrap_or(true),
            request_timeout: bounded(
                "request_timeout_secs",
                self.request_timeout_secs.or(file.request_timeout_secs),
                Duration::from_secs,
                defaults.request_timeout,
            )?,
            stream_idle_timeout: bounded(
                "stream_idle_timeout_secs",
                self.stream_idle_timeout_secs
                    .or(file.stream_idle_timeout_secs),
                Duration::from_secs,
                defaults.stream_idle_timeout,
            )?,
            client_idle_timeout: bounded(
                "client_idle_timeout_secs",
                self.client_idle_timeout_secs
                    .or(file.client_idle_timeout_secs),
                Duration::from_secs,
                defaults.client_idle_timeout,
            )?,
            max_connections: self
                .max_connections
                .or(file.max_connections)
                .unwrap_or(defaults.max_connections)
                .max(1),
            max_in_flight: self
                .max_in_flight
                .or(file.max_in_flight)
                .unwrap_or(defaults.max_in_flight)
                .max(1),
            outlier_detection: self
                .outlier_detection
                .or(file.outlier_detection)
                .unwrap_or(true),
            overload: std::sync::Arc::new(overload),
            ..defaults
        };
        let od = OutlierConfig::default();
        let percent = |p: u32| f64::from(p.min(100)) / 100.0;
        let outlier = OutlierConfig {
            consecutive_failures: self
                .consecutive_failures
                .or(file.consecutive_failures)
                .unwrap_or(od.consecutive_failures)
                .max(1),
            max_ejection_share: self
                .max_ejection_percent
                .or(file.max_ejection_percent)
                .map_or(od.max_ejection_share, percent),
            panic_threshold: self
                .panic_threshold_percent
                .or(file.panic_threshold_percent)
                .map_or(od.panic_threshold, percent),
            base_ejection: bounded(
                "base_ejection_ms",
                self.base_ejection_ms.or(file.base_ejection_ms),
                Duration::from_millis,
                od.base_ejection,
            )?,
            max_ejection: bounded(
                "max_ejection_secs",
                self.max_ejection_secs.or(file.max_ejection_secs),
                Duration::from_secs,
                od.max_ejection,
            )?,
            health_interval: match self
                .health_check_interval_ms
                .or(file.health_check_interval_ms)
            {
                Some(0) => None,
                Some(ms) => Some(bounded(
                    "health_check_interval_ms",
                    Some(ms),
                    Duration::from_millis,
                    Duration::ZERO,
                )?),
                None => od.health_interval,
            },
            discovery_grace: bounded(
                "discovery_grace_secs",
                self.discovery_grace_secs.or(file.discovery_grace_secs),
                Duration::from_secs,
                od.discovery_grace,
            )?,
            busy_max: bounded(
                "max_retry_after_secs",
                self.max_retry_after_secs.or(file.max_retry_after_secs),
                Duration::from_secs,
                od.busy_max,
            )?,
            ..od
        };
        let outlier = if gateway.outlier_detection {
            outlier
        } else {
            OutlierConfig {
                consecutive_failures: 1,
                max_ejection_share: 1.0,
                panic_threshold: 0.0,
                // Probed 0.5 s after the failure, as before outlier detection.
                base_ejection: Duration::from_millis(500),
                max_ejection: Duration::from_millis(500),
                health_interval: None,
                discovery_grace: Duration::ZERO,
                ..outlier
            }
        };
        let approx_defaults = switchyard_router::Approximate::default();
        let prediction_ttl = self.prediction_ttl_secs.or(file.prediction_ttl_secs);
        let prediction_ttl = match prediction_ttl {
            None => approx_defaults.ttl,
            Some(t) => Duration::try_from_secs_f64(t)
                .ok()
                .filter(|d| !d.is_zero() && *d <= MAX_SETTING_DURATION)
                .ok_or_else(|| {
                    ConfigError(format!(
                        "prediction_ttl_secs = {t}: must be a positive number of seconds, at most a year"
                    ))
                })?,
        };
        let approximate = switchyard_router::Approximate {
            ttl: prediction_ttl,
            max_blocks: self
                .prediction_max_blocks
                .or(file.prediction_max_blocks)
                .unwrap_or(approx_defaults.max_blocks)
                .max(1),
        };
        let runtime_defaults = RuntimeConfig::default();
        let runtime = RuntimeConfig {
            call_budget: bounded(
                "policy_budget_ms",
                self.policy_budget_ms.or(file.policy_budget_ms),
                Duration::from_millis,
                runtime_defaults.call_budget,
            )?,
            memory_cap: self
                .policy_memory_mb
                .or(file.policy_memory_mb)
                .map_or(runtime_defaults.memory_cap, |mb| mb << 20),
            total_memory_cap: self
                .policy_memory_total_mb
                .or(file.policy_memory_total_mb)
                .map_or(runtime_defaults.total_memory_cap, |mb| mb << 20),
            warm_instances: self
                .policy_warm_instances
                .or(file.policy_warm_instances)
                .unwrap_or(runtime_defaults.warm_instances)
                .clamp(1, runtime_defaults.max_warm_instances),
            cache_dir: self
                .policy_cache
                .or(file.policy_cache)
                .or(runtime_defaults.cache_dir.clone()),
            allow_reject_all: self
                .policy_may_reject_all
                .or(file.policy_may_reject_all)
                .unwrap_or(false),
            ..runtime_defaults
        };
        let policy_trusted_keys = flag_or_file(self.policy_trusted_keys, file.policy_trusted_keys)
            .iter()
            .map(|path| switchyard_discovery::signing::PublicKey::load(path).map_err(ConfigError))
            .collect::<Result<Vec<_>, _>>()?;
        let kv_hash_key = match self.kv_hash_key.or(file.kv_hash_key) {
            Some(key) => key,
            // Only the router computes the chain: keyed at random, so that no client can
            // craft prompts whose blocks collide with others'.
            None if matches!(
                discovery,
                DiscoveryConfig::Static {
                    kv_events: false,
                    ..
                }
            ) =>
            {
                use std::hash::BuildHasher;
                std::hash::RandomState::new().hash_one(std::time::SystemTime::now()) | 1
            }
            // Workers may publish NDJSON events, hashed with the chain: they and the router
            // share the key, 0 unless both are given another.
            None => 0,
        };
        Ok(ServeConfig {
            kv_hash_key,
            listen: self
                .listen
                .or(file.listen)
                .unwrap_or_else(|| "127.0.0.1:8000".parse().expect("valid")),
            default_policy,
            endpoint_policies,
            watch: self.watch.or(file.watch).unwrap_or(false),
            tokenizer: self.tokenizer.or(file.tokenizer),
            chat_template: self.chat_template.or(file.chat_template),
            tokenizer_cache_tokens: self
                .tokenizer_cache_tokens
                .or(file.tokenizer_cache_tokens)
                .unwrap_or(switchyard_tokens::prefix::DEFAULT_BUDGET_TOKENS),
            gateway,
            runtime,
            client: ClientConfig {
                outlier,
                ..ClientConfig::default()
            },
            shutdown_grace: bounded(
                "shutdown_grace_secs",
                self.shutdown_grace_secs.or(file.shutdown_grace_secs),
                Duration::from_secs,
                Duration::from_secs(30),
            )?,
            approximate,
            engine_metrics: match self
                .engine_metrics_ms
                .or(file.engine_metrics_ms)
                .unwrap_or(1000)
            {
                0 => None,
                ms => Some(bounded(
                    "engine_metrics_ms",
                    Some(ms),
                    Duration::from_millis,
                    Duration::ZERO,
                )?),
            },
            kv_events_bind,
            kv_events_memory: match self.kv_events_memory_mib.or(file.kv_events_memory_mib) {
                None => switchyard_router::DEFAULT_EVENT_MEMORY,
                // At least one of the largest messages (32 MiB); at most 1 TiB.
                Some(mib) if (32..=1 << 20).contains(&mib) => mib << 20,
                Some(mib) => {
                    return Err(ConfigError(format!(
                        "--kv-events-memory-mib {mib}: from 32 (one message at its bound) to 1048576"
                    )));
                }
            },
            forward_authorization: self
                .forward_authorization
                .or(file.forward_authorization)
                .unwrap_or(matches!(discovery, DiscoveryConfig::Static { .. })),
            endpoint_forward_authorization,
            policy_trusted_keys,
            saturation,
            admin_listen: self.admin_listen.or(file.admin_listen),
            epp_listen: self.epp_listen.or(file.epp_listen),
            epp_tls: match (
                self.epp_tls_cert.or(file.epp_tls_cert),
                self.epp_tls_key.or(file.epp_tls_key),
            ) {
                (None, None) => None,
                (Some(cert), Some(key)) => {
                    Some(crate::epp::EppTls::read(&cert, &key).map_err(ConfigError)?)
                }
                _ => {
                    return Err(ConfigError(
                        "--epp-tls-cert and --epp-tls-key go together".into(),
                    ));
                }
            },
            epp_fallbacks: match self.epp_fallbacks.or(file.epp_fallbacks).unwrap_or(0) {
                n if n <= crate::epp::MAX_FALLBACKS => n,
                n => {
                    return Err(ConfigError(format!(
                        "epp_fallbacks {n}: at most {}",
                        crate::epp::MAX_FALLBACKS
                    )));
                }
            },
            endpoint_grace: bounded(
                "endpoint_grace_secs",
                self.endpoint_grace_secs.or(file.endpoint_grace_secs),
                Duration::from_secs,
                Duration::from_secs(600),
            )?,
            discovery,
        })
    }
}
