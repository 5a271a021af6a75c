//! An engine's KV event publisher (`tests/fixtures/kv_publisher.py`, driven line by
//! line), and the routers and clients the engine event tests follow it with.

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use switchyard::client::{Client, ClientConfig, HttpHealthCheck, OutlierConfig};
use switchyard::discovery::{DiscoveryUpdate, EndpointPath, EngineEventSource, InstanceInfo};
use switchyard::ids::{BlockHash, InstanceId};
use switchyard::kv::hash::BlockHasher;
use switchyard::router::KvRouter;

pub const PATIENCE: Duration = Duration::from_secs(30);

pub const BLOCK: u32 = 16;

pub const W: InstanceId = InstanceId(7);

/// The Python publisher.
pub struct Publisher {
    _child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
    pub pub_port: u16,
    pub replay_port: u16,
}

impl Publisher {
    pub async fn start(shape: &str) -> Publisher {
        Publisher::start_with(shape, &[]).await
    }

    pub async fn start_with(shape: &str, extra: &[&str]) -> Publisher {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/kv_publisher.py"
        );
        let mut child = Command::new("python3")
            .args([script, "--shape", shape, "--block-size", &BLOCK.to_string()])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs (tools/test.sh installs it, with pyzmq and msgspec)");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(PATIENCE, stdout.next_line())
            .await
            .expect("the publisher starts")
            .unwrap()
            .expect("the publisher says ready (are pyzmq and msgspec installed?)");
        let ports: Vec<u16> = line
            .strip_prefix("ready ")
            .unwrap_or_else(|| panic!("{line}"))
            .split(' ')
            .map(|p| p.parse().unwrap())
            .collect();
        Publisher {
            _child: child,
            stdin,
            stdout,
            pub_port: ports[0],
            replay_port: ports[1],
        }
    }

    /// Sends a command; returns the next sequence number.
    pub async fn send(&mut self, cmd: serde_json::Value) -> u64 {
        let mut line = cmd.to_string();
        line.push('\n');
        self.stdin.write_all(line.as_bytes()).await.unwrap();
        let answer = tokio::time::timeout(PATIENCE, self.stdout.next_line())
            .await
            .expect("the publisher answers")
            .unwrap()
            .expect("the publisher is alive");
        answer.strip_prefix("ok ").unwrap().parse().unwrap()
    }

    pub fn source(&self, replay: bool) -> EngineEventSource {
        EngineEventSource {
            endpoint: format!("tcp://127.0.0.1:{}", self.pub_port),
            replay: replay.then(|| format!("tcp://127.0.0.1:{}", self.replay_port)),
            topic: "kv-events".into(),
            data_parallel_size: 1,
        }
    }
}

/// Worker `id` of model `m` at `url`, with its engine's KV event sockets if any.
pub fn instance(
    id: InstanceId,
    url: String,
    engine_events: Option<EngineEventSource>,
) -> InstanceInfo {
    InstanceInfo {
        engine_events: engine_events.map(Arc::new),
        ..InstanceInfo::new(id, EndpointPath::for_model("m"), url, "m", BLOCK)
    }
}

/// A Client of model `m` over `instances` (no health probes: the workers' HTTP sides are
/// not what these tests are about).
pub fn client_of(instances: Vec<InstanceInfo>) -> Arc<Client> {
    let client = Client::new(
        EndpointPath::for_model("m"),
        ClientConfig {
            outlier: OutlierConfig {
                health_interval: None,
                ..OutlierConfig::default()
            },
            ..ClientConfig::default()
        },
        Arc::new(HttpHealthCheck::new(Duration::from_secs(1))),
    );
    client.apply(DiscoveryUpdate::Reset(instances));
    client
}

pub fn router(source: EngineEventSource) -> Arc<KvRouter> {
    let client = client_of(vec![instance(W, "http://127.0.0.1:9".into(), Some(source))]);
    let router = super::kv::kv_cost_router(client, BLOCK);
    super::kv::follow_events(&router);
    router
}

pub async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A prompt of `blocks` full blocks, distinct per `seed`.
pub fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| seed * 100_000 + i).collect()
}

pub fn hashes(tokens: &[u32]) -> Vec<BlockHash> {
    BlockHasher::new(BLOCK, 0).hashes(tokens)
}

pub fn sorted(mut v: Vec<BlockHash>) -> Vec<BlockHash> {
    v.sort_unstable();
    v
}

/// Leading blocks of `tokens` the router finds on the worker.
pub fn overlap(router: &KvRouter, tokens: &[u32]) -> u32 {
    let (c, _) = router.candidates(&hashes(tokens), &[]);
    c.overlap_of(W).unwrap_or(0)
}

/// `POST url` with a JSON body and the admin token; the JSON answer.
pub async fn admin_post(url: &str, body: &serde_json::Value) -> serde_json::Value {
    let c = super::http::client();
    let (status, _, bytes) = super::http::send(
        &c,
        hyper::Method::POST,
        url,
        &[
            ("authorization", "Bearer t0ken-for-the-tests"),
            ("content-type", "application/json"),
        ],
        body.to_string(),
        PATIENCE,
    )
    .await
    .unwrap();
    assert!(
        status.is_success(),
        "{status}: {}",
        String::from_utf8_lossy(&bytes)
    );
    serde_json::from_slice(&bytes).unwrap()
}

pub async fn eventually_async<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + PATIENCE;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A chat template unlike ChatML (Llama 3's shape), as a model's `tokenizer_config.json`.
pub const LLAMA3_CONFIG: &str = r#"{"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": "{{- bos_token }}\n{%- for message in messages %}\n{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n"}"#;
