//! A tiny real HTTP server whose `/health` answer the test controls.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::Bytes;
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Response, StatusCode};
use hyper_util::rt::TokioIo;

pub struct HealthServer {
    pub addr: SocketAddr,
    pub healthy: Arc<AtomicBool>,
    pub hits: Arc<AtomicU64>,
}

impl HealthServer {
    /// Serves on 127.0.0.1 (a free port) until the runtime ends; starts unhealthy.
    pub async fn start() -> HealthServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let healthy = Arc::new(AtomicBool::new(false));
        let hits = Arc::new(AtomicU64::new(0));
        let (h, n) = (healthy.clone(), hits.clone());
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (h, n) = (h.clone(), n.clone());
                tokio::spawn(async move {
                    let service = service_fn(move |_req| {
                        n.fetch_add(1, Ordering::SeqCst);
                        let status = if h.load(Ordering::SeqCst) {
                            StatusCode::OK
                        } else {
                            StatusCode::SERVICE_UNAVAILABLE
                        };
                        async move {
                            Ok::<_, Infallible>(
                                Response::builder()
                                    .status(status)
                                    .body(Full::new(Bytes::from_static(b"{}")))
                                    .unwrap(),
                            )
                        }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        HealthServer {
            addr,
            healthy,
            hits,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}
