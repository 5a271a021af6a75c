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

/// A port nothing listens on, for a process to bind later — below the kernel's ephemeral
/// range, so that no outgoing connection takes it meanwhile (a port from `bind(0)` is an
/// ephemeral one: a vLLM engine binds its NIXL side channel a minute after it was chosen,
/// and once found it taken by another connection's source port and never started), and
/// never the same twice in one test process.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 15_000;
    let high = ephemeral_low().clamp(LOW + 1_000, 65_536);
    let span = high - LOW;
    // Each process starts somewhere else in the span, then walks it.
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id().wrapping_mul(7_919) % span,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..span {
        let port = (LOW + NEXT.fetch_add(1, Ordering::Relaxed) % span) as u16;
        // The wildcard address: free there is free on every address (vLLM binds `*`).
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {LOW}..{high}");
}

/// The first port of the kernel's ephemeral range (32768 when it cannot be read).
fn ephemeral_low() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
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
