//! What each subcommand connects to. Every connection is optional on the command line; a
//! subcommand asks for the ones it needs and fails, naming the flag and the variable, when one is
//! missing. Nothing is connected that a subcommand does not use.

use anyhow::{Context, Result, anyhow};
use handoff_shared::config::{DatabaseArgs, NatsArgs};
use sqlx::PgPool;

/// The databases, the stream and the durable consumer, as flags and environment variables (the
/// services' own names for stream and durable consumer). NATS settings belong to the subcommands
/// that read the broker (the services' own flags: `--nats-url`/`NATS_URL`, credentials, TLS).
#[derive(Debug, Clone, clap::Args)]
pub struct Connections {
    /// The application's database: approved actions and the outbox (relay's DATABASE_URL).
    #[arg(long, env = "HANDOFF_PRODUCER_DATABASE_URL", hide_env_values = true, global = true)]
    pub producer_database_url: Option<String>,
    /// The consumer's own database: inbox, CRM store, ledger, review and dead letters.
    #[arg(long, env = "HANDOFF_CONSUMER_DATABASE_URL", hide_env_values = true, global = true)]
    pub consumer_database_url: Option<String>,
    /// JetStream stream name.
    #[arg(long, env = "HANDOFF_STREAM", default_value = "HANDOFF", global = true)]
    pub stream: String,
    /// The durable pull consumer the replicas share.
    #[arg(long, env = "HANDOFF_CONSUMER_NAME", default_value = "handoff-crm", global = true)]
    pub consumer_name: String,
}

impl Connections {
    /// The producer database, or an error naming the setting.
    pub async fn producer(&self, command: &str) -> Result<PgPool> {
        let url = self.producer_database_url.as_deref().ok_or_else(|| {
            anyhow!("{command} needs the producer database: --producer-database-url or HANDOFF_PRODUCER_DATABASE_URL")
        })?;
        connect(url, "producer").await
    }

    /// The consumer database, or an error naming the setting.
    pub async fn consumer(&self, command: &str) -> Result<PgPool> {
        let url = self.consumer_database_url.as_deref().ok_or_else(|| {
            anyhow!("{command} needs the consumer database: --consumer-database-url or HANDOFF_CONSUMER_DATABASE_URL")
        })?;
        connect(url, "consumer").await
    }

    /// The producer database if it was given.
    pub async fn producer_if_given(&self) -> Result<Option<PgPool>> {
        match &self.producer_database_url {
            Some(url) => Ok(Some(connect(url, "producer").await?)),
            None => Ok(None),
        }
    }

    /// The consumer database if it was given.
    pub async fn consumer_if_given(&self) -> Result<Option<PgPool>> {
        match &self.consumer_database_url {
            Some(url) => Ok(Some(connect(url, "consumer").await?)),
            None => Ok(None),
        }
    }
}

/// JetStream. The first connection is bounded by `--nats-connect-timeout-secs`; its error names
/// the cause and what to check.
pub async fn jetstream(nats: &NatsArgs) -> Result<async_nats::jetstream::Context> {
    Ok(async_nats::jetstream::new(nats.connect("handoff-admin").await?))
}

async fn connect(url: &str, which: &str) -> Result<PgPool> {
    let mut args = DatabaseArgs::plain(url);
    args.max_connections = 4;
    args.connect("handoff-admin")
        .await
        .with_context(|| format!("connecting to the {which} database {}", handoff_shared::config::redact_url(url)))
}
