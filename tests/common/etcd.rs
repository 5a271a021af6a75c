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
        let mut etcd = Etcd {
            child: None,
            client_port: free_port(),
            peer_port: free_port(),
            dir: tempfile::tempdir().unwrap(),
        };
        etcd.spawn();
        etcd
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn spawn(&mut self) {
        let client = self.url();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new("etcd")
            .args(["--name", "test", "--data-dir"])
            .arg(self.data_dir())
            .args([
                "--listen-client-urls",
                &client,
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
                let url = self.url();
                let ok = std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap();
                    rt.block_on(async {
                        switchyard::discovery::etcd_api::EtcdApi::new(
                            &[url],
                            Duration::from_secs(2),
                        )
                        .status()
                        .await
                        .is_ok()
                    })
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
