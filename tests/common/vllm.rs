//! Real vLLM engines for tests, on CPU: the engine `tools/vllm.sh` installs (which
//! `tools/test.sh` runs) serving the tiny model it builds (`tools/tiny-model.py`), with
//! its KV events on and `NixlConnector` (either side of a prefill/decode split). Each
//! engine runs in a process group of its own (vLLM's API server and its engine core),
//! killed whole when dropped.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::http::{self, HttpClient};
use super::procs::free_port;

/// The served model's name.
pub const MODEL: &str = "tiny";
/// The name its LoRA adapter is served under (`Vllm::spawn_with`).
pub const ADAPTER: &str = "tiny-lora";
/// Its context (`--max-model-len`).
pub const CONTEXT: u32 = 1024;
/// Its KV block size (vLLM on CPU takes multiples of 32).
pub const BLOCK: u32 = 32;
/// Its KV cache in blocks (`--num-gpu-blocks-override`): 2,048 tokens, small enough
/// that a test fills it.
pub const KV_BLOCKS: u32 = 64;

/// Where `tools/vllm.sh` installs the engine and the model.
fn home_path() -> PathBuf {
    std::env::var_os("SWITCHYARD_VLLM_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set"))
                .join(".cache/switchyard/vllm")
        })
}

/// Whether this test goes without vLLM (see `goes_without`): the first line of every
/// test that starts an engine.
pub fn no_vllm() -> bool {
    let home = home_path();
    let model = home.join("tiny-llama/model.safetensors");
    let engine = home.join("bin/python");
    // The adapter came with the model later: a model without it is built again.
    let adapter = home.join("tiny-llama/lora-a/adapter_model.safetensors");
    let missing = if !engine.exists() {
        engine
    } else if !model.exists() {
        model
    } else {
        adapter
    };
    super::goes_without("a vLLM engine and its test model (tools/vllm.sh)", &missing)
}

/// Where `tools/vllm.sh` installed the engine and the model.
pub fn home() -> PathBuf {
    let home = home_path();
    assert!(
        home.join("bin/python").exists() && home.join("tiny-llama/model.safetensors").exists(),
        "no vLLM engine in {}: run tools/vllm.sh (tools/test.sh does)",
        home.display()
    );
    home
}

/// The model's directory (its `tokenizer.json` is the router's too).
pub fn model_dir() -> PathBuf {
    home().join("tiny-llama")
}

/// The words the model's greedy answers run through, in order, from a chat's first
/// answer token on; and the two words after which it detours through byte tokens.
pub fn chain() -> (Vec<String>, Vec<String>) {
    let v: Value =
        serde_json::from_slice(&std::fs::read(model_dir().join("chain.json")).unwrap()).unwrap();
    let words = v["chain"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_str().unwrap().to_string())
        .collect();
    let detours = v["detours"].as_object().unwrap().keys().cloned().collect();
    (words, detours)
}

/// One vLLM engine.
pub struct Vllm {
    child: Option<Child>,
    pub port: u16,
    pub events: u16,
    pub replay: u16,
    /// NIXL's side channel (`NixlConnector`'s handshake between prefill and decode).
    nixl: u16,
    /// The core its compute thread is bound to.
    core: usize,
    /// Its KV block size.
    pub block: u32,
    /// Serves the test model's LoRA adapter too, as [`ADAPTER`].
    lora: bool,
    log: PathBuf,
}

impl Vllm {
    /// Starts an engine bound to `core` (two engines need one core each), logging to
    /// `dir`. [`Vllm::ready`] waits for it.
    pub fn spawn(core: usize, dir: &Path) -> Vllm {
        Vllm::spawn_with(core, dir, BLOCK, false)
    }

    /// As [`Vllm::spawn`], with KV blocks of `block` tokens (a multiple of 32), and the
    /// model's LoRA adapter served as [`ADAPTER`] if `lora`.
    pub fn spawn_with(core: usize, dir: &Path, block: u32, lora: bool) -> Vllm {
        let mut v = Vllm {
            child: None,
            port: free_port(),
            events: free_port(),
            replay: free_port(),
            nixl: free_port(),
            core,
            block,
            lora,
            log: dir.join(format!("vllm-{core}-{block}.log")),
        };
        v.start();
        v
    }

    fn start(&mut self) {
        let home = home();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        // vLLM binds an endpoint with a wildcard host and connects to any other.
        let events = format!(
            r#"{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{}", "replay_endpoint": "tcp://*:{}", "topic": "kv-events"}}"#,
            self.events, self.replay
        );
        let child = Command::new(home.join("bin/python"))
            .args(["-m", "vllm.entrypoints.cli.main", "serve"])
            .arg(home.join("tiny-llama"))
            .args(["--served-model-name", MODEL, "--host", "127.0.0.1"])
            .args(["--port", &self.port.to_string()])
            .args(["--max-model-len", &CONTEXT.to_string()])
            .args(["--block-size", &self.block.to_string()])
            .args(["--num-gpu-blocks-override", &KV_BLOCKS.to_string()])
            .args(["--dtype", "float32", "--enforce-eager"])
            .args(["--enable-prefix-caching", "--enable-prompt-tokens-details"])
            .args(["--kv-events-config", &events])
            // Either role of a split, and whole requests (without kv_transfer_params).
            .args([
                "--kv-transfer-config",
                r#"{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}"#,
            ])
            .args(if self.lora {
                vec![
                    "--enable-lora".to_string(),
                    "--max-lora-rank".into(),
                    "8".into(),
                    "--lora-modules".into(),
                    format!("{ADAPTER}={}", home.join("tiny-llama/lora-a").display()),
                ]
            } else {
                Vec::new()
            })
            // Its IPC sockets in the test's directory, which goes with the test: an engine
            // killed leaves them behind (in /tmp they piled up by the thousand).
            .env("VLLM_RPC_BASE_PATH", self.log.parent().expect("a log in a directory"))
            .env("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
            .env("VLLM_NIXL_SIDE_CHANNEL_PORT", self.nixl.to_string())
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_CPU_OMP_THREADS_BIND", self.core.to_string())
            .env("HF_HUB_OFFLINE", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("DO_NOT_TRACK", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("vLLM starts");
        self.child = Some(child);
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The router's `--worker` for it: its URL and its KV event sockets.
    pub fn worker_arg(&self) -> String {
        format!(
            "{}#kv_events=tcp://127.0.0.1:{}&kv_replay=tcp://127.0.0.1:{}&topic=kv-events",
            self.url(),
            self.events,
            self.replay
        )
    }

    /// Waits until it answers `/health` (vLLM takes ~1 minute to start on CPU); panics
    /// with its log's end if it exits or takes over 10 minutes.
    pub async fn ready(&mut self, c: &HttpClient) {
        let started = Instant::now();
        loop {
            if let Ok((s, _)) = tokio::time::timeout(
                Duration::from_secs(5),
                http::get_maybe(c, &format!("{}/health", self.url())),
            )
            .await
                && s == Some(hyper::StatusCode::OK)
            {
                return;
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                panic!(
                    "vLLM exited ({status}) before it was ready:\n{}",
                    self.log_tail()
                );
            }
            assert!(
                started.elapsed() < Duration::from_secs(600),
                "vLLM not ready in 10 minutes:\n{}",
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// The end of its log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// SIGKILL to the engine and its engine core, and reap.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // The process group this engine leads: its API server and engine core.
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same ports (after [`Vllm::kill`]).
    pub fn restart(&mut self) {
        self.kill();
        self.start();
    }

    /// A Prometheus gauge or counter of its `/metrics` (summed over its labels).
    pub async fn metric(&self, c: &HttpClient, name: &str) -> f64 {
        let (_, body) = http::get(c, &format!("{}/metrics", self.url())).await;
        super::router::series_sum(&String::from_utf8_lossy(&body), name, "")
    }
}

impl Drop for Vllm {
    fn drop(&mut self) {
        self.kill();
    }
}
