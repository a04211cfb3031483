//! The least NATS permissions of deploy/nats/handoff-users.conf, on a real nats-server with that
//! file as its `authorization` block: relay, consumer and handoff-admin do their whole job as those
//! users, and the consumer's user cannot publish an action.

use std::time::Duration;

use handoff_tests::ops::{free_local_addr, get, series};
use handoff_tests::process::run_binary;
use handoff_tests::{Nats, ServiceProcess, TestEnv, eventually};

const PASSWORDS: [(&str, &str); 3] = [
    ("$HANDOFF_RELAY_NATS_PASSWORD", "relay-pw"),
    ("$HANDOFF_CONSUMER_NATS_PASSWORD", "consumer-pw"),
    ("$HANDOFF_ADMIN_NATS_PASSWORD", "admin-pw"),
];

/// The deploy file with this test's stream, prefix and durable in place of the defaults, and the
/// passwords filled in, plus an unrestricted user for the test's own counting.
fn server_config(env: &TestEnv) -> String {
    let mut users = include_str!("../../../deploy/nats/handoff-users.conf")
        .replace(".HANDOFF", &format!(".{}", env.stream))
        .replace("\"handoff.>\"", &format!("\"{}.>\"", env.subjects.prefix()))
        .replace("handoff-crm", "crm");
    for (variable, password) in PASSWORDS {
        users = users.replace(variable, &format!("\"{password}\""));
    }
    let users = users.replacen("users = [", "users = [\n  { user: test, password: \"test-pw\" }", 1);
    format!("listen: 0.0.0.0:4222\njetstream {{ store_dir: /data }}\nauthorization {{\n{users}\n}}\n")
}

#[tokio::test]
async fn relay_consumer_and_admin_work_with_the_least_permissions_and_the_consumer_cannot_publish_actions() {
    let env = TestEnv::start().await.unwrap();
    let dir = env.keys.dir().join("nats");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("nats.conf"), server_config(&env)).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(dir.join("nats.conf"), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let nats = Nats::start_with_files(&["-c", "/config/nats.conf"], dir.to_str().unwrap(), "/config").await.unwrap();

    let relay_addr = free_local_addr().unwrap();
    let mut relay_env = env.service_env_for_relay();
    relay_env.extend([
        ("NATS_URL", nats.url()),
        ("NATS_USER", "handoff-relay".to_owned()),
        ("NATS_PASSWORD", "relay-pw".to_owned()),
        ("NATS_INBOX_PREFIX", "_INBOX_handoff_relay".to_owned()),
        // Reconcile every second: it reads the stream back, which needs its own permission.
        ("HANDOFF_RECONCILE_INTERVAL_SECS", "1".to_owned()),
        ("HANDOFF_HTTP_ADDR", relay_addr.to_string()),
        ("RUST_LOG", "info".to_owned()),
    ]);
    let relay = ServiceProcess::spawn_capturing("handoff-relay", &relay_env).unwrap();
    let mut consumer_env = env.service_env_for_consumer();
    consumer_env.extend([
        ("NATS_URL", nats.url()),
        ("NATS_USER", "handoff-consumer".to_owned()),
        ("NATS_PASSWORD", "consumer-pw".to_owned()),
        ("NATS_INBOX_PREFIX", "_INBOX_handoff_consumer".to_owned()),
        ("RUST_LOG", "info".to_owned()),
    ]);
    let consumer = ServiceProcess::spawn_capturing("handoff-consumer", &consumer_env).unwrap();

    env.approve_many_via_sql(1, 200).await.unwrap();
    eventually("200 tasks", Duration::from_secs(90), || async { Ok((env.tasks().await? == 200).then_some(())) })
        .await
        .unwrap();
    eventually("a reconciliation run", Duration::from_secs(30), || async {
        let (_, metrics) = get(relay_addr, "/metrics").await?;
        Ok(series(&metrics, "handoff_reconcile_runs_total").is_some_and(|n| n >= 1.0).then_some(metrics))
    })
    .await
    .unwrap();

    // The operator's command reads the stream and the durable as its own user.
    let mut admin_env = env.admin_env();
    admin_env.extend([
        ("NATS_URL", nats.url()),
        ("NATS_USER", "handoff-admin".to_owned()),
        ("NATS_PASSWORD", "admin-pw".to_owned()),
        ("NATS_INBOX_PREFIX", "_INBOX_handoff_admin".to_owned()),
    ]);
    let out = run_binary("handoff-admin", &admin_env, &["reconcile"], Duration::from_secs(60)).await.unwrap();
    let out = out.expect_code(0).unwrap();
    assert!(out.stdout.contains("200"), "{}", out.stdout);
    run_binary("handoff-admin", &admin_env, &["status"], Duration::from_secs(60))
        .await
        .unwrap()
        .expect_code(0)
        .unwrap();

    // The consumer's user may not publish an action: the server refuses, nothing is stored.
    let options = async_nats::ConnectOptions::with_user_and_password("handoff-consumer".into(), "consumer-pw".into())
        .custom_inbox_prefix("_INBOX_handoff_consumer");
    let mut intruder = async_nats::jetstream::new(options.connect(nats.url()).await.unwrap());
    intruder.set_timeout(Duration::from_secs(2));
    let forged =
        intruder.publish(format!("{}.harbor.create-followup", env.subjects.prefix()), "{}".into()).await.unwrap().await;
    assert!(forged.is_err(), "the publish was refused: {forged:?}");
    let test_user = async_nats::ConnectOptions::with_user_and_password("test".into(), "test-pw".into());
    let js = async_nats::jetstream::new(test_user.connect(nats.url()).await.unwrap());
    assert_eq!(js.get_stream(&env.stream).await.unwrap().info().await.unwrap().state.messages, 200);
    assert_eq!(env.consumer_counts().await.unwrap().dead_letters, 0);

    for (name, process) in [("relay", &relay), ("consumer", &consumer)] {
        let denied: Vec<String> =
            process.log_lines().into_iter().filter(|l| l.to_lowercase().contains("permissions violation")).collect();
        assert!(denied.is_empty(), "{name} needed a permission the file does not give: {denied:?}");
    }
}
