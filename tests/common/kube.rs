//! A real Kubernetes API server for a test (built from Debian's source package by
//! `tools/kube-apiserver.sh`, which `tools/test.sh` runs), on a real etcd of its own:
//! RBAC on, a self-signed certificate, and two bearer tokens — an administrator
//! (`system:masters`) for the test's own calls, and `reader`, who may do nothing until
//! a test grants it a role. No scheduler and no kubelet: a test creates pods and writes
//! their status (IP, readiness) itself, as a kubelet would.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, StatusCode};
use serde_json::{Value, json};

use super::etcd::Etcd;
use super::procs::{Proc, free_port};

/// The administrator's token.
pub const ADMIN: &str = "admin-token-for-the-tests";
/// The token of `reader`, a user with no role until a test binds one.
pub const READER: &str = "reader-token-for-the-tests";

fn kube_path() -> PathBuf {
    let home = std::env::var_os("SWITCHYARD_KUBE_HOME").map_or_else(
        || {
            PathBuf::from(std::env::var_os("HOME").expect("HOME"))
                .join(".cache/switchyard/kube-apiserver")
        },
        PathBuf::from,
    );
    home.join("kube-apiserver")
}

/// Whether this test goes without the API server (see `goes_without`).
pub fn no_kube() -> bool {
    super::goes_without("kube-apiserver (tools/kube-apiserver.sh)", &kube_path())
}

/// `kubectl` on the PATH (Debian's `kubernetes-client`, which `tools/test.sh`
/// installs when none is there).
fn kubectl_path() -> PathBuf {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join("kubectl"))
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("/usr/bin/kubectl"))
}

/// Whether this test goes without `kubectl` (see `goes_without`).
pub fn no_kubectl() -> bool {
    super::goes_without("kubectl (tools/test.sh)", &kubectl_path())
}

type Client = hyper_util::client::legacy::Client<switchyard::net::upstream::Connector, Full<Bytes>>;

/// A running API server.
pub struct Kube {
    proc: Option<Proc>,
    /// Its storage.
    pub etcd: Etcd,
    /// Flags of its own for this test's server.
    extra: Vec<String>,
    port: u16,
    dir: tempfile::TempDir,
    client: Client,
    /// `https://127.0.0.1:PORT`.
    pub url: String,
}

impl Kube {
    /// Starts etcd and the API server, and waits until it is ready.
    pub async fn start() -> Kube {
        Kube::start_with(&[]).await
    }

    /// [`Kube::start`] with these flags too (`--watch-cache=false`, say).
    pub async fn start_with(extra: &[&str]) -> Kube {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("tokens.csv"),
            format!("{ADMIN},admin,1,\"system:masters\"\n{READER},reader,2\n"),
        )
        .unwrap();
        let key = dir.path().join("sa.key");
        openssl(&["genrsa", "-out", key.to_str().unwrap(), "2048"]);
        // A client CA, and `reader`'s certificate signed by it (kubeconfigs of kind and
        // minikube authenticate so).
        let at = |f: &str| dir.path().join(f).to_str().unwrap().to_string();
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &at("client-ca.key"),
            "-out",
            &at("client-ca.crt"),
            "-subj",
            "/CN=client-ca",
            "-days",
            "2",
        ]);
        openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &at("reader.key"),
            "-out",
            &at("reader.csr"),
            "-subj",
            "/CN=reader",
        ]);
        // An X.509 v3 certificate for client authentication (what TLS libraries take).
        std::fs::write(
            dir.path().join("client.ext"),
            "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n",
        )
        .unwrap();
        openssl(&[
            "x509",
            "-extfile",
            &at("client.ext"),
            "-req",
            "-in",
            &at("reader.csr"),
            "-CA",
            &at("client-ca.crt"),
            "-CAkey",
            &at("client-ca.key"),
            "-CAcreateserial",
            "-out",
            &at("reader.crt"),
            "-days",
            "2",
        ]);
        let port = free_port();
        let mut kube = Kube {
            proc: None,
            etcd: Etcd::start(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            port,
            client: client(&dir.path().join("certs/apiserver.crt")),
            dir,
            url: format!("https://127.0.0.1:{port}"),
        };
        kube.spawn().await;
        kube
    }

    /// `reader`'s client certificate and key (PEM files).
    pub fn reader_identity(&self) -> (PathBuf, PathBuf) {
        (
            self.dir.path().join("reader.crt"),
            self.dir.path().join("reader.key"),
        )
    }

    /// The server's certificate, to trust.
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("certs/apiserver.crt")
    }

    /// `kubectl ARGS` as the administrator in `default` (no kubeconfig of the
    /// machine's): whether it succeeded, and what it printed.
    pub fn kubectl(&self, args: &[&str]) -> (bool, String) {
        let config = self.dir.path().join("kubeconfig");
        std::fs::write(&config, "apiVersion: v1\nkind: Config\n").unwrap();
        let out = Command::new(kubectl_path())
            .env("KUBECONFIG", &config)
            .env("HOME", self.dir.path())
            .arg(format!("--server={}", self.url))
            .arg(format!("--token={ADMIN}"))
            .arg(format!("--certificate-authority={}", self.ca().display()))
            .arg("--namespace=default")
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("kubectl runs");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }

    /// A file holding `token`, for the router's `--kube-token-file`.
    pub fn token_file(&self, token: &str) -> PathBuf {
        let path = self.dir.path().join(format!("token-{}", token.len()));
        std::fs::write(&path, token).unwrap();
        path
    }

    async fn spawn(&mut self) {
        let d = self.dir.path();
        let arg = |k: &str, v: &str| format!("--{k}={v}");
        let key = d.join("sa.key");
        let child = Command::new(kube_path())
            .args([
                arg("etcd-servers", &self.etcd.url()),
                arg("bind-address", "127.0.0.1"),
                arg("advertise-address", "127.0.0.1"),
                arg("secure-port", &self.port.to_string()),
                arg("insecure-port", "0"),
                arg("cert-dir", d.join("certs").to_str().unwrap()),
                arg("token-auth-file", d.join("tokens.csv").to_str().unwrap()),
                arg("client-ca-file", d.join("client-ca.crt").to_str().unwrap()),
                arg("authorization-mode", "RBAC"),
                arg("service-account-issuer", "https://kubernetes.default.svc"),
                arg("service-account-key-file", key.to_str().unwrap()),
                arg("service-account-signing-key-file", key.to_str().unwrap()),
                arg("disable-admission-plugins", "ServiceAccount"),
                arg("endpoint-reconciler-type", "none"),
                arg("service-cluster-ip-range", "10.96.0.0/24"),
                "--v=0".to_string(),
            ])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(if std::env::var_os("SWITCHYARD_TEST_LOG").is_some() {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .spawn()
            .expect("kube-apiserver starts");
        self.proc = Some(Proc(child));
        // The certificate is written at start: a client trusting it is made once it is.
        for _ in 0..1200 {
            if let Some(exit) = self.proc.as_mut().unwrap().0.try_wait().unwrap() {
                panic!("kube-apiserver exited at start ({exit}); SWITCHYARD_TEST_LOG=1 shows why");
            }
            if self.ca().exists() {
                self.client = client(&self.ca());
                // Ready, and its bootstrap has made the `default` namespace (readyz can
                // answer before it does).
                if self.get("/readyz").await.0 == StatusCode::OK
                    && self.get("/api/v1/namespaces/default").await.0 == StatusCode::OK
                {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("kube-apiserver never became ready");
    }

    /// Stops the server (SIGKILL) and starts it again on the same port and etcd.
    pub async fn restart(&mut self) {
        drop(self.proc.take());
        self.spawn().await;
    }

    /// Stops the server; the router then finds nothing there.
    pub fn stop(&mut self) {
        drop(self.proc.take());
    }

    /// Starts a stopped server again.
    pub async fn resume(&mut self) {
        self.spawn().await;
    }

    /// One call as the administrator: its status and JSON answer.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<(&str, Value)>,
    ) -> (StatusCode, Value) {
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.url))
            .header("authorization", format!("Bearer {ADMIN}"));
        let payload = match body {
            Some((content_type, v)) => {
                req = req.header("content-type", content_type);
                Bytes::from(v.to_string())
            }
            None => Bytes::new(),
        };
        let req = req.body(Full::new(payload)).unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(30), self.client.request(req)).await;
        let Ok(Ok(resp)) = answer else {
            return (StatusCode::SERVICE_UNAVAILABLE, Value::Null);
        };
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    /// `GET path`.
    pub async fn get(&self, path: &str) -> (StatusCode, Value) {
        self.call(Method::GET, path, None).await
    }

    /// Creates `object` at `path` (a collection); panics unless it is created.
    pub async fn create(&self, path: &str, object: Value) -> Value {
        let (s, v) = self
            .call(Method::POST, path, Some(("application/json", object)))
            .await;
        assert_eq!(s, StatusCode::CREATED, "POST {path}: {v}");
        v
    }

    /// A merge patch of the object at `path`.
    pub async fn patch(&self, path: &str, patch: Value) {
        let (s, v) = self
            .call(
                Method::PATCH,
                path,
                Some(("application/merge-patch+json", patch)),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "PATCH {path}: {v}");
    }

    /// Deletes the object at `path` at once.
    pub async fn delete(&self, path: &str) {
        let body = json!({"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0});
        let (s, v) = self
            .call(Method::DELETE, path, Some(("application/json", body)))
            .await;
        assert!(s.is_success(), "DELETE {path}: {s} {v}");
    }

    /// A pod labelled `labels`, as a kubelet would leave it once running: `ip`, Ready
    /// (or not).
    pub async fn pod(&self, name: &str, labels: Value, ip: &str, ready: bool) {
        self.annotated_pod(name, labels, json!({}), ip, ready).await
    }

    /// A pod as `pod` makes it, with these annotations.
    pub async fn annotated_pod(
        &self,
        name: &str,
        labels: Value,
        annotations: Value,
        ip: &str,
        ready: bool,
    ) {
        let pod = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": labels, "annotations": annotations},
            "spec": {"containers": [{"name": "engine", "image": "engine"}]}});
        self.create("/api/v1/namespaces/default/pods", pod).await;
        self.set_ready(name, ip, ready).await;
    }

    /// Writes a pod's status, as its kubelet would.
    pub async fn set_ready(&self, name: &str, ip: &str, ready: bool) {
        let status = if ready { "True" } else { "False" };
        let patch = json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": status}]}});
        self.patch(
            &format!("/api/v1/namespaces/default/pods/{name}/status"),
            patch,
        )
        .await;
    }

    /// GIE's `InferencePool` kind (the parts discovery reads), established.
    pub async fn pool_crd(&self) {
        let crd = json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": "inferencepools.inference.networking.k8s.io",
                "annotations": {"api-approved.kubernetes.io": "https://github.com/kubernetes-sigs/gateway-api-inference-extension"}},
            "spec": {"group": "inference.networking.k8s.io", "scope": "Namespaced",
                "names": {"plural": "inferencepools", "singular": "inferencepool", "kind": "InferencePool"},
                "versions": [{"name": "v1", "served": true, "storage": true,
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}]}});
        self.create(
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
            crd,
        )
        .await;
        super::router::eventually("the InferencePool kind served", || async {
            self.get("/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools")
                .await
                .0
                == StatusCode::OK
        })
        .await;
    }

    /// Lets `reader` get, list and watch pods and pools in `default`.
    pub async fn grant_reader(&self) {
        let role = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "pool-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"], "verbs": ["get", "list", "watch"]}]});
        self.create(
            "/apis/rbac.authorization.k8s.io/v1/namespaces/default/roles",
            role,
        )
        .await;
        self.bind("pool-reader", "reader").await;
    }

    /// Binds the Role `role` in `default` to the user `user`.
    pub async fn bind(&self, role: &str, user: &str) {
        let binding = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": format!("{user}-as-{role}")},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]});
        self.create(
            "/apis/rbac.authorization.k8s.io/v1/namespaces/default/rolebindings",
            binding,
        )
        .await;
    }
}

/// `openssl ARGS`, which must succeed.
fn openssl(args: &[&str]) {
    let ok = Command::new("openssl")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("openssl runs");
    assert!(ok.success(), "openssl {} failed", args.join(" "));
}

fn client(ca: &std::path::Path) -> Client {
    let tls = if ca.exists() {
        switchyard::net::upstream::Tls::with_ca_files(&[ca.to_path_buf()]).unwrap()
    } else {
        switchyard::net::upstream::Tls::default()
    };
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(tls.connector(Duration::from_secs(5)))
}
