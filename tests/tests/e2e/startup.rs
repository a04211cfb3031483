//! How the binaries start and fail: secrets never reach the startup log, a refused NATS login or
//! an unreachable server ends the process with the cause on its last line, within the connect
//! timeout; the consumer creates its durable through requests a cluster leaves unanswered.

use std::time::{Duration, Instant};

use handoff_tests::faulty_api::{Fault, FaultyApi};
use handoff_tests::process::run_binary;
use handoff_tests::{Nats, ServiceProcess, TestEnv, eventually};

#[tokio::test]
async fn no_form_of_a_secret_reaches_the_startup_log() {
    let env = TestEnv::start().await.unwrap();
    // The test Postgres and NATS accept any credentials: the secrets only have to be given.
    let db = env.producer_url().replace("postgres@", "postgres:userinfo-s3cret@") + "?password=query-s3cret";
    let nats = env.nats.url().replace("nats://", "nats://natsuser:url-s3cret@");
    let mut vars = env.service_env_for_relay();
    vars.extend([
        ("DATABASE_URL", db),
        ("NATS_URL", nats),
        ("NATS_TOKEN", "token-s3cret".to_owned()),
        ("RUST_LOG", "debug".to_owned()),
    ]);
    let relay = ServiceProcess::spawn_capturing("handoff-relay", &vars).unwrap();
    eventually("the relay to run", Duration::from_secs(60), || async {
        Ok(relay.log_lines().iter().any(|l| l.contains("relay running")).then_some(()))
    })
    .await
    .unwrap();
    let lines = relay.log_lines();
    let startup = lines.iter().find(|l| l.contains("starting handoff-relay")).expect("a startup line");
    assert!(startup.contains("<redacted>"), "{startup}");
    for secret in ["userinfo-s3cret", "query-s3cret", "url-s3cret", "token-s3cret"] {
        assert!(lines.iter().all(|l| !l.contains(secret)), "{secret} was logged");
    }
}

#[tokio::test]
async fn wrong_nats_credentials_end_the_process_at_once_with_the_cause_on_its_last_line() {
    let env = TestEnv::start().await.unwrap();
    let guarded =
        Nats::start_with_args(&["-js", "--store_dir", "/data", "--user", "relay", "--pass", "right"]).await.unwrap();
    let mut vars = env.service_env_for_relay();
    vars.extend([
        ("NATS_URL", guarded.url()),
        ("NATS_USER", "relay".to_owned()),
        ("NATS_PASSWORD", "wrong".to_owned()),
        ("HANDOFF_NATS_CONNECT_TIMEOUT_SECS", "30".to_owned()),
    ]);
    let started = Instant::now();
    let out = run_binary("handoff-relay", &vars, &[], Duration::from_secs(60)).await.unwrap();
    assert_ne!(out.code, Some(0));
    assert!(started.elapsed() < Duration::from_secs(20), "a refused login is not retried for the timeout");
    let last = out.stderr.lines().last().unwrap_or_default();
    assert!(last.contains("authorization violation") && last.contains("--nats-user"), "{}", out.stderr);
    assert!(!out.stderr.contains("wrong"), "the password is not printed");
}

#[tokio::test]
async fn an_unreachable_nats_server_ends_the_process_after_the_connect_timeout_with_the_cause() {
    let env = TestEnv::start().await.unwrap();
    let nobody = handoff_tests::ops::free_local_addr().unwrap();
    let mut vars = env.service_env_for_relay();
    vars.extend([("NATS_URL", format!("nats://{nobody}")), ("HANDOFF_NATS_CONNECT_TIMEOUT_SECS", "2".to_owned())]);
    let started = Instant::now();
    let out = run_binary("handoff-relay", &vars, &[], Duration::from_secs(60)).await.unwrap();
    assert_ne!(out.code, Some(0));
    assert!(started.elapsed() < Duration::from_secs(15), "bounded by the connect timeout: {:?}", started.elapsed());
    let last = out.stderr.lines().last().unwrap_or_default();
    assert!(last.contains("cannot connect to NATS") && last.contains("gave up after 2s"), "{}", out.stderr);
}

#[tokio::test]
async fn a_setting_that_would_stall_is_refused_at_startup_naming_it() {
    let env = TestEnv::start().await.unwrap();
    let mut vars = env.service_env_for_relay();
    vars.push(("HANDOFF_RELAY_BATCH_SIZE", "0".to_owned()));
    let out = run_binary("handoff-relay", &vars, &[], Duration::from_secs(30)).await.unwrap();
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(out.stderr.contains("--batch-size"), "{}", out.stderr);
    let out = run_binary(
        "handoff-consumer",
        &[("DATABASE_URL", env.consumer_url()), ("HANDOFF_CRM_LEASE_SECS", "NaN".to_owned())],
        &[],
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(out.stderr.contains("--crm-lease-secs"), "{}", out.stderr);
    // Rows claimed ahead with a lease that leaves them no time to wait for a slot.
    let out = run_binary(
        "handoff-consumer",
        &[
            ("DATABASE_URL", env.consumer_url()),
            ("HANDOFF_CRM", "http".to_owned()),
            ("HANDOFF_CRM_URL", "http://127.0.0.1:9".to_owned()),
            ("HANDOFF_CRM_LEASE_SECS", "15".to_owned()),
            ("HANDOFF_CRM_CLAIM_AHEAD", "4".to_owned()),
        ],
        &[],
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    assert!(out.stderr.contains("--crm-claim-ahead needs --crm-lease-secs"), "{}", out.stderr);
}

/// More consumer replicas than the stream has is refused by the server: the process ends naming
/// the setting and leaves no durable consumer behind. A count out of range never gets that far.
#[tokio::test]
async fn a_consumer_replica_count_the_stream_cannot_hold_is_refused_naming_the_setting() {
    let env = TestEnv::start().await.unwrap();
    // Creates the stream (R1 on this single server), as a relay does before any consumer binds.
    let _relay = env.relay(env.relay_settings()).await.unwrap();
    let mut vars = env.service_env_for_consumer();
    vars.push(("HANDOFF_CONSUMER_REPLICAS", "3".to_owned()));
    let out = run_binary("handoff-consumer", &vars, &[], Duration::from_secs(60)).await.unwrap();
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    let last = out.stderr.lines().last().unwrap_or_default();
    assert!(
        last.contains("--consumer-replicas (HANDOFF_CONSUMER_REPLICAS) is 3") && last.contains("fewer replicas"),
        "{}",
        out.stderr
    );
    let durable = env.subscription().durable_name;
    let left: Result<async_nats::jetstream::consumer::PullConsumer, _> =
        env.js.get_consumer_from_stream(&durable, &env.stream).await;
    assert!(left.is_err(), "no durable consumer was created");
    for bad in ["0", "6", "three"] {
        let mut vars = env.service_env_for_consumer();
        vars.push(("HANDOFF_CONSUMER_REPLICAS", bad.to_owned()));
        let out = run_binary("handoff-consumer", &vars, &[], Duration::from_secs(30)).await.unwrap();
        assert_eq!(out.code, Some(2), "{bad}: {}", out.stderr);
        assert!(out.stderr.contains("--consumer-replicas") && out.stderr.contains("from 1 to 5"), "{}", out.stderr);
    }
}

#[tokio::test]
async fn an_untrusted_server_certificate_ends_the_process_at_once_naming_the_tls_settings() {
    let env = TestEnv::start().await.unwrap();
    // A server certificate nobody signed: no client trusts it.
    let dir = std::env::temp_dir().join(format!("handoff-tls-{}-{}", std::process::id(), env.stream));
    std::fs::create_dir_all(&dir).unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).unwrap();
    std::fs::write(dir.join("server.pem"), cert.cert.pem()).unwrap();
    std::fs::write(dir.join("server.key"), cert.signing_key.serialize_pem()).unwrap();
    for file in ["server.pem", "server.key"] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.join(file), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let args =
        ["-js", "--store_dir", "/data", "--tls", "--tlscert", "/certs/server.pem", "--tlskey", "/certs/server.key"];
    let nats = Nats::start_with_files(&args, dir.to_str().unwrap(), "/certs").await.unwrap();

    let mut vars = env.service_env_for_relay();
    vars.extend([
        ("NATS_URL", format!("tls://127.0.0.1:{}", nats.port())),
        ("HANDOFF_NATS_CONNECT_TIMEOUT_SECS", "30".to_owned()),
    ]);
    let started = Instant::now();
    let out = run_binary("handoff-relay", &vars, &[], Duration::from_secs(60)).await.unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert_ne!(out.code, Some(0));
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "an untrusted certificate is not retried for the timeout: {}",
        out.stderr
    );
    let last = out.stderr.lines().last().unwrap_or_default();
    assert!(last.contains("cannot connect to NATS") && last.contains("--nats-tls-ca"), "{}", out.stderr);
    assert!(
        last.to_lowercase().contains("certificate") || last.contains("UnknownIssuer"),
        "the cause is named: {last}"
    );
}

/// A stream on `nats` and the durable consumer the tests below create on it, waiting `patience`.
async fn stream_for_binding(nats: &Nats, patience: Duration) -> handoff_consumer::SubscriptionSettings {
    let subjects = handoff_shared::Subjects::new("bind").unwrap();
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "BIND".into(),
        subjects: vec![subjects.all()],
        ..Default::default()
    })
    .await
    .unwrap();
    handoff_consumer::SubscriptionSettings {
        stream: "BIND".into(),
        filter_subject: subjects.all(),
        subjects,
        durable_name: "crm".into(),
        ack_wait: Duration::from_secs(7),
        max_ack_pending: 1_234,
        stream_wait: patience,
        replicas: None,
    }
}

/// How many durable consumers the stream has, asked of the server directly.
async fn durables(nats: &Nats) -> usize {
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    js.get_stream("BIND").await.unwrap().info().await.unwrap().state.consumer_count
}

/// A cluster electing a leader leaves the request that creates the durable unanswered, before or
/// after acting on it: the consumer asks again (within --stream-wait-secs) instead of exiting, and
/// the durable is then there, once, with the consumer's settings. The requests go through a
/// forwarder of JetStream's API that leaves the first two creates unanswered.
#[tokio::test]
async fn the_durable_is_created_through_requests_left_unanswered() {
    for fault in [Fault::NotDelivered, Fault::AnswerLost] {
        let nats = Nats::start().await.unwrap();
        let settings = stream_for_binding(&nats, Duration::from_secs(60)).await;
        let api = FaultyApi::start(&nats.url(), "CONSUMER.CREATE.", fault, 2).await.unwrap();
        let js = api.jetstream(async_nats::connect(nats.url()).await.unwrap(), Duration::from_secs(2));

        handoff_consumer::subscription::bind(&js, &settings).await.unwrap();

        assert_eq!(api.requests("CONSUMER.CREATE."), 3, "{fault:?}: two unanswered, the third answered");
        assert_eq!(api.requests("STREAM.INFO."), 1, "{fault:?}");
        assert_eq!(durables(&nats).await, 1, "{fault:?}");
        let real = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
        let mut durable: async_nats::jetstream::consumer::PullConsumer =
            real.get_consumer_from_stream("crm", "BIND").await.unwrap();
        let config = &durable.info().await.unwrap().config;
        assert_eq!((config.max_ack_pending, config.ack_wait), (1_234, Duration::from_secs(7)), "{fault:?}");
    }
}

/// When the server stays silent, the consumer gives up once --stream-wait-secs has passed (not
/// before) with the cause, and ends (see main). It asked more than once on the way.
#[tokio::test]
async fn a_durable_create_that_is_never_answered_fails_after_the_stream_wait_with_its_cause() {
    let nats = Nats::start().await.unwrap();
    let settings = stream_for_binding(&nats, Duration::from_secs(5)).await;
    let api = FaultyApi::start(&nats.url(), "CONSUMER.CREATE.", Fault::NotDelivered, usize::MAX).await.unwrap();
    let js = api.jetstream(async_nats::connect(nats.url()).await.unwrap(), Duration::from_millis(200));

    let started = Instant::now();
    let error = handoff_consumer::subscription::bind(&js, &settings).await.unwrap_err();
    assert!(started.elapsed() >= settings.stream_wait, "gave up after {:?}", started.elapsed());

    let chain = format!("{error:#}");
    assert!(chain.contains("cannot create or update durable consumer crm on stream BIND"), "{chain}");
    assert!(chain.contains("timed out"), "{chain}");
    assert!(api.requests("CONSUMER.CREATE.") >= 2, "asked {} times", api.requests("CONSUMER.CREATE."));
}

/// A refusal is an answer, not a timeout: the consumer does not ask again.
#[tokio::test]
async fn a_refused_durable_is_not_asked_for_again() {
    let nats = Nats::start().await.unwrap();
    let mut settings = stream_for_binding(&nats, Duration::from_secs(60)).await;
    settings.replicas = handoff_consumer::subscription::ConsumerReplicas::new(3);
    let api = FaultyApi::start(&nats.url(), "CONSUMER.CREATE.", Fault::NotDelivered, 0).await.unwrap();
    let js = api.jetstream(async_nats::connect(nats.url()).await.unwrap(), Duration::from_secs(5));

    let error = handoff_consumer::subscription::bind(&js, &settings).await.unwrap_err();

    assert!(format!("{error:#}").contains("--consumer-replicas (HANDOFF_CONSUMER_REPLICAS) is 3"), "{error:#}");
    assert_eq!(api.requests("CONSUMER.CREATE."), 1);
    assert_eq!(durables(&nats).await, 0);
}
