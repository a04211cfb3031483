//! Many relays and replicas at once, and a broker restart in the middle of a run.

use std::time::Duration;

use handoff_tests::{TestEnv, eventually};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

async fn start_pipeline(
    env: &TestEnv,
    relays: usize,
    replicas: usize,
    token: &CancellationToken,
) -> JoinSet<anyhow::Result<()>> {
    let mut tasks = JoinSet::new();
    for _ in 0..relays {
        let relay = env.relay(env.relay_settings()).await.unwrap();
        tasks.spawn(relay.run_until_stopped(token.clone()));
    }
    for _ in 0..replicas {
        let consumer = env.consumer(env.consumer_settings()).await.unwrap();
        tasks.spawn(consumer.run_until_stopped(token.clone()));
    }
    tasks
}

async fn stop(token: CancellationToken, mut tasks: JoinSet<anyhow::Result<()>>) {
    token.cancel();
    while let Some(result) = tasks.join_next().await {
        result.unwrap().unwrap();
    }
}

#[tokio::test]
async fn two_relays_and_three_replicas_move_ten_thousand_actions_exactly_once() {
    const N: i64 = 10_000;
    let env = TestEnv::start().await.unwrap();
    let token = CancellationToken::new();
    let tasks = start_pipeline(&env, 2, 3, &token).await;
    env.approve_many_via_sql(1, N).await.unwrap();

    // Both ends done: a batch whose PubAck was lost is stored (and consumed) before the relay's
    // retry records it as a duplicate, so tasks can be complete while rows are still pending.
    eventually("10,000 tasks and the outbox drained", Duration::from_secs(300), || async {
        Ok((env.tasks().await? >= N && env.outbox().await?.published == N).then_some(()))
    })
    .await
    .unwrap();
    stop(token, tasks).await;

    let outbox = env.outbox().await.unwrap();
    assert_eq!((outbox.published, outbox.pending, outbox.blocked), (N, 0, 0));
    let counts = env.consumer_counts().await.unwrap();
    assert_eq!((counts.tasks, counts.inbox, counts.reviews, counts.dead_letters), (N, N, 0, 0));
    let distinct: i64 = sqlx::query_scalar("SELECT count(DISTINCT operation_key) FROM handoff_consumer.crm_task")
        .fetch_one(&env.consumer_db)
        .await
        .unwrap();
    assert_eq!(distinct, N);
    assert_eq!(env.stream_messages().await.unwrap(), N as u64);
}

#[tokio::test]
async fn a_nats_restart_in_the_middle_of_a_run_loses_nothing() {
    const HALF: i64 = 2_000;
    let env = TestEnv::start().await.unwrap();
    let token = CancellationToken::new();
    let tasks = start_pipeline(&env, 1, 2, &token).await;
    env.approve_many_via_sql(1, HALF).await.unwrap();
    eventually("the first tasks", Duration::from_secs(120), || async { Ok((env.tasks().await? > 0).then_some(())) })
        .await
        .unwrap();

    env.nats.restart().await.unwrap();
    env.approve_many_via_sql(HALF + 1, HALF).await.unwrap();
    // Both ends done: a commit whose PubAck the restart lost is stored (and consumed) before the
    // relay's retry records the batch as duplicates.
    eventually("every task after the restart and the outbox drained", Duration::from_secs(300), || async {
        Ok((env.tasks().await? >= 2 * HALF && env.outbox().await?.published == 2 * HALF).then_some(()))
    })
    .await
    .unwrap();
    stop(token, tasks).await;

    let outbox = env.outbox().await.unwrap();
    assert_eq!((outbox.published, outbox.pending, outbox.blocked), (2 * HALF, 0, 0));
    let counts = env.consumer_counts().await.unwrap();
    assert_eq!((counts.tasks, counts.inbox, counts.dead_letters), (2 * HALF, 2 * HALF, 0));
    let stored = env.stream_messages().await.unwrap();
    assert!(stored >= 2 * HALF as u64, "{stored} messages in the stream for {} published rows", 2 * HALF);
}
