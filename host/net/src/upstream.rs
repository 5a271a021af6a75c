//! How the router connects to workers: plain HTTP or HTTPS on the same client.
//!
//! Every client that talks to a worker (the proxy, health probes, event streams, metrics
//! scrapes) is built here, so an `https://` worker URL works everywhere a worker URL is
//! used. Server certificates are checked against the system's roots plus the CA files the
//! operator gives (`--ca-file`, for a fleet with its own CA); certificate checking cannot
//! be turned off.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use rustls::RootCertStore;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;

/// The connector of every worker-facing client.
pub type Connector = HttpsConnector<HttpConnector>;

/// The trust the router puts in workers' certificates. Cheap to clone.
#[derive(Clone)]
pub struct Tls {
    config: Arc<rustls::ClientConfig>,
    ca_files: Arc<[PathBuf]>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("ca_files", &self.ca_files)
            .finish_non_exhaustive()
    }
}

impl Default for Tls {
    /// The system's roots only (read once per process).
    fn default() -> Tls {
        static SYSTEM: OnceLock<Tls> = OnceLock::new();
        SYSTEM
            .get_or_init(|| Tls::build(system_roots(), Vec::new()))
            .clone()
    }
}

/// A CA file that cannot be used, said plainly.
#[derive(Debug, thiserror::Error)]
#[error("CA file {path}: {why}")]
pub struct TlsError {
    path: PathBuf,
    why: String,
}

impl Tls {
    /// The system's roots plus every certificate in the PEM `ca_files`. A file that cannot
    /// be read, or holds no certificate, is an error: a typo must not fall back silently
    /// to the system roots.
    pub fn with_ca_files(ca_files: &[PathBuf]) -> Result<Tls, TlsError> {
        if ca_files.is_empty() {
            return Ok(Tls::default());
        }
        let mut roots = system_roots();
        for path in ca_files {
            let added = add_pem(&mut roots, path).map_err(|why| TlsError {
                path: path.clone(),
                why,
            })?;
            tracing::info!(path = %path.display(), certificates = added, "trusting CA file for workers");
        }
        Ok(Tls::build(roots, ca_files.to_vec()))
    }

    /// The trust of a client of one server (a Kubernetes API server, say): the system's
    /// roots plus the PEM certificates of `ca`, and `identity` (a PEM certificate chain
    /// and its PEM key) presented to it, if given. The error says which part is wrong.
    pub fn for_server(ca: Option<&[u8]>, identity: Option<(&[u8], &[u8])>) -> Result<Tls, String> {
        let mut roots = system_roots();
        if let Some(pem) = ca {
            add_pem_bytes(&mut roots, pem).map_err(|why| format!("its CA: {why}"))?;
        }
        let builder = client_config(roots);
        let config = match identity {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = CertificateDer::pem_slice_iter(cert)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| format!("its client certificate: {e}"))?;
                if chain.is_empty() {
                    return Err("its client certificate holds no PEM certificate".into());
                }
                let key = rustls_pki_types::PrivateKeyDer::from_pem_slice(key)
                    .map_err(|e| format!("its client key: {e}"))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| format!("its client certificate and key: {e}"))?
            }
        };
        Ok(Tls {
            config: Arc::new(config),
            ca_files: Vec::new().into(),
        })
    }

    fn build(roots: RootCertStore, ca_files: Vec<PathBuf>) -> Tls {
        Tls {
            config: Arc::new(client_config(roots).with_no_client_auth()),
            ca_files: ca_files.into(),
        }
    }

    /// A connector for `http://` and `https://` URLs: no Nagle delay, connects bounded
    /// by `connect_timeout` (the TLS handshake is bounded by the caller's own timeouts).
    pub fn connector(&self, connect_timeout: Duration) -> Connector {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        // A worker that vanished without a reset (a rescheduled pod, a dropped NAT
        // entry) is found by the kernel instead of holding a pooled connection forever.
        http.set_keepalive(Some(Duration::from_secs(30)));
        http.set_connect_timeout(Some(connect_timeout));
        http.enforce_http(false);
        hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config((*self.config).clone())
            .https_or_http()
            .enable_http1()
            .wrap_connector(http)
    }
}

fn system_roots() -> RootCertStore {
    let mut roots = RootCertStore::empty();
    let found = rustls_native_certs::load_native_certs();
    for e in &found.errors {
        tracing::debug!(error = %e, "a system CA certificate could not be read");
    }
    let (added, ignored) = roots.add_parsable_certificates(found.certs);
    tracing::debug!(added, ignored, "system CA roots");
    roots
}

/// A client configuration trusting `roots`, before its client certificate (if any).
fn client_config(
    roots: RootCertStore,
) -> rustls::ConfigBuilder<rustls::ClientConfig, rustls::client::WantsClientCert> {
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_root_certificates(roots)
}

fn add_pem(roots: &mut RootCertStore, path: &Path) -> Result<usize, String> {
    // A CA bundle is kilobytes; the system's whole store is under a megabyte.
    let bytes = switchyard_bounded::files::read(path, 16 << 20)?;
    add_pem_bytes(roots, &bytes)
}

/// Every certificate of the PEM `bytes` into `roots`: how many; none is an error.
fn add_pem_bytes(roots: &mut RootCertStore, bytes: &[u8]) -> Result<usize, String> {
    let mut added = 0;
    for cert in CertificateDer::pem_slice_iter(bytes) {
        let cert = cert.map_err(|e| format!("not PEM: {e}"))?;
        roots
            .add(cert)
            .map_err(|e| format!("not a usable CA certificate: {e}"))?;
        added += 1;
    }
    if added == 0 {
        return Err("holds no PEM certificate".into());
    }
    Ok(added)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ca_file_that_is_missing_or_empty_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let err = Tls::with_ca_files(std::slice::from_ref(&missing)).unwrap_err();
        assert!(err.to_string().contains("missing.pem"), "{err}");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let err = Tls::with_ca_files(&[empty]).unwrap_err();
        assert!(err.to_string().contains("no PEM certificate"), "{err}");
    }
}
