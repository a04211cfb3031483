//! Reconciliation speed: `handoff-admin reconcile` (the library call the command makes) over `n`
//! published rows and `n` inbox rows, against its own ceiling in the same run: a bare loop that
//! reads the same stream sequences with as many reads in flight and nothing else (no database).
//!
//! The outbox is filled and published by the real relay (two processes), so sequences, rows and
//! stream are what production holds; the consumer's side is filled by SQL with the same keys (an
//! inbox row and a local task per key), which is what a drained consumer leaves.

use std::time::Instant;

use anyhow::{Result, ensure};
use futures::StreamExt;
use handoff_relay::reconcile::{PROBE_CONCURRENCY, Scope};
use handoff_shared::Subjects;

use crate::measure::{Meter, Sample};
use crate::workload;
use crate::world::{Service, World, wait_for_listeners};

/// What one reconciliation run found (it must find nothing: every row is where it should be).
#[derive(Debug, Clone, Default)]
pub struct ReconcileChecks {
    pub published_rows_checked: u64,
    pub inbox_rows_checked: u64,
    pub mismatches: usize,
}

/// A filled world to reconcile: producer and consumer databases and the stream.
#[derive(Debug)]
pub struct Filled {
    producer: crate::world::Database,
    consumer: crate::world::Database,
    stream: String,
    n: i64,
}

/// Records `n` actions, lets two relay processes publish them, and fills the consumer's inbox and
/// local CRM with the same keys.
pub async fn fill(world: &mut World, n: i64) -> Result<Filled> {
    let producer = world.database("bench_reconcile", 4).await?;
    handoff_relay::SCHEMA.migrate(&producer.pool).await?;
    let stream = world.unique("RECON");
    let subjects = Subjects::new(stream.to_lowercase())?;
    let env = world.relay_env(&producer, &stream, &subjects);
    let mut relays =
        vec![Service::spawn("relay", "handoff-relay", &env)?, Service::spawn("relay", "handoff-relay", &env)?];
    wait_for_listeners(&producer, "handoff-relay", 2).await?;
    workload::record_actions(&producer.pool, "x", 1, n).await?;
    let started = Instant::now();
    while world.stream_messages(&stream).await? < n as u64 {
        ensure!(started.elapsed().as_secs() < 900, "relays did not publish {n} actions in 15 minutes");
        for relay in &mut relays {
            relay.ensure_running()?;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    loop {
        let published: i64 =
            sqlx::query_scalar("SELECT count(*) FROM handoff.outbox_delivery WHERE state = 'published'")
                .fetch_one(&producer.pool)
                .await?;
        if published >= n {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    for relay in relays {
        relay.stop().await?;
    }
    let consumer = world.consumer_database("bench_reconcile_consumer", 4).await?;
    handoff_consumer::SCHEMA.migrate(&consumer.pool).await?;
    sqlx::query(
        r#"WITH keys AS (SELECT $1::text || 'x-' || i AS k, i FROM generate_series(1, $2::bigint) AS i),
                inbox AS (INSERT INTO handoff_consumer.inbox (operation_key, payload_hash, stream_sequence, outcome)
                          SELECT k, repeat('0', 64), i, 'task_created' FROM keys)
           INSERT INTO handoff_consumer.crm_task (operation_key, payload_hash, payload, approved_by)
           SELECT k, repeat('0', 64), '{}'::jsonb, 'user-17' FROM keys"#,
    )
    .bind(workload::KEY_PREFIX)
    .bind(n)
    .execute(&consumer.pool)
    .await?;
    // As a settled production table would be: visibility map set, statistics current. No parallel
    // workers: their shared memory does not fit a container's default 64 MiB /dev/shm at 1M rows.
    for pool in [&producer.pool, &consumer.pool] {
        sqlx::query("VACUUM (ANALYZE, PARALLEL 0)").execute(pool).await?;
    }
    Ok(Filled { producer, consumer, stream, n })
}

/// One reconciliation of everything in `filled`.
pub async fn reconcile(world: &World, filled: &Filled) -> Result<(Sample, ReconcileChecks)> {
    let meter = Meter::start(world, &[]);
    let report = handoff_admin::reconcile::run(
        &filled.producer.pool,
        &world.js,
        &filled.stream,
        &filled.consumer.pool,
        Scope::All,
        None,
    )
    .await?;
    let sample = meter.finish(world, &[], filled.n as u64);
    let checks = ReconcileChecks {
        published_rows_checked: report.published_rows_checked,
        inbox_rows_checked: report.inbox_rows_checked,
        mismatches: report.mismatches.len(),
    };
    Ok((sample, checks))
}

/// The ceiling: every sequence of the stream read once, [`PROBE_CONCURRENCY`] reads in flight.
pub async fn bare_reads(world: &World, filled: &Filled) -> Result<Sample> {
    let stream = world.js.get_stream(&filled.stream).await?;
    let meter = Meter::start(world, &[]);
    let reads = futures::stream::iter((1..=filled.n as u64).map(|sequence| {
        let stream = stream.clone();
        async move { stream.get_raw_message(sequence).await.map(|_| ()) }
    }))
    .buffer_unordered(PROBE_CONCURRENCY);
    let failures = reads.filter(|r| std::future::ready(r.is_err())).count().await;
    ensure!(failures == 0, "{failures} stream reads failed");
    Ok(meter.finish(world, &[], filled.n as u64))
}

/// Drops what [`fill`] made.
pub async fn drop_filled(world: &World, filled: Filled) -> Result<()> {
    world.drop_stream(&filled.stream).await;
    world.drop_database(filled.producer).await?;
    world.drop_database(filled.consumer).await
}
