//! On a three-node JetStream cluster (`sync_interval: always`, R3 streams), the production shape:
//! the real relay and consumer binaries move every action exactly once while the stream leader is
//! killed mid-batch, a node restarts, or the cluster loses quorum for a while.

use std::time::Duration;

use handoff_tests::{ServiceProcess, TestEnv, eventually};

/// Every count that proves exactly once: `n` rows published, `n` messages stored, `n` tasks for
/// `n` distinct keys, nothing held, dead-lettered or left behind.
async fn assert_exactly_once(env: &TestEnv, n: i64) {
    let outbox = env.outbox().await.unwrap();
    assert_eq!((outbox.published, outbox.pending, outbox.blocked), (n, 0, 0));
    assert_eq!(env.stream_messages().await.unwrap(), n as u64, "messages stored in the R3 stream");
    let counts = env.consumer_counts().await.unwrap();
    assert_eq!((counts.tasks, counts.inbox, counts.reviews, counts.dead_letters), (n, n, 0, 0));
    let distinct: i64 = sqlx::query_scalar("SELECT count(DISTINCT operation_key) FROM handoff_consumer.crm_task")
        .fetch_one(&env.consumer_db)
        .await
        .unwrap();
    assert_eq!(distinct, n, "one task per key");
}

async fn until_done(env: &TestEnv, n: i64, what: &str) {
    eventually(what, Duration::from_secs(300), || async {
        Ok((env.tasks().await? >= n && env.outbox().await?.published == n).then_some(()))
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn an_r3_stream_moves_actions_exactly_once_in_atomic_batches_and_dedups_a_repeated_id() {
    const N: i64 = 1_000;
    let env = TestEnv::start_on_cluster().await.unwrap();
    let _relay = env.relay_process_with(&[("HANDOFF_PUBLISH_MODE", "atomic".to_owned())]).unwrap();
    let _consumer = env.consumer_process().unwrap();
    env.approve_many_via_sql(1, N).await.unwrap();
    until_done(&env, N, "every task").await;

    let mut stream = env.js.get_stream(&env.stream).await.unwrap();
    let info = stream.info().await.unwrap();
    let cluster = info.cluster.as_ref().expect("a clustered stream");
    assert_eq!((info.config.num_replicas, cluster.replicas.len()), (3, 2), "a leader and two replicas");
    assert!(info.config.allow_atomic_publish, "the relay provisioned atomic publishing");
    // The broker still dedups a plain publish of a stored id on R3.
    let key = "harbor:create-followup:v1:case-1";
    let ack = env
        .js
        .send_publish(
            env.subjects.for_key(&key.parse().unwrap()),
            async_nats::jetstream::message::PublishMessage::build().payload("again".into()).message_id(key),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(ack.duplicate, "{ack:?}");
    assert_exactly_once(&env, N).await;
}

#[tokio::test]
async fn two_relays_and_three_consumers_lose_and_duplicate_nothing_through_a_leader_kill() {
    const HALF: i64 = 3_000;
    let env = TestEnv::start_on_cluster().await.unwrap();
    let cluster = env.nats.cluster().unwrap();
    let mut services: Vec<ServiceProcess> = Vec::new();
    for _ in 0..2 {
        services.push(env.relay_process_with(&handoff_tests::quick_relay_retries()).unwrap());
    }
    for _ in 0..3 {
        services.push(env.consumer_process().unwrap());
    }
    env.approve_many_via_sql(1, HALF).await.unwrap();
    eventually("the first messages stored", Duration::from_secs(120), || async {
        Ok((env.stream_messages().await.unwrap_or(0) > 200).then_some(()))
    })
    .await
    .unwrap();

    // SIGKILL, no shutdown: batches in flight lose their PubAcks, the relays retry them.
    let leader = cluster.stream_leader(&env.js, &env.stream).await.unwrap();
    let killed = leader.name.clone();
    leader.nats.kill().await.unwrap();
    env.approve_many_via_sql(HALF + 1, HALF).await.unwrap();
    // Two of three nodes are a quorum: everything is published and consumed without the third.
    until_done(&env, 2 * HALF, "every task with the old leader dead").await;
    let new_leader = eventually("a new leader", Duration::from_secs(60), || async {
        Ok(cluster.stream_leader(&env.js, &env.stream).await.ok().map(|n| n.name.clone()))
    })
    .await
    .unwrap();
    assert_ne!(new_leader, killed, "the dead node cannot lead");

    cluster.node(&killed).unwrap().nats.start_again().await.unwrap();
    for service in &mut services {
        assert!(!service.has_exited().unwrap(), "every relay and consumer rode out the leader kill");
    }
    assert_exactly_once(&env, 2 * HALF).await;
}

#[tokio::test]
async fn without_quorum_publishes_wait_and_are_retried_with_the_same_key_until_it_returns() {
    const N: i64 = 300;
    let env = TestEnv::start_on_cluster().await.unwrap();
    let cluster = env.nats.cluster().unwrap();
    let relay = ServiceProcess::spawn_capturing(
        "handoff-relay",
        &[env.service_env_for_relay(), handoff_tests::quick_relay_retries()].concat(),
    )
    .unwrap();
    let _consumer = env.consumer_process().unwrap();
    env.approve_many_via_sql(1, N).await.unwrap();
    until_done(&env, N, "the first tasks").await;

    // Two nodes down: the stream has no leader (publishes meet no responders or time out).
    let leader = cluster.stream_leader(&env.js, &env.stream).await.unwrap().name.clone();
    let follower = cluster.nodes().iter().find(|n| n.name != leader).unwrap();
    follower.nats.stop().await.unwrap();
    cluster.node(&leader).unwrap().nats.kill().await.unwrap();
    env.approve_many_via_sql(N + 1, N).await.unwrap();
    eventually("publishes to fail", Duration::from_secs(120), || async {
        Ok(relay.log_lines().iter().any(|l| l.contains("publishing to the stream failing")).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(env.outbox().await.unwrap().published, N, "nothing is published without a quorum");

    let (a, b) = (cluster.node(&leader).unwrap(), follower);
    tokio::try_join!(a.nats.start_again(), b.nats.start_again()).unwrap();
    until_done(&env, 2 * N, "every task after quorum returned").await;
    eventually("the recovery line", Duration::from_secs(60), || async {
        Ok(relay.log_lines().iter().any(|l| l.contains("publishing to the stream recovered")).then_some(()))
    })
    .await
    .unwrap();
    assert_exactly_once(&env, 2 * N).await;
}

#[tokio::test]
async fn a_restarted_follower_catches_up_and_the_cluster_leads_on_when_the_leader_dies() {
    const N: i64 = 500;
    let env = TestEnv::start_on_cluster().await.unwrap();
    let cluster = env.nats.cluster().unwrap();
    let _relay = env.relay_process_with(&handoff_tests::quick_relay_retries()).unwrap();
    let _consumer = env.consumer_process().unwrap();
    env.approve_many_via_sql(1, N).await.unwrap();
    until_done(&env, N, "the first tasks").await;

    // A follower is away while more is published, then comes back and catches up.
    let leader = cluster.stream_leader(&env.js, &env.stream).await.unwrap().name.clone();
    let away = cluster.nodes().iter().find(|n| n.name != leader).unwrap();
    away.nats.stop().await.unwrap();
    env.approve_many_via_sql(N + 1, N).await.unwrap();
    until_done(&env, 2 * N, "tasks while a follower is away").await;
    away.nats.start_again().await.unwrap();
    eventually("every replica current", Duration::from_secs(120), || async {
        let mut stream = env.js.get_stream(&env.stream).await?;
        let info = stream.info().await?;
        let replicas = info.cluster.clone().map(|c| c.replicas).unwrap_or_default();
        Ok((replicas.len() == 2 && replicas.iter().all(|r| r.current && r.lag.unwrap_or(0) == 0)).then_some(()))
    })
    .await
    .unwrap();

    // Now the leader dies: the cluster leads on with the node that was away.
    cluster.node(&leader).unwrap().nats.kill().await.unwrap();
    env.approve_many_via_sql(2 * N + 1, N).await.unwrap();
    until_done(&env, 3 * N, "tasks after the leader died").await;
    assert_exactly_once(&env, 3 * N).await;
}

/// A retry that races its original on R3 (sent while the leader still replicates the first
/// publish of that id, as a relay's retry after a PubAck timed out in an election can be) is
/// answered 10158 "in process". The relay treats it as a retry like any transient failure (not
/// permanent, counted as `in_process`), and the next retry with the same id answers `duplicate`
/// with the original's sequence: one message per key, whichever answer the race got.
#[tokio::test]
async fn a_retry_racing_its_original_on_r3_is_in_process_and_the_next_retry_is_a_duplicate() {
    use handoff_relay::publisher::{self, Outgoing};
    const PAIRS: usize = 50;
    let env = TestEnv::start_on_cluster().await.unwrap();
    publisher::ensure_stream(&env.js, &env.stream_settings(), false).await.unwrap();
    let keys: Vec<String> = (1..=PAIRS).map(|n| format!("harbor:create-followup:v1:race-{n}")).collect();
    let outgoing = |key: &String| Outgoing {
        subject: env.subjects.for_key(&key.parse().unwrap()),
        key: key.clone(),
        body: "approved".into(),
    };
    // Each key twice, the copy right behind its original: both are sent before any PubAck is read.
    let messages: Vec<Outgoing> = keys.iter().flat_map(|k| [outgoing(k), outgoing(k)]).collect();
    let answers = publisher::publish_pipelined(&env.js, messages).await;

    let mut in_process = 0;
    for (key, pair) in keys.iter().zip(answers.chunks(2)) {
        let original = pair[0].as_ref().unwrap_or_else(|e| panic!("{key}: the original failed: {e:#}"));
        assert!(!original.duplicate, "{key}: the original is stored");
        match &pair[1] {
            Ok(ack) => assert_eq!((ack.duplicate, ack.sequence), (true, original.sequence), "{key}"),
            Err(error) => {
                assert!(publisher::is_id_in_process(error), "{key}: only 10158 may refuse the copy: {error:#}");
                assert!(!publisher::is_permanent(error), "10158 is retried");
                assert_eq!(publisher::failure_class(error), "in_process");
                in_process += 1;
                // The relay's retry: the same id again, answered with the original's sequence.
                let retry = eventually("the retry to be answered", Duration::from_secs(30), || async {
                    let mut answer = publisher::publish_pipelined(&env.js, vec![outgoing(key)]).await;
                    Ok(answer.pop().and_then(Result::ok))
                })
                .await
                .unwrap();
                assert_eq!((retry.duplicate, retry.sequence), (true, original.sequence), "{key}: the retry");
            }
        }
    }
    eprintln!("{in_process} of {PAIRS} copies were answered 10158");
    assert!(in_process > 0, "no copy of {PAIRS} raced its original: the case was not exercised");
    assert_eq!(env.stream_messages().await.unwrap(), PAIRS as u64, "one message per key");
}

/// `--consumer-replicas 1` on an R3 stream keeps the durable's state on one node, as documented:
/// the stream goes on taking every message while that node is down, nothing is delivered until it
/// is back, and then every action is done exactly once.
#[tokio::test]
async fn a_consumer_state_on_one_node_waits_for_that_node_and_then_finishes_exactly_once() {
    const HALF: i64 = 1_000;
    let env = TestEnv::start_on_cluster().await.unwrap();
    let cluster = env.nats.cluster().unwrap();
    let one = [("HANDOFF_CONSUMER_REPLICAS", "1".to_owned())];
    let mut services = vec![env.relay_process_with(&handoff_tests::quick_relay_retries()).unwrap()];
    for _ in 0..2 {
        services.push(env.consumer_process_with(&one).unwrap());
    }
    env.approve_many_via_sql(1, HALF).await.unwrap();
    until_done(&env, HALF, "the first half").await;
    let mut durable: async_nats::jetstream::consumer::PullConsumer =
        env.js.get_consumer_from_stream("crm", &env.stream).await.unwrap();
    let info = durable.info().await.unwrap().clone();
    let placement = info.cluster.as_ref().expect("a clustered consumer");
    assert_eq!((info.config.num_replicas, placement.replicas.len()), (1, 0), "the state on one node");
    let host = placement.leader.clone().expect("the node holding the state");

    cluster.node(&host).unwrap().nats.kill().await.unwrap();
    env.approve_many_via_sql(HALF + 1, HALF).await.unwrap();
    // The R3 stream keeps a quorum without that node: every row is published...
    eventually("every row published", Duration::from_secs(300), || async {
        Ok((env.outbox().await?.published == 2 * HALF).then_some(()))
    })
    .await
    .unwrap();
    // ...and none of them delivered: the first half was done before the kill, the second half was
    // recorded after it, and only the dead node could deliver it.
    assert_eq!(env.tasks().await.unwrap(), HALF, "nothing delivered without the consumer's node");

    cluster.node(&host).unwrap().nats.start_again().await.unwrap();
    until_done(&env, 2 * HALF, "every task once the node is back").await;
    for service in &mut services {
        assert!(!service.has_exited().unwrap(), "every relay and consumer rode out the outage");
    }
    assert_exactly_once(&env, 2 * HALF).await;
}

/// The setting can change on a running deployment: a replica restarted with
/// `--consumer-replicas 1` scales the durable's state down in place, keeping its position, and
/// the actions recorded after that are done once too.
#[tokio::test]
async fn moving_the_consumer_state_to_one_node_keeps_its_position() {
    const HALF: i64 = 500;
    let env = TestEnv::start_on_cluster().await.unwrap();
    let _relay = env.relay_process_with(&handoff_tests::quick_relay_retries()).unwrap();
    let replica = env.consumer_process().unwrap();
    env.approve_many_via_sql(1, HALF).await.unwrap();
    until_done(&env, HALF, "the first half").await;
    let durable: async_nats::jetstream::consumer::PullConsumer =
        env.js.get_consumer_from_stream("crm", &env.stream).await.unwrap();
    let before = durable.get_info().await.unwrap();
    assert_eq!(before.cluster.as_ref().map(|c| c.replicas.len()), Some(2), "the state on three nodes");
    drop(replica);

    let _replica = env.consumer_process_with(&[("HANDOFF_CONSUMER_REPLICAS", "1".to_owned())]).unwrap();
    let info = eventually("the durable on one node", Duration::from_secs(60), || async {
        let info = durable.get_info().await?;
        Ok((info.config.num_replicas == 1 && info.cluster.as_ref().is_some_and(|c| c.replicas.is_empty()))
            .then_some(info))
    })
    .await
    .unwrap();
    assert_eq!(info.ack_floor.stream_sequence, HALF as u64, "the acknowledged position moved with it");
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0), "nothing to deliver again");

    env.approve_many_via_sql(HALF + 1, HALF).await.unwrap();
    until_done(&env, 2 * HALF, "the second half").await;
    assert_exactly_once(&env, 2 * HALF).await;
}
