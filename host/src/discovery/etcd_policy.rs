//! Fleet-wide policy distribution through etcd: `switchyard policy push` stores a policy
//! under `{root}/policies/{namespace}/{component}/{endpoint}`; every router replica
//! watches that prefix and swaps the endpoint's policy (after its own validation).
//!
//! The value is JSON: `{"sha256", "config", "wasm_base64", "pushed_at"}`. etcd's default
//! request limit (1.5 MiB) bounds the policy size at about 1.1 MiB of `.wasm`.

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::etcd::EtcdConfig;
use super::etcd_api::Event;
use super::{DiscoveryError, EndpointPath};

/// A policy stored in etcd.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushedPolicy {
    /// sha256 of the `.wasm`, hex.
    pub sha256: String,
    /// The operator configuration (JSON text).
    pub config: String,
    /// The `.wasm` bytes, base64.
    pub wasm_base64: String,
    /// Unix seconds when it was pushed.
    pub pushed_at: u64,
}

impl PushedPolicy {
    /// Wraps `wasm` and `config` for storage.
    pub fn new(wasm: &[u8], config: &str) -> PushedPolicy {
        PushedPolicy {
            sha256: hex(&Sha256::digest(wasm)),
            config: config.to_string(),
            wasm_base64: base64::engine::general_purpose::STANDARD.encode(wasm),
            pushed_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }
    }

    /// The `.wasm` bytes, checked against `sha256`.
    pub fn wasm(&self) -> Result<Vec<u8>, String> {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(&self.wasm_base64)
            .map_err(|e| format!("wasm_base64 is not base64: {e}"))?;
        if hex(&Sha256::digest(&bytes)) != self.sha256 {
            return Err("the policy bytes do not match their sha256".into());
        }
        Ok(bytes)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn prefix(root: &str) -> String {
    format!("{}/policies/", root.trim_end_matches('/'))
}

/// Stores `policy` for `endpoint`; returns the key written.
pub async fn push(
    config: &EtcdConfig,
    endpoint: &EndpointPath,
    policy: &PushedPolicy,
) -> Result<String, DiscoveryError> {
    let key = format!("{}{endpoint}", prefix(&config.root));
    let value = serde_json::to_string(policy).expect("policies serialise");
    config.api().put(&key, value.as_bytes(), None).await?;
    Ok(key)
}

/// Calls `apply(endpoint, policy)` for every stored policy now and for every one pushed
/// later, forever (reconnecting with backoff). Malformed entries are logged and skipped.
pub fn watch(
    config: EtcdConfig,
    apply: impl Fn(EndpointPath, PushedPolicy) + Send + Sync + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut delay = config.backoff_initial;
        // The revision applied last, so that a re-list does not re-apply old pushes.
        let mut seen: i64 = 0;
        loop {
            if let Err(e) = cycle(&config, &apply, &mut seen, &mut delay).await {
                tracing::warn!(error = %e, retry_in = ?delay, "policy watch interrupted");
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(config.backoff_max);
        }
    })
}

fn parse(key: &[u8], value: &[u8], root: &str) -> Result<(EndpointPath, PushedPolicy), String> {
    let key = String::from_utf8_lossy(key);
    let path = key
        .strip_prefix(&prefix(root))
        .ok_or("outside the policy prefix")?;
    let endpoint: EndpointPath = path.parse().map_err(|e: super::KeyError| e.to_string())?;
    let policy: PushedPolicy = serde_json::from_slice(value).map_err(|e| format!("{key}: {e}"))?;
    Ok((endpoint, policy))
}

async fn cycle(
    config: &EtcdConfig,
    apply: &(impl Fn(EndpointPath, PushedPolicy) + Send + Sync),
    seen: &mut i64,
    delay: &mut std::time::Duration,
) -> Result<(), DiscoveryError> {
    let api = config.api();
    let (kvs, revision) = api.range_prefix(&prefix(&config.root)).await?;
    for kv in &kvs {
        if kv.mod_revision <= *seen {
            continue;
        }
        match parse(&kv.key, &kv.value, &config.root) {
            Ok((endpoint, policy)) => apply(endpoint, policy),
            Err(e) => tracing::warn!(error = %e, "skipping a malformed policy entry"),
        }
    }
    *seen = (*seen).max(revision);
    let mut watch = api
        .watch_prefix(&prefix(&config.root), revision + 1)
        .await?;
    *delay = config.backoff_initial;
    let mut alive = tokio::time::interval(config.timeout);
    alive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let events = tokio::select! {
            events = watch.next() => events?,
            _ = alive.tick() => {
                api.status().await?;
                continue;
            }
        };
        for event in events {
            let kv = match event {
                Event::Put(kv) => kv,
                Event::Delete(kv) => {
                    *seen = (*seen).max(kv.mod_revision);
                    continue;
                }
            };
            *seen = (*seen).max(kv.mod_revision);
            match parse(&kv.key, &kv.value, &config.root) {
                Ok((endpoint, policy)) => apply(endpoint, policy),
                Err(e) => tracing::warn!(error = %e, "skipping a malformed policy entry"),
            }
        }
    }
}
