//! Re-admission: probes of ejected instances, holds of instances discovery removed, and
//! active health checks.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use switchyard_discovery::InstanceInfo;
use switchyard_ids::InstanceId;

use super::{Availability, Client, DownKind, HealthError};

impl Client {
    /// The instance's info if it is still down under `registration` (else probing stops).
    pub(super) fn still_down(
        &self,
        id: InstanceId,
        registration: u64,
    ) -> Option<Arc<InstanceInfo>> {
        let snap = self.current.load();
        let state = snap.instances.get(&id)?;
        (state.info.registration == registration && state.availability != Availability::Available)
            .then(|| state.info.clone())
    }

    pub(super) fn probe_result(
        &self,
        id: InstanceId,
        registration: u64,
        result: Result<(), String>,
    ) -> bool {
        let mut readmitted = false;
        self.write(|instances, tasks| {
            let Some(state) = instances.get_mut(&id) else {
                return;
            };
            if state.info.registration != registration {
                return;
            }
            match (&result, &mut state.availability) {
                (Ok(()), Availability::Down { .. }) => {
                    state.availability = Availability::Available;
                    state.health.readmitted(Instant::now());
                    tasks.remove(&id);
                    readmitted = true;
                    self.counters
                        .readmitted_by_probe
                        .fetch_add(1, Ordering::Relaxed);
                }
                (Err(_), Availability::Down { failed_probes, .. }) => {
                    *failed_probes += 1;
                    self.counters.failed_probes.fetch_add(1, Ordering::Relaxed);
                }
                _ => {}
            }
        });
        match result {
            Ok(()) if readmitted => {
                tracing::info!(endpoint = %self.endpoint, instance = %id, "instance healthy again; available on probation");
            }
            Err(e) => {
                tracing::debug!(endpoint = %self.endpoint, instance = %id, error = %e, "health probe failed");
            }
            _ => {}
        }
        readmitted
    }

    /// Ends the hold of an instance discovery removed (grace over, or it did not answer).
    pub(super) fn end_hold(&self, id: InstanceId, registration: u64, why: &str) {
        let mut removed = false;
        self.write(|instances, tasks| {
            if instances
                .get(&id)
                .is_some_and(|s| s.held_until.is_some() && s.info.registration == registration)
            {
                instances.remove(&id);
                tasks.remove(&id);
                removed = true;
            }
        });
        if removed {
            tracing::info!(endpoint = %self.endpoint, instance = %id, why, "held instance removed");
        }
    }

    /// One round of active health checks over the available instances, concurrently.
    async fn check_available(self: &Arc<Self>) {
        let snap = self.current.load_full();
        let mut handles = Vec::new();
        for (&id, s) in &snap.instances {
            if s.availability != Availability::Available {
                continue;
            }
            let (me, info, health) = (self.clone(), s.info.clone(), s.health.clone());
            let held = s.held_until.is_some();
            handles.push(tokio::spawn(async move {
                match me.health.check(&info).await {
                    Ok(()) => health.passed_check(),
                    Err(HealthError::Local(e)) => {
                        tracing::warn!(instance = %id, error = %e, "health check not made");
                    }
                    Err(HealthError::Unhealthy(e)) if held => {
                        me.end_hold(id, info.registration, &e)
                    }
                    Err(HealthError::Unhealthy(e)) => {
                        if health.failed_check(&me.config.outlier) {
                            let reason = format!("health check failed: {e}");
                            me.eject(id, &reason, DownKind::Unhealthy);
                        }
                    }
                }
            }));
        }
        for h in handles {
            let _ = h.await;
        }
    }
}

/// Probes an ejected instance, after its ejection time, until it is healthy,
/// re-registered or gone.
pub(super) async fn probe(
    client: Weak<Client>,
    id: InstanceId,
    registration: u64,
    ejected_for: Duration,
) {
    let Some(mut delay) = client.upgrade().map(|c| c.config.probe_initial) else {
        return;
    };
    tokio::time::sleep(ejected_for).await;
    loop {
        let Some(c) = client.upgrade() else { return };
        let Some(info) = c.still_down(id, registration) else {
            return;
        };
        let result = match c.health.check(&info).await {
            Ok(()) => Some(Ok(())),
            Err(HealthError::Unhealthy(e)) => Some(Err(e)),
            // No verdict: the router itself is out of resources.
            Err(HealthError::Local(_)) => None,
        };
        if let Some(result) = result
            && c.probe_result(id, registration, result)
        {
            return;
        }
        drop(c);
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(
            client
                .upgrade()
                .map_or(Duration::from_secs(30), |c| c.config.probe_max),
        );
    }
}

/// Holds an instance that discovery removed while it served: one health probe now (a
/// worker that does not answer leaves at once), then removal when the grace ends.
pub(super) async fn hold(client: Weak<Client>, id: InstanceId, registration: u64, grace: Duration) {
    let Some(c) = client.upgrade() else { return };
    let Some(info) = c.instance(id) else { return };
    if let Err(HealthError::Unhealthy(e)) = c.health.check(&info).await {
        c.end_hold(id, registration, &format!("does not answer: {e}"));
        return;
    }
    drop(c);
    tokio::time::sleep(grace).await;
    if let Some(c) = client.upgrade() {
        c.end_hold(id, registration, "grace period over");
    }
}

/// Checks every available instance each `every`, so that a hung worker leaves before
/// requests time out on it. Ends with the client.
pub(super) async fn active_checks(client: Weak<Client>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(c) = client.upgrade() else { return };
        c.check_available().await;
    }
}
