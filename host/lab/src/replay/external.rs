//! Routers run as separate processes (the peers, or Switchyard's own binary), so that each
//! one is driven by the same client in front of the same mock fleet and its CPU time and
//! peak memory are measured alone.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

// The run of one external router uses the replay's own pieces (workers, client, report).
use super::*;

/// A router started from a command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExternalRouter {
    /// Its name in the report.
    pub name: String,
    /// A shell command. `{port}` is replaced by the port it must listen on (127.0.0.1),
    /// `{workers}` by the mock workers' URLs separated by spaces, `{workers_comma}` by the
    /// same separated by commas, and `{worker_args}` by `--worker URL` once per worker.
    /// A command with any of the placeholders of a disaggregated fleet runs on one:
    /// `{prefill_workers}` (`--worker 'URL#role=prefill'` per prefill worker: Switchyard
    /// with vLLM's handoff), `{prefill_workers_bootstrap}` (the same with
    /// `&bootstrap_port=P`: SGLang's handoff), `{decode_workers}` (`--worker
    /// 'URL#role=decode'`), `{prefill_urls}` (`--prefill URL P` per prefill worker, as the
    /// peers take them) and `{decode_urls}` (`--decode URL`).
    pub command: String,
}

/// The workers of a disaggregated fleet: prefill workers with their bootstrap ports, and
/// decode workers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PdFleet {
    /// Prefill workers' URLs and bootstrap ports.
    pub prefill: Vec<(String, u16)>,
    /// Decode workers' URLs.
    pub decode: Vec<String>,
}

/// The placeholders that ask for a disaggregated fleet.
const PD_PLACEHOLDERS: [&str; 5] = [
    "{prefill_workers}",
    "{prefill_workers_bootstrap}",
    "{decode_workers}",
    "{prefill_urls}",
    "{decode_urls}",
];

impl ExternalRouter {
    /// Parses `NAME=COMMAND`.
    pub fn parse(spec: &str) -> Result<ExternalRouter, String> {
        match spec.split_once('=') {
            Some((name, command)) if !name.trim().is_empty() && !command.trim().is_empty() => {
                Ok(ExternalRouter {
                    name: name.trim().to_string(),
                    command: command.trim().to_string(),
                })
            }
            _ => Err(format!("a router is NAME=COMMAND, got {spec:?}")),
        }
    }

    /// Whether the command runs on a disaggregated fleet.
    pub fn wants_pd(&self) -> bool {
        PD_PLACEHOLDERS.iter().any(|p| self.command.contains(p))
    }

    /// The command with its placeholders filled in (`workers`: every worker, as a URL or
    /// as `serve --worker` takes it, `URL#options`: `{worker_args}` keeps the options, the
    /// other placeholders give the URL alone).
    pub fn expand(&self, port: u16, workers: &[String], pd: &PdFleet) -> String {
        let args: Vec<String> = workers.iter().map(|w| format!("--worker '{w}'")).collect();
        let workers: Vec<&str> = workers.iter().map(|w| engines::url_of(w)).collect();
        let each = |f: &dyn Fn(&str, u16) -> String| -> String {
            pd.prefill
                .iter()
                .map(|(u, p)| f(u, *p))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let decode = |f: &dyn Fn(&str) -> String| -> String {
            pd.decode.iter().map(|u| f(u)).collect::<Vec<_>>().join(" ")
        };
        self.command
            .replace("{port}", &port.to_string())
            .replace("{workers_comma}", &workers.join(","))
            .replace("{workers}", &workers.join(" "))
            .replace("{worker_args}", &args.join(" "))
            .replace(
                "{prefill_workers_bootstrap}",
                &each(&|u, p| format!("--worker '{u}#role=prefill&bootstrap_port={p}'")),
            )
            .replace(
                "{prefill_workers}",
                &each(&|u, _| format!("--worker '{u}#role=prefill'")),
            )
            .replace(
                "{decode_workers}",
                &decode(&|u| format!("--worker '{u}#role=decode'")),
            )
            .replace(
                "{prefill_urls}",
                &each(&|u, p| format!("--prefill {u} {p}")),
            )
            .replace("{decode_urls}", &decode(&|u| format!("--decode {u}")))
    }
}

/// What a router process cost.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct ProcessCost {
    /// User plus system CPU seconds of the whole process group.
    pub cpu_secs: f64,
    /// Of which spent before it answered its first probe (loading, importing): a cost
    /// paid once per start, not per request.
    pub start_cpu_secs: f64,
    /// Sum of the group's processes' peak resident memory, MiB.
    pub peak_rss_mib: f64,
}

/// A running router process group.
pub struct RouterProcess {
    child: Child,
    /// Where its output goes.
    pub log: PathBuf,
}

impl RouterProcess {
    /// Starts `command` under `sh -c` in a process group of its own, output to `log`.
    pub fn start(command: &str, log: PathBuf) -> Result<RouterProcess, String> {
        use std::os::unix::process::CommandExt;
        let out = std::fs::File::create(&log)
            .map_err(|e| format!("cannot create {}: {e}", log.display()))?;
        let err = out
            .try_clone()
            .map_err(|e| format!("cannot create {}: {e}", log.display()))?;
        let child = Command::new("sh")
            .arg("-c")
            .arg(format!("exec {command}"))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot start {command:?}: {e}"))?;
        Ok(RouterProcess { child, log })
    }

    /// Whether it has exited (with its status).
    pub fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(status)) => Some(status.to_string()),
            Ok(None) => None,
            Err(e) => Some(e.to_string()),
        }
    }

    /// The CPU time and peak memory of every live process in the group, plus the
    /// children it has reaped.
    pub fn cost(&self) -> ProcessCost {
        group_cost(self.child.id() as i32)
    }

    /// The last lines of its output, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// SIGTERM to the group, SIGKILL after `grace`.
    pub fn stop(mut self, grace: Duration) {
        let pgid = self.child.id() as i32;
        signal_group(pgid, "TERM");
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) && !group_alive(pgid) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        signal_group(pgid, "KILL");
        let _ = self.child.wait();
    }
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            signal_group(self.child.id() as i32, "KILL");
            let _ = self.child.wait();
        }
    }
}

/// `kill -SIGNAL -- -PGID`: the crate has no unsafe code, so no direct kill(2).
fn signal_group(pgid: i32, signal: &str) -> bool {
    Command::new("kill")
        .args([&format!("-{signal}"), "--", &format!("-{pgid}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn group_alive(pgid: i32) -> bool {
    signal_group(pgid, "0")
}

/// Reads `/proc` for the processes of group `pgid`.
fn group_cost(pgid: i32) -> ProcessCost {
    // /proc reports times in USER_HZ, which Linux fixes at 100 for user space.
    let ticks = 100.0;
    let mut cost = ProcessCost::default();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return cost;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the parenthesised command name, which may contain spaces.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        // rest[0] is field 3 (state): pgrp is field 5, utime..cstime fields 14..17.
        let field = |n: usize| {
            f.get(n - 3)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        if field(5) as i32 != pgid {
            continue;
        }
        cost.cpu_secs += (field(14) + field(15) + field(16) + field(17)) / ticks;
        if let Some(kb) = proc_status_kb(pid as u32, "VmHWM") {
            cost.peak_rss_mib += kb as f64 / 1024.0;
        }
    }
    cost
}

/// A memory figure of process `pid` from `/proc/PID/status` (`VmRSS`, `VmHWM`…), KiB.
pub fn proc_status_kb(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// A port nothing listens on, for a process to bind later: below the kernel's ephemeral
/// range, so that no outgoing connection takes it meanwhile (a port from `bind(0)` is an
/// ephemeral one: a vLLM engine binds its ports a minute after they were chosen, and
/// once found one taken as another connection's source port), and never the same twice
/// in one process.
pub fn free_port() -> Result<u16, String> {
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
        let port = LOW + NEXT.fetch_add(1, Ordering::Relaxed) % span;
        let port = u16::try_from(port).map_err(|_| "no free port".to_string())?;
        // The wildcard address: free there is free on every address (vLLM binds `*`).
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(format!("no free port in {LOW}..{high}"))
}

/// The first port of the kernel's ephemeral range (32768 when it cannot be read).
fn ephemeral_low() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// One external router on fresh mock workers, or on the running engines emptied of
/// their caches.
pub(super) async fn replay_external(
    config: &ReplayConfig,
    router: &ExternalRouter,
    reqs: Arc<Vec<TraceRequest>>,
) -> Result<PolicyRun, String> {
    let (fleet, workers, pd) = if config.engines.specs.is_empty() {
        let disaggregated = config.disaggregated.filter(|_| router.wants_pd());
        let (workers, pd) = mock_fleet(config, disaggregated).await?;
        let urls = workers.iter().map(MockWorker::url).collect();
        let fleet = Fleet::Mock {
            workers,
            disaggregated: disaggregated.is_some(),
        };
        (fleet, urls, pd)
    } else {
        config.engines.reset().await?;
        let specs = config.engines.specs.clone();
        (Fleet::Engines(&config.engines), specs, PdFleet::default())
    };
    let port = free_port()?;
    let command = router.expand(port, &workers, &pd);
    let log = config
        .logs
        .join(format!("{}.log", router.name.replace('/', "_")));
    eprintln!(
        "[{}] starting: {command} (output in {})",
        router.name,
        log.display()
    );
    let mut process = RouterProcess::start(&command, log)?;
    let url = format!("http://127.0.0.1:{port}");
    let ready = router_ready(&url, &mut process).await;
    let start_cpu_secs = process.cost().cpu_secs;
    let result = match ready {
        Ok(()) => {
            let cost = || ProcessCost {
                start_cpu_secs,
                ..process.cost()
            };
            run_through(config, router, &url, &fleet, reqs, cost).await
        }
        Err(e) => Err(format!("{}: {e}\n{}", router.name, process.log_tail())),
    };
    tokio::task::spawn_blocking(move || process.stop(Duration::from_secs(10)))
        .await
        .map_err(|e| e.to_string())?;
    if let Fleet::Mock { workers, .. } = fleet {
        for w in workers {
            w.shutdown().await;
        }
    }
    result
}

/// The workers an external router runs in front of.
enum Fleet<'a> {
    /// Mock workers started for it (some of them prefill workers of a split fleet).
    Mock {
        workers: Vec<MockWorker>,
        disaggregated: bool,
    },
    /// Running engines.
    Engines(&'a engines::Engines),
}

/// Fresh mock workers: aggregated ones, or `(prefill, decode)` of a split fleet.
async fn mock_fleet(
    config: &ReplayConfig,
    disaggregated: Option<(usize, usize)>,
) -> Result<(Vec<MockWorker>, PdFleet), String> {
    let mut engine = config.engine.clone();
    engine.speedup = config.speedup;
    let tokenizer = switchyard_tokens::Tokenizer::from_file_if_any(config.tokenizer.as_deref())
        .map_err(|e| e.to_string())?;
    let start = |pd: PdConfig| {
        MockWorker::bind(
            MockWorkerConfig {
                model: "replay".into(),
                engine: engine.clone(),
                hash_seed: 0,
                fault: FaultConfig::NONE,
                tokenizer: tokenizer.clone(),
                zmq_events: None,
                tls: None,
                chat: None,
                api_key: None,
                pd,
                lora_adapters: Vec::new(),
            },
            "127.0.0.1:0".parse().expect("valid"),
        )
    };
    let mut workers = Vec::new();
    let mut fleet = PdFleet::default();
    let roles = match disaggregated {
        None => vec![PdConfig::default(); config.workers.max(1)],
        Some((prefill, decode)) => {
            let mut roles = Vec::new();
            for _ in 0..prefill.max(1) {
                roles.push(PdConfig {
                    role: Role::Prefill,
                    bootstrap_port: Some(free_port()?),
                    ..PdConfig::default()
                });
            }
            roles.extend(std::iter::repeat_n(
                PdConfig {
                    role: Role::Decode,
                    ..PdConfig::default()
                },
                decode.max(1),
            ));
            roles
        }
    };
    for pd in roles {
        let worker = start(pd)
            .await
            .map_err(|e| format!("cannot start a mock worker: {e}"))?;
        match (pd.role, pd.bootstrap_port) {
            (Role::Prefill, Some(port)) => fleet.prefill.push((worker.url(), port)),
            (Role::Decode, _) => fleet.decode.push(worker.url()),
            _ => {}
        }
        workers.push(worker);
    }
    Ok((workers, fleet))
}

/// The trace through a ready router; the run's hit rate from the workers where the
/// answers' usage cannot say it (a split fleet's decode workers report received blocks as
/// cached; engines are read from their own counters).
async fn run_through(
    config: &ReplayConfig,
    router: &ExternalRouter,
    url: &str,
    fleet: &Fleet<'_>,
    reqs: Arc<Vec<TraceRequest>>,
    cost: impl Fn() -> ProcessCost,
) -> Result<PolicyRun, String> {
    let before = match fleet {
        Fleet::Engines(engines) => engines.counters().await?,
        Fleet::Mock { .. } => Vec::new(),
    };
    let urls = [url.to_string()];
    let mut run = drive(config, &router.name, &urls, reqs, Prompts::Text)
        .await
        .map_err(|e| format!("{}: {e}", router.name))?;
    run.router = Some(cost());
    match fleet {
        Fleet::Engines(engines) => {
            let after = engines.counters().await?;
            (run.fleet_hit_rate, run.worker_requests) = engines::delta(&before, &after);
        }
        Fleet::Mock {
            workers,
            disaggregated,
        } => {
            run.worker_requests = workers.iter().map(|w| w.stats().finished).collect();
            if *disaggregated {
                let computed: u64 = workers.iter().map(|w| w.stats().prefill_tokens).sum();
                let prompt: u64 = run
                    .outcomes
                    .iter()
                    .filter(|o| o.ok)
                    .map(|o| o.prompt_tokens)
                    .sum();
                run.fleet_hit_rate =
                    (prompt > 0).then(|| 1.0 - (computed as f64 / prompt as f64).min(1.0));
            }
        }
    }
    if let Some(text) = scrape(&format!("{url}/metrics")).await {
        let _ = std::fs::write(
            config
                .logs
                .join(format!("{}.metrics", router.name.replace('/', "_"))),
            &text,
        );
        run.live = LiveTimings::parse(&text);
    }
    Ok(run)
}

/// Waits until a one-token completion through the router succeeds (the router is up and
/// has found its workers healthy), for at most two minutes.
async fn router_ready(url: &str, process: &mut RouterProcess) -> Result<(), String> {
    let http: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut last = String::from("no answer");
    while Instant::now() < deadline {
        if let Some(status) = process.exited() {
            return Err(format!("the router exited ({status})"));
        }
        let req = hyper::Request::post(format!("{url}/v1/completions"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(
                br#"{"model":"replay","prompt":"ready","max_tokens":1}"#,
            )))
            .expect("valid request");
        match tokio::time::timeout(Duration::from_secs(5), http.request(req)).await {
            Ok(Ok(r)) if r.status().is_success() => {
                let _ = r.into_body().collect().await;
                return Ok(());
            }
            Ok(Ok(r)) => last = format!("answered {}", r.status()),
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = "timed out".into(),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Err(format!("not ready after 120 s (last: {last})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ports for processes to bind later come from below the ephemeral range (no
    /// outgoing connection takes them meanwhile), free, and never twice.
    #[test]
    fn free_ports_are_below_the_ephemeral_range_and_never_repeat() {
        let high = ephemeral_low().max(16_000);
        let ports: Vec<u16> = (0..50).map(|_| free_port().unwrap()).collect();
        assert!(ports.iter().all(|p| u32::from(*p) < high), "{ports:?}");
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "{ports:?}");
        for p in ports {
            std::net::TcpListener::bind(("127.0.0.1", p)).expect("still free");
        }
    }

    #[test]
    fn specs_parse_and_placeholders_expand() {
        let r = ExternalRouter::parse(
            "peer = run --port {port} --urls {workers} {worker_args} {workers_comma}",
        )
        .unwrap();
        assert_eq!(r.name, "peer");
        let workers = ["http://a".to_string(), "http://b".to_string()];
        assert_eq!(
            r.expand(9, &workers, &PdFleet::default()),
            "run --port 9 --urls http://a http://b --worker 'http://a' --worker 'http://b' http://a,http://b"
        );
        assert!(!r.wants_pd());
        let engines = ["http://a#kv_events=tcp://127.0.0.1:5557&topic=kv".to_string()];
        assert_eq!(
            r.expand(9, &engines, &PdFleet::default()),
            "run --port 9 --urls http://a --worker 'http://a#kv_events=tcp://127.0.0.1:5557&topic=kv' http://a",
            "an engine's options go to Switchyard's --worker only"
        );
        let pd = PdFleet {
            prefill: vec![("http://p".into(), 8998)],
            decode: vec!["http://d".into(), "http://e".into()],
        };
        let sy =
            ExternalRouter::parse("sy=serve {prefill_workers_bootstrap} {decode_workers}").unwrap();
        assert!(sy.wants_pd());
        assert_eq!(
            sy.expand(9, &workers, &pd),
            "serve --worker 'http://p#role=prefill&bootstrap_port=8998' --worker 'http://d#role=decode' --worker 'http://e#role=decode'"
        );
        let peer =
            ExternalRouter::parse("peer=r --pd {prefill_urls} {decode_urls} {prefill_workers}")
                .unwrap();
        assert_eq!(
            peer.expand(9, &workers, &pd),
            "r --pd --prefill http://p 8998 --decode http://d --decode http://e --worker 'http://p#role=prefill'"
        );
        assert!(ExternalRouter::parse("no-command").is_err());
        assert!(ExternalRouter::parse("=cmd").is_err());
    }

    #[test]
    fn a_process_group_is_measured_and_stopped() {
        let log = std::env::temp_dir().join(format!("switchyard-ext-{}.log", std::process::id()));
        let mut p = RouterProcess::start("sh -c 'echo started; sleep 30'", log.clone()).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        assert!(p.exited().is_none());
        assert!(p.cost().peak_rss_mib > 0.0, "the group's memory is read");
        assert!(p.log_tail().contains("started"));
        let pgid = p.child.id() as i32;
        p.stop(Duration::from_secs(5));
        assert!(!group_alive(pgid), "the whole group is gone");
        let _ = std::fs::remove_file(log);
    }
}
