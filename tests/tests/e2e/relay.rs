//! The relay: outbox rows reach the stream once in effect, whatever fails in between.

use std::sync::atomic::Ordering;
use std::time::Duration;

use handoff_consumer::Handled;
use handoff_tests::{SEED_TITLE, TestEnv, eventually};

const WAIT: Duration = Duration::from_secs(5);

#[tokio::test]
async fn nats_unavailable_at_publish_keeps_the_row_pending_until_it_is_back() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    let consumer = env.consumer(env.consumer_settings()).await.unwrap();
    env.approve("case-104", SEED_TITLE).await.unwrap();

    env.nats.stop().await.unwrap();
    let batch = relay.publish_batch().await.unwrap();
    assert_eq!((batch.claimed, batch.published, batch.retried), (1, 0, 1));
    let outbox = env.outbox().await.unwrap();
    assert_eq!((outbox.pending, outbox.published), (1, 0));
    let last_error: Option<String> =
        sqlx::query_scalar("SELECT last_error FROM handoff.outbox_delivery").fetch_one(&env.producer_db).await.unwrap();
    assert!(last_error.unwrap().contains("publish failed"));

    env.nats.start_again().await.unwrap();
    // The client reconnects on its own; each pass is a real publish attempt.
    eventually("the row to be published after NATS is back", Duration::from_secs(60), || async {
        Ok((relay.publish_batch().await?.published == 1).then_some(()))
    })
    .await
    .unwrap();
    let handled = consumer.fetch_and_handle(WAIT).await.unwrap();
    assert!(matches!(handled.as_slice(), [Handled::Created { .. }]), "{handled:?}");
    assert_eq!(env.stream_messages().await.unwrap(), 1);
    assert_eq!(env.tasks().await.unwrap(), 1);
    assert_eq!(env.outbox().await.unwrap().published, 1);
}

#[tokio::test]
async fn a_lost_puback_is_republished_as_a_jetstream_duplicate_and_makes_one_task() {
    let env = TestEnv::start().await.unwrap();
    // A zero lease stands in for "the dead relay's lease has expired".
    let settings = handoff_relay::RelaySettings { lease: Duration::ZERO, ..env.relay_settings() };
    let dying = env.relay(settings.clone()).await.unwrap();
    env.approve("case-104", SEED_TITLE).await.unwrap();

    dying.faults().crash_after_publish.store(1, Ordering::SeqCst);
    assert!(dying.publish_batch().await.is_err());
    assert_eq!(env.stream_messages().await.unwrap(), 1, "the publish reached the broker");
    assert_eq!(env.outbox().await.unwrap().pending, 1, "but the relay never recorded it");
    drop(dying);

    let restarted = env.relay(settings).await.unwrap();
    let batch = restarted.publish_batch().await.unwrap();
    assert_eq!((batch.published, batch.duplicates), (1, 1));
    let (duplicate, attempts): (Option<bool>, i32) =
        sqlx::query_as("SELECT duplicate, attempts FROM handoff.outbox_delivery")
            .fetch_one(&env.producer_db)
            .await
            .unwrap();
    assert_eq!((duplicate, attempts), (Some(true), 2));
    assert_eq!(env.stream_messages().await.unwrap(), 1);

    let consumer = env.consumer(env.consumer_settings()).await.unwrap();
    consumer.fetch_and_handle(WAIT).await.unwrap();
    assert_eq!(env.tasks().await.unwrap(), 1);
}

#[tokio::test]
async fn a_published_row_is_never_selected_again() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    env.approve("case-104", SEED_TITLE).await.unwrap();
    assert_eq!(relay.publish_batch().await.unwrap().published, 1);
    assert_eq!(relay.publish_batch().await.unwrap().claimed, 0);
    // Re-approving the same action adds nothing to send.
    env.approve("case-104", SEED_TITLE).await.unwrap();
    assert_eq!(relay.publish_batch().await.unwrap().claimed, 0);
    let attempts: i32 =
        sqlx::query_scalar("SELECT attempts FROM handoff.outbox_delivery").fetch_one(&env.producer_db).await.unwrap();
    assert_eq!(attempts, 1);
    assert_eq!(env.stream_messages().await.unwrap(), 1);
}

#[tokio::test]
async fn the_retry_budget_blocks_a_row_that_keeps_failing_and_publishes_nothing() {
    let env = TestEnv::start().await.unwrap();
    let settings = handoff_relay::RelaySettings { max_attempts: 3, ..env.relay_settings() };
    let relay = env.relay(settings).await.unwrap();
    env.approve("case-104", SEED_TITLE).await.unwrap();
    // Every publish fails fast: the stream is gone ("no responders").
    env.js.delete_stream(&env.stream).await.unwrap();

    let outcomes: Vec<(usize, usize)> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            let b = relay.publish_batch().await.unwrap();
            v.push((b.retried, b.blocked));
        }
        v
    };
    assert_eq!(outcomes, [(1, 0), (1, 0), (0, 1)]);
    assert_eq!(relay.publish_batch().await.unwrap().claimed, 0, "blocked rows are not retried");
    let (state, attempts, error): (String, i32, String) =
        sqlx::query_as("SELECT state, attempts, last_error FROM handoff.outbox_delivery")
            .fetch_one(&env.producer_db)
            .await
            .unwrap();
    assert_eq!((state.as_str(), attempts), ("blocked", 3));
    assert!(error.contains("publish failed"), "{error}");

    handoff_relay::publisher::ensure_stream(&env.js, &env.stream_settings(), false).await.unwrap();
    assert_eq!(env.stream_messages().await.unwrap(), 0);
}

#[tokio::test]
async fn repeated_crashes_after_publish_still_end_with_exactly_one_task() {
    let env = TestEnv::start().await.unwrap();
    let settings = handoff_relay::RelaySettings { lease: Duration::ZERO, max_attempts: 3, ..env.relay_settings() };
    let relay = env.relay(settings).await.unwrap();
    let consumer = env.consumer(env.consumer_settings()).await.unwrap();
    env.approve("case-104", SEED_TITLE).await.unwrap();

    relay.faults().crash_after_publish.store(3, Ordering::SeqCst);
    for _ in 0..3 {
        assert!(relay.publish_batch().await.is_err());
    }
    // The fourth claim finds the budget spent: blocked for an operator, not sent again.
    let batch = relay.publish_batch().await.unwrap();
    assert_eq!((batch.claimed, batch.published, batch.blocked), (1, 0, 1));
    let (state, error): (String, String) = sqlx::query_as("SELECT state, last_error FROM handoff.outbox_delivery")
        .fetch_one(&env.producer_db)
        .await
        .unwrap();
    assert_eq!(state, "blocked");
    assert!(error.contains("retry budget exhausted"), "{error}");

    assert_eq!(env.stream_messages().await.unwrap(), 1, "three publishes, one stored message");
    consumer.fetch_and_handle(WAIT).await.unwrap();
    assert_eq!(env.tasks().await.unwrap(), 1);
}

#[tokio::test]
async fn an_existing_stream_keeps_what_handoff_does_not_own_and_its_drifted_settings_are_set_back() {
    use async_nats::jetstream::stream::{Config, DiscardPolicy};
    let env = TestEnv::start().await.unwrap();
    let mut theirs = Config {
        name: env.stream.clone(),
        subjects: vec![env.subjects.all(), format!("audit{}.>", env.stream.to_lowercase())],
        description: Some("owned by the platform team".into()),
        max_messages_per_subject: 1_000,
        allow_direct: true,
        duplicate_window: Duration::from_secs(10),
        discard: DiscardPolicy::Old,
        ..Default::default()
    };
    theirs.max_age = Duration::ZERO;
    env.js.create_stream(theirs).await.unwrap();

    let relay = env.relay(env.relay_settings()).await.unwrap();
    let config = env.js.get_stream(&env.stream).await.unwrap().cached_info().config.clone();
    assert_eq!(config.description.as_deref(), Some("owned by the platform team"));
    assert_eq!(config.subjects.len(), 2, "{:?}", config.subjects);
    assert_eq!((config.max_messages_per_subject, config.allow_direct), (1_000, true));
    assert_eq!((config.discard, config.duplicate_window), (DiscardPolicy::New, env.duplicate_window));
    env.approve("case-104", SEED_TITLE).await.unwrap();
    relay.publish_batch().await.unwrap();
    assert_eq!(env.stream_messages().await.unwrap(), 1);
}

#[tokio::test]
async fn a_stream_the_relay_cannot_fix_in_place_stops_the_binary_with_what_to_do() {
    use async_nats::jetstream::stream::{Config, StorageType};
    let env = TestEnv::start().await.unwrap();
    let memory = Config {
        name: env.stream.clone(),
        subjects: vec![env.subjects.all()],
        storage: StorageType::Memory,
        ..Default::default()
    };
    env.js.create_stream(memory).await.unwrap();
    let out =
        handoff_tests::process::run_binary("handoff-relay", &env.service_env_for_relay(), &[], Duration::from_secs(60))
            .await
            .unwrap();
    assert_ne!(out.code, Some(0));
    let last = out.stderr.lines().last().unwrap_or_default();
    assert!(last.contains("storage") && last.contains("HANDOFF_STREAM_MEMORY"), "{}", out.stderr);
    let config = env.js.get_stream(&env.stream).await.unwrap().cached_info().config.clone();
    assert_eq!(config.storage, StorageType::Memory, "left as it was");
}
