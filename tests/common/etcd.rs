//! A real etcd server for a test: free loopback ports, a temporary data directory,
//! stopped (and its directory removed) when dropped.

use super::procs::free_port;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Etcd {
    child: Option<Child>,
    client_port: u16,
    peer_port: u16,
    dir: tempfile::TempDir,
    /// With TLS on the client port: the server's certificate and key, and its CA.
    tls: Option<(PathBuf, PathBuf, PathBuf)>,
}

impl Etcd {
    /// Starts etcd and waits until it answers. Panics with a clear message if the
    /// `etcd` binary is missing (`.ci/run` installs Debian's `etcd-server`).
    pub fn start() -> Etcd {
        Etcd::start_with(None)
    }

    /// Starts etcd serving clients over TLS (`https://localhost:PORT`) with `cert` and
    /// `key`, signed by `ca`.
    pub fn start_tls(cert: PathBuf, key: PathBuf, ca: PathBuf) -> Etcd {
        Etcd::start_with(Some((cert, key, ca)))
    }

    /// A port found free may be taken again before etcd binds it (by another test's
    /// listener, or as the local port of some connection): etcd then exits at once. So a
    /// start that fails is tried again, on fresh ports and a fresh directory, twice.
    fn start_with(tls: Option<(PathBuf, PathBuf, PathBuf)>) -> Etcd {
        let mut etcd = Etcd {
            child: None,
            client_port: free_port(),
            peer_port: free_port(),
            dir: tempfile::tempdir().unwrap(),
            tls,
        };
        for attempt in 1..=3 {
            match etcd.try_spawn() {
                Ok(()) => return etcd,
                Err(why) if attempt < 3 => {
                    eprintln!("etcd start {attempt} failed ({why}); trying other ports");
                    etcd.stop();
                    etcd.client_port = free_port();
                    etcd.peer_port = free_port();
                    etcd.dir = tempfile::tempdir().unwrap();
                }
                Err(why) => panic!("{why}"),
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    pub fn url(&self) -> String {
        match self.tls {
            Some(_) => format!("https://localhost:{}", self.client_port),
            None => format!("http://127.0.0.1:{}", self.client_port),
        }
    }

    /// A client of this etcd (trusting its CA when it has TLS).
    pub fn api(&self) -> switchyard::discovery::etcd_api::EtcdApi {
        let tls = match &self.tls {
            Some((_, _, ca)) => {
                switchyard::net::upstream::Tls::with_ca_files(std::slice::from_ref(ca)).unwrap()
            }
            None => switchyard::net::upstream::Tls::default(),
        };
        switchyard::discovery::etcd_api::EtcdApi::with_access(
            &[self.url()],
            Duration::from_secs(2),
            &tls,
            None,
        )
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn spawn(&mut self) {
        if let Err(why) = self.try_spawn() {
            panic!("{why}");
        }
    }

    fn try_spawn(&mut self) -> Result<(), String> {
        let client = self.url();
        let listen = client.replace("localhost", "127.0.0.1");
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new("etcd");
        if let Some((cert, key, _)) = &self.tls {
            command
                .arg("--cert-file")
                .arg(cert)
                .arg("--key-file")
                .arg(key);
        }
        let child = command
            .args(["--name", "test", "--data-dir"])
            .arg(self.data_dir())
            .args([
                "--listen-client-urls",
                &listen,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("test={peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot start `etcd`: install Debian's etcd-server (.ci/run does)");
        self.child = Some(child);
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                return Err(format!(
                    "etcd exited ({status}) before answering on {}",
                    self.url()
                ));
            }
            if std::net::TcpStream::connect(("127.0.0.1", self.client_port)).is_ok() {
                // The port is open; wait for the server to answer requests too (on a
                // thread of its own: the caller may be inside a Tokio runtime).
                let api = self.api();
                let ok = std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap();
                    rt.block_on(async { api.status().await.is_ok() })
                })
                .join()
                .unwrap();
                if ok {
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!("etcd did not become ready on {}", self.url()))
    }

    /// Kills the server (as a crash would), keeping its data.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends a signal (`STOP` freezes it, `CONT` resumes it).
    pub fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("etcd is running").id();
        let status = std::process::Command::new("kill")
            .args([&format!("-{sig}"), &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Starts it again on the same ports and data.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A TCP proxy in front of etcd that can freeze the connections carrying watches: they
/// stay open, neither closed nor reset, but relay nothing more in either direction (a
/// member or NAT path that vanished), while every other connection, and every new one,
/// is relayed as before.
pub struct FreezingProxy {
    pub url: String,
    frozen: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Connections accepted (etcd up or not): a client's attempts, to wait on.
    accepted: std::sync::Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl FreezingProxy {
    /// Relays `127.0.0.1:PORT` to `etcd` (an `http://` URL).
    pub async fn start(etcd: &str) -> FreezingProxy {
        use std::sync::atomic::{AtomicBool, Ordering};
        let target = etcd.trim_start_matches("http://").to_string();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let frozen = std::sync::Arc::new(AtomicBool::new(false));
        let f = frozen.clone();
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = accepted.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                let Ok(server) = tokio::net::TcpStream::connect(&target).await else {
                    continue;
                };
                let f = f.clone();
                tokio::spawn(async move {
                    // Only connections opened before the freeze are frozen.
                    let after_freeze = f.load(Ordering::SeqCst);
                    let is_watch = std::sync::Arc::new(AtomicBool::new(false));
                    let stopped = {
                        let (f, is_watch) = (f.clone(), is_watch.clone());
                        move || {
                            f.load(Ordering::SeqCst)
                                && is_watch.load(Ordering::SeqCst)
                                && !after_freeze
                        }
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let up = relay(cr, sw, stopped.clone(), Some(is_watch.clone()));
                    let down = relay(sr, cw, stopped, None);
                    tokio::join!(up, down);
                });
            }
        });
        FreezingProxy {
            url,
            frozen,
            accepted,
            task,
        }
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// From now on, the watch connections open now relay nothing.
    pub fn freeze_watches(&self) {
        self.frozen.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for FreezingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to` until either ends; once `stopped()` holds, reads are kept
/// unanswered and the connection held open (for at most a minute). `watch` is set once
/// a watch request goes through.
async fn relay(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    stopped: impl Fn() -> bool,
    watch: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 << 10];
    loop {
        let n = tokio::select! {
            n = from.read(&mut buf) => match n {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            _ = async { while !stopped() { tokio::time::sleep(Duration::from_millis(10)).await } } => {
                tokio::time::sleep(Duration::from_secs(60)).await;
                return;
            }
        };
        // A pooled connection may carry other calls before its watch.
        if let Some(w) = &watch
            && buf[..n].windows(15).any(|x| x == b"POST /v3/watch ")
        {
            w.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        if stopped() {
            tokio::time::sleep(Duration::from_secs(60)).await;
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
