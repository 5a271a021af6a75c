//! Policies pushed through etcd (live and shadow), reconciled one endpoint at a time.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use parking_lot::Mutex;

use switchyard_discovery::EndpointPath;
use switchyard_discovery::etcd_policy::PolicyEvent;
use switchyard_policy::{PolicyError, PolicySource};

use super::fleet::ServeFleet;
use super::{Pushes, push_key};

impl ServeFleet {
    /// Swaps `endpoint`'s policy to a `.wasm` file's bytes, after validation.
    pub(super) fn swap(
        &self,
        endpoint: &EndpointPath,
        source: PolicySource,
        bytes: &[u8],
        config: &str,
    ) {
        let Some(router) = self.routers.lock().get(endpoint).cloned() else {
            return;
        };
        match router.policy().swap_bytes(source, bytes, config) {
            Ok(s) => {
                tracing::info!(endpoint = %endpoint, policy = %s.info.name, sha256 = %s.info.sha256, "policy swapped")
            }
            Err(e) => {
                tracing::error!(endpoint = %endpoint, error = %e, "policy file refused; the current one keeps serving")
            }
        }
    }

    /// Applies what etcd says about pushed policies, then reconciles the endpoints it
    /// touched.
    pub(super) fn apply_push_event(&self, event: PolicyEvent) {
        let listing = matches!(event, PolicyEvent::Listed(_));
        for endpoint in Self::record(&self.pushes, event) {
            self.reconcile(&endpoint);
        }
        if listing {
            self.policies_listed.store(true, Ordering::Relaxed);
        }
    }

    /// The same for pushed shadows.
    pub(super) fn apply_shadow_event(&self, event: PolicyEvent) {
        for endpoint in Self::record(&self.shadow_pushes, event) {
            self.reconcile_shadow(&endpoint);
        }
    }

    /// Records an event in `pushes`; returns the endpoints it touched.
    pub(super) fn record(pushes: &Mutex<Pushes>, event: PolicyEvent) -> Vec<EndpointPath> {
        {
            let mut pushes = pushes.lock();
            match event {
                PolicyEvent::Put(endpoint, policy) => {
                    pushes.desired.insert(endpoint.clone(), Arc::new(policy));
                    vec![endpoint]
                }
                PolicyEvent::Delete(endpoint) => {
                    pushes.desired.remove(&endpoint);
                    vec![endpoint]
                }
                PolicyEvent::Listed(listed) => {
                    let gone: Vec<EndpointPath> = pushes
                        .desired
                        .keys()
                        .filter(|e| !listed.contains(e))
                        .cloned()
                        .collect();
                    for e in &gone {
                        pushes.desired.remove(e);
                    }
                    gone
                }
            }
        }
    }

    /// Makes `endpoint`'s shadow what etcd holds for it: the pushed shadow (verified and
    /// validated like a live push) or none. Only a shadow etcd put there is removed when
    /// etcd's goes (one attached through the admin API is the operator's).
    pub(super) fn reconcile_shadow(&self, endpoint: &EndpointPath) {
        let Some(router) = self.routers.lock().get(endpoint).cloned() else {
            return;
        };
        let _turn = self.reconciling.lock();
        let (desired, attempted) = self.shadow_pushes.lock().of(endpoint);
        let handle = router.policy();
        let Some(pushed) = desired else {
            if attempted.is_some() {
                self.shadow_pushes.lock().attempted.remove(endpoint);
                if router.detach_shadow().is_some() {
                    tracing::info!(endpoint = %endpoint, "pushed shadow deleted: shadow removed");
                }
            }
            return;
        };
        let key = push_key(&pushed);
        if attempted.as_ref() == Some(&key) {
            return;
        }
        self.shadow_pushes
            .lock()
            .attempted
            .insert(endpoint.clone(), key);
        let verified = match pushed.sample {
            None => Err("a live push stored as a shadow".to_string()),
            Some(_) => pushed.verify(endpoint, &self.trusted_keys),
        };
        let result = verified
            .map_err(PolicyError::Unsigned)
            .and_then(|()| pushed.wasm().map_err(PolicyError::NotAComponent))
            .and_then(|bytes| {
                self.engine.load(
                    PolicySource::Uploaded("etcd (shadow)".into()),
                    &bytes,
                    &pushed.config,
                )
            })
            .inspect_err(|e| handle.refused(e))
            .and_then(|loaded| router.attach_shadow(loaded, pushed.sample.unwrap_or(1.0)));
        match result {
            Ok(s) => {
                tracing::info!(endpoint = %endpoint, shadow = %s.info.name, sha256 = %s.info.sha256, "pushed shadow attached")
            }
            Err(e) => {
                tracing::error!(endpoint = %endpoint, error = %e, "pushed shadow refused; nothing changed")
            }
        }
    }

    /// Makes `endpoint`'s router run what etcd holds for it: the pushed policy (verified
    /// against the trusted keys, validated like any swap), or its configured policy when
    /// etcd holds none. A push already applied (or refused) is not tried again; an
    /// endpoint with no router yet is reconciled when its router is made.
    pub(super) fn reconcile(&self, endpoint: &EndpointPath) {
        let Some(router) = self.routers.lock().get(endpoint).cloned() else {
            return;
        };
        // One reconciliation at a time per fleet (they compile).
        let _turn = self.reconciling.lock();
        let (desired, attempted) = self.pushes.lock().of(endpoint);
        let handle = router.policy();
        match desired {
            Some(pushed) => {
                let key = push_key(&pushed);
                if attempted.as_ref() == Some(&key) {
                    return;
                }
                self.pushes.lock().attempted.insert(endpoint.clone(), key);
                let verified = if pushed.sample.is_some() {
                    Err("a shadow push stored as the live policy".to_string())
                } else {
                    pushed.verify(endpoint, &self.trusted_keys)
                };
                if let Err(why) = verified {
                    let error = PolicyError::Unsigned(why);
                    tracing::error!(endpoint = %endpoint, error = %error, "pushed policy refused; the current one keeps serving");
                    handle.refused(&error);
                    return;
                }
                let result = pushed
                    .wasm()
                    .map_err(PolicyError::NotAComponent)
                    .inspect_err(|e| handle.refused(e))
                    .and_then(|bytes| {
                        handle.swap_bytes(
                            PolicySource::Uploaded("etcd".into()),
                            &bytes,
                            &pushed.config,
                        )
                    });
                match result {
                    Ok(s) => {
                        tracing::info!(endpoint = %endpoint, policy = %s.info.name, sha256 = %s.info.sha256, "pushed policy applied")
                    }
                    Err(e) => {
                        tracing::error!(endpoint = %endpoint, error = %e, "pushed policy refused; the current one keeps serving")
                    }
                }
            }
            None => {
                if attempted.is_none() {
                    return;
                }
                self.pushes.lock().attempted.remove(endpoint);
                let spec = self.spec_for(endpoint);
                match handle.swap_spec(&spec.spec, &spec.config) {
                    Ok(_) => {
                        tracing::info!(endpoint = %endpoint, policy = %spec.spec, "push deleted: back to the configured policy")
                    }
                    Err(e) => {
                        tracing::error!(endpoint = %endpoint, error = %e, "push deleted, but the configured policy was refused; the current one keeps serving")
                    }
                }
            }
        }
    }
}
