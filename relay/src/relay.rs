//! The relay: moves due outbox rows to JetStream, at least once, with the operation key as message id.
//!
//! One step, [`Relay::publish_batch`]: claim a batch under lease (short transaction), publish it
//! pipelined (no transaction open), then record PubAcks and failures (one statement each). If the
//! process dies anywhere in between, the lease expires and another relay (or this one, restarted)
//! re-publishes; the broker reports the re-publish as a duplicate inside its window and the consumer's
//! unique index stops it after that. Nothing is deleted or skipped: a row leaves `pending` only as
//! `published` (with its stream sequence) or `blocked` (with its reason).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use handoff_shared::{Approval, Backoff, CanonicalPayload, Envelope, OperationKey, PayloadHash};
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::outbox::{self, ClaimedRow, FailedRow, Failure, PublishedRow};
use crate::publisher::{self, Outgoing, StreamSettings};

/// The channel `handoff.notify_outbox()` signals on.
pub const NOTIFY_CHANNEL: &str = "handoff_outbox";

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
}

impl Default for RelaySettings {
    fn default() -> Self {
        Self {
            batch_size: 500,
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_millis(500),
            max_attempts: 10,
            max_age: None,
            backoff: Backoff::default(),
            workers: 2,
            source: "/handoff/relay".into(),
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
    pub async fn build(
        pool: PgPool,
        client: async_nats::Client,
        stream: StreamSettings,
        settings: RelaySettings,
    ) -> anyhow::Result<Self> {
        crate::MIGRATOR.run(&pool).await?;
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

    /// Claims one batch of due rows, publishes it and records the outcome.
    pub async fn publish_batch(&self) -> Result<Published, RelayError> {
        let rows =
            outbox::claim_due_rows(&self.pool, &self.owner, self.settings.batch_size, self.settings.lease).await?;
        let mut outcome = Published { claimed: rows.len(), ..Published::default() };
        if rows.is_empty() {
            return Ok(outcome);
        }

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
                Err(reason) => failed.push(FailedRow { id: row.id, outcome: Failure::Block, error: reason }),
            }
        }

        let acks = publisher::publish_pipelined(&self.js, outgoing).await;
        if RelayFaults::fire(&self.faults.crash_after_publish) {
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
                        sequence: ack.sequence,
                        duplicate: ack.duplicate,
                        computed_hash,
                    });
                }
                Err(error) => {
                    let permanent = publisher::is_permanent(&error);
                    let decision = self.after_failure(&row, permanent);
                    tracing::warn!(operation_key = %row.operation_key, attempts = row.attempts, ?decision, error = %error, "publish failed");
                    failed.push(FailedRow { id: row.id, outcome: decision, error: format!("publish failed: {error}") });
                }
            }
        }

        outcome.published = published.len();
        outcome.duplicates = published.iter().filter(|r| r.duplicate).count();
        outcome.retried = failed.iter().filter(|f| matches!(f.outcome, Failure::RetryAfter(_))).count();
        outcome.blocked = failed.len() - outcome.retried;
        outbox::mark_published(&self.pool, &self.stream.name, &published).await?;
        outbox::mark_failed(&self.pool, &self.owner, &failed).await?;
        Ok(outcome)
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

    /// Runs `workers` loops until `token` is cancelled; each finishes its current batch first, so a
    /// SIGTERM never leaves published-but-unmarked rows behind (beyond a crash's lease expiry).
    pub async fn run_until_stopped(self, token: CancellationToken) -> anyhow::Result<()> {
        let mut workers = JoinSet::new();
        for worker in 0..self.settings.workers.max(1) {
            let relay = self.clone();
            let token = token.clone();
            workers.spawn(async move { relay.work(worker, token).await });
        }
        while let Some(result) = workers.join_next().await {
            result??;
        }
        tracing::info!(owner = %self.owner, "relay stopped");
        Ok(())
    }

    async fn work(&self, worker: usize, token: CancellationToken) -> anyhow::Result<()> {
        // Register interest before the first query so no insert slips between them unnoticed.
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.listen(NOTIFY_CHANNEL).await?;
        let mut failures = 0u32;
        while !token.is_cancelled() {
            let idle = match self.publish_batch().await {
                Ok(batch) => {
                    failures = 0;
                    if batch.claimed > 0 {
                        tracing::debug!(worker, ?batch, "batch done");
                    }
                    // A full batch means more may be due: go again without waiting.
                    batch.claimed < self.settings.batch_size as usize
                }
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
            if idle {
                tokio::select! {
                    // Stop requested while idle: nothing is in flight.
                    _ = token.cancelled() => break,
                    // A producer committed outbox rows: look now rather than at the next poll.
                    notification = listener.recv() => {
                        if let Err(error) = notification {
                            tracing::warn!(worker, %error, "outbox listener failed; polling continues");
                        }
                    }
                    // Polling is the guarantee: retries fall due and notifications can be lost.
                    _ = tokio::time::sleep(self.settings.poll_interval) => {}
                }
            }
        }
        Ok(())
    }
}
