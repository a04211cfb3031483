//! Authentic messages: only a holder of a signing key can have a task created. Forged, unsigned
//! and misrouted messages are dead-lettered with their reasons while the legitimate ones flow;
//! keys written by `handoff-admin keygen` rotate without losing a message; the binaries refuse to
//! start without keys.

use std::time::Duration;

use async_nats::jetstream::message::PublishMessage;
use handoff_consumer::Handled;
use handoff_shared::envelope::SCHEMA_VERSION;
use handoff_shared::signing::{KeyId, SigningKey};
use handoff_shared::{Approval, CanonicalPayload, Envelope, OperationKey};
use handoff_tests::process::run_binary;
use handoff_tests::{TestEnv, eventually};

fn envelope(key: &str) -> Envelope {
    let key: OperationKey = key.parse().unwrap();
    let case = key.entity().to_owned();
    Envelope {
        key,
        payload: CanonicalPayload::new(serde_json::json!({"case_id": case, "title": "Call the customer"})).unwrap(),
        approval: Approval::new("user-17", chrono::Utc::now()).unwrap(),
        source: "/forger".into(),
        time: chrono::Utc::now(),
        traceparent: None,
    }
}

async fn publish(env: &TestEnv, subject: String, key: &str, body: bytes::Bytes) {
    let message = PublishMessage::build().payload(body).message_id(key);
    env.js.send_publish(subject, message).await.unwrap().await.unwrap();
}

async fn dead_letter_reason(env: &TestEnv, key: &str) -> String {
    sqlx::query_scalar("SELECT reason FROM handoff_consumer.dead_letter WHERE message_id = $1")
        .bind(key)
        .fetch_one(&env.consumer_db)
        .await
        .unwrap_or_else(|e| panic!("no dead letter for {key}: {e}"))
}

#[tokio::test]
async fn forged_unsigned_and_misrouted_messages_are_dead_lettered_with_reasons_while_1000_legitimate_ones_are_created()
{
    let env = TestEnv::start().await.unwrap();
    env.approve_many_via_sql(1, 1_000).await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    eventually("1,000 rows published", Duration::from_secs(60), || async {
        relay.publish_batch().await?;
        Ok((env.outbox().await?.published == 1_000).then_some(()))
    })
    .await
    .unwrap();

    // Well formed, correctly hashed, Nats-Msg-Id = key, on the right subject: only the signature is wrong.
    let same_id = SigningKey::generate(Some(env.keys.signing.id().clone())).unwrap();
    let forged = envelope("harbor:create-followup:v1:forged-same-id");
    publish(
        &env,
        env.subjects.for_key(&forged.key),
        forged.key.as_str(),
        forged.encode_signed(SCHEMA_VERSION, Some(&same_id)),
    )
    .await;
    let other = SigningKey::generate(Some(KeyId::new("k-attacker").unwrap())).unwrap();
    let unknown = envelope("harbor:create-followup:v1:forged-other-key");
    publish(
        &env,
        env.subjects.for_key(&unknown.key),
        unknown.key.as_str(),
        unknown.encode_signed(SCHEMA_VERSION, Some(&other)),
    )
    .await;
    let unsigned = envelope("harbor:create-followup:v1:unsigned");
    publish(&env, env.subjects.for_key(&unsigned.key), unsigned.key.as_str(), unsigned.encode()).await;
    // Genuinely signed, but on another action's subject.
    let misrouted = envelope("legit:create-followup:v1:case-1");
    let wrong_subject = format!("{}.othertenant.delete-everything", env.subjects.prefix());
    publish(&env, wrong_subject, misrouted.key.as_str(), env.signed(&misrouted, SCHEMA_VERSION)).await;
    assert_eq!(env.stream_messages().await.unwrap(), 1_004);

    let consumer = env.consumer(env.consumer_settings()).await.unwrap();
    let mut handled = Vec::new();
    for _ in 0..60 {
        handled.extend(consumer.fetch_and_handle(Duration::from_secs(1)).await.unwrap());
        if handled.len() >= 1_004 {
            break;
        }
    }
    let created = handled.iter().filter(|h| matches!(h, Handled::Created { .. })).count();
    let dead = handled.iter().filter(|h| matches!(h, Handled::DeadLettered { .. })).count();
    assert_eq!((created, dead, handled.len()), (1_000, 4, 1_004), "{:?}", &handled[..4]);
    let counts = env.consumer_counts().await.unwrap();
    assert_eq!((counts.tasks, counts.inbox, counts.dead_letters), (1_000, 1_000, 4));

    let reason = dead_letter_reason(&env, forged.key.as_str()).await;
    assert!(
        reason.contains("signature does not verify") && reason.contains(env.keys.signing.id().as_str()),
        "{reason}"
    );
    let reason = dead_letter_reason(&env, unknown.key.as_str()).await;
    assert!(reason.contains("\"k-attacker\"") && reason.contains("not among the verify keys"), "{reason}");
    let reason = dead_letter_reason(&env, unsigned.key.as_str()).await;
    assert!(reason.contains("not signed"), "{reason}");
    let reason = dead_letter_reason(&env, misrouted.key.as_str()).await;
    assert!(reason.contains("arrived on subject") && reason.contains("othertenant.delete-everything"), "{reason}");
    // The operators' command shows the same reasons.
    let out = env.admin(&["dead-letter", "list"]).await.unwrap().expect_code(0).unwrap();
    assert!(out.stdout.contains("not signed") && out.stdout.contains("signature does not verify"), "{}", out.stdout);
}

#[tokio::test]
async fn keys_from_keygen_rotate_without_losing_a_message() {
    let env = TestEnv::start().await.unwrap();
    let dir = env.keys.dir().to_owned();
    let file = |name: &str| dir.join(name).display().to_string();
    for (id, signing, verify) in [("k-2026-a", "a.key", "a.verify"), ("k-2026-b", "b.key", "b.verify")] {
        let out = run_binary(
            "handoff-admin",
            &[],
            &["keygen", "--signing-key", &file(signing), "--verify-key", &file(verify), "--key-id", id],
            Duration::from_secs(30),
        )
        .await
        .unwrap()
        .expect_code(0)
        .unwrap();
        assert!(out.stdout.contains(id), "{}", out.stdout);
    }
    // A key file is never overwritten.
    let again = run_binary(
        "handoff-admin",
        &[],
        &["keygen", "--signing-key", &file("a.key"), "--verify-key", &file("c.verify")],
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    assert_ne!(again.code, Some(0));
    assert!(again.stderr.contains("already exists"), "{}", again.stderr);
    assert!(!dir.join("c.verify").exists(), "nothing half made");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join("a.verify")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "a verify key is a secret too");
    }

    let relay_with = |key: &str| env.relay_process_with(&[("HANDOFF_SIGNING_KEY_FILE", file(key))]).unwrap();
    let consumer_with =
        |keys: &str| env.consumer_process_with(&[("HANDOFF_VERIFY_KEY_FILES", keys.to_owned())]).unwrap();
    let published = |n: i64| {
        let env = &env;
        async move {
            eventually(&format!("{n} rows published"), Duration::from_secs(60), || async {
                Ok((env.outbox().await?.published == n).then_some(()))
            })
            .await
            .unwrap()
        }
    };
    let tasks = |n: i64| {
        let env = &env;
        async move {
            eventually(&format!("{n} tasks"), Duration::from_secs(90), || async {
                Ok((env.tasks().await? == n).then_some(()))
            })
            .await
            .unwrap()
        }
    };

    // Before: the relay signs with key a; 100 messages wait in the stream.
    let mut relay = relay_with("a.key");
    env.approve_many_via_sql(1, 100).await.unwrap();
    published(100).await;
    // 1. The consumers accept a and b. 2. The relay switches to b, while a's messages are unconsumed.
    relay.terminate().await.unwrap();
    let mut relay = relay_with("b.key");
    env.approve_many_via_sql(101, 100).await.unwrap();
    published(200).await;
    let mut consumer = consumer_with(&format!("{},{}", file("a.verify"), file("b.verify")));
    tasks(200).await;
    // 3. Key a is removed once nothing signed with it is left.
    consumer.terminate().await.unwrap();
    let _consumer = consumer_with(&file("b.verify"));
    env.approve_many_via_sql(201, 50).await.unwrap();
    published(250).await;
    tasks(250).await;
    let counts = env.consumer_counts().await.unwrap();
    assert_eq!((counts.tasks, counts.inbox, counts.dead_letters), (250, 250, 0), "nothing lost, nothing doubled");
    assert_eq!(env.stream_messages().await.unwrap(), 250);

    // A message signed with the retired key is refused now, naming the key.
    let old = SigningKey::read(&dir.join("a.key")).unwrap();
    let late = envelope("harbor:create-followup:v1:late-1");
    publish(&env, env.subjects.for_key(&late.key), late.key.as_str(), late.encode_signed(SCHEMA_VERSION, Some(&old)))
        .await;
    let reason = eventually("the late message dead-lettered", Duration::from_secs(60), || async {
        Ok(sqlx::query_scalar::<_, String>("SELECT reason FROM handoff_consumer.dead_letter")
            .fetch_optional(&env.consumer_db)
            .await?)
    })
    .await
    .unwrap();
    assert!(reason.contains("\"k-2026-a\"") && reason.contains("k-2026-b"), "{reason}");
    assert_eq!(env.tasks().await.unwrap(), 250);
    relay.terminate().await.unwrap();
}

#[tokio::test]
async fn the_services_refuse_to_start_without_keys_naming_the_setting() {
    // Refused before any connection: nothing needs to listen at these addresses.
    let env = [
        ("DATABASE_URL", "postgres://handoff@127.0.0.1:1/handoff".to_owned()),
        ("NATS_URL", "nats://127.0.0.1:1".to_owned()),
        ("HANDOFF_HTTP_ADDR", String::new()),
    ];
    for (binary, setting) in
        [("handoff-relay", "HANDOFF_SIGNING_KEY_FILE"), ("handoff-consumer", "HANDOFF_VERIFY_KEY_FILES")]
    {
        let out = run_binary(binary, &env, &[], Duration::from_secs(30)).await.unwrap();
        assert_ne!(out.code, Some(0), "{binary}");
        let last = out.stderr.lines().last().unwrap_or_default();
        assert!(last.contains(setting) && last.contains("handoff-admin keygen"), "{binary}: {}", out.stderr);
    }
    let mut missing = env.to_vec();
    missing.push(("HANDOFF_VERIFY_KEY_FILES", "/nonexistent/verify.key".to_owned()));
    let out = run_binary("handoff-consumer", &missing, &[], Duration::from_secs(30)).await.unwrap();
    let last = out.stderr.lines().last().unwrap_or_default();
    assert!(last.contains("/nonexistent/verify.key") && last.contains("HANDOFF_VERIFY_KEY_FILES"), "{}", out.stderr);
}
