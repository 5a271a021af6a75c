//! `switchyard serve`: wires discovery, the shared clients, per-endpoint policies and KV
//! routers, and the HTTP front door together.
//!
//! Endpoints are found from discovery's instance records (each names its model and
//! endpoint): static workers form one endpoint; with etcd, the whole instance prefix is
//! listed every 2 seconds to learn new endpoints (each endpoint's instances are then
//! watched live by its Client). A router — Client, policy handle, KV index, event
//! subscriptions — is created as soon as its endpoint appears, so the index is warm
//! before the first request.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use tokio::net::TcpListener;

use crate::config::{DiscoveryConfig, PolicySpec, ServeConfig};
use crate::{Fleet, Gateway, GatewayConfig};
use switchyard_discovery::etcd::{EtcdDiscovery, list_all};
use switchyard_discovery::etcd_policy::{PolicyEvent, PushedPolicy, Role};
use switchyard_discovery::fixed::FixedDiscovery;
use switchyard_discovery::{Discovery, EndpointPath, InstanceInfo, etcd_policy};
use switchyard_ids::InstanceId;
use switchyard_policy::{PolicyEngine, PolicyError, PolicyHandle, PolicySource};
use switchyard_router::client::{ClientRegistry, HttpHealthCheck};
use switchyard_router::subscriber::{self, SubscriberConfig};
use switchyard_router::{KvRouter, KvRouterConfig};
use switchyard_tokens::{PrefixTokenizer, Tokenizer};

/// Longest time between two listings of the endpoints (a change to the instances prefix
/// lists them at once).
const ENDPOINT_RELIST: Duration = Duration::from_secs(30);

/// What the catalog knows about an endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
struct EndpointEntry {
    endpoint: EndpointPath,
    block_size: u32,
}

/// What tells one push from another.
type PushKey = (String, String, u64, Option<String>);

/// Pushed policies: etcd's view, and what each endpoint's router was made to run.
#[derive(Default)]
struct Pushes {
    /// The push etcd holds for each endpoint.
    desired: HashMap<EndpointPath, Arc<PushedPolicy>>,
    /// The push each endpoint was last reconciled to, applied or refused (its sha256,
    /// config, push time and signature: a new push of the same policy is a new push);
    /// absent: it runs its configured policy.
    attempted: HashMap<EndpointPath, PushKey>,
}

impl Pushes {
    /// What etcd holds for `endpoint`, and what it was last reconciled to.
    fn of(&self, endpoint: &EndpointPath) -> (Option<Arc<PushedPolicy>>, Option<PushKey>) {
        (
            self.desired.get(endpoint).cloned(),
            self.attempted.get(endpoint).cloned(),
        )
    }
}

fn push_key(p: &PushedPolicy) -> PushKey {
    (
        p.sha256.clone(),
        p.config.clone(),
        p.pushed_at,
        p.signature.clone(),
    )
}

/// The endpoints, their routers and policies.
pub struct ServeFleet {
    registry: ClientRegistry,
    engine: PolicyEngine,
    default_policy: PolicySpec,
    endpoint_policies: BTreeMap<EndpointPath, PolicySpec>,
    /// model → endpoint, replaced whole on every discovery pass.
    catalog: ArcSwap<BTreeMap<String, Vec<EndpointEntry>>>,
    /// Models that lost their last instance, and when: answered 503 (not 404) for
    /// `endpoint_grace`; then its router, Client and their tasks are released.
    gone: Mutex<HashMap<String, std::time::Instant>>,
    /// Endpoints with a router and no instances, and since when.
    idle_since: Mutex<HashMap<EndpointPath, std::time::Instant>>,
    discovered: AtomicBool,
    /// etcd's pushed policies have been listed and reconciled once (always true without
    /// etcd): a replica is ready only then, so it never serves with a policy the fleet
    /// has replaced.
    policies_listed: AtomicBool,
    /// One per endpoint with instances; an endpoint that loses them all keeps its router
    /// (answering 503) for `endpoint_grace`, then it is released.
    routers: Mutex<HashMap<EndpointPath, Arc<KvRouter>>>,
    /// Endpoints whose policy failed to load: not tried again before the instant, and the
    /// backoff that led to it (1 s doubling to a minute), so that a bad policy is not
    /// loaded again by every request on the request path.
    load_failures: Mutex<HashMap<EndpointPath, (std::time::Instant, Duration)>>,
    /// Policy loads that failed, all endpoints (`switchyard_endpoint_policy_load_failures_total`).
    load_failures_total: AtomicU64,
    /// What every endpoint's router starts from (its block size and, per endpoint,
    /// `forward_authorization` filled in).
    router_defaults: KvRouterConfig,
    /// Pushed policies as state: what etcd holds per endpoint, and what each endpoint was
    /// last reconciled to (see [`ServeFleet::reconcile`]).
    pushes: Mutex<Pushes>,
    /// Pushed shadows, the same way: what etcd holds and what each endpoint was made to run.
    shadow_pushes: Mutex<Pushes>,
    /// Serialises reconciliations.
    reconciling: Mutex<()>,
    /// How long a model whose instances are all gone is answered 503 (not 404) and its
    /// endpoint's resources kept.
    endpoint_grace: Duration,
    /// Keys whose signed pushes are applied (none: every push is).
    trusted_keys: Vec<switchyard_discovery::signing::PublicKey>,
    endpoint_forward_authorization: BTreeMap<EndpointPath, bool>,
    engine_metrics: Option<Duration>,
}

impl ServeFleet {
    fn spec_for(&self, endpoint: &EndpointPath) -> &PolicySpec {
        self.endpoint_policies
            .get(endpoint)
            .unwrap_or(&self.default_policy)
    }

    /// The router of `entry`, created (with its policy, client and subscriber) if new.
    fn ensure_router(&self, entry: &EndpointEntry) -> Result<Arc<KvRouter>, String> {
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
    fn update_catalog(&self, instances: &[InstanceInfo]) {
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
    fn release(&self, endpoint: &EndpointPath) {
        let router = self.routers.lock().remove(endpoint);
        self.registry.release(endpoint);
        self.pushes.lock().attempted.remove(endpoint);
        self.shadow_pushes.lock().attempted.remove(endpoint);
        if router.is_some() {
            tracing::info!(endpoint = %endpoint, "endpoint released: no instances for the grace period");
        }
    }

    /// Swaps `endpoint`'s policy to a `.wasm` file's bytes, after validation.
    fn swap(&self, endpoint: &EndpointPath, source: PolicySource, bytes: &[u8], config: &str) {
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
    fn apply_push_event(&self, event: PolicyEvent) {
        let listing = matches!(event, PolicyEvent::Listed(_));
        for endpoint in Self::record(&self.pushes, event) {
            self.reconcile(&endpoint);
        }
        if listing {
            self.policies_listed.store(true, Ordering::Relaxed);
        }
    }

    /// The same for pushed shadows.
    fn apply_shadow_event(&self, event: PolicyEvent) {
        for endpoint in Self::record(&self.shadow_pushes, event) {
            self.reconcile_shadow(&endpoint);
        }
    }

    /// Records an event in `pushes`; returns the endpoints it touched.
    fn record(pushes: &Mutex<Pushes>, event: PolicyEvent) -> Vec<EndpointPath> {
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
    fn reconcile_shadow(&self, endpoint: &EndpointPath) {
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
    fn reconcile(&self, endpoint: &EndpointPath) {
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

/// Static workers as instances (IDs derived from their URLs).
pub fn static_instances(
    workers: &[crate::config::StaticWorker],
    model: &str,
    block_size: u32,
    kv_events: bool,
    health_path: &str,
) -> Vec<InstanceInfo> {
    workers
        .iter()
        .map(|w| InstanceInfo {
            id: InstanceId(xxhash_rust::xxh3::xxh3_64(w.url.as_bytes())),
            endpoint: EndpointPath::for_model(model),
            url: w.url.clone(),
            model: model.to_string(),
            block_size,
            events_url: (kv_events && w.engine_events.is_none())
                .then(|| format!("{}/v1/kv_events", w.url)),
            engine_events: w.engine_events.clone().map(std::sync::Arc::new),
            health_path: health_path.to_string(),
            registration: 1,
        })
        .collect()
}

/// Why the router could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A configured policy cannot load.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The tokenizer cannot load.
    #[error(transparent)]
    Tokenizer(#[from] switchyard_tokens::TokenizerError),
    /// The chat template cannot load.
    #[error(transparent)]
    ChatTemplate(#[from] switchyard_tokens::ChatTemplateError),
    /// A KV events socket cannot be bound.
    #[error("{0}")]
    KvEvents(String),
    /// The listening socket failed.
    #[error("listening socket: {0}")]
    Io(#[from] std::io::Error),
}

/// Runs the router until `shutdown` resolves, then drains.
pub async fn serve(
    config: ServeConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let engine = PolicyEngine::new(config.runtime.clone())?;
    // Fail fast on a policy that cannot load, before serving anything.
    for spec in std::iter::once(&config.default_policy).chain(config.endpoint_policies.values()) {
        let loaded = engine.load_spec(&spec.spec, &spec.config)?;
        loaded.canary()?;
    }
    let tokenizer = Arc::new(match &config.tokenizer {
        Some(path) => Tokenizer::from_file(path)?,
        None => Tokenizer::builtin(),
    });
    let chat = switchyard_tokens::ChatFormat::resolve(
        config.chat_template.as_deref(),
        config.tokenizer.as_deref(),
    )?;
    let tokenizer = Arc::new(
        PrefixTokenizer::new(tokenizer, config.tokenizer_cache_tokens).with_chat(Arc::new(chat)),
    );
    let central_events = if config.kv_events_bind.is_empty() {
        None
    } else {
        Some(
            switchyard_router::central_events::CentralEvents::bind(&config.kv_events_bind)
                .await
                .map_err(ServeError::KvEvents)?,
        )
    };
    let (discovery, static_set): (Arc<dyn Discovery>, Option<Vec<InstanceInfo>>) =
        match &config.discovery {
            DiscoveryConfig::Etcd(etcd) => (Arc::new(EtcdDiscovery::new(etcd.clone())), None),
            DiscoveryConfig::Static {
                workers,
                model,
                block_size,
                kv_events,
                health_path,
            } => {
                let set = static_instances(workers, model, *block_size, *kv_events, health_path);
                (Arc::new(FixedDiscovery::new(set.clone())), Some(set))
            }
        };
    let fleet = Arc::new(ServeFleet {
        registry: ClientRegistry::new(
            discovery,
            Arc::new(HttpHealthCheck::with_tls(
                Duration::from_secs(2),
                &config.gateway.tls,
            )),
            config.client.clone(),
        ),
        engine: engine.clone(),
        default_policy: config.default_policy.clone(),
        endpoint_policies: config.endpoint_policies.clone(),
        catalog: ArcSwap::from_pointee(BTreeMap::new()),
        gone: Mutex::new(HashMap::new()),
        idle_since: Mutex::new(HashMap::new()),
        discovered: AtomicBool::new(false),
        policies_listed: AtomicBool::new(!matches!(config.discovery, DiscoveryConfig::Etcd(_))),
        routers: Mutex::new(HashMap::new()),
        load_failures: Mutex::new(HashMap::new()),
        load_failures_total: AtomicU64::new(0),
        router_defaults: KvRouterConfig {
            approximate: config.approximate,
            tls: config.gateway.tls.clone(),
            central_events,
            forward_authorization: config.forward_authorization,
            // Three missed scrapes before a worker's report stops counting.
            report_ttl: config
                .engine_metrics
                .map_or(switchyard_kv::load::REPORT_TTL, |every| {
                    (every * 3).max(switchyard_kv::load::REPORT_TTL)
                }),
            hash_seed: config.kv_hash_key,
            ..KvRouterConfig::new(16)
        },
        endpoint_forward_authorization: config.endpoint_forward_authorization.clone(),
        engine_metrics: config.engine_metrics,
        pushes: Mutex::new(Pushes::default()),
        shadow_pushes: Mutex::new(Pushes::default()),
        reconciling: Mutex::new(()),
        endpoint_grace: config.endpoint_grace,
        trusted_keys: config.policy_trusted_keys.clone(),
    });
    let mut background = Vec::new();
    match (&config.discovery, static_set) {
        (_, Some(set)) => fleet.update_catalog(&set),
        (DiscoveryConfig::Etcd(etcd), None) => {
            let (fleet2, etcd2) = (fleet.clone(), etcd.clone());
            // Endpoints are listed again as soon as the instances prefix changes (one
            // watch on it), and every 30 s in any case.
            let changed = Arc::new(tokio::sync::Notify::new());
            background.push(switchyard_discovery::etcd::watch_changes(
                etcd.clone(),
                changed.clone(),
            ));
            background.push(tokio::spawn(async move {
                loop {
                    match list_all(&etcd2).await {
                        Ok((found, _)) => {
                            // A new endpoint compiles its policy: CPU work, off the async workers.
                            let fleet = fleet2.clone();
                            let _ = tokio::task::spawn_blocking(move || fleet.update_catalog(&found)).await;
                        }
                        Err(e) => tracing::warn!(error = %e, "cannot list endpoints; keeping the last known"),
                    }
                    // A short grace needs listings at least that often to release on time.
                    let relist = ENDPOINT_RELIST.min(fleet2.endpoint_grace.max(Duration::from_secs(1)));
                    tokio::select! {
                        _ = changed.notified() => {}
                        _ = tokio::time::sleep(relist) => {}
                    }
                }
            }));
            // Pushed policies are state: every event updates what etcd holds, and the
            // endpoints it touched are reconciled in order, off the async workers.
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            let shadows = tx.clone();
            let trusted = config.policy_trusted_keys.clone();
            background.push(etcd_policy::watch(
                etcd.clone(),
                Role::Live,
                trusted.clone(),
                move |event| {
                    let _ = tx.send((Role::Live, event));
                },
            ));
            background.push(etcd_policy::watch(
                etcd.clone(),
                Role::Shadow,
                trusted,
                move |event| {
                    let _ = shadows.send((Role::Shadow, event));
                },
            ));
            let fleet3 = fleet.clone();
            background.push(tokio::spawn(async move {
                while let Some((role, event)) = rx.recv().await {
                    let fleet = fleet3.clone();
                    let _ = tokio::task::spawn_blocking(move || match role {
                        Role::Live => fleet.apply_push_event(event),
                        Role::Shadow => fleet.apply_shadow_event(event),
                    })
                    .await;
                }
            }));
        }
        (DiscoveryConfig::Static { .. }, None) => unreachable!("static discovery always has a set"),
    }
    if config.watch {
        background.push(watch_policy_files(fleet.clone(), &config));
    }
    let admin =
        match config.admin_listen {
            Some(addr) => Some(TcpListener::bind(addr).await.map_err(|e| {
                std::io::Error::new(e.kind(), format!("admin listener {addr}: {e}"))
            })?),
            None => None,
        };
    let gateway_config = GatewayConfig {
        admin_listener: admin.is_some(),
        ..config.gateway.clone()
    };
    let gateway = Gateway::new(gateway_config, fleet, tokenizer);
    let addr = listener.local_addr()?;
    tracing::info!(%addr, "serving");
    let (stop, stopped) = tokio::sync::watch::channel(false);
    if let Some(admin) = admin {
        tracing::info!(addr = %admin.local_addr()?, "serving the admin API");
        let mut stopped = stopped.clone();
        background.push(tokio::spawn(crate::run(
            gateway.clone(),
            admin,
            crate::Listener::Admin,
            async move {
                let _ = stopped.wait_for(|s| *s).await;
            },
            config.shutdown_grace,
        )));
    }
    crate::run(
        gateway,
        listener,
        crate::Listener::Public,
        async move {
            shutdown.await;
            let _ = stop.send(true);
        },
        config.shutdown_grace,
    )
    .await;
    for task in background {
        task.abort();
    }
    Ok(())
}

/// Polls the `.wasm` files of file-based policies once a second and swaps the endpoints
/// using them when a file changes (a refused file leaves the current policy in place).
fn watch_policy_files(fleet: Arc<ServeFleet>, config: &ServeConfig) -> tokio::task::JoinHandle<()> {
    let mut files: Vec<(std::path::PathBuf, String, Option<EndpointPath>)> = Vec::new();
    let is_file = |spec: &str| switchyard_policy::builtin(spec).is_none();
    if is_file(&config.default_policy.spec) {
        files.push((
            config.default_policy.spec.clone().into(),
            config.default_policy.config.clone(),
            None,
        ));
    }
    for (ep, spec) in &config.endpoint_policies {
        if is_file(&spec.spec) {
            files.push((
                spec.spec.clone().into(),
                spec.config.clone(),
                Some(ep.clone()),
            ));
        }
    }
    tokio::spawn(async move {
        let modified = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        let mut last: Vec<_> = files.iter().map(|(p, _, _)| modified(p)).collect();
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            for (i, (path, cfg, endpoint)) in files.iter().enumerate() {
                let now = modified(path);
                if now == last[i] {
                    continue;
                }
                last[i] = now;
                let Ok(bytes) = std::fs::read(path) else {
                    continue;
                };
                tracing::info!(path = %path.display(), "policy file changed; reloading");
                let targets: Vec<EndpointPath> = match endpoint {
                    Some(ep) => vec![ep.clone()],
                    None => fleet
                        .routers()
                        .iter()
                        .map(|r| r.endpoint().clone())
                        .filter(|ep| !fleet.endpoint_policies.contains_key(ep))
                        .collect(),
                };
                for ep in targets {
                    let (fleet, bytes, cfg, path) =
                        (fleet.clone(), bytes.clone(), cfg.clone(), path.clone());
                    let _ = tokio::task::spawn_blocking(move || {
                        fleet.swap(&ep, PolicySource::File(path), &bytes, &cfg)
                    })
                    .await;
                }
            }
        }
    })
}
