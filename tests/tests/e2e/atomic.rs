//! Atomic batch publishing (ADR-50): a claimed batch is committed as one atomic batch, each row's
//! stream sequence derived from the commit's PubAck; a batch holding an id the broker already
//! stored is rejected whole (10201) and published again message by message, exactly once.

use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::jetstream::message::PublishMessage;
use handoff_relay::metrics::WayLabel;
use handoff_relay::publisher::{self, Outgoing, PublishMode};
use handoff_relay::{RelaySettings, auto_mode};
use handoff_tests::{TestEnv, eventually};

#[tokio::test]
async fn a_backlog_goes_out_in_atomic_batches_with_every_rows_sequence_right() {
    let env = TestEnv::start().await.unwrap();
    env.approve_many_via_sql(1, 2_500).await.unwrap();
    // One claim of 2,500 rows: three atomic batches (1,000 + 1,000 + 500) in flight together.
    let settings = RelaySettings { publish_mode: PublishMode::Atomic, batch_size: 2_500, ..env.relay_settings() };
    let relay = env.relay(settings).await.unwrap();
    assert_eq!(relay.publish_mode(), PublishMode::Atomic);
    let info = env.js.get_stream(&env.stream).await.unwrap().cached_info().clone();
    assert!(info.config.allow_atomic_publish, "the relay turned atomic batches on");
    let mut batches = 0;
    while env.outbox().await.unwrap().published < 2_500 {
        let batch = relay.publish_batch().await.unwrap();
        assert_eq!(batch.duplicates, 0);
        batches += 1;
        assert!(batches < 20, "no progress");
    }
    assert_eq!(env.stream_messages().await.unwrap(), 2_500);
    assert_eq!(env.published_sequences_match_the_stream().await.unwrap(), 2_500);
    assert_eq!(relay.metrics().atomic_batches.get(), 3, "1,000 + 1,000 + 500");
    assert_eq!(relay.metrics().atomic_fallbacks.get(), 0);

    let consumer = env.consumer(env.consumer_settings()).await.unwrap();
    eventually("2,500 tasks", Duration::from_secs(60), || async {
        consumer.fetch_and_handle(Duration::from_secs(1)).await?;
        Ok((env.tasks().await? == 2_500).then_some(()))
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_batch_holding_ids_the_broker_stored_is_published_per_message_with_their_duplicates() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(RelaySettings { publish_mode: PublishMode::Atomic, ..env.relay_settings() }).await.unwrap();
    let message = |i: usize| Outgoing {
        subject: format!("{}.harbor.create-followup", env.subjects.prefix()),
        key: format!("harbor:create-followup:v1:case-{i}"),
        body: format!("{{\"n\":{i}}}").into(),
    };
    // Ten of the thirty ids are already stored (another relay's publish whose PubAck was lost).
    let mut earlier = Vec::new();
    for i in (0..30).step_by(3) {
        let m = message(i);
        let ack = env
            .js
            .send_publish(m.subject.clone(), PublishMessage::build().payload(m.body).message_id(&m.key))
            .await
            .unwrap()
            .await
            .unwrap();
        earlier.push((i, ack.sequence));
    }
    let outcome = publisher::publish_atomic(&env.js, "test-batch", (0..30).map(message).collect()).await;
    assert_eq!((outcome.committed, outcome.fallbacks), (0, 1), "refused whole, then per message");
    let results = outcome.results;
    assert_eq!(results.len(), 30);
    for (i, result) in results.iter().enumerate() {
        let ack = result.as_ref().unwrap();
        match earlier.iter().find(|(n, _)| *n == i) {
            Some((_, sequence)) => assert!(ack.duplicate && ack.sequence == *sequence, "{i}: {ack:?}"),
            None => assert!(!ack.duplicate, "{i}: {ack:?}"),
        }
    }
    assert_eq!(env.stream_messages().await.unwrap(), 30, "10 earlier + 20 new, none twice");
    drop(relay);
}

#[tokio::test]
async fn a_lost_commit_ack_is_settled_by_the_retry_without_a_second_copy() {
    let env = TestEnv::start().await.unwrap();
    let settings = RelaySettings { publish_mode: PublishMode::Atomic, lease: Duration::ZERO, ..env.relay_settings() };
    let relay = env.relay(settings).await.unwrap();
    env.approve_many_via_sql(1, 300).await.unwrap();
    // The batch is committed, then the relay "dies" before recording it: the rows stay leased.
    relay.faults().crash_after_publish.store(1, Ordering::SeqCst);
    assert!(relay.publish_batch().await.is_err());
    assert_eq!(env.stream_messages().await.unwrap(), 300);
    env.approve_many_via_sql(301, 200).await.unwrap();
    // The re-claimed range is all known ids: rejected whole (10201), then published per message
    // as duplicates; the new rows go out as an atomic batch.
    let mut duplicates = 0;
    while env.outbox().await.unwrap().published < 500 {
        duplicates += relay.publish_batch().await.unwrap().duplicates;
    }
    assert_eq!(duplicates, 300);
    let fallbacks = relay.metrics().atomic_fallbacks.get();
    assert_eq!(fallbacks, 1, "the re-claimed range was one batch refused whole");
    assert_eq!(env.stream_messages().await.unwrap(), 500);
    assert_eq!(env.published_sequences_match_the_stream().await.unwrap(), 500);
    let consumer = env.consumer(env.consumer_settings()).await.unwrap();
    eventually("500 tasks", Duration::from_secs(60), || async {
        consumer.fetch_and_handle(Duration::from_secs(1)).await?;
        Ok((env.tasks().await? == 500).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(env.consumer_counts().await.unwrap().inbox, 500);
}

#[tokio::test]
async fn pipelined_mode_leaves_the_stream_without_atomic_batches_and_still_publishes_once() {
    let env = TestEnv::start().await.unwrap();
    let relay =
        env.relay(RelaySettings { publish_mode: PublishMode::Pipelined, ..env.relay_settings() }).await.unwrap();
    assert_eq!(relay.publish_mode(), PublishMode::Pipelined);
    let info = env.js.get_stream(&env.stream).await.unwrap().cached_info().clone();
    assert!(!info.config.allow_atomic_publish);
    env.approve_many_via_sql(1, 1_200).await.unwrap();
    while env.outbox().await.unwrap().published < 1_200 {
        relay.publish_batch().await.unwrap();
    }
    assert_eq!(env.stream_messages().await.unwrap(), 1_200);
    assert_eq!(env.published_sequences_match_the_stream().await.unwrap(), 1_200);
}

#[tokio::test]
async fn auto_times_small_and_full_claims_both_ways_each_class_apart() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(RelaySettings { publish_mode: PublishMode::Auto, ..env.relay_settings() }).await.unwrap();
    assert_eq!(relay.publish_mode(), PublishMode::Atomic, "2.15 allows atomic batches");
    let small = auto_mode::AUTO_ATOMIC_MIN_ROWS as i64 - 1;
    env.approve_many_via_sql(1, small).await.unwrap();
    assert_eq!(relay.publish_batch().await.unwrap().published, small as usize);
    assert_eq!(relay.metrics().atomic_batches.get(), 0, "a first small claim goes out pipelined");
    // Pipelined has been timed: the next small claim is the one atomic trial (auto_mode), and
    // the one after goes whichever way was faster (either way, each row is stored once).
    env.approve_many_via_sql(small + 1, 10).await.unwrap();
    assert_eq!(relay.publish_batch().await.unwrap().published, 10);
    assert_eq!(relay.metrics().atomic_batches.get(), 1, "the trial is one atomic batch");
    env.approve_many_via_sql(small + 11, 10).await.unwrap();
    assert_eq!(relay.publish_batch().await.unwrap().published, 10);
    let before_full = relay.metrics().atomic_batches.get();

    let ways = |way: &'static str| relay.metrics().claims_published.get_or_create(&WayLabel { way }).get();
    let (pipelined, atomic) = (ways("pipelined"), ways("atomic"));
    assert!(pipelined >= 1 && atomic >= 1 && pipelined + atomic == 3, "{pipelined} pipelined, {atomic} atomic");

    // Full claims are timed apart from small ones: the first goes out as an atomic batch (where
    // pipelined would cost a broker that fsyncs each message a thousand fsyncs), the second is
    // the pipelined screen on its first rows only, the rest one atomic batch; the third goes
    // pipelined whole if the screen came out within the margin (a whole trial), else atomic, and
    // each row is stored once either way.
    let recorded = small + 20;
    env.approve_many_via_sql(recorded + 1, 1_000).await.unwrap();
    assert_eq!(relay.publish_batch().await.unwrap().published, 1_000);
    assert_eq!(relay.metrics().atomic_batches.get(), before_full + 1, "a first full claim is one atomic batch");
    assert_eq!(ways("pipelined_first"), 0);
    env.approve_many_via_sql(recorded + 1_001, 1_000).await.unwrap();
    assert_eq!(relay.publish_batch().await.unwrap().published, 1_000);
    assert_eq!(ways("pipelined_first"), 1, "the full claims' trial");
    assert_eq!(relay.metrics().atomic_batches.get(), before_full + 2, "the rest of the trial's claim, atomic");
    env.approve_many_via_sql(recorded + 2_001, 1_000).await.unwrap();
    let (pipelined, atomic) = (ways("pipelined"), ways("atomic"));
    assert_eq!(relay.publish_batch().await.unwrap().published, 1_000);
    assert_eq!(ways("pipelined") + ways("atomic"), pipelined + atomic + 1, "the third, whole either way");
    assert_eq!(relay.metrics().atomic_fallbacks.get(), 0);
    let total = recorded + 3_000;
    assert_eq!(env.stream_messages().await.unwrap(), total as u64);
    assert_eq!(env.published_sequences_match_the_stream().await.unwrap(), total as usize);
}

#[tokio::test]
async fn on_a_server_before_2_15_auto_publishes_pipelined_and_atomic_still_works() {
    let env = TestEnv::start().await.unwrap();
    let image = std::env::var("HANDOFF_NATS_OLD_IMAGE").unwrap_or_else(|_| "handoff-test/nats:2.14.6".into());
    let old = handoff_tests::Nats::start_image(&image).await.unwrap();
    let old_js = async_nats::jetstream::new(async_nats::connect(old.url()).await.unwrap());
    let relay_on = |mode: PublishMode, stream: String| {
        let (env, old) = (&env, &old);
        async move {
            let pool = sqlx::PgPool::connect(&env.relay_url()).await.unwrap();
            let client = async_nats::connect(old.url()).await.unwrap();
            assert!(client.server_info().version.starts_with("2.14"), "{}", client.server_info().version);
            let settings = RelaySettings { publish_mode: mode, ..env.relay_settings() };
            handoff_relay::Relay::build(
                pool,
                client,
                handoff_relay::StreamSettings { name: stream, ..env.stream_settings() },
                settings,
            )
            .await
            .unwrap()
        }
    };
    let auto = relay_on(PublishMode::Auto, env.stream.clone()).await;
    assert_eq!(auto.publish_mode(), PublishMode::Pipelined, "2.14 does not coalesce atomic syncs");
    let info = old_js.get_stream(&env.stream).await.unwrap().cached_info().clone();
    assert!(!info.config.allow_atomic_publish);
    env.approve_many_via_sql(1, 500).await.unwrap();
    while env.outbox().await.unwrap().published < 500 {
        auto.publish_batch().await.unwrap();
    }
    assert_eq!(old_js.get_stream(&env.stream).await.unwrap().info().await.unwrap().state.messages, 500);

    // Asked for explicitly, atomic batches work on 2.14 too (2.12+): the relay turns them on.
    let atomic = relay_on(PublishMode::Atomic, env.stream.clone()).await;
    assert_eq!(atomic.publish_mode(), PublishMode::Atomic);
    assert!(old_js.get_stream(&env.stream).await.unwrap().cached_info().config.allow_atomic_publish);
    env.approve_many_via_sql(501, 700).await.unwrap();
    while env.outbox().await.unwrap().published < 1_200 {
        atomic.publish_batch().await.unwrap();
    }
    assert_eq!(atomic.metrics().atomic_fallbacks.get(), 0);
    assert!(atomic.metrics().atomic_batches.get() >= 1);
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT operation_key, stream_sequence FROM handoff.outbox_delivery WHERE state = 'published'")
            .fetch_all(&env.producer_db)
            .await
            .unwrap();
    let stream = old_js.get_stream(&env.stream).await.unwrap();
    assert_eq!(stream.cached_info().state.messages, 1_200);
    for (key, sequence) in rows {
        let message = stream.get_raw_message(sequence as u64).await.unwrap();
        assert_eq!(message.headers.get(handoff_shared::headers::MSG_ID).map(|v| v.as_str()), Some(key.as_str()));
    }
    drop(auto);
}
