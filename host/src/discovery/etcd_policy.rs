//! Fleet-wide policy distribution through etcd: `switchyard policy push` stores a policy
//! under `{root}/policies/{namespace}/{component}/{endpoint}`; every router replica
//! watches that prefix and swaps the endpoint's policy (after its own validation).
//!
//! The value is JSON: `{"sha256", "config", "wasm_base64", "pushed_at"}`. etcd's default
//! request limit (1.5 MiB) bounds the policy size at about 1.1 MiB of `.wasm`.

use base64::Engine as _;
use etcd_client::{EventType, GetOptions, WatchOptions};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::etcd::EtcdConfig;
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
    let mut etcd = config.connect().await?;
    etcd.put(key.as_str(), value, None)
        .await
        .map_err(|e| config.error(e))?;
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
    let mut etcd = config.connect().await?;
    let resp = etcd
        .get(prefix(&config.root), Some(GetOptions::new().with_prefix()))
        .await
        .map_err(|e| config.error(e))?;
    let revision = resp.header().map_or(0, |h| h.revision());
    for kv in resp.kvs() {
        if kv.mod_revision() <= *seen {
            continue;
        }
        match parse(kv.key(), kv.value(), &config.root) {
            Ok((endpoint, policy)) => apply(endpoint, policy),
            Err(e) => tracing::warn!(error = %e, "skipping a malformed policy entry"),
        }
    }
    *seen = (*seen).max(revision);
    let mut stream = etcd
        .watch(
            prefix(&config.root),
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(revision + 1),
            ),
        )
        .await
        .map_err(|e| config.error(e))?;
    *delay = config.backoff_initial;
    loop {
        let Some(msg) = stream.message().await.map_err(|e| config.error(e))? else {
            return Err(config.error("policy watch ended"));
        };
        if msg.canceled() {
            return Err(config.error(format!("policy watch canceled: {}", msg.cancel_reason())));
        }
        for event in msg.events() {
            let Some(kv) = event.kv() else { continue };
            *seen = (*seen).max(kv.mod_revision());
            if event.event_type() != EventType::Put {
                continue;
            }
            match parse(kv.key(), kv.value(), &config.root) {
                Ok((endpoint, policy)) => apply(endpoint, policy),
                Err(e) => tracing::warn!(error = %e, "skipping a malformed policy entry"),
            }
        }
    }
}
