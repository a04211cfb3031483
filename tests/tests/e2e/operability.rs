//! The operations endpoint of the real binaries (`/metrics`, `/healthz`, `/readyz`), and the
//! liveness check driven by fault hooks in-process.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use handoff_shared::observe::Endpoint;
use handoff_tests::ops::{free_local_addr, get, has_metric, series};
use handoff_tests::{TestEnv, eventually};
use sqlx::Connection;
use tokio_util::sync::CancellationToken;

const RELAY_METRICS: &[&str] = &[
    "handoff_relay_published_total",
    "handoff_relay_broker_duplicates_total",
    "handoff_relay_publish_failures_total",
    "handoff_relay_blocked_total",
    "handoff_relay_batches_total",
    "handoff_relay_claims_published_total",
    "handoff_relay_batch_errors_total",
    "handoff_relay_claim_duration_seconds",
    "handoff_relay_publish_duration_seconds",
    "handoff_relay_settle_duration_seconds",
    "handoff_outbox_rows",
    "handoff_outbox_oldest_pending_age_seconds",
    "handoff_outbox_held_back_rows",
    "handoff_outbox_held_back_transaction_age_seconds",
    "handoff_reconcile_mismatches",
    "handoff_reconcile_runs_total",
    "handoff_paused_action_types",
    "handoff_relay_sample_errors_total",
];

const CONSUMER_METRICS: &[&str] = &[
    "handoff_consumer_messages_total",
    "handoff_consumer_batch_duration_seconds",
    "handoff_consumer_batch_errors_total",
    "handoff_consumer_batches_total",
    "handoff_consumer_pending_messages",
    "handoff_consumer_ack_pending_messages",
    "handoff_consumer_redelivered_messages",
    "handoff_ledger_rows",
    "handoff_ledger_oldest_unknown_age_seconds",
    "handoff_review_rows",
    "handoff_conflict_rows",
    "handoff_dead_letter_rows",
    "handoff_paused_action_types",
    "handoff_consumer_sample_errors_total",
];

const ACTION: &str = "harbor:create-followup";

async fn status(addr: SocketAddr, path: &str) -> anyhow::Result<Option<u16>> {
    Ok(get(addr, path).await.ok().map(|(status, _)| status))
}

async fn metrics(addr: SocketAddr) -> anyhow::Result<String> {
    let (status, body) = get(addr, "/metrics").await?;
    anyhow::ensure!(status == 200, "/metrics answered {status}");
    Ok(body)
}

/// Waits until the endpoint at `addr` answers `/readyz` with 200 (`what` says which wait it is).
async fn until_ready(addr: SocketAddr, what: &str) {
    eventually(what, Duration::from_secs(60), || async {
        Ok((status(addr, "/readyz").await? == Some(200)).then_some(()))
    })
    .await
    .unwrap();
}

/// Waits until the series in the endpoint at `addr` has `value`.
async fn series_reaches(addr: SocketAddr, name: &str, value: f64) -> anyhow::Result<()> {
    eventually(&format!("{name} == {value}"), Duration::from_secs(120), || async {
        let text = metrics(addr).await?;
        Ok((series(&text, name) == Some(value)).then_some(()))
    })
    .await
}

#[tokio::test]
async fn metrics_of_running_binaries_show_a_backlog_rise_and_drain_to_zero() {
    const N: i64 = 2_000;
    let env = TestEnv::start().await.unwrap();
    let (relay_addr, consumer_addr) = (free_local_addr().unwrap(), free_local_addr().unwrap());
    let fast = |addr: SocketAddr| {
        vec![
            ("HANDOFF_HTTP_ADDR", addr.to_string()),
            ("HANDOFF_METRICS_SAMPLE_SECS", "1".to_owned()),
            // The blocker below must hold the rows back for as long as it is open.
            ("HANDOFF_RELAY_HELD_BACK_SECS", "3600".to_owned()),
            // A batch must not outlive its lease (the suite's 1 s) on a busy machine: a range
            // re-claimed and re-published as duplicates is counted twice in published_total.
            ("HANDOFF_RELAY_LEASE_SECS", "60".to_owned()),
        ]
    };
    let _relay = env.relay_process_with(&fast(relay_addr)).unwrap();
    let _consumer = env.consumer_process_with(&fast(consumer_addr)).unwrap();
    for addr in [relay_addr, consumer_addr] {
        until_ready(addr, "/readyz 200").await;
        assert_eq!(status(addr, "/healthz").await.unwrap(), Some(200));
    }
    // An open write transaction holds every row committed after it back: a backlog that stays.
    let mut blocker = sqlx::PgConnection::connect(&env.producer_url()).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT pg_current_xact_id();").execute(&mut blocker).await.unwrap();
    env.approve_many_via_sql(1, N).await.unwrap();
    series_reaches(relay_addr, "handoff_outbox_rows{state=\"pending\"}", N as f64).await.unwrap();
    let text = metrics(relay_addr).await.unwrap();
    assert_eq!(series(&text, "handoff_outbox_held_back_rows"), Some(N as f64), "{text}");
    assert!(series(&text, "handoff_outbox_held_back_transaction_age_seconds").unwrap() > 0.0, "{text}");
    assert!(series(&text, "handoff_outbox_oldest_pending_age_seconds").unwrap() > 0.0, "{text}");
    assert_eq!(env.tasks().await.unwrap(), 0, "nothing passes the open transaction");

    sqlx::raw_sql("COMMIT").execute(&mut blocker).await.unwrap();
    series_reaches(relay_addr, "handoff_outbox_rows{state=\"pending\"}", 0.0).await.unwrap();
    series_reaches(relay_addr, "handoff_outbox_oldest_pending_age_seconds", 0.0).await.unwrap();
    eventually("every task", Duration::from_secs(120), || async { Ok((env.tasks().await? >= N).then_some(())) })
        .await
        .unwrap();
    let text = metrics(relay_addr).await.unwrap();
    assert_eq!(series(&text, &format!("handoff_relay_published_total{{action=\"{ACTION}\"}}")), Some(N as f64));
    assert_eq!(series(&text, "handoff_outbox_held_back_rows"), Some(0.0), "{text}");
    let created = format!("handoff_consumer_messages_total{{action=\"{ACTION}\",outcome=\"created\"}}");
    series_reaches(consumer_addr, &created, N as f64).await.unwrap();
    series_reaches(consumer_addr, "handoff_consumer_pending_messages", 0.0).await.unwrap();
    assert_eq!(env.tasks().await.unwrap(), N);
    assert_eq!(env.stream_messages().await.unwrap(), N as u64);

    // After traffic every family is exposed (per-action series appear with their first row).
    let relay_text = metrics(relay_addr).await.unwrap();
    for name in RELAY_METRICS {
        assert!(has_metric(&relay_text, name), "relay /metrics lacks {name}:\n{relay_text}");
    }
    let consumer_text = metrics(consumer_addr).await.unwrap();
    for name in CONSUMER_METRICS {
        assert!(has_metric(&consumer_text, name), "consumer /metrics lacks {name}:\n{consumer_text}");
    }
    assert!(!relay_text.contains("case-") && !consumer_text.contains("case-"), "no operation key in any label");
    // New keys only: the binary records them as usual batches, one statement each.
    let one_statement = series(&consumer_text, "handoff_consumer_batches_total{path=\"one_statement\"}");
    assert!(one_statement.is_some_and(|n| n >= 1.0), "{consumer_text}");
}

#[tokio::test]
async fn readyz_is_503_while_the_database_is_unreachable_and_200_after() {
    let env = TestEnv::start().await.unwrap();
    let addr = free_local_addr().unwrap();
    let _relay = env.relay_process_with(&[("HANDOFF_HTTP_ADDR", addr.to_string())]).unwrap();
    until_ready(addr, "/readyz 200").await;

    // A paused container answers nothing: connections hang, as behind a dead network path.
    env.postgres.container().pause().await.unwrap();
    let (code, body) = get(addr, "/readyz").await.unwrap();
    env.postgres.container().unpause().await.unwrap();
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("\"name\":\"database\",\"ok\":false"), "{body}");
    assert!(body.contains("\"name\":\"nats\",\"ok\":true"), "{body}");

    until_ready(addr, "/readyz 200 again").await;
    env.approve("case-1", "after the outage").await.unwrap();
    eventually("published", Duration::from_secs(60), || async {
        Ok((env.outbox().await?.published == 1).then_some(()))
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn healthz_is_503_naming_the_loop_a_fault_hook_stalls() {
    let env = TestEnv::start().await.unwrap();
    let stall_after = Duration::from_secs(2);
    let relay = env.relay(handoff_relay::RelaySettings { stall_after, ..env.relay_settings() }).await.unwrap();
    let consumer =
        env.consumer(handoff_consumer::ConsumerSettings { stall_after, ..env.consumer_settings() }).await.unwrap();
    let token = CancellationToken::new();
    let mut addrs = Vec::new();
    for endpoint in [relay.endpoint(), consumer.endpoint()] {
        let listener = Endpoint::bind("127.0.0.1:0".parse().unwrap(), "test").await.unwrap();
        addrs.push(listener.local_addr().unwrap());
        tokio::spawn(endpoint.serve(listener, token.clone()));
    }
    let (relay_addr, consumer_addr) = (addrs[0], addrs[1]);
    let relay_faults = relay.clone();
    let relay_task = tokio::spawn(relay.run_until_stopped(token.clone()));
    let consumer_faults = consumer.clone();
    let consumer_task = tokio::spawn(consumer.run_until_stopped(token.clone()));
    for addr in [relay_addr, consumer_addr] {
        eventually("/healthz 200", Duration::from_secs(30), || async {
            Ok((status(addr, "/healthz").await? == Some(200)).then_some(()))
        })
        .await
        .unwrap();
    }

    // One relay worker hangs; so does the consumer's next batch, which the approval brings.
    relay_faults.faults().stall_worker.store(1, Ordering::SeqCst);
    consumer_faults.faults().stall_batch.store(1, Ordering::SeqCst);
    env.approve("case-1", "stalls the consumer").await.unwrap();
    for (addr, stalled) in [(relay_addr, "stalled: relay worker"), (consumer_addr, "stalled: consumer fetch loop")] {
        let body = eventually("/healthz 503", Duration::from_secs(30), || async {
            let (code, body) = get(addr, "/healthz").await?;
            Ok((code == 503).then_some(body))
        })
        .await
        .unwrap();
        assert!(body.contains(stalled), "{body}");
        // Only the stalled loop is named: the relay's other worker and the samplers still beat.
        assert_eq!(body.lines().count(), 1, "{body}");
    }
    assert_eq!(env.tasks().await.unwrap(), 0, "the stalled batch created nothing");
    token.cancel();
    relay_task.await.unwrap().unwrap();
    consumer_task.abort();
}

#[tokio::test]
async fn a_broker_outage_logs_one_warning_at_its_start_and_one_at_its_end_not_one_per_row() {
    const N: i64 = 500;
    let env = TestEnv::start().await.unwrap();
    let env_vars = [
        ("RUST_LOG", "info".to_owned()),
        // Retries soon after the broker is back, so the test does not wait out a long backoff.
        ("HANDOFF_RELAY_BACKOFF_INITIAL_MS", "100".to_owned()),
        ("HANDOFF_RELAY_BACKOFF_MAX_SECS", "1".to_owned()),
        ("HANDOFF_RELAY_MAX_ATTEMPTS", "1000".to_owned()),
    ];
    let relay = handoff_tests::ServiceProcess::spawn_capturing(
        "handoff-relay",
        &[env.service_env_for_relay(), env_vars.to_vec()].concat(),
    )
    .unwrap();
    eventually("the stream", Duration::from_secs(60), || async { Ok(env.stream_messages().await.ok()) }).await.unwrap();

    env.nats.stop().await.unwrap();
    env.approve_many_via_sql(1, N).await.unwrap();
    eventually("publishes to fail", Duration::from_secs(60), || async {
        Ok(relay.log_lines().iter().any(|l| l.contains("publishing to the stream failing")).then_some(()))
    })
    .await
    .unwrap();
    env.nats.start_again().await.unwrap();
    eventually("every row published", Duration::from_secs(120), || async {
        Ok((env.outbox().await?.published == N).then_some(()))
    })
    .await
    .unwrap();
    eventually("the recovery line", Duration::from_secs(30), || async {
        Ok(relay.log_lines().iter().any(|l| l.contains("publishing to the stream recovered")).then_some(()))
    })
    .await
    .unwrap();
    let lines = relay.log_lines();
    let warnings: Vec<&String> = lines.iter().filter(|l| l.contains(" WARN ")).collect();
    let failing = warnings.iter().filter(|l| l.contains("publishing to the stream failing")).count();
    let recovered = warnings.iter().filter(|l| l.contains("publishing to the stream recovered")).count();
    assert_eq!((failing, recovered), (1, 1), "{warnings:#?}");
    // The recovery says what the outage cost; no warning names a single row.
    let recovery = warnings.iter().find(|l| l.contains("recovered")).unwrap();
    assert!(recovery.contains("lasted_s=") && recovery.contains("affected="), "{recovery}");
    assert!(warnings.iter().all(|l| !l.contains("operation_key")), "{warnings:#?}");
    assert!(warnings.len() < 10, "{} warnings for {N} rows: {warnings:#?}", warnings.len());
    assert_eq!(env.stream_messages().await.unwrap(), N as u64);
    assert!(lines.iter().all(|l| !l.contains('\u{1b}')), "no ANSI colours when stderr is not a terminal");
}

#[tokio::test]
async fn the_relays_periodic_reconciliation_exports_what_the_broker_lost() {
    const N: i64 = 20;
    let env = TestEnv::start().await.unwrap();
    let addr = free_local_addr().unwrap();
    let _relay = env
        .relay_process_with(&[
            ("HANDOFF_HTTP_ADDR", addr.to_string()),
            ("HANDOFF_RECONCILE_INTERVAL_SECS", "1".to_owned()),
            ("HANDOFF_RECONCILE_LOOKBACK_SECS", "3600".to_owned()),
        ])
        .unwrap();
    eventually("the stream", Duration::from_secs(60), || async { Ok(env.stream_messages().await.ok()) }).await.unwrap();
    env.approve_many_via_sql(1, N).await.unwrap();
    eventually("every row published", Duration::from_secs(60), || async {
        Ok((env.outbox().await?.published == N).then_some(()))
    })
    .await
    .unwrap();
    let stream = env.js.get_stream(&env.stream).await.unwrap();
    for sequence in [3, 7] {
        assert!(stream.delete_message(sequence).await.unwrap());
    }
    series_reaches(addr, "handoff_reconcile_mismatches{kind=\"lost_by_broker\"}", 2.0).await.unwrap();
    let text = metrics(addr).await.unwrap();
    assert_eq!(series(&text, "handoff_reconcile_mismatches{kind=\"sequence_reused\"}"), Some(0.0), "{text}");
    assert!(series(&text, "handoff_reconcile_runs_total").unwrap() >= 1.0, "{text}");
}

#[tokio::test]
async fn the_healthcheck_subcommand_asks_the_running_service_and_exits_by_its_answer() {
    let env = TestEnv::start().await.unwrap();
    let addr = free_local_addr().unwrap();
    let _relay = env.relay_process_with(&[("HANDOFF_HTTP_ADDR", addr.to_string())]).unwrap();
    until_ready(addr, "/readyz 200").await;
    // As a container healthcheck runs it: the service's own settings, the wildcard address.
    let check = |http_addr: String, args: &'static [&'static str]| {
        let database = env.relay_url();
        async move {
            handoff_tests::process::run_binary(
                "handoff-relay",
                &[("DATABASE_URL", database), ("HANDOFF_HTTP_ADDR", http_addr)],
                args,
                Duration::from_secs(30),
            )
            .await
            .unwrap()
        }
    };
    let wildcard = format!("0.0.0.0:{}", addr.port());
    let ok = check(wildcard.clone(), &["healthcheck"]).await.expect_code(0).unwrap();
    assert!(ok.stdout.contains("/healthz: 200"), "{}", ok.stdout);
    check(wildcard, &["healthcheck", "--path", "/readyz"]).await.expect_code(0).unwrap();
    let nobody = free_local_addr().unwrap().to_string();
    let down = check(nobody, &["healthcheck"]).await.expect_code(1).unwrap();
    assert!(down.stderr.lines().last().unwrap_or_default().contains("/healthz"), "{}", down.stderr);
    let off = check(String::new(), &["healthcheck"]).await.expect_code(1).unwrap();
    assert!(off.stderr.contains("the endpoint is off"), "{}", off.stderr);
}
