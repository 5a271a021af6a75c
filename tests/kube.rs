//! Kubernetes discovery against a real kube-apiserver (`tests/common/kube.rs`): a GIE
//! `InferencePool` whose pods are mock workers on 127.0.0.x, their status written as a
//! kubelet would. Pods join when Ready, leave when unready or deleted, the pool's
//! selector is followed, the watch outlives the API server's restart, and a router
//! without the permissions says which.

mod common;

use std::io::BufRead as _;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::json;

use common::gateway::served;
use common::http;
use common::kube::{Kube, READER};
use common::procs::{Proc, free_port, serve, switchyard, wait_ok};
use common::router::{TOKEN, admin_post, available, eventually, instances};

/// A mock worker on `ip:port`.
async fn worker(ip: &str, port: u16) -> Proc {
    worker_with(ip, port, &[]).await
}

/// A mock worker on `ip:port` with these flags too.
async fn worker_with(ip: &str, port: u16, extra: &[&str]) -> Proc {
    let listen = format!("{ip}:{port}");
    let mut args = vec!["mock-worker", "--listen", &listen, "--model", "mock"];
    args.extend_from_slice(extra);
    let p = switchyard(&args);
    wait_ok(&format!("http://{listen}/v1/models")).await;
    p
}

/// GIE's pool kind, `reader` allowed to read it, and a pool `name` of the `app=mock`
/// pods on a free port: that port.
async fn pool(kube: &Kube, name: &str) -> u16 {
    kube.pool_crd().await;
    kube.grant_reader().await;
    let port = free_port();
    let pool = json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": name},
        "spec": {"selector": {"matchLabels": {"app": "mock"}}, "targetPorts": [{"number": port}]}});
    kube.create(
        "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools",
        pool,
    )
    .await;
    port
}

/// Completions the worker at `url` finished.
async fn finished(c: &http::HttpClient, url: &str) -> u64 {
    let (_, s) = http::get(c, &format!("{url}/stats")).await;
    serde_json::from_slice::<serde_json::Value>(&s).unwrap()["finished"]
        .as_u64()
        .unwrap_or(0)
}

/// The router's flags for the fleet `fleet` names (`["--kube-pool", NAME]`, or a
/// selector and its ports) as `token`'s user.
fn router_args(kube: &Kube, fleet: &[&str], token: &str) -> Vec<String> {
    let token_file = kube.token_file(token);
    let ca = kube.ca();
    let mut args: Vec<String> = fleet.iter().map(|s| s.to_string()).collect();
    args.extend(
        [
            "--model",
            "mock",
            "--kube-namespace",
            "default",
            "--kube-api",
            &kube.url,
            "--kube-token-file",
            token_file.to_str().unwrap(),
            "--kube-ca-file",
            ca.to_str().unwrap(),
            "--admin-token",
            TOKEN,
            "--health-check-interval-ms",
            "0",
        ]
        .map(String::from),
    );
    args
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pools_ready_pods_are_the_fleet_as_they_come_and_go() {
    if common::kube::no_kube() {
        return;
    }
    let kube = Kube::start().await;
    let port = pool(&kube, "mock-pool").await;
    let ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4"];
    let mut workers = Vec::new();
    for ip in ips {
        workers.push(worker(ip, port).await);
    }
    let url_of = |ip: &str| format!("http://{ip}:{port}");
    kube.pod("a", json!({"app": "mock"}), ips[0], true).await;
    kube.pod("b", json!({"app": "mock"}), ips[1], true).await;
    // Another app's pod, on the same port: never the pool's.
    kube.pod("other", json!({"app": "other"}), ips[2], true)
        .await;

    let args = router_args(&kube, &["--kube-pool", "mock-pool"], READER);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (_router, url) = serve(&args).await;
    let c = http::client();
    eventually("the pool's two Ready pods", || async {
        available(&c, &url).await == 2
    })
    .await;
    served(&c, &url, 6, "two pods").await;
    assert_eq!(
        finished(&c, &url_of(ips[2])).await,
        0,
        "another app's pod was used"
    );

    // Scale up: a third pod, not Ready yet, then Ready.
    kube.pod("c", json!({"app": "mock"}), ips[2], false).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(available(&c, &url).await, 2, "an unready pod joined");
    kube.set_ready("c", ips[2], true).await;
    eventually("the third pod once Ready", || async {
        available(&c, &url).await == 3
    })
    .await;

    // A pod turning unready leaves every decision once the router sees it.
    kube.set_ready("a", ips[0], false).await;
    eventually("the unready pod gone", || async {
        available(&c, &url).await == 2
    })
    .await;
    let before = finished(&c, &url_of(ips[0])).await;
    served(&c, &url, 8, "a unready").await;
    assert_eq!(
        finished(&c, &url_of(ips[0])).await,
        before,
        "sent to an unready pod"
    );

    // Scale down: a deleted pod leaves.
    kube.delete("/api/v1/namespaces/default/pods/b").await;
    eventually("the deleted pod gone", || async {
        available(&c, &url).await == 1
    })
    .await;
    served(&c, &url, 4, "one pod").await;

    // The pool's selector changes: its fleet is the other app's pods now.
    kube.patch(
        "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools/mock-pool",
        json!({"spec": {"selector": {"matchLabels": {"app": "other"}}}}),
    )
    .await;
    eventually("the pool's new selector followed", || async {
        let v = instances(&c, &url).await;
        let urls: Vec<String> = v["instances"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|i| i["available"] == true)
            .map(|i| i["url"].as_str().unwrap_or_default().to_string())
            .collect();
        urls == [url_of(ips[2])]
    })
    .await;
    drop(workers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_outlives_the_api_server_and_the_fleet_meanwhile_serves() {
    if common::kube::no_kube() {
        return;
    }
    let mut kube = Kube::start().await;
    let port = pool(&kube, "p").await;
    let _a = worker("127.0.0.5", port).await;
    let _b = worker("127.0.0.6", port).await;
    kube.pod("a", json!({"app": "mock"}), "127.0.0.5", true)
        .await;
    let args = router_args(&kube, &["--kube-pool", "p"], READER);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (_router, url) = serve(&args).await;
    let c = http::client();
    eventually("the first pod", || async { available(&c, &url).await == 1 }).await;

    // The API server gone: decisions go on from the last state.
    kube.stop();
    served(&c, &url, 4, "no API server").await;
    kube.resume().await;
    // Back: what changed is seen.
    kube.pod("b", json!({"app": "mock"}), "127.0.0.6", true)
        .await;
    eventually("the pod made after the restart", || async {
        available(&c, &url).await == 2
    })
    .await;
    kube.restart().await;
    kube.set_ready("a", "127.0.0.5", false).await;
    eventually("a change after a second restart", || async {
        available(&c, &url).await == 1
    })
    .await;
    served(&c, &url, 4, "after the restarts").await;
}

/// Without the permissions, the router says which verb on which resource it lacks
/// (and serves nothing it cannot know).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_permissions_are_named() {
    if common::kube::no_kube() {
        return;
    }
    let kube = Kube::start().await;
    kube.pool_crd().await;
    let listen = format!("127.0.0.1:{}", free_port());
    let mut args = vec!["serve".to_string(), "--listen".into(), listen];
    args.extend(router_args(&kube, &["--kube-pool", "p"], READER));
    let mut child = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(args.iter().filter(|a| *a != "--admin-token" && *a != TOKEN))
        .env("SWITCHYARD_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let _proc = Proc(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    // The endpoint's router is made at the first request.
    wait_ok(&format!("http://{}/health", args[2])).await;
    let c = http::client();
    let _ = http::send(
        &c,
        hyper::Method::POST,
        &format!("http://{}/v1/completions", args[2]),
        &[("content-type", "application/json")],
        json!({"model": "mock", "prompt": "hi", "max_tokens": 2}).to_string(),
        Duration::from_secs(10),
    )
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut seen = Vec::new();
    while std::time::Instant::now() < deadline {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(line) => {
                if line.contains("403") && line.contains("inferencepools") {
                    assert!(line.contains("cannot get resource"), "{line}");
                    return;
                }
                seen.push(line);
            }
            Err(_) => continue,
        }
    }
    panic!(
        "no error naming the missing permission:\n{}",
        seen.join("\n")
    );
}

/// What the router would do with `request`, and why (its admin `explain`).
async fn explain(
    c: &http::HttpClient,
    url: &str,
    request: &serde_json::Value,
) -> serde_json::Value {
    let at = format!("{url}/admin/endpoints/default/mock/generate/explain");
    let (status, v, _) = admin_post(c, &at, request).await;
    assert!(status.is_success(), "{status}");
    v
}

/// A pod's annotations name its engine's KV event sockets: the router subscribes to
/// them and sees the pod's cache exactly (not a prediction from its own decisions).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pods_kv_event_annotations_feed_the_index() {
    if common::kube::no_kube() {
        return;
    }
    let kube = Kube::start().await;
    kube.grant_reader().await;
    let (port, events) = (free_port(), free_port());
    let events_arg = events.to_string();
    // The mock publishes vLLM's ZMQ events on `events` and its replay socket on the next.
    let _w = worker_with("127.0.0.9", port, &["--zmq-events", &events_arg]).await;
    let _plain = worker("127.0.0.10", port).await;
    kube.annotated_pod(
        "publishing",
        json!({"app": "mock"}),
        json!({"switchyard.dev/kv-events-port": events_arg,
            "switchyard.dev/kv-replay-port": (events + 1).to_string(),
            "switchyard.dev/kv-topic": "kv-events"}),
        "127.0.0.9",
        true,
    )
    .await;
    kube.pod("plain", json!({"app": "mock"}), "127.0.0.10", true)
        .await;
    let port_arg = port.to_string();
    let selector = ["--kube-selector", "app=mock", "--kube-port", &port_arg];
    let args = router_args(&kube, &selector, READER);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (_router, url) = serve(&args).await;
    let c = http::client();
    eventually("both pods", || async { available(&c, &url).await == 2 }).await;
    let prompt: String = (0..400).map(|i| format!("w{i} ")).collect();
    let request = json!({"model": "mock", "prompt": prompt, "max_tokens": 4});
    let views = |e: &serde_json::Value| -> Vec<String> {
        let mut v: Vec<String> = e["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["cache_view"].as_str().unwrap_or_default().to_string())
            .collect();
        v.sort();
        v
    };
    let e = explain(&c, &url, &request).await;
    assert!(
        views(&e).contains(&"events".to_string()),
        "the annotated pod's view is its events: {e}"
    );
    assert_ne!(
        views(&e),
        ["events", "events"],
        "the plain pod has none: {e}"
    );
    // Served by the publishing pod's engine (asked directly), its blocks reach the
    // router through its events.
    let (status, v, _) = http::post_json(
        &c,
        &format!("http://127.0.0.9:{port}/v1/completions"),
        &request,
    )
    .await;
    assert!(status.is_success(), "{v}");
    let blocks = e["prompt_blocks"].clone();
    eventually("the published blocks", || async {
        common::router::published(&explain(&c, &url, &request).await, &blocks)
    })
    .await;
}

/// Outside a pod, a kubeconfig names the server, its CA, the user and the namespace:
/// `reader` by its client certificate (as kind's and minikube's kubeconfigs do), or by
/// a bearer token in another context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubeconfig_names_the_server_the_user_and_the_namespace() {
    if common::kube::no_kube() {
        return;
    }
    let kube = Kube::start().await;
    kube.grant_reader().await;
    let port = free_port();
    let _w = worker("127.0.0.14", port).await;
    kube.pod("a", json!({"app": "mock"}), "127.0.0.14", true)
        .await;
    // Paths relative to the kubeconfig's directory, as kubectl reads them.
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = kube.reader_identity();
    std::fs::copy(kube.ca(), dir.path().join("ca.crt")).unwrap();
    std::fs::copy(&cert, dir.path().join("reader.crt")).unwrap();
    std::fs::copy(&key, dir.path().join("reader.key")).unwrap();
    let config = dir.path().join("config");
    std::fs::write(
        &config,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: by-cert\n\
             clusters:\n- name: test\n  cluster:\n    server: {}\n    certificate-authority: ca.crt\n\
             contexts:\n- name: by-cert\n  context: {{cluster: test, user: cert, namespace: default}}\n\
             - name: by-token\n  context: {{cluster: test, user: bearer, namespace: default}}\n\
             users:\n- name: cert\n  user: {{client-certificate: reader.crt, client-key: reader.key}}\n\
             - name: bearer\n  user: {{token: {READER}}}\n",
            kube.url
        ),
    )
    .unwrap();
    let port_arg = port.to_string();
    let c = http::client();
    for context in ["by-cert", "by-token"] {
        let (_router, url) = serve(&[
            "--model",
            "mock",
            "--kube-selector",
            "app=mock",
            "--kube-port",
            &port_arg,
            "--kubeconfig",
            config.to_str().unwrap(),
            "--kube-context",
            context,
            "--admin-token",
            TOKEN,
            "--health-check-interval-ms",
            "0",
        ])
        .await;
        eventually(&format!("the pod, as {context}"), || async {
            available(&c, &url).await == 1
        })
        .await;
        served(&c, &url, 2, context).await;
    }
    // The router with this kubeconfig and `extra` stops at start, saying `why`.
    let config = config.to_str().unwrap();
    let refused = |extra: &[&str], why: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
            .args(["serve", "--model", "mock", "--kube-selector", "app=mock"])
            .args(["--kubeconfig", config])
            .args(extra)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && said.contains(why), "{said}");
    };
    // A context that does not exist, named.
    refused(&["--kube-context", "nope"], "no context `nope`");
    // A CA file beside a kubeconfig, whose cluster names its own: refused, not ignored.
    refused(&["--kube-ca-file", config], "give one or the other");
}

/// A watch from a resource version the API server no longer holds (its storage
/// compacted past it) is answered `410 Gone` by the real server, and the router's client
/// reads it as such (on which discovery lists again: `tests/kube_faults.rs` holds that
/// loop to its bound); a watch from the list's version is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_servers_410_for_a_stale_watch_is_read_as_gone() {
    use switchyard::discovery::kube_api::{KubeApi, KubeError, Token};
    if common::kube::no_kube() {
        return;
    }
    // Watches straight from etcd (no watch cache, which would keep recent history).
    let kube = Kube::start_with(&["--watch-cache=false"]).await;
    kube.grant_reader().await;
    for i in 0..3 {
        kube.pod(&format!("p{i}"), json!({"app": "mock"}), "127.0.0.15", true)
            .await;
    }
    // etcd compacts its history up to now (its JSON gateway).
    let c = http::client();
    let etcd = kube.etcd.url();
    let (_, head, _) =
        http::post_json(&c, &format!("{etcd}/v3/kv/range"), &json!({"key": "YQ=="})).await;
    let revision = head["header"]["revision"].as_str().unwrap().to_string();
    let (status, v, _) = http::post_json(
        &c,
        &format!("{etcd}/v3/kv/compaction"),
        &json!({"revision": revision, "physical": true}),
    )
    .await;
    assert!(status.is_success(), "{v}");
    let tls = switchyard::net::upstream::Tls::with_ca_files(&[kube.ca()]).unwrap();
    let api = KubeApi::new(
        &kube.url,
        Some(Token::Fixed(READER.into())),
        &tls,
        Duration::from_secs(10),
    );
    let list_path = "/api/v1/namespaces/default/pods?labelSelector=app%3Dmock";
    let watch = |version: &str| {
        format!(
            "{list_path}&watch=1&allowWatchBookmarks=true&timeoutSeconds=5&resourceVersion={version}"
        )
    };
    let gone = match api
        .watch(&watch("2"), "watch pods", Duration::from_secs(10))
        .await
    {
        Err(e) => e,
        Ok(mut w) => w
            .next()
            .await
            .expect_err("a compacted version yields no event"),
    };
    assert!(matches!(gone, KubeError::Gone), "{gone:?}");
    let list = api.get(list_path, "list pods").await.unwrap();
    let version = list["metadata"]["resourceVersion"].as_str().unwrap();
    let mut w = api
        .watch(&watch(version), "watch pods", Duration::from_secs(10))
        .await
        .unwrap();
    kube.set_ready("p0", "127.0.0.15", false).await;
    let event = w.next().await.unwrap().expect("the change");
    assert_eq!(event.kind, "MODIFIED");
}

/// Thousands of pods: every Ready one followed, from one list and the watch after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_pods_are_followed() {
    const PODS: usize = 2000;
    if common::kube::no_kube() {
        return;
    }
    let kube = std::sync::Arc::new(Kube::start().await);
    kube.grant_reader().await;
    let made = std::time::Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for lane in 0..16 {
        let kube = kube.clone();
        set.spawn(async move {
            for i in (lane..PODS).step_by(16) {
                let ip = format!("127.1.{}.{}", i / 250, i % 250 + 1);
                kube.pod(&format!("w{i}"), json!({"app": "many"}), &ip, true)
                    .await;
            }
        });
    }
    set.join_all().await;
    eprintln!("{PODS} pods made in {:?}", made.elapsed());
    let mut args = router_args(
        &kube,
        &["--kube-selector", "app=many", "--kube-port", "8000"],
        READER,
    );
    args.extend(["--engine-metrics-ms", "0"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (router, url) = serve(&args).await;
    let c = http::client();
    eventually("every pod", || async { available(&c, &url).await == PODS }).await;
    // Changes after the list come through the watch.
    kube.set_ready("w7", "127.1.0.8", false).await;
    eventually("one pod fewer", || async {
        available(&c, &url).await == PODS - 1
    })
    .await;
    let status = std::fs::read_to_string(format!("/proc/{}/status", router.0.id())).unwrap();
    let rss = status
        .lines()
        .find(|l| l.starts_with("VmRSS"))
        .unwrap_or("");
    eprintln!("the router following {PODS} pods: {rss}");
}
