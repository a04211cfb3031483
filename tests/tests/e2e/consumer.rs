//! The consumer: one task per operation key, whatever the broker delivers.

use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::jetstream::message::PublishMessage;
use futures::StreamExt;
use handoff_consumer::Handled;
use handoff_consumer::crm::{Crm, TaskOutcome};
use handoff_tests::{SEED_TITLE, TestEnv, eventually};

const WAIT: Duration = Duration::from_secs(5);

/// Re-publishes the stream's first message, same id and bytes, until the broker stores it again
/// instead of answering "duplicate" (the test's short duplicate window has passed): a condition
/// awaited, not a sleep.
async fn republish_first_message_until_stored(env: &TestEnv) {
    let first = env.js.get_stream(&env.stream).await.unwrap().get_raw_message(1).await.unwrap();
    eventually("the broker to forget the message id", Duration::from_secs(30), || async {
        let ack = env
            .js
            .send_publish(
                first.subject.clone(),
                // The relay's own headers; not the Nats-Batch-* ones an atomic batch left on it
                // (with them this publish would be an atomic batch the broker refuses as a duplicate).
                PublishMessage::build()
                    .payload(first.payload.clone())
                    .message_id(first.headers.get(handoff_shared::headers::MSG_ID).unwrap().as_str())
                    .header(handoff_shared::headers::CONTENT_TYPE, handoff_shared::headers::CLOUDEVENTS_JSON),
            )
            .await?
            .await?;
        Ok((!ack.duplicate).then_some(()))
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_consumer_dying_after_its_commit_and_before_its_ack_creates_no_second_task() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    env.approve("case-104", SEED_TITLE).await.unwrap();
    relay.publish_batch().await.unwrap();

    let dying = env.consumer(env.consumer_settings()).await.unwrap();
    dying.faults().crash_after_commit.store(1, Ordering::SeqCst);
    assert!(dying.fetch_and_handle(WAIT).await.unwrap().is_empty(), "crashed before acking");
    assert_eq!(env.tasks().await.unwrap(), 1);
    drop(dying);

    // ack_wait (1 s in tests) passes and the message is redelivered to another replica.
    let other = env.consumer(env.consumer_settings()).await.unwrap();
    let handled = eventually("the redelivery", Duration::from_secs(30), || async {
        let handled = other.fetch_and_handle(Duration::from_secs(2)).await?;
        Ok((!handled.is_empty()).then_some(handled))
    })
    .await
    .unwrap();
    assert_eq!(handled, [Handled::Duplicate { operation_key: "harbor:create-followup:v1:case-104".into() }]);
    assert_eq!(env.tasks().await.unwrap(), 1);
    assert_eq!(env.consumer_counts().await.unwrap().inbox, 1);
}

/// A replica does not wait for each ack's confirmation, but its batch's acks are written to its
/// connection before the batch counts as handled: a replica dropped right after its batch (its
/// connection closed, nothing left to send them) leaves nothing to redeliver.
#[tokio::test]
async fn a_replica_dropped_right_after_its_batch_has_delivered_its_acks() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    for case in ["case-104", "case-105", "case-106"] {
        env.approve(case, SEED_TITLE).await.unwrap();
    }
    assert_eq!(relay.publish_batch().await.unwrap().published, 3);

    let first = env.consumer(env.consumer_settings()).await.unwrap();
    let handled = first.fetch_and_handle(WAIT).await.unwrap();
    assert_eq!(handled.len(), 3);
    assert!(handled.iter().all(|h| matches!(h, Handled::Created { .. })), "{handled:?}");
    drop(first);

    // Three times ack_wait (1 s in tests): a message whose ack never reached the server is
    // redelivered within this fetch. The durable's state, read on another connection afterwards,
    // has had those seconds to take every ack in.
    let other = env.consumer(env.consumer_settings()).await.unwrap();
    assert_eq!(other.fetch_and_handle(Duration::from_secs(3)).await.unwrap(), []);
    let durable = env.subscription().durable_name;
    let mut consumer: async_nats::jetstream::consumer::PullConsumer =
        env.js.get_consumer_from_stream(&durable, &env.stream).await.unwrap();
    let info = consumer.info().await.unwrap();
    assert_eq!((info.num_ack_pending, info.num_redelivered, info.num_pending), (0, 0, 0));
    assert_eq!(env.tasks().await.unwrap(), 3);
}

/// A batch in hand when NATS goes away is still finished: its acks wait for the connection only
/// a bounded time (they come back as redeliveries the inbox absorbs), so the loop, its heartbeat
/// and a shutdown are not held for the length of the outage.
#[tokio::test]
async fn a_batch_in_hand_when_nats_goes_away_is_finished_without_waiting_for_the_outage() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    env.approve("case-104", SEED_TITLE).await.unwrap();
    assert_eq!(relay.publish_batch().await.unwrap().published, 1);
    let replica = env.consumer(env.consumer_settings()).await.unwrap();
    let durable: async_nats::jetstream::consumer::PullConsumer =
        env.js.get_consumer_from_stream(&env.subscription().durable_name, &env.stream).await.unwrap();
    let mut fetched = durable.fetch().max_messages(10).expires(WAIT).messages().await.unwrap();
    let mut messages = Vec::new();
    while let Some(message) = fetched.next().await {
        messages.push(message.unwrap());
    }
    assert_eq!(messages.len(), 1);

    env.nats.stop().await.unwrap();
    // Not a duration being measured: a bound that tells a finished batch from one waiting for a
    // broker that does not come back in this test.
    let handled = tokio::time::timeout(Duration::from_secs(60), replica.handle_batch(messages))
        .await
        .expect("the batch waited for the outage");
    assert!(matches!(handled.as_slice(), [Handled::Created { .. }]), "{handled:?}");
    assert_eq!(env.tasks().await.unwrap(), 1);
}

#[tokio::test]
async fn a_crm_store_holding_different_content_for_the_key_records_a_conflict_and_no_second_task() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    let consumer = env.consumer(env.consumer_settings()).await.unwrap();
    env.seed_task_with_other_content("harbor:create-followup:v1:case-104").await.unwrap();
    env.approve("case-104", SEED_TITLE).await.unwrap();
    relay.publish_batch().await.unwrap();

    let handled = consumer.fetch_and_handle(WAIT).await.unwrap();
    assert!(matches!(handled.as_slice(), [Handled::Conflict { .. }]), "{handled:?}");
    let counts = env.consumer_counts().await.unwrap();
    assert_eq!((counts.tasks, counts.reviews), (1, 1));
    let outcome: String =
        sqlx::query_scalar("SELECT outcome FROM handoff_consumer.inbox").fetch_one(&env.consumer_db).await.unwrap();
    assert_eq!(outcome, "conflict");
    // Terminated, not redelivered: nothing more arrives.
    assert!(consumer.fetch_and_handle(Duration::from_secs(2)).await.unwrap().is_empty());
}

#[tokio::test]
async fn a_crm_store_already_holding_the_same_task_is_a_duplicate_recorded_as_task_existed() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    let consumer = env.consumer(env.consumer_settings()).await.unwrap();
    env.approve("case-104", SEED_TITLE).await.unwrap();
    env.approve("case-105", SEED_TITLE).await.unwrap();
    // The CRM already holds case-104 with exactly the approved content (e.g. an inbox restored
    // from an older backup than the CRM store).
    let (payload, hash): (serde_json::Value, String) = sqlx::query_as(
        "SELECT payload, payload_hash FROM handoff.approved_action WHERE operation_key = 'harbor:create-followup:v1:case-104'",
    )
    .fetch_one(&env.producer_db)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO handoff_consumer.crm_task (operation_key, payload_hash, payload, approved_by)
         VALUES ('harbor:create-followup:v1:case-104', $1, $2, 'someone')",
    )
    .bind(&hash)
    .bind(&payload)
    .execute(&env.consumer_db)
    .await
    .unwrap();
    relay.publish_batch().await.unwrap();

    let mut handled = Vec::new();
    while handled.len() < 2 {
        let batch = consumer.fetch_and_handle(WAIT).await.unwrap();
        assert!(!batch.is_empty(), "both messages arrive; got {handled:?}");
        handled.extend(batch);
    }
    assert!(handled.iter().any(|h| matches!(h, Handled::Duplicate { .. })), "{handled:?}");
    assert!(handled.iter().any(|h| matches!(h, Handled::Created { .. })), "{handled:?}");
    let counts = env.consumer_counts().await.unwrap();
    assert_eq!((counts.inbox, counts.tasks, counts.reviews), (2, 2, 0));
    // The usual outcome is written with the arrival; only the exception is corrected.
    let outcomes: Vec<(String, String)> =
        sqlx::query_as("SELECT operation_key, outcome FROM handoff_consumer.inbox ORDER BY operation_key")
            .fetch_all(&env.consumer_db)
            .await
            .unwrap();
    assert_eq!(
        outcomes,
        [
            ("harbor:create-followup:v1:case-104".to_owned(), "task_existed".to_owned()),
            ("harbor:create-followup:v1:case-105".to_owned(), "task_created".to_owned()),
        ]
    );
}

/// Payloads near the size limit: one pull stops at its byte limit, well before a batch of
/// messages, and the pulls that follow take the rest, each once.
#[tokio::test]
async fn a_pull_of_large_payloads_stops_at_its_byte_limit_and_the_next_pulls_take_the_rest() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    let consumer = env.consumer(env.consumer_settings()).await.unwrap();
    const ACTIONS: usize = 100;
    let note = "x".repeat(60 * 1024);
    for i in 0..ACTIONS {
        handoff_relay::record_approved_action(
            &mut env.producer_db.acquire().await.unwrap(),
            &handoff_relay::ApprovedAction::parse(
                &format!("harbor:create-followup:v1:case-{i}"),
                serde_json::json!({"title": SEED_TITLE, "note": note}),
                "user-17",
                chrono::Utc::now(),
            )
            .unwrap(),
        )
        .await
        .unwrap();
    }
    assert_eq!(relay.publish_batch().await.unwrap().published, ACTIONS);
    assert!(env.consumer_settings().batch_size >= ACTIONS, "a pull could take every message");

    let first = consumer.fetch_and_handle(WAIT).await.unwrap();
    let per_pull = handoff_consumer::consumer::PULL_MAX_BYTES / note.len();
    assert!(!first.is_empty() && first.len() <= per_pull, "{} messages in the first pull", first.len());
    let mut handled = first.len();
    while handled < ACTIONS {
        let next = consumer.fetch_and_handle(WAIT).await.unwrap();
        assert!(!next.is_empty() && next.len() <= per_pull, "{} messages in a pull", next.len());
        assert!(next.iter().all(|h| matches!(h, Handled::Created { .. })), "{next:?}");
        handled += next.len();
    }
    assert_eq!(handled, ACTIONS);
    assert_eq!(env.tasks().await.unwrap(), ACTIONS as i64);
    assert_eq!(env.stream_messages().await.unwrap(), ACTIONS as u64);
}

#[tokio::test]
async fn two_keys_with_identical_payloads_make_two_tasks() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    let consumer = env.consumer(env.consumer_settings()).await.unwrap();
    for case in ["case-104", "case-105"] {
        handoff_relay::record_approved_action(
            &mut env.producer_db.acquire().await.unwrap(),
            &handoff_relay::ApprovedAction::parse(
                &format!("harbor:create-followup:v1:{case}"),
                serde_json::json!({"title": SEED_TITLE}),
                "user-17",
                chrono::Utc::now(),
            )
            .unwrap(),
        )
        .await
        .unwrap();
    }
    assert_eq!(relay.publish_batch().await.unwrap().published, 2);
    let handled = consumer.fetch_and_handle(WAIT).await.unwrap();
    assert_eq!(handled.iter().filter(|h| matches!(h, Handled::Created { .. })).count(), 2);
    assert_eq!(env.tasks().await.unwrap(), 2);
    assert_eq!(env.stream_messages().await.unwrap(), 2);
}

#[tokio::test]
async fn a_republish_after_the_dedup_window_expired_is_stopped_by_the_consumers_unique_index() {
    let env = TestEnv::start_with_window(Duration::from_secs(1)).await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    let consumer = env.consumer(env.consumer_settings()).await.unwrap();
    env.approve("case-104", SEED_TITLE).await.unwrap();
    relay.publish_batch().await.unwrap();
    consumer.fetch_and_handle(WAIT).await.unwrap();
    assert_eq!(env.tasks().await.unwrap(), 1);

    // Re-publish the very same message until the broker no longer recognizes its id.
    republish_first_message_until_stored(&env).await;
    assert_eq!(env.stream_messages().await.unwrap(), 2, "the broker stored it twice");

    let handled = consumer.fetch_and_handle(WAIT).await.unwrap();
    assert!(matches!(handled.as_slice(), [Handled::Duplicate { .. }]), "{handled:?}");
    assert_eq!(env.tasks().await.unwrap(), 1);
}

#[tokio::test]
async fn malformed_and_hash_mismatch_messages_are_dead_lettered_without_blocking_the_rest() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    // Accepting unsigned messages too, as during a move to signing, so the hash check is reached.
    let signatures = handoff_shared::signing::SignaturePolicy::new([env.keys.signing.clone()], true).unwrap();
    let consumer =
        env.consumer(handoff_consumer::ConsumerSettings { signatures, ..env.consumer_settings() }).await.unwrap();
    let key: handoff_shared::OperationKey = "harbor:create-followup:v1:case-200".parse().unwrap();
    let subject = env.subjects.for_key(&key);
    let publish = |payload: Vec<u8>, id: &str| {
        let message = PublishMessage::build().payload(payload.into()).message_id(id);
        let js = env.js.clone();
        let subject = subject.clone();
        async move { js.send_publish(subject, message).await.unwrap().await.unwrap() }
    };

    // 1: not an envelope at all.
    publish(b"not json".to_vec(), "garbage-1").await;
    // 2: a genuine envelope whose data was changed after hashing.
    let genuine = handoff_shared::Envelope {
        key: key.clone(),
        payload: handoff_shared::CanonicalPayload::new(serde_json::json!({"title": SEED_TITLE})).unwrap(),
        approval: handoff_shared::Approval::new("user-17", chrono::Utc::now()).unwrap(),
        source: "/test".into(),
        time: chrono::Utc::now(),
        traceparent: None,
    };
    let mut tampered: serde_json::Value = serde_json::from_slice(&genuine.encode()).unwrap();
    // (Unsigned: this is the hash check's test; a signed one is refused before it, see signing.rs.)
    tampered["data"]["title"] = "Call someone else".into();
    publish(serde_json::to_vec(&tampered).unwrap(), key.as_str()).await;
    // 3: a valid action behind both.
    env.approve("case-104", SEED_TITLE).await.unwrap();
    relay.publish_batch().await.unwrap();

    let mut handled = Vec::new();
    for _ in 0..10 {
        handled.extend(consumer.fetch_and_handle(Duration::from_secs(1)).await.unwrap());
        if handled.len() >= 3 {
            break;
        }
    }
    assert_eq!(handled.len(), 3, "{handled:?}");
    assert!(
        matches!(handled[0], Handled::DeadLettered { ref reason } if reason.contains("CloudEvents")),
        "{handled:?}"
    );
    assert!(
        matches!(handled[1], Handled::DeadLettered { ref reason } if reason.contains("hash mismatch")),
        "{handled:?}"
    );
    assert!(matches!(handled[2], Handled::Created { .. }), "{handled:?}");
    let counts = env.consumer_counts().await.unwrap();
    assert_eq!((counts.dead_letters, counts.tasks, counts.inbox), (2, 1, 1));
    let reasons: Vec<String> =
        sqlx::query_scalar("SELECT reason FROM handoff_consumer.dead_letter ORDER BY stream_sequence")
            .fetch_all(&env.consumer_db)
            .await
            .unwrap();
    assert!(reasons[0].contains("not a CloudEvents"), "{reasons:?}");
    assert!(reasons[1].contains("hash mismatch"), "{reasons:?}");
    // Terminated after being recorded: nothing is redelivered.
    assert!(consumer.fetch_and_handle(Duration::from_secs(2)).await.unwrap().is_empty());
}

#[tokio::test]
async fn a_failed_batch_transaction_is_retried_message_by_message() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    let consumer = env.consumer(env.consumer_settings()).await.unwrap();
    env.approve("case-104", SEED_TITLE).await.unwrap();
    env.approve("case-105", SEED_TITLE).await.unwrap();
    assert_eq!(relay.publish_batch().await.unwrap().published, 2);

    // The batch transaction fails once; each message then commits on its own.
    consumer.faults().fail_transaction.store(1, Ordering::SeqCst);
    let handled = consumer.fetch_and_handle(WAIT).await.unwrap();
    assert_eq!(handled.len(), 2, "{handled:?}");
    assert!(handled.iter().all(|h| matches!(h, Handled::Created { .. })), "{handled:?}");
    assert_eq!(env.tasks().await.unwrap(), 2);
}

#[tokio::test]
async fn a_message_that_keeps_failing_is_dead_lettered_after_its_budget_not_lost() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    let settings = handoff_consumer::ConsumerSettings { dead_letter_after: 3, ..env.consumer_settings() };
    let consumer = env.consumer(settings).await.unwrap();
    env.approve("case-104", SEED_TITLE).await.unwrap();
    relay.publish_batch().await.unwrap();

    // Every processing transaction fails, as during a long database fault.
    consumer.faults().fail_transaction.store(u32::MAX, Ordering::SeqCst);
    let mut outcomes = Vec::new();
    for _ in 0..20 {
        outcomes.extend(consumer.fetch_and_handle(Duration::from_secs(1)).await.unwrap());
        if matches!(outcomes.last(), Some(Handled::DeadLettered { .. })) {
            break;
        }
    }
    assert!(
        matches!(
            outcomes.as_slice(),
            [Handled::Retrying { .. }, Handled::Retrying { .. }, Handled::DeadLettered { .. }]
        ),
        "{outcomes:?}"
    );
    let (reason, deliveries, message_id): (String, i64, Option<String>) =
        sqlx::query_as("SELECT reason, deliveries, message_id FROM handoff_consumer.dead_letter")
            .fetch_one(&env.consumer_db)
            .await
            .unwrap();
    assert!(reason.starts_with("failed 3 deliveries"), "{reason}");
    assert_eq!(deliveries, 3);
    assert_eq!(message_id.as_deref(), Some("harbor:create-followup:v1:case-104"));
    assert_eq!(env.tasks().await.unwrap(), 0);
    // Terminated once stored: it does not come back.
    assert!(consumer.fetch_and_handle(Duration::from_secs(2)).await.unwrap().is_empty());
}

#[tokio::test]
async fn two_copies_of_one_key_in_the_same_batch_make_one_task() {
    let env = TestEnv::start_with_window(Duration::from_secs(1)).await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    env.approve("case-104", SEED_TITLE).await.unwrap();
    relay.publish_batch().await.unwrap();
    // A second stored copy of the same message, before any consumer has run.
    republish_first_message_until_stored(&env).await;

    let consumer = env.consumer(env.consumer_settings()).await.unwrap();
    let handled = consumer.fetch_and_handle(WAIT).await.unwrap();
    assert!(
        matches!(handled.as_slice(), [Handled::Created { .. }, Handled::Duplicate { .. }]),
        "both copies in one batch: {handled:?}"
    );
    assert_eq!(env.tasks().await.unwrap(), 1);
    assert_eq!(env.consumer_counts().await.unwrap().inbox, 1);
}

#[tokio::test]
async fn a_valid_message_on_another_action_types_subject_is_dead_lettered_and_creates_nothing() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    let consumer = env.consumer(env.consumer_settings()).await.unwrap();
    // Well formed, correctly hashed, its Nats-Msg-Id its key: only the subject is another action's,
    // where a publisher allowed on that subject alone would put it.
    let key: handoff_shared::OperationKey = "legit:create-followup:v1:case-1".parse().unwrap();
    let envelope = handoff_shared::Envelope {
        key: key.clone(),
        payload: handoff_shared::CanonicalPayload::new(serde_json::json!({"case_id": "case-1"})).unwrap(),
        approval: handoff_shared::Approval::new("user-17", chrono::Utc::now()).unwrap(),
        source: "/test".into(),
        time: chrono::Utc::now(),
        traceparent: None,
    };
    let wrong_subject = format!("{}.othertenant.delete-everything", env.subjects.prefix());
    // Signed with the relays' own key: only the subject is wrong.
    let message = PublishMessage::build()
        .payload(env.signed(&envelope, handoff_shared::envelope::SCHEMA_VERSION))
        .message_id(key.as_str());
    env.js.send_publish(wrong_subject, message).await.unwrap().await.unwrap();
    env.approve("case-104", SEED_TITLE).await.unwrap();
    relay.publish_batch().await.unwrap();

    let handled = eventually("both messages", Duration::from_secs(30), || async {
        let handled = consumer.fetch_and_handle(Duration::from_secs(1)).await?;
        Ok((!handled.is_empty()).then_some(handled))
    })
    .await
    .unwrap();
    assert_eq!(handled.len(), 2, "{handled:?}");
    assert!(
        matches!(&handled[0], Handled::DeadLettered { reason } if reason.contains("arrived on subject") && reason.contains("othertenant.delete-everything")),
        "{handled:?}"
    );
    assert!(matches!(&handled[1], Handled::Created { .. }), "{handled:?}");
    let counts = env.consumer_counts().await.unwrap();
    assert_eq!((counts.tasks, counts.inbox, counts.dead_letters), (1, 1, 1));
}

#[tokio::test]
async fn a_newer_envelope_version_waits_for_an_upgraded_consumer_and_is_never_dead_lettered() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    let newest = handoff_shared::envelope::SCHEMA_VERSION;
    // A replica one version behind the relay that wrote the second message.
    let old = handoff_consumer::ConsumerSettings {
        newest_envelope_version: newest,
        newer_version_delay: Duration::from_secs(1),
        ..env.consumer_settings()
    };
    let old = env.consumer(old).await.unwrap();
    env.approve("case-1", SEED_TITLE).await.unwrap();
    relay.publish_batch().await.unwrap();
    let key: handoff_shared::OperationKey = "harbor:create-followup:v1:case-2".parse().unwrap();
    let newer = handoff_shared::Envelope {
        key: key.clone(),
        payload: handoff_shared::CanonicalPayload::new(serde_json::json!({"case_id": "case-2"})).unwrap(),
        approval: handoff_shared::Approval::new("user-17", chrono::Utc::now()).unwrap(),
        source: "/newer-relay".into(),
        time: chrono::Utc::now(),
        traceparent: None,
    };
    let message = PublishMessage::build().payload(env.signed(&newer, newest + 1)).message_id(key.as_str());
    env.js.send_publish(env.subjects.for_key(&key), message).await.unwrap().await.unwrap();

    let handled = eventually("both messages", Duration::from_secs(30), || async {
        let handled = old.fetch_and_handle(Duration::from_secs(1)).await?;
        Ok((handled.len() >= 2).then_some(handled))
    })
    .await
    .unwrap();
    assert!(matches!(handled[0], Handled::Created { .. }), "{handled:?}");
    assert_eq!(handled[1], Handled::Held { version: newest + 1 });
    let held = old
        .metrics()
        .messages
        .get_or_create(&handoff_consumer::metrics::MessageLabels {
            action: "harbor:create-followup".into(),
            outcome: "held_newer_version",
        })
        .get();
    assert_eq!(held, 1);
    let counts = env.consumer_counts().await.unwrap();
    assert_eq!((counts.tasks, counts.dead_letters), (1, 0), "held, not dead-lettered");
    drop(old);

    // The replica is upgraded: the held message is offered again and handled once.
    let upgraded =
        handoff_consumer::ConsumerSettings { newest_envelope_version: newest + 1, ..env.consumer_settings() };
    let upgraded = env.consumer(upgraded).await.unwrap();
    let handled = eventually("the held message", Duration::from_secs(30), || async {
        let handled = upgraded.fetch_and_handle(Duration::from_secs(1)).await?;
        Ok((!handled.is_empty()).then_some(handled))
    })
    .await
    .unwrap();
    assert!(
        matches!(&handled[..], [Handled::Created { operation_key, .. }] if operation_key == key.as_str()),
        "{handled:?}"
    );
    let counts = env.consumer_counts().await.unwrap();
    assert_eq!((counts.tasks, counts.inbox, counts.dead_letters), (2, 2, 0));
    assert_eq!(env.stream_messages().await.unwrap(), 2);
}

/// The usual batch (every key new) is recorded in one statement; a batch with a key the inbox
/// already holds is recorded by the batch transaction, which decides each message.
#[tokio::test]
async fn a_usual_batch_is_one_statement_and_a_batch_with_a_held_key_goes_to_the_transaction() {
    use handoff_consumer::metrics::path;
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    let consumer = env.consumer(env.consumer_settings()).await.unwrap();
    let batches = |p| consumer.metrics().batches(p).get();
    for case in ["case-104", "case-105", "case-106"] {
        env.approve(case, SEED_TITLE).await.unwrap();
    }
    assert_eq!(relay.publish_batch().await.unwrap().published, 3);
    let handled = consumer.fetch_and_handle(WAIT).await.unwrap();
    assert_eq!(handled.len(), 3, "{handled:?}");
    assert!(handled.iter().all(|h| matches!(h, Handled::Created { .. })), "{handled:?}");
    assert_eq!((batches(path::ONE_STATEMENT), batches(path::TRANSACTION)), (1, 0));

    // case-107 arrives with case-108, whose key the inbox already holds (as after a restore of
    // the CRM store from an older backup than the inbox): no task for it, one for case-107.
    env.approve("case-107", SEED_TITLE).await.unwrap();
    env.approve("case-108", SEED_TITLE).await.unwrap();
    let hash: String = sqlx::query_scalar(
        "SELECT payload_hash FROM handoff.approved_action WHERE operation_key = 'harbor:create-followup:v1:case-108'",
    )
    .fetch_one(&env.producer_db)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO handoff_consumer.inbox (operation_key, payload_hash, stream_sequence, outcome)
         VALUES ('harbor:create-followup:v1:case-108', $1, 0, 'task_created')",
    )
    .bind(&hash)
    .execute(&env.consumer_db)
    .await
    .unwrap();
    assert_eq!(relay.publish_batch().await.unwrap().published, 2);
    let mut handled = Vec::new();
    while handled.len() < 2 {
        let batch = consumer.fetch_and_handle(WAIT).await.unwrap();
        assert!(!batch.is_empty(), "both messages arrive; got {handled:?}");
        handled.extend(batch);
    }
    assert!(handled.contains(&Handled::Duplicate { operation_key: "harbor:create-followup:v1:case-108".into() }));
    assert!(
        handled
            .iter()
            .any(|h| matches!(h, Handled::Created { operation_key, .. } if operation_key.ends_with("case-107"))),
        "{handled:?}"
    );
    assert!(batches(path::TRANSACTION) >= 1, "the held key sent its batch to the transaction");
    let counts = env.consumer_counts().await.unwrap();
    assert_eq!((counts.inbox, counts.tasks, counts.reviews), (5, 4, 0));
}

/// The one statement writes all or nothing: one key already held (here committed by another
/// replica while the statement waited on it) and none of the batch's rows are written.
#[tokio::test]
async fn the_one_statement_batch_writes_nothing_when_another_replica_commits_one_of_its_keys_first() {
    use handoff_consumer::crm::TaskRequest;
    use handoff_consumer::inbox::Arrival;
    let env = TestEnv::start().await.unwrap();
    // Builds the stream and the consumer schema.
    drop(env.relay(env.relay_settings()).await.unwrap());
    drop(env.consumer(env.consumer_settings()).await.unwrap());
    let keys = ["harbor:create-followup:v1:case-104", "harbor:create-followup:v1:case-105"];
    let arrivals: Vec<Arrival> = keys
        .iter()
        .zip(1..)
        .map(|(k, s)| Arrival { operation_key: (*k).into(), payload_hash: "h".repeat(64), stream_sequence: s })
        .collect();
    let requests: Vec<TaskRequest> = keys
        .iter()
        .map(|k| TaskRequest {
            operation_key: (*k).into(),
            payload_hash: "h".repeat(64),
            payload: serde_json::json!({"title": SEED_TITLE}),
            approved_by: "user-17".into(),
            traceparent: None,
        })
        .collect();

    // Another replica's transaction holds case-105's inbox row, not yet committed.
    let mut other = env.consumer_db.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO handoff_consumer.inbox (operation_key, payload_hash, stream_sequence, outcome)
         VALUES ($1, $2, 9, 'task_created')",
    )
    .bind(keys[1])
    .bind("h".repeat(64))
    .execute(&mut *other)
    .await
    .unwrap();
    let pool = env.consumer_db.clone();
    let (a, r) = (arrivals.clone(), requests.clone());
    let usual = tokio::spawn(async move { handoff_consumer::LocalCrm.create_usual(&pool, &a, &r).await });
    // The statement waits on case-105's unique index entry...
    eventually("the one statement to wait for the other transaction", Duration::from_secs(10), || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%WITH arrived AS%'",
        )
        .fetch_one(&env.consumer_db)
        .await?;
        Ok((waiting == 1).then_some(()))
    })
    .await
    .unwrap();
    // ...which the other replica now commits.
    other.commit().await.unwrap();
    let outcome = usual.await.unwrap().unwrap();
    assert_eq!(outcome, None, "a held key: the batch transaction must decide");
    let inbox: Vec<String> = sqlx::query_scalar("SELECT operation_key FROM handoff_consumer.inbox")
        .fetch_all(&env.consumer_db)
        .await
        .unwrap();
    assert_eq!(inbox, [keys[1]], "case-104 was not written either");
    assert_eq!(env.tasks().await.unwrap(), 0);

    // With every key new, the same statement writes every row.
    let fresh: Vec<Arrival> = arrivals[..1].to_vec();
    let outcome = handoff_consumer::LocalCrm.create_usual(&env.consumer_db, &fresh, &requests[..1]).await.unwrap();
    assert!(matches!(outcome.as_deref(), Some([TaskOutcome::Created { .. }])), "{outcome:?}");
    assert_eq!(env.tasks().await.unwrap(), 1);

    // The remote CRM's ledger, the same way: a `received` row per new key, or nothing.
    let ledger = handoff_consumer::remote::ledger::LedgerCrm { account: "default".into() };
    let ledger_arrivals: Vec<Arrival> = ["case-201", "case-202"]
        .iter()
        .zip(20..)
        .map(|(c, s)| Arrival {
            operation_key: format!("harbor:create-followup:v1:{c}"),
            payload_hash: "h".repeat(64),
            stream_sequence: s,
        })
        .collect();
    let ledger_requests: Vec<TaskRequest> = ledger_arrivals
        .iter()
        .map(|a| TaskRequest { operation_key: a.operation_key.clone(), ..requests[0].clone() })
        .collect();
    let outcome = ledger.create_usual(&env.consumer_db, &ledger_arrivals, &ledger_requests).await.unwrap();
    assert_eq!(outcome, Some(vec![TaskOutcome::Accepted, TaskOutcome::Accepted]));
    let received: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM handoff_consumer.crm_operation WHERE state = 'received' AND account = 'default'",
    )
    .fetch_one(&env.consumer_db)
    .await
    .unwrap();
    assert_eq!(received, 2);
    // Again: both keys are held now, so nothing is written and the transaction decides.
    let outcome = ledger.create_usual(&env.consumer_db, &ledger_arrivals, &ledger_requests).await;
    assert!(matches!(outcome, Ok(None)), "{outcome:?}");
}
