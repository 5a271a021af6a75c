//! `switchyard register` and `switchyard instances`: a worker's registration in etcd, and what etcd holds.

use std::time::Duration;

use clap::Args;
use switchyard::discovery::etcd::list_all;
use switchyard::discovery::etcd_register::Registration;
use switchyard::discovery::{EndpointPath, InstanceInfo};
use switchyard::ids::InstanceId;

use super::{EtcdArgs, shutdown_signal};

#[derive(Args)]
pub struct RegisterArgs {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// The server's HTTP base URL, e.g. http://10.0.0.7:8000.
    #[arg(long)]
    pub url: String,
    /// The model it serves (selects the endpoint in the router).
    #[arg(long)]
    pub model: String,
    /// Endpoint path namespace/component/endpoint (default: default/MODEL/generate).
    #[arg(long)]
    pub endpoint: Option<EndpointPath>,
    /// Lease TTL in seconds; the registration disappears this long after a crash.
    #[arg(long, default_value_t = 10)]
    pub ttl: u64,
    /// The server's KV block size in tokens.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// URL of the server's KV event stream (Switchyard's NDJSON), if it publishes one.
    #[arg(long)]
    pub events_url: Option<String>,
    /// The engine's ZMQ KV event socket, e.g. tcp://10.0.0.7:5557 (vLLM's
    /// `--kv-events-config` endpoint, SGLang's the same), if it publishes one.
    #[arg(long)]
    pub kv_events: Option<String>,
    /// The engine's ZMQ replay socket, e.g. tcp://10.0.0.7:5558.
    #[arg(long, requires = "kv_events")]
    pub kv_replay: Option<String>,
    /// The topic the engine publishes its KV events under.
    #[arg(long, default_value = "", requires = "kv_events")]
    pub kv_topic: String,
    /// Data-parallel ranks of the engine (rank r publishes on the ports plus r).
    #[arg(long, default_value_t = 1, requires = "kv_events")]
    pub data_parallel_size: u32,
    /// Path of the server's health endpoint.
    #[arg(long, default_value = "/health")]
    pub health_path: String,
    /// What the server does in a fleet that splits prefill from decode: `prefill`,
    /// `decode` or `both`.
    #[arg(long, default_value_t = switchyard::discovery::Role::Both)]
    pub role: switchyard::discovery::Role,
    /// A prefill server's bootstrap port (SGLang's `--disaggregation-bootstrap-port`);
    /// given, the router hands requests over SGLang's way, otherwise vLLM's.
    #[arg(long)]
    pub bootstrap_port: Option<u16>,
    /// Instance ID in hex (default: random).
    #[arg(long)]
    pub instance_id: Option<InstanceId>,
}

pub fn random_instance_id() -> InstanceId {
    use std::hash::{BuildHasher, RandomState};
    InstanceId(RandomState::new().hash_one((std::process::id(), std::time::SystemTime::now())))
}

pub async fn register(args: RegisterArgs) -> anyhow::Result<()> {
    let config = args.etcd.config()?;
    let info = InstanceInfo {
        id: args.instance_id.unwrap_or_else(random_instance_id),
        endpoint: args
            .endpoint
            .unwrap_or_else(|| EndpointPath::for_model(&args.model)),
        url: args.url.trim_end_matches('/').to_string(),
        model: args.model,
        block_size: args.block_size,
        events_url: args.events_url,
        engine_events: args
            .kv_events
            .map(|endpoint| switchyard::discovery::EngineEventSource {
                endpoint,
                replay: args.kv_replay,
                topic: args.kv_topic,
                data_parallel_size: args.data_parallel_size,
            })
            .map(std::sync::Arc::new),
        health_path: args.health_path,
        registration: 0,
        role: args.role,
        bootstrap_port: args.bootstrap_port,
    };
    if let Some(src) = &info.engine_events {
        src.validate().map_err(anyhow::Error::msg)?;
    }
    anyhow::ensure!(
        info.bootstrap_port.is_none() || info.role == switchyard::discovery::Role::Prefill,
        "--bootstrap-port is a prefill server's: give --role prefill too"
    );
    anyhow::ensure!(
        info.bootstrap_port != Some(0),
        "--bootstrap-port 0 is not a port"
    );
    anyhow::ensure!(
        info.url.starts_with("http://") || info.url.starts_with("https://"),
        "--url must be an http(s) URL, got {}",
        info.url
    );
    let mut registration = Registration::start(config, &info, Duration::from_secs(args.ttl));
    let lease = registration
        .wait_registered(Duration::from_secs(15))
        .await?;
    println!(
        "registered {} (lease {lease:x}); Ctrl-C to deregister",
        registration.key()
    );
    shutdown_signal().await;
    registration.stop().await;
    println!("deregistered");
    Ok(())
}

pub async fn instances(etcd: EtcdArgs) -> anyhow::Result<()> {
    let (found, malformed) = list_all(&etcd.config()?).await?;
    println!(
        "{:<36} {:<18} {:<24} {:<8} URL",
        "ENDPOINT", "INSTANCE", "MODEL", "BLOCK"
    );
    for i in &found {
        println!(
            "{:<36} {:<18} {:<24} {:<8} {}",
            i.endpoint.to_string(),
            i.id.to_string(),
            i.model,
            i.block_size,
            i.url
        );
    }
    for e in &malformed {
        eprintln!("skipped: {e}");
    }
    println!("{} instance(s)", found.len());
    Ok(())
}
