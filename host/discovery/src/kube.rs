//! Kubernetes discovery: the fleet is a GIE `InferencePool` (its pod selector and target
//! ports) or a pod label selector and ports, in one namespace. A worker is a Ready pod's
//! `podIP:port`, one per target port (data-parallel ranks serve on several).
//!
//! The pods are listed, then watched from the list's resource version with bookmarks; a
//! watch the server ends is made again from the last version seen, a 410 Gone lists
//! again (after a backoff when the last list was under `MIN_CYCLE` ago), a broken stream or an unreachable server retries with backoff while the last
//! known set stays in force. A pool is read again at every list and watched beside its
//! pods: a change of its selector or ports lists again at once. A pod that turns
//! unready, is being deleted or disappears leaves at once (`Leave`: the client drops it
//! from every decision); a pod that becomes Ready joins.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::mpsc;

use super::kube_api::{KubeApi, KubeError};
use super::{Discovery, DiscoveryUpdate, EndpointPath, EngineEventSource, InstanceInfo};
use switchyard_ids::InstanceId;

/// The most pods an endpoint follows (more are refused with an error, not held).
pub const MAX_PODS: usize = 10_000;

/// A list-and-watch cycle shorter than this that asks to list again (a 410 at once) is
/// paused before the next, as a failure is: a server answering every watch with 410
/// gets lists at a backoff's pace, not in a loop.
pub const MIN_CYCLE: Duration = Duration::from_secs(1);

/// The most target ports a pool names.
pub const MAX_PORTS: usize = 16;

/// Each followed pod's workers, by pod UID.
type Pods = BTreeMap<String, Vec<InstanceInfo>>;

/// Where the fleet is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubeSource {
    /// A GIE `InferencePool` (`inference.networking.k8s.io/v1`) of this name.
    Pool(String),
    /// Pods matching a label selector (`app=vllm,tier=gpu`), serving on these ports.
    Selector {
        /// The label selector, as `kubectl -l` takes it.
        selector: String,
        /// The ports each pod serves on.
        ports: Vec<u16>,
    },
}

/// How to follow a fleet in Kubernetes.
#[derive(Debug, Clone)]
pub struct KubeConfig {
    /// The API client.
    pub api: KubeApi,
    /// The namespace of the pool and its pods.
    pub namespace: String,
    /// The pool, or the selector.
    pub source: KubeSource,
    /// The model the pods serve.
    pub model: String,
    /// Tokens per KV block.
    pub block_size: u32,
    /// The workers' health path.
    pub health_path: String,
    /// First retry delay; doubles up to `backoff_max`.
    pub backoff_initial: Duration,
    /// Longest retry delay.
    pub backoff_max: Duration,
    /// The longest a watch may be silent (the server is asked for bookmarks, and ends
    /// a watch after `timeoutSeconds`, well within it).
    pub idle: Duration,
}

/// Discovery from a Kubernetes API server.
#[derive(Debug, Clone)]
pub struct KubeDiscovery {
    config: KubeConfig,
}

impl KubeDiscovery {
    /// Follows the fleet `config` names.
    pub fn new(config: KubeConfig) -> KubeDiscovery {
        KubeDiscovery { config }
    }
}

impl Discovery for KubeDiscovery {
    fn watch(
        &self,
        endpoint: EndpointPath,
        tx: mpsc::UnboundedSender<DiscoveryUpdate>,
    ) -> tokio::task::JoinHandle<()> {
        let config = self.config.clone();
        tokio::spawn(async move {
            let mut delay = config.backoff_initial;
            // The pods as last seen, kept across lists.
            let mut pods = Pods::new();
            loop {
                let started = tokio::time::Instant::now();
                let result = tokio::select! {
                    r = follow(&config, &endpoint, &tx, &mut pods) => r,
                    _ = tx.closed() => return,
                };
                // A cycle that lasted (its watch delivered) earns a fresh start; one
                // that ends at once, whatever ended it, waits longer each time.
                if started.elapsed() >= config.backoff_max {
                    delay = config.backoff_initial;
                }
                match result {
                    // Listed again at once (a 410, or the pool changed)...
                    Ok(()) if started.elapsed() >= MIN_CYCLE => continue,
                    // ...unless that is all the server does.
                    Ok(()) => {
                        tracing::info!(%endpoint, retry_in = ?delay, "the pods' watch ended at once again; listing again after a pause");
                    }
                    Err(e) => {
                        tracing::warn!(%endpoint, error = %e, retry_in = ?delay, "Kubernetes discovery failed; keeping the last known workers");
                    }
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(config.backoff_max);
            }
        })
    }
}

/// What a pool or a selector resolves to: a label selector and ports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fleet {
    /// The label selector, URL-ready.
    pub selector: String,
    /// The ports each pod serves on.
    pub ports: Vec<u16>,
    /// The pool's resource version, when the fleet is a pool.
    pub pool_version: Option<String>,
}

/// A pool's selector and ports, from its object.
pub fn pool_fleet(pool: &Value) -> Result<Fleet, String> {
    let spec = &pool["spec"];
    let labels = spec["selector"]["matchLabels"]
        .as_object()
        .or_else(|| {
            spec["selector"]
                .as_object()
                .filter(|o| !o.contains_key("matchLabels"))
        })
        .ok_or("the pool has no selector.matchLabels")?;
    let mut pairs = Vec::new();
    for (k, v) in labels {
        let v = v
            .as_str()
            .ok_or("a selector label's value is not a string")?;
        pairs.push(format!("{k}={v}"));
    }
    if pairs.is_empty() {
        return Err("the pool's selector selects every pod".into());
    }
    let mut ports = Vec::new();
    for p in spec["targetPorts"].as_array().into_iter().flatten() {
        let n = p["number"].as_u64().or_else(|| p.as_u64());
        match n.and_then(|n| u16::try_from(n).ok()).filter(|n| *n > 0) {
            Some(n) if !ports.contains(&n) => ports.push(n),
            Some(_) => {}
            None => return Err(format!("a target port is not a port number: {p}")),
        }
    }
    if ports.is_empty() || ports.len() > MAX_PORTS {
        return Err(format!(
            "the pool names {} target ports (1 to {MAX_PORTS})",
            ports.len()
        ));
    }
    Ok(Fleet {
        selector: pairs.join(","),
        ports,
        pool_version: pool["metadata"]["resourceVersion"]
            .as_str()
            .map(str::to_string),
    })
}

/// A pod's workers: none unless it is Ready, has an IP and is not being deleted.
pub fn pod_workers(
    pod: &Value,
    fleet: &Fleet,
    config: &KubeConfig,
    endpoint: &EndpointPath,
) -> Vec<InstanceInfo> {
    let meta = &pod["metadata"];
    let status = &pod["status"];
    let ready = status["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "Ready" && c["status"] == "True");
    let ip = status["podIP"]
        .as_str()
        .filter(|ip| ip.parse::<std::net::IpAddr>().is_ok());
    let uid = meta["uid"].as_str().unwrap_or_default();
    let (Some(ip), true, true, false) = (
        ip,
        ready,
        !uid.is_empty(),
        meta.get("deletionTimestamp").is_some_and(|d| !d.is_null()),
    ) else {
        return Vec::new();
    };
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_string()
    };
    let events = pod_events(&meta["annotations"]);
    fleet
        .ports
        .iter()
        .zip(0u16..)
        .map(|(port, rank)| {
            let mut info = InstanceInfo::new(
                instance_id(uid, *port),
                endpoint.clone(),
                format!("http://{host}:{port}"),
                config.model.clone(),
                config.block_size,
            );
            info.health_path = config.health_path.clone();
            // A pod with the same name made again is another pod (another UID).
            info.registration = instance_id(uid, 0).0;
            info.engine_events = events.as_ref().and_then(|e| {
                let at = |port: u16| Some(format!("tcp://{host}:{}", port.checked_add(rank)?));
                let mut source = EngineEventSource::new(at(e.publish)?);
                source.replay = match e.replay {
                    Some(r) => Some(at(r)?),
                    None => None,
                };
                source.topic = e.topic.clone();
                Some(std::sync::Arc::new(source))
            });
            info
        })
        .collect()
}

/// The annotation naming the port of a pod's KV event publisher (vLLM's
/// `--kv-events-config` endpoint, SGLang's the same): the pod's first target port's
/// engine publishes there, the next one's on the port after (data-parallel ranks, as
/// vLLM numbers them).
pub const KV_EVENTS_PORT: &str = "switchyard.dev/kv-events-port";
/// The annotation naming the port of its replay socket (optional; ranks as above).
pub const KV_REPLAY_PORT: &str = "switchyard.dev/kv-replay-port";
/// The annotation naming the topic it publishes under (default: every topic).
pub const KV_TOPIC: &str = "switchyard.dev/kv-topic";

/// Where a pod's engines publish their KV events, from its annotations.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PodEvents {
    publish: u16,
    replay: Option<u16>,
    topic: String,
}

/// A pod's KV event sockets, if its annotations name them (a port that does not parse
/// names none: the pod is routed on predicted caches, with a warning).
fn pod_events(annotations: &Value) -> Option<PodEvents> {
    let port = |key: &str| -> Result<Option<u16>, String> {
        let Some(v) = annotations[key].as_str() else {
            return Ok(None);
        };
        match v.trim().parse::<u16>() {
            Ok(p) if p != 0 => Ok(Some(p)),
            _ => Err(format!(
                "{key}: `{}` is not a port",
                v.chars().take(40).collect::<String>()
            )),
        }
    };
    let checked = || -> Result<Option<PodEvents>, String> {
        let Some(publish) = port(KV_EVENTS_PORT)? else {
            return Ok(None);
        };
        let replay = port(KV_REPLAY_PORT)?;
        let topic = annotations[KV_TOPIC].as_str().unwrap_or_default();
        if topic.len() > 256 {
            return Err(format!("{KV_TOPIC}: over 256 bytes"));
        }
        Ok(Some(PodEvents {
            publish,
            replay,
            topic: topic.to_string(),
        }))
    };
    checked().unwrap_or_else(|why| {
        // Read again at every event of the pod: said the first times, then now and then.
        static SAID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SAID.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        if n <= 10 || n.is_multiple_of(1000) {
            tracing::warn!(%why, times = n, "a pod's KV event annotations are left out");
        }
        None
    })
}

/// A worker's ID: a hash of its pod's UID and its port, the same in every replica.
pub fn instance_id(uid: &str, port: u16) -> InstanceId {
    // FNV-1a, 64 bits: stable across builds and processes.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in uid.bytes().chain(port.to_be_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    InstanceId(h)
}

fn query(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// The fleet as it is now: the pool read, or the selector as given.
async fn resolve(config: &KubeConfig) -> Result<Fleet, KubeError> {
    match &config.source {
        KubeSource::Selector { selector, ports } => Ok(Fleet {
            selector: selector.clone(),
            ports: ports.clone(),
            pool_version: None,
        }),
        KubeSource::Pool(name) => {
            let path = format!(
                "/apis/inference.networking.k8s.io/v1/namespaces/{}/inferencepools/{}",
                query(&config.namespace),
                query(name)
            );
            let what = format!(
                "get inferencepools/{name} in namespace {}",
                config.namespace
            );
            let pool = config.api.get(&path, &what).await?;
            pool_fleet(&pool).map_err(|why| KubeError::Refused {
                what,
                status: 0,
                message: why,
            })
        }
    }
}

/// One list and the watches after it, until the watch must be made anew from a list
/// (`Ok`: at once) or something failed (`Err`: after a pause).
async fn follow(
    config: &KubeConfig,
    endpoint: &EndpointPath,
    tx: &mpsc::UnboundedSender<DiscoveryUpdate>,
    pods: &mut Pods,
) -> Result<(), KubeError> {
    let fleet = resolve(config).await?;
    let ns = query(&config.namespace);
    let pods_path = format!(
        "/api/v1/namespaces/{ns}/pods?labelSelector={}",
        query(&fleet.selector)
    );
    let what = format!("list pods in namespace {}", config.namespace);
    let list = config.api.get(&pods_path, &what).await?;
    let items = list["items"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    if items.len() > MAX_PODS {
        return Err(KubeError::Refused {
            what,
            status: 0,
            message: format!(
                "{} pods match, more than the {MAX_PODS} followed",
                items.len()
            ),
        });
    }
    let mut listed = Pods::new();
    for pod in items {
        if let Some(uid) = pod["metadata"]["uid"].as_str() {
            listed.insert(uid.to_string(), pod_workers(pod, &fleet, config, endpoint));
        }
    }
    let all: Vec<InstanceInfo> = listed.values().flatten().cloned().collect();
    // A worker the list no longer holds is a pod the API server says is unready or gone
    // (it turned so while no watch was open): it leaves at once, as it would have from
    // the watch, rather than being held as a registry's missing entry is.
    for gone in pods.values().flatten() {
        if !all.iter().any(|w| w.id == gone.id) {
            let _ = tx.send(DiscoveryUpdate::Leave(gone.id));
        }
    }
    *pods = listed;
    if tx.send(DiscoveryUpdate::Reset(all)).is_err() {
        return Ok(());
    }
    let mut version = list["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let watch_secs = (config.idle.as_secs() / 2).max(1);
    loop {
        let path = format!(
            "{pods_path}&watch=1&allowWatchBookmarks=true&timeoutSeconds={watch_secs}&resourceVersion={}",
            query(&version)
        );
        let what = format!("watch pods in namespace {}", config.namespace);
        let mut watch = match config.api.watch(&path, &what, config.idle).await {
            Err(KubeError::Gone) => return Ok(()),
            w => w?,
        };
        loop {
            let event = tokio::select! {
                e = watch.next() => e,
                changed = pool_changed(config, &fleet) => {
                    changed?;
                    tracing::info!(%endpoint, "the pool changed; listing its pods again");
                    return Ok(());
                }
            };
            let event = match event {
                Err(KubeError::Gone) => return Ok(()),
                Ok(None) => break,
                e => e?.expect("checked"),
            };
            if let Some(v) = event.object["metadata"]["resourceVersion"].as_str() {
                version = v.to_string();
            }
            let Some(uid) = event.object["metadata"]["uid"].as_str().map(str::to_string) else {
                continue;
            };
            let now = match event.kind.as_str() {
                "ADDED" | "MODIFIED" => pod_workers(&event.object, &fleet, config, endpoint),
                "DELETED" => Vec::new(),
                _ => continue,
            };
            if !pods.contains_key(&uid) && pods.len() >= MAX_PODS {
                tracing::warn!(%endpoint, "more than {MAX_PODS} pods match; a new one is left out");
                continue;
            }
            let before = pods.insert(uid.clone(), now.clone()).unwrap_or_default();
            if event.kind == "DELETED" {
                pods.remove(&uid);
            }
            for gone in before.iter().filter(|b| !now.iter().any(|n| n.id == b.id)) {
                let _ = tx.send(DiscoveryUpdate::Leave(gone.id));
            }
            for info in now.into_iter().filter(|n| !before.contains(n)) {
                let _ = tx.send(DiscoveryUpdate::Insert(info));
            }
        }
    }
}

/// Resolves when the pool's selector or ports differ from `fleet`'s (checked every few
/// seconds); never for a selector.
async fn pool_changed(config: &KubeConfig, fleet: &Fleet) -> Result<(), KubeError> {
    if fleet.pool_version.is_none() {
        return std::future::pending().await;
    }
    loop {
        tokio::time::sleep(config.backoff_max.min(Duration::from_secs(2))).await;
        let now = resolve(config).await?;
        if now.selector != fleet.selector || now.ports != fleet.ports {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn config() -> KubeConfig {
        KubeConfig {
            api: KubeApi::new(
                "http://127.0.0.1:1",
                None,
                &Default::default(),
                Duration::from_secs(1),
            ),
            namespace: "default".into(),
            source: KubeSource::Pool("p".into()),
            model: "m".into(),
            block_size: 16,
            health_path: "/health".into(),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(1),
            idle: Duration::from_secs(60),
        }
    }

    /// A configuration, a fleet on ports 8000 and 8001, and an endpoint.
    fn two_ports() -> (KubeConfig, Fleet, EndpointPath) {
        let f = Fleet {
            selector: "a=b".into(),
            ports: vec![8000, 8001],
            pool_version: None,
        };
        (config(), f, "default/m/generate".parse().unwrap())
    }

    fn pod(uid: &str, ip: Option<&str>, ready: bool, deleting: bool) -> Value {
        let mut p = json!({"metadata": {"uid": uid, "name": uid},
            "status": {"conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]}});
        if let Some(ip) = ip {
            p["status"]["podIP"] = json!(ip);
        }
        if deleting {
            p["metadata"]["deletionTimestamp"] = json!("2026-12-07T00:00:00Z");
        }
        p
    }

    #[test]
    fn a_pool_gives_its_selector_and_ports() {
        let pool = json!({"metadata": {"resourceVersion": "7"},
            "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}, {"number": 8001}]}});
        let f = pool_fleet(&pool).unwrap();
        assert_eq!(
            (f.selector.as_str(), f.ports.as_slice()),
            ("app=vllm", &[8000, 8001][..])
        );
        let no_ports =
            json!({"spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": []}});
        assert!(pool_fleet(&no_ports).is_err());
        let everything =
            json!({"spec": {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]}});
        assert!(
            pool_fleet(&everything).is_err(),
            "an empty selector is every pod"
        );
        let bad = json!({"spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 70000}]}});
        assert!(pool_fleet(&bad).is_err());
    }

    #[test]
    fn only_a_ready_pod_with_an_ip_not_being_deleted_is_a_worker_one_per_port() {
        let (c, f, ep) = two_ports();
        let ws = pod_workers(&pod("u1", Some("10.0.0.7"), true, false), &f, &c, &ep);
        let urls: Vec<&str> = ws.iter().map(|w| w.url.as_str()).collect();
        assert_eq!(urls, ["http://10.0.0.7:8000", "http://10.0.0.7:8001"]);
        assert_ne!(ws[0].id, ws[1].id);
        assert_eq!(
            ws[0].id,
            instance_id("u1", 8000),
            "the same in every replica"
        );
        for (p, why) in [
            (pod("u1", Some("10.0.0.7"), false, false), "unready"),
            (pod("u1", None, true, false), "no IP yet"),
            (pod("u1", Some("10.0.0.7"), true, true), "being deleted"),
            (pod("u1", Some("not an ip"), true, false), "a bad IP"),
        ] {
            assert!(pod_workers(&p, &f, &c, &ep).is_empty(), "{why}");
        }
        let v6 = pod_workers(&pod("u2", Some("fd00::7"), true, false), &f, &c, &ep);
        assert_eq!(v6[0].url, "http://[fd00::7]:8000");
    }

    #[test]
    fn a_pods_annotations_name_its_ranks_kv_event_sockets() {
        let (c, f, ep) = two_ports();
        let mut p = pod("u1", Some("10.0.0.7"), true, false);
        p["metadata"]["annotations"] =
            json!({KV_EVENTS_PORT: "5557", KV_REPLAY_PORT: "5600", KV_TOPIC: "kv"});
        let ws = pod_workers(&p, &f, &c, &ep);
        let e: Vec<_> = ws
            .iter()
            .map(|w| w.engine_events.clone().unwrap())
            .collect();
        assert_eq!(
            (
                e[0].endpoint.as_str(),
                e[0].replay.as_deref(),
                e[0].topic.as_str()
            ),
            ("tcp://10.0.0.7:5557", Some("tcp://10.0.0.7:5600"), "kv")
        );
        assert_eq!(e[1].endpoint, "tcp://10.0.0.7:5558", "the second rank's");
        assert_eq!(e[1].replay.as_deref(), Some("tcp://10.0.0.7:5601"));
        for bad in ["0", "70000", "x", "65535"] {
            p["metadata"]["annotations"] = json!({KV_EVENTS_PORT: bad});
            let ws = pod_workers(&p, &f, &c, &ep);
            assert_eq!(ws.len(), 2, "{bad}: the pod is still a worker");
            assert!(
                ws[1].engine_events.is_none(),
                "{bad}: no socket past the port range"
            );
        }
        p["metadata"]["annotations"] = json!({});
        assert!(pod_workers(&p, &f, &c, &ep)[0].engine_events.is_none());
    }

    #[test]
    fn selectors_are_escaped_for_the_query() {
        assert_eq!(
            query("app=vllm,tier in (a,b)"),
            "app%3Dvllm%2Ctier%20in%20%28a%2Cb%29"
        );
    }
}
