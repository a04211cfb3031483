//! `handoff-crm-sim`: serves the simulated CRM until SIGTERM or Ctrl-C.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{ArgAction, Parser};
use handoff_crm_sim::{CrmSim, SimConfig};
use handoff_shared::config::{DatabaseArgs, LogFormat};
use tokio_util::sync::CancellationToken;

/// A simulated remote CRM (tasks with idempotency keys and external ids) with fault injection.
///
/// The /_admin endpoints have no authentication: keep --listen on a loopback or private address.
#[derive(Debug, Parser)]
#[command(name = "handoff-crm-sim", version)]
struct Args {
    #[command(flatten)]
    database: DatabaseArgs,
    /// Address to serve HTTP on.
    #[arg(long, env = "CRM_SIM_LISTEN", default_value = "127.0.0.1:8089")]
    listen: SocketAddr,
    /// Bearer token every /v1 request must present (secret: never logged, not shown from the environment).
    #[arg(long, env = "CRM_SIM_AUTH_TOKEN", default_value = "sim-token", hide_env_values = true)]
    auth_token: String,
    /// How long an idempotency key is remembered, seconds; older keys are forgotten.
    #[arg(long, env = "CRM_SIM_IDEMPOTENCY_RETENTION_SECS", default_value_t = 24 * 3600)]
    idempotency_retention_secs: u64,
    /// Refuse a second task with the same external id (true/false).
    #[arg(long, env = "CRM_SIM_UNIQUE_EXTERNAL_ID", default_value_t = true, action = ArgAction::Set)]
    unique_external_id: bool,
    /// How old a task must be before the search (GET /v1/tasks?external_id=) lists it, milliseconds.
    #[arg(long, env = "CRM_SIM_QUERY_VISIBILITY_LAG_MS", default_value_t = 0)]
    query_visibility_lag_ms: u64,
    /// Latency added to every /v1 request, milliseconds.
    #[arg(long, env = "CRM_SIM_LATENCY_MS", default_value_t = 0)]
    latency_ms: u64,
    /// How long a request whose reply is lost (fault lose_reply_after_commit) is held before its
    /// connection is closed, seconds.
    #[arg(long, env = "CRM_SIM_LOST_REPLY_HOLD_SECS", default_value_t = 60)]
    lost_reply_hold_secs: u64,
    /// The upsert shape's record field holding the payload hash.
    #[arg(long, env = "CRM_SIM_UPSERT_HASH_FIELD", default_value = "Handoff_Payload_Hash__c")]
    upsert_hash_field: String,
    /// The upsert shape refuses an update that changes the payload hash (true/false).
    #[arg(long, env = "CRM_SIM_HASH_WRITE_ONCE", default_value_t = true, action = ArgAction::Set)]
    hash_write_once: bool,
    /// The unique-property shape's unique property (carries the operation key).
    #[arg(long, env = "CRM_SIM_UNIQUE_PROPERTY", default_value = "handoff_key")]
    unique_property: String,
    /// The unique-property shape's property holding the payload hash.
    #[arg(long, env = "CRM_SIM_HASH_PROPERTY", default_value = "handoff_hash")]
    hash_property: String,
    /// Log format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
}

impl Args {
    fn sim_config(&self) -> SimConfig {
        SimConfig {
            auth_token: self.auth_token.clone(),
            idempotency_retention: Duration::from_secs(self.idempotency_retention_secs),
            enforce_unique_external_id: self.unique_external_id,
            query_visibility_lag: Duration::from_millis(self.query_visibility_lag_ms),
            latency: Duration::from_millis(self.latency_ms),
            lost_reply_hold: Duration::from_secs(self.lost_reply_hold_secs),
            upsert_hash_field: self.upsert_hash_field.clone(),
            hash_write_once: self.hash_write_once,
            unique_property: self.unique_property.clone(),
            hash_property: self.hash_property.clone(),
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    handoff_shared::config::init_tracing(args.log_format);
    let config = args.sim_config();
    // `config` redacts the token; `args` would print it.
    tracing::info!(database = ?args.database, listen = %args.listen, ?config, "starting handoff-crm-sim");
    if !args.listen.ip().is_loopback() {
        tracing::warn!(listen = %args.listen, "the /_admin endpoints are unauthenticated and reachable on this address");
    }
    let pool = args.database.connect("handoff-crm-sim").await?;
    let sim = CrmSim::new(pool, config).await?;
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let shutdown = CancellationToken::new();
    tokio::spawn(handoff_shared::config::shutdown_on_signal(shutdown.clone()));
    sim.spawn(listener, shutdown).await.await??;
    tracing::info!("handoff-crm-sim stopped");
    Ok(())
}
