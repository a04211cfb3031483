//! The real binaries, crashed for real (SIGKILL) and stopped as an orchestrator would (SIGTERM).

use std::time::Duration;

use handoff_tests::{TestEnv, eventually};

async fn published(env: &TestEnv) -> anyhow::Result<i64> {
    Ok(env.outbox().await?.published)
}

#[tokio::test]
async fn killing_relay_and_consumer_processes_mid_run_loses_nothing_and_duplicates_nothing() {
    const N: i64 = 20_000;
    let env = TestEnv::start().await.unwrap();
    let mut relay = env.relay_process().unwrap();
    let mut consumers = [env.consumer_process().unwrap(), env.consumer_process().unwrap()];
    // The relay creates the stream; wait for it before loading work so the kill lands mid-run.
    eventually("the stream", Duration::from_secs(60), || async { Ok(env.stream_messages().await.ok()) }).await.unwrap();
    env.approve_many_via_sql(1, N).await.unwrap();

    eventually("the relay to be mid-backlog", Duration::from_secs(60), || async {
        Ok((published(&env).await? > 0).then_some(()))
    })
    .await
    .unwrap();
    relay.kill().await.unwrap();
    consumers[0].kill().await.unwrap();
    let before = env.outbox().await.unwrap();
    eprintln!("killed relay and one replica at {} of {N} published", before.published);
    assert!(before.published < N, "the kill should land before the backlog is drained: {before:?}");

    let _relay = env.relay_process().unwrap();
    let _replacement = env.consumer_process().unwrap();
    // Both ends done: ranges the killed relay had published but not settled are consumed at
    // once, and recorded only when the new relay re-claims them after their lease (the broker
    // reports their re-publish as duplicates), which can come after the last task.
    eventually("every task and the outbox drained", Duration::from_secs(300), || async {
        Ok((env.tasks().await? >= N && env.outbox().await?.published == N).then_some(()))
    })
    .await
    .unwrap();

    let outbox = env.outbox().await.unwrap();
    assert_eq!((outbox.published, outbox.pending, outbox.blocked), (N, 0, 0));
    let counts = env.consumer_counts().await.unwrap();
    assert_eq!((counts.tasks, counts.inbox, counts.reviews, counts.dead_letters), (N, N, 0, 0));
    // Re-publishes of the killed relay's leased rows were broker duplicates, not new messages.
    assert_eq!(env.stream_messages().await.unwrap(), N as u64);
}

#[tokio::test]
async fn a_relay_stopped_with_sigterm_finishes_its_batch_and_leaves_no_row_leased() {
    const N: i64 = 3_000;
    let env = TestEnv::start().await.unwrap();
    let mut relay = env.relay_process().unwrap();
    eventually("the stream", Duration::from_secs(60), || async { Ok(env.stream_messages().await.ok()) }).await.unwrap();
    env.approve_many_via_sql(1, N).await.unwrap();
    eventually("publishing to start", Duration::from_secs(60), || async {
        Ok((published(&env).await? > 0).then_some(()))
    })
    .await
    .unwrap();

    let status = relay.terminate().await.unwrap();
    assert!(status.success(), "relay exited with {status}");
    let leased: i64 = sqlx::query_scalar("SELECT count(*) FROM handoff.outbox WHERE lease_owner IS NOT NULL")
        .fetch_one(&env.producer_db)
        .await
        .unwrap();
    assert_eq!(leased, 0, "a drained relay leaves no claimed-but-unmarked rows");
    // Everything it marked published is in the stream, and nothing else is.
    assert_eq!(env.stream_messages().await.unwrap(), published(&env).await.unwrap() as u64);
}

#[tokio::test]
async fn a_consumer_stopped_with_sigterm_exits_cleanly_and_another_finishes_the_work_once() {
    const N: i64 = 20_000;
    let env = TestEnv::start().await.unwrap();
    let _relay = env.relay_process().unwrap();
    eventually("the stream", Duration::from_secs(60), || async { Ok(env.stream_messages().await.ok()) }).await.unwrap();
    let mut consumer = env.consumer_process().unwrap();
    env.approve_many_via_sql(1, N).await.unwrap();
    eventually("the first tasks", Duration::from_secs(60), || async { Ok((env.tasks().await? > 0).then_some(())) })
        .await
        .unwrap();

    let status = consumer.terminate().await.unwrap();
    assert!(status.success(), "consumer exited with {status}");
    let _next = env.consumer_process().unwrap();
    eventually("every task", Duration::from_secs(300), || async { Ok((env.tasks().await? >= N).then_some(())) })
        .await
        .unwrap();
    let counts = env.consumer_counts().await.unwrap();
    assert_eq!((counts.tasks, counts.inbox, counts.dead_letters), (N, N, 0));
}
