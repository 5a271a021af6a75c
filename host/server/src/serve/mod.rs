//! `switchyard serve`: wires discovery, the shared clients, per-endpoint policies and KV
//! routers, and the HTTP front door together.
//!
//! Endpoints are found from discovery's instance records (each names its model and
//! endpoint): static workers form one endpoint; with etcd, the whole instance prefix is
//! listed every 2 seconds to learn new endpoints (each endpoint's instances are then
//! watched live by its Client). A router — Client, policy handle, KV index, event
//! subscriptions — is created as soon as its endpoint appears, so the index is warm
//! before the first request.
//!
//! - `fleet`: [`ServeFleet`], the endpoints and their routers;
//! - `pushes`: policies pushed through etcd, reconciled per endpoint.

mod fleet;
mod pushes;

pub use fleet::ServeFleet;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use tokio::net::TcpListener;

use crate::config::{DiscoveryConfig, ServeConfig};
use crate::{Fleet, Gateway, GatewayConfig};
use switchyard_discovery::etcd::{EtcdDiscovery, list_all};
use switchyard_discovery::etcd_policy::{PushedPolicy, Role};
use switchyard_discovery::fixed::FixedDiscovery;
use switchyard_discovery::{Discovery, EndpointPath, InstanceInfo, etcd_policy};
use switchyard_ids::InstanceId;
use switchyard_policy::{PolicyEngine, PolicyError, PolicySource};
use switchyard_router::KvRouterConfig;
use switchyard_router::client::{ClientRegistry, HttpHealthCheck};
use switchyard_tokens::{PrefixTokenizer, Tokenizer};

/// Longest time between two listings of the endpoints (a change to the instances prefix
/// lists them at once).
pub(super) const ENDPOINT_RELIST: Duration = Duration::from_secs(30);

/// What the catalog knows about an endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct EndpointEntry {
    endpoint: EndpointPath,
    block_size: u32,
}

/// What tells one push from another.
type PushKey = (String, String, u64, Option<String>);

/// Pushed policies: etcd's view, and what each endpoint's router was made to run.
#[derive(Default)]
pub(super) struct Pushes {
    /// The push etcd holds for each endpoint.
    pub(super) desired: HashMap<EndpointPath, Arc<PushedPolicy>>,
    /// The push each endpoint was last reconciled to, applied or refused (its sha256,
    /// config, push time and signature: a new push of the same policy is a new push);
    /// absent: it runs its configured policy.
    pub(super) attempted: HashMap<EndpointPath, PushKey>,
}

impl Pushes {
    /// What etcd holds for `endpoint`, and what it was last reconciled to.
    pub(super) fn of(
        &self,
        endpoint: &EndpointPath,
    ) -> (Option<Arc<PushedPolicy>>, Option<PushKey>) {
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
            role: w.role,
            bootstrap_port: w.bootstrap_port,
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
    let tokenizer = tokenizer(&config)?;
    let (fleet, static_set) = fleet(&config, engine).await?;
    let mut background = Vec::new();
    match (&config.discovery, static_set) {
        (_, Some(set)) => fleet.update_catalog(&set),
        (DiscoveryConfig::Etcd(etcd), None) => {
            follow_etcd(&fleet, etcd, &config.policy_trusted_keys, &mut background);
        }
        (DiscoveryConfig::Static { .. } | DiscoveryConfig::Kube(_), None) => {
            unreachable!("static and Kubernetes discovery always have a catalog")
        }
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
    if let Some(epp) = config.epp_listen {
        background.push(serve_picker(epp, &gateway, &config, stopped.clone()).await?);
    }
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

/// The tokenizer (the model's file, else the built-in one) with its prefix cache and the
/// chat format.
fn tokenizer(config: &ServeConfig) -> Result<Arc<PrefixTokenizer>, ServeError> {
    let tokenizer = Arc::new(match &config.tokenizer {
        Some(path) => Tokenizer::from_file(path)?,
        None => Tokenizer::builtin(),
    });
    let chat = switchyard_tokens::ChatFormat::resolve(
        config.chat_template.as_deref(),
        config.tokenizer.as_deref(),
    )?;
    Ok(Arc::new(
        PrefixTokenizer::new(tokenizer, config.tokenizer_cache_tokens).with_chat(Arc::new(chat)),
    ))
}

/// The fleet: discovery (etcd or the static set, returned too), one client registry, the
/// policies, and what every endpoint's router is made with.
async fn fleet(
    config: &ServeConfig,
    engine: PolicyEngine,
) -> Result<(Arc<ServeFleet>, Option<Vec<InstanceInfo>>), ServeError> {
    // One budget for every engine's event input, whichever endpoint it feeds.
    let event_budget = switchyard_bounded::budget::Budget::new(config.kv_events_memory);
    let central_events = if config.kv_events_bind.is_empty() {
        None
    } else {
        Some(
            switchyard_router::central_events::CentralEvents::bind(
                &config.kv_events_bind,
                event_budget.clone(),
            )
            .await
            .map_err(ServeError::KvEvents)?,
        )
    };
    let (discovery, static_set): (Arc<dyn Discovery>, Option<Vec<InstanceInfo>>) =
        match &config.discovery {
            DiscoveryConfig::Etcd(etcd) => (Arc::new(EtcdDiscovery::new(etcd.clone())), None),
            // One endpoint, for the pool's model: its workers come from the watch.
            DiscoveryConfig::Kube(kube) => {
                let endpoint = EndpointPath::for_model(&kube.model);
                let template = InstanceInfo::new(
                    switchyard_ids::InstanceId(0),
                    endpoint,
                    "",
                    kube.model.clone(),
                    kube.block_size,
                );
                let discovery = switchyard_discovery::kube::KubeDiscovery::new((**kube).clone());
                (Arc::new(discovery), Some(vec![template]))
            }
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
            saturation: config.saturation,
            event_budget,
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
    Ok((fleet, static_set))
}

/// Follows etcd: endpoints listed again when the instances change (and every 30 s), and
/// pushed policies (live and shadow) applied as they change.
fn follow_etcd(
    fleet: &Arc<ServeFleet>,
    etcd: &switchyard_discovery::etcd::EtcdConfig,
    trusted: &[switchyard_discovery::signing::PublicKey],
    background: &mut Vec<tokio::task::JoinHandle<()>>,
) {
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
                Err(e) => {
                    tracing::warn!(error = %e, "cannot list endpoints; keeping the last known")
                }
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
    let trusted = trusted.to_vec();
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

/// The endpoint picker's port bound (before serving: a picker that cannot listen is a
/// router that cannot start, not one whose /ready says 200 while its gateway finds
/// nothing there) and served until `stopped`.
async fn serve_picker(
    epp: std::net::SocketAddr,
    gateway: &Arc<Gateway>,
    config: &ServeConfig,
    mut stopped: tokio::sync::watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<()>, ServeError> {
    // Bound before serving: a picker that cannot listen is a router that cannot
    // start, not one whose /ready says 200 while its gateway finds nothing there.
    let epp_listener = TcpListener::bind(epp).await.map_err(|e| {
        std::io::Error::new(e.kind(), format!("endpoint picker listener {epp}: {e}"))
    })?;
    let epp = epp_listener.local_addr()?;
    tracing::info!(addr = %epp, "serving the endpoint picker");
    let gw = gateway.clone();
    let options = crate::epp::Options {
        fallbacks: config.epp_fallbacks,
        report_served: config.epp_report_served,
    };
    let tls = config.epp_tls.clone();
    Ok(tokio::spawn(async move {
        let stop = async move {
            let _ = stopped.wait_for(|s| *s).await;
        };
        if let Err(e) = crate::epp::serve(gw, epp_listener, options, tls, stop).await {
            tracing::error!(addr = %epp, error = %e, "the endpoint picker stopped");
        }
    }))
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
                // Bounded: a watched path replaced by a huge file (or a device) is
                // refused with a log line, not read into memory.
                let limit = switchyard_policy::MAX_POLICY_BYTES as u64;
                let bytes = match switchyard_bounded::files::read(path, limit) {
                    Ok(bytes) => bytes,
                    Err(why) => {
                        tracing::warn!(path = %path.display(), "policy file not reloaded: {why}");
                        continue;
                    }
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
