#![doc = "A hostile test policy; see the body of `choose`."]
use switchyard::policy::types::RejectionKind;

wit_bindgen::generate!({ path: "../../../wit", world: "policy" });

thread_local! {
    static AFTER: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// True when this decision should misbehave (see `configure`).
fn misbehave(req: &Request) -> bool {
    req.sequence >= AFTER.get()
}

struct Hostile;

#[allow(unused_variables)]
impl Guest for Hostile {
    /// `{"after": N}`: behave (pick the first candidate) for decisions with a sequence
    /// number below N, so the policy passes its canary and misbehaves later.
    fn configure(config: String) -> Result<(), String> {
        let digits: String = config.chars().filter(|c| c.is_ascii_digit()).collect();
        AFTER.set(digits.parse().unwrap_or(0));
        Ok(())
    }
    fn describe() -> Info {
        Info { name: env!("CARGO_PKG_NAME").to_string(), version: "0.1.0".to_string() }
    }

    /// Tries to reach outside the sandbox. Picks the first candidate when everything was
    /// denied, and rejects with a description of what leaked otherwise.
    fn choose(req: Request, candidates: Candidates) -> Result<u64, Rejection> {
        if !misbehave(&req) {
            return Ok(candidates.worker_ids[0]);
        }
        let mut leaks = Vec::new();
        for path in ["/etc/passwd", "/etc/hostname", ".", "/"] {
            if std::fs::read(path).is_ok() || std::fs::read_dir(path).is_ok() {
                leaks.push(format!("file {path}"));
            }
        }
        if std::env::vars().next().is_some() {
            leaks.push("environment".to_string());
        }
        if std::env::args().next().is_some() {
            leaks.push("arguments".to_string());
        }
        if std::net::TcpStream::connect("127.0.0.1:80").is_ok() {
            leaks.push("network".to_string());
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        if now > 0 {
            leaks.push(format!("wall clock ({now} s since the epoch)"));
        }
        if leaks.is_empty() {
            Ok(candidates.worker_ids[0])
        } else {
            Err(reject(&format!("sandbox leaks: {}", leaks.join(", "))))
        }
    }
}

#[allow(dead_code)]
fn reject(reason: &str) -> Rejection {
    Rejection { kind: RejectionKind::Refused, reason: reason.to_string() }
}

export!(Hostile);
