//! `handoff-consumer`: one replica of the durable consumer, run until SIGTERM or Ctrl-C.

use clap::Parser;
use handoff_consumer::config::ConsumerConfig;
use handoff_consumer::{Consumer, LocalCrm};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = ConsumerConfig::parse();
    handoff_shared::config::init_tracing(config.log_format);
    tracing::info!(?config, "starting handoff-consumer");
    let pool = config.database.connect("handoff-consumer").await?;
    let client = config.nats.connect("handoff-consumer").await?;
    let consumer = Consumer::build(pool, client.clone(), &config.subscription()?, LocalCrm, config.settings()).await?;
    let token = CancellationToken::new();
    tokio::spawn(handoff_shared::config::shutdown_on_signal(token.clone()));
    consumer.run_until_stopped(token).await?;
    client.drain().await?;
    Ok(())
}
