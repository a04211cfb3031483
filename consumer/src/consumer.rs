//! The consumer: verified messages become CRM tasks, once per operation key.
//!
//! One step, [`Consumer::handle_batch`]: verify every message, then in **one** transaction in the
//! consumer's own database record new keys in the inbox (unique index), create their tasks, and
//! record conflicts and dead letters; commit; only then ack. A crash before the commit leaves nothing
//! and the messages are redelivered; a crash after it leaves the inbox rows, so the redelivery is a
//! duplicate that acks and creates nothing. The database, not the ack, prevents the second task.
//!
//! The usual batch (every message verified, every key new and once) is that same transaction
//! written as one statement, a single round trip instead of four: the inbox insert as a CTE beside
//! the CRM's insert, with no `ON CONFLICT`, so a key already held fails the statement and writes
//! nothing; the transaction then decides that batch message by message ([`Consumer::commit`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::message::Message;
use futures::StreamExt;
use handoff_shared::logging::{Outage, error_chain};
use handoff_shared::migrate::MigrateMode;
use handoff_shared::observe::{Check, Endpoint, Heartbeat, Liveness, Readiness};
use handoff_shared::signing::{SignaturePolicy, Signed};
use handoff_shared::{Backoff, Envelope, headers};
use prometheus_client::registry::Registry;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::crm::{Crm, TaskOutcome, TaskRequest};
use crate::inbox::{self, Arrival, DeadLetter, ReviewItem};
use crate::metrics::{ConsumerMetrics, outcome};
use crate::remote::LedgerState;

/// How the consumer batches, retries and gives up.
#[derive(Debug, Clone)]
pub struct ConsumerSettings {
    /// Messages handled per transaction.
    pub batch_size: usize,
    /// Failed deliveries after which a message is dead-lettered instead of retried.
    pub dead_letter_after: i64,
    /// Redelivery delays after transient failures (by delivery count).
    pub backoff: Backoff,
    /// Pull request expiry; also bounds how long shutdown waits for the fetch loop.
    pub fetch_expires: Duration,
    /// A loop that has not completed an iteration for this long is reported stalled (`/healthz`).
    pub stall_after: Duration,
    /// How often the gauges are sampled from the broker and the database.
    pub sample_interval: Duration,
    /// Apply pending migrations at startup, or refuse to start while the schema is behind.
    pub migrate: MigrateMode,
    /// The newest envelope version this replica reads (this build's
    /// [`SCHEMA_VERSION`](handoff_shared::envelope::SCHEMA_VERSION)); a lower value stands in for
    /// an older build in upgrade tests.
    pub newest_envelope_version: u32,
    /// How long a message of a newer envelope version waits before it is offered again.
    pub newer_version_delay: Duration,
    /// Which signatures are accepted (checked before anything else); the default accepts no key and
    /// no unsigned message, so every message is dead-lettered until keys are given.
    pub signatures: SignaturePolicy,
}

/// A message of a newer envelope version is offered again after this long: rolling upgrades take
/// minutes, and each offer is one cheap nak.
pub const DEFAULT_NEWER_VERSION_DELAY: Duration = Duration::from_secs(300);

impl ConsumerSettings {
    /// Messages per transaction: as many as the bare consumer loop of the benchmark takes. Fewer
    /// commits per message; 500 moved about 15% more than 250 per replica (docs/benchmarks.md).
    pub const DEFAULT_BATCH_SIZE: usize = 500;
}

impl Default for ConsumerSettings {
    fn default() -> Self {
        Self {
            batch_size: Self::DEFAULT_BATCH_SIZE,
            dead_letter_after: 10,
            backoff: Backoff {
                initial: Duration::from_millis(500),
                max: Duration::from_secs(60),
                ..Backoff::default()
            },
            fetch_expires: Duration::from_secs(5),
            stall_after: handoff_shared::observe::DEFAULT_STALL_AFTER,
            sample_interval: handoff_shared::observe::DEFAULT_SAMPLE_INTERVAL,
            migrate: MigrateMode::Auto,
            newest_envelope_version: handoff_shared::envelope::SCHEMA_VERSION,
            newer_version_delay: DEFAULT_NEWER_VERSION_DELAY,
            signatures: SignaturePolicy::default(),
        }
    }
}

/// What happened to one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Handled {
    /// A new task; acked.
    Created { operation_key: String, task_id: i64 },
    /// Recorded in the remote-CRM ledger, which now owns the call and its retries; acked.
    Accepted { operation_key: String },
    /// The key was already handled with the same content (or the CRM already held the task); acked.
    Duplicate { operation_key: String },
    /// Same key, different content: recorded for review; terminated.
    Conflict { operation_key: String },
    /// Could not be processed: stored in the dead-letter table; terminated.
    DeadLettered { reason: String },
    /// A transient failure: nak'ed for redelivery after a delay.
    Retrying { error: String },
    /// Written in an envelope version newer than this replica reads: nak'ed with a long delay,
    /// never dead-lettered, until an upgraded replica takes it.
    Held { version: u32 },
}

impl Handled {
    /// The word `handoff_consumer_messages_total` counts this outcome under.
    pub fn outcome(&self) -> &'static str {
        match self {
            Self::Created { .. } => outcome::CREATED,
            Self::Accepted { .. } => outcome::ACCEPTED,
            Self::Duplicate { .. } => outcome::DUPLICATE,
            Self::Conflict { .. } => outcome::CONFLICT,
            Self::DeadLettered { .. } => outcome::DEAD_LETTERED,
            Self::Retrying { .. } => outcome::NAKED,
            Self::Held { .. } => outcome::HELD,
        }
    }
}

/// Failure injection for tests (see `RelayFaults`).
#[derive(Debug, Default)]
pub struct ConsumerFaults {
    /// Commit the batch, then "die" before acking any message.
    pub crash_after_commit: AtomicU32,
    /// Fail the batch transaction as a database outage would (before commit).
    pub fail_transaction: AtomicU32,
    /// The next batch hangs (until shutdown) before its transaction, as a statement stuck on a
    /// lock would: the loop's heartbeat stops and `/healthz` turns 503.
    pub stall_batch: AtomicU32,
}

fn fire(counter: &AtomicU32) -> bool {
    counter.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
}

/// Why a batch failed as a whole.
#[derive(Debug, thiserror::Error)]
pub enum ConsumeError {
    #[error("consumer database error")]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Crm(#[from] crate::crm::CrmError),
    #[error("injected fault: {0}")]
    Injected(&'static str),
}

/// One message after verification.
struct Incoming {
    /// The broker's message, to acknowledge; `None` for a dead letter being replayed (already
    /// terminated at the broker: the database alone records its outcome).
    message: Option<Message>,
    verified: Result<Envelope, String>,
    /// Set when the envelope is of a newer version than this replica reads.
    newer: Option<u32>,
    sequence: i64,
    delivered: i64,
}

/// What one pull asks the broker for at most, in bytes. A batch of small messages never reaches
/// it (500 follow-ups are well under a MiB); messages near the 64 KiB payload limit end a pull after
/// a few dozen, so a replica holds megabytes while it handles them, not 500 x 64 KiB parsed (a
/// replica so fed peaked at 127 MiB).
pub const PULL_MAX_BYTES: usize = 4 * 1024 * 1024;

/// How the server ends a pull that reached its byte limit (a 409 status with this description).
const PULL_FULL_STATUS: &str = "Message Size Exceeds MaxBytes";

/// Room for a message's subject and headers above the server's `max_payload`.
const PULL_HEADROOM_BYTES: usize = 64 * 1024;

/// A consumer replica. Clone it for more in-process replicas of the same durable.
#[derive(Debug, Clone)]
pub struct Consumer<C> {
    pool: PgPool,
    consumer: PullConsumer,
    subjects: handoff_shared::Subjects,
    client: async_nats::Client,
    crm: Arc<C>,
    settings: ConsumerSettings,
    faults: Arc<ConsumerFaults>,
    metrics: ConsumerMetrics,
    registry: Arc<Registry>,
    liveness: Liveness,
    /// Batch transactions failing (the database), one warning at the start and one at the end.
    batches: Arc<Outage>,
    /// The newest envelope version held so far (its first message is logged).
    newest_held: Arc<AtomicU32>,
    /// Whether an unsigned message was accepted yet (the first is logged).
    unsigned_seen: Arc<std::sync::atomic::AtomicBool>,
}

impl<C: Crm + 'static> Consumer<C> {
    /// Runs the consumer's migrations (or, with [`MigrateMode::Never`], checks that none is pending)
    /// and binds to the durable consumer.
    pub async fn build(
        pool: PgPool,
        client: async_nats::Client,
        subscription: &crate::SubscriptionSettings,
        crm: C,
        settings: ConsumerSettings,
    ) -> anyhow::Result<Self> {
        crate::SCHEMA.prepare(&pool, settings.migrate, "handoff-consumer").await?;
        let js = async_nats::jetstream::new(client.clone());
        let consumer = crate::subscription::bind(&js, subscription).await?;
        let mut registry = Registry::default();
        let metrics = ConsumerMetrics::register(&mut registry);
        Ok(Self {
            pool,
            consumer,
            subjects: subscription.subjects.clone(),
            client,
            crm: Arc::new(crm),
            settings,
            faults: Arc::default(),
            metrics,
            registry: Arc::new(registry),
            liveness: Liveness::default(),
            batches: Arc::new(Outage::new("consumer batch transactions")),
            newest_held: Arc::default(),
            unsigned_seen: Arc::default(),
        })
    }

    /// This replica's metrics (the dispatcher of the replica adds its CRM calls to them).
    pub fn metrics(&self) -> &ConsumerMetrics {
        &self.metrics
    }

    /// This replica's loops, for the dispatcher to register with.
    pub fn liveness(&self) -> &Liveness {
        &self.liveness
    }

    /// The `/metrics`, `/healthz` and `/readyz` endpoint of this replica.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint {
            registry: self.registry.clone(),
            liveness: self.liveness.clone(),
            readiness: Arc::new(ConsumerReadiness {
                pool: self.pool.clone(),
                consumer: self.consumer.clone(),
                client: self.client.clone(),
            }),
        }
    }

    /// This replica's fault hooks (tests only).
    pub fn faults(&self) -> &ConsumerFaults {
        &self.faults
    }

    /// Bytes one pull asks the broker for at most: [`PULL_MAX_BYTES`], or more where the server
    /// accepts larger messages (a message larger than a pull's limit would never be delivered).
    fn pull_max_bytes(&self) -> usize {
        PULL_MAX_BYTES.max(self.client.server_info().max_payload.saturating_add(PULL_HEADROOM_BYTES))
    }

    /// Fetches up to one batch (waiting at most `wait`) and handles it. For tests and tools.
    pub async fn fetch_and_handle(&self, wait: Duration) -> anyhow::Result<Vec<Handled>> {
        let mut batch = self
            .consumer
            .fetch()
            .max_messages(self.settings.batch_size)
            .max_bytes(self.pull_max_bytes())
            .expires(wait)
            .messages()
            .await?;
        let mut messages = Vec::new();
        while let Some(message) = batch.next().await {
            match message {
                Ok(message) => messages.push(message),
                // The pull reached its byte limit: the batch is complete (the pull stream of
                // `fetch_until_stopped` takes this status as the end of a pull by itself).
                Err(e) if e.to_string().contains(PULL_FULL_STATUS) => break,
                Err(e) => return Err(anyhow::anyhow!(e)),
            }
        }
        Ok(self.handle_batch(messages).await)
    }

    /// Handles one batch: verify, one transaction, commit, then ack each message by its outcome.
    /// If the batch transaction fails, each message is retried alone so one bad message cannot hold
    /// back the others.
    pub async fn handle_batch(&self, messages: Vec<Message>) -> Vec<Handled> {
        if messages.is_empty() {
            return Vec::new();
        }
        let started = std::time::Instant::now();
        let actions: Vec<String> = messages
            .iter()
            .map(|m| {
                let key = m.headers.as_ref().and_then(|h| h.get(headers::MSG_ID)).map(|v| v.as_str());
                crate::metrics::action_type(key)
            })
            .collect();
        let outcomes = self.handle_verified(messages.into_iter().map(|m| self.verify(m)).collect()).await;
        let mut counts: HashMap<(String, &'static str), u64> = HashMap::new();
        for (action, handled) in actions.into_iter().zip(&outcomes) {
            *counts.entry((action, handled.outcome())).or_default() += 1;
        }
        self.metrics.add_messages(&counts);
        self.metrics.batch_duration.observe(started.elapsed().as_secs_f64());
        outcomes
    }

    async fn handle_verified(&self, incoming: Vec<Incoming>) -> Vec<Handled> {
        // Newer envelope versions wait for an upgraded replica; the rest are handled as a batch.
        if incoming.iter().any(|m| m.newer.is_some()) {
            let mut order = Vec::with_capacity(incoming.len());
            let mut current = Vec::new();
            for m in incoming {
                match m.newer {
                    Some(version) => {
                        self.hold(&m, version).await;
                        order.push(Some(Handled::Held { version }));
                    }
                    None => {
                        current.push(m);
                        order.push(None);
                    }
                }
            }
            let mut handled = Box::pin(self.handle_verified(current)).await.into_iter();
            return order.into_iter().filter_map(|slot| slot.or_else(|| handled.next())).collect();
        }
        if fire(&self.faults.stall_batch) {
            tracing::warn!(messages = incoming.len(), "injected stall: this batch hangs");
            std::future::pending::<()>().await;
        }
        match self.commit(&incoming).await {
            Ok(outcomes) => {
                self.batches.succeeded();
                if fire(&self.faults.crash_after_commit) {
                    tracing::warn!(messages = incoming.len(), "injected crash after commit, before ack");
                    return Vec::new();
                }
                self.acknowledge(&incoming, &outcomes).await;
                outcomes
            }
            Err(error) if incoming.len() > 1 => {
                self.metrics.batch_errors.inc();
                let cause = error_chain(&error);
                if !self.batches.failed(&cause, incoming.len() as u64) {
                    tracing::debug!(error = %cause, messages = incoming.len(), "batch failed; retrying messages one by one");
                }
                let mut outcomes = Vec::with_capacity(incoming.len());
                for one in incoming {
                    outcomes.push(self.handle_alone(one).await);
                }
                outcomes
            }
            Err(error) => {
                let mut incoming = incoming;
                let one = incoming.pop().expect("one message");
                vec![self.after_failure(one, error).await]
            }
        }
    }

    async fn handle_alone(&self, one: Incoming) -> Handled {
        let single = [one];
        match self.commit(&single).await {
            Ok(mut outcomes) => {
                self.batches.succeeded();
                self.acknowledge(&single, &outcomes).await;
                outcomes.pop().expect("one outcome")
            }
            Err(error) => {
                let [one] = single;
                self.after_failure(one, error).await
            }
        }
    }

    /// Verifies a delivered message: the envelope (see `Envelope::decode_up_to`), and that it arrived
    /// on the subject of its own key's action type, so a publisher allowed only on one action's
    /// subject cannot have another action's task created (and `--filter-subject` routing cannot be
    /// bypassed). A newer envelope version is not an error: it is marked to be held.
    fn verify(&self, message: Message) -> Incoming {
        let (sequence, delivered) = position(&message);
        let msg_id = message.headers.as_ref().and_then(|h| h.get(headers::MSG_ID)).map(|v| v.as_str().to_owned());
        let decoded = self.open(&message.payload, msg_id.as_deref());
        let newer = match &decoded {
            Err(handoff_shared::EnvelopeError::NewerVersion { found, .. }) => Some(*found),
            _ => None,
        };
        let verified = decoded
            .map_err(|e| e.to_string())
            .and_then(|env| on_its_subject(env, message.subject.as_str(), &self.subjects));
        Incoming { message: Some(message), verified, newer, sequence, delivered }
    }

    /// Opens a message body under this replica's signature policy and envelope version; an
    /// accepted unsigned message is counted (and the first one logged).
    fn open(&self, body: &[u8], msg_id: Option<&str>) -> Result<Envelope, handoff_shared::EnvelopeError> {
        let (envelope, signed) =
            Envelope::open(body, msg_id, self.settings.newest_envelope_version, &self.settings.signatures)?;
        if signed == Signed::Unsigned {
            self.metrics.unsigned.inc();
            if !self.unsigned_seen.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    operation_key = %envelope.key,
                    "accepted an unsigned message (--allow-unsigned); handoff_consumer_unsigned_messages_total counts them"
                );
            }
        }
        Ok(envelope)
    }

    /// Holds a message of a newer envelope version: a nak with [`ConsumerSettings::newer_version_delay`],
    /// logged at the first such message of each version (the counter shows the rest).
    async fn hold(&self, m: &Incoming, version: u32) {
        let previous = self.newest_held.fetch_max(version, Ordering::Relaxed);
        if version > previous {
            tracing::warn!(
                version,
                reads_up_to = self.settings.newest_envelope_version,
                delay_s = self.settings.newer_version_delay.as_secs(),
                "messages of a newer envelope version are held, not dead-lettered, until this replica is upgraded"
            );
        }
        self.settle(&[(m.message.as_ref(), AckKind::Nak(Some(self.settings.newer_version_delay)))]).await;
    }

    /// A message that failed transiently: nak with backoff, or dead-letter once it has failed
    /// `dead_letter_after` times and the dead letter is safely stored.
    async fn after_failure(&self, one: Incoming, error: ConsumeError) -> Handled {
        let error = error_chain(&error);
        if one.delivered >= self.settings.dead_letter_after {
            let reason = format!("failed {} deliveries; last error: {error}", one.delivered);
            let letters: Vec<DeadLetter> = dead_letter(&one, reason.clone()).into_iter().collect();
            let stored = async {
                let mut tx = self.pool.begin().await?;
                inbox::record_dead_letters(&mut tx, &letters).await?;
                tx.commit().await
            }
            .await;
            match stored {
                Ok(()) => {
                    self.settle(&[(one.message.as_ref(), AckKind::Term)]).await;
                    return Handled::DeadLettered { reason };
                }
                Err(store_error) => {
                    tracing::error!(sequence = one.sequence, error = %error_chain(&store_error), "cannot store dead letter; message stays for redelivery")
                }
            }
        }
        let delay = self.settings.backoff.delay(one.delivered.max(1) as u32);
        // During an outage every message fails alike: the outage is logged once, each message at debug.
        let key = one.verified.as_ref().ok().map(|env| env.key.to_string());
        self.batches.failed(&error, 1);
        tracing::debug!(operation_key = ?key, sequence = one.sequence, delivered = one.delivered, %error, ?delay, "message will be redelivered");
        self.settle(&[(one.message.as_ref(), AckKind::Nak(Some(delay)))]).await;
        Handled::Retrying { error }
    }

    /// Records a batch: the usual one (every message verified, every key once and new) in one
    /// statement, any other in the batch transaction. Returns one outcome per message, in order.
    async fn commit(&self, incoming: &[Incoming]) -> Result<Vec<Handled>, ConsumeError> {
        if fire(&self.faults.fail_transaction) {
            return Err(ConsumeError::Injected("batch transaction failed"));
        }
        let outcomes = match self.commit_usual(incoming).await? {
            Some(outcomes) => {
                self.metrics.batches(crate::metrics::path::ONE_STATEMENT).inc();
                outcomes
            }
            None => {
                let mut tx = self.pool.begin().await?;
                let outcomes = self.record(&mut tx, incoming).await?;
                tx.commit().await?;
                self.metrics.batches(crate::metrics::path::TRANSACTION).inc();
                outcomes
            }
        };
        log_outcomes(incoming, &outcomes);
        Ok(outcomes)
    }

    /// The usual batch, every message verified and every key in it once, as one statement with no
    /// transaction around it ([`Crm::create_usual`]): one round trip to the database where the
    /// batch transaction takes four (BEGIN, inbox, CRM, COMMIT), the same rows written. `None`,
    /// with nothing written, when the batch is not usual or a key in it is already held (a
    /// redelivery, a re-publish, a conflict): the batch transaction then decides each message.
    async fn commit_usual(&self, incoming: &[Incoming]) -> Result<Option<Vec<Handled>>, ConsumeError> {
        let mut keys = HashSet::with_capacity(incoming.len());
        let mut envelopes = Vec::with_capacity(incoming.len());
        for m in incoming {
            match &m.verified {
                Ok(env) if keys.insert(env.key.as_str()) => envelopes.push((m, env)),
                _ => return Ok(None),
            }
        }
        let arrivals: Vec<Arrival> = envelopes.iter().map(|&(m, env)| arrival(m, env)).collect();
        let requests: Vec<TaskRequest> = envelopes.iter().map(|&(_, env)| task_request(env)).collect();
        let Some(task_outcomes) = self.crm.create_usual(&self.pool, &arrivals, &requests).await? else {
            return Ok(None);
        };
        Ok(Some(
            requests
                .into_iter()
                .zip(task_outcomes)
                .map(|(request, outcome)| {
                    let operation_key = request.operation_key;
                    match outcome {
                        TaskOutcome::Created { task_id } => Handled::Created { operation_key, task_id },
                        TaskOutcome::Accepted => Handled::Accepted { operation_key },
                        // Unreachable: the one statement creates every task or nothing. Were it
                        // not so, the redelivery would find the key held and decide it in full.
                        TaskOutcome::Existing { .. } | TaskOutcome::Conflict { .. } => {
                            Handled::Retrying { error: "one-statement batch: not the usual outcome".into() }
                        }
                    }
                })
                .collect(),
        ))
    }

    /// Everything the batch transaction writes: inbox rows, tasks (or ledger rows), conflicts and
    /// dead letters, in `tx`. Returns one outcome per message, in order.
    async fn record(&self, tx: &mut sqlx::PgConnection, incoming: &[Incoming]) -> Result<Vec<Handled>, ConsumeError> {
        let arrivals: Vec<Arrival> =
            incoming.iter().filter_map(|m| m.verified.as_ref().ok().map(|env| arrival(m, env))).collect();
        let new_keys = inbox::insert_new_arrivals(&mut *tx, &arrivals, C::USUAL_OUTCOME).await?;

        // The first arrival of each new key goes to the CRM.
        let mut sent_to_crm = HashSet::new();
        let mut requests = Vec::new();
        for m in incoming {
            if let Ok(env) = &m.verified
                && new_keys.contains(env.key.as_str())
                && sent_to_crm.insert(env.key.as_str())
            {
                requests.push(task_request(env));
            }
        }
        let task_outcomes = self.crm.create_tasks(&mut *tx, &requests).await?;
        let mut crm_result = HashMap::new();
        let mut unusual = Vec::new();
        let mut reviews = Vec::new();
        for (request, outcome) in requests.iter().zip(&task_outcomes) {
            crm_result.insert(request.operation_key.as_str(), *outcome);
            let kind = outcome.inbox_outcome();
            if kind != C::USUAL_OUTCOME {
                unusual.push((request.operation_key.as_str(), kind));
            }
        }
        inbox::record_unusual_outcomes(&mut *tx, &unusual).await?;

        // Keys that were not new, or arrived more than once in this batch, are compared with what
        // the inbox holds (including rows this batch inserted a moment ago).
        let mut arrivals_per_key: HashMap<&str, usize> = HashMap::new();
        for arrival in &arrivals {
            *arrivals_per_key.entry(arrival.operation_key.as_str()).or_default() += 1;
        }
        let repeated: Vec<&str> = arrivals_per_key
            .iter()
            .filter(|&(key, &count)| !sent_to_crm.contains(key) || count > 1)
            .map(|(key, _)| *key)
            .collect();
        let held =
            if repeated.is_empty() { Default::default() } else { inbox::recorded_hashes(&mut *tx, &repeated).await? };

        let mut outcomes = Vec::with_capacity(incoming.len());
        let mut letters = Vec::new();
        let mut first_seen = HashSet::new();
        for m in incoming {
            let env = match &m.verified {
                Ok(env) => env,
                Err(reason) => {
                    letters.extend(dead_letter(m, reason.clone()));
                    outcomes.push(Handled::DeadLettered { reason: reason.clone() });
                    continue;
                }
            };
            let key = env.key.as_str();
            let hash = env.payload.hash().to_string();
            let outcome = match crm_result.get(key) {
                Some(outcome) if first_seen.insert(key) => match *outcome {
                    TaskOutcome::Created { task_id } => Handled::Created { operation_key: key.to_owned(), task_id },
                    TaskOutcome::Existing { .. } => Handled::Duplicate { operation_key: key.to_owned() },
                    TaskOutcome::Accepted => Handled::Accepted { operation_key: key.to_owned() },
                    TaskOutcome::Conflict { .. } => {
                        reviews.push(ReviewItem {
                            operation_key: key.to_owned(),
                            reason: "CRM holds different content for this operation key".into(),
                            incoming_hash: hash,
                            existing_hash: "crm".into(),
                            stream_sequence: m.sequence,
                        });
                        Handled::Conflict { operation_key: key.to_owned() }
                    }
                },
                _ => match held.get(key) {
                    Some(existing) if *existing == hash => Handled::Duplicate { operation_key: key.to_owned() },
                    Some(existing) => {
                        reviews.push(ReviewItem {
                            operation_key: key.to_owned(),
                            reason: "operation key already handled with a different payload".into(),
                            incoming_hash: hash,
                            existing_hash: existing.clone(),
                            stream_sequence: m.sequence,
                        });
                        Handled::Conflict { operation_key: key.to_owned() }
                    }
                    // Unreachable: every arrival is in the inbox by now.
                    None => Handled::Retrying { error: "inbox row missing".into() },
                },
            };
            outcomes.push(outcome);
        }
        inbox::record_reviews(&mut *tx, &reviews).await?;
        inbox::record_dead_letters(&mut *tx, &letters).await?;
        Ok(outcomes)
    }

    /// Replays the dead letters an operator asked for (`handoff-admin dead-letter replay`), at most
    /// `limit`, in one transaction: each is verified again and, if it now verifies, goes through
    /// the same statements as a delivered message (so the inbox still decides once per key); it is
    /// then resolved with its outcome. One that still fails keeps its place with the new reason
    /// and its request cleared. Replicas never replay the same letter: rows are locked `SKIP
    /// LOCKED`. A crash before the commit leaves the request in place for the next pass.
    pub async fn replay_requested(&self, limit: i64) -> Result<Vec<(i64, Handled)>, ConsumeError> {
        let mut tx = self.pool.begin().await?;
        let letters = inbox::lock_replay_requests(&mut tx, limit).await?;
        if letters.is_empty() {
            return Ok(Vec::new());
        }
        let mut ids = Vec::new();
        let mut incoming = Vec::new();
        let mut still_failing = Vec::new();
        for letter in letters {
            let verified = self
                .open(&letter.body, letter.message_id.as_deref())
                .map_err(|e| e.to_string())
                .and_then(|env| on_its_subject(env, &letter.subject, &self.subjects));
            match verified {
                Ok(envelope) => {
                    ids.push(letter.id);
                    incoming.push(Incoming {
                        message: None,
                        verified: Ok(envelope),
                        newer: None,
                        sequence: letter.stream_sequence,
                        delivered: letter.deliveries,
                    });
                }
                Err(reason) => still_failing.push((letter.id, format!("replay failed: {reason}"))),
            }
        }
        let outcomes = self.record(&mut tx, &incoming).await?;
        let resolved: Vec<(i64, String)> =
            ids.iter().zip(&outcomes).map(|(id, handled)| (*id, format!("replayed: {}", handled.outcome()))).collect();
        inbox::finish_replays(&mut tx, &resolved, &still_failing).await?;
        tx.commit().await?;
        log_outcomes(&incoming, &outcomes);
        let mut done: Vec<(i64, Handled)> = ids.into_iter().zip(outcomes).collect();
        for (id, reason) in still_failing {
            tracing::warn!(dead_letter = id, "dead letter replayed and still failing; it stays in the queue");
            done.push((id, Handled::DeadLettered { reason }));
        }
        for (id, handled) in &done {
            tracing::info!(dead_letter = id, outcome = handled.outcome(), "dead letter replayed");
        }
        Ok(done)
    }

    /// Acks after the commit (see `settle`): done messages with Ack, conflicts and dead letters with
    /// Term (they are recorded; redelivery cannot help).
    async fn acknowledge(&self, incoming: &[Incoming], outcomes: &[Handled]) {
        let acks: Vec<_> = incoming
            .iter()
            .zip(outcomes)
            .map(|(m, outcome)| {
                let kind = match outcome {
                    Handled::Created { .. } | Handled::Accepted { .. } | Handled::Duplicate { .. } => AckKind::Ack,
                    Handled::Conflict { .. } | Handled::DeadLettered { .. } => AckKind::Term,
                    Handled::Retrying { .. } => {
                        AckKind::Nak(Some(self.settings.backoff.delay(m.delivered.max(1) as u32)))
                    }
                    Handled::Held { .. } => AckKind::Nak(Some(self.settings.newer_version_delay)),
                };
                (m.message.as_ref(), kind)
            })
            .collect();
        self.settle(&acks).await;
    }

    /// Sends each ack of its kind, then flushes the connection the messages came in on once
    /// (bounded by [`ACK_FLUSH_TIMEOUT`]): when this returns the acks have been written to it, and
    /// a replica dropped right after a batch does not take them with it. It does not wait for each
    /// ack's confirmation: the commit before it is what makes a message done, and a lost or refused
    /// ack only means a redelivery after `ack_wait`, which the inbox turns into a duplicate (acked
    /// again). Waiting for the confirmations (double acks) held the next batch behind the acks'
    /// raft commit on a cluster (docs/benchmarks.md, "Acks without a confirmation each"). A
    /// replayed dead letter has no broker message: nothing to send.
    async fn settle(&self, acks: &[(Option<&Message>, AckKind)]) {
        let (mut sent, mut failed, mut last_error, mut connection) = (0, 0, None, None);
        for (message, kind) in acks {
            let Some(message) = message else { continue };
            match message.ack_with(*kind).await {
                Ok(()) => (sent, connection) = (sent + 1, Some(message.context.client())),
                Err(error) => (failed, last_error) = (failed + 1, Some(error_chain(error.as_ref()))),
            }
        }
        if let Some(error) = last_error {
            tracing::warn!(%error, acks = failed, "acks not sent; their messages will be redelivered");
        }
        let Some(connection) = connection else { return };
        match tokio::time::timeout(ACK_FLUSH_TIMEOUT, connection.flush()).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(
                error = %error_chain(&error),
                acks = sent,
                "acks not written; their messages may be redelivered"
            ),
            Err(_) => tracing::warn!(
                acks = sent,
                timeout_s = ACK_FLUSH_TIMEOUT.as_secs(),
                "acks not written in time (is NATS reachable?); their messages may be redelivered"
            ),
        }
    }

    /// Pulls and handles batches until `token` is cancelled, then finishes the batch in hand.
    /// Samples the gauges and logs progress beside it.
    pub async fn run_until_stopped(self, token: CancellationToken) -> anyhow::Result<()> {
        let heartbeat = self.liveness.register("consumer fetch loop", self.settings.stall_after);
        let sampler_heartbeat = self.liveness.register("consumer sampler", self.settings.stall_after);
        tracing::info!(batch_size = self.settings.batch_size, "consumer running");
        tokio::join!(
            self.fetch_until_stopped(&heartbeat, &token),
            self.sample_periodically(&sampler_heartbeat, token.clone())
        );
        tracing::info!("consumer stopped");
        Ok(())
    }

    async fn fetch_until_stopped(&self, heartbeat: &Heartbeat, token: &CancellationToken) {
        // An idle pull stream yields nothing for as long as the stream is empty; the tick keeps the
        // heartbeat honest: it beats only when this loop is free to take the next chunk.
        let mut idle = tokio::time::interval((self.settings.stall_after / 4).max(Duration::from_millis(10)));
        idle.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !token.is_cancelled() {
            heartbeat.beat();
            let stream = self
                .consumer
                .stream()
                .max_messages_per_batch(self.settings.batch_size)
                .max_bytes_per_batch(self.pull_max_bytes())
                .expires(self.settings.fetch_expires)
                .messages()
                .await;
            let mut stream = match stream {
                Ok(stream) => stream.ready_chunks(self.settings.batch_size),
                Err(error) => {
                    tracing::warn!(error = %error_chain(&error), "cannot start pulling; retrying");
                    if !heartbeat.pause(Duration::from_secs(1), token).await {
                        break;
                    }
                    continue;
                }
            };
            loop {
                heartbeat.beat();
                let chunk = tokio::select! {
                    // Stop fetching; messages buffered but not handled are redelivered after ack_wait.
                    _ = token.cancelled() => break,
                    _ = idle.tick() => continue,
                    chunk = stream.next() => chunk,
                };
                let Some(chunk) = chunk else { break };
                let mut messages = Vec::with_capacity(chunk.len());
                for item in chunk {
                    match item {
                        Ok(message) => messages.push(message),
                        Err(error) => tracing::warn!(error = %error_chain(&error), "pull stream error"),
                    }
                }
                // Not raced against shutdown: a batch in hand is finished and acked.
                self.handle_batch(messages).await;
            }
        }
    }

    /// Samples the gauges now: the durable consumer's pending and unacknowledged messages, and the
    /// depths in the consumer's database.
    pub async fn sample(&self) -> anyhow::Result<inbox::DepthSample> {
        let info = self.consumer.get_info().await?;
        let depths = inbox::sample_depths(&self.pool).await?;
        let m = &self.metrics;
        m.pending_messages.set(info.num_pending as i64);
        m.ack_pending_messages.set(info.num_ack_pending as i64);
        m.redelivered_messages.set(info.num_redelivered as i64);
        for state in crate::metrics::SAMPLED_LEDGER_STATES {
            let rows = depths.ledger.get(&state).copied().unwrap_or(0);
            m.ledger_rows.get_or_create(&crate::metrics::StateLabel { state: state.as_str() }).set(rows);
        }
        m.oldest_unknown_age.set(depths.oldest_unknown_s);
        m.review_rows.set(depths.ledger.get(&LedgerState::Review).copied().unwrap_or(0));
        m.conflict_rows.set(depths.conflicts);
        m.dead_letter_rows.set(depths.dead_letters);
        m.paused_action_types.set(depths.paused);
        Ok(inbox::DepthSample { pending_messages: info.num_pending, ..depths })
    }

    async fn sample_periodically(&self, heartbeat: &Heartbeat, token: CancellationToken) {
        let mut last_line = std::time::Instant::now();
        let totals = &self.metrics.totals;
        let load = |counter: &std::sync::atomic::AtomicU64| counter.load(Ordering::Relaxed);
        let (mut handled_before, mut created_before) = (load(&totals.handled), load(&totals.created));
        loop {
            match self.sample().await {
                Ok(sample) if last_line.elapsed() >= crate::PROGRESS_INTERVAL => {
                    let (handled, created) = (load(&totals.handled), load(&totals.created));
                    let seconds = last_line.elapsed().as_secs_f64();
                    tracing::info!(
                        handled = handled - handled_before,
                        per_second = ((handled - handled_before) as f64 / seconds).round(),
                        created = created - created_before,
                        pending_messages = sample.pending_messages,
                        undecided_ledger_rows =
                            sample.ledger.iter().filter(|(s, _)| !s.is_decided()).map(|(_, n)| n).sum::<i64>(),
                        review = sample.ledger.get(&LedgerState::Review).copied().unwrap_or(0),
                        conflicts = sample.conflicts,
                        dead_letters = sample.dead_letters,
                        "progress"
                    );
                    (handled_before, created_before, last_line) = (handled, created, std::time::Instant::now());
                }
                Ok(_) => {}
                Err(error) => {
                    self.metrics.sample_errors.inc();
                    tracing::debug!(error = %error_chain(error.as_ref()), "sampling failed; the gauges keep their last value");
                }
            }
            // Replays an operator asked for are picked up here, at the sample interval.
            if let Err(error) = self.replay_requested(REPLAY_BATCH).await {
                tracing::warn!(error = %error_chain(&error), "replaying dead letters failed; retrying at the next interval");
            }
            if !heartbeat.pause(self.settings.sample_interval, &token).await {
                return;
            }
        }
    }
}

/// How long a batch's acks may take to be written to the connection before the replica moves on
/// (during a NATS outage the client holds them until it reconnects). The same bound the client
/// put on each double ack's confirmation before the acks stopped waiting for one.
const ACK_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// Dead letters replayed per pass.
const REPLAY_BATCH: i64 = 100;

/// A replica's readiness: its database is reachable and migrated, NATS is connected, and the
/// stream and the durable consumer exist.
struct ConsumerReadiness {
    pool: PgPool,
    consumer: PullConsumer,
    client: async_nats::Client,
}

impl Readiness for ConsumerReadiness {
    fn check(&self) -> futures::future::BoxFuture<'_, Vec<Check>> {
        Box::pin(async move {
            let database =
                Check::bounded("database", handoff_shared::observe::check_database(&self.pool, &crate::SCHEMA));
            let durable = Check::bounded("consumer", async {
                match self.consumer.get_info().await {
                    Ok(info) => Check::ok("consumer", format!("{} on stream {}", info.name, info.stream_name)),
                    Err(error) => Check::failed("consumer", error_chain(&error)),
                }
            });
            let (database, durable) = tokio::join!(database, durable);
            vec![database, handoff_shared::observe::check_nats(&self.client), durable]
        })
    }
}

/// The stream position and delivery count of a delivered message.
fn position(message: &Message) -> (i64, i64) {
    match message.info() {
        Ok(info) => (info.stream_sequence as i64, info.delivered),
        Err(_) => (0, 1),
    }
}

/// The envelope, if `subject` is its key's subject; otherwise why not.
fn on_its_subject(env: Envelope, subject: &str, subjects: &handoff_shared::Subjects) -> Result<Envelope, String> {
    let expected = subjects.for_key(&env.key);
    if subject == expected {
        Ok(env)
    } else {
        Err(format!("message for {} arrived on subject {subject}, not {expected}", env.key.action_type()))
    }
}

/// The inbox row of a verified message.
fn arrival(m: &Incoming, env: &Envelope) -> Arrival {
    Arrival {
        operation_key: env.key.to_string(),
        payload_hash: env.payload.hash().to_string(),
        stream_sequence: m.sequence,
    }
}

/// What the CRM is asked to create for a verified message.
fn task_request(env: &Envelope) -> TaskRequest {
    TaskRequest {
        operation_key: env.key.to_string(),
        payload_hash: env.payload.hash().to_string(),
        payload: env.payload.value().clone(),
        approved_by: env.approval.approved_by().to_owned(),
        traceparent: env.traceparent.map(|tp| tp.to_string()),
    }
}

/// Logs what a committed batch did that is worth a line.
fn log_outcomes(incoming: &[Incoming], outcomes: &[Handled]) {
    for (m, outcome) in incoming.iter().zip(outcomes) {
        // The producer's trace continues here: every line about the action carries its trace id.
        let trace_id = m.verified.as_ref().ok().and_then(|env| env.traceparent).map(|tp| tp.trace_id());
        let _span = trace_id.as_deref().map(|trace_id| tracing::info_span!("action", trace_id).entered());
        match outcome {
            Handled::Created { operation_key, task_id } => {
                tracing::debug!(%operation_key, task_id, sequence = m.sequence, "task created");
            }
            Handled::Accepted { operation_key } => {
                tracing::debug!(%operation_key, sequence = m.sequence, "accepted for the remote CRM");
            }
            Handled::Duplicate { operation_key } => {
                tracing::debug!(%operation_key, sequence = m.sequence, "duplicate: already handled");
            }
            Handled::Conflict { operation_key } => {
                tracing::warn!(%operation_key, sequence = m.sequence, "conflict recorded for review");
            }
            Handled::DeadLettered { .. } => {
                // The reason can quote message content; it is in the dead-letter table, not the log.
                let message_id =
                    m.message.as_ref().and_then(|msg| msg.headers.as_ref()?.get(headers::MSG_ID)).map(|v| v.as_str());
                tracing::warn!(sequence = m.sequence, message_id, "message dead-lettered");
            }
            Handled::Retrying { .. } | Handled::Held { .. } => {}
        }
    }
}

/// The dead letter of a broker message (a replayed letter is stored already: `None`).
fn dead_letter(m: &Incoming, reason: String) -> Option<DeadLetter> {
    let message = m.message.as_ref()?;
    let headers = message
        .headers
        .as_ref()
        .map(|h| {
            let map: serde_json::Map<String, serde_json::Value> = h
                .iter()
                .map(|(name, values)| {
                    let values: Vec<serde_json::Value> = values.iter().map(|v| v.as_str().into()).collect();
                    (name.to_string(), values.into())
                })
                .collect();
            serde_json::Value::Object(map)
        })
        .unwrap_or_else(|| serde_json::json!({}));
    Some(DeadLetter {
        stream_sequence: m.sequence,
        subject: message.subject.to_string(),
        message_id: message.headers.as_ref().and_then(|h| h.get(headers::MSG_ID)).map(|v| v.as_str().to_owned()),
        reason,
        deliveries: m.delivered,
        headers,
        body: message.payload.to_vec(),
    })
}
