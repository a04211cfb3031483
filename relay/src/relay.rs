//! The relay: moves due outbox rows to JetStream, at least once, with the operation key as message id.
//!
//! One step, [`Relay::publish_batch`]: claim a batch under lease (short transaction: an expired
//! range, else due retries, else the next range of new rows in commit order), publish it pipelined
//! (no transaction open), then record PubAcks and failures and release the lease (one statement).
//! If the process dies anywhere in between, the lease expires and another relay (or this one,
//! restarted) re-publishes; the broker reports the re-publish as a duplicate inside its window and
//! the consumer's unique index stops it after that. Nothing is skipped: a row leaves `pending` only
//! as `published` (with its stream sequence) or `blocked` (with its reason). Published rows are
//! deleted after the retention ([`RelaySettings::retention`]); blocked rows never are.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::context::PublishError;
use async_nats::jetstream::publish::PublishAck;
use chrono::{DateTime, Utc};
use handoff_shared::config::Plans;
use handoff_shared::logging::{Outage, error_chain};
use handoff_shared::migrate::MigrateMode;
use handoff_shared::observe::{Check, Endpoint, Heartbeat, Liveness, Readiness};
use handoff_shared::signing::SigningKey;
use handoff_shared::{Approval, Backoff, OperationKey, OutgoingEnvelope, PayloadText};
use prometheus_client::registry::Registry;
use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::auto_mode::{self, AutoMode, Way};
use crate::metrics::{ClassLabel, KindLabel, ReasonLabel, RelayMetrics, WayLabel, action_type};
use crate::outbox::{self, Claim, ClaimedRow, FailedRow, Failure, Lease, PublishedRow, RangeClaim, RetentionPosition};
use crate::publisher::{self, Outgoing, PublishMode, StreamSettings};
use crate::reconcile::{self, AtSequence, MismatchKind, Scope};

/// The channel `handoff.notify_outbox()` signals on.
pub const NOTIFY_CHANNEL: &str = "handoff_outbox";

/// Turns outbox notifications into wake-ups: each one wakes one idle worker (a worker whose batch
/// comes back full wakes the next). Notifications are hints: while the listener reconnects they
/// are lost, and the workers' polling covers that.
async fn listen(
    mut listener: PgListener,
    wake: Arc<Notify>,
    pause_after_error: Duration,
    token: CancellationToken,
) -> anyhow::Result<()> {
    loop {
        tokio::select! {
            _ = token.cancelled() => return Ok(()),
            notification = listener.recv() => match notification {
                Ok(_) => wake.notify_one(),
                Err(error) => {
                    tracing::warn!(error = %error_chain(&error), "outbox listener failed; polling continues");
                    tokio::select! {
                        _ = token.cancelled() => return Ok(()),
                        _ = tokio::time::sleep(pause_after_error) => {}
                    }
                }
            }
        }
    }
}

/// How the relay claims, retries and gives up.
#[derive(Debug, Clone)]
pub struct RelaySettings {
    /// Rows claimed per batch.
    pub batch_size: i64,
    /// How long a claim is held before other relays may take the rows.
    pub lease: Duration,
    /// How often an idle relay looks for due rows without a notification.
    pub poll_interval: Duration,
    /// Publish attempts before a row is blocked.
    pub max_attempts: u32,
    /// Age after which a row that still fails is blocked, whatever its attempts.
    pub max_age: Option<Duration>,
    pub backoff: Backoff,
    /// Concurrent claim-publish-mark loops in this process.
    pub workers: usize,
    /// CloudEvents `source` of published events.
    pub source: String,
    /// How long a committed row may wait behind an older open write transaction before it is
    /// claimed on its own (the per-row path) instead of in commit order.
    pub held_back: Duration,
    /// Published outbox rows are deleted this long after publishing (approved actions are kept); `None`
    /// keeps them forever. Long enough to re-publish a range if the broker loses acknowledged
    /// messages: the rows hold their stream sequence.
    pub retention: Option<Duration>,
    /// A loop that has not completed an iteration for this long is reported stalled (`/healthz`).
    pub stall_after: Duration,
    /// How often the backlog gauges are sampled from the database.
    pub sample_interval: Duration,
    /// Periodic reconciliation of recently published rows against the stream; `None` is off.
    pub reconcile: Option<ReconcileSettings>,
    /// Apply pending migrations at startup, or refuse to start while the schema is behind.
    pub migrate: MigrateMode,
    /// The envelope version to write (this build's newest by default; an older one while the
    /// consumers are upgraded after the relays).
    pub envelope_version: u32,
    /// The key every message is signed with; `None` publishes unsigned messages, which consumers
    /// refuse unless they run with `--allow-unsigned`.
    pub signing: Option<SigningKey>,
    /// Pipelined per-message publishes, atomic batches, or atomic where the broker allows it.
    pub publish_mode: PublishMode,
}

/// The relay's periodic reconciliation (see [`reconcile`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReconcileSettings {
    /// Time between runs.
    pub interval: Duration,
    /// Each run checks rows published this long ago or later.
    pub lookback: Duration,
}

/// How often the relay logs a progress line at info, so `docker logs` shows life.
pub const PROGRESS_INTERVAL: Duration = Duration::from_secs(30);

/// How often the relay checks whether the transactions holding rows back have ended, at first.
/// The usual blocker is another short transaction committing (a few milliseconds, mostly its WAL
/// flush), so a millisecond keeps the delay that small; the check is one tiny query.
const HORIZON_POLL: Duration = Duration::from_millis(1);
/// After this long the check backs off (doubling) towards the poll interval: a long transaction
/// is holding rows back, and the held-back rescue will deal with them.
const HORIZON_FAST_POLLING: Duration = Duration::from_millis(25);

/// Range claims in a row that may find the cursor moved past their snapshot by other relays
/// before one claim gives up (and reports more work due, so the worker comes straight back).
const CONTENDED_CLAIMS: usize = 4;

/// Rows examined per retention statement: big enough to make progress, small enough that each
/// statement is a short transaction that never holds back vacuum.
const RETENTION_CHUNK: i64 = 5_000;

impl Default for RelaySettings {
    fn default() -> Self {
        Self {
            batch_size: 1_000,
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_millis(500),
            max_attempts: 10,
            max_age: None,
            backoff: Backoff::default(),
            workers: 2,
            source: "/handoff/relay".into(),
            held_back: Duration::from_secs(1),
            retention: Some(Duration::from_secs(7 * 24 * 3600)),
            stall_after: handoff_shared::observe::DEFAULT_STALL_AFTER,
            sample_interval: handoff_shared::observe::DEFAULT_SAMPLE_INTERVAL,
            reconcile: None,
            migrate: MigrateMode::Auto,
            envelope_version: handoff_shared::envelope::SCHEMA_VERSION,
            signing: None,
            publish_mode: PublishMode::Auto,
        }
    }
}

/// Failure injection for tests: each counter, while above zero, makes the next batch fail at that
/// point exactly as a crash there would (the rows stay leased, nothing more is written).
#[derive(Debug, Default)]
pub struct RelayFaults {
    /// Publish the batch, receive the PubAcks, then "die" before marking the rows published.
    pub crash_after_publish: AtomicU32,
    /// The next worker iteration hangs (until shutdown), as a statement stuck on a lock would: its
    /// heartbeat stops and `/healthz` turns 503.
    pub stall_worker: AtomicU32,
}

impl RelayFaults {
    fn fire(counter: &AtomicU32) -> bool {
        counter.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
    }
}

/// What one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Published {
    /// Rows claimed from the outbox.
    pub claimed: usize,
    /// Rows marked published (including duplicates).
    pub published: usize,
    /// Of those, how many the broker already held (a re-publish).
    pub duplicates: usize,
    /// Rows rescheduled after a transient failure.
    pub retried: usize,
    /// Rows moved to `blocked`.
    pub blocked: usize,
    /// Rows held because their action type is paused.
    pub held: usize,
    /// The claim was full: more rows may be due right now.
    pub more_due: bool,
    /// Committed rows wait behind an older transaction that is still open: the transaction id of
    /// the oldest of them (see [`outbox::Claim::held_back_by`]).
    pub held_back_by: Option<u64>,
}

/// Why a claimed row is blocked instead of published: the metric's reason and the stored error.
#[derive(Debug)]
struct Refusal {
    reason: &'static str,
    error: String,
}

impl Refusal {
    fn new(reason: &'static str, error: impl Into<String>) -> Self {
        Self { reason, error: error.into() }
    }
}

/// Why a batch could not run. Rows already claimed stay leased and fall due again.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("outbox database error")]
    Database(#[from] sqlx::Error),
    /// A fault hook fired ([`RelayFaults`]); only tests set these.
    #[error("injected crash: {0}")]
    InjectedCrash(&'static str),
}

/// A relay bound to one outbox database and one stream.
#[derive(Debug, Clone)]
pub struct Relay {
    pool: PgPool,
    /// The workers' own pool for the statements of a batch's happy path
    /// ([`outbox::worker_statements`]), planned once per connection; one connection per worker, at
    /// most as many as `pool` has.
    worker_pool: PgPool,
    js: async_nats::jetstream::Context,
    /// How batches are published: [`PublishMode::Pipelined`] or [`PublishMode::Atomic`], as
    /// decided at startup from the setting, the server and the stream.
    mode: PublishMode,
    /// Numbers this relay's atomic batches (their ids are `<owner>-<n>-<chunk>`).
    batch_counter: Arc<std::sync::atomic::AtomicU64>,
    /// In auto mode, how claims go out, from what the broker's answers took.
    auto_mode: Arc<AutoMode>,
    stream: StreamSettings,
    settings: RelaySettings,
    owner: String,
    faults: Arc<RelayFaults>,
    metrics: RelayMetrics,
    registry: Arc<Registry>,
    liveness: Liveness,
    /// Publishes failing (the broker), one warning at the start and one at the end.
    publishing: Arc<Outage>,
    /// Batches failing as a whole (the database).
    batches: Arc<Outage>,
    /// Action types paused by an operator, as of the last sample.
    paused: Arc<std::sync::RwLock<HashSet<String>>>,
}

impl Relay {
    /// Runs migrations (or, with [`MigrateMode::Never`], checks that none is pending), creates or
    /// updates the stream, and warns when a row can be retried for longer than the broker
    /// remembers message ids.
    ///
    /// The relay works on its own connections to the database `pool` points at (same options and
    /// size, and one more connection per worker, at most as many as `pool` has), with these
    /// session settings:
    /// * `synchronous_commit = off`: every relay write is progress that can be redone (a claim, a
    ///   mark, a retention delete). If a database crash loses one, rows are published again and the
    ///   broker reports duplicates; nothing is lost, and the relay never waits for a WAL flush. Any
    ///   later synchronous commit (a producer's) flushes the relay's earlier writes with it.
    /// * On the pool's connections, `plan_cache_mode = force_custom_plan`: a generic plan made on
    ///   an empty outbox must not stick when a backlog arrives (platform notes; checked: without
    ///   `enable_seqscan = off`, the generic plan of the range claim made on an empty outbox is a
    ///   sequential scan and a sort).
    /// * On the workers' own connections, which run only [`outbox::worker_statements`] (the range
    ///   claim, its settle, the horizon check), [`Plans::OncePerConnection`]: each statement is
    ///   planned once per connection, with sequential scans off, as each reaches its rows by an
    ///   index at any outbox size (tested on an empty outbox and a filled one). Planning the range
    ///   claim took about as long as running it for a claim of a few rows: at low load it was half
    ///   of the claim's time (docs/benchmarks.md).
    pub async fn build(
        pool: PgPool,
        client: async_nats::Client,
        stream: StreamSettings,
        settings: RelaySettings,
    ) -> anyhow::Result<Self> {
        crate::SCHEMA.prepare(&pool, settings.migrate, "handoff-relay").await?;
        let base = (*pool.connect_options()).clone().options([("synchronous_commit", "off")]);
        // No ping before every statement (sqlx's default): it doubles the round trips of every
        // claim and mark. A broken connection fails its statement instead, the batch is retried
        // after a pause, and the pool replaces the connection.
        let pool_of = |size: u32, plans: Plans| {
            PgPoolOptions::new()
                .max_connections(size)
                .acquire_timeout(pool.options().get_acquire_timeout())
                .test_before_acquire(false)
                .connect_lazy_with(base.clone().options(plans.settings()))
        };
        let size = pool.options().get_max_connections();
        // One connection per worker (each runs one statement at a time), at most the pool's size:
        // more workers than that share them.
        let worker_pool = pool_of((settings.workers.max(1) as u32).min(size), Plans::OncePerConnection);
        let pool = pool_of(size, Plans::PerExecution);
        let js = async_nats::jetstream::new(client.clone());
        let version = client.server_info().version;
        let atomic_possible = publisher::supports_atomic(&version);
        let wants_atomic = match settings.publish_mode {
            PublishMode::Pipelined => false,
            PublishMode::Atomic => {
                anyhow::ensure!(
                    atomic_possible,
                    "--publish-mode atomic (HANDOFF_PUBLISH_MODE) needs nats-server 2.12 or later; this one is {version}: \
                     use pipelined or auto"
                );
                true
            }
            PublishMode::Auto => publisher::prefers_atomic(&version),
        };
        let info =
            publisher::ensure_stream_patiently(&js, &stream, wants_atomic, publisher::STREAM_SETUP_PATIENCE).await?;
        let mode = match (settings.publish_mode, wants_atomic && info.config.allow_atomic_publish) {
            (PublishMode::Pipelined, _) => PublishMode::Pipelined,
            (_, true) => PublishMode::Atomic,
            (PublishMode::Atomic, false) => anyhow::bail!(
                "--publish-mode atomic (HANDOFF_PUBLISH_MODE): stream {} does not allow atomic batches (allow_atomic \
                 is off after the update; a server before 2.12 ignores it)",
                stream.name
            ),
            (_, false) => {
                tracing::warn!(server = %version, stream = %stream.name,
                    "atomic batch publishing is not used (server before 2.15, or the stream does not allow it); publishing pipelined");
                PublishMode::Pipelined
            }
        };
        tracing::info!(?mode, server = %version, "publish mode");
        let horizon = settings.backoff.horizon(settings.max_attempts) + settings.lease;
        if horizon > stream.duplicate_window {
            tracing::warn!(
                retry_horizon_s = horizon.as_secs(),
                duplicate_window_s = stream.duplicate_window.as_secs(),
                "a row can be re-published after the stream's duplicate window; the consumer's unique \
                 index still stops the duplicate, but the broker will store it twice"
            );
        }
        let owner = format!("relay-{:016x}", rand::random::<u64>());
        let paused = outbox::paused_action_types(&pool).await?.into_iter().map(|p| p.action_type).collect();
        let mut registry = Registry::default();
        let metrics = RelayMetrics::register(&mut registry);
        Ok(Self {
            pool,
            worker_pool,
            js,
            mode,
            batch_counter: Arc::default(),
            auto_mode: Arc::default(),
            stream,
            settings,
            owner,
            faults: Arc::default(),
            metrics,
            registry: Arc::new(registry),
            liveness: Liveness::default(),
            publishing: Arc::new(Outage::new("publishing to the stream")),
            batches: Arc::new(Outage::new("outbox batches")),
            paused: Arc::new(std::sync::RwLock::new(paused)),
        })
    }

    /// This relay's metrics.
    pub fn metrics(&self) -> &RelayMetrics {
        &self.metrics
    }

    /// The `/metrics`, `/healthz` and `/readyz` endpoint of this relay.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint {
            registry: self.registry.clone(),
            liveness: self.liveness.clone(),
            readiness: Arc::new(RelayReadiness { relay: self.clone() }),
        }
    }

    /// How this relay publishes (decided at startup).
    pub fn publish_mode(&self) -> PublishMode {
        self.mode
    }

    /// The fault hooks of this relay (tests only).
    pub fn faults(&self) -> &RelayFaults {
        &self.faults
    }

    /// The workers' pool, whose connections plan each statement once (for tests that check
    /// those plans as the relay makes them).
    pub fn worker_pool(&self) -> &PgPool {
        &self.worker_pool
    }

    /// This relay's lease owner id.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// Claims one batch, publishes it and records the outcome.
    pub async fn publish_batch(&self) -> Result<Published, RelayError> {
        let started = Instant::now();
        let Claim { lease, rows, more_due, held_back_by } = self.claim().await?;
        let claimed_at = Instant::now();
        let mut outcome = Published { claimed: rows.len(), more_due, held_back_by, ..Published::default() };

        // Decide per row before anything is sent: over budget, or not what was approved -> blocked.
        let mut failed = Vec::new();
        let mut sendable = Vec::with_capacity(rows.len());
        let mut outgoing = Vec::with_capacity(rows.len());
        let paused = self.paused.read().unwrap_or_else(|e| e.into_inner()).clone();
        let mut held_per_action: HashMap<String, u64> = HashMap::new();
        for mut row in rows {
            let action = action_type(&row.operation_key);
            if paused.contains(action) {
                // Paused: hold it without counting this claim as an attempt.
                *held_per_action.entry(action.to_owned()).or_default() += 1;
                tracing::debug!(operation_key = %row.operation_key, "held: action type paused");
                failed.push(FailedRow {
                    id: row.id,
                    attempts: row.attempts - 1,
                    outcome: Failure::Hold,
                    error: "held: action type paused".into(),
                });
                continue;
            }
            match self.prepare(&row) {
                Ok((message, computed_hash)) => {
                    // The envelope holds the payload now: a claim keeps one copy of each payload
                    // while it is published, not two (1,000 x 64 KiB less for a claim of payloads
                    // near the limit).
                    row.payload = String::new();
                    outgoing.push(message);
                    sendable.push((row, computed_hash));
                }
                Err(refusal) => {
                    tracing::warn!(operation_key = %row.operation_key, reason = refusal.reason, error = %refusal.error, "row blocked before publishing");
                    self.metrics.blocked.get_or_create(&ReasonLabel { reason: refusal.reason }).inc();
                    failed.push(FailedRow {
                        id: row.id,
                        attempts: row.attempts,
                        outcome: Failure::Block,
                        error: refusal.error,
                    });
                }
            }
        }

        // In auto mode on a server with atomic batches, a claim goes out as the broker has answered
        // this relay's claims of its size sooner (crate::auto_mode); it feeds that estimate back.
        let auto = self.settings.publish_mode == PublishMode::Auto && self.mode == PublishMode::Atomic;
        let messages = outgoing.len();
        let acks = if outgoing.is_empty() {
            Vec::new()
        } else {
            let way = match self.mode {
                PublishMode::Atomic if auto => self.auto_mode.choose(messages),
                PublishMode::Atomic => Way::Atomic,
                PublishMode::Pipelined | PublishMode::Auto => Way::Pipelined,
            };
            self.metrics.claims_published.get_or_create(&WayLabel { way: way.label() }).inc();
            match way {
                Way::Atomic => self.publish_atomic(outgoing, auto).await,
                Way::Pipelined => self.publish_pipelined(outgoing, auto).await,
                Way::PipelinedFirst(n) => {
                    let rest = outgoing.split_off(n.min(messages));
                    let mut acks = self.publish_screen(outgoing, auto).await;
                    acks.extend(self.publish_atomic(rest, false).await);
                    acks
                }
            }
        };
        let published_at = Instant::now();
        if outcome.claimed > 0 && RelayFaults::fire(&self.faults.crash_after_publish) {
            return Err(RelayError::InjectedCrash("after publish, before marking rows published"));
        }

        let mut published = Vec::with_capacity(sendable.len());
        let mut first_failure: Option<String> = None;
        let mut published_per_action: HashMap<&str, u64> = HashMap::new();
        let mut duplicates_per_action: HashMap<&str, u64> = HashMap::new();
        for ((row, computed_hash), ack) in sendable.iter().zip(acks) {
            match ack {
                Ok(ack) if ack.duplicate && row.lost_sequence == Some(ack.sequence as i64) => {
                    // A re-queued row whose lost message the broker still remembers (its duplicate
                    // window has not passed, or its purge timer ran late): nothing was stored. Not a
                    // failure of the row: try again after the window, without counting an attempt.
                    tracing::info!(operation_key = %row.operation_key, sequence = ack.sequence,
                        "the broker still remembers the lost message's id; re-publishing after its duplicate window");
                    failed.push(FailedRow {
                        id: row.id,
                        attempts: row.attempts - 1,
                        outcome: Failure::RetryAfter(self.stream.duplicate_window),
                        error: format!(
                            "re-queued after broker loss; the broker still remembered sequence {} as this key",
                            ack.sequence
                        ),
                    });
                }
                Ok(ack) => {
                    let action = action_type(&row.operation_key);
                    *published_per_action.entry(action).or_default() += 1;
                    if ack.duplicate {
                        *duplicates_per_action.entry(action).or_default() += 1;
                        tracing::info!(operation_key = %row.operation_key, sequence = ack.sequence, "broker already held this message id");
                    } else {
                        tracing::debug!(operation_key = %row.operation_key, sequence = ack.sequence, attempts = row.attempts, "published");
                    }
                    published.push(PublishedRow {
                        id: row.id,
                        operation_key: row.operation_key.clone(),
                        attempts: row.attempts,
                        sequence: ack.sequence,
                        duplicate: ack.duplicate,
                        computed_hash: computed_hash.clone(),
                    });
                }
                Err(error) => {
                    let permanent = publisher::is_permanent(&error);
                    let decision = self.after_failure(row, permanent);
                    let cause = error_chain(&error);
                    self.metrics
                        .publish_failures
                        .get_or_create(&ClassLabel { class: publisher::failure_class(&error) })
                        .inc();
                    if decision == Failure::Block {
                        let reason = if permanent { "permanent_error" } else { "retry_budget" };
                        self.metrics.blocked.get_or_create(&ReasonLabel { reason }).inc();
                        tracing::warn!(operation_key = %row.operation_key, attempts = row.attempts, error = %cause, "publish failed; row blocked");
                    } else {
                        // The outage is logged once (below); each row only at debug.
                        tracing::debug!(operation_key = %row.operation_key, attempts = row.attempts, ?decision, error = %cause, "publish failed");
                    }
                    first_failure.get_or_insert_with(|| cause.clone());
                    failed.push(FailedRow {
                        id: row.id,
                        attempts: row.attempts,
                        outcome: decision,
                        error: format!("publish failed: {cause}"),
                    });
                }
            }
        }

        outcome.published = published.len();
        outcome.duplicates = published.iter().filter(|r| r.duplicate).count();
        outcome.retried = failed.iter().filter(|f| matches!(f.outcome, Failure::RetryAfter(_))).count();
        outcome.held = failed.iter().filter(|f| f.outcome == Failure::Hold).count();
        outcome.blocked = failed.len() - outcome.retried - outcome.held;
        // Also releases a range whose rows had all been handled elsewhere (nothing to send).
        outbox::settle(&self.worker_pool, &self.owner, &self.stream.name, lease, &published, &failed).await?;
        let settled_at = Instant::now();
        match first_failure {
            Some(cause) => {
                self.publishing.failed(&cause, (sendable.len() - published.len()) as u64);
            }
            None if !published.is_empty() => {
                self.publishing.succeeded();
            }
            None => {}
        }
        self.metrics.totals.add(published.len() as u64, (sendable.len() - published.len()) as u64);
        for (action, n) in held_per_action {
            self.metrics.held_paused.get_or_create(&crate::metrics::ActionLabel { action }).inc_by(n);
        }
        RelayMetrics::add_per_action(&self.metrics.published, &published_per_action);
        // Every action type that publishes has a duplicates series, at zero until the first one.
        for action in published_per_action.keys() {
            duplicates_per_action.entry(action).or_default();
        }
        RelayMetrics::add_per_action(&self.metrics.broker_duplicates, &duplicates_per_action);
        self.metrics.batches.inc();
        self.metrics.claim_duration.observe((claimed_at - started).as_secs_f64());
        if outcome.claimed > 0 {
            self.metrics.publish_duration.observe((published_at - claimed_at).as_secs_f64());
            self.metrics.settle_duration.observe((settled_at - published_at).as_secs_f64());
            tracing::debug!(
                claimed = outcome.claimed,
                claim_us = (claimed_at - started).as_micros() as u64,
                publish_us = (published_at - claimed_at).as_micros() as u64,
                settle_us = (settled_at - published_at).as_micros() as u64,
                "batch timings"
            );
        }
        Ok(outcome)
    }

    /// Publishes `outgoing` in atomic batches; with `timed`, feeds how long a claim that was
    /// committed whole took into the auto mode's estimate.
    async fn publish_atomic(&self, outgoing: Vec<Outgoing>, timed: bool) -> Vec<Result<PublishAck, PublishError>> {
        let (messages, n) = (outgoing.len(), self.batch_counter.fetch_add(1, Ordering::Relaxed));
        let sent = Instant::now();
        let atomic = publisher::publish_atomic(&self.js, &format!("{}-{n}", self.owner), outgoing).await;
        // Timed only if every batch committed as one (a refused or mismatched batch goes out per
        // message, which is not an atomic batch's time).
        let whole = atomic.committed as usize == messages.div_ceil(publisher::ATOMIC_BATCH_LIMIT);
        if timed && whole && atomic.fallbacks == 0 && atomic.results.iter().all(Result::is_ok) {
            self.auto_mode.timed(Way::Atomic, messages, sent.elapsed());
        }
        self.metrics.atomic_batches.inc_by(atomic.committed);
        self.metrics.atomic_fallbacks.inc_by(atomic.fallbacks);
        atomic.results
    }

    /// Publishes `outgoing` pipelined; with `timed`, feeds how long it took until every message
    /// was stored into the auto mode's estimate.
    async fn publish_pipelined(&self, outgoing: Vec<Outgoing>, timed: bool) -> Vec<Result<PublishAck, PublishError>> {
        let messages = outgoing.len();
        let sent = Instant::now();
        let results = publisher::publish_pipelined(&self.js, outgoing).await;
        if timed && results.iter().all(Result::is_ok) {
            self.auto_mode.timed(Way::Pipelined, messages, sent.elapsed());
        }
        results
    }

    /// Publishes a screen's rows pipelined in [`auto_mode::SCREEN_PARTS`] parts, each sent once the
    /// one before has its PubAcks; with `timed`, feeds the fastest part into the auto mode's
    /// estimate (a broker busy for a moment with another relay's atomic batch slows one part, a
    /// broker that fsyncs each message every part).
    async fn publish_screen(&self, mut outgoing: Vec<Outgoing>, timed: bool) -> Vec<Result<PublishAck, PublishError>> {
        let part = outgoing.len().div_ceil(auto_mode::SCREEN_PARTS).max(1);
        let mut results = Vec::with_capacity(outgoing.len());
        let per_row = |(rows, took): (usize, Duration)| took.as_secs_f64() / rows as f64;
        let mut fastest: Option<(usize, Duration)> = None;
        while !outgoing.is_empty() {
            let rest = outgoing.split_off(part.min(outgoing.len()));
            let rows = outgoing.len();
            let sent = Instant::now();
            results.extend(publisher::publish_pipelined(&self.js, std::mem::replace(&mut outgoing, rest)).await);
            let this = (rows, sent.elapsed());
            if fastest.is_none_or(|fastest| per_row(this) < per_row(fastest)) {
                fastest = Some(this);
            }
        }
        if let Some((rows, took)) = fastest
            && timed
            && results.iter().all(Result::is_ok)
        {
            self.auto_mode.timed(Way::PipelinedFirst(rows), rows, took);
        }
        results
    }

    /// The next claim, most urgent first: a dead relay's range, then due retries, then new rows.
    /// On the happy path this is one statement: the range claim looks for the others itself.
    async fn claim(&self) -> Result<Claim, sqlx::Error> {
        let (limit, lease) = (self.settings.batch_size, self.settings.lease);
        let mut check_priority = true;
        for _ in 0..CONTENDED_CLAIMS {
            match outbox::claim_new_range(&self.worker_pool, &self.owner, limit, lease, check_priority).await? {
                RangeClaim::Claimed(claim) => return Ok(claim),
                RangeClaim::Contended => {
                    tracing::debug!("another relay moved the range cursor past this claim's snapshot; claiming again");
                    continue;
                }
                RangeClaim::Priority { expired_range, due_retries } => {
                    if expired_range
                        && let Some(claim) = outbox::claim_expired_range(&self.pool, &self.owner, lease).await?
                    {
                        return Ok(claim);
                    }
                    if due_retries {
                        let rows = outbox::claim_retry_rows(&self.pool, &self.owner, limit, lease).await?;
                        if !rows.is_empty() {
                            let more_due = rows.len() as i64 >= limit;
                            return Ok(Claim { lease: Lease::Rows, rows, more_due, held_back_by: None });
                        }
                    }
                    // Another relay took them first: new rows, then.
                    check_priority = false;
                }
            }
        }
        // Other relays keep winning the cursor: they are busy with the backlog, come back at once.
        Ok(Claim { lease: Lease::Nothing, rows: Vec::new(), more_due: true, held_back_by: None })
    }

    /// Hands rows that have waited [`RelaySettings::held_back`] behind an older open transaction to
    /// the per-row path, so a long transaction elsewhere cannot stall delivery. Returns how many.
    pub async fn rescue_held_back_rows(&self) -> Result<u64, RelayError> {
        Ok(outbox::rescue_held_back_rows(&self.pool, self.settings.held_back, self.settings.batch_size).await?)
    }

    /// One retention pass: deletes published rows older than the retention, a chunk per statement,
    /// until it reaches rows that are still young: first published ranges with the rows they list,
    /// oldest first, then rows published one by one (the retry path), in commit order. Returns how
    /// many outbox rows it deleted.
    pub async fn apply_retention(&self) -> Result<u64, RelayError> {
        let Some(retention) = self.settings.retention else { return Ok(0) };
        let mut deleted = 0;
        loop {
            let step = outbox::delete_expired_ranges(&self.pool, RETENTION_CHUNK, retention).await?;
            deleted += step.deleted as u64;
            if step.reached_young || step.ranges == 0 {
                break;
            }
        }
        let mut position = RetentionPosition::start();
        loop {
            let step = outbox::delete_expired(&self.pool, &position, RETENTION_CHUNK, retention).await?;
            deleted += step.deleted as u64;
            match step.next {
                Some(next) if !step.reached_young && step.examined >= RETENTION_CHUNK => position = next,
                _ => break,
            }
        }
        if deleted > 0 {
            tracing::info!(deleted, retention_s = retention.as_secs(), "deleted published rows past retention");
        }
        Ok(deleted)
    }

    /// Builds the envelope for a claimed row, or says why the row must be blocked instead.
    fn prepare(&self, row: &ClaimedRow) -> Result<(Outgoing, Option<String>), Refusal> {
        if row.attempts as u32 > self.settings.max_attempts {
            return Err(Refusal::new("retry_budget", format!("retry budget exhausted: {} attempts", row.attempts - 1)));
        }
        if self.too_old(row.created_at) {
            return Err(Refusal::new("retry_budget", "retry budget exhausted: older than max age"));
        }
        let key: OperationKey = row
            .operation_key
            .parse()
            .map_err(|e| Refusal::new("invalid_row", format!("stored key is invalid: {e}")))?;
        let payload = PayloadText::from_json(&row.payload)
            .map_err(|e| Refusal::new("invalid_row", format!("stored payload is invalid: {e}")))?;
        let hash = payload.hash();
        let computed_hash = match row.payload_hash.as_deref() {
            None => Some(hash.to_string()),
            // A hash has one spelling, 64 lowercase hex digits (`PayloadHash` parses nothing else):
            // equal text is an equal hash, and text in any other spelling was never a valid one.
            Some(stored) if stored.as_bytes() == hash.write_hex(&mut [0u8; 64]).as_bytes() => None,
            // The stored payload no longer hashes to what was approved: never send it.
            Some(_) => {
                return Err(Refusal::new(
                    "payload_changed",
                    "payload changed after approval: stored hash does not match",
                ));
            }
        };
        let approval = Approval::new(&row.approved_by, row.approved_at)
            .map_err(|e| Refusal::new("invalid_row", format!("stored approval is invalid: {e}")))?;
        let subject = self.stream.subjects.for_key(&key);
        // Stored through the SQL contract's check; a value that does not parse is only a lost trace.
        let traceparent = row.traceparent.as_deref().and_then(|tp| tp.parse().ok());
        let envelope = OutgoingEnvelope {
            key: &key,
            payload: &payload,
            approval: &approval,
            source: &self.settings.source,
            time: row.recorded_at,
            traceparent,
        };
        let body = envelope.encode_signed(self.settings.envelope_version, self.settings.signing.as_ref());
        Ok((Outgoing { subject, key: row.operation_key.clone(), body }, computed_hash))
    }

    fn too_old(&self, created_at: DateTime<Utc>) -> bool {
        self.settings.max_age.is_some_and(|max| (Utc::now() - created_at).to_std().is_ok_and(|age| age > max))
    }

    /// Retry or block after a failed publish: permanent errors and exhausted budgets block.
    fn after_failure(&self, row: &ClaimedRow, permanent: bool) -> Failure {
        if permanent || row.attempts as u32 >= self.settings.max_attempts || self.too_old(row.created_at) {
            Failure::Block
        } else {
            Failure::RetryAfter(self.settings.backoff.delay(row.attempts as u32))
        }
    }

    /// Runs `workers` loops (and retention, the sampler and the periodic reconciliation) until
    /// `token` is cancelled; each worker finishes its current batch first, so a SIGTERM never leaves
    /// published-but-unmarked rows behind (beyond a crash's lease expiry).
    pub async fn run_until_stopped(self, token: CancellationToken) -> anyhow::Result<()> {
        // One listener per process. Register interest before the first claim so no insert slips
        // between them unnoticed.
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.listen(NOTIFY_CHANNEL).await?;
        let wake = Arc::new(Notify::new());
        let mut tasks = JoinSet::new();
        tasks.spawn(listen(listener, wake.clone(), self.settings.poll_interval, token.clone()));
        for worker in 0..self.settings.workers.max(1) {
            let relay = self.clone();
            let (wake, token) = (wake.clone(), token.clone());
            let heartbeat = self.liveness.register(format!("relay worker {worker}"), self.settings.stall_after);
            tasks.spawn(async move { relay.work(worker, &heartbeat, wake, token).await });
        }
        if let Some(retention) = self.settings.retention {
            let relay = self.clone();
            let token = token.clone();
            tasks.spawn(async move { relay.retain(retention, token).await });
        }
        {
            let relay = self.clone();
            let token = token.clone();
            let heartbeat = self.liveness.register("relay sampler", self.settings.stall_after);
            tasks.spawn(async move { relay.sample_periodically(&heartbeat, token).await });
        }
        if let Some(settings) = self.settings.reconcile {
            let relay = self.clone();
            let token = token.clone();
            tasks.spawn(async move { relay.reconcile_periodically(settings, token).await });
        }
        tracing::info!(owner = %self.owner, workers = self.settings.workers.max(1), stream = %self.stream.name, "relay running");
        while let Some(result) = tasks.join_next().await {
            result??;
        }
        tracing::info!(owner = %self.owner, "relay stopped");
        Ok(())
    }

    async fn work(
        &self,
        worker: usize,
        heartbeat: &Heartbeat,
        wake: Arc<Notify>,
        token: CancellationToken,
    ) -> anyhow::Result<()> {
        let mut failures = 0u32;
        let mut held_back_since: Option<Instant> = None;
        while !token.is_cancelled() {
            heartbeat.beat();
            if RelayFaults::fire(&self.faults.stall_worker) {
                tracing::warn!(worker, "injected stall: this worker hangs until shutdown");
                token.cancelled().await;
                break;
            }
            let batch = match self.publish_batch().await {
                Ok(batch) => batch,
                Err(error) => {
                    failures += 1;
                    self.metrics.batch_errors.inc();
                    let cause = error_chain(&error);
                    if !self.batches.failed(&cause, 0) {
                        tracing::debug!(worker, error = %cause, "relay batch failed");
                    }
                    // Shutdown wins over the pause; the pause beats, it is not a stall.
                    if !heartbeat.pause(self.settings.backoff.delay(failures), &token).await {
                        break;
                    }
                    continue;
                }
            };
            if failures > 0 {
                self.batches.succeeded();
            }
            failures = 0;
            if batch.claimed > 0 {
                tracing::debug!(worker, ?batch, "batch done");
            }
            if batch.more_due {
                // A full batch: more may be due. Bring in an idle worker too, and go again.
                wake.notify_one();
                continue;
            }
            if let Some(transaction_id) = batch.held_back_by {
                let since = *held_back_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= self.settings.held_back {
                    self.rescue(worker).await;
                    held_back_since = None;
                    continue;
                }
                // Rows are committed but an older transaction is still open: no notification will
                // say when it ends, so watch the horizon, then claim again.
                if let Err(error) = self.wait_for_horizon(transaction_id, &token).await {
                    tracing::warn!(worker, error = %error_chain(&error), "cannot read the transaction horizon; polling continues");
                }
                continue;
            }
            held_back_since = None;
            tokio::select! {
                // Stop requested while idle: nothing is in flight.
                _ = token.cancelled() => break,
                // A producer committed outbox rows: look now rather than at the next poll.
                _ = wake.notified() => {}
                // Polling is the guarantee: retries fall due and notifications can be lost.
                _ = tokio::time::sleep(self.settings.poll_interval) => {}
            }
        }
        Ok(())
    }

    /// Samples the backlog into the gauges now. Returns the sample (also for the progress line).
    pub async fn sample(&self) -> Result<outbox::BacklogSample, RelayError> {
        // The pauses first: rows of a resumed action type are released by the same pass.
        let paused: HashSet<String> =
            outbox::paused_action_types(&self.pool).await?.into_iter().map(|p| p.action_type).collect();
        *self.paused.write().unwrap_or_else(|e| e.into_inner()) = paused;
        let released = outbox::release_resumed(&self.pool).await?;
        if released > 0 {
            tracing::info!(rows = released, "released held rows: their action type was resumed");
        }
        let sample = outbox::sample_backlog(&self.pool).await?;
        let m = &self.metrics;
        m.outbox_rows.get_or_create(&crate::metrics::StateLabel { state: "pending" }).set(sample.pending);
        m.outbox_rows.get_or_create(&crate::metrics::StateLabel { state: "blocked" }).set(sample.blocked);
        m.oldest_pending_age.set(sample.oldest_pending_s);
        m.held_back_rows.set(sample.held_back);
        m.held_back_transaction_age.set(sample.held_back_s);
        m.paused_action_types.set(sample.paused);
        Ok(sample)
    }

    /// Samples every [`RelaySettings::sample_interval`] and logs a progress line every
    /// [`PROGRESS_INTERVAL`]: what was published since the last line, and the backlog.
    async fn sample_periodically(&self, heartbeat: &Heartbeat, token: CancellationToken) -> anyhow::Result<()> {
        let mut last_line = Instant::now();
        let mut published_before = self.published_total();
        let mut failures_before = self.failures_total();
        loop {
            match self.sample().await {
                Ok(sample) if last_line.elapsed() >= PROGRESS_INTERVAL => {
                    let (published, failures) = (self.published_total(), self.failures_total());
                    let seconds = last_line.elapsed().as_secs_f64();
                    tracing::info!(
                        published = published - published_before,
                        per_second = ((published - published_before) as f64 / seconds).round(),
                        failed_publishes = failures - failures_before,
                        pending = sample.pending,
                        pending_estimated = sample.estimated,
                        oldest_pending_s = sample.oldest_pending_s.round(),
                        blocked = sample.blocked,
                        held_back = sample.held_back,
                        paused_action_types = sample.paused,
                        "progress"
                    );
                    if sample.held_back > 0 {
                        tracing::warn!(
                            rows = sample.held_back,
                            transaction_age_s = sample.held_back_s.round(),
                            holder =
                                sample.held_back_by.as_deref().unwrap_or("not visible to this role (grant pg_monitor)"),
                            "rows wait behind an open write transaction"
                        );
                    }
                    (published_before, failures_before, last_line) = (published, failures, Instant::now());
                }
                Ok(_) => {}
                Err(error) => {
                    self.metrics.sample_errors.inc();
                    tracing::debug!(error = %error_chain(&error), "sampling the backlog failed; the gauges keep their last value");
                }
            }
            if !heartbeat.pause(self.settings.sample_interval, &token).await {
                return Ok(());
            }
        }
    }

    fn published_total(&self) -> u64 {
        self.metrics.totals.published.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn failures_total(&self) -> u64 {
        self.metrics.totals.failed_publishes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Checks rows published within `lookback` against the stream (the producer's half of
    /// `handoff-admin reconcile`) and sets `handoff_reconcile_mismatches`. Without the consumer's
    /// database a missing message counts as lost by the broker whether or not it was consumed
    /// first; `handoff-admin reconcile` tells the two apart.
    pub async fn reconcile_recent(&self, lookback: Duration) -> anyhow::Result<Vec<(MismatchKind, String)>> {
        let since = Utc::now() - chrono::Duration::from_std(lookback)?;
        let stream = self.js.get_stream(&self.stream.name).await?;
        let first_sequence = stream.get_info().await?.state.first_sequence;
        let mut findings = Vec::new();
        let mut position = reconcile::Position::start();
        loop {
            let chunk =
                reconcile::published_chunk(&self.pool, Scope::Since(since), &position, reconcile::CHUNK_ROWS).await?;
            let found = reconcile::probe(&stream, &chunk.rows, first_sequence).await?;
            for (row, at) in chunk.rows.iter().zip(found) {
                match at {
                    AtSequence::Same | AtSequence::Expired => {}
                    AtSequence::Missing => findings.push((MismatchKind::LostByBroker, row.operation_key.clone())),
                    AtSequence::Other { .. } => {
                        findings.push((MismatchKind::SequenceReused, row.operation_key.clone()))
                    }
                }
            }
            match chunk.next {
                Some(next) => position = next,
                None => break,
            }
        }
        for kind in [MismatchKind::LostByBroker, MismatchKind::SequenceReused] {
            let n = findings.iter().filter(|(k, _)| *k == kind).count();
            self.metrics.reconcile_mismatches.get_or_create(&KindLabel { kind: kind.as_str() }).set(n as i64);
        }
        self.metrics.reconcile_runs.inc();
        Ok(findings)
    }

    async fn reconcile_periodically(
        &self,
        settings: ReconcileSettings,
        token: CancellationToken,
    ) -> anyhow::Result<()> {
        loop {
            tokio::select! {
                _ = token.cancelled() => return Ok(()),
                _ = tokio::time::sleep(settings.interval) => {}
            }
            tokio::select! {
                _ = token.cancelled() => return Ok(()),
                result = self.reconcile_recent(settings.lookback) => match result {
                    Ok(findings) if findings.is_empty() => {
                        tracing::debug!(lookback_s = settings.lookback.as_secs(), "reconciled: the stream holds every published row");
                    }
                    Ok(findings) => {
                        let sample: Vec<&str> = findings.iter().take(5).map(|(_, key)| key.as_str()).collect();
                        tracing::warn!(
                            mismatches = findings.len(),
                            lost = findings.iter().filter(|(k, _)| *k == MismatchKind::LostByBroker).count(),
                            reused = findings.iter().filter(|(k, _)| *k == MismatchKind::SequenceReused).count(),
                            first_keys = ?sample,
                            "published rows are missing from the stream; run `handoff-admin reconcile` (with --repair to re-publish)"
                        );
                    }
                    Err(error) => {
                        tracing::warn!(error = %error_chain(error.as_ref()), "periodic reconciliation failed; retrying at the next interval");
                    }
                }
            }
        }
    }

    /// Returns once every transaction older than `transaction_id` has ended, or after the poll
    /// interval (or the held-back limit, if shorter) at the latest.
    async fn wait_for_horizon(&self, transaction_id: u64, token: &CancellationToken) -> Result<(), sqlx::Error> {
        let started = Instant::now();
        let limit = self.settings.poll_interval.min(self.settings.held_back);
        let mut pause = HORIZON_POLL;
        let mut polls = 0;
        while started.elapsed() < limit {
            polls += 1;
            if outbox::horizon_passed(&self.worker_pool, transaction_id).await? {
                tracing::trace!(polls, waited_us = started.elapsed().as_micros() as u64, "horizon passed");
                break;
            }
            tokio::select! {
                _ = token.cancelled() => break,
                _ = tokio::time::sleep(pause) => {}
            }
            if started.elapsed() >= HORIZON_FAST_POLLING {
                pause = (pause * 2).min(limit);
            }
        }
        Ok(())
    }

    async fn rescue(&self, worker: usize) {
        match self.rescue_held_back_rows().await {
            Ok(0) => {}
            Ok(rows) => tracing::warn!(
                worker,
                rows,
                held_back_s = self.settings.held_back.as_secs_f64(),
                "rows waited behind an older open transaction; claimed them one by one"
            ),
            Err(error) => tracing::warn!(worker, error = %error_chain(&error), "held-back rescue failed"),
        }
    }

    /// Runs a retention pass every quarter of the retention (at most every minute, at least every
    /// second). Failures are logged and retried at the next pass: retention is housekeeping.
    async fn retain(&self, retention: Duration, token: CancellationToken) -> anyhow::Result<()> {
        let every = (retention / 4).clamp(Duration::from_secs(1), Duration::from_secs(60));
        loop {
            tokio::select! {
                _ = token.cancelled() => return Ok(()),
                _ = tokio::time::sleep(every) => {}
            }
            tokio::select! {
                // Each retention statement is its own transaction: stopping between (or during) them
                // leaves nothing half done.
                _ = token.cancelled() => return Ok(()),
                result = self.apply_retention() => if let Err(error) = result {
                    tracing::warn!(error = %error_chain(&error), "retention pass failed; retrying at the next pass");
                }
            }
        }
    }
}

/// The relay's readiness: its database is reachable and migrated, NATS is connected, and the
/// stream exists.
struct RelayReadiness {
    relay: Relay,
}

impl Readiness for RelayReadiness {
    fn check(&self) -> futures::future::BoxFuture<'_, Vec<Check>> {
        Box::pin(async move {
            let relay = &self.relay;
            let database =
                Check::bounded("database", handoff_shared::observe::check_database(&relay.pool, &crate::SCHEMA));
            let stream = Check::bounded("stream", async {
                match relay.js.get_stream(&relay.stream.name).await {
                    Ok(_) => Check::ok("stream", relay.stream.name.clone()),
                    Err(error) => Check::failed("stream", format!("{}: {}", relay.stream.name, error_chain(&error))),
                }
            });
            let (database, stream) = tokio::join!(database, stream);
            vec![database, handoff_shared::observe::check_nats(&relay.js.client()), stream]
        })
    }
}
