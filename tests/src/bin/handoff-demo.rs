//! The main job, end to end: starts Postgres and NATS (testcontainers, local images), runs the relay
//! and the consumer, and pushes seed 000's lost-reply scenario through both the naive baseline and
//! the handoff path. Prints a report and writes it as JSON (`--json PATH`); exits non-zero unless
//! the CHECK holds (naive: 2 tasks, handoff: 1 task).

use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Result, ensure};
use handoff_consumer::crm::{Crm, TaskRequest};
use handoff_consumer::{Handled, LocalCrm};
use handoff_relay::RelaySettings;
use handoff_tests::{SEED_TITLE, TestEnv};
use serde_json::json;

const KEY: &str = "harbor:create-followup:v1:case-104";

#[derive(Debug, serde::Serialize)]
struct Step {
    step: &'static str,
    result: String,
    crm_tasks: i64,
    outbox_attempts: i32,
    stream_messages: u64,
    task_id: Option<i64>,
}

#[tokio::main]
async fn main() -> Result<()> {
    let json_path = std::env::args().skip_while(|a| a != "--json").nth(1);
    // Injected crashes log warnings by design, and clients log reconnect errors while the
    // containers are removed at exit: keep the report readable unless RUST_LOG asks for more.
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "error,async_nats=off".into());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    eprintln!("starting Postgres and NATS containers...");
    let env = TestEnv::start().await?;

    // The naive baseline: the same approved follow-up, sent with a fresh id per attempt, and the
    // first reply lost. The CRM cannot tell the retry from a new request.
    let naive_db = sqlx::PgPool::connect(&env.postgres.fresh_database("naive").await?).await?;
    handoff_consumer::SCHEMA.migrate(&naive_db).await?;
    for attempt in 1..=2 {
        let request = TaskRequest {
            operation_key: format!("naive-attempt-{attempt}-{:x}", rand_id()),
            payload_hash: "0".repeat(64),
            payload: json!({"case_id": "case-104", "title": SEED_TITLE}),
            approved_by: "user-17".into(),
            traceparent: None,
        };
        let mut tx = naive_db.begin().await?;
        LocalCrm.create_tasks(&mut tx, &[request]).await?;
        tx.commit().await?;
        // Attempt 1's reply is "lost": the sender sees a timeout and retries.
    }
    let naive_tasks: i64 =
        sqlx::query_scalar("SELECT count(*) FROM handoff_consumer.crm_task").fetch_one(&naive_db).await?;

    // The handoff path: approval + outbox in one transaction, stable key end to end.
    let mut steps = Vec::new();
    env.approve("case-104", SEED_TITLE).await?;
    // A zero lease stands in for "the crashed relay's lease has expired".
    let settings = RelaySettings { lease: Duration::ZERO, ..env.relay_settings() };
    let relay = env.relay(settings.clone()).await?;
    let consumer = env.consumer(env.consumer_settings()).await?;
    steps.push(snapshot(&env, "approved_and_recorded", "pending".into()).await?);

    relay.faults().crash_after_publish.store(1, Ordering::SeqCst);
    let lost = relay.publish_batch().await;
    steps.push(snapshot(&env, "relay_puback_lost", format!("relay died: {}", lost.is_err())).await?);

    let restarted = env.relay(settings).await?;
    let batch = restarted.publish_batch().await?;
    steps.push(
        snapshot(&env, "relay_republished", format!("published, broker duplicate: {}", batch.duplicates == 1)).await?,
    );

    consumer.faults().crash_after_commit.store(1, Ordering::SeqCst);
    consumer.fetch_and_handle(Duration::from_secs(5)).await?;
    steps.push(snapshot(&env, "consumer_ack_lost", "task committed, ack never sent".into()).await?);

    let replica = env.consumer(env.consumer_settings()).await?;
    let mut redelivered = Vec::new();
    for _ in 0..20 {
        redelivered = replica.fetch_and_handle(Duration::from_secs(2)).await?;
        if !redelivered.is_empty() {
            break;
        }
    }
    let result = match redelivered.as_slice() {
        [Handled::Duplicate { .. }] => "redelivered, recognized as duplicate".to_string(),
        other => format!("unexpected: {other:?}"),
    };
    steps.push(snapshot(&env, "consumer_redelivery", result).await?);
    steps.push(
        snapshot(&env, "run_again", format!("relay claimed {}", restarted.publish_batch().await?.claimed)).await?,
    );

    let handoff_tasks = env.tasks().await?;
    let report = json!({
        "fictional_business": "Harbor Service",
        "operation_key": KEY,
        "naive_baseline": {"attempts": 2, "crm_tasks": naive_tasks},
        "handoff": {"crm_tasks": handoff_tasks, "stream_messages": env.stream_messages().await?, "steps": steps},
    });

    println!("Seed 000 lost-reply scenario on Postgres + NATS JetStream");
    println!("operation key: {KEY}\n");
    println!("naive baseline (new id per attempt, first reply lost): {naive_tasks} CRM tasks\n");
    println!(
        "{:<24} {:<42} {:>9} {:>9} {:>8} {:>8}",
        "handoff step", "result", "crm tasks", "attempts", "stream", "task id"
    );
    for s in &steps {
        let task = s.task_id.map_or("-".to_string(), |t| t.to_string());
        println!(
            "{:<24} {:<42} {:>9} {:>9} {:>8} {:>8}",
            s.step, s.result, s.crm_tasks, s.outbox_attempts, s.stream_messages, task
        );
    }
    let pass = naive_tasks == 2 && handoff_tasks == 1;
    println!(
        "\nCHECK naive_tasks={naive_tasks} (expect 2) handoff_tasks={handoff_tasks} (expect 1): {}",
        if pass { "PASS" } else { "FAIL" }
    );
    if let Some(path) = json_path {
        std::fs::write(&path, serde_json::to_vec_pretty(&report)?)?;
        println!("report written to {path}");
    }
    ensure!(pass, "the handoff did not hold: see the report");
    Ok(())
}

async fn snapshot(env: &TestEnv, step: &'static str, result: String) -> Result<Step> {
    let attempts: i32 = sqlx::query_scalar("SELECT attempts FROM handoff.outbox_delivery WHERE operation_key = $1")
        .bind(KEY)
        .fetch_one(&env.producer_db)
        .await?;
    let task_id: Option<i64> =
        sqlx::query_scalar("SELECT task_id FROM handoff_consumer.crm_task WHERE operation_key = $1")
            .bind(KEY)
            .fetch_optional(&env.consumer_db)
            .await?;
    Ok(Step {
        step,
        result,
        crm_tasks: env.tasks().await?,
        outbox_attempts: attempts,
        stream_messages: env.stream_messages().await?,
        task_id,
    })
}

fn rand_id() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::Instant::now())
}
