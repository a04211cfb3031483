//! A simulated remote CRM with the delivery guarantees of a real one and the failures you need to
//! test against: replies lost after commit, resets, rate limits, unavailable readbacks, keys that
//! expire, searches that lag behind writes.
//!
//! The consumer's HTTP adapter, the integration tests and the demo talk to it over HTTP exactly as
//! they would talk to a provider; tests also inject faults and count effects in-process.
//!
//! # Wire contract (full version with examples in `crm-sim/README.md`)
//!
//! Every `/v1` request needs `Authorization: Bearer <auth_token>` (else 401
//! `{"error":"unauthorized"}`) and is delayed by [`SimConfig::latency`].
//!
//! * `POST /v1/tasks`, optional `Idempotency-Key` header (1-255 characters), body
//!   `{"external_id", "payload_hash" (64 lowercase hex), "data" (non-empty object)}`:
//!   201 new task, 200 with `"replayed": true` for the same key (or, with unique external ids,
//!   the same external id) and the same hash, 409 `idempotency_key_reused` /
//!   `external_id_conflict` for a different hash, 422 `validation`. Task and idempotency record
//!   commit in one transaction; a key older than [`SimConfig::idempotency_retention`] is forgotten.
//! * `GET /v1/tasks/by-key/{key}`: 200 task or 404 (also for a forgotten key); always carries
//!   `X-Idempotency-Retention-Secs`.
//! * `GET /v1/tasks/by-external-id/{id}`: 200 task, 404, or 409 `ambiguous` with `task_ids`.
//! * `GET /v1/tasks?external_id=X`: 200 `{"tasks": [...], "as_of": ...}`, only tasks at least
//!   [`SimConfig::query_visibility_lag`] old (an eventually consistent search).
//! * `/_admin/faults` (GET, POST a [`Fault`], DELETE), `GET /_admin/effects`
//!   ([`EffectsReport`]), `POST /_admin/tasks` (seed a task): no authentication, loopback only.
//!
//! # Example
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> anyhow::Result<()> {
//! use handoff_crm_sim::{CrmSim, Fault, FaultKind, SimConfig};
//!
//! let sim = CrmSim::new(pool, SimConfig::default()).await?;
//! sim.faults().inject(Fault::once_for("harbor:create-followup:v1:case-104", FaultKind::LoseReplyAfterCommit));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let base_url = format!("http://{}", listener.local_addr()?);
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! let server = sim.clone().spawn(listener, shutdown.clone()).await;
//! // ... drive the CRM at base_url ...
//! assert_eq!(sim.effects().await?, 1);
//! shutdown.cancel();
//! server.await??;
//! # Ok(())
//! # }
//! ```

mod faults;
mod http;
mod shapes;
mod store;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use faults::{Fault, FaultError, FaultKind, Faults};
pub use http::{IDEMPOTENCY_KEY, RETENTION_HEADER};
pub use store::{MAX_ID_CHARS, Task};

/// The simulator's schema migrations (schema `crm_sim`), embedded in the binary.
///
/// Their bookkeeping table is `crm_sim._sqlx_migrations`, not the default `public` one, so the
/// simulator can share a database with the consumer or relay without their migration histories
/// colliding (sqlx refuses to run when the table lists versions it does not know).
pub fn migrator() -> sqlx::migrate::Migrator {
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.dangerous_set_table_name("crm_sim._sqlx_migrations");
    migrator.create_schema("crm_sim");
    migrator
}

/// How the simulated CRM behaves when nothing is injected.
#[derive(Clone)]
pub struct SimConfig {
    /// The bearer token every `/v1` request must present.
    pub auth_token: String,
    /// How long an idempotency key is remembered; older records are ignored.
    pub idempotency_retention: Duration,
    /// Refuse a second task for an external id (a replay with the same hash returns the first).
    pub enforce_unique_external_id: bool,
    /// How old a task must be before `GET /v1/tasks?external_id=` lists it.
    pub query_visibility_lag: Duration,
    /// Added to every `/v1` request before it is handled.
    pub latency: Duration,
    /// How long a [`FaultKind::LoseReplyAfterCommit`] request is held before its connection is
    /// closed (longer than the client's timeout, so the client gives up first).
    pub lost_reply_hold: Duration,
    /// The upsert shape: the record field holding the payload hash.
    pub upsert_hash_field: String,
    /// The upsert shape: refuse an update that changes the payload hash (the validation rule an org
    /// installs for handoff). Off, an upsert silently overwrites: the hazard it guards against.
    pub hash_write_once: bool,
    /// The unique-property shape: the unique property carrying the operation key.
    pub unique_property: String,
    /// The unique-property shape: the property holding the payload hash.
    pub hash_property: String,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            auth_token: "sim-token".into(),
            idempotency_retention: Duration::from_secs(24 * 3600),
            enforce_unique_external_id: true,
            query_visibility_lag: Duration::ZERO,
            latency: Duration::ZERO,
            lost_reply_hold: Duration::from_secs(60),
            upsert_hash_field: "Handoff_Payload_Hash__c".into(),
            hash_write_once: true,
            unique_property: "handoff_key".into(),
            hash_property: "handoff_hash".into(),
        }
    }
}

impl fmt::Debug for SimConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimConfig")
            .field("auth_token", &"<redacted>")
            .field("idempotency_retention", &self.idempotency_retention)
            .field("enforce_unique_external_id", &self.enforce_unique_external_id)
            .field("query_visibility_lag", &self.query_visibility_lag)
            .field("latency", &self.latency)
            .field("lost_reply_hold", &self.lost_reply_hold)
            .field("upsert_hash_field", &self.upsert_hash_field)
            .field("hash_write_once", &self.hash_write_once)
            .field("unique_property", &self.unique_property)
            .field("hash_property", &self.hash_property)
            .finish()
    }
}

/// How many `/v1` requests of each sort passed authentication (faulted ones included).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestCounts {
    /// Creates of every shape: `POST /v1/tasks`, the upsert `PATCH .../sobjects/..`, `POST /crm/v3/objects/..`.
    pub creates: u64,
    /// Lookups: `GET /v1/tasks/by-key/..`, `GET /v1/tasks/by-external-id/..`, `GET .../sobjects/..`
    /// and `GET /crm/v3/objects/{type}/{id}`.
    pub readbacks: u64,
    /// Searches: `GET /v1/tasks?external_id=..` and `POST /crm/v3/objects/{type}/search`.
    pub queries: u64,
    /// Upserts that updated an existing record (each fires the CRM's update workflows).
    #[serde(default)]
    pub updates: u64,
}

/// `GET /_admin/effects`: what the CRM did, for checks like "exactly one task".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EffectsReport {
    /// Tasks ever created (seeded ones included): the provider effects.
    pub effects: i64,
    /// Every task, oldest first.
    pub tasks: Vec<Task>,
    pub requests: RequestCounts,
}

/// How many received trace headers the simulator keeps (the oldest are dropped first).
pub const MAX_TRACES: usize = 10_000;

/// A `traceparent` header the simulator received.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ReceivedTrace {
    /// `POST /v1/tasks`, `GET /v1/tasks/by-external-id/...`, ...
    pub request: String,
    pub traceparent: String,
}

#[derive(Debug, Default)]
struct Counters {
    creates: AtomicU64,
    readbacks: AtomicU64,
    queries: AtomicU64,
    updates: AtomicU64,
}

/// Shared by the handle and every request.
#[derive(Debug)]
struct Inner {
    store: store::Store,
    config: SimConfig,
    faults: Faults,
    counters: Counters,
    /// W3C `traceparent` headers received on the API, oldest first, at most [`MAX_TRACES`].
    traces: std::sync::Mutex<std::collections::VecDeque<ReceivedTrace>>,
    /// Cancelled when the server shuts down: ends injected delays and held replies, so a
    /// graceful shutdown does not wait out a 60 s lost-reply hold.
    stopping: CancellationToken,
}

/// The injected delay was cut short by shutdown.
#[derive(Debug)]
struct Stopping;

impl Inner {
    fn traces(&self) -> Vec<ReceivedTrace> {
        self.traces.lock().unwrap_or_else(|e| e.into_inner()).iter().cloned().collect()
    }

    fn record_trace(&self, request: String, traceparent: String) {
        let mut traces = self.traces.lock().unwrap_or_else(|e| e.into_inner());
        if traces.len() >= MAX_TRACES {
            traces.pop_front();
        }
        traces.push_back(ReceivedTrace { request, traceparent });
    }

    async fn pause(&self, delay: Duration) -> Result<(), Stopping> {
        tokio::select! {
            () = tokio::time::sleep(delay) => Ok(()),
            () = self.stopping.cancelled() => Err(Stopping),
        }
    }

    async fn report(&self) -> Result<EffectsReport, sqlx::Error> {
        let tasks = self.store.all_tasks().await?;
        let effects = self.store.effects().await?;
        Ok(EffectsReport { effects, tasks, requests: self.requests() })
    }

    fn requests(&self) -> RequestCounts {
        RequestCounts {
            creates: self.counters.creates.load(Ordering::Relaxed),
            readbacks: self.counters.readbacks.load(Ordering::Relaxed),
            queries: self.counters.queries.load(Ordering::Relaxed),
            updates: self.counters.updates.load(Ordering::Relaxed),
        }
    }
}

/// A simulated CRM on its own Postgres database. Cheap to clone: clones share state.
#[derive(Debug, Clone)]
pub struct CrmSim {
    inner: Arc<Inner>,
}

impl CrmSim {
    /// Runs the simulator's migrations on `pool` and builds a simulator with no faults.
    pub async fn new(pool: PgPool, config: SimConfig) -> anyhow::Result<Self> {
        migrator().run(&pool).await?;
        let store = store::Store::new(pool, config.idempotency_retention, config.enforce_unique_external_id);
        Ok(Self {
            inner: Arc::new(Inner {
                store,
                config,
                faults: Faults::default(),
                counters: Counters::default(),
                traces: Default::default(),
                stopping: CancellationToken::new(),
            }),
        })
    }

    /// The HTTP API and admin endpoints, for serving with `axum::serve` or calling in-process.
    pub fn router(&self) -> axum::Router {
        http::router(self.inner.clone())
    }

    /// Serves [`CrmSim::router`] on `listener` until `shutdown` is cancelled, then stops
    /// accepting, cuts injected delays and held replies short (those clients get no response)
    /// and returns once open connections have finished.
    pub async fn spawn(self, listener: TcpListener, shutdown: CancellationToken) -> JoinHandle<std::io::Result<()>> {
        let router = self.router();
        let stopping = self.inner.stopping.clone();
        tokio::spawn(async move {
            match listener.local_addr() {
                Ok(addr) => tracing::info!(%addr, "CRM simulator listening"),
                Err(error) => tracing::warn!(%error, "CRM simulator listening on an unknown address"),
            }
            axum::serve(listener, router)
                .with_graceful_shutdown(async move {
                    shutdown.cancelled().await;
                    stopping.cancel();
                })
                .await
        })
    }

    /// In-process fault injection (the same list `/_admin/faults` edits).
    pub fn faults(&self) -> &Faults {
        &self.inner.faults
    }

    /// Number of tasks ever created (provider effects), counted in the database.
    pub async fn effects(&self) -> anyhow::Result<i64> {
        Ok(self.inner.store.effects().await?)
    }

    /// Every task and the counts, as `GET /_admin/effects` reports them.
    pub async fn report(&self) -> anyhow::Result<EffectsReport> {
        Ok(self.inner.report().await?)
    }

    /// Requests received so far.
    pub fn requests(&self) -> RequestCounts {
        self.inner.requests()
    }

    /// The `traceparent` headers received so far (as `GET /_admin/traces` reports them).
    pub fn traces(&self) -> Vec<ReceivedTrace> {
        self.inner.traces()
    }

    /// The configuration this simulator runs with.
    pub fn config(&self) -> &SimConfig {
        &self.inner.config
    }
}
