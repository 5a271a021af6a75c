//! Registering a worker instance in etcd: grant a lease, put the instance's key bound to
//! it, keep it alive at TTL/3 — a keep-alive that fails (etcd slow, a connection reset)
//! is retried on the *same* lease, sooner, until etcd says the lease is gone, because
//! routers take a new lease for a new registration (an ejected worker would come back
//! unprobed, its failure memory wiped) — register again if the lease is lost, revoke it on a
//! graceful stop (so the instance disappears at once instead of after the TTL). Before
//! revoking, the record is rewritten with `draining: true`: a deletion alone looks the
//! same as a lease that expired, which routers do not believe at once.

use std::time::Duration;

use tokio::sync::{oneshot, watch};

use super::etcd::EtcdConfig;
use super::{DiscoveryError, InstanceInfo, InstanceKey, InstanceRecord};

/// A live registration. Dropping it without [`Registration::stop`] leaves the key to
/// expire with its lease (as a crash would).
pub struct Registration {
    key: String,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    lease: watch::Receiver<Option<i64>>,
}

enum SessionEnd {
    Stopped,
    LeaseLost,
}

impl Registration {
    /// Starts registering `info` under `config.root` with a lease of `ttl` (at least 2 s).
    /// Returns at once; see [`Registration::wait_registered`].
    pub fn start(config: EtcdConfig, info: &InstanceInfo, ttl: Duration) -> Registration {
        let key = InstanceKey {
            root: config.root.clone(),
            endpoint: info.endpoint.clone(),
            id: info.id,
        }
        .to_string();
        let record = InstanceRecord::from_info(info);
        let value = serde_json::to_string(&record).expect("records serialise");
        let draining = serde_json::to_string(&InstanceRecord {
            draining: true,
            ..record
        })
        .expect("records serialise");
        let values = (value, draining);
        let ttl = ttl.max(Duration::from_secs(2));
        let (stop_tx, mut stop_rx) = oneshot::channel();
        let (lease_tx, lease_rx) = watch::channel(None);
        let task_key = key.clone();
        let task = tokio::spawn(async move {
            let mut delay = config.backoff_initial;
            loop {
                match session(&config, &task_key, &values, ttl, &mut stop_rx, &lease_tx).await {
                    Ok(SessionEnd::Stopped) => return,
                    Ok(SessionEnd::LeaseLost) => {
                        tracing::warn!(key = %task_key, "registration lease lost; registering again");
                        delay = config.backoff_initial;
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(key = %task_key, error = %e, retry_in = ?delay, "registration interrupted");
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = &mut stop_rx => return,
                }
                // A worker without a registration gets no traffic once its old lease
                // expires: retry at least once a second, so it is back as soon as etcd is.
                delay = (delay * 2).min(config.backoff_max.min(Duration::from_secs(1)));
            }
        });
        Registration {
            key,
            stop: Some(stop_tx),
            task,
            lease: lease_rx,
        }
    }

    /// The etcd key this registration writes.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The current lease, if registered.
    pub fn lease(&self) -> Option<i64> {
        *self.lease.borrow()
    }

    /// Waits until the key is written (or `limit` passes).
    pub async fn wait_registered(&mut self, limit: Duration) -> Result<i64, DiscoveryError> {
        let wait = self.lease.wait_for(|l| l.is_some());
        match tokio::time::timeout(limit, wait).await {
            Ok(Ok(lease)) => Ok(lease.expect("waited for Some")),
            _ => Err(DiscoveryError::Etcd {
                endpoints: String::new(),
                why: format!("not registered within {limit:?}"),
            }),
        }
    }

    /// Revokes the lease (the key disappears at once) and ends the keep-alive task.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if self.stop.is_some() {
            self.task.abort();
        }
    }
}

async fn session(
    config: &EtcdConfig,
    key: &str,
    (value, draining): &(String, String),
    ttl: Duration,
    stop: &mut oneshot::Receiver<()>,
    lease_tx: &watch::Sender<Option<i64>>,
) -> Result<SessionEnd, DiscoveryError> {
    let etcd = config.api();
    let lease = etcd.lease_grant(ttl.as_secs() as i64).await?;
    etcd.put(key, value.as_bytes(), Some(lease)).await?;
    lease_tx.send_replace(Some(lease));
    tracing::info!(key, lease, ttl = ?ttl, "registered");
    let period = ttl / 3;
    let mut next = tokio::time::Instant::now() + period;
    // Retries of a failed keep-alive: from the first reconnect delay up to a second,
    // never past the regular period.
    let mut retry = config.backoff_initial;
    let mut failures = 0u32;
    loop {
        tokio::select! {
            _ = &mut *stop => {
                if etcd.put(key, draining.as_bytes(), Some(lease)).await.is_err() {
                    tracing::warn!(key, "could not mark the registration draining");
                }
                let revoked = etcd.lease_revoke(lease).await;
                lease_tx.send_replace(None);
                match revoked {
                    Ok(()) => tracing::info!(key, lease, "registration revoked"),
                    Err(_) => tracing::warn!(key, lease, "could not revoke the lease; the key expires with it"),
                }
                return Ok(SessionEnd::Stopped);
            }
            _ = tokio::time::sleep_until(next) => match etcd.lease_keep_alive(lease).await {
                Ok(left) if left <= 0 => {
                    lease_tx.send_replace(None);
                    return Ok(SessionEnd::LeaseLost);
                }
                Ok(_) => {
                    if failures > 0 {
                        tracing::info!(key, lease, failures, "lease kept alive again");
                    }
                    (failures, retry) = (0, config.backoff_initial);
                    next = tokio::time::Instant::now() + period;
                }
                Err(e) => {
                    failures += 1;
                    if failures <= 3 || failures.is_multiple_of(100) {
                        tracing::warn!(key, lease, failures, error = %e, retry_in = ?retry.min(period), "lease keep-alive failed; retrying the same lease");
                    }
                    next = tokio::time::Instant::now() + retry.min(period);
                    retry = (retry * 2).min(Duration::from_secs(1));
                }
            },
        }
    }
}
