//! handoff consumer: verified JetStream messages become CRM tasks, once per operation key.
//!
//! * [`inbox`] owns the consumer's tables and their batched statements.
//! * [`crm`] is the CRM boundary ([`crm::Crm`]) and the local store ([`crm::LocalCrm`]).
//! * [`remote`] is the remote-CRM path: the ledger row is written in the intake transaction
//!   ([`remote::ledger::LedgerCrm`]), the dispatcher calls the CRM through an adapter
//!   ([`remote::RemoteCrm`]) and proves every outcome by seed 004's table ([`remote::decide`]).
//! * [`review`] is the operators' queue (the `handoff-review` binary).
//! * [`subscription`] binds the durable pull consumer the replicas share.
//! * [`consumer`] orchestrates verify -> one transaction -> commit -> ack, and the run loop.
//! * [`config`] is the command line / environment surface of the `handoff-consumer` binary.

pub mod config;
pub mod consumer;
pub mod crm;
pub mod inbox;
pub mod metrics;
pub mod remote;
pub mod review;
pub mod subscription;

pub use consumer::{Consumer, ConsumerFaults, ConsumerSettings, Handled};
pub use crm::{Crm, LocalCrm};
pub use subscription::SubscriptionSettings;

/// How often a replica logs a progress line at info, so `docker logs` shows life.
pub const PROGRESS_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);

/// The consumer schema (`handoff_consumer`) and its migrations, embedded in the binary, with their
/// history in `handoff_consumer._sqlx_migrations`, so the consumer can share a database with the
/// relay or an application that runs sqlx migrations of its own.
pub static SCHEMA: std::sync::LazyLock<handoff_shared::migrate::Schema> = std::sync::LazyLock::new(|| {
    handoff_shared::migrate::Schema::new("handoff_consumer", sqlx::migrate!("./migrations"))
});
