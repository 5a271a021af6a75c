//! Flags, variables and the file merged into one [`ServeConfig`]: a flag or variable
//! beats the file, the file beats the default.

use std::collections::BTreeMap;
use std::mem::take;
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

/// Each migration prefills the prompt and the answer so far again.
const MAX_MIGRATION_LIMIT: u32 = 16;

impl ServeArgs {
    /// Merges flags, environment and the file.
    pub fn resolve(mut self) -> Result<ServeConfig, ConfigError> {
        let mut file: FileConfig = match &self.config {
            Some(path) => {
                let text = switchyard_bounded::files::read_to_string(path, MAX_CONFIG_FILE)
                    .map_err(|e| ConfigError(format!("cannot read {}: {e}", path.display())))?;
                toml::from_str(&text)
                    .map_err(|e| ConfigError(format!("{}: {e}", path.display())))?
            }
            None => FileConfig::default(),
        };
        let (a, f) = (&mut self, &mut file);
        let lora_adapters = super::lora::adapters(a, f)?;
        let discovery = discovery(a, f)?;
        let (default_policy, endpoint_policies, endpoint_forward_authorization) = endpoints(a, f)?;
        let kv_events_bind = kv_events_bind(a, f)?;
        let (overload, saturation) = super::overload::resolve(super::overload::Raw {
            queue_max: a.queue_max.take().or(f.queue_max.take()),
            queue_max_bytes: a.queue_max_bytes.take().or(f.queue_max_bytes.take()),
            saturation_queued: a.saturation_queued.take().or(f.saturation_queued.take()),
            saturation_kv_usage: a
                .saturation_kv_usage
                .take()
                .or(f.saturation_kv_usage.take()),
            saturation_max_in_flight: a
                .saturation_max_in_flight
                .take()
                .or(f.saturation_max_in_flight.take()),
            saturation_prefill_tokens: a
                .saturation_prefill_tokens
                .take()
                .or(f.saturation_prefill_tokens.take()),
            saturation_wait_ms: a.saturation_wait_ms.take().or(f.saturation_wait_ms.take()),
            saturation_batch_full: a
                .saturation_batch_full
                .take()
                .or(f.saturation_batch_full.take()),
            tenant_header: a.tenant_header.take().or(f.tenant_header.take()),
            classes: take(&mut f.classes),
            tenants: take(&mut f.tenants),
        })?;
        let mut gateway = gateway(a, f, overload)?;
        gateway.lora_adapters = lora_adapters;
        let outlier = outlier(a, f, gateway.outlier_detection)?;
        let approximate = approximate(a, f)?;
        let runtime = runtime(a, f)?;
        let policy_trusted_keys = flag_or_file(
            take(&mut a.policy_trusted_keys),
            take(&mut f.policy_trusted_keys),
        )
        .iter()
        .map(|path| switchyard_discovery::signing::PublicKey::load(path).map_err(ConfigError))
        .collect::<Result<Vec<_>, _>>()?;
        let kv_hash_key = kv_hash_key(a, f, &discovery);
        let (epp_tls, epp_fallbacks) = epp(a, f)?;
        Ok(ServeConfig {
            kv_hash_key,
            listen: a
                .listen
                .take()
                .or(f.listen.take())
                .unwrap_or_else(|| "127.0.0.1:8000".parse().expect("valid")),
            default_policy,
            endpoint_policies,
            watch: a.watch.take().or(f.watch.take()).unwrap_or(false),
            tokenizer: a.tokenizer.take().or(f.tokenizer.take()),
            chat_template: a.chat_template.take().or(f.chat_template.take()),
            tokenizer_cache_tokens: a
                .tokenizer_cache_tokens
                .take()
                .or(f.tokenizer_cache_tokens.take())
                .unwrap_or(switchyard_tokens::prefix::DEFAULT_BUDGET_TOKENS),
            gateway,
            runtime,
            client: ClientConfig {
                outlier,
                ..ClientConfig::default()
            },
            shutdown_grace: bounded(
                "shutdown_grace_secs",
                a.shutdown_grace_secs
                    .take()
                    .or(f.shutdown_grace_secs.take()),
                Duration::from_secs,
                Duration::from_secs(30),
            )?,
            approximate,
            engine_metrics: match a
                .engine_metrics_ms
                .take()
                .or(f.engine_metrics_ms.take())
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
            kv_events_memory: match a
                .kv_events_memory_mib
                .take()
                .or(f.kv_events_memory_mib.take())
            {
                None => switchyard_router::DEFAULT_EVENT_MEMORY,
                // At least one of the largest messages (32 MiB); at most 1 TiB.
                Some(mib) if (32..=1 << 20).contains(&mib) => mib << 20,
                Some(mib) => {
                    return Err(ConfigError(format!(
                        "--kv-events-memory-mib {mib}: from 32 (one message at its bound) to 1048576"
                    )));
                }
            },
            forward_authorization: a
                .forward_authorization
                .take()
                .or(f.forward_authorization.take())
                .unwrap_or(matches!(discovery, DiscoveryConfig::Static { .. })),
            endpoint_forward_authorization,
            policy_trusted_keys,
            saturation,
            admin_listen: a.admin_listen.take().or(f.admin_listen.take()),
            epp_listen: a.epp_listen.take().or(f.epp_listen.take()),
            epp_tls,
            epp_fallbacks,
            epp_report_served: a
                .epp_report_served
                .take()
                .or(f.epp_report_served.take())
                .unwrap_or(false),
            endpoint_grace: bounded(
                "endpoint_grace_secs",
                a.endpoint_grace_secs
                    .take()
                    .or(f.endpoint_grace_secs.take()),
                Duration::from_secs,
                Duration::from_secs(600),
            )?,
            discovery,
        })
    }
}

/// Where the workers come from: etcd or a static list, never both.
fn discovery(a: &mut ServeArgs, f: &mut FileConfig) -> Result<DiscoveryConfig, ConfigError> {
    let etcd = flag_or_file(take(&mut a.etcd), take(&mut f.etcd));
    let workers: Vec<StaticWorker> = if a.workers.is_empty() {
        take(&mut f.workers)
            .into_iter()
            .map(|w| match w {
                WorkerEntry::Url(u) => StaticWorker::parse(&u),
                WorkerEntry::Table(t) => StaticWorker::from_table(t),
            })
            .collect::<Result<_, _>>()?
    } else {
        a.workers
            .iter()
            .map(|w| StaticWorker::parse(w))
            .collect::<Result<_, _>>()?
    };
    let model = a
        .model
        .take()
        .or(f.model.take())
        .unwrap_or_else(|| "mock-model".into());
    let block_size = a
        .block_size
        .take()
        .or(f.block_size.take())
        .unwrap_or(16)
        .max(1);
    let health_path = a
        .health_path
        .clone()
        .or(f.health_path.clone())
        .unwrap_or_else(|| "/health".into());
    if let Some(kube) = super::kube::resolve(a, f, &model, block_size, &health_path)? {
        if !etcd.is_empty() || !workers.is_empty() {
            return Err(ConfigError(
                "give one of --etcd, --worker or Kubernetes discovery (--kube-pool, --kube-selector)".into(),
            ));
        }
        return Ok(DiscoveryConfig::Kube(Box::new(kube)));
    }
    Ok(match (etcd.is_empty(), workers.is_empty()) {
        (false, true) => DiscoveryConfig::Etcd(
            EtcdAccessArgs {
                etcd_user: a.etcd_access.etcd_user.clone().or(f.etcd_user.take()),
                etcd_password_file: a
                    .etcd_access
                    .etcd_password_file
                    .clone()
                    .or(f.etcd_password_file.take()),
                etcd_ca_files: flag_or_file(
                    a.etcd_access.etcd_ca_files.clone(),
                    take(&mut f.etcd_ca_files),
                ),
            }
            .apply(EtcdConfig {
                root: a
                    .etcd_root
                    .take()
                    .or(f.etcd_root.take())
                    .unwrap_or_else(|| "switchyard".into()),
                ..EtcdConfig::new(etcd)
            })?,
        ),
        (true, false) => DiscoveryConfig::Static {
            workers,
            model,
            block_size,
            kv_events: a.kv_events.take().or(f.kv_events.take()).unwrap_or(false),
            health_path,
        },
        (false, false) => {
            return Err(ConfigError(
                "give either --etcd or --worker, not both".into(),
            ));
        }
        (true, true) => {
            return Err(ConfigError(
                "no workers: give --etcd URL, --worker URL or --kube-pool NAME".into(),
            ));
        }
    })
}

/// The default policy, each endpoint's own, and each endpoint's forward_authorization.
#[allow(clippy::type_complexity)]
fn endpoints(
    a: &mut ServeArgs,
    f: &mut FileConfig,
) -> Result<
    (
        PolicySpec,
        BTreeMap<EndpointPath, PolicySpec>,
        BTreeMap<EndpointPath, bool>,
    ),
    ConfigError,
> {
    let default_policy = PolicySpec {
        spec: a
            .policy
            .take()
            .or(f.policy.take())
            .unwrap_or_else(|| "kv-cost".into()),
        config: a
            .policy_config
            .take()
            .or(f.policy_config.take())
            .unwrap_or_else(|| "{}".into()),
    };
    let mut endpoint_policies = BTreeMap::new();
    let mut endpoint_forward_authorization = BTreeMap::new();
    for (path, ep) in take(&mut f.endpoints) {
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
    Ok((
        default_policy,
        endpoint_policies,
        endpoint_forward_authorization,
    ))
}

/// The addresses KV events are read from, each `tcp://HOST:PORT`.
fn kv_events_bind(a: &mut ServeArgs, f: &mut FileConfig) -> Result<Vec<String>, ConfigError> {
    let kv_events_bind = flag_or_file(take(&mut a.kv_events_bind), take(&mut f.kv_events_bind));
    for address in &kv_events_bind {
        if !address.starts_with("tcp://") || !address.contains(':') {
            return Err(ConfigError(format!(
                "--kv-events-bind `{address}` is not tcp://HOST:PORT"
            )));
        }
    }
    Ok(kv_events_bind)
}

/// The gateway's bounds and deadlines.
fn gateway(
    a: &mut ServeArgs,
    f: &mut FileConfig,
    overload: crate::queue::classes::OverloadConfig,
) -> Result<GatewayConfig, ConfigError> {
    let defaults = GatewayConfig::default();
    let ca_files = flag_or_file(take(&mut a.ca_files), take(&mut f.ca_files));
    let tls = switchyard_net::upstream::Tls::with_ca_files(&ca_files)
        .map_err(|e| ConfigError(e.to_string()))?;
    Ok(GatewayConfig {
        tls,
        max_body_bytes: a
            .max_body_bytes
            .take()
            .or(f.max_body_bytes.take())
            .unwrap_or(defaults.max_body_bytes),
        max_body_bytes_total: a
            .max_body_bytes_total
            .take()
            .or(f.max_body_bytes_total.take())
            .unwrap_or(defaults.max_body_bytes_total),
        max_prompt_tokens: a
            .max_prompt_tokens
            .take()
            .or(f.max_prompt_tokens.take())
            .unwrap_or(defaults.max_prompt_tokens)
            .max(1),
        max_attempts: a
            .max_attempts
            .take()
            .or(f.max_attempts.take())
            .unwrap_or(defaults.max_attempts)
            .max(1),
        migration_limit: match a.migration_limit.take().or(f.migration_limit.take()) {
            None => defaults.migration_limit,
            Some(n) if n <= MAX_MIGRATION_LIMIT => n,
            Some(n) => {
                return Err(ConfigError(format!(
                    "migration_limit = {n}: at most {MAX_MIGRATION_LIMIT} (each migration prefills the prompt again)"
                )));
            }
        },
        migration_token_ids: a
            .migration_token_ids
            .take()
            .or(f.migration_token_ids.take())
            .unwrap_or(defaults.migration_token_ids),
        drain_grace: bounded(
            "drain_grace_secs",
            a.drain_grace_secs.take().or(f.drain_grace_secs.take()),
            Duration::from_secs,
            defaults.drain_grace,
        )?,
        connect_timeout: bounded(
            "connect_timeout_ms",
            a.connect_timeout_ms.take().or(f.connect_timeout_ms.take()),
            Duration::from_millis,
            defaults.connect_timeout,
        )?,
        first_byte_timeout: bounded(
            "first_byte_timeout_secs",
            a.first_byte_timeout_secs
                .take()
                .or(f.first_byte_timeout_secs.take()),
            Duration::from_secs,
            defaults.first_byte_timeout,
        )?,
        admin_token: admin_token(
            a.admin_token_on_command_line.take(),
            f.admin_token.take(),
            a.admin_token.take().or_else(|| {
                std::env::var("SWITCHYARD_ADMIN_TOKEN")
                    .ok()
                    .filter(|t| !t.is_empty())
            }),
            a.admin_token_file.take().or(f.admin_token_file.take()),
        )?,
        availability: a
            .availability
            .take()
            .or(f.availability.take())
            .unwrap_or(true),
        request_timeout: bounded(
            "request_timeout_secs",
            a.request_timeout_secs
                .take()
                .or(f.request_timeout_secs.take()),
            Duration::from_secs,
            defaults.request_timeout,
        )?,
        stream_idle_timeout: bounded(
            "stream_idle_timeout_secs",
            a.stream_idle_timeout_secs
                .take()
                .or(f.stream_idle_timeout_secs.take()),
            Duration::from_secs,
            defaults.stream_idle_timeout,
        )?,
        client_idle_timeout: bounded(
            "client_idle_timeout_secs",
            a.client_idle_timeout_secs
                .take()
                .or(f.client_idle_timeout_secs.take()),
            Duration::from_secs,
            defaults.client_idle_timeout,
        )?,
        max_connections: a
            .max_connections
            .take()
            .or(f.max_connections.take())
            .unwrap_or(defaults.max_connections)
            .max(1),
        max_in_flight: a
            .max_in_flight
            .take()
            .or(f.max_in_flight.take())
            .unwrap_or(defaults.max_in_flight)
            .max(1),
        outlier_detection: a
            .outlier_detection
            .take()
            .or(f.outlier_detection.take())
            .unwrap_or(true),
        overload: std::sync::Arc::new(overload),
        ..defaults
    })
}

/// Outlier detection's settings; off, a worker is ejected at its first failure.
fn outlier(
    a: &mut ServeArgs,
    f: &mut FileConfig,
    enabled: bool,
) -> Result<OutlierConfig, ConfigError> {
    let od = OutlierConfig::default();
    let percent = |p: u32| f64::from(p.min(100)) / 100.0;
    let outlier = OutlierConfig {
        consecutive_failures: a
            .consecutive_failures
            .take()
            .or(f.consecutive_failures.take())
            .unwrap_or(od.consecutive_failures)
            .max(1),
        max_ejection_share: a
            .max_ejection_percent
            .take()
            .or(f.max_ejection_percent.take())
            .map_or(od.max_ejection_share, percent),
        panic_threshold: a
            .panic_threshold_percent
            .take()
            .or(f.panic_threshold_percent.take())
            .map_or(od.panic_threshold, percent),
        base_ejection: bounded(
            "base_ejection_ms",
            a.base_ejection_ms.take().or(f.base_ejection_ms.take()),
            Duration::from_millis,
            od.base_ejection,
        )?,
        max_ejection: bounded(
            "max_ejection_secs",
            a.max_ejection_secs.take().or(f.max_ejection_secs.take()),
            Duration::from_secs,
            od.max_ejection,
        )?,
        health_interval: match a
            .health_check_interval_ms
            .take()
            .or(f.health_check_interval_ms.take())
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
            a.discovery_grace_secs
                .take()
                .or(f.discovery_grace_secs.take()),
            Duration::from_secs,
            od.discovery_grace,
        )?,
        busy_max: bounded(
            "max_retry_after_secs",
            a.max_retry_after_secs
                .take()
                .or(f.max_retry_after_secs.take()),
            Duration::from_secs,
            od.busy_max,
        )?,
        ..od
    };
    let outlier = if enabled {
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
    Ok(outlier)
}

/// How long predicted cache entries live, and how many.
fn approximate(
    a: &mut ServeArgs,
    f: &mut FileConfig,
) -> Result<switchyard_router::Approximate, ConfigError> {
    let approx_defaults = switchyard_router::Approximate::default();
    let prediction_ttl = a
        .prediction_ttl_secs
        .take()
        .or(f.prediction_ttl_secs.take());
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
        max_blocks: a
            .prediction_max_blocks
            .take()
            .or(f.prediction_max_blocks.take())
            .unwrap_or(approx_defaults.max_blocks)
            .max(1),
    };
    Ok(approximate)
}

/// The policy runtime's bounds.
fn runtime(a: &mut ServeArgs, f: &mut FileConfig) -> Result<RuntimeConfig, ConfigError> {
    let runtime_defaults = RuntimeConfig::default();
    let runtime = RuntimeConfig {
        call_budget: bounded(
            "policy_budget_ms",
            a.policy_budget_ms.take().or(f.policy_budget_ms.take()),
            Duration::from_millis,
            runtime_defaults.call_budget,
        )?,
        memory_cap: a
            .policy_memory_mb
            .take()
            .or(f.policy_memory_mb.take())
            .map_or(runtime_defaults.memory_cap, |mb| mb << 20),
        total_memory_cap: a
            .policy_memory_total_mb
            .take()
            .or(f.policy_memory_total_mb.take())
            .map_or(runtime_defaults.total_memory_cap, |mb| mb << 20),
        warm_instances: a
            .policy_warm_instances
            .take()
            .or(f.policy_warm_instances.take())
            .unwrap_or(runtime_defaults.warm_instances)
            .clamp(1, runtime_defaults.max_warm_instances),
        cache_dir: a
            .policy_cache
            .take()
            .or(f.policy_cache.take())
            .or(runtime_defaults.cache_dir.clone()),
        allow_reject_all: a
            .policy_may_reject_all
            .take()
            .or(f.policy_may_reject_all.take())
            .unwrap_or(false),
        ..runtime_defaults
    };
    Ok(runtime)
}

/// The key of the router's block hashes.
fn kv_hash_key(a: &mut ServeArgs, f: &mut FileConfig, discovery: &DiscoveryConfig) -> u64 {
    match a.kv_hash_key.take().or(f.kv_hash_key.take()) {
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
    }
}

/// The picker port's TLS and how many fallbacks a pick names.
fn epp(
    a: &mut ServeArgs,
    f: &mut FileConfig,
) -> Result<(Option<crate::epp::EppTls>, usize), ConfigError> {
    let tls = match (
        a.epp_tls_cert.take().or(f.epp_tls_cert.take()),
        a.epp_tls_key.take().or(f.epp_tls_key.take()),
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
    };
    let fallbacks = match a
        .epp_fallbacks
        .take()
        .or(f.epp_fallbacks.take())
        .unwrap_or(0)
    {
        n if n <= crate::epp::MAX_FALLBACKS => n,
        n => {
            return Err(ConfigError(format!(
                "epp_fallbacks {n}: at most {}",
                crate::epp::MAX_FALLBACKS
            )));
        }
    };
    Ok((tls, fallbacks))
}
