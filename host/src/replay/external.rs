//! Routers run as separate processes (the peers, or Switchyard's own binary), so that each
//! one is driven by the same client in front of the same mock fleet and its CPU time and
//! peak memory are measured alone.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A router started from a command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExternalRouter {
    /// Its name in the report.
    pub name: String,
    /// A shell command. `{port}` is replaced by the port it must listen on (127.0.0.1),
    /// `{workers}` by the mock workers' URLs separated by spaces, `{workers_comma}` by the
    /// same separated by commas, and `{worker_args}` by `--worker URL` once per worker.
    pub command: String,
}

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

    /// The command with its placeholders filled in.
    pub fn expand(&self, port: u16, workers: &[String]) -> String {
        let args: Vec<String> = workers.iter().map(|w| format!("--worker {w}")).collect();
        self.command
            .replace("{port}", &port.to_string())
            .replace("{workers_comma}", &workers.join(","))
            .replace("{workers}", &workers.join(" "))
            .replace("{worker_args}", &args.join(" "))
    }
}

/// What a router process cost.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct ProcessCost {
    /// User plus system CPU seconds of the whole process group.
    pub cpu_secs: f64,
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
        if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status"))
            && let Some(kb) = status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        {
            cost.peak_rss_mib += kb / 1024.0;
        }
    }
    cost
}

/// A port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_placeholders_expand() {
        let r = ExternalRouter::parse(
            "peer = run --port {port} --urls {workers} {worker_args} {workers_comma}",
        )
        .unwrap();
        assert_eq!(r.name, "peer");
        let workers = ["http://a".to_string(), "http://b".to_string()];
        assert_eq!(
            r.expand(9, &workers),
            "run --port 9 --urls http://a http://b --worker http://a --worker http://b http://a,http://b"
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
