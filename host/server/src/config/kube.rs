//! Kubernetes discovery's flags, file keys and their resolution: a GIE `InferencePool`
//! or a pod selector, and how to reach the API server — in a pod, the cluster's own
//! (`KUBERNETES_SERVICE_HOST`, the service account's token, CA and namespace), else
//! `--kube-api` with a token file and a CA file.

use std::path::{Path, PathBuf};
use std::time::Duration;

use switchyard_discovery::kube::{KubeConfig, KubeSource, MAX_PORTS};
use switchyard_discovery::kube_api::{KubeApi, Token};

use super::{ConfigError, FileConfig, ServeArgs};

/// Where a pod's service account is mounted.
const SERVICE_ACCOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The flags of Kubernetes discovery.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct KubeArgs {
    /// Discover the workers of this GIE InferencePool (inference.networking.k8s.io/v1:
    /// its selector's Ready pods, one worker per target port) in `--kube-namespace`.
    #[arg(long, env = "SWITCHYARD_KUBE_POOL")]
    pub kube_pool: Option<String>,
    /// Or the Ready pods matching this label selector (`app=vllm`), on `--kube-port`.
    #[arg(long, env = "SWITCHYARD_KUBE_SELECTOR")]
    pub kube_selector: Option<String>,
    /// The port(s) the selected pods serve on (repeatable) [default: 8000].
    #[arg(
        long = "kube-port",
        env = "SWITCHYARD_KUBE_PORTS",
        value_delimiter = ','
    )]
    pub kube_ports: Vec<u16>,
    /// The namespace of the pool and its pods [default: the pod's own, else default].
    #[arg(long, env = "SWITCHYARD_KUBE_NAMESPACE")]
    pub kube_namespace: Option<String>,
    /// The API server's URL [default: in a pod, the cluster's].
    #[arg(long, env = "SWITCHYARD_KUBE_API")]
    pub kube_api: Option<String>,
    /// A file holding the bearer token, read again for every call [default: in a pod,
    /// its service account's].
    #[arg(long, env = "SWITCHYARD_KUBE_TOKEN_FILE")]
    pub kube_token_file: Option<PathBuf>,
    /// The API server's CA (PEM) [default: in a pod, its service account's].
    #[arg(long, env = "SWITCHYARD_KUBE_CA_FILE")]
    pub kube_ca_file: Option<PathBuf>,
}

/// The file's keys of Kubernetes discovery (as the flags, `kube_` and snake case).
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubeFile {
    pool: Option<String>,
    selector: Option<String>,
    #[serde(default)]
    ports: Vec<u16>,
    namespace: Option<String>,
    api: Option<String>,
    token_file: Option<PathBuf>,
    ca_file: Option<PathBuf>,
}

/// What the flags and the file say of Kubernetes; `None` when they name no pool and no
/// selector.
pub(super) fn resolve(
    a: &mut ServeArgs,
    f: &mut FileConfig,
    model: &str,
    block_size: u32,
    health_path: &str,
) -> Result<Option<KubeConfig>, ConfigError> {
    let k = &mut a.kube;
    let file = f.kube.take().unwrap_or_default();
    let pool = k.kube_pool.take().or(file.pool);
    let selector = k.kube_selector.take().or(file.selector);
    let source = match (pool, selector) {
        (None, None) => return Ok(None),
        (Some(_), Some(_)) => {
            return Err(ConfigError(
                "give --kube-pool or --kube-selector, not both".into(),
            ));
        }
        (Some(p), None) => KubeSource::Pool(p),
        (None, Some(s)) => {
            let mut ports = std::mem::take(&mut k.kube_ports);
            if ports.is_empty() {
                ports = file.ports;
            }
            if ports.is_empty() {
                ports.push(8000);
            }
            if ports.len() > MAX_PORTS || ports.contains(&0) {
                return Err(ConfigError(format!(
                    "--kube-port: 1 to {MAX_PORTS} ports, none 0"
                )));
            }
            KubeSource::Selector { selector: s, ports }
        }
    };
    let in_pod = Path::new(SERVICE_ACCOUNT);
    let server = match k.kube_api.take().or(file.api) {
        Some(s) => s,
        None => match (
            std::env::var("KUBERNETES_SERVICE_HOST"),
            std::env::var("KUBERNETES_SERVICE_PORT"),
        ) {
            (Ok(h), Ok(p)) if !h.is_empty() => {
                let host = if h.contains(':') { format!("[{h}]") } else { h };
                format!("https://{host}:{p}")
            }
            _ => {
                return Err(ConfigError(
                    "Kubernetes discovery outside a pod needs --kube-api URL (and --kube-token-file, --kube-ca-file)".into(),
                ));
            }
        },
    };
    let token = k
        .kube_token_file
        .take()
        .or(file.token_file)
        .or_else(|| Some(in_pod.join("token")).filter(|t| t.exists()))
        .map(Token::File);
    let ca = k
        .kube_ca_file
        .take()
        .or(file.ca_file)
        .or_else(|| Some(in_pod.join("ca.crt")).filter(|c| c.exists()));
    let tls = switchyard_net::upstream::Tls::with_ca_files(ca.as_slice())
        .map_err(|e| ConfigError(format!("--kube-ca-file: {e}")))?;
    let namespace = match k.kube_namespace.take().or(file.namespace) {
        Some(n) => n,
        None => switchyard_bounded::files::read_to_string(&in_pod.join("namespace"), 256)
            .map(|n| n.trim().to_string())
            .unwrap_or_else(|_| "default".into()),
    };
    let timeout = Duration::from_secs(10);
    Ok(Some(KubeConfig {
        api: KubeApi::new(&server, token, &tls, timeout),
        namespace,
        source,
        model: model.to_string(),
        block_size,
        health_path: health_path.to_string(),
        backoff_initial: Duration::from_millis(250),
        backoff_max: Duration::from_secs(5),
        idle: Duration::from_secs(120),
    }))
}
