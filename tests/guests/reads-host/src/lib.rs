#![doc = "A hostile test policy; see the body of `choose`."]

include!("../../hostile.rs");

hostile_choose! {
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
        if std::net::UdpSocket::bind("127.0.0.1:0").is_ok() {
            leaks.push("a UDP socket".to_string());
        }
        if std::net::TcpListener::bind("127.0.0.1:0").is_ok() {
            leaks.push("a listening socket".to_string());
        }
        {
            use std::net::ToSocketAddrs;
            if ("localhost", 80).to_socket_addrs().is_ok_and(|mut a| a.next().is_some()) {
                leaks.push("name lookup".to_string());
            }
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
