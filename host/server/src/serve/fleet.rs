//! `ServeFleet`: the endpoints, their routers and policies, made as discovery finds them
//! and released when their instances have been gone for the grace period.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use crate::Fleet;
use crate::config::PolicySpec;
use switchyard_discovery::{EndpointPath, InstanceInfo};
use switchyard_policy::{PolicyEngine, PolicyHandle};
use switchyard_router::client::ClientRegistry;
use switchyard_router::subscriber::{self, SubscriberConfig};
use switchyard_router::{KvRouter, KvRouterConfig};

use super::EndpointEntry;
use super::Pushes;

/// The endpoints, their routers and policies.
pub struct ServeFleet {
    pub(super) registry: ClientRegistry,
    pub(super) engine: PolicyEngine,
    pub(super) default_policy: PolicySpec,
    pub(super) endpoint_policies: BTreeMap<EndpointPath, PolicySpec>,
    /// model → endpoint, replaced whole on every discovery pass.
    pub(super) catalog: ArcSwap<BTreeMap<String, Vec<EndpointEntry>>>,
    /// Models that lost their last instance, and when: answered 503 (not 404) for
    /// `endpoint_grace`; then its router, Client and their tasks are released.
    pub(super) gone: Mutex<HashMap<String, std::time::Instant>>,
    /// Endpoints with a router and no instances, and since when.
    pub(super) idle_since: Mutex<HashMap<EndpointPath, std::time::Instant>>,
    pub(super) discovered: AtomicBool,
    /// etcd's pushed policies have been listed and reconciled once (always true without
    /// etcd): a replica is ready only then, so it never serves with a policy the fleet
    /// has replaced.
    pub(super) policies_listed: AtomicBool,
    /// One per endpoint with instances; an endpoint that loses them all keeps its router
    /// (answering 503) for `endpoint_grace`, then it is released.
    pub(super) routers: Mutex<HashMap<EndpointPath, Arc<KvRouter>>>,
    /// Endpoints whose policy failed to load: not tried again before the instant, and the
    /// backoff that led to it (1 s doubling to a minute), so that a bad policy is not
    /// loaded again by every request on the request path.
    pub(super) load_failures: Mutex<HashMap<EndpointPath, (std::time::Instant, Duration)>>,
    /// Policy loads that failed, all endpoints (`switchyard_endpoint_policy_load_failures_total`).
    pub(super) load_failures_total: AtomicU64,
    /// What every endpoint's router starts from (its block size and, per endpoint,
    /// `forward_authorization` filled in).
    pub(super) router_defaults: KvRouterConfig,
    /// Pushed policies as state: what etcd holds per endpoint, and what each endpoint was
    /// last reconciled to (see [`ServeFleet::reconcile`]).
    pub(super) pushes: Mutex<Pushes>,
    /// Pushed shadows, the same way: what etcd holds and what each endpoint was made to run.
    pub(super) shadow_pushes: Mutex<Pushes>,
    /// Serialises reconciliations.
    pub(super) reconciling: Mutex<()>,
    /// How long a model whose instances are all gone is answered 503 (not 404) and its
    /// endpoint's resources kept.
    pub(super) endpoint_grace: Duration,
    /// Keys whose signed pushes are applied (none: every push is).
    pub(super) trusted_keys: Vec<switchyard_discovery::signing::PublicKey>,
    pub(super) endpoint_forward_authorization: BTreeMap<EndpointPath, bool>,
    pub(super) engine_metrics: Option<Duration>,
}

impl ServeFleet {
    pub(super) fn spec_for(&self, endpoint: &EndpointPath) -> &PolicySpec {
        self.endpoint_policies
            .get(endpoint)
            .unwrap_or(&self.default_policy)
    }

    /// The router of `entry`, created (with its policy, client and subscriber) if new.
    pub(super) fn ensure_router(&self, entry: &EndpointEntry) -> Result<Arc<KvRouter>, String> {
        if let Some(r) = self.routers.lock().get(&entry.endpoint) {
            return Ok(r.clone());
        }
        if let Some((until, _)) = self.load_failures.lock().get(&entry.endpoint)
            && std::time::Instant::now() < *until
        {
            return Err("its policy failed to load; tried again after a backoff".into());
        }
        let spec = self.spec_for(&entry.endpoint).clone();
        let made = self
            .engine
            .load_spec(&spec.spec, &spec.config)
            .and_then(|loaded| PolicyHandle::new(self.engine.clone(), loaded));
        let handle = match made {
            Ok(h) => {
                self.load_failures.lock().remove(&entry.endpoint);
                Arc::new(h)
            }
            Err(e) => {
                self.load_failures_total.fetch_add(1, Ordering::Relaxed);
                let mut failures = self.load_failures.lock();
                let backoff = failures
                    .get(&entry.endpoint)
                    .map_or(Duration::from_secs(1), |(_, b)| {
                        (*b * 2).min(Duration::from_secs(60))
                    });
                failures.insert(
                    entry.endpoint.clone(),
                    (std::time::Instant::now() + backoff, backoff),
                );
                return Err(format!("{e} (tried again in {backoff:?})"));
            }
        };
        let client = self.registry.client(&entry.endpoint);
        let mut routers = self.routers.lock();
        // Racing: another task may have created it while the policy loaded.
        if let Some(r) = routers.get(&entry.endpoint) {
            return Ok(r.clone());
        }
        let router = Arc::new(KvRouter::new(
            client,
            handle,
            KvRouterConfig {
                block_size: entry.block_size,
                forward_authorization: self
                    .endpoint_forward_authorization
                    .get(&entry.endpoint)
                    .copied()
                    .unwrap_or(self.router_defaults.forward_authorization),
                ..self.router_defaults.clone()
            },
        ));
        subscriber::spawn(&router, SubscriberConfig::default());
        if let Some(every) = self.engine_metrics {
            switchyard_router::metrics_scraper::spawn(&router, every);
        }
        tracing::info!(endpoint = %entry.endpoint, policy = %spec.spec, block_size = entry.block_size, "endpoint ready");
        routers.insert(entry.endpoint.clone(), router.clone());
        Ok(router)
    }

    /// Replaces the catalog from a full list of instances and creates new routers. A
    /// model may be served by several endpoints (e.g. two deployments): each gets its
    /// router, and a request goes to the one with the most available workers. An
    /// endpoint missing from the list stays while its Client still holds instances (e.g.
    /// ones held after a mass lease expiry); a model with none left is remembered as
    /// gone (503), and an endpoint without instances for the grace period is released.
    pub(super) fn update_catalog(&self, instances: &[InstanceInfo]) {
        let mut catalog: BTreeMap<String, Vec<EndpointEntry>> = BTreeMap::new();
        for i in instances {
            let entries = catalog.entry(i.model.clone()).or_default();
            if !entries.iter().any(|e| e.endpoint == i.endpoint) {
                entries.push(EndpointEntry {
                    endpoint: i.endpoint.clone(),
                    block_size: i.block_size,
                });
            }
        }
        let old = self.catalog.load_full();
        for (model, entries) in old.iter() {
            for entry in entries {
                let listed = catalog
                    .get(model)
                    .is_some_and(|es| es.iter().any(|e| e.endpoint == entry.endpoint));
                let holds = self
                    .routers
                    .lock()
                    .get(&entry.endpoint)
                    .is_some_and(|r| !r.client().snapshot().instances.is_empty());
                if !listed && holds {
                    catalog
                        .entry(model.clone())
                        .or_default()
                        .push(entry.clone());
                }
            }
        }
        for entries in catalog.values_mut() {
            entries.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
        }
        {
            let mut gone = self.gone.lock();
            for model in old.keys() {
                if !catalog.contains_key(model) && !gone.contains_key(model) {
                    tracing::warn!(model, "the model has no instances left; answering 503");
                    gone.insert(model.clone(), std::time::Instant::now());
                }
            }
            for model in catalog.keys() {
                gone.remove(model);
            }
            gone.retain(|_, at| at.elapsed() < self.endpoint_grace);
        }
        // Endpoints with a router but no place in the catalog: released after the grace.
        let serving: std::collections::HashSet<EndpointPath> = catalog
            .values()
            .flatten()
            .map(|e| e.endpoint.clone())
            .collect();
        let idle: Vec<EndpointPath> = self
            .routers
            .lock()
            .keys()
            .filter(|e| !serving.contains(*e))
            .cloned()
            .collect();
        {
            let mut since = self.idle_since.lock();
            since.retain(|e, _| idle.contains(e));
            for endpoint in idle {
                let at = *since
                    .entry(endpoint.clone())
                    .or_insert_with(std::time::Instant::now);
                if at.elapsed() >= self.endpoint_grace {
                    since.remove(&endpoint);
                    self.release(&endpoint);
                }
            }
        }
        for entry in catalog.values().flatten() {
            if let Err(e) = self.ensure_router(entry) {
                tracing::error!(endpoint = %entry.endpoint, error = %e, "cannot set up the endpoint's policy");
            }
            // A push stored before the endpoint's first instance applies now.
            self.reconcile(&entry.endpoint);
            self.reconcile_shadow(&entry.endpoint);
        }
        self.catalog.store(Arc::new(catalog));
        self.discovered.store(true, Ordering::Relaxed);
    }

    /// Lets go of an endpoint whose instances have been gone for the grace period: its
    /// router (with its policy, index and metrics series), its Client (discovery watch,
    /// probes) and the event subscriptions, which end with them. If the endpoint comes
    /// back it is set up anew (and its push applied again).
    pub(super) fn release(&self, endpoint: &EndpointPath) {
        let router = self.routers.lock().remove(endpoint);
        self.registry.release(endpoint);
        self.pushes.lock().attempted.remove(endpoint);
        self.shadow_pushes.lock().attempted.remove(endpoint);
        if router.is_some() {
            tracing::info!(endpoint = %endpoint, "endpoint released: no instances for the grace period");
        }
    }
}

impl Fleet for ServeFleet {
    /// The router of the model's endpoint with the most available workers; on a tie, the
    /// one with fewer requests in flight per available worker (so two equal deployments
    /// share the traffic), then the first by endpoint path.
    fn router_for_model(&self, model: &str) -> Option<Arc<KvRouter>> {
        let entries = self.catalog.load().get(model).cloned()?;
        if let [only] = entries.as_slice() {
            return self.ensure_router(only).ok();
        }
        // (available workers, fewer in flight) and the router.
        type Score = (usize, std::cmp::Reverse<u64>);
        let mut best: Option<(Score, Arc<KvRouter>)> = None;
        for entry in &entries {
            let Ok(router) = self.ensure_router(entry) else {
                continue;
            };
            let available = router.client().available();
            let in_flight: u64 = available
                .iter()
                .map(|id| u64::from(router.load_of(*id).in_flight))
                .sum();
            let score = (available.len(), std::cmp::Reverse(in_flight));
            if best.as_ref().is_none_or(|(b, _)| score > *b) {
                best = Some((score, router));
            }
        }
        best.map(|(_, r)| r)
    }

    fn router(&self, endpoint: &EndpointPath) -> Option<Arc<KvRouter>> {
        self.routers.lock().get(endpoint).cloned()
    }

    fn routers(&self) -> Vec<Arc<KvRouter>> {
        let mut v: Vec<_> = self.routers.lock().values().cloned().collect();
        v.sort_by(|a, b| a.endpoint().cmp(b.endpoint()));
        v
    }

    fn models(&self) -> Vec<(String, EndpointPath)> {
        self.catalog
            .load()
            .iter()
            .filter_map(|(m, es)| Some((m.clone(), es.first()?.endpoint.clone())))
            .collect()
    }

    fn discovered(&self) -> bool {
        self.discovered.load(Ordering::Relaxed) && self.policies_listed.load(Ordering::Relaxed)
    }

    fn model_known(&self, model: &str) -> bool {
        self.gone
            .lock()
            .get(model)
            .is_some_and(|at| at.elapsed() < self.endpoint_grace)
    }

    fn counters(&self) -> Vec<(&'static str, &'static str, u64)> {
        vec![(
            "endpoint_policy_load_failures",
            "Loads of an endpoint's policy that failed (each endpoint tried again after a backoff of 1 s doubling to a minute, never by every request)",
            self.load_failures_total.load(Ordering::Relaxed),
        )]
    }
}
