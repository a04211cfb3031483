//! The bare ceilings of this machine: minimal loops that do only the essential work of each stage,
//! with nothing the product adds (no envelope, no hash, no verification, no retry state). The
//! product's figures are divided by these, measured in the same run on the same servers.
//!
//! * `publish`: pipelined JetStream publishing with message ids (a window of acks in flight).
//! * `publish_atomic`: the same messages as atomic batches of 1,000 (ADR-50), a few batches open.
//! * `claim_mark`: claim 1,000 outbox rows (`FOR UPDATE SKIP LOCKED`, a lease) and mark them, no
//!   network.
//! * `inbox_task`: insert 500 inbox rows and 500 task rows in one transaction, no network.
//! * `relay`: claim 1,000 rows, publish them pipelined, await the acks, mark them published.
//! * `consumer`: fetch 500 messages, insert inbox and task rows in one transaction, commit, ack
//!   (plain or double ack).
//! * `round_trip`: one message from publish to a waiting pull consumer: the latency yardstick.
//! * `pipeline_round_trip`: one action from the producer's commit to the consumer's commit through
//!   the same durable steps as the product, each minimal: the floor of the end-to-end latency.
//! * `pipeline_under_load`: the same minimal steps at an offered load, rows committed every 10 ms
//!   as the product's load generator commits them: the floor of the end-to-end latency at that load.
//! * `crm_calls`: `concurrency` callers each POSTing tasks to the CRM simulator back to back, with
//!   the body and headers the consumer sends: what the simulator itself allows at that concurrency.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream::StorageType;
use bytes::Bytes;
use futures::StreamExt;
use futures::future::join_all;
use futures::stream::FuturesUnordered;
use handoff_relay::StreamSettings;
use handoff_shared::signing::SigningKey;
use handoff_shared::{Subjects, headers};
use sqlx::PgPool;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::measure::{Meter, Sample};
use crate::workload;
use crate::world::World;

/// Rows per claim in the bare relay loops (the issue's reference loop).
pub const CLAIM_BATCH: i64 = 1_000;
/// Messages per consumer transaction in the bare consumer loop.
pub const CONSUME_BATCH: usize = 500;
/// Publishes in flight at once in the publish ceiling (below the client's default of 5,000).
const PUBLISH_WINDOW: usize = 4_096;
/// How long the publish ceiling waits for each ack. With `sync_interval: always` on R1 every
/// message waits for the fsyncs of those ahead of it: a full window takes seconds on a slow disk,
/// more than the client's default of 5 s.
const PUBLISH_ACK_TIMEOUT: Duration = Duration::from_secs(60);

/// Stream settings as the relay creates them by default (file storage, Limits, DiscardPolicy::New).
pub fn stream_settings(name: &str, subjects: &Subjects, replicas: usize) -> StreamSettings {
    StreamSettings {
        name: name.to_owned(),
        subjects: subjects.clone(),
        duplicate_window: Duration::from_secs(3600),
        max_age: Duration::from_secs(7 * 24 * 3600),
        max_bytes: -1,
        replicas,
        storage: StorageType::File,
    }
}

/// `n` encoded envelopes of `batch`, made before any clock starts.
pub fn envelopes(batch: &str, n: i64, signing: &SigningKey) -> Result<Vec<(String, Bytes)>> {
    envelopes_of(workload::Payloads::Small, batch, n, signing)
}

/// [`envelopes`] with `payloads`.
pub fn envelopes_of(
    payloads: workload::Payloads,
    batch: &str,
    n: i64,
    signing: &SigningKey,
) -> Result<Vec<(String, Bytes)>> {
    (1..=n).map(|i| workload::envelope_of(payloads, batch, i, signing)).collect()
}

/// A stream filled with envelopes, which the consumer measurements read from.
#[derive(Debug, Clone)]
pub struct FilledStream {
    pub name: String,
    pub subjects: Subjects,
    pub messages: u64,
}

/// Publishes `messages` pipelined into a new stream; returns the sample and the stream.
pub async fn publish(world: &mut World, messages: &[(String, Bytes)]) -> Result<(Sample, FilledStream)> {
    let name = world.unique("CEIL");
    let subjects = Subjects::new(name.to_lowercase())?;
    handoff_relay::publisher::ensure_stream(
        &world.js,
        &stream_settings(&name, &subjects, world.profile.replicas()),
        false,
    )
    .await?;
    let subject = format!("{}.bench.create-followup", subjects.prefix());
    let mut js = world.js.clone();
    js.set_timeout(PUBLISH_ACK_TIMEOUT);
    let acked = |ack: Result<_, async_nats::jetstream::context::PublishError>| {
        ack.with_context(|| {
            format!("waiting for a publish's ack ({PUBLISH_WINDOW} in flight, {PUBLISH_ACK_TIMEOUT:?} each)")
        })
    };
    let meter = Meter::start(world, &[]);
    let mut in_flight = FuturesUnordered::new();
    for (key, body) in messages {
        let publish = PublishMessage::build()
            .payload(body.clone())
            .header(headers::CONTENT_TYPE, headers::CLOUDEVENTS_JSON)
            .message_id(key);
        in_flight.push(js.send_publish(subject.clone(), publish).await.context("publishing")?.into_future());
        if in_flight.len() >= PUBLISH_WINDOW {
            acked(in_flight.next().await.context("an ack in flight")?)?;
        }
    }
    while let Some(ack) = in_flight.next().await {
        acked(ack)?;
    }
    let sample = meter.finish(world, &[], messages.len() as u64);
    let stored = world.stream_messages(&name).await?;
    ensure!(stored == messages.len() as u64, "publish ceiling stored {stored} of {} messages", messages.len());
    Ok((sample, FilledStream { name, subjects, messages: stored }))
}

/// Messages per batch in the atomic publish ceiling: the relay's claim and the server's limit.
pub const ATOMIC_BATCH: usize = 1_000;

/// The bare atomic-batch loop (ADR-50): batches of [`ATOMIC_BATCH`] messages with message ids,
/// messages 1..n-1 as core publishes with the batch headers and no reply, the last with the commit
/// header through JetStream; `in_flight` batches open at once (as many relays as the relay rows
/// run, each holding one claimed batch). Nothing else: no database, no envelope work.
pub async fn publish_atomic(
    world: &mut World,
    messages: &[(String, Bytes)],
    in_flight: usize,
) -> Result<(Sample, String)> {
    use async_nats::header::{NATS_BATCH_COMMIT, NATS_BATCH_COMMIT_FINAL, NATS_BATCH_ID, NATS_BATCH_SEQUENCE};
    let name = world.unique("ATOM");
    let subjects = Subjects::new(name.to_lowercase())?;
    let settings = stream_settings(&name, &subjects, world.profile.replicas());
    let info = handoff_relay::publisher::ensure_stream(&world.js, &settings, true).await?;
    ensure!(info.config.allow_atomic_publish, "stream {name} does not allow atomic batches (server too old?)");
    let subject = format!("{}.bench.create-followup", subjects.prefix());
    let meter = Meter::start(world, &[]);
    let mut commits = FuturesUnordered::new();
    for (n, chunk) in messages.chunks(ATOMIC_BATCH).enumerate() {
        let batch_id = format!("{name}-{n}");
        let (last, rest) = chunk.split_last().context("an empty chunk")?;
        for (i, (key, body)) in rest.iter().enumerate() {
            let mut h = async_nats::HeaderMap::new();
            h.insert(headers::MSG_ID, key.as_str());
            h.insert(headers::CONTENT_TYPE, headers::CLOUDEVENTS_JSON);
            h.insert(NATS_BATCH_ID, batch_id.as_str());
            h.insert(NATS_BATCH_SEQUENCE, (i + 1).to_string().as_str());
            world.client.publish_with_headers(subject.clone(), h, body.clone()).await?;
        }
        let commit = PublishMessage::build()
            .payload(last.1.clone())
            .header(headers::CONTENT_TYPE, headers::CLOUDEVENTS_JSON)
            .header(NATS_BATCH_ID, batch_id.as_str())
            .header(NATS_BATCH_SEQUENCE, chunk.len().to_string().as_str())
            .header(NATS_BATCH_COMMIT, NATS_BATCH_COMMIT_FINAL)
            .message_id(&last.0);
        commits.push(world.js.send_publish(subject.clone(), commit).await?.into_future());
        if commits.len() >= in_flight {
            let ack = commits.next().await.context("a commit in flight")??;
            ensure!(ack.batch_size.is_some(), "a commit answered without a batch: {ack:?}");
        }
    }
    while let Some(ack) = commits.next().await {
        ensure!(ack?.batch_size.is_some(), "a commit answered without a batch");
    }
    let sample = meter.finish(world, &[], messages.len() as u64);
    let stored = world.stream_messages(&name).await?;
    ensure!(stored == messages.len() as u64, "atomic publish ceiling stored {stored} of {} messages", messages.len());
    Ok((sample, name))
}

const BARE_SCHEMA: &str = r#"
    CREATE TABLE bare_outbox (
        id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        operation_key   text NOT NULL UNIQUE,
        payload         jsonb NOT NULL,
        state           text NOT NULL DEFAULT 'pending',
        attempts        integer NOT NULL DEFAULT 0,
        next_attempt_at timestamptz NOT NULL DEFAULT now(),
        lease_owner     text,
        stream_sequence bigint,
        published_at    timestamptz,
        -- The producer's transaction: its commit timestamp survives the claim's and mark's updates.
        recorded_xid    xid8 NOT NULL DEFAULT pg_current_xact_id()
    );
    CREATE INDEX bare_outbox_due ON bare_outbox (next_attempt_at) WHERE state = 'pending';
    CREATE TABLE bare_inbox (
        operation_key   text PRIMARY KEY,
        payload_hash    text NOT NULL,
        stream_sequence bigint NOT NULL,
        received_at     timestamptz NOT NULL DEFAULT now()
    );
    CREATE TABLE bare_task (
        task_id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        operation_key text NOT NULL UNIQUE,
        payload       jsonb NOT NULL,
        created_at    timestamptz NOT NULL DEFAULT now()
    );"#;

/// Creates the bare tables in a fresh database.
pub async fn create_bare_schema(pool: &PgPool) -> Result<()> {
    sqlx::raw_sql(BARE_SCHEMA).execute(pool).await?;
    Ok(())
}

/// Fills `bare_outbox` with `n` pending rows carrying the benchmark payloads.
pub async fn fill_bare_outbox(pool: &PgPool, n: i64) -> Result<()> {
    sqlx::query(
        r#"INSERT INTO bare_outbox (operation_key, payload)
           SELECT 'bench:create-followup:v1:bare-' || i,
                  jsonb_build_object('case_id', 'case-' || i, 'due', '2026-12-01', 'priority', 'normal',
                                     'title', 'Call about the approved repair plan ' || i)
             FROM generate_series(1, $1::bigint) AS i"#,
    )
    .bind(n)
    .execute(pool)
    .await?;
    // No VACUUM or ANALYZE: a backlog is drained as it arrives, for the bare loop as for the relay.
    Ok(())
}

/// The bare claim: a lease and an attempt on up to `$1` due rows.
const BARE_CLAIM: &str = r#"
    UPDATE bare_outbox
       SET attempts = attempts + 1, lease_owner = $2, next_attempt_at = now() + interval '30 seconds'
     WHERE id = ANY(ARRAY(SELECT id FROM bare_outbox
                           WHERE state = 'pending' AND next_attempt_at <= now()
                           ORDER BY next_attempt_at
                           LIMIT $1
                             FOR UPDATE SKIP LOCKED))
 RETURNING id, operation_key, payload::text"#;

/// The bare mark: published with a sequence, in one statement. (`o.id = ANY(..)` keeps it on the
/// primary key: without it a batch of 1% of the table is planned as a hash join over a full scan.)
const BARE_MARK: &str = r#"
    UPDATE bare_outbox AS o
       SET state = 'published', stream_sequence = u.seq, published_at = now(), lease_owner = NULL
      FROM UNNEST($1::bigint[], $2::bigint[]) AS u(id, seq)
     WHERE o.id = u.id AND o.id = ANY($1::bigint[])"#;

/// Claim + mark with no network in between, `workers` loops, until the table is drained.
pub async fn claim_mark(world: &World, pool: &PgPool, n: i64, workers: usize) -> Result<Sample> {
    let meter = Meter::start(world, &[]);
    let mut loops = JoinSet::new();
    for w in 0..workers {
        let pool = pool.clone();
        loops.spawn(async move {
            let owner = format!("bare-{w}");
            let mut moved = 0_u64;
            loop {
                let rows: Vec<(i64, String, String)> =
                    sqlx::query_as(BARE_CLAIM).bind(CLAIM_BATCH).bind(&owner).fetch_all(&pool).await?;
                if rows.is_empty() {
                    return anyhow::Ok(moved);
                }
                let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
                sqlx::query(BARE_MARK).bind(&ids).bind(&ids).execute(&pool).await?;
                moved += rows.len() as u64;
            }
        });
    }
    let mut moved = 0;
    while let Some(done) = loops.join_next().await {
        moved += done??;
    }
    ensure!(moved == n as u64, "claim+mark moved {moved} of {n} rows");
    Ok(meter.finish(world, &[], moved))
}

/// Inbox + task rows, 500 per transaction, `workers` loops, no network.
pub async fn inbox_task(world: &World, pool: &PgPool, n: i64, workers: usize) -> Result<Sample> {
    let rows: Arc<Vec<(String, String, serde_json::Value)>> = Arc::new(
        (1..=n).map(|i| (workload::key("it", i), format!("{:064x}", i), workload::payload(i))).collect::<Vec<_>>(),
    );
    let next = Arc::new(AtomicU64::new(0));
    let meter = Meter::start(world, &[]);
    let mut loops = JoinSet::new();
    for _ in 0..workers {
        let (pool, rows, next) = (pool.clone(), rows.clone(), next.clone());
        loops.spawn(async move {
            loop {
                let start = next.fetch_add(CONSUME_BATCH as u64, Ordering::Relaxed) as usize;
                if start >= rows.len() {
                    return anyhow::Ok(());
                }
                let chunk = &rows[start..(start + CONSUME_BATCH).min(rows.len())];
                insert_inbox_and_tasks(&pool, chunk.iter().map(|(k, h, p)| (k.as_str(), h.as_str(), p.clone(), 0)))
                    .await?;
            }
        });
    }
    while let Some(done) = loops.join_next().await {
        done??;
    }
    Ok(meter.finish(world, &[], n as u64))
}

/// One consumer transaction: inbox rows (new keys only) and their task rows.
async fn insert_inbox_and_tasks<'a>(
    pool: &PgPool,
    rows: impl Iterator<Item = (&'a str, &'a str, serde_json::Value, i64)>,
) -> Result<()> {
    let (mut keys, mut hashes, mut payloads, mut seqs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (k, h, p, s) in rows {
        keys.push(k);
        hashes.push(h);
        payloads.push(p);
        seqs.push(s);
    }
    let mut tx = pool.begin().await?;
    let new: Vec<String> = sqlx::query_scalar(
        r#"INSERT INTO bare_inbox (operation_key, payload_hash, stream_sequence)
           SELECT * FROM UNNEST($1::text[], $2::text[], $3::bigint[])
           ON CONFLICT (operation_key) DO NOTHING
           RETURNING operation_key"#,
    )
    .bind(&keys)
    .bind(&hashes)
    .bind(&seqs)
    .fetch_all(&mut *tx)
    .await?;
    if new.len() < keys.len() {
        bail!("bare inbox: {} of {} keys were not new", keys.len() - new.len(), keys.len());
    }
    sqlx::query(
        r#"INSERT INTO bare_task (operation_key, payload)
           SELECT * FROM UNNEST($1::text[], $2::jsonb[])
           ON CONFLICT (operation_key) DO NOTHING"#,
    )
    .bind(&keys)
    .bind(&payloads)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// One batch of the bare relay: claims up to [`CLAIM_BATCH`] due rows for `owner`, publishes them
/// pipelined with their message ids on `subject`, awaits the PubAcks and marks the rows. Returns
/// how many rows it moved (0: nothing was due).
async fn relay_batch(pool: &PgPool, js: &async_nats::jetstream::Context, subject: &str, owner: &str) -> Result<usize> {
    let rows: Vec<(i64, String, String)> =
        sqlx::query_as(BARE_CLAIM).bind(CLAIM_BATCH).bind(owner).fetch_all(pool).await?;
    if rows.is_empty() {
        return Ok(0);
    }
    let mut acks = Vec::with_capacity(rows.len());
    for (_, key, payload) in &rows {
        let publish = PublishMessage::build().payload(Bytes::from(payload.clone())).message_id(key);
        acks.push(js.send_publish(subject.to_owned(), publish).await?.into_future());
    }
    let mut ids = Vec::with_capacity(rows.len());
    let mut seqs = Vec::with_capacity(rows.len());
    for ((id, _, _), ack) in rows.iter().zip(join_all(acks).await) {
        ids.push(*id);
        seqs.push(ack?.sequence as i64);
    }
    sqlx::query(BARE_MARK).bind(&ids).bind(&seqs).execute(pool).await?;
    Ok(rows.len())
}

/// One chunk of the bare consumer: the inbox and task rows of `messages` in one transaction.
async fn store_chunk(pool: &PgPool, messages: &[async_nats::jetstream::Message]) -> Result<()> {
    let rows: Vec<(String, serde_json::Value, i64)> = messages
        .iter()
        .map(|m| {
            let key = m.headers.as_ref().and_then(|h| h.get(headers::MSG_ID)).map(|v| v.as_str().to_owned());
            let seq = m.info().map(|i| i.stream_sequence as i64).unwrap_or_default();
            let body = serde_json::from_slice(&m.payload).unwrap_or(serde_json::Value::Null);
            (key.unwrap_or_default(), body, seq)
        })
        .collect();
    insert_inbox_and_tasks(pool, rows.iter().map(|(k, b, s)| (k.as_str(), "bare", b.clone(), *s))).await
}

/// A fresh stream of the run's profile as the relay creates it: its name and subjects.
async fn fresh_stream(world: &mut World, hint: &str) -> Result<(String, Subjects)> {
    let name = world.unique(hint);
    let subjects = Subjects::new(name.to_lowercase())?;
    handoff_relay::publisher::ensure_stream(
        &world.js,
        &stream_settings(&name, &subjects, world.profile.replicas()),
        false,
    )
    .await?;
    Ok((name, subjects))
}

/// The bare relay: claim 1,000, publish pipelined with message ids, await acks, mark; `workers`
/// loops, each on its own NATS connection (as separate relay processes would be).
pub async fn relay(world: &mut World, pool: &PgPool, n: i64, workers: usize) -> Result<Sample> {
    let (name, subjects) = fresh_stream(world, "BRELAY").await?;
    let subject = format!("{}.bench.create-followup", subjects.prefix());
    let mut clients = Vec::new();
    for _ in 0..workers {
        clients.push(async_nats::connect(world.nats.addrs()).await?);
    }
    let meter = Meter::start(world, &[]);
    let mut loops = JoinSet::new();
    for (w, client) in clients.into_iter().enumerate() {
        let (pool, subject) = (pool.clone(), subject.clone());
        loops.spawn(async move {
            let js = async_nats::jetstream::new(client);
            let owner = format!("bare-{w}");
            let mut moved = 0_u64;
            loop {
                let rows = relay_batch(&pool, &js, &subject, &owner).await?;
                if rows == 0 {
                    return anyhow::Ok(moved);
                }
                moved += rows as u64;
            }
        });
    }
    let mut moved = 0;
    while let Some(done) = loops.join_next().await {
        moved += done??;
    }
    let sample = meter.finish(world, &[], moved);
    ensure!(moved == n as u64, "bare relay moved {moved} of {n} rows");
    let stored = world.stream_messages(&name).await?;
    ensure!(stored == n as u64, "bare relay stored {stored} messages for {n} rows");
    world.drop_stream(&name).await;
    Ok(sample)
}

/// The bare consumer: `workers` loops on one durable, each on its own connection, fetching up to
/// 500 messages, inserting inbox and task rows in one transaction, then acking each message
/// (plain acks like the real consumer's, without its flush; `double_ack` waits for each
/// confirmation instead).
pub async fn consumer(
    world: &mut World,
    pool: &PgPool,
    source: &FilledStream,
    workers: usize,
    double_ack: bool,
) -> Result<Sample> {
    let durable = world.unique("bare");
    let stream = world.js.get_stream(&source.name).await?;
    stream
        .create_consumer(pull::Config {
            durable_name: Some(durable.clone()),
            filter_subject: source.subjects.all(),
            ack_policy: AckPolicy::Explicit,
            deliver_policy: DeliverPolicy::All,
            ack_wait: Duration::from_secs(30),
            max_deliver: -1,
            max_ack_pending: (CONSUME_BATCH * workers * 2) as i64,
            ..Default::default()
        })
        .await?;
    let total = source.messages;
    let done = Arc::new(AtomicU64::new(0));
    let finished = CancellationToken::new();
    let mut consumers = Vec::new();
    for _ in 0..workers {
        let client = async_nats::connect(world.nats.addrs()).await?;
        let js = async_nats::jetstream::new(client);
        let consumer: async_nats::jetstream::consumer::PullConsumer =
            js.get_consumer_from_stream(&durable, &source.name).await?;
        consumers.push(consumer);
    }
    let meter = Meter::start(world, &[]);
    let mut loops = JoinSet::new();
    for consumer in consumers {
        let (pool, done, finished) = (pool.clone(), done.clone(), finished.clone());
        loops.spawn(async move {
            let messages = consumer.stream().max_messages_per_batch(CONSUME_BATCH).messages().await?;
            let mut chunks = messages.ready_chunks(CONSUME_BATCH);
            loop {
                let chunk = tokio::select! {
                    // Another loop handled the last message.
                    _ = finished.cancelled() => return anyhow::Ok(()),
                    chunk = chunks.next() => chunk,
                };
                let Some(chunk) = chunk else { bail!("pull stream ended") };
                let messages = chunk.into_iter().collect::<Result<Vec<_>, _>>().map_err(|e| anyhow::anyhow!(e))?;
                store_chunk(&pool, &messages).await?;
                if double_ack {
                    for acked in join_all(messages.iter().map(|m| m.double_ack())).await {
                        acked.map_err(|e| anyhow::anyhow!(e))?;
                    }
                } else {
                    for m in &messages {
                        m.ack().await.map_err(|e| anyhow::anyhow!(e))?;
                    }
                }
                if done.fetch_add(messages.len() as u64, Ordering::Relaxed) + messages.len() as u64 >= total {
                    finished.cancel();
                }
            }
        });
    }
    while let Some(result) = loops.join_next().await {
        result??;
    }
    let sample = meter.finish(world, &[], total);
    let tasks: i64 = sqlx::query_scalar("SELECT count(*) FROM bare_task").fetch_one(pool).await?;
    ensure!(tasks == total as i64, "bare consumer made {tasks} tasks for {total} messages");
    let _ = world.js.delete_consumer_from_stream(&durable, &source.name).await;
    Ok(sample)
}

/// A fresh stream of the run's profile with a durable pull consumer already pulling from it: where
/// the latency yardsticks publish and receive.
struct Waiting {
    /// The stream, to drop afterwards.
    name: String,
    /// A subject of the stream to publish on.
    subject: String,
    messages: pull::Stream,
}

async fn waiting_consumer(world: &mut World, hint: &str) -> Result<Waiting> {
    let (name, subjects) = fresh_stream(world, hint).await?;
    let stream = world.js.get_stream(&name).await?;
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("yardstick".into()),
            filter_subject: subjects.all(),
            ack_policy: AckPolicy::Explicit,
            ..Default::default()
        })
        .await?;
    let messages = consumer.stream().max_messages_per_batch(100).messages().await?;
    let subject = format!("{}.bench.create-followup", subjects.prefix());
    Ok(Waiting { name, subject, messages })
}

/// The latency yardstick: one message at a time from publish to a pull consumer that is already
/// waiting, `samples` times (spaced 2 ms apart, an idle system). Milliseconds per message.
pub async fn round_trip(world: &mut World, samples: usize) -> Result<Vec<f64>> {
    let Waiting { name, subject, mut messages } = waiting_consumer(world, "RTT").await?;
    let (key, body) = workload::envelope("rtt", 1, &world.keys.signing)?;
    let mut millis = Vec::with_capacity(samples);
    for i in 0..samples {
        let publish = PublishMessage::build().payload(body.clone()).message_id(format!("{key}-{i}"));
        let sent = Instant::now();
        let ack = world.js.send_publish(subject.clone(), publish).await?;
        let message = messages.next().await.context("pull stream ended")?.map_err(|e| anyhow::anyhow!(e))?;
        millis.push(sent.elapsed().as_secs_f64() * 1e3);
        message.ack().await.map_err(|e| anyhow::anyhow!(e))?;
        ack.await?;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    drop(messages);
    world.drop_stream(&name).await;
    Ok(millis)
}

/// The channel the bare pipeline's producer notifies and its relay loop listens on.
const PIPELINE_CHANNEL: &str = "bare_pipeline";

/// The bare producer: one outbox row and its notification on `$3`, in one statement (one commit).
const PIPELINE_INSERT: &str = r#"
    WITH row AS (INSERT INTO bare_outbox (operation_key, payload) VALUES ($1, $2) RETURNING id)
    SELECT pg_notify($3, id::text) FROM row"#;

/// The floor of the end-to-end latency: one action at a time, `samples` times (spaced 2 ms apart,
/// an idle system), through the durable steps the product takes, each as small as it can be. The
/// producer commits an outbox row and a notification in one statement; a relay loop woken by
/// LISTEN claims it ([`BARE_CLAIM`]), publishes it with its message id and awaits the PubAck, then
/// marks it; a pull consumer already waiting inserts its inbox and task rows in one transaction
/// and commits. Milliseconds from the producer's commit returning to the consumer's commit
/// returning: two commits, a notification, a claim, a publish and a delivery, with nothing the
/// product adds (no envelope, hash, signature, range record, verification, or other load).
pub async fn pipeline_round_trip(world: &mut World, pool: &PgPool, samples: usize) -> Result<Vec<f64>> {
    let Waiting { name, subject, mut messages } = waiting_consumer(world, "BPIPE").await?;
    let mut listener = sqlx::postgres::PgListener::connect_with(pool).await?;
    listener.listen(PIPELINE_CHANNEL).await?;
    let stop = CancellationToken::new();
    let relay = {
        let (pool, js, stop) = (pool.clone(), world.js.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return anyhow::Ok(()),
                    notification = listener.recv() => { notification?; }
                }
                relay_batch(&pool, &js, &subject, "pipeline").await?;
            }
        })
    };
    let mut millis = Vec::with_capacity(samples);
    for i in 1..=samples as i64 {
        let key = workload::key("pipeline", i);
        let payload = workload::payload(i);
        sqlx::query(PIPELINE_INSERT).bind(&key).bind(&payload).bind(PIPELINE_CHANNEL).execute(pool).await?;
        let committed = Instant::now();
        let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .with_context(|| format!("the bare pipeline delivered nothing for {key} within 10 s"))?
            .context("pull stream ended")?
            .map_err(|e| anyhow::anyhow!(e))?;
        let sequence = message.info().map(|i| i.stream_sequence as i64).map_err(|e| anyhow::anyhow!(e))?;
        let body: serde_json::Value = serde_json::from_slice(&message.payload)?;
        insert_inbox_and_tasks(pool, std::iter::once((key.as_str(), "bare", body, sequence))).await?;
        millis.push(committed.elapsed().as_secs_f64() * 1e3);
        message.ack().await.map_err(|e| anyhow::anyhow!(e))?;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    stop.cancel();
    relay.await??;
    drop(messages);
    let tasks: i64 = sqlx::query_scalar("SELECT count(*) FROM bare_task").fetch_one(pool).await?;
    ensure!(tasks == samples as i64, "the bare pipeline made {tasks} tasks for {samples} actions");
    let stored = world.stream_messages(&name).await?;
    ensure!(stored == samples as u64, "the bare pipeline's stream holds {stored} messages for {samples} actions");
    world.drop_stream(&name).await;
    Ok(millis)
}

/// The bare producer under load: actions `$1..=$2` with keys `$3 || $4 || '-' || i` and the
/// benchmark payloads, and one notification on `$5`, in one statement (one commit).
const PIPELINE_LOAD_INSERT: &str = r#"
    WITH rows AS (
        INSERT INTO bare_outbox (operation_key, payload)
        SELECT $3::text || $4::text || '-' || i,
               jsonb_build_object('case_id', 'case-' || i, 'due', '2026-12-01', 'priority', 'normal',
                                  'title', 'Call about the approved repair plan ' || i)
          FROM generate_series($1::bigint, $2::bigint) AS i
     RETURNING 1)
    SELECT pg_notify($5, count(*)::text) FROM rows"#;

/// The bare pipeline at an offered load of `rate` actions/s for `duration`: the floor of the
/// end-to-end latency at that load, measured as the product's is.
///
/// The producer commits the actions due every 10 ms in one statement with a notification
/// ([`workload::offer`], as the product's load generator commits them), in `producer`. `workers`
/// bare relay loops (the product's relay has as many), each woken by its own LISTEN, claim
/// ([`BARE_CLAIM`]) until nothing is due, publish pipelined with message ids, await the PubAcks and
/// mark ([`BARE_MARK`]). `replicas` bare consumers on one durable, each on its own NATS connection,
/// insert the inbox and task rows of each chunk they receive in one transaction in `consumer` (the
/// consumer's own server, as the product's), commit, then ack. Nothing the product adds: no
/// envelope, hash, signature, range record, verification or retry state.
///
/// Milliseconds per action from the producer's commit to the commit of the consumer transaction
/// holding its task, both read as commit timestamps (`track_commit_timestamp`), as
/// [`crate::system::Pipeline::latencies`] reads the product's.
pub async fn pipeline_under_load(
    world: &mut World,
    producer: &PgPool,
    consumer: &PgPool,
    rate: f64,
    duration: Duration,
    (workers, replicas): (usize, usize),
) -> Result<Vec<f64>> {
    const BATCH: &str = "bl";
    let (name, subjects) = fresh_stream(world, "BLOAD").await?;
    let subject = format!("{}.bench.create-followup", subjects.prefix());
    let durable = world.unique("bare");
    world
        .js
        .get_stream(&name)
        .await?
        .create_consumer(pull::Config {
            durable_name: Some(durable.clone()),
            filter_subject: subjects.all(),
            ack_policy: AckPolicy::Explicit,
            deliver_policy: DeliverPolicy::All,
            ack_wait: Duration::from_secs(30),
            max_deliver: -1,
            ..Default::default()
        })
        .await?;
    let stop = CancellationToken::new();
    let mut loops = JoinSet::new();
    for _ in 0..replicas {
        let js = async_nats::jetstream::new(async_nats::connect(world.nats.addrs()).await?);
        let pull: async_nats::jetstream::consumer::PullConsumer = js.get_consumer_from_stream(&durable, &name).await?;
        let mut chunks =
            pull.stream().max_messages_per_batch(CONSUME_BATCH).messages().await?.ready_chunks(CONSUME_BATCH);
        let (pool, stop) = (consumer.clone(), stop.clone());
        loops.spawn(async move {
            loop {
                let chunk = tokio::select! {
                    _ = stop.cancelled() => return anyhow::Ok(()),
                    chunk = chunks.next() => chunk,
                };
                let Some(chunk) = chunk else { bail!("pull stream ended") };
                let messages = chunk.into_iter().collect::<Result<Vec<_>, _>>().map_err(|e| anyhow::anyhow!(e))?;
                store_chunk(&pool, &messages).await?;
                for m in &messages {
                    m.ack().await.map_err(|e| anyhow::anyhow!(e))?;
                }
            }
        });
    }
    for w in 0..workers {
        let mut listener = sqlx::postgres::PgListener::connect_with(producer).await?;
        listener.listen(PIPELINE_CHANNEL).await?;
        let (pool, js, subject, stop) = (producer.clone(), world.js.clone(), subject.clone(), stop.clone());
        loops.spawn(async move {
            let owner = format!("bare-{w}");
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return anyhow::Ok(()),
                    notification = listener.recv() => { notification?; }
                }
                // Until nothing is due: rows committed meanwhile may have no notification left.
                while relay_batch(&pool, &js, &subject, &owner).await? > 0 {}
            }
        });
    }
    let recorded = workload::offer(rate, duration, |first, n| async move {
        sqlx::query(PIPELINE_LOAD_INSERT)
            .bind(first)
            .bind(first + n - 1)
            .bind(workload::KEY_PREFIX)
            .bind(BATCH)
            .bind(PIPELINE_CHANNEL)
            .execute(producer)
            .await?;
        Ok(())
    })
    .await;
    // Every recorded action has its task, or a loop failed (or the recording did).
    let waited = async {
        let recorded = recorded?;
        let started = Instant::now();
        loop {
            let tasks: i64 = sqlx::query_scalar("SELECT count(*) FROM bare_task").fetch_one(consumer).await?;
            if tasks >= recorded {
                return anyhow::Ok(recorded);
            }
            ensure!(started.elapsed() < Duration::from_secs(120), "the bare pipeline made {tasks} of {recorded} tasks");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let recorded = tokio::select! {
        recorded = waited => recorded,
        Some(failed) = loops.join_next() => bail!("a bare pipeline loop ended early: {:?}", failed?.err()),
    };
    stop.cancel();
    while let Some(result) = loops.join_next().await {
        result??;
    }
    let recorded = recorded?;
    let stored = world.stream_messages(&name).await?;
    ensure!(stored == recorded as u64, "the bare pipeline's stream holds {stored} messages for {recorded} actions");
    let tasks: i64 = sqlx::query_scalar("SELECT count(*) FROM bare_task").fetch_one(consumer).await?;
    ensure!(tasks == recorded, "the bare pipeline made {tasks} tasks for {recorded} actions");
    let committed: std::collections::HashMap<String, f64> = sqlx::query_as::<_, (String, Option<f64>)>(
        "SELECT operation_key, extract(epoch FROM pg_xact_commit_timestamp(xid(recorded_xid)))::float8 FROM bare_outbox",
    )
    .fetch_all(producer)
    .await?
    .into_iter()
    .map(|(key, at)| at.map(|at| (key, at)).context("no commit timestamp: is track_commit_timestamp on?"))
    .collect::<Result<_>>()?;
    let done: Vec<(String, Option<f64>)> = sqlx::query_as(
        "SELECT operation_key, extract(epoch FROM pg_xact_commit_timestamp(xmin))::float8 FROM bare_task",
    )
    .fetch_all(consumer)
    .await?;
    let mut millis = Vec::with_capacity(done.len());
    for (key, done) in done {
        let done = done.context("no commit timestamp for a bare task: is track_commit_timestamp on?")?;
        let at = committed.get(&key).with_context(|| format!("a bare task for {key}, which was not recorded"))?;
        millis.push((done - at) * 1e3);
    }
    let _ = world.js.delete_consumer_from_stream(&durable, &name).await;
    world.drop_stream(&name).await;
    Ok(millis)
}

/// `concurrency` callers create `items` tasks in the CRM simulator at `addr`, each waiting for its
/// reply before the next request (the remote consumer's shape without ledger or broker).
pub async fn crm_calls(
    world: &World,
    addr: std::net::SocketAddr,
    adapter: handoff_consumer::remote::Adapter,
    concurrency: usize,
    items: i64,
) -> Result<Sample> {
    use handoff_consumer::remote::Adapter;
    let client = reqwest::Client::builder().pool_max_idle_per_host(concurrency).build()?;
    let base = format!("http://{addr}");
    let next = Arc::new(AtomicU64::new(1));
    let meter = Meter::start(world, &[]);
    let callers = (0..concurrency).map(|_| {
        let (client, base, next) = (client.clone(), base.clone(), next.clone());
        async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as i64;
                if i > items {
                    return Ok::<_, anyhow::Error>(());
                }
                let payload = workload::payload(i);
                let hash = handoff_shared::CanonicalPayload::new(payload.clone())?.hash().to_string();
                let key = workload::key("bare", i);
                // The create each adapter makes, with the default mapping (the payload's fields).
                let request = match adapter {
                    Adapter::TasksApi => client.post(format!("{base}/v1/tasks")).json(&serde_json::json!({
                        "external_id": key,
                        "payload_hash": hash,
                        "data": payload,
                    })),
                    Adapter::Upsert => {
                        let mut fields = payload.as_object().cloned().unwrap_or_default();
                        fields.insert("Handoff_Payload_Hash__c".into(), hash.into());
                        client
                            .patch(format!("{base}/services/data/v60.0/sobjects/Task/Handoff_Key__c/{key}"))
                            .json(&fields)
                    }
                    Adapter::UniqueProperty => {
                        let mut properties = payload.as_object().cloned().unwrap_or_default();
                        properties.insert("handoff_key".into(), key.clone().into());
                        properties.insert("handoff_hash".into(), hash.into());
                        client
                            .post(format!("{base}/crm/v3/objects/tasks"))
                            .json(&serde_json::json!({ "properties": properties }))
                    }
                };
                let response = request.bearer_auth("sim-token").send().await?;
                ensure!(response.status().is_success(), "the simulator answered {}", response.status());
            }
        }
    });
    for caller in join_all(callers).await {
        caller?;
    }
    Ok(meter.finish(world, &[], items as u64))
}
