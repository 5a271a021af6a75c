//! A fleet on a real etcd for the benchmarks that need one (failover, chaos): etcd,
//! mock workers registered in it, and a router process over them, started once every
//! worker is routable.

use std::time::Duration;

use crate::common::{Http, Proc, free_port, get_text, switchyard_with_cache, wait_ok};
use crate::etcd::Etcd;

pub struct EtcdFleet {
    pub etcd: Etcd,
    /// Each worker's process and `host:port`.
    pub workers: Vec<(Proc, String)>,
    pub router: Proc,
    /// The router's base URL.
    pub url: String,
    /// The compiled-policy cache both kinds of process use (removed at the end).
    pub cache: tempfile::TempDir,
}

impl EtcdFleet {
    /// `n` mock workers (`--speedup 20 --ttl 10` and `worker_flags`) and a router
    /// (`serve_flags`); returns once the router has all `n` available.
    pub async fn start(
        c: &Http,
        n: usize,
        worker_flags: &[&str],
        serve_flags: &[&str],
    ) -> EtcdFleet {
        let cache = tempfile::tempdir().unwrap();
        let etcd = Etcd::start();
        let etcd_url = etcd.url();
        let mut workers = Vec::new();
        for _ in 0..n {
            let listen = format!("127.0.0.1:{}", free_port());
            let mut args = vec![
                "mock-worker",
                "--listen",
                &listen,
                "--model",
                "mock",
                "--speedup",
                "20",
                "--etcd",
                &etcd_url,
                "--ttl",
                "10",
            ];
            args.extend_from_slice(worker_flags);
            let p = switchyard_with_cache(&args, cache.path());
            wait_ok(&format!("http://{listen}/health")).await;
            workers.push((p, listen));
        }
        let listen = format!("127.0.0.1:{}", free_port());
        let mut args = vec!["serve", "--listen", &listen, "--etcd", &etcd_url];
        args.extend_from_slice(serve_flags);
        let router = switchyard_with_cache(&args, cache.path());
        let url = format!("http://{listen}");
        wait_ok(&format!("{url}/ready")).await;
        // Bounded: 500 polls of 20 ms.
        for _ in 0..500 {
            let page = get_text(c, &format!("{url}/metrics")).await;
            let available = page
                .lines()
                .filter(|l| l.starts_with("switchyard_instance_available{") && l.ends_with(" 1"))
                .count();
            if available == n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        EtcdFleet {
            etcd,
            workers,
            router,
            url,
            cache,
        }
    }
}
