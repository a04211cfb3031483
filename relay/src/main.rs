//! `handoff-relay`: reads its configuration, builds the relay and runs it until SIGTERM or Ctrl-C.

use clap::Parser;
use handoff_relay::Relay;
use handoff_relay::config::RelayConfig;
use handoff_shared::config::{ServiceCommand, run_healthcheck, run_migrate};
use handoff_shared::observe::Endpoint;
use tokio_util::sync::CancellationToken;

fn main() -> std::process::ExitCode {
    handoff_shared::config::exit_with("handoff-relay", start())
}

fn start() -> anyhow::Result<()> {
    let config = RelayConfig::parse();
    handoff_shared::config::init_tracing(config.log_format);
    let runtime = config.runtime.build()?;
    match &config.command {
        Some(ServiceCommand::Migrate) => {
            return runtime.block_on(run_migrate(&config.database, &handoff_relay::SCHEMA, "handoff-relay"));
        }
        Some(ServiceCommand::Healthcheck { path }) => {
            return runtime.block_on(run_healthcheck(config.http_addr, path, "handoff-relay"));
        }
        None => {}
    }
    runtime.block_on(run(config))
}

async fn run(config: RelayConfig) -> anyhow::Result<()> {
    tracing::info!(?config, "starting handoff-relay");
    let settings = config.relay_settings()?;
    match &settings.signing {
        Some(key) => tracing::info!(key_id = %key.id(), "signing every message"),
        None => tracing::warn!(
            "--unsigned: messages are published unsigned; consumers accept them only with --allow-unsigned"
        ),
    }
    let pool = config.database.connect("handoff-relay").await?;
    let client = config.nats.connect("handoff-relay").await?;
    let relay = Relay::build(pool, client.clone(), config.stream_settings()?, settings).await?;
    let token = CancellationToken::new();
    tokio::spawn(handoff_shared::config::shutdown_on_signal(token.clone()));
    if let Some(addr) = config.http_addr.0 {
        let listener = Endpoint::bind(addr, "--http-addr").await?;
        tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
        tokio::spawn(relay.endpoint().serve(listener, token.clone()));
    }
    relay.run_until_stopped(token).await?;
    // Flush anything still buffered in the client before exiting.
    client.drain().await?;
    Ok(())
}
