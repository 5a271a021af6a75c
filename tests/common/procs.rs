//! Real `switchyard` processes for end-to-end tests, killed when dropped.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::http;

/// A child process, killed and reaped on drop.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    /// Sends SIGTERM (a graceful stop).
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A port nothing listens on, for a process to bind later: below the kernel's ephemeral
/// range and never the same twice in a process (the lab's allocator, which says why).
pub fn free_port() -> u16 {
    switchyard::replay::external::free_port().expect("a free port")
}

/// Starts `switchyard ARGS...`. An `--admin-token TOKEN` among them is passed in the
/// environment instead (`SWITCHYARD_ADMIN_TOKEN`), as the router requires: a token on its
/// command line is refused.
pub fn switchyard(args: &[&str]) -> Proc {
    let cache = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("policy-cache");
    switchyard_with_cache(args, &cache)
}

/// [`switchyard`] with compiled policies cached in `cache` (a benchmark's own, so that its
/// first loads compile).
pub fn switchyard_with_cache(args: &[&str], cache: &std::path::Path) -> Proc {
    let log = std::env::var_os("SWITCHYARD_TEST_LOG").is_some();
    let mut rest = Vec::with_capacity(args.len());
    let mut token = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if *a == "--admin-token" {
            token = it.next().copied();
        } else {
            rest.push(*a);
        }
    }
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_switchyard"));
    if let Some(t) = token {
        cmd.env("SWITCHYARD_ADMIN_TOKEN", t);
    }
    Proc(
        cmd.args(&rest)
            .env("SWITCHYARD_POLICY_CACHE", cache)
            .env("SWITCHYARD_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(if log { Stdio::inherit() } else { Stdio::null() })
            .spawn()
            .unwrap(),
    )
}

/// Waits (bounded) until `GET url` answers 200.
pub async fn wait_ok(url: &str) {
    let c = http::client();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Ok((status, _, _)) =
            http::send(&c, hyper::Method::GET, url, &[], "", Duration::from_secs(2)).await
            && status.is_success()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{url} never answered 200");
}

/// A mock worker process serving `mock` on a free port; returns it and its URL once it
/// answers `/v1/models` (which it does whatever fault it was started with).
pub async fn mock_worker(extra: &[&str]) -> (Proc, String) {
    let listen = format!("127.0.0.1:{}", free_port());
    let mut args = vec!["mock-worker", "--listen", &listen, "--model", "mock"];
    args.extend_from_slice(extra);
    let p = switchyard(&args);
    let url = format!("http://{listen}");
    wait_ok(&format!("{url}/v1/models")).await;
    (p, url)
}

/// A router process; returns it and its URL once it is ready. Its policy call budget is
/// raised to 250 ms: the tests run in parallel, unoptimised, on two cores, and a policy
/// interrupted by a starved CPU would decide through the fallback (and five in a row roll
/// the policy back), which is not what these tests are about.
pub async fn serve(extra: &[&str]) -> (Proc, String) {
    let listen = format!("127.0.0.1:{}", free_port());
    let mut args = vec!["serve", "--listen", &listen, "--policy-budget-ms", "250"];
    args.extend_from_slice(extra);
    let p = switchyard(&args);
    let url = format!("http://{listen}");
    wait_ok(&format!("{url}/ready")).await;
    (p, url)
}
