//! The subcommands' flags and what each does with them; `main.rs` parses and dispatches.

pub mod lab;
pub mod policy;
pub mod register;
pub mod worker;

use clap::Args;
use switchyard::config::ServeArgs;
use switchyard::discovery::etcd::EtcdConfig;
use switchyard::serve::serve;

#[derive(Args)]
pub struct EtcdArgs {
    /// etcd client URL(s), comma-separated.
    #[arg(
        long = "etcd",
        env = "SWITCHYARD_ETCD",
        value_delimiter = ',',
        required = true
    )]
    pub endpoints: Vec<String>,
    /// Root of Switchyard's keys in etcd.
    #[arg(long, env = "SWITCHYARD_ETCD_ROOT", default_value = "switchyard")]
    pub etcd_root: String,
    #[command(flatten)]
    pub access: switchyard::config::EtcdAccessArgs,
}

impl EtcdArgs {
    /// The etcd client configuration these flags describe.
    pub fn config(&self) -> anyhow::Result<EtcdConfig> {
        Ok(self.access.apply(EtcdConfig {
            root: self.etcd_root.clone(),
            ..EtcdConfig::new(self.endpoints.clone())
        })?)
    }
}

/// Runs the router until Ctrl-C or SIGTERM.
pub fn serve_command(args: Box<ServeArgs>) -> anyhow::Result<()> {
    let config = args.resolve()?;
    tokio_runtime()?.block_on(async move {
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", config.listen))?;
        println!("switchyard serving on http://{}", listener.local_addr()?);
        serve(config, listener, shutdown_signal()).await?;
        Ok(())
    })
}

pub fn tokio_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("install a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
