//! The consumer: verified messages become CRM tasks, once per operation key.
//!
//! One step, [`Consumer::handle_batch`]: verify every message, then in **one** transaction in the
//! consumer's own database record new keys in the inbox (unique index), create their tasks, and
//! record conflicts and dead letters; commit; only then ack. A crash before the commit leaves nothing
//! and the messages are redelivered; a crash after it leaves the inbox rows, so the redelivery is a
//! duplicate that acks and creates nothing. The database, not the ack, prevents the second task.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::message::Message;
use futures::StreamExt;
use futures::future::join_all;
use handoff_shared::{Backoff, Envelope, headers};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::crm::{Crm, TaskOutcome, TaskRequest};
use crate::inbox::{self, Arrival, DeadLetter, ReviewItem};

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
}

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
}

/// Failure injection for tests (see `RelayFaults`).
#[derive(Debug, Default)]
pub struct ConsumerFaults {
    /// Commit the batch, then "die" before acking any message.
    pub crash_after_commit: AtomicU32,
    /// Fail the batch transaction as a database outage would (before commit).
    pub fail_transaction: AtomicU32,
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
    message: Message,
    verified: Result<Envelope, String>,
    sequence: i64,
    delivered: i64,
}

/// A consumer replica. Clone it for more in-process replicas of the same durable.
#[derive(Debug, Clone)]
pub struct Consumer<C> {
    pool: PgPool,
    consumer: PullConsumer,
    crm: Arc<C>,
    settings: ConsumerSettings,
    faults: Arc<ConsumerFaults>,
}

impl<C: Crm + 'static> Consumer<C> {
    /// Runs the consumer's migrations and binds to the durable consumer.
    pub async fn build(
        pool: PgPool,
        client: async_nats::Client,
        subscription: &crate::SubscriptionSettings,
        crm: C,
        settings: ConsumerSettings,
    ) -> anyhow::Result<Self> {
        crate::MIGRATOR.run(&pool).await?;
        let js = async_nats::jetstream::new(client);
        let consumer = crate::subscription::bind(&js, subscription).await?;
        Ok(Self { pool, consumer, crm: Arc::new(crm), settings, faults: Arc::default() })
    }

    /// This replica's fault hooks (tests only).
    pub fn faults(&self) -> &ConsumerFaults {
        &self.faults
    }

    /// Fetches up to one batch (waiting at most `wait`) and handles it. For tests and tools.
    pub async fn fetch_and_handle(&self, wait: Duration) -> anyhow::Result<Vec<Handled>> {
        let mut batch = self.consumer.fetch().max_messages(self.settings.batch_size).expires(wait).messages().await?;
        let mut messages = Vec::new();
        while let Some(message) = batch.next().await {
            messages.push(message.map_err(|e| anyhow::anyhow!(e))?);
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
        let incoming: Vec<Incoming> = messages.into_iter().map(verify).collect();
        match self.commit(&incoming).await {
            Ok(outcomes) => {
                if fire(&self.faults.crash_after_commit) {
                    tracing::warn!(messages = incoming.len(), "injected crash after commit, before ack");
                    return Vec::new();
                }
                self.acknowledge(&incoming, &outcomes).await;
                outcomes
            }
            Err(error) if incoming.len() > 1 => {
                tracing::warn!(error = %anyhow::Error::from(error), messages = incoming.len(), "batch failed; retrying messages one by one");
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
                self.acknowledge(&single, &outcomes).await;
                outcomes.pop().expect("one outcome")
            }
            Err(error) => {
                let [one] = single;
                self.after_failure(one, error).await
            }
        }
    }

    /// A message that failed transiently: nak with backoff, or dead-letter once it has failed
    /// `dead_letter_after` times and the dead letter is safely stored.
    async fn after_failure(&self, one: Incoming, error: ConsumeError) -> Handled {
        let error = format!("{:#}", anyhow::Error::from(error));
        if one.delivered >= self.settings.dead_letter_after {
            let reason = format!("failed {} deliveries; last error: {error}", one.delivered);
            let letter = dead_letter(&one, reason.clone());
            let stored = async {
                let mut tx = self.pool.begin().await?;
                inbox::record_dead_letters(&mut tx, &[letter]).await?;
                tx.commit().await
            }
            .await;
            match stored {
                Ok(()) => {
                    settle(&one.message, AckKind::Term).await;
                    return Handled::DeadLettered { reason };
                }
                Err(store_error) => {
                    tracing::error!(%store_error, "cannot store dead letter; message stays for redelivery")
                }
            }
        }
        let delay = self.settings.backoff.delay(one.delivered.max(1) as u32);
        tracing::warn!(sequence = one.sequence, delivered = one.delivered, %error, ?delay, "message will be redelivered");
        settle(&one.message, AckKind::Nak(Some(delay))).await;
        Handled::Retrying { error }
    }

    /// The batch transaction. Returns one outcome per message, in order.
    async fn commit(&self, incoming: &[Incoming]) -> Result<Vec<Handled>, ConsumeError> {
        let mut tx = self.pool.begin().await?;
        if fire(&self.faults.fail_transaction) {
            return Err(ConsumeError::Injected("batch transaction failed"));
        }
        let arrivals: Vec<Arrival> = incoming
            .iter()
            .filter_map(|m| m.verified.as_ref().ok().map(|env| (m, env)))
            .map(|(m, env)| Arrival {
                operation_key: env.key.to_string(),
                payload_hash: env.payload.hash().to_string(),
                stream_sequence: m.sequence,
            })
            .collect();
        let new_keys = inbox::insert_new_arrivals(&mut tx, &arrivals, C::USUAL_OUTCOME).await?;

        // The first arrival of each new key goes to the CRM.
        let mut sent_to_crm = HashSet::new();
        let mut requests = Vec::new();
        for m in incoming {
            if let Ok(env) = &m.verified
                && new_keys.contains(env.key.as_str())
                && sent_to_crm.insert(env.key.as_str())
            {
                requests.push(TaskRequest {
                    operation_key: env.key.to_string(),
                    payload_hash: env.payload.hash().to_string(),
                    payload: env.payload.value().clone(),
                    approved_by: env.approval.approved_by().to_owned(),
                });
            }
        }
        let task_outcomes = self.crm.create_tasks(&mut tx, &requests).await?;
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
        inbox::record_unusual_outcomes(&mut tx, &unusual).await?;

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
            if repeated.is_empty() { Default::default() } else { inbox::recorded_hashes(&mut tx, &repeated).await? };

        let mut outcomes = Vec::with_capacity(incoming.len());
        let mut letters = Vec::new();
        let mut first_seen = HashSet::new();
        for m in incoming {
            let env = match &m.verified {
                Ok(env) => env,
                Err(reason) => {
                    letters.push(dead_letter(m, reason.clone()));
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
        inbox::record_reviews(&mut tx, &reviews).await?;
        inbox::record_dead_letters(&mut tx, &letters).await?;
        tx.commit().await?;
        for (m, outcome) in incoming.iter().zip(&outcomes) {
            match outcome {
                Handled::Created { operation_key, task_id } => {
                    tracing::debug!(%operation_key, task_id, sequence = m.sequence, "task created");
                }
                Handled::Conflict { operation_key } => {
                    tracing::warn!(%operation_key, sequence = m.sequence, "conflict recorded for review");
                }
                Handled::DeadLettered { .. } => {
                    // The reason can quote message content; it is in the dead-letter table, not the log.
                    tracing::warn!(sequence = m.sequence, "message dead-lettered");
                }
                _ => {}
            }
        }
        Ok(outcomes)
    }

    /// Acks after the commit: done messages with a double ack (waits for the server), conflicts and
    /// dead letters with Term (they are recorded; redelivery cannot help).
    async fn acknowledge(&self, incoming: &[Incoming], outcomes: &[Handled]) {
        join_all(incoming.iter().zip(outcomes).map(|(m, outcome)| async move {
            let kind = match outcome {
                Handled::Created { .. } | Handled::Accepted { .. } | Handled::Duplicate { .. } => AckKind::Ack,
                Handled::Conflict { .. } | Handled::DeadLettered { .. } => AckKind::Term,
                Handled::Retrying { .. } => AckKind::Nak(Some(self.settings.backoff.delay(m.delivered.max(1) as u32))),
            };
            settle(&m.message, kind).await;
        }))
        .await;
    }

    /// Pulls and handles batches until `token` is cancelled, then finishes the batch in hand.
    pub async fn run_until_stopped(self, token: CancellationToken) -> anyhow::Result<()> {
        while !token.is_cancelled() {
            let stream = self
                .consumer
                .stream()
                .max_messages_per_batch(self.settings.batch_size)
                .expires(self.settings.fetch_expires)
                .messages()
                .await;
            let mut stream = match stream {
                Ok(stream) => stream.ready_chunks(self.settings.batch_size),
                Err(error) => {
                    tracing::warn!(%error, "cannot start pulling; retrying");
                    tokio::select! {
                        _ = token.cancelled() => break,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    }
                }
            };
            loop {
                let chunk = tokio::select! {
                    // Stop fetching; messages buffered but not handled are redelivered after ack_wait.
                    _ = token.cancelled() => break,
                    chunk = stream.next() => chunk,
                };
                let Some(chunk) = chunk else { break };
                let mut messages = Vec::with_capacity(chunk.len());
                for item in chunk {
                    match item {
                        Ok(message) => messages.push(message),
                        Err(error) => tracing::warn!(%error, "pull stream error"),
                    }
                }
                // Not raced against shutdown: a batch in hand is finished and acked.
                self.handle_batch(messages).await;
            }
        }
        tracing::info!("consumer stopped");
        Ok(())
    }
}

fn verify(message: Message) -> Incoming {
    let (sequence, delivered) = match message.info() {
        Ok(info) => (info.stream_sequence as i64, info.delivered),
        Err(_) => (0, 1),
    };
    let msg_id = message.headers.as_ref().and_then(|h| h.get(headers::MSG_ID)).map(|v| v.as_str().to_owned());
    let verified = Envelope::decode(&message.payload, msg_id.as_deref()).map_err(|e| e.to_string());
    Incoming { message, verified, sequence, delivered }
}

fn dead_letter(m: &Incoming, reason: String) -> DeadLetter {
    let headers = m
        .message
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
    DeadLetter {
        stream_sequence: m.sequence,
        subject: m.message.subject.to_string(),
        message_id: m.message.headers.as_ref().and_then(|h| h.get(headers::MSG_ID)).map(|v| v.as_str().to_owned()),
        reason,
        deliveries: m.delivered,
        headers,
        body: m.message.payload.to_vec(),
    }
}

/// Sends an ack of `kind` and waits for the server's confirmation. A failed ack only means a
/// redelivery, which the inbox turns into a duplicate, so it is logged, not retried.
async fn settle(message: &Message, kind: AckKind) {
    if let Err(error) = message.double_ack_with(kind).await {
        tracing::warn!(%error, "ack not confirmed; the message may be redelivered");
    }
}
