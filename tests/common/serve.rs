//! `switchyard serve` scaffolding: admin calls, fleets in etcd, waiting for workers, and a
//! bounded load loop.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::etcd::Etcd;
use super::http::{self, HttpClient, get};
use super::procs::{mock_worker, serve};
use super::router::{PATIENCE, TOKEN, auth, eventually};
use hyper::{Method, StatusCode};
use serde_json::{Value, json};

pub async fn wait_available(c: &HttpClient, router: &str, n: usize) {
    eventually(&format!("{n} available instances"), || async {
        let Ok((StatusCode::OK, _, body)) = http::send(
            c,
            Method::GET,
            &format!("{router}/admin/endpoints/default/mock/generate/instances"),
            &[("authorization", &auth())],
            "",
            PATIENCE,
        )
        .await
        else {
            return false;
        };
        let v: Value = serde_json::from_slice(&body).unwrap();
        v["instances"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|i| i["available"] == true)
            .count()
            == n
    })
    .await;
}

pub async fn worker_finished(c: &HttpClient, worker: &str) -> u64 {
    let (_, body) = get(c, &format!("{worker}/stats")).await;
    serde_json::from_slice::<Value>(&body).unwrap()["finished"]
        .as_u64()
        .unwrap()
}

pub fn chat(text: &str, max_tokens: u32) -> Value {
    json!({"model": "mock", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})
}

/// A real etcd, `n` mock-worker processes registered in it, and a router process; waits
/// until the router sees every worker available.
pub struct EtcdFleet {
    pub etcd: Etcd,
    pub workers: Vec<(super::procs::Proc, String)>,
    pub _router: super::procs::Proc,
    pub url: String,
    pub c: HttpClient,
}

pub async fn etcd_fleet(n: usize, speedup: &str) -> EtcdFleet {
    let etcd = Etcd::start();
    let mut workers = Vec::new();
    for _ in 0..n {
        workers.push(mock_worker(&["--etcd", &etcd.url(), "--speedup", speedup]).await);
    }
    let (router, url) = serve(&["--etcd", &etcd.url(), "--admin-token", TOKEN]).await;
    let c = http::client();
    wait_available(&c, &url, n).await;
    EtcdFleet {
        etcd,
        workers,
        _router: router,
        url,
        c,
    }
}

/// Runs `tasks` clients sending requests until `stop`; returns (ok, failed).
pub fn load(
    url: String,
    tasks: usize,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(u64, u64, Vec<String>)> {
    tokio::spawn(async move {
        let ok = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let errors = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let mut handles = Vec::new();
        for t in 0..tasks {
            let (url, stop, ok, failed, errors) = (
                url.clone(),
                stop.clone(),
                ok.clone(),
                failed.clone(),
                errors.clone(),
            );
            handles.push(tokio::spawn(async move {
                let c = http::client();
                // Bounded: at most 2,000 requests per task.
                for i in 0..2000u32 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let body = chat(&format!("task {t} request {i}: please answer briefly."), 2)
                        .to_string();
                    match http::send(
                        &c,
                        Method::POST,
                        &format!("{url}/v1/chat/completions"),
                        &[],
                        body,
                        PATIENCE,
                    )
                    .await
                    {
                        Ok((StatusCode::OK, _, _)) => {
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok((s, _, b)) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            errors
                                .lock()
                                .push(format!("{s}: {}", String::from_utf8_lossy(&b)));
                        }
                        Err(e) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            errors.lock().push(e);
                        }
                    }
                }
            }));
        }
        for h in handles {
            h.await.unwrap();
        }
        let errors = errors.lock().clone();
        (
            ok.load(Ordering::Relaxed),
            failed.load(Ordering::Relaxed),
            errors,
        )
    })
}

/// `wasm` with a custom section of `padding` bytes appended: a valid component that
/// much larger.
pub fn padded(wasm: &[u8], padding: usize) -> Vec<u8> {
    let mut big = wasm.to_vec();
    big.push(0); // custom section
    let mut size = padding + 2;
    while size >= 0x80 {
        big.push((size & 0x7f) as u8 | 0x80);
        size >>= 7;
    }
    big.push(size as u8);
    big.extend_from_slice(&[1, b'p']);
    big.resize(big.len() + padding, b'x');
    big
}
