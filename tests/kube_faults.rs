//! Kubernetes discovery against an API server at its worst, scripted over real HTTP:
//! one that answers every watch with `410 Gone`. The router lists again each time, at
//! a backoff's pace rather than in a loop, and keeps the workers of its last list; a
//! pod a later list no longer holds leaves at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::mpsc;

use switchyard::discovery::kube::{KubeConfig, KubeDiscovery, KubeSource};
use switchyard::discovery::kube_api::KubeApi;
use switchyard::discovery::{Discovery as _, DiscoveryUpdate, EndpointPath};

const LIST: &str = r#"{"kind":"PodList","apiVersion":"v1","metadata":{"resourceVersion":"5"},"items":[{"metadata":{"name":"a","uid":"u-a","resourceVersion":"4"},"status":{"podIP":"127.0.0.2","conditions":[{"type":"Ready","status":"True"}]}}]}"#;
const EMPTY: &str =
    r#"{"kind":"PodList","apiVersion":"v1","metadata":{"resourceVersion":"9"},"items":[]}"#;
const GONE: &str = r#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Expired","code":410,"message":"too old resource version: 5 (9)"}}"#;

/// An API server that lists one Ready pod (the first time only, unless `stays`) and
/// ends every watch with 410 Gone; it counts the lists and the watches.
async fn gone_server(stays: bool) -> (String, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (lists, watches) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (l, w) = (lists.clone(), watches.clone());
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let (l, w) = (l.clone(), w.clone());
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|x| x == b"\r\n\r\n") && head.len() < 65536 {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let line = String::from_utf8_lossy(&head)
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_string();
                let body = if line.contains("watch=1") {
                    w.fetch_add(1, Ordering::Relaxed);
                    format!("{GONE}\n")
                } else if l.fetch_add(1, Ordering::Relaxed) == 0 || stays {
                    LIST.to_string()
                } else {
                    EMPTY.to_string()
                };
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(answer.as_bytes()).await;
            });
        }
    });
    (url, lists, watches)
}

/// Discovery of `app=mock` on port 8000 from the server at `url`, for `secs`: the
/// updates it sent.
async fn follow(url: &str, secs: u64) -> Vec<DiscoveryUpdate> {
    let config = KubeConfig {
        api: KubeApi::new(url, None, &Default::default(), Duration::from_secs(2)),
        namespace: "default".into(),
        source: KubeSource::Selector {
            selector: "app=mock".into(),
            ports: vec![8000],
        },
        model: "mock".into(),
        block_size: 16,
        health_path: "/health".into(),
        backoff_initial: Duration::from_millis(250),
        backoff_max: Duration::from_secs(5),
        idle: Duration::from_secs(120),
    };
    let endpoint: EndpointPath = "default/mock/generate".parse().unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let task = KubeDiscovery::new(config).watch(endpoint, tx);
    let mut updates = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while let Ok(Some(u)) = tokio::time::timeout_at(deadline, rx.recv()).await {
        updates.push(u);
    }
    task.abort();
    updates
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_answering_every_watch_with_410_gets_lists_at_a_backoffs_pace() {
    let (url, lists, watches) = gone_server(true).await;
    let updates = follow(&url, 3).await;
    let (lists, watches) = (
        lists.load(Ordering::Relaxed),
        watches.load(Ordering::Relaxed),
    );
    // 250 ms doubling: lists at 0, 0.25, 0.75 and 1.75 s within the 3 s.
    assert!(lists >= 2, "a 410 lists again: {lists} lists");
    assert!(
        lists <= 6,
        "{lists} lists and {watches} watches in 3 s: relisting in a loop"
    );
    assert!(
        watches <= lists,
        "one watch per list: {watches} for {lists}"
    );
    // Every list is the same one pod, and it never leaves.
    assert!(!updates.is_empty());
    for u in &updates {
        match u {
            DiscoveryUpdate::Reset(all) => {
                let urls: Vec<&str> = all.iter().map(|i| i.url.as_str()).collect();
                assert_eq!(urls, ["http://127.0.0.2:8000"]);
            }
            other => panic!("only lists of the same pod: {other:?}"),
        }
    }
}

/// A pod that turned unready or went while no watch was open is missing from the next
/// list: it leaves every decision at once (not held as a registry's missing entry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_missing_from_a_relist_leaves_at_once() {
    let (url, _, _) = gone_server(false).await;
    let updates = follow(&url, 1).await;
    let DiscoveryUpdate::Reset(first) = &updates[0] else {
        panic!("a list first: {updates:?}");
    };
    assert_eq!(first.len(), 1, "{updates:?}");
    let leave = updates
        .iter()
        .position(|u| matches!(u, DiscoveryUpdate::Leave(id) if *id == first[0].id));
    let next = updates[1..]
        .iter()
        .position(|u| matches!(u, DiscoveryUpdate::Reset(_)))
        .map(|i| i + 1);
    assert!(
        leave.is_some() && leave < next,
        "the pod leaves before the next list: {updates:?}"
    );
}
