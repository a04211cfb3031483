//! handoff relay: approved actions from the Postgres outbox to NATS JetStream.
//!
//! * [`outbox`] owns the producer tables and every statement on them, including the producer API
//!   [`outbox::record_approved_action`] that runs inside the caller's transaction.
//! * [`publisher`] owns the stream configuration and publishing (pipelined, atomic batches);
//!   [`auto_mode`] decides how `--publish-mode auto` sends a claim.
//! * [`relay`] orchestrates claim -> publish -> mark and the run loop.
//! * [`metrics`] is what `/metrics` shows; [`reconcile`] checks published rows against the stream.
//! * [`config`] is the command line / environment surface of the `handoff-relay` binary.

pub mod auto_mode;
pub mod config;
pub mod metrics;
pub mod outbox;
pub mod publisher;
pub mod reconcile;
pub mod relay;

pub use outbox::{ApprovedAction, RecordError, Recorded, record_approved_action};
pub use publisher::StreamSettings;
pub use relay::{Published, ReconcileSettings, Relay, RelayError, RelayFaults, RelaySettings};

/// The producer schema (`handoff`) and its migrations, embedded in the binary, with their history in
/// `handoff._sqlx_migrations` (never `public`, which belongs to the application). Concurrent runs
/// serialize on an advisory lock.
pub static SCHEMA: std::sync::LazyLock<handoff_shared::migrate::Schema> =
    std::sync::LazyLock::new(|| handoff_shared::migrate::Schema::new("handoff", sqlx::migrate!("./migrations")));
