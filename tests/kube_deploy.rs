//! The manifests in `deploy/` against a real kube-apiserver (`tests/common/kube.rs`):
//! each passes a server-side dry run with `kubectl`; applied, the picker's Role is
//! enough for the router to follow the pool, its ConfigMap's configuration is one
//! `serve` takes, and a real Envoy sends requests to the pool's pods the picker names.

mod common;

use serde_json::json;

use common::gateway::{REFERENCE, envoy, no_envoy};
use common::http;
use common::kube::{Kube, READER, no_kube, no_kubectl};
use common::procs::{Proc, free_port, serve, switchyard, wait_ok};
use common::router::{TOKEN, available, eventually};

const PICKER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/picker.yaml");
const ROUTER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/router.yaml");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_manifests_pass_a_server_side_dry_run() {
    if no_kube() || no_kubectl() {
        return;
    }
    let kube = Kube::start().await;
    kube.pool_crd().await;
    for file in [PICKER, ROUTER] {
        let (ok, out) = kube.kubectl(&["apply", "--server-side", "--dry-run=server", "-f", file]);
        assert!(ok, "{file}: {out}");
        let applied = out
            .lines()
            .filter(|l| l.contains("(server dry run)"))
            .count();
        let objects = std::fs::read_to_string(file)
            .unwrap()
            .lines()
            .filter(|l| l.starts_with("kind:"))
            .count();
        assert_eq!(applied, objects, "{file}: every object checked: {out}");
    }
    // A dry run changes nothing.
    let (ok, out) = kube.kubectl(&["get", "deployments,roles,inferencepools", "-o", "name"]);
    assert!(ok && out.trim().is_empty(), "{out}");
    // And it does check: a Deployment without its selector is refused.
    let broken = std::fs::read_to_string(ROUTER).unwrap().replace(
        "  selector:\n    matchLabels:",
        "  notASelector:\n    matchLabels:",
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.yaml");
    std::fs::write(&path, broken).unwrap();
    let (ok, out) = kube.kubectl(&[
        "apply",
        "--server-side",
        "--dry-run=server",
        "-f",
        path.to_str().unwrap(),
    ]);
    assert!(!ok, "a broken manifest passed: {out}");
}

/// A mock worker on `ip:port`.
async fn worker(ip: &str, port: u16) -> Proc {
    let listen = format!("{ip}:{port}");
    let p = switchyard(&["mock-worker", "--listen", &listen, "--model", "mock"]);
    wait_ok(&format!("http://{listen}/v1/models")).await;
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_applied_picker_routes_the_pools_pods_behind_envoy() {
    if no_kube() || no_kubectl() || no_envoy() {
        return;
    }
    let kube = Kube::start().await;
    kube.pool_crd().await;
    let (ok, out) = kube.kubectl(&["apply", "--server-side", "-f", PICKER]);
    assert!(ok, "{out}");
    // The router runs as `reader`, bound to the manifests' Role and nothing else.
    kube.bind("switchyard-picker", "reader").await;
    // The pool as applied; its pods on 127.0.0.x, on a free port.
    let pool_path = "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools";
    let (_, list) = kube.get(pool_path).await;
    let pool = &list["items"][0];
    let name = pool["metadata"]["name"].as_str().unwrap().to_string();
    let labels = pool["spec"]["selector"]["matchLabels"].clone();
    let port = free_port();
    kube.patch(
        &format!("{pool_path}/{name}"),
        json!({"spec": {"targetPorts": [{"number": port}]}}),
    )
    .await;
    let ips = ["127.0.0.11", "127.0.0.12"];
    let mut workers = Vec::new();
    for (i, ip) in ips.iter().enumerate() {
        workers.push(worker(ip, port).await);
        kube.pod(&format!("engine-{i}"), labels.clone(), ip, true)
            .await;
    }
    // The ConfigMap's configuration, with the test's addresses and credentials.
    let (_, cm) = kube
        .get("/api/v1/namespaces/default/configmaps/switchyard-picker")
        .await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("switchyard.toml");
    let text = cm["data"]["switchyard.toml"].as_str().unwrap();
    std::fs::write(
        &config,
        text.replace("meta-llama/Llama-3.1-8B-Instruct", "mock"),
    )
    .unwrap();
    let epp = free_port();
    let epp_listen = format!("127.0.0.1:{epp}");
    let token = kube.token_file(READER);
    let ca = kube.ca();
    let (_router, url) = serve(&[
        "--config",
        config.to_str().unwrap(),
        "--epp-listen",
        &epp_listen,
        "--kube-api",
        &kube.url,
        "--kube-token-file",
        token.to_str().unwrap(),
        "--kube-ca-file",
        ca.to_str().unwrap(),
        "--kube-namespace",
        "default",
        "--admin-token",
        TOKEN,
    ])
    .await;
    let c = http::client();
    eventually("the pool's two pods", || async {
        available(&c, &url).await == 2
    })
    .await;
    let (_envoy, gateway, _dir) = envoy(epp, &REFERENCE).await;
    common::gateway::served(&c, &gateway, 8, "through the pool").await;
    let mut finished = 0;
    for ip in ips {
        let (_, s) = http::get(&c, &format!("http://{ip}:{port}/stats")).await;
        finished += serde_json::from_slice::<serde_json::Value>(&s).unwrap()["finished"]
            .as_u64()
            .unwrap();
    }
    assert_eq!(finished, 8, "every request reached one of the pool's pods");
}
