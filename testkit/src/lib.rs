//! A test kit for integration suites of applications that use handoff: one call starts
//! Postgres (a producer and a consumer database, migrated), NATS JetStream, the relay and a
//! consumer replica (in your test's process, or as the real binaries), optionally the CRM
//! simulator, and hands back connection strings and helpers to record an approved action and wait
//! for its CRM task. Everything runs in containers started by [testcontainers] and is removed when
//! the [`Stack`] is dropped.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! # async fn example() -> anyhow::Result<()> {
//! let stack = handoff_testkit::Stack::start().await?;
//! // Your application writes its business rows and the approved action in one transaction against
//! // stack.producer_url(); the kit's own helper does the latter alone:
//! let key = "harbor:create-followup:v1:case-104";
//! stack.record(key, serde_json::json!({"case_id": "case-104", "title": "Call"}), "user-17").await?;
//! let task = stack.wait_for_task(key, Duration::from_secs(30)).await?;
//! assert_eq!(stack.task_count().await?, 1);
//! # let _ = task; Ok(()) }
//! ```
//!
//! * [`Stack::builder`] chooses the stream, subject prefix and durable names (random by default, so
//!   stacks in parallel tests never meet), [`Services::Processes`] to run the binaries, and
//!   [`StackBuilder::with_crm_sim`] for the remote-CRM path.
//! * Images: `HANDOFF_POSTGRES_IMAGE` (default `postgres:15`) and `HANDOFF_NATS_IMAGE` (default
//!   `nats:2.12`); see [`containers`].
//! * Messages are signed with a key the kit generates ([`Stack::keys`]), as in production.
//!
//! [testcontainers]: https://docs.rs/testcontainers

pub mod cluster;
pub mod containers;
pub mod keys;
pub mod process;
mod stack;

pub use containers::{Nats, Postgres};
pub use keys::Keys;
pub use process::ServiceProcess;
pub use stack::{CrmSimulator, SIM_ACCOUNT, Services, Stack, StackBuilder, Task};

/// A number that differs between calls and processes (names of keys directories, streams).
pub(crate) fn unique_u32() -> u32 {
    use std::hash::{BuildHasher, RandomState};
    use std::sync::atomic::{AtomicU32, Ordering};
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    RandomState::new().hash_one((std::time::SystemTime::now(), std::process::id(), n)) as u32
}
