//! Trust boundaries around etcd, against real etcd and router processes: signed policy
//! pushes, a separate admin listener, and an etcd with TLS and user authentication that
//! every command reaches.

mod common;

use std::path::Path;
use std::process::Command;

use common::etcd::Etcd;
use common::http;
use common::procs::{free_port, mock_worker, serve};
use common::router::{TOKEN, admin_get_text, eventually, metric};
use hyper::StatusCode;
use serde_json::{Value, json};

/// Runs `switchyard ARGS` to completion with `env`: (success, stdout, stderr).
fn cli(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(args)
        .envs(env.iter().copied())
        .env("SWITCHYARD_LOG", "warn")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The endpoint mock workers register under.
const EP: &str = "default/mock/generate";

/// The name of the policy `router` runs for `endpoint` (empty if the admin API has no
/// such endpoint yet).
async fn policy_of(c: &http::HttpClient, router: &str, endpoint: &str) -> String {
    let (s, b) = admin_get_text(c, &format!("{router}/admin/endpoints/{endpoint}/policy")).await;
    if s != StatusCode::OK {
        return String::new();
    }
    serde_json::from_str::<Value>(&b).unwrap()["name"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// `switchyard policy push round-robin --endpoint ENDPOINT ARGS...`, which must succeed;
/// its output.
fn push_round_robin(endpoint: &str, args: &[&str]) -> String {
    let mut all = vec!["policy", "push", "round-robin", "--endpoint", endpoint];
    all.extend_from_slice(args);
    let (ok, out, err) = cli(&all, &[]);
    assert!(ok, "{err}");
    out
}

async fn chat_ok(c: &http::HttpClient, router: &str) {
    let body = json!({"model": "mock", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4});
    let (s, _, b) = http::post_json(c, &format!("{router}/v1/chat/completions"), &body).await;
    assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
}

/// Whoever can write etcd's policy keys cannot change the routing of a router that
/// requires signatures: an unsigned push and one signed by a key it does not trust are
/// refused (counted, the current policy keeps serving); a push signed by its trusted key
/// is applied. Its admin API is on a listener of its own, not on the public one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_requiring_signatures_applies_only_signed_pushes() {
    let etcd = Etcd::start();
    let url = etcd.url();
    let dir = tempfile::tempdir().unwrap();
    let (ops, stranger) = (dir.path().join("ops"), dir.path().join("stranger"));
    for key in [&ops, &stranger] {
        let (ok, out, err) = cli(&["policy", "keygen", "--out", path(key)], &[]);
        assert!(ok, "{err}");
        assert!(out.contains("--policy-trusted-key"), "{out}");
    }
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&ops).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let trusted = format!("{}.pub", path(&ops));

    let (_worker, _) = mock_worker(&["--etcd", &url]).await;
    let admin = format!("127.0.0.1:{}", free_port());
    let (_router, router) = serve(&[
        "--etcd",
        &url,
        "--policy-trusted-key",
        &trusted,
        "--admin-token",
        TOKEN,
        "--admin-listen",
        &admin,
    ])
    .await;
    let admin = format!("http://{admin}");
    let c = http::client();
    chat_ok(&c, &router).await;
    assert_eq!(policy_of(&c, &admin, EP).await, "kv-cost");
    let (s, b) = admin_get_text(&c, &format!("{router}/admin/endpoints")).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(b.contains("admin listener"), "{b}");
    let (s, _) = http::get(&c, &format!("{admin}/v1/models")).await;
    assert_eq!(
        s,
        StatusCode::NOT_FOUND,
        "no client API on the admin listener"
    );

    let push = |extra: &[&str]| {
        let mut args = vec!["--etcd", url.as_str()];
        args.extend_from_slice(extra);
        push_round_robin(EP, &args)
    };
    let unsigned = |c: http::HttpClient, admin: String| async move {
        metric(
            &c,
            &admin,
            "switchyard_policy_refusals_total",
            "reason=\"unsigned\"",
        )
        .await
    };
    push(&[]);
    eventually("the unsigned push refused", || {
        let (c, admin) = (c.clone(), admin.clone());
        async move { unsigned(c, admin).await == 1.0 }
    })
    .await;
    let out = push(&["--sign", path(&stranger)]);
    assert!(out.contains("signed by"), "{out}");
    eventually("the stranger's push refused", || {
        let (c, admin) = (c.clone(), admin.clone());
        async move { unsigned(c, admin).await == 2.0 }
    })
    .await;
    assert_eq!(policy_of(&c, &admin, EP).await, "kv-cost");
    chat_ok(&c, &router).await;
    // An etcd writer's entry claiming 100 chunks that do not exist: the signature is
    // checked before any chunk is read, so it is refused as unsigned at once (reading
    // first would fail on the chunks, or buffer whatever the writer stored).
    let forged = serde_json::json!({
        "sha256": "0".repeat(64), "config": "{}", "wasm_base64": "", "pushed_at": 1, "chunks": 100,
    });
    etcd.api()
        .put(
            &format!("switchyard/policies/{EP}"),
            forged.to_string().as_bytes(),
            None,
        )
        .await
        .unwrap();
    eventually("the forged chunked entry refused", || {
        let (c, admin) = (c.clone(), admin.clone());
        async move { unsigned(c, admin).await == 3.0 }
    })
    .await;

    push(&["--sign", path(&ops)]);
    eventually("the signed push applied", || {
        let (c, admin) = (c.clone(), admin.clone());
        async move { policy_of(&c, &admin, EP).await == "round-robin" }
    })
    .await;
    chat_ok(&c, &router).await;
}

/// An etcd with TLS (its own CA) and user authentication on: every command reaches it
/// with the CA and the user's password (from a file or the environment, never argv), and
/// says what is wrong without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_reaches_an_etcd_with_tls_and_authentication() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = common::tls::self_signed_ca(dir.path());
    let etcd = Etcd::start_tls(cert, key, ca.clone());
    let url = etcd.url();
    let api = etcd.api();
    api.call(
        "/v3/auth/user/add",
        json!({"name": "root", "password": "rootpw"}),
    )
    .await
    .unwrap();
    let _ = api.call("/v3/auth/role/add", json!({"name": "root"})).await;
    api.call(
        "/v3/auth/user/grant",
        json!({"user": "root", "role": "root"}),
    )
    .await
    .unwrap();
    api.call("/v3/auth/enable", json!({})).await.unwrap();
    let password_file = dir.path().join("etcd-password");
    std::fs::write(&password_file, "rootpw\n").unwrap();
    // Private to its user, as every secret file must be.
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&password_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }

    // `switchyard instances` with the CA, and the user if given.
    let instances = |user: bool, env: &[(&str, &str)]| {
        let mut args = vec!["instances", "--etcd", &url, "--etcd-ca-file", path(&ca)];
        if user {
            args.extend_from_slice(&["--etcd-user", "root"]);
        }
        cli(&args, env)
    };
    let (ok, _, err) = cli(&["instances", "--etcd", &url], &[]);
    assert!(!ok);
    assert!(err.contains("certificate"), "{err}");
    let (ok, _, err) = instances(false, &[]);
    assert!(
        !ok,
        "an etcd with authentication on answered without credentials"
    );
    assert!(
        err.contains("user name") || err.contains("permission"),
        "{err}"
    );
    let (ok, _, err) = instances(true, &[]);
    assert!(!ok);
    assert!(err.contains("no password"), "{err}");
    let (ok, _, err) = instances(true, &[("SWITCHYARD_ETCD_PASSWORD", "wrong")]);
    assert!(!ok);
    assert!(err.contains("refused user `root`"), "{err}");

    let access = [
        "--etcd",
        &url,
        "--etcd-ca-file",
        path(&ca),
        "--etcd-user",
        "root",
        "--etcd-password-file",
        path(&password_file),
    ];
    let (_worker, worker) = mock_worker(&access).await;
    let mut serve_args = access.to_vec();
    serve_args.extend_from_slice(&["--admin-token", TOKEN]);
    let (_router, router) = serve(&serve_args).await;
    let c = http::client();
    chat_ok(&c, &router).await;
    let (ok, out, err) = instances(true, &[("SWITCHYARD_ETCD_PASSWORD", "rootpw")]);
    assert!(ok, "{err}");
    assert!(out.contains(&worker), "{out}");

    push_round_robin(EP, &access);
    eventually("the pushed policy", || {
        let (c, router) = (c.clone(), router.clone());
        async move { policy_of(&c, &router, EP).await == "round-robin" }
    })
    .await;
}

/// Pushed policies are state, not events: a replica started after a push runs it, a
/// deleted push returns every replica to its configured policy, and a push for a model
/// whose workers register later applies when they do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_replica_runs_what_etcd_holds_whenever_it_starts() {
    let etcd = Etcd::start();
    let url = etcd.url();
    let c = http::client();
    let (_worker, _) = mock_worker(&["--etcd", &url]).await;
    let (_a, a) = serve(&["--etcd", &url, "--admin-token", TOKEN]).await;
    chat_ok(&c, &a).await;
    push_round_robin(EP, &["--etcd", &url]);
    eventually("the push on the running replica", || async {
        policy_of(&c, &a, EP).await == "round-robin"
    })
    .await;

    // A replica started after the push runs it from the moment it is ready (it is not
    // ready before its policies are reconciled).
    let (_b, b) = serve(&["--etcd", &url, "--admin-token", TOKEN]).await;
    assert_eq!(policy_of(&c, &b, EP).await, "round-robin");
    chat_ok(&c, &b).await;

    // Deleting the push returns both to their configured policy.
    let (ok, out, err) = cli(&["policy", "remove", "--etcd", &url, "--endpoint", EP], &[]);
    assert!(ok, "{err}");
    assert!(out.contains("removed the push"), "{out}");
    for r in [&a, &b] {
        eventually("back to the configured policy", || async {
            policy_of(&c, r, EP).await == "kv-cost"
        })
        .await;
    }

    // A push for a model with no worker yet applies when its first worker registers.
    let late = "default/late/generate";
    push_round_robin(late, &["--etcd", &url]);
    let listen = format!("127.0.0.1:{}", free_port());
    let _late_worker = common::procs::switchyard(&[
        "mock-worker",
        "--listen",
        &listen,
        "--model",
        "late",
        "--etcd",
        &url,
    ]);
    common::procs::wait_ok(&format!("http://{listen}/v1/models")).await;
    // The new model is seen by every replica through the watch on the instances prefix
    // within a second, not at the next periodic listing (30 s away).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
    for r in [&a, &b] {
        loop {
            let (_, body) = http::get(&c, &format!("{r}/v1/models")).await;
            if String::from_utf8_lossy(&body).contains("\"late\"") {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the new model was not discovered from the watch within a second"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
    for r in [&a, &b] {
        eventually("the push for the model that came later", || async {
            policy_of(&c, r, late).await == "round-robin"
        })
        .await;
    }
}

/// The shadow of an endpoint, from the admin API (`Null` when none).
async fn shadow_of(c: &http::HttpClient, router: &str) -> Value {
    let (s, b) = admin_get_text(c, &format!("{router}/admin/endpoints/{EP}/shadow")).await;
    if s != StatusCode::OK {
        return Value::Null;
    }
    serde_json::from_str(&b).unwrap()
}

/// A shadow pushed through etcd is attached by a replica already running and by one
/// started after the push, beside the live policy, which keeps serving; removing it
/// removes it everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_pushed_through_etcd_reaches_every_replica_and_leaves_with_its_push() {
    let etcd = Etcd::start();
    let url = etcd.url();
    let (_worker, _) = mock_worker(&["--etcd", &url]).await;
    let (_r1, first) = serve(&["--etcd", &url, "--admin-token", TOKEN]).await;
    let c = http::client();
    chat_ok(&c, &first).await;
    let push_shadow = |sample: &str| {
        let args = [
            "policy",
            "push",
            "round-robin",
            "--shadow",
            "--sample",
            sample,
        ];
        cli(
            &[&args[..], &["--etcd", &url, "--endpoint", EP]].concat(),
            &[],
        )
    };
    let (ok, out, err) = push_shadow("0.5");
    assert!(ok, "{err}");
    assert!(out.contains("pushed shadow round-robin"), "{out}");
    let (ok, _, err) = push_shadow("1.5");
    assert!(!ok && err.contains("(0, 1]"), "{err}");
    let (_r2, second) = serve(&["--etcd", &url, "--admin-token", TOKEN]).await;
    chat_ok(&c, &second).await;
    for router in [&first, &second] {
        eventually("the shadow attached", || {
            let (c, router) = (c.clone(), router.clone());
            async move {
                let s = shadow_of(&c, &router).await;
                s["name"] == "round-robin" && s["sample"] == 0.5
            }
        })
        .await;
        assert_eq!(
            policy_of(&c, router, EP).await,
            "kv-cost",
            "the live policy is unchanged"
        );
    }
    for _ in 0..4 {
        chat_ok(&c, &first).await;
    }
    eventually("the shadow offered half the decisions", || {
        let (c, first) = (c.clone(), first.clone());
        async move { shadow_of(&c, &first).await["offered"].as_u64() >= Some(2) }
    })
    .await;

    let (ok, out, err) = cli(
        &[
            "policy",
            "remove",
            "--shadow",
            "--etcd",
            &url,
            "--endpoint",
            EP,
        ],
        &[],
    );
    assert!(ok, "{err}");
    assert!(out.contains("removed the shadow"), "{out}");
    for router in [&first, &second] {
        eventually("the shadow removed", || {
            let (c, router) = (c.clone(), router.clone());
            async move { shadow_of(&c, &router).await.is_null() }
        })
        .await;
        assert_eq!(policy_of(&c, router, EP).await, "kv-cost");
        chat_ok(&c, router).await;
    }
}
