//! The retention soak: a steady load of many actions through the whole pipeline with a short
//! retention, sampling the producer tables' size, dead rows and the longest relay or consumer
//! transaction. Bounded sizes and short transactions are the claim; the samples are the evidence.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::report::{Soak, SoakSample};
use crate::system::Pipeline;
use crate::workload;
use crate::world::World;

/// How often the soak samples sizes.
const EVERY: Duration = Duration::from_secs(5);

/// Runs `actions` actions at `rate` per second with the relay's retention at `retention_s`.
pub async fn soak(
    world: &mut World,
    actions: i64,
    rate: f64,
    retention_s: u64,
    relays: usize,
    replicas: usize,
) -> Result<Soak> {
    let extra = [("HANDOFF_RELAY_RETENTION_SECS", retention_s.to_string())];
    let mut pipeline = Pipeline::start(world, relays, replicas, &extra).await?;
    let batch = pipeline.next_batch();
    let duration = Duration::from_secs_f64(actions as f64 / rate);
    let mut producer = {
        let pool = pipeline.producer.pool.clone();
        tokio::spawn(async move { workload::offer_load(&pool, &batch, rate, duration).await })
    };
    let started = Instant::now();
    let mut samples = Vec::new();
    // Sample through the load, then for two retention periods after it, to see the tables shrink.
    // The producer records what fits in the duration (about `actions`): drained means every
    // action it recorded has been delivered.
    let mut recorded: Option<i64> = None;
    let mut drained_at: Option<Instant> = None;
    loop {
        tokio::time::sleep(EVERY).await;
        let sample = sample(world, &pipeline, started).await?;
        tracing::info!(?sample, "soak");
        let tasks = sample.tasks;
        samples.push(sample);
        if recorded.is_none() && producer.is_finished() {
            recorded = Some((&mut producer).await??);
        }
        if drained_at.is_none() && recorded.is_some_and(|r| tasks >= r) {
            drained_at = Some(Instant::now());
        }
        if drained_at.is_some_and(|at| at.elapsed() > Duration::from_secs(2 * retention_s + 10)) {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < duration * 3 + Duration::from_secs(600),
            "soak stuck: {tasks} delivered of {recorded:?} recorded"
        );
    }
    let recorded = recorded.unwrap_or_default();
    let counts: (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT operation_key) FROM handoff_consumer.crm_task")
            .fetch_one(&pipeline.consumer.pool)
            .await?;
    let blocked: i64 = sqlx::query_scalar("SELECT count(*) FROM handoff.outbox WHERE state = 'blocked'")
        .fetch_one(&pipeline.producer.pool)
        .await?;
    let mut checks = BTreeMap::new();
    checks.insert("recorded".to_owned(), recorded.into());
    checks.insert("tasks".to_owned(), counts.0.into());
    checks.insert("distinct_task_keys".to_owned(), counts.1.into());
    checks.insert("blocked".to_owned(), blocked.into());
    pipeline.stop(world).await?;
    Ok(Soak { actions: recorded, offered_per_s: rate, retention_s, samples, checks })
}

async fn sample(world: &World, pipeline: &Pipeline, started: Instant) -> Result<SoakSample> {
    let (outbox_rows, outbox_bytes, approved_bytes, dead): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM handoff.outbox),
                pg_total_relation_size('handoff.outbox'),
                pg_total_relation_size('handoff.approved_action'),
                (SELECT n_dead_tup FROM pg_stat_user_tables WHERE schemaname = 'handoff' AND relname = 'outbox')",
    )
    .fetch_one(&pipeline.producer.pool)
    .await?;
    let longest: f64 = sqlx::query_scalar(
        "SELECT coalesce(max(extract(epoch FROM now() - xact_start)), 0)::float8 FROM pg_stat_activity
          WHERE application_name IN ('handoff-relay', 'handoff-consumer') AND xact_start IS NOT NULL",
    )
    .fetch_one(&pipeline.producer.pool)
    .await?;
    let tasks = world.consumer_info(&pipeline.durable, &pipeline.stream).await?.ack_floor.stream_sequence as i64;
    Ok(SoakSample {
        elapsed_s: started.elapsed().as_secs_f64(),
        tasks,
        outbox_rows,
        outbox_mib: outbox_bytes as f64 / (1024.0 * 1024.0),
        approved_action_mib: approved_bytes as f64 / (1024.0 * 1024.0),
        outbox_dead_rows: dead,
        longest_xact_s: longest,
    })
}
