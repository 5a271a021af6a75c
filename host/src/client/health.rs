//! Health probes: active checks of available instances, and the probes that re-admit
//! an ejected one.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::discovery::InstanceInfo;

/// Decides whether an instance is healthy again.
#[async_trait::async_trait]
pub trait HealthCheck: Send + Sync + 'static {
    /// `Ok` when the instance can take traffic; `Err` says why not.
    async fn check(&self, instance: &InstanceInfo) -> Result<(), String>;
}

/// `GET {url}{health_path}`; any 2xx within the timeout is healthy. A 404, 405 or 501
/// means the server has no such health endpoint: it answered, which is all a probe can
/// tell, so it counts as healthy (a worker without a health endpoint is then judged by
/// its requests alone, and is never ejected forever).
pub struct HttpHealthCheck {
    http: HttpClient<HttpConnector, Empty<Bytes>>,
    timeout: Duration,
}

impl HttpHealthCheck {
    /// A probe that gives each request `timeout`.
    pub fn new(timeout: Duration) -> HttpHealthCheck {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(timeout));
        connector.set_nodelay(true);
        HttpHealthCheck {
            http: HttpClient::builder(TokioExecutor::new()).build(connector),
            timeout,
        }
    }
}

#[async_trait::async_trait]
impl HealthCheck for HttpHealthCheck {
    async fn check(&self, instance: &InstanceInfo) -> Result<(), String> {
        let url = format!("{}{}", instance.url, instance.health_path);
        let uri: hyper::Uri = url
            .parse()
            .map_err(|e| format!("bad health URL {url}: {e}"))?;
        let response = tokio::time::timeout(self.timeout, self.http.get(uri))
            .await
            .map_err(|_| format!("GET {url} timed out after {:?}", self.timeout))?
            .map_err(|e| format!("GET {url}: {e}"))?;
        let status = response.status();
        if status.is_success() || matches!(status.as_u16(), 404 | 405 | 501) {
            Ok(())
        } else {
            Err(format!("GET {url}: {}", response.status()))
        }
    }
}
