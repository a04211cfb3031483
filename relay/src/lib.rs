//! handoff relay: approved actions from the Postgres outbox to NATS JetStream.
//!
//! * [`outbox`] owns the producer tables and every statement on them, including the producer API
//!   [`outbox::record_approved_action`] that runs inside the caller's transaction.
//! * [`publisher`] owns the stream configuration and pipelined publishing.
//! * [`relay`] orchestrates claim -> publish -> mark and the run loop.
//! * [`metrics`] is what `/metrics` shows; [`reconcile`] checks published rows against the stream.
//! * [`config`] is the command line / environment surface of the `handoff-relay` binary.

pub mod config;
pub mod metrics;
pub mod outbox;
pub mod publisher;
pub mod reconcile;
pub mod relay;

pub use outbox::{ApprovedAction, RecordError, Recorded, record_approved_action};
pub use publisher::StreamSettings;
pub use relay::{Published, ReconcileSettings, Relay, RelayError, RelayFaults, RelaySettings};

/// The outbox schema migrations, embedded in the binary. Concurrent runs serialize on an advisory lock.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");
