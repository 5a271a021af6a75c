//! etcd discovery: list an endpoint's prefix, then watch it from the listed revision + 1
//! so no change is missed; on a broken watch or a lost connection, reconnect with
//! backoff, re-list and reset. While etcd is unreachable nothing is sent, so the last
//! known set stays in force. An open watch is checked every `timeout` against etcd over
//! another connection ([`super::etcd_api::Watch::check`]): a server that stopped
//! answering, a member without a leader, and a watch stream that went silent while etcd
//! moved on (its connection frozen without a reset) all end the watch, which is then
//! re-listed and re-made.

use std::time::Duration;

use tokio::sync::mpsc;

use super::etcd_api::{EtcdApi, EtcdAuth, Event, Kv};
use switchyard_net::upstream::Tls;

use super::{
    Discovery, DiscoveryError, DiscoveryUpdate, EndpointPath, InstanceInfo, InstanceKey,
    InstanceRecord,
};

/// How to reach etcd and where Switchyard's keys live.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// Client URLs, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Root of Switchyard's key space.
    pub root: String,
    /// Timeout for connecting and for each request.
    pub timeout: Duration,
    /// First reconnect delay; doubles up to `backoff_max`.
    pub backoff_initial: Duration,
    /// Longest reconnect delay.
    pub backoff_max: Duration,
    /// Trust for `https://` endpoints (system roots plus the operator's CA files).
    pub tls: Tls,
    /// etcd user and password, when etcd has authentication enabled.
    pub auth: Option<EtcdAuth>,
}

impl EtcdConfig {
    /// Defaults for `endpoints`: root `switchyard`, 2 s timeouts, backoff 0.25 s → 5 s.
    pub fn new(endpoints: Vec<String>) -> EtcdConfig {
        EtcdConfig {
            endpoints,
            root: "switchyard".into(),
            timeout: Duration::from_secs(2),
            backoff_initial: Duration::from_millis(250),
            backoff_max: Duration::from_secs(5),
            tls: Tls::default(),
            auth: None,
        }
    }

    /// A client of this etcd (no connection is made until the first call).
    pub fn api(&self) -> EtcdApi {
        EtcdApi::with_access(&self.endpoints, self.timeout, &self.tls, self.auth.clone())
    }
}

/// The instance under `kv`, and whether it is draining (about to deregister).
pub fn parse_kv(kv: &Kv) -> Result<(InstanceInfo, bool), DiscoveryError> {
    let key_text = String::from_utf8_lossy(&kv.key);
    let key: InstanceKey = key_text.parse()?;
    let record: InstanceRecord =
        serde_json::from_slice(&kv.value).map_err(|e| DiscoveryError::BadValue {
            key: key.to_string(),
            why: e.to_string(),
        })?;
    // A new lease (or, without one, a new create revision) is a new registration.
    let registration = if kv.lease != 0 {
        kv.lease
    } else {
        kv.create_revision
    } as u64;
    let draining = record.draining;
    Ok((record.into_info(&key, registration)?, draining))
}

/// Calls `changed.notify_one()` whenever anything under `{root}/instances/` changes (a
/// registration, a deregistration, an expiry), from one watch on the whole prefix; after
/// a broken watch it reconnects with backoff and notifies once (a change may have been
/// missed). Lease renewals change nothing and notify nothing.
pub fn watch_changes(
    config: EtcdConfig,
    changed: std::sync::Arc<tokio::sync::Notify>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let prefix = format!("{}/instances/", config.root.trim_end_matches('/'));
        let mut delay = config.backoff_initial;
        loop {
            let api = config.api();
            let result: Result<(), DiscoveryError> = async {
                let (kvs, revision) = api.range_prefix(&prefix).await?;
                let mut watch = api.watch_prefix(&prefix, &kvs, revision + 1).await?;
                // Changes from here on arrive as events; one made before the watch began
                // (between the caller's last listing and this one) arrives as nothing,
                // so the caller lists again now.
                changed.notify_one();
                delay = config.backoff_initial;
                loop {
                    watch.next_checked().await?;
                    changed.notify_one();
                }
            }
            .await;
            if let Err(e) = result {
                tracing::debug!(error = %e, retry_in = ?delay, "instance watch interrupted");
            }
            changed.notify_one();
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(config.backoff_max);
        }
    })
}

/// Lists every registered instance under `root` (all endpoints).
pub async fn list_all(
    config: &EtcdConfig,
) -> Result<(Vec<InstanceInfo>, Vec<DiscoveryError>), DiscoveryError> {
    let prefix = format!("{}/instances/", config.root.trim_end_matches('/'));
    let (kvs, _) = config.api().range_prefix(&prefix).await?;
    let (mut ok, mut bad) = (Vec::new(), Vec::new());
    for kv in &kvs {
        match parse_kv(kv) {
            Ok((info, _)) => ok.push(info),
            Err(e) => bad.push(e),
        }
    }
    Ok((ok, bad))
}

/// Discovery from etcd.
#[derive(Debug, Clone)]
pub struct EtcdDiscovery {
    config: EtcdConfig,
}

impl EtcdDiscovery {
    /// Discovery against the etcd in `config`.
    pub fn new(config: EtcdConfig) -> EtcdDiscovery {
        EtcdDiscovery { config }
    }
}

impl Discovery for EtcdDiscovery {
    fn watch(
        &self,
        endpoint: EndpointPath,
        tx: mpsc::UnboundedSender<DiscoveryUpdate>,
    ) -> tokio::task::JoinHandle<()> {
        let config = self.config.clone();
        tokio::spawn(async move {
            let mut delay = config.backoff_initial;
            loop {
                let result = tokio::select! {
                    r = list_and_watch(&config, &endpoint, &tx, &mut delay) => r,
                    _ = tx.closed() => return,
                };
                if tx.is_closed() {
                    return;
                }
                if let Err(e) = result {
                    tracing::warn!(endpoint = %endpoint, error = %e, retry_in = ?delay, "etcd discovery interrupted; keeping the last known instances");
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(config.backoff_max);
            }
        })
    }
}

/// One list + watch cycle; returns when the watch breaks.
async fn list_and_watch(
    config: &EtcdConfig,
    endpoint: &EndpointPath,
    tx: &mpsc::UnboundedSender<DiscoveryUpdate>,
    delay: &mut Duration,
) -> Result<(), DiscoveryError> {
    let prefix = endpoint.etcd_prefix(&config.root);
    let api = config.api();
    let (kvs, revision) = api.range_prefix(&prefix).await?;
    let mut set = Vec::new();
    let mut leaving = Vec::new();
    for kv in &kvs {
        match parse_kv(kv) {
            Ok((info, false)) => set.push(info),
            Ok((info, true)) => leaving.push(info.id),
            Err(e) => tracing::warn!(error = %e, "skipping a malformed instance entry"),
        }
    }
    let mut watch = api.watch_prefix(&prefix, &kvs, revision + 1).await?;
    tracing::debug!(endpoint = %endpoint, instances = set.len(), revision, "listed instances; watching");
    if tx.send(DiscoveryUpdate::Reset(set)).is_err() {
        return Ok(());
    }
    for id in leaving {
        if tx.send(DiscoveryUpdate::Leave(id)).is_err() {
            return Ok(());
        }
    }
    // Connected and listed: the next failure starts backing off from the beginning.
    *delay = config.backoff_initial;
    loop {
        let events = watch.next_checked().await?;
        for event in events {
            let update = match event {
                Event::Put(kv) => match parse_kv(&kv) {
                    Ok((info, false)) => DiscoveryUpdate::Insert(info),
                    Ok((info, true)) => DiscoveryUpdate::Leave(info.id),
                    Err(e) => {
                        tracing::warn!(error = %e, "skipping a malformed instance entry");
                        continue;
                    }
                },
                Event::Delete(kv) => {
                    match String::from_utf8_lossy(&kv.key).parse::<InstanceKey>() {
                        Ok(key) => DiscoveryUpdate::Remove(key.id),
                        Err(e) => {
                            tracing::warn!(error = %e, "skipping the deletion of a malformed key");
                            continue;
                        }
                    }
                }
            };
            if tx.send(update).is_err() {
                return Ok(());
            }
        }
    }
}
