//! Health probes: active checks of available instances, and the probes that re-admit
//! an ejected one.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::rt::TokioExecutor;
use switchyard_net::upstream::{Connector, Tls};

use switchyard_discovery::InstanceInfo;

/// Why a health check did not pass.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HealthError {
    /// The instance did not answer, or answered that it is unhealthy.
    #[error("{0}")]
    Unhealthy(String),
    /// The check could not be made because this process is out of a resource (file
    /// descriptors, ports): no verdict on the instance.
    #[error("no verdict, the router is out of resources: {0}")]
    Local(String),
}

/// Decides whether an instance is healthy.
#[async_trait::async_trait]
pub trait HealthCheck: Send + Sync + 'static {
    /// `Ok` when the instance can take traffic; `Err` says why not.
    async fn check(&self, instance: &InstanceInfo) -> Result<(), HealthError>;
}

/// If `e` (or an error it wraps) says this process ran out of something rather than
/// that the peer failed — EMFILE, ENFILE, ENOBUFS, ENOMEM, EADDRNOTAVAIL (Linux
/// numbers) — what it says.
pub fn local_exhaustion(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut source = Some(e);
    while let Some(err) = source {
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && io
                .raw_os_error()
                .is_some_and(|code| matches!(code, 24 | 23 | 105 | 12 | 99))
        {
            return Some(io.to_string());
        }
        source = err.source();
    }
    None
}

/// `GET {url}{health_path}`; any 2xx within the timeout is healthy. A 404, 405 or 501
/// means the server has no such health endpoint: it answered, which is all a probe can
/// tell, so it counts as healthy (a worker without a health endpoint is then judged by
/// its requests alone, and is never ejected forever).
pub struct HttpHealthCheck {
    http: HttpClient<Connector, Empty<Bytes>>,
    timeout: Duration,
}

impl HttpHealthCheck {
    /// A probe that gives each request `timeout`, trusting the system's CA roots.
    pub fn new(timeout: Duration) -> HttpHealthCheck {
        HttpHealthCheck::with_tls(timeout, &Tls::default())
    }

    /// A probe that gives each request `timeout`, trusting `tls` for `https://` workers.
    pub fn with_tls(timeout: Duration, tls: &Tls) -> HttpHealthCheck {
        HttpHealthCheck {
            http: HttpClient::builder(TokioExecutor::new()).build(tls.connector(timeout)),
            timeout,
        }
    }
}

#[async_trait::async_trait]
impl HealthCheck for HttpHealthCheck {
    async fn check(&self, instance: &InstanceInfo) -> Result<(), HealthError> {
        let url = format!("{}{}", instance.url, instance.health_path);
        let uri: hyper::Uri = url
            .parse()
            .map_err(|e| HealthError::Unhealthy(format!("bad health URL {url}: {e}")))?;
        let response = tokio::time::timeout(self.timeout, self.http.get(uri))
            .await
            .map_err(|_| {
                HealthError::Unhealthy(format!("GET {url} timed out after {:?}", self.timeout))
            })?
            .map_err(|e| match local_exhaustion(&e) {
                Some(why) => HealthError::Local(why),
                None => HealthError::Unhealthy(format!(
                    "GET {url}: {}",
                    switchyard_net::error_chain(&e)
                )),
            })?;
        let status = response.status();
        if status.is_success() || matches!(status.as_u16(), 404 | 405 | 501) {
            Ok(())
        } else {
            Err(HealthError::Unhealthy(format!(
                "GET {url}: {}",
                response.status()
            )))
        }
    }
}
