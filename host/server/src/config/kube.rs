//! Kubernetes discovery's flags, file keys and their resolution: a GIE `InferencePool`
//! or a pod selector, and how to reach the API server, the first that applies:
//! `--kube-api` (with a token file and a CA file); `--kubeconfig`; in a pod, the
//! cluster's own (`KUBERNETES_SERVICE_HOST`, the service account's token, CA and
//! namespace); `$KUBECONFIG` or `~/.kube/config`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use switchyard_discovery::kube::{KubeConfig, KubeSource, MAX_PORTS};
use switchyard_discovery::kube_api::{KubeApi, Token};
use switchyard_net::upstream::Tls;

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
    /// A kubeconfig file: its context's server, CA, token or client certificate, and
    /// namespace [default outside a pod: $KUBECONFIG, else ~/.kube/config].
    #[arg(long, env = "SWITCHYARD_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig's context to use [default: its current-context].
    #[arg(long, env = "SWITCHYARD_KUBE_CONTEXT")]
    pub kube_context: Option<String>,
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
    kubeconfig: Option<PathBuf>,
    context: Option<String>,
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
    let pool = k.kube_pool.take().or(file.pool.clone());
    let selector = k.kube_selector.take().or(file.selector.clone());
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
                ports = file.ports.clone();
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
    let (server, token, tls, namespace) = connection(k, &file)?;
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

/// The API server, the token, the trust and the namespace, from the first source that
/// applies (the module's order).
fn connection(
    k: &mut KubeArgs,
    file: &KubeFile,
) -> Result<(String, Option<Token>, Tls, String), ConfigError> {
    let in_pod = Path::new(SERVICE_ACCOUNT);
    let pod_namespace = || {
        switchyard_bounded::files::read_to_string(&in_pod.join("namespace"), 256)
            .map(|n| n.trim().to_string())
            .ok()
    };
    let namespace = k.kube_namespace.take().or(file.namespace.clone());
    let token_file = k.kube_token_file.take().or(file.token_file.clone());
    let ca_file = k.kube_ca_file.take().or(file.ca_file.clone());
    let kubeconfig = k.kubeconfig.take().or(file.kubeconfig.clone());
    let context = k.kube_context.take().or(file.context.clone());
    let in_cluster = match (
        std::env::var("KUBERNETES_SERVICE_HOST"),
        std::env::var("KUBERNETES_SERVICE_PORT"),
    ) {
        (Ok(h), Ok(p)) if !h.is_empty() => {
            let host = if h.contains(':') { format!("[{h}]") } else { h };
            Some(format!("https://{host}:{p}"))
        }
        _ => None,
    };
    let explicit = k.kube_api.take().or(file.api.clone());
    let kubeconfig = match (&explicit, kubeconfig, &in_cluster) {
        (Some(_), _, _) => None,
        (None, Some(path), _) => Some(path),
        (None, None, Some(_)) => None,
        (None, None, None) => default_kubeconfig(),
    };
    if let Some(path) = kubeconfig {
        if let Some(ca) = &ca_file {
            // The kubeconfig's cluster names the CA the server is trusted by: a second
            // one beside it would be either ignored or a silent change of trust.
            return Err(ConfigError(format!(
                "--kube-ca-file {} with the kubeconfig {}: its cluster names the server's CA (certificate-authority); give one or the other",
                ca.display(),
                path.display()
            )));
        }
        let (server, token, tls, ns) = from_kubeconfig(&path, context.as_deref())?;
        let token = token_file.map(Token::File).or(token);
        let namespace = namespace.or(ns).unwrap_or_else(|| "default".into());
        return Ok((server, token, tls, namespace));
    }
    let server = explicit.or(in_cluster).ok_or_else(|| {
        ConfigError(
            "Kubernetes discovery outside a pod needs --kube-api URL (with --kube-token-file and --kube-ca-file) or a kubeconfig (--kubeconfig, $KUBECONFIG, ~/.kube/config)".into(),
        )
    })?;
    let token = token_file
        .or_else(|| Some(in_pod.join("token")).filter(|t| t.exists()))
        .map(Token::File);
    let ca = ca_file.or_else(|| Some(in_pod.join("ca.crt")).filter(|c| c.exists()));
    let tls = switchyard_net::upstream::Tls::with_ca_files(ca.as_slice())
        .map_err(|e| ConfigError(format!("--kube-ca-file: {e}")))?;
    let namespace = namespace
        .or_else(pod_namespace)
        .unwrap_or_else(|| "default".into());
    Ok((server, token, tls, namespace))
}

/// `$KUBECONFIG`'s first file, else `~/.kube/config`, if it exists.
fn default_kubeconfig() -> Option<PathBuf> {
    let from_env = std::env::var_os("KUBECONFIG")
        .and_then(|v| std::env::split_paths(&v).find(|p| !p.as_os_str().is_empty()));
    let home = std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".kube/config"));
    from_env.or(home).filter(|p| p.exists())
}

/// The most a file a kubeconfig names (a CA, a certificate, a key, a token) may hold.
const MAX_CREDENTIAL: u64 = 1 << 20;

/// The server, token, trust and namespace of a kubeconfig's context.
fn from_kubeconfig(
    path: &Path,
    context: Option<&str>,
) -> Result<(String, Option<Token>, Tls, Option<String>), ConfigError> {
    use switchyard_discovery::kubeconfig::{self, Source};
    let fail = |why: String| ConfigError(format!("kubeconfig {}: {why}", path.display()));
    let text = switchyard_bounded::files::read_to_string(path, kubeconfig::MAX_KUBECONFIG as u64)
        .map_err(|e| fail(e.to_string()))?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let c = kubeconfig::parse(&text, dir, context).map_err(fail)?;
    let read = |s: &Source| -> Result<Vec<u8>, ConfigError> {
        match s {
            Source::Data(d) => Ok(d.clone()),
            Source::File(f) => switchyard_bounded::files::read(f, MAX_CREDENTIAL)
                .map_err(|e| fail(format!("{}: {e}", f.display()))),
        }
    };
    let token = match &c.token {
        Some(Source::File(f)) => Some(Token::File(f.clone())),
        Some(Source::Data(d)) => Some(Token::Fixed(String::from_utf8_lossy(d).trim().to_string())),
        None => None,
    };
    let ca = c.ca.as_ref().map(read).transpose()?;
    let identity = match &c.identity {
        Some((cert, key)) => Some((read(cert)?, read(key)?)),
        None => None,
    };
    let tls = Tls::for_server(
        ca.as_deref(),
        identity.as_ref().map(|(c, k)| (c.as_slice(), k.as_slice())),
    )
    .map_err(fail)?;
    Ok((c.server, token, tls, c.namespace))
}
