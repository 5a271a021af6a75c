//! The router's own ZMTP 3.0 peer (NULL security): just the sockets it reads engines' KV
//! events with — SUB (connecting to an engine's PUB, or bound for engines to connect to
//! in central mode) and DEALER (asking an engine's replay ROUTER for missed batches).
//!
//! Why not a ZMQ library: every byte here comes from a worker or, in central mode, from
//! anyone who can reach the bound port, and the router is the one process every request
//! passes through. The `zeromq` crate's codec reserves whatever length a frame header
//! declares before any data arrives (a 10-byte header declaring 2^62 bytes aborts the
//! process) and buffers unlimited frames per message; libzmq's `ZMQ_MAXMSGSIZE` would
//! mean a C build dependency. The part of ZMTP these sockets need is small, so it is
//! written here with every read bounded ([`Limits`]):
//! - a frame's declared size is checked against [`Limits::max_frame`] *before* anything
//!   is allocated, and a message's frames and total bytes against `max_frames` and
//!   `max_message`; with a budget ([`Connection::with_budget`]: the router's one budget
//!   for all event input) its bytes are taken from it first, and held until the message
//!   is done with;
//! - the greeting and handshake must finish within `handshake_deadline`, and a message,
//!   once its first byte has arrived, within `message_deadline` (an idle publisher is
//!   normal; a half-sent message is not);
//! - commands (ZMTP 3.1's PING, a peer's SUBSCRIBE) are read under a small bound too,
//!   and only PING is answered.
//!
//! Past any bound the connection is closed with a [`ZmtpError`] that says which; the
//! callers count it and reconnect with backoff. TCP keepalive finds a peer that vanished
//! without a reset.
//!
//! Must not know: what the frames mean (`engine_subscriber` and `central_events` do).

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use switchyard_bounded::budget::{Budget, Grant};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// What one connection may take from its peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest frame accepted, in bytes.
    pub max_frame: u64,
    /// Most frames in one message.
    pub max_frames: usize,
    /// Largest message (all its frames), in bytes.
    pub max_message: u64,
    /// Largest command frame (READY, PING, …), in bytes.
    pub max_command: u64,
    /// The greeting and READY exchange must finish within this.
    pub handshake_deadline: Duration,
    /// A message must arrive whole within this of its first byte.
    pub message_deadline: Duration,
}

/// The bounds of engines' KV event sockets. An event batch is a few KiB to a few MiB
/// (a snapshot of a large cache as one batch is the largest seen); vLLM and SGLang send
/// `[topic, seq, payload]` and the replay socket `["", seq, payload]`.
pub const KV_EVENT_LIMITS: Limits = Limits {
    max_frame: 32 << 20,
    max_frames: 8,
    max_message: 32 << 20,
    max_command: 64 << 10,
    handshake_deadline: Duration::from_secs(5),
    message_deadline: Duration::from_secs(10),
};

/// TCP keepalive on every connection: idle for 30 s, then probes 10 s apart (the kernel
/// gives up after its probe count, ~90 s more on Linux's default of 9).
const KEEPALIVE: (Duration, Duration) = (Duration::from_secs(30), Duration::from_secs(10));

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    /// The socket failed or the peer closed it.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The peer does not speak ZMTP 3 with NULL security, or broke its framing.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The peer declared or sent more than [`Limits`] allow.
    #[error("over the limit: {0}")]
    TooLarge(String),
    /// The peer took longer than [`Limits`] allow.
    #[error("timed out: {0}")]
    Timeout(&'static str),
    /// The endpoint is not `tcp://HOST:PORT`.
    #[error("endpoint `{0}` is not tcp://HOST:PORT")]
    Endpoint(String),
}

impl ZmtpError {
    /// The peer broke the protocol or a bound (rather than the connection merely ending,
    /// or an endpoint being misnamed): a connection to be counted against it and waited
    /// out, not reconnected at once.
    pub fn broke_bounds(&self) -> bool {
        matches!(
            self,
            ZmtpError::TooLarge(_) | ZmtpError::Protocol(_) | ZmtpError::Timeout(_)
        )
    }
}

/// The socket types spoken here, and the peers each accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketType {
    /// Receives a publisher's messages (peer: PUB or XPUB).
    Sub,
    /// Asks a replay ROUTER (peer: ROUTER or DEALER).
    Dealer,
}

impl SocketType {
    fn name(self) -> &'static [u8] {
        match self {
            SocketType::Sub => b"SUB",
            SocketType::Dealer => b"DEALER",
        }
    }

    fn accepts(self, peer: &[u8]) -> bool {
        match self {
            SocketType::Sub => peer == b"PUB" || peer == b"XPUB",
            SocketType::Dealer => peer == b"ROUTER" || peer == b"DEALER",
        }
    }
}

/// `tcp://HOST:PORT` → `HOST:PORT` (`*` for every interface becomes `0.0.0.0`).
pub fn tcp_address(endpoint: &str) -> Result<String, ZmtpError> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .filter(|r| {
            r.rsplit_once(':')
                .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        })
        .ok_or_else(|| ZmtpError::Endpoint(endpoint.to_string()))?;
    Ok(match rest.strip_prefix("*:") {
        Some(port) => format!("0.0.0.0:{port}"),
        None => rest.to_string(),
    })
}

/// One ZMTP connection after its handshake (over TCP; any byte stream in tests and
/// fuzzing).
pub struct Connection<S = TcpStream> {
    stream: BufReader<S>,
    limits: Limits,
    /// The process's budget for event input, which every frame's bytes are taken from
    /// before they are read ([`Connection::with_budget`]); `None`: the limits alone.
    budget: Option<Budget>,
}

/// No Nagle delay, and TCP keepalive: a peer that vanished without a reset is found by
/// the kernel.
pub fn tune(stream: &TcpStream) {
    let _ = stream.set_nodelay(true);
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE.0)
        .with_interval(KEEPALIVE.1);
    let _ = socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive);
}

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;

impl Connection<TcpStream> {
    /// Connects to `endpoint` (`tcp://HOST:PORT`) as `kind` and shakes hands, all within
    /// `connect_timeout` plus the handshake deadline.
    pub async fn connect(
        endpoint: &str,
        kind: SocketType,
        limits: Limits,
        connect_timeout: Duration,
    ) -> Result<Connection, ZmtpError> {
        let address = tcp_address(endpoint)?;
        let stream = tokio::time::timeout(connect_timeout, TcpStream::connect(&address))
            .await
            .map_err(|_| ZmtpError::Timeout("connect"))??;
        tune(&stream);
        Connection::handshake(stream, kind, limits).await
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Connection<S> {
    /// Shakes hands as `kind` on a stream either side opened.
    pub async fn handshake(
        stream: S,
        kind: SocketType,
        limits: Limits,
    ) -> Result<Connection<S>, ZmtpError> {
        let mut c = Connection {
            stream: BufReader::with_capacity(64 << 10, stream),
            limits,
            budget: None,
        };
        tokio::time::timeout(limits.handshake_deadline, c.greet(kind))
            .await
            .map_err(|_| ZmtpError::Timeout("handshake"))??;
        Ok(c)
    }

    /// Takes every message's bytes from `budget` before reading them: a frame that does
    /// not fit in what is left closes the connection (`TooLarge`), and a message holds
    /// its bytes until its [`Grant`] is dropped ([`Connection::recv_held`]).
    pub fn with_budget(mut self, budget: Budget) -> Connection<S> {
        self.budget = Some(budget);
        self
    }

    async fn greet(&mut self, kind: SocketType) -> Result<(), ZmtpError> {
        self.stream.get_mut().write_all(&greeting()).await?;
        let mut theirs = [0u8; 64];
        self.stream.read_exact(&mut theirs).await?;
        if theirs[0] != 0xFF || theirs[9] & 0x01 != 0x01 {
            return Err(ZmtpError::Protocol("not a ZMTP greeting".into()));
        }
        if theirs[10] < 3 {
            return Err(ZmtpError::Protocol(format!(
                "ZMTP {}.{} is too old (3.0 or later)",
                theirs[10], theirs[11]
            )));
        }
        let mechanism = &theirs[12..32];
        let name_end = mechanism.iter().position(|b| *b == 0).unwrap_or(20);
        if &mechanism[..name_end] != b"NULL" {
            return Err(ZmtpError::Protocol(format!(
                "security mechanism `{}` (only NULL is spoken)",
                String::from_utf8_lossy(&mechanism[..name_end])
            )));
        }
        self.write_frame(FLAG_COMMAND, &ready_body(kind.name()))
            .await?;
        self.stream.get_mut().flush().await?;
        let (flags, body) = self.read_frame(self.limits.max_command).await?;
        if flags & FLAG_COMMAND == 0 {
            return Err(ZmtpError::Protocol("a message before READY".into()));
        }
        let (name, props) = command(&body)?;
        match name {
            b"READY" => {}
            b"ERROR" => {
                let reason = props.get(1..).map(String::from_utf8_lossy);
                return Err(ZmtpError::Protocol(format!(
                    "the peer refused: {}",
                    reason.unwrap_or_default()
                )));
            }
            other => {
                return Err(ZmtpError::Protocol(format!(
                    "`{}` before READY",
                    String::from_utf8_lossy(other)
                )));
            }
        }
        let peer = properties(props)?
            .into_iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(b"Socket-Type"))
            .map(|(_, v)| v)
            .ok_or_else(|| ZmtpError::Protocol("READY without Socket-Type".into()))?;
        if !kind.accepts(peer) {
            return Err(ZmtpError::Protocol(format!(
                "a {} peer cannot talk to a {} socket",
                String::from_utf8_lossy(peer),
                String::from_utf8_lossy(kind.name())
            )));
        }
        Ok(())
    }

    /// Subscribes to messages whose first frame starts with `topic` (`b""`: all), in
    /// ZMTP 3.0's form, which 3.1 peers accept too.
    pub async fn subscribe(&mut self, topic: &[u8]) -> Result<(), ZmtpError> {
        let mut m = Vec::with_capacity(topic.len() + 1);
        m.push(1);
        m.extend_from_slice(topic);
        self.send(&[&m]).await
    }

    /// Sends one message of `frames`.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), ZmtpError> {
        for (i, f) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
            self.write_frame(more, f).await?;
        }
        self.stream.get_mut().flush().await?;
        Ok(())
    }

    /// Resolves once the peer has sent something (or closed the connection), without
    /// consuming it: cancel-safe, unlike [`Connection::recv`], so it can be raced against
    /// a timer.
    pub async fn readable(&mut self) -> Result<(), ZmtpError> {
        self.stream.fill_buf().await?;
        Ok(())
    }

    /// The next message, its frames in order. Waits as long as the peer is silent; once
    /// a message has begun it must end within the message deadline and the limits.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        self.recv_held().await.map(|(m, _)| m)
    }

    /// [`Connection::recv`], with the message's bytes held against the budget until the
    /// grant is dropped (keep it while the message is queued or handled).
    pub async fn recv_held(&mut self) -> Result<(Vec<Bytes>, Grant), ZmtpError> {
        loop {
            let first = self.stream.read_u8().await?;
            let limits = self.limits;
            let message = tokio::time::timeout(limits.message_deadline, self.rest_of(first))
                .await
                .map_err(|_| ZmtpError::Timeout("a message's frames"))??;
            if let Some(m) = message {
                return Ok(m);
            }
        }
    }

    /// The message that `flags` starts, or `None` for a command (handled here).
    async fn rest_of(&mut self, mut flags: u8) -> Result<Option<(Vec<Bytes>, Grant)>, ZmtpError> {
        let mut frames = Vec::new();
        let mut total: u64 = 0;
        let mut held = Grant::default();
        loop {
            if flags & FLAG_COMMAND != 0 {
                if !frames.is_empty() {
                    return Err(ZmtpError::Protocol("a command inside a message".into()));
                }
                let body = self
                    .frame_body(flags, self.limits.max_command, None)
                    .await?;
                self.on_command(&body).await?;
                return Ok(None);
            }
            if frames.len() == self.limits.max_frames {
                return Err(ZmtpError::TooLarge(format!(
                    "more than {} frames in one message",
                    self.limits.max_frames
                )));
            }
            let left = self.limits.max_message - total;
            let body = self
                .frame_body(flags, self.limits.max_frame.min(left), Some(&mut held))
                .await?;
            total += body.len() as u64;
            frames.push(body);
            if flags & FLAG_MORE == 0 {
                return Ok(Some((frames, held)));
            }
            flags = self.stream.read_u8().await?;
        }
    }

    async fn on_command(&mut self, body: &[u8]) -> Result<(), ZmtpError> {
        let (name, rest) = command(body)?;
        if name == b"PING" {
            // PING: a 2-byte TTL, then up to 16 bytes of context echoed in the PONG.
            let context = rest.get(2..).unwrap_or_default();
            let context = &context[..context.len().min(16)];
            let mut pong = Vec::with_capacity(5 + context.len());
            pong.push(4);
            pong.extend_from_slice(b"PONG");
            pong.extend_from_slice(context);
            self.write_frame(FLAG_COMMAND, &pong).await?;
            self.stream.get_mut().flush().await?;
        }
        Ok(())
    }

    /// One whole frame (for the handshake): its flags and body.
    async fn read_frame(&mut self, bound: u64) -> Result<(u8, Bytes), ZmtpError> {
        let flags = self.stream.read_u8().await?;
        let body = self.frame_body(flags, bound, None).await?;
        Ok((flags, body))
    }

    /// The size and body of a frame whose flags byte was read; a declared size past
    /// `bound`, or past what the budget has left (when `held` gathers a message's
    /// bytes), is refused before anything is allocated.
    async fn frame_body(
        &mut self,
        flags: u8,
        bound: u64,
        held: Option<&mut Grant>,
    ) -> Result<Bytes, ZmtpError> {
        if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
            return Err(ZmtpError::Protocol(format!(
                "reserved flag bits in {flags:#04x}"
            )));
        }
        let size = if flags & FLAG_LONG != 0 {
            self.stream.read_u64().await?
        } else {
            u64::from(self.stream.read_u8().await?)
        };
        if size > bound {
            return Err(ZmtpError::TooLarge(format!(
                "a frame of {size} bytes (at most {bound} here)"
            )));
        }
        if let (Some(budget), Some(held)) = (&self.budget, held) {
            let grant = budget.take(size).ok_or_else(|| {
                ZmtpError::TooLarge(format!(
                    "a frame of {size} bytes past the router's KV event memory ({} of {} MiB held)",
                    budget.used() >> 20,
                    budget.capacity() >> 20
                ))
            })?;
            held.absorb(grant);
        }
        let size = usize::try_from(size)
            .map_err(|_| ZmtpError::TooLarge(format!("a frame of {size} bytes")))?;
        let mut body = BytesMut::zeroed(size);
        self.stream.read_exact(&mut body).await?;
        Ok(body.freeze())
    }

    async fn write_frame(&mut self, flags: u8, body: &[u8]) -> Result<(), ZmtpError> {
        let w = self.stream.get_mut();
        match u8::try_from(body.len()) {
            Ok(n) => w.write_all(&[flags, n]).await?,
            Err(_) => {
                w.write_all(&[flags | FLAG_LONG]).await?;
                w.write_all(&(body.len() as u64).to_be_bytes()).await?;
            }
        }
        w.write_all(body).await?;
        Ok(())
    }
}

/// The body of a READY command naming `socket_type`.
fn ready_body(socket_type: &[u8]) -> Vec<u8> {
    let mut ready = Vec::with_capacity(24 + socket_type.len());
    ready.push(5);
    ready.extend_from_slice(b"READY");
    ready.push(11);
    ready.extend_from_slice(b"Socket-Type");
    ready.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    ready.extend_from_slice(socket_type);
    ready
}

/// What a peer of `socket_type` (`b"PUB"`…) sends first: the greeting and its READY
/// command, as bytes on the wire (for scripted peers in tests and fuzzing).
pub fn hello(socket_type: &[u8]) -> Vec<u8> {
    let mut out = greeting().to_vec();
    let body = ready_body(socket_type);
    out.extend_from_slice(&[FLAG_COMMAND, body.len() as u8]);
    out.extend_from_slice(&body);
    out
}

/// ZMTP 3.0's greeting with NULL security, as a client (`as-server` 0).
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A command body's name and what follows it.
fn command(body: &[u8]) -> Result<(&[u8], &[u8]), ZmtpError> {
    let n = usize::from(
        *body
            .first()
            .ok_or_else(|| ZmtpError::Protocol("an empty command".into()))?,
    );
    let name = body
        .get(1..1 + n)
        .ok_or_else(|| ZmtpError::Protocol("a command's name is cut short".into()))?;
    Ok((name, &body[1 + n..]))
}

/// A property of a READY command: its name and value.
type Property<'a> = (&'a [u8], &'a [u8]);

/// A READY command's properties: `name-size name value-size(4) value`, repeated.
fn properties(mut rest: &[u8]) -> Result<Vec<Property<'_>>, ZmtpError> {
    let cut = || ZmtpError::Protocol("a READY property is cut short".into());
    let mut out = Vec::new();
    while let Some((&n, tail)) = rest.split_first() {
        let name = tail.get(..usize::from(n)).ok_or_else(cut)?;
        let tail = &tail[usize::from(n)..];
        let len = tail.get(..4).ok_or_else(cut)?;
        let len = u32::from_be_bytes(len.try_into().map_err(|_| cut())?) as usize;
        let value = tail
            .get(4..4usize.checked_add(len).ok_or_else(cut)?)
            .ok_or_else(cut)?;
        out.push((name, value));
        rest = &tail[4 + len..];
    }
    Ok(out)
}

/// An engine's event message split: the last three frames as `[topic, seq, payload]`, or `[seq, payload]` (no topic): the
/// topic, if any, the sequence number (8 bytes big-endian) and the payload.
pub fn topic_frames(mut f: Vec<Bytes>) -> Option<(Option<Bytes>, u64, Bytes)> {
    let payload = f.pop()?;
    let seq = f.pop()?;
    let seq = <[u8; 8]>::try_from(&seq[..]).ok().map(u64::from_be_bytes)?;
    Some((f.pop(), seq, payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// A scripted peer: accepts one connection, sends a PUB's greeting and READY, then
    /// `then`, and keeps the connection open.
    async fn scripted_pub(then: Vec<u8>) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            s.write_all(&hello(b"PUB")).await.unwrap();
            s.write_all(&then).await.unwrap();
            let mut sink = vec![0u8; 4096];
            while s.read(&mut sink).await.is_ok_and(|n| n > 0) {}
        });
        format!("tcp://{addr}")
    }

    fn short(flags: u8, body: &[u8]) -> Vec<u8> {
        let mut f = vec![flags, body.len() as u8];
        f.extend_from_slice(body);
        f
    }

    async fn sub(endpoint: &str) -> Connection {
        Connection::connect(
            endpoint,
            SocketType::Sub,
            KV_EVENT_LIMITS,
            Duration::from_secs(5),
        )
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn a_message_of_three_frames_arrives_whole() {
        let mut script = short(FLAG_MORE, b"kv");
        script.extend(short(FLAG_MORE, &7u64.to_be_bytes()));
        script.push(FLAG_LONG);
        script.extend_from_slice(&300u64.to_be_bytes());
        script.extend(std::iter::repeat_n(b'x', 300));
        let mut c = sub(&scripted_pub(script).await).await;
        let m = c.recv().await.unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(&m[0][..], b"kv");
        assert_eq!(m[2].len(), 300);
    }

    /// The 10-byte header that aborted the process through the `zeromq` crate.
    #[tokio::test]
    async fn a_frame_declaring_2_pow_62_bytes_is_refused_before_any_allocation() {
        let mut script = vec![FLAG_LONG];
        script.extend_from_slice(&(1u64 << 62).to_be_bytes());
        let mut c = sub(&scripted_pub(script).await).await;
        let e = c.recv().await.err().unwrap();
        assert!(matches!(e, ZmtpError::TooLarge(_)), "{e}");
    }

    #[tokio::test]
    async fn endless_more_frames_end_the_connection_at_the_frame_bound() {
        let mut script = Vec::new();
        for _ in 0..100 {
            script.extend(short(FLAG_MORE, b"x"));
        }
        let mut c = sub(&scripted_pub(script).await).await;
        let e = c.recv().await.err().unwrap();
        assert!(e.to_string().contains("frames in one message"), "{e}");
    }

    #[tokio::test]
    async fn frames_adding_up_past_the_message_bound_are_refused() {
        let limits = Limits {
            max_frame: 100,
            max_message: 150,
            ..KV_EVENT_LIMITS
        };
        let mut script = short(FLAG_MORE, &[0; 100]);
        script.extend(short(0, &[0; 100]));
        let endpoint = scripted_pub(script).await;
        let mut c = Connection::connect(&endpoint, SocketType::Sub, limits, Duration::from_secs(5))
            .await
            .unwrap();
        let e = c.recv().await.err().unwrap();
        assert!(matches!(e, ZmtpError::TooLarge(_)), "{e}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_begun_and_never_finished_times_out() {
        let script = vec![FLAG_MORE, 10, b'a'];
        let endpoint = scripted_pub(script).await;
        let mut c = sub(&endpoint).await;
        let e = c.recv().await.err().unwrap();
        assert!(matches!(e, ZmtpError::Timeout(_)), "{e}");
    }

    #[tokio::test]
    async fn a_ping_is_answered_and_the_next_message_still_arrives() {
        let mut ping = vec![4];
        ping.extend_from_slice(b"PING");
        ping.extend_from_slice(&[0, 10]);
        ping.extend_from_slice(b"ctx");
        let mut script = short(FLAG_COMMAND, &ping);
        script.extend(short(0, b"after"));
        let mut c = sub(&scripted_pub(script).await).await;
        assert_eq!(&c.recv().await.unwrap()[0][..], b"after");
    }

    #[test]
    fn endpoints_are_tcp_host_port() {
        assert_eq!(
            tcp_address("tcp://127.0.0.1:5557").unwrap(),
            "127.0.0.1:5557"
        );
        assert_eq!(tcp_address("tcp://*:5557").unwrap(), "0.0.0.0:5557");
        assert!(tcp_address("ipc:///tmp/x").is_err());
        assert!(tcp_address("tcp://host:99999").is_err());
    }

    #[test]
    fn properties_that_run_past_their_command_are_errors() {
        assert!(properties(&[11, b'S']).is_err());
        assert!(properties(&[1, b'S', 0, 0, 0, 9, b'x']).is_err());
        assert!(properties(&[1, b'S', 0xFF, 0xFF, 0xFF, 0xFF]).is_err());
        assert_eq!(
            properties(&[1, b'S', 0, 0, 0, 1, b'x']).unwrap(),
            vec![(&b"S"[..], &b"x"[..])]
        );
    }
}
