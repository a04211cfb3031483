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

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use handoff_shared::{Approval, Backoff, CanonicalPayload, Envelope, OperationKey, PayloadHash};
use sqlx::PgPool;
use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::outbox::{self, Claim, ClaimedRow, FailedRow, Failure, Lease, PublishedRow, RangeClaim, RetentionPosition};
use crate::publisher::{self, Outgoing, StreamSettings};

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
                    tracing::warn!(%error, "outbox listener failed; polling continues");
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
}

/// How often the relay checks whether the transactions holding rows back have ended, at first.
/// The usual blocker is another short transaction committing (a few milliseconds, mostly its WAL
/// flush), so a millisecond keeps the delay that small; the check is one tiny query.
const HORIZON_POLL: Duration = Duration::from_millis(1);
/// After this long the check backs off (doubling) towards the poll interval: a long transaction
/// is holding rows back, and the held-back rescue will deal with them.
const HORIZON_FAST_POLLING: Duration = Duration::from_millis(25);

/// Range claims in a row that may lose the cursor to other relays before one claim gives up (and
/// reports more work due, so the worker comes straight back).
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
        }
    }
}

/// Failure injection for tests: each counter, while above zero, makes the next batch fail at that
/// point exactly as a crash there would (the rows stay leased, nothing more is written).
#[derive(Debug, Default)]
pub struct RelayFaults {
    /// Publish the batch, receive the PubAcks, then "die" before marking the rows published.
    pub crash_after_publish: AtomicU32,
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
    /// The claim was full: more rows may be due right now.
    pub more_due: bool,
    /// Committed rows wait behind an older transaction that is still open: the transaction id of
    /// the oldest of them (see [`outbox::Claim::held_back_by`]).
    pub held_back_by: Option<u64>,
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
    js: async_nats::jetstream::Context,
    stream: StreamSettings,
    settings: RelaySettings,
    owner: String,
    faults: Arc<RelayFaults>,
}

impl Relay {
    /// Runs migrations, creates or updates the stream, and warns when a row can be retried for
    /// longer than the broker remembers message ids.
    ///
    /// The relay works on its own connections to the database `pool` points at (same options and
    /// size), with two session settings:
    /// * `synchronous_commit = off`: every relay write is progress that can be redone (a claim, a
    ///   mark, a retention delete). If a database crash loses one, rows are published again and the
    ///   broker reports duplicates; nothing is lost, and the relay never waits for a WAL flush. Any
    ///   later synchronous commit (a producer's) flushes the relay's earlier writes with it.
    /// * `plan_cache_mode = force_custom_plan`: a generic plan made on an empty outbox must not
    ///   stick when a backlog arrives (platform notes; checked: the generic plan of the range claim
    ///   made on an empty outbox is a sequential scan and a sort).
    pub async fn build(
        pool: PgPool,
        client: async_nats::Client,
        stream: StreamSettings,
        settings: RelaySettings,
    ) -> anyhow::Result<Self> {
        crate::MIGRATOR.run(&pool).await?;
        let options = (*pool.connect_options())
            .clone()
            .options([("synchronous_commit", "off"), ("plan_cache_mode", "force_custom_plan")]);
        let pool = PgPoolOptions::new()
            .max_connections(pool.options().get_max_connections())
            .acquire_timeout(pool.options().get_acquire_timeout())
            // No ping before every statement (sqlx's default): it doubles the round trips of
            // every claim and mark. A broken connection fails its statement instead, the batch
            // is retried after a pause, and the pool replaces the connection.
            .test_before_acquire(false)
            .connect_lazy_with(options);
        let js = async_nats::jetstream::new(client);
        publisher::ensure_stream(&js, &stream).await?;
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
        Ok(Self { pool, js, stream, settings, owner, faults: Arc::default() })
    }

    /// The fault hooks of this relay (tests only).
    pub fn faults(&self) -> &RelayFaults {
        &self.faults
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
        for row in rows {
            match self.prepare(&row) {
                Ok((message, computed_hash)) => {
                    outgoing.push(message);
                    sendable.push((row, computed_hash));
                }
                Err(reason) => failed.push(FailedRow {
                    id: row.id,
                    attempts: row.attempts,
                    outcome: Failure::Block,
                    error: reason,
                }),
            }
        }

        let acks =
            if outgoing.is_empty() { Vec::new() } else { publisher::publish_pipelined(&self.js, outgoing).await };
        let published_at = Instant::now();
        if outcome.claimed > 0 && RelayFaults::fire(&self.faults.crash_after_publish) {
            return Err(RelayError::InjectedCrash("after publish, before marking rows published"));
        }

        let mut published = Vec::with_capacity(sendable.len());
        for ((row, computed_hash), ack) in sendable.into_iter().zip(acks) {
            match ack {
                Ok(ack) => {
                    if ack.duplicate {
                        tracing::info!(operation_key = %row.operation_key, sequence = ack.sequence, "broker already held this message id");
                    }
                    published.push(PublishedRow {
                        id: row.id,
                        operation_key: row.operation_key,
                        attempts: row.attempts,
                        sequence: ack.sequence,
                        duplicate: ack.duplicate,
                        computed_hash,
                    });
                }
                Err(error) => {
                    let permanent = publisher::is_permanent(&error);
                    let decision = self.after_failure(&row, permanent);
                    tracing::warn!(operation_key = %row.operation_key, attempts = row.attempts, ?decision, error = %error, "publish failed");
                    failed.push(FailedRow {
                        id: row.id,
                        attempts: row.attempts,
                        outcome: decision,
                        error: format!("publish failed: {error}"),
                    });
                }
            }
        }

        outcome.published = published.len();
        outcome.duplicates = published.iter().filter(|r| r.duplicate).count();
        outcome.retried = failed.iter().filter(|f| matches!(f.outcome, Failure::RetryAfter(_))).count();
        outcome.blocked = failed.len() - outcome.retried;
        // Also releases a range whose rows had all been handled elsewhere (nothing to send).
        outbox::settle(&self.pool, &self.owner, &self.stream.name, lease, &published, &failed).await?;
        if outcome.claimed > 0 {
            tracing::debug!(
                claimed = outcome.claimed,
                claim_us = (claimed_at - started).as_micros() as u64,
                publish_us = (published_at - claimed_at).as_micros() as u64,
                settle_us = published_at.elapsed().as_micros() as u64,
                "batch timings"
            );
        }
        Ok(outcome)
    }

    /// The next claim, most urgent first: a dead relay's range, then due retries, then new rows.
    /// On the happy path this is one statement: the range claim looks for the others itself.
    async fn claim(&self) -> Result<Claim, sqlx::Error> {
        let (limit, lease) = (self.settings.batch_size, self.settings.lease);
        let mut check_priority = true;
        for _ in 0..CONTENDED_CLAIMS {
            match outbox::claim_new_range(&self.pool, &self.owner, limit, lease, check_priority).await? {
                RangeClaim::Claimed(claim) => return Ok(claim),
                RangeClaim::Contended => continue,
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
    /// until it reaches rows that are still young. Returns how many rows it deleted.
    pub async fn apply_retention(&self) -> Result<u64, RelayError> {
        let Some(retention) = self.settings.retention else { return Ok(0) };
        let mut position = RetentionPosition::start();
        let mut deleted = 0;
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
    fn prepare(&self, row: &ClaimedRow) -> Result<(Outgoing, Option<String>), String> {
        if row.attempts as u32 > self.settings.max_attempts {
            return Err(format!("retry budget exhausted: {} attempts", row.attempts - 1));
        }
        if self.too_old(row.created_at) {
            return Err("retry budget exhausted: older than max age".into());
        }
        let key: OperationKey = row.operation_key.parse().map_err(|e| format!("stored key is invalid: {e}"))?;
        let payload = CanonicalPayload::from_json(row.payload.as_bytes())
            .map_err(|e| format!("stored payload is invalid: {e}"))?;
        let hash = payload.hash();
        let computed_hash = match row.payload_hash.as_deref().map(str::parse::<PayloadHash>) {
            None => Some(hash.to_string()),
            Some(Ok(stored)) if stored == hash => None,
            // The stored payload no longer hashes to what was approved: never send it.
            Some(_) => return Err("payload changed after approval: stored hash does not match".into()),
        };
        let approval =
            Approval::new(&row.approved_by, row.approved_at).map_err(|e| format!("stored approval is invalid: {e}"))?;
        let subject = self.stream.subjects.for_key(&key);
        let envelope = Envelope { key, payload, approval, source: self.settings.source.clone(), time: row.recorded_at };
        Ok((Outgoing { subject, key: row.operation_key.clone(), body: envelope.encode() }, computed_hash))
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

    /// Runs `workers` loops (and retention) until `token` is cancelled; each worker finishes its
    /// current batch first, so a SIGTERM never leaves published-but-unmarked rows behind (beyond a
    /// crash's lease expiry).
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
            tasks.spawn(async move { relay.work(worker, wake, token).await });
        }
        if let Some(retention) = self.settings.retention {
            let relay = self.clone();
            let token = token.clone();
            tasks.spawn(async move { relay.retain(retention, token).await });
        }
        while let Some(result) = tasks.join_next().await {
            result??;
        }
        tracing::info!(owner = %self.owner, "relay stopped");
        Ok(())
    }

    async fn work(&self, worker: usize, wake: Arc<Notify>, token: CancellationToken) -> anyhow::Result<()> {
        let mut failures = 0u32;
        let mut held_back_since: Option<Instant> = None;
        while !token.is_cancelled() {
            let batch = match self.publish_batch().await {
                Ok(batch) => batch,
                Err(error) => {
                    failures += 1;
                    tracing::error!(worker, error = %anyhow::Error::from(error), "relay batch failed");
                    let pause = self.settings.backoff.delay(failures);
                    tokio::select! {
                        // Shutdown wins over the pause.
                        _ = token.cancelled() => break,
                        _ = tokio::time::sleep(pause) => {}
                    }
                    continue;
                }
            };
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
                    tracing::warn!(worker, %error, "cannot read the transaction horizon; polling continues");
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

    /// Returns once every transaction older than `transaction_id` has ended, or after the poll
    /// interval (or the held-back limit, if shorter) at the latest.
    async fn wait_for_horizon(&self, transaction_id: u64, token: &CancellationToken) -> Result<(), sqlx::Error> {
        let started = Instant::now();
        let limit = self.settings.poll_interval.min(self.settings.held_back);
        let mut pause = HORIZON_POLL;
        let mut polls = 0;
        while started.elapsed() < limit {
            polls += 1;
            if outbox::horizon_passed(&self.pool, transaction_id).await? {
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
            Err(error) => tracing::warn!(worker, error = %anyhow::Error::from(error), "held-back rescue failed"),
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
                    tracing::warn!(error = %anyhow::Error::from(error), "retention pass failed; retrying at the next pass");
                }
            }
        }
    }
}
