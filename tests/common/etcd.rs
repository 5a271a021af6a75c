//! A real etcd server for a test: free loopback ports, a temporary data directory,
//! stopped (and its directory removed) when dropped.

use std::net::TcpListener;
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

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
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

    fn start_with(tls: Option<(PathBuf, PathBuf, PathBuf)>) -> Etcd {
        let mut etcd = Etcd {
            child: None,
            client_port: free_port(),
            peer_port: free_port(),
            dir: tempfile::tempdir().unwrap(),
            tls,
        };
        etcd.spawn();
        etcd
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
                switchyard::http::upstream::Tls::with_ca_files(std::slice::from_ref(ca)).unwrap()
            }
            None => switchyard::http::upstream::Tls::default(),
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
        self.wait_ready();
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
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
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("etcd did not become ready on {}", self.url());
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
