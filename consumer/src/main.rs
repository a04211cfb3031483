//! `handoff-consumer`: one replica of the durable consumer, run until SIGTERM or Ctrl-C. With
//! `--crm http` it also runs this replica's dispatcher for the remote CRM.

use clap::Parser;
use handoff_consumer::config::{ConsumerConfig, CrmMode};
use handoff_consumer::remote::dispatcher::{self, Dispatcher};
use handoff_consumer::remote::ledger::LedgerCrm;
use handoff_consumer::{Consumer, LocalCrm};
use handoff_shared::config::{ServiceCommand, run_healthcheck, run_migrate};
use handoff_shared::observe::Endpoint;
use tokio_util::sync::CancellationToken;

fn main() -> std::process::ExitCode {
    handoff_shared::config::exit_with("handoff-consumer", start())
}

fn start() -> anyhow::Result<()> {
    let config = ConsumerConfig::parse();
    handoff_shared::config::init_tracing(config.log_format);
    let runtime = config.runtime.build()?;
    match &config.command {
        Some(ServiceCommand::Migrate) => {
            return runtime.block_on(run_migrate(&config.database, &handoff_consumer::SCHEMA, "handoff-consumer"));
        }
        Some(ServiceCommand::Healthcheck { path }) => {
            return runtime.block_on(run_healthcheck(config.http_addr, path, "handoff-consumer"));
        }
        None => {}
    }
    config.validate()?;
    runtime.block_on(run(config))
}

async fn run(config: ConsumerConfig) -> anyhow::Result<()> {
    tracing::info!(?config, "starting handoff-consumer");
    let settings = config.settings()?;
    let keys: Vec<String> = settings.signatures.key_ids().map(ToString::to_string).collect();
    if settings.signatures.allows_unsigned() {
        tracing::warn!(?keys, "--allow-unsigned: unsigned messages are accepted (signed ones are still verified)");
    } else {
        tracing::info!(?keys, "accepting messages signed with these keys only");
    }
    let pool = config.database.connect("handoff-consumer").await?;
    let client = config.nats.connect("handoff-consumer").await?;
    let token = CancellationToken::new();
    tokio::spawn(handoff_shared::config::shutdown_on_signal(token.clone()));
    let subscription = config.subscription()?;
    match config.crm.mode {
        CrmMode::Local => {
            let consumer = Consumer::build(pool, client.clone(), &subscription, LocalCrm, settings).await?;
            serve_endpoint(&config, consumer.endpoint(), &token).await?;
            consumer.run_until_stopped(token).await?;
        }
        CrmMode::Http => {
            let crm = config.crm.connect()?;
            let ledger = LedgerCrm { account: config.crm.account.clone() };
            let consumer = Consumer::build(pool, client.clone(), &subscription, ledger, settings).await?;
            serve_endpoint(&config, consumer.endpoint(), &token).await?;
            if config.dry_run {
                tracing::warn!("dry run: intake is recorded and acknowledged; this replica makes no CRM call");
                consumer.run_until_stopped(token).await?;
            } else {
                let dispatch_pool = dispatcher::connect_pool(&config.database).await?;
                let dispatcher = Dispatcher::new(dispatch_pool, crm, config.crm.dispatch_settings()).observed_by(
                    consumer.metrics(),
                    consumer.liveness(),
                    config.observe.stall_after(),
                );
                // Either half failing stops the replica; the orchestrator restarts it.
                tokio::try_join!(
                    consumer.run_until_stopped(token.clone()),
                    dispatcher.run_until_stopped(token.clone())
                )?;
            }
        }
    }
    client.drain().await?;
    Ok(())
}

/// Serves /metrics, /healthz and /readyz on `--http-addr` (unless it is empty) until `token` is
/// cancelled. Binding fails at startup, naming the setting.
async fn serve_endpoint(config: &ConsumerConfig, endpoint: Endpoint, token: &CancellationToken) -> anyhow::Result<()> {
    if let Some(addr) = config.http_addr.0 {
        let listener = Endpoint::bind(addr, "--http-addr").await?;
        tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
        tokio::spawn(endpoint.serve(listener, token.clone()));
    }
    Ok(())
}
