//! The remote CRM: every outcome the seeds name, proven by counting provider effects in the CRM
//! simulator. A lost reply is never retried blindly; what cannot be proven goes to review.

use std::time::Duration;

use handoff_consumer::Handled;
use handoff_consumer::remote::LedgerState;
use handoff_consumer::remote::dispatcher::{DispatchSettings, Dispatched, Dispatcher};
use handoff_consumer::remote::{Adapter, Capability};
use handoff_consumer::review;
use handoff_crm_sim::{Fault, FaultKind, SimConfig};
use handoff_tests::remote::SimHandle;
use handoff_tests::{SEED_TITLE, TestEnv, eventually};

pub(crate) const KEY: &str = "harbor:create-followup:v1:case-104";
pub(crate) const WAIT: Duration = Duration::from_secs(5);

/// Approves `case`, publishes it and lets a remote-mode replica take it into the ledger.
pub(crate) async fn deliver(env: &TestEnv, cases: &[&str]) {
    let relay = env.relay(env.relay_settings()).await.unwrap();
    let consumer = env.remote_consumer().await.unwrap();
    for case in cases {
        env.approve(case, SEED_TITLE).await.unwrap();
    }
    assert_eq!(relay.publish_batch().await.unwrap().published, cases.len());
    let handled = consumer.fetch_and_handle(WAIT).await.unwrap();
    assert_eq!(handled.len(), cases.len());
    assert!(handled.iter().all(|h| matches!(h, Handled::Accepted { .. })), "{handled:?}");
}

pub(crate) async fn setup(config: SimConfig) -> (TestEnv, SimHandle) {
    setup_with_window(config, Duration::from_secs(120)).await
}

async fn setup_with_window(config: SimConfig, duplicate_window: Duration) -> (TestEnv, SimHandle) {
    let env = TestEnv::start_with_window(duplicate_window).await.unwrap();
    let sim = env.crm_sim(config).await.unwrap();
    (env, sim)
}

async fn dispatcher(env: &TestEnv, sim: &SimHandle, capability: Capability) -> Dispatcher {
    env.dispatcher(env.sim_crm(sim, capability), env.dispatch_settings()).await.unwrap()
}

/// Dispatches until `key` reaches a decided state (bounded); returns every step taken.
pub(crate) async fn until_decided(dispatcher: &Dispatcher, env: &TestEnv, key: &str) -> Vec<Dispatched> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut steps = Vec::new();
    loop {
        steps.extend(dispatcher.dispatch_due().await.unwrap());
        let state = env.ledger_state(key).await.unwrap();
        if state == LedgerState::Settled || state == LedgerState::Review {
            return steps;
        }
        assert!(tokio::time::Instant::now() < deadline, "no decision for {key} after {steps:?}");
        // Readbacks and retries fall due by time; look again shortly.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub(crate) fn calls(steps: &[Dispatched]) -> Vec<(&'static str, LedgerState)> {
    steps.iter().map(|d| (d.call, d.state)).collect()
}

/// The steps taken for `key` only (a dispatcher works every due key at once).
pub(crate) fn calls_for(steps: &[Dispatched], key: &str) -> Vec<(&'static str, LedgerState)> {
    steps.iter().filter(|d| d.operation_key == key).map(|d| (d.call, d.state)).collect()
}

#[tokio::test]
async fn a_reply_lost_after_the_crm_committed_is_settled_by_readback_without_a_second_create() {
    let (env, sim) = setup(SimConfig::default()).await;
    deliver(&env, &["case-104"]).await;
    sim.sim.faults().inject(Fault::once_for(KEY, FaultKind::LoseReplyAfterCommit));
    let dispatcher = dispatcher(&env, &sim, Capability::ExternalId).await;

    let steps = until_decided(&dispatcher, &env, KEY).await;
    assert_eq!(calls(&steps), [("create", LedgerState::Unknown), ("readback", LedgerState::Settled)]);
    assert_eq!((sim.effects().await.unwrap(), sim.creates()), (1, 1));
    let proof: String = sqlx::query_scalar("SELECT proof FROM handoff_consumer.crm_operation")
        .fetch_one(&env.consumer_db)
        .await
        .unwrap();
    assert_eq!(proof, "readback_by_external_id");

    // The operator's view of the same key, from the binary.
    let explained = env.admin(&["explain", KEY]).await.unwrap().expect_code(0).unwrap().stdout;
    assert!(explained.contains("verdict: settled in the remote CRM: task"), "{explained}");
    assert!(explained.contains("attempt #1"), "{explained}");
    assert!(explained.contains("readback"), "{explained}");
    assert!(explained.contains("-> settled"), "{explained}");
}

#[tokio::test]
async fn unavailable_readback_goes_to_review_after_its_window_with_no_retry() {
    let (env, sim) = setup(SimConfig::default()).await;
    deliver(&env, &["case-104"]).await;
    sim.sim.faults().inject(Fault::once_for(KEY, FaultKind::LoseReplyAfterCommit));
    sim.sim.faults().inject(Fault { target: Some(KEY.into()), kind: FaultKind::ReadbackUnavailable, times: None });
    let settings = DispatchSettings { readback_interval: Duration::from_millis(200), ..env.dispatch_settings() };
    let dispatcher = env.dispatcher(env.sim_crm(&sim, Capability::ExternalId), settings).await.unwrap();

    let steps = until_decided(&dispatcher, &env, KEY).await;
    assert_eq!(steps.first().map(|d| (d.call, d.state)), Some(("create", LedgerState::Unknown)));
    assert_eq!(steps.last().map(|d| (d.call, d.state)), Some(("readback", LedgerState::Review)));
    assert!(steps.len() > 2, "readbacks were retried before giving up: {steps:?}");
    assert!(
        steps[1..steps.len() - 1].iter().all(|d| (d.call, d.state) == ("readback", LedgerState::Unknown)),
        "{steps:?}"
    );
    assert!(steps.last().unwrap().note.contains("readback unavailable"), "{steps:?}");
    assert_eq!((sim.effects().await.unwrap(), sim.creates()), (1, 1), "never retried");
    assert!(dispatcher.dispatch_due().await.unwrap().is_empty(), "review is not picked up again");

    let explained = env.admin(&["explain", KEY]).await.unwrap().expect_code(0).unwrap().stdout;
    assert!(explained.contains("verdict: waiting for a person (review)"), "{explained}");
    assert!(explained.contains("readback unavailable"), "{explained}");
    let listed = env.admin(&["list", "--state", "review"]).await.unwrap().expect_code(0).unwrap().stdout;
    assert!(listed.starts_with("review") && listed.contains(KEY), "{listed}");
}

#[tokio::test]
async fn readback_proving_non_execution_allows_exactly_one_new_attempt_with_the_same_key() {
    let (env, sim) = setup(SimConfig::default()).await;
    deliver(&env, &["case-104"]).await;
    // The connection drops before the CRM stores anything: the caller cannot tell.
    sim.sim.faults().inject(Fault::once_for(KEY, FaultKind::ResetBeforeCommit));
    let dispatcher = dispatcher(&env, &sim, Capability::ExternalId).await;

    let steps = until_decided(&dispatcher, &env, KEY).await;
    // Readbacks inside the absence grace find nothing but do not count as proof yet.
    let decisive: Vec<_> = calls(&steps).into_iter().filter(|c| *c != ("readback", LedgerState::Unknown)).collect();
    assert_eq!(
        decisive,
        [
            ("create", LedgerState::Unknown),
            ("readback", LedgerState::ProvedNotExecuted),
            ("create", LedgerState::Settled)
        ]
    );
    assert_eq!((sim.effects().await.unwrap(), sim.creates()), (1, 2));
}

#[tokio::test]
async fn different_content_at_the_crm_for_the_key_is_a_conflict_for_review_with_no_second_effect() {
    let (env, sim) = setup(SimConfig::default()).await;
    sim.seed_task(KEY, &"0".repeat(64), serde_json::json!({"title": "someone else's follow-up"})).await.unwrap();
    deliver(&env, &["case-104"]).await;
    let dispatcher = dispatcher(&env, &sim, Capability::ExternalId).await;

    let steps = until_decided(&dispatcher, &env, KEY).await;
    assert_eq!(calls(&steps), [("create", LedgerState::Review)]);
    assert!(steps[0].note.contains("conflict"), "{steps:?}");
    assert_eq!(sim.effects().await.unwrap(), 1, "only the seeded task");
}

#[tokio::test]
async fn two_replicas_dispatching_the_same_key_at_once_make_one_crm_call() {
    let (env, sim) = setup(SimConfig::default()).await;
    deliver(&env, &["case-104"]).await;
    // Hold the create long enough that both replicas are certainly inside dispatch at once.
    sim.sim.faults().inject(Fault::once_for(KEY, FaultKind::Slow(Duration::from_millis(300))));
    let (a, b) =
        (dispatcher(&env, &sim, Capability::ExternalId).await, dispatcher(&env, &sim, Capability::ExternalId).await);
    let (from_a, from_b) = tokio::join!(a.dispatch_due(), b.dispatch_due());
    let (from_a, from_b) = (from_a.unwrap(), from_b.unwrap());
    assert_eq!(from_a.len() + from_b.len(), 1, "{from_a:?} {from_b:?}");
    assert_eq!((sim.effects().await.unwrap(), sim.creates()), (1, 1));
    assert_eq!(env.ledger_state(KEY).await.unwrap(), LedgerState::Settled);
}

#[tokio::test]
async fn statuses_the_destination_documents_as_not_executed_are_retried_with_backoff_and_make_one_effect() {
    let (env, sim) = setup(SimConfig::default()).await;
    deliver(&env, &["case-104"]).await;
    sim.sim.faults().inject(Fault::once_for(KEY, FaultKind::RateLimited { retry_after: Duration::from_secs(1) }));
    // The simulator refuses with 429 and 503 before doing any work, and says so: declared.
    let crm = env.sim_crm_with(&sim, Capability::ExternalId, "connect-failure,429,503".parse().unwrap());
    let dispatcher = env.dispatcher(crm, env.dispatch_settings()).await.unwrap();

    assert_eq!(calls(&dispatcher.dispatch_due().await.unwrap()), [("create", LedgerState::Received)]);
    let wait: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM next_attempt_at - updated_at)::float8 FROM handoff_consumer.crm_operation",
    )
    .fetch_one(&env.consumer_db)
    .await
    .unwrap();
    assert!(wait >= 1.0, "Retry-After honoured, next attempt in {wait}s");
    assert!(dispatcher.dispatch_due().await.unwrap().is_empty(), "not due before Retry-After");

    sim.sim.faults().inject(Fault::once_for(KEY, FaultKind::FailBeforeCommit));
    let steps = until_decided(&dispatcher, &env, KEY).await;
    assert_eq!(calls(&steps), [("create", LedgerState::Received), ("create", LedgerState::Settled)]);
    assert_eq!((sim.effects().await.unwrap(), sim.creates()), (1, 3));
}

/// By default no status proves non-execution: behind a gateway a 503 can follow a committed
/// request. The same fault with and without the rule: declared "503 = not executed" against a
/// destination that does not keep that promise makes a second task (the hazard); the default
/// reads back first and makes one.
#[tokio::test]
async fn a_503_proves_nothing_by_default_so_a_gateway_503_after_commit_settles_by_readback() {
    // Unique external ids off: nothing at the destination would catch a second create.
    let (env, sim) = setup(SimConfig { enforce_unique_external_id: false, ..SimConfig::default() }).await;
    deliver(&env, &["case-104", "case-106"]).await;
    let faults = sim.sim.faults();
    faults.inject(Fault::once_for(KEY, FaultKind::Gateway503AfterCommit));
    let rate_limited = "harbor:create-followup:v1:case-106";
    faults.inject(Fault::once_for(rate_limited, FaultKind::RateLimited { retry_after: Duration::from_secs(1) }));

    let default = dispatcher(&env, &sim, Capability::ExternalId).await;
    let mut steps = until_decided(&default, &env, KEY).await;
    assert_eq!(calls_for(&steps, KEY), [("create", LedgerState::Unknown), ("readback", LedgerState::Settled)]);
    assert!(steps[0].note.contains("outcome unknown"), "{steps:?}");
    // A 429 under the default rule is unknown too; its Retry-After delays the readback.
    steps.extend(until_decided(&default, &env, rate_limited).await);
    let steps: Vec<_> = steps.into_iter().filter(|d| d.operation_key == rate_limited).collect();
    let decisive: Vec<_> = calls(&steps).into_iter().filter(|c| *c != ("readback", LedgerState::Unknown)).collect();
    assert_eq!(
        decisive,
        [
            ("create", LedgerState::Unknown),
            ("readback", LedgerState::ProvedNotExecuted),
            ("create", LedgerState::Settled)
        ]
    );
    assert!(steps[0].note.contains("read back in 1000ms"), "Retry-After honoured: {steps:?}");

    let trusting = env
        .dispatcher(env.sim_crm_with(&sim, Capability::ExternalId, "503".parse().unwrap()), env.dispatch_settings())
        .await
        .unwrap();
    let hazard = "harbor:create-followup:v1:case-105";
    deliver(&env, &["case-105"]).await;
    faults.inject(Fault::once_for(hazard, FaultKind::Gateway503AfterCommit));
    let steps = until_decided(&trusting, &env, hazard).await;
    assert_eq!(calls(&steps)[0], ("create", LedgerState::Received), "the 503 was taken as proof: {steps:?}");
    let report = sim.sim.report().await.unwrap();
    let tasks_of = |key: &str| report.tasks.iter().filter(|t| t.external_id == key).count();
    assert_eq!((tasks_of(KEY), tasks_of(rate_limited)), (1, 1), "the default rule: one task each");
    assert_eq!(tasks_of(hazard), 2, "a rule the destination does not keep duplicates");
}

/// With an idempotency key the CRM still retains, an unavailable readback is no reason to wait
/// for a person: the create is sent again with the same key, which returns the original task
/// (reply lost after commit) or creates the missing one (reset before commit). One task each.
#[tokio::test]
async fn with_readback_unavailable_a_retained_idempotency_key_is_replayed_and_makes_one_effect() {
    let (env, sim) = setup(SimConfig::default()).await;
    deliver(&env, &["case-104", "case-105"]).await;
    let never_stored = "harbor:create-followup:v1:case-105";
    let faults = sim.sim.faults();
    faults.inject(Fault::once_for(KEY, FaultKind::LoseReplyAfterCommit));
    faults.inject(Fault::once_for(never_stored, FaultKind::ResetBeforeCommit));
    for key in [KEY, never_stored] {
        faults.inject(Fault { target: Some(key.into()), kind: FaultKind::ReadbackUnavailable, times: None });
    }
    let keyed = Capability::IdempotencyKey { retention: Duration::from_secs(3600) };
    let dispatcher = dispatcher(&env, &sim, keyed).await;

    let mut steps = Vec::new();
    for key in [KEY, never_stored] {
        steps.extend(until_decided(&dispatcher, &env, key).await);
    }
    for key in [KEY, never_stored] {
        assert_eq!(
            calls_for(&steps, key),
            [("create", LedgerState::Unknown), ("readback", LedgerState::Replay), ("replay", LedgerState::Settled)],
            "{key}"
        );
        let proof: String =
            sqlx::query_scalar("SELECT proof FROM handoff_consumer.crm_operation WHERE operation_key = $1")
                .bind(key)
                .fetch_one(&env.consumer_db)
                .await
                .unwrap();
        assert_eq!(proof, "replay_by_key");
    }
    let report = sim.sim.report().await.unwrap();
    assert_eq!((report.effects, report.requests.creates), (2, 4), "one task per key, two creates each");
    let explained = env.admin(&["explain", KEY]).await.unwrap().expect_code(0).unwrap().stdout;
    assert!(explained.contains("replay with the same key"), "{explained}");
}

/// Seed 001: "an old response arrives after a new attempt began". A replica's create is held at
/// the CRM past its lease; another replica takes the key over and reads back; then the old reply
/// arrives. It is kept as evidence (`lease_lost`) and changes nothing: the row is decided by the
/// replica that holds it, and the CRM has one task.
#[tokio::test]
async fn a_reply_arriving_after_the_lease_was_taken_over_changes_nothing() {
    let (env, sim) = setup(SimConfig::default()).await;
    deliver(&env, &["case-104"]).await;
    sim.sim.faults().inject(Fault::once_for(KEY, FaultKind::HoldUntilReleased));
    // A lease shorter than the call: only possible in process (the binary refuses it).
    let short_lease = DispatchSettings { lease: Duration::from_millis(300), ..env.dispatch_settings() };
    let mut slow_http = env.http_settings(&sim);
    slow_http.timeout = Duration::from_secs(30);
    let slow_crm = handoff_consumer::remote::connect(
        Adapter::TasksApi,
        slow_http,
        Capability::ExternalId,
        Adapter::TasksApi.default_mapping(),
    )
    .unwrap();
    let old = env.dispatcher(slow_crm, short_lease).await.unwrap();
    let old_call = tokio::spawn(async move { old.dispatch_due().await });
    eventually("the old create to be held at the CRM", WAIT, || async {
        Ok((sim.sim.faults().held() == 1).then_some(()))
    })
    .await
    .unwrap();
    eventually("the old lease to expire", WAIT, || async {
        let expired: bool = sqlx::query_scalar(
            "SELECT lease_until < now() FROM handoff_consumer.crm_operation WHERE operation_key = $1",
        )
        .bind(KEY)
        .fetch_one(&env.consumer_db)
        .await?;
        Ok(expired.then_some(()))
    })
    .await
    .unwrap();

    // The new attempt begins: the takeover reads back (nothing yet: the old create is unprocessed).
    let new = dispatcher(&env, &sim, Capability::ExternalId).await;
    assert_eq!(calls(&new.dispatch_due().await.unwrap()), [("readback", LedgerState::Unknown)]);
    // The old reply arrives now: a 201 with the task.
    sim.sim.faults().release_held();
    let old_steps = old_call.await.unwrap().unwrap();
    assert!(old_steps.is_empty(), "the old claim's decision was not applied: {old_steps:?}");
    let lost: Vec<String> = sqlx::query_scalar(
        "SELECT evidence FROM handoff_consumer.crm_event WHERE operation_key = $1 AND state_after = 'lease_lost' ORDER BY id",
    )
    .bind(KEY)
    .fetch_all(&env.consumer_db)
    .await
    .unwrap();
    assert!(lost.iter().any(|e| e.contains("-> 201")), "the late receipt is kept as evidence: {lost:?}");
    assert_eq!(env.ledger_state(KEY).await.unwrap(), LedgerState::Unknown, "the late reply decided nothing");

    // The holder reads back and settles on what the CRM really has.
    let steps = until_decided(&new, &env, KEY).await;
    assert_eq!(calls(&steps), [("readback", LedgerState::Settled)]);
    assert_eq!((sim.effects().await.unwrap(), sim.creates()), (1, 1));
}

#[tokio::test]
async fn validation_and_auth_errors_go_to_review_at_once_without_retry() {
    let (env, sim) = setup(SimConfig::default()).await;
    deliver(&env, &["case-104", "case-105"]).await;
    sim.sim.faults().inject(Fault::once_for(KEY, FaultKind::ValidationError));
    sim.sim.faults().inject(Fault::once_for("harbor:create-followup:v1:case-105", FaultKind::AuthError));
    let dispatcher = dispatcher(&env, &sim, Capability::ExternalId).await;

    let steps = dispatcher.dispatch_due().await.unwrap();
    assert_eq!(steps.len(), 2);
    assert!(steps.iter().all(|d| d.state == LedgerState::Review && d.note.contains("not retryable")), "{steps:?}");
    assert!(dispatcher.dispatch_due().await.unwrap().is_empty());
    assert_eq!((sim.effects().await.unwrap(), sim.creates()), (0, 2));
}

#[tokio::test]
async fn a_query_only_crm_lookup_inside_the_visibility_lag_is_not_taken_as_absence() {
    let lag = Duration::from_secs(2);
    let (env, sim) = setup(SimConfig { query_visibility_lag: lag, ..SimConfig::default() }).await;
    deliver(&env, &["case-104"]).await;
    sim.sim.faults().inject(Fault::once_for(KEY, FaultKind::LoseReplyAfterCommit));
    let capability = Capability::QueryOnly { freshness: Duration::from_secs(3) };
    let dispatcher = dispatcher(&env, &sim, capability).await;

    let steps = until_decided(&dispatcher, &env, KEY).await;
    assert_eq!(steps.first().map(|d| (d.call, d.state)), Some(("create", LedgerState::Unknown)));
    // At least one search ran inside the lag and found nothing, and it was not taken as proof.
    assert!(
        steps.iter().any(|d| d.call == "readback" && d.state == LedgerState::Unknown && d.note.contains("lag")),
        "{steps:?}"
    );
    assert_eq!(steps.last().map(|d| (d.call, d.state)), Some(("readback", LedgerState::Settled)));
    assert_eq!((sim.effects().await.unwrap(), sim.creates()), (1, 1));
}

#[tokio::test]
async fn an_idempotency_key_forgotten_by_the_crm_while_unknown_goes_to_review_not_a_blind_retry() {
    let retention = Duration::from_secs(1);
    let (env, sim) = setup(SimConfig { idempotency_retention: retention, ..SimConfig::default() }).await;
    deliver(&env, &["case-104"]).await;
    sim.sim.faults().inject(Fault::once_for(KEY, FaultKind::LoseReplyAfterCommit));
    let dispatcher = dispatcher(&env, &sim, Capability::IdempotencyKey { retention }).await;
    assert_eq!(calls(&dispatcher.dispatch_due().await.unwrap()), [("create", LedgerState::Unknown)]);

    // The dispatcher is away until the CRM has forgotten the key.
    let client = reqwest::Client::new();
    eventually("the CRM to forget the key", Duration::from_secs(30), || async {
        let status = client
            .get(format!("{}/v1/tasks/by-key/{KEY}", sim.url))
            .bearer_auth(SimConfig::default().auth_token)
            .send()
            .await?
            .status();
        Ok((status == reqwest::StatusCode::NOT_FOUND).then_some(()))
    })
    .await
    .unwrap();
    let steps = until_decided(&dispatcher, &env, KEY).await;
    assert_eq!(calls(&steps), [("none", LedgerState::Review)]);
    assert!(steps[0].note.contains("retention"), "{steps:?}");
    assert_eq!((sim.effects().await.unwrap(), sim.creates()), (1, 1));
}

#[tokio::test]
async fn operators_resolve_by_receipt_or_by_approving_one_new_attempt_with_audit_and_export() {
    let (env, sim) = setup(SimConfig::default()).await;
    let lost = KEY;
    let never_sent = "harbor:create-followup:v1:case-105";
    deliver(&env, &["case-104", "case-105"]).await;
    sim.sim.faults().inject(Fault::once_for(lost, FaultKind::LoseReplyAfterCommit));
    sim.sim.faults().inject(Fault::once_for(never_sent, FaultKind::ResetBeforeCommit));
    // A destination with no readback: every unknown outcome goes to a person.
    let dispatcher = dispatcher(&env, &sim, Capability::Nothing).await;
    let steps = dispatcher.dispatch_due().await.unwrap();
    assert!(steps.iter().all(|d| d.state == LedgerState::Review), "{steps:?}");

    // Export: non-secret fields only, no payload bodies.
    let rows = review::list(&env.consumer_db, &[LedgerState::Unknown, LedgerState::Review]).await.unwrap();
    assert_eq!(rows.len(), 2);
    let csv = review::export(&rows, review::ExportFormat::Csv).unwrap();
    let json = review::export(&rows, review::ExportFormat::Json).unwrap();
    assert!(csv.starts_with("operation_key,account,state,attempts,receipt_ref,note,created_at,updated_at\n"), "{csv}");
    assert!(csv.contains(lost) && csv.contains(never_sent) && csv.contains(",review,1,"), "{csv}");
    for export in [&csv, &json] {
        assert!(!export.contains(SEED_TITLE) && !export.contains("sim-token"), "{export}");
    }
    let parsed: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(parsed.as_array().unwrap().len(), 2);

    // The person finds the lost task in the CRM and records its receipt.
    let task_id = sim.sim.report().await.unwrap().tasks[0].task_id.clone();
    review::resolve_with_receipt(&env.consumer_db, lost, None, &task_id, "ops-ana", "found in CRM by external id")
        .await
        .unwrap();
    // The other was never stored (the CRM shows no task for it): one new attempt is approved.
    assert_eq!(sim.effects().await.unwrap(), 1);
    review::approve_new_attempt(
        &env.consumer_db,
        never_sent,
        None,
        "ops-ana",
        "CRM has no task for the key; checked by hand",
    )
    .await
    .unwrap();
    assert_eq!(calls(&dispatcher.dispatch_due().await.unwrap()), [("create", LedgerState::Settled)]);

    // Refusals change nothing: no actor, or a row that is already decided.
    assert!(matches!(
        review::approve_new_attempt(&env.consumer_db, lost, None, "ops-ana", "again").await,
        Err(review::ReviewError::NotResolvable { .. })
    ));
    assert!(matches!(
        review::resolve_with_receipt(&env.consumer_db, never_sent, None, "T-1", " ", "x").await,
        Err(review::ReviewError::Missing("actor"))
    ));

    let history = review::history(&env.consumer_db, lost, None).await.unwrap();
    assert_eq!(history.operation.state, LedgerState::Settled);
    assert_eq!(history.operation.receipt_ref.as_deref(), Some(task_id.as_str()));
    assert_eq!(history.audit.len(), 1);
    assert_eq!((history.audit[0].actor.as_str(), history.audit[0].action.as_str()), ("ops-ana", "record_receipt"));
    assert!(history.events.iter().any(|e| e.kind == "operator"));
    let audits: i64 =
        sqlx::query_scalar("SELECT count(*) FROM handoff_consumer.audit").fetch_one(&env.consumer_db).await.unwrap();
    assert_eq!(audits, 2);
    assert_eq!((sim.effects().await.unwrap(), sim.creates()), (2, 3));
}

#[tokio::test]
async fn a_changed_payload_while_reconciliation_is_pending_is_refused_and_needs_a_new_key() {
    // A 1 s broker window, so the forged re-publish below is stored rather than deduplicated.
    let (env, sim) = setup_with_window(SimConfig::default(), Duration::from_secs(1)).await;
    deliver(&env, &["case-104"]).await;
    sim.sim.faults().inject(Fault::once_for(KEY, FaultKind::LoseReplyAfterCommit));
    sim.sim.faults().inject(Fault { target: Some(KEY.into()), kind: FaultKind::ReadbackUnavailable, times: None });
    let settings = DispatchSettings { readback_window: Duration::from_secs(3600), ..env.dispatch_settings() };
    let dispatcher = env.dispatcher(env.sim_crm(&sim, Capability::ExternalId), settings).await.unwrap();
    assert_eq!(calls(&dispatcher.dispatch_due().await.unwrap()), [("create", LedgerState::Unknown)]);

    // The producer refuses the edit outright...
    assert!(matches!(
        env.approve("case-104", "Call about a different plan").await,
        Err(handoff_relay::RecordError::Conflict(_))
    ));
    // ...and a forged message with the edited payload under the same key is a conflict at intake.
    let edited = handoff_shared::Envelope {
        key: KEY.parse().unwrap(),
        payload: handoff_shared::CanonicalPayload::new(serde_json::json!({"case_id": "case-104", "title": "edited"}))
            .unwrap(),
        approval: handoff_shared::Approval::new("user-17", chrono::Utc::now()).unwrap(),
        source: "/test".into(),
        time: chrono::Utc::now(),
        traceparent: None,
    };
    eventually("the broker to store the edited message", Duration::from_secs(30), || async {
        let ack = env
            .js
            .send_publish(
                env.subjects.for_key(&edited.key),
                async_nats::jetstream::message::PublishMessage::build()
                    // A producer's bug, not a forgery: signed like every message.
                    .payload(env.signed(&edited, handoff_shared::envelope::SCHEMA_VERSION))
                    .message_id("harbor:create-followup:v1:case-104"),
            )
            .await?
            .await?;
        Ok((!ack.duplicate).then_some(()))
    })
    .await
    .unwrap();
    let consumer = env.remote_consumer().await.unwrap();
    let mut handled = Vec::new();
    for _ in 0..10 {
        handled.extend(consumer.fetch_and_handle(Duration::from_secs(1)).await.unwrap());
        if !handled.is_empty() {
            break;
        }
    }
    assert!(matches!(handled.as_slice(), [Handled::Conflict { .. }]), "{handled:?}");
    let (ledger_state, ledger_hash): (LedgerState, String) =
        sqlx::query_as("SELECT state, payload_hash FROM handoff_consumer.crm_operation WHERE operation_key = $1")
            .bind(KEY)
            .fetch_one(&env.consumer_db)
            .await
            .unwrap();
    assert_eq!(ledger_state, LedgerState::Unknown, "the pending reconciliation is untouched");
    assert_ne!(ledger_hash, edited.payload.hash().to_string(), "and still carries the approved payload");
    let reviews: i64 =
        sqlx::query_scalar("SELECT count(*) FROM handoff_consumer.review").fetch_one(&env.consumer_db).await.unwrap();
    assert_eq!(reviews, 1, "the edit is recorded for review");
    assert_eq!((sim.effects().await.unwrap(), sim.creates()), (1, 1));
}

/// The dispatcher as replicas run it (`run_until_stopped`: a pipeline of calls, decisions recorded
/// in batches), on two replicas at once, while the CRM loses a reply after committing, fails one
/// create before committing and rate-limits another: every action ends settled with exactly one
/// CRM task, and both dispatchers stop cleanly when asked.
#[tokio::test]
async fn running_dispatchers_on_two_replicas_settle_every_action_once_through_failures() {
    const N: i64 = 120;
    let (env, sim) = setup(SimConfig::default()).await;
    let relay = env.relay(env.relay_settings()).await.unwrap();
    let consumer = env.remote_consumer().await.unwrap();
    env.approve_many_via_sql(1, N).await.unwrap();
    let mut published = 0;
    while published < N as usize {
        published += relay.publish_batch().await.unwrap().published;
    }
    let mut accepted = 0;
    while accepted < N as usize {
        let handled = consumer.fetch_and_handle(WAIT).await.unwrap();
        assert!(handled.iter().all(|h| matches!(h, Handled::Accepted { .. })), "{handled:?}");
        accepted += handled.len();
    }
    let faults = sim.sim.faults();
    faults.inject(Fault::once_for("harbor:create-followup:v1:case-7", FaultKind::LoseReplyAfterCommit));
    faults.inject(Fault::once_for("harbor:create-followup:v1:case-8", FaultKind::FailBeforeCommit));
    faults.inject(Fault::once_for(
        "harbor:create-followup:v1:case-9",
        FaultKind::RateLimited { retry_after: Duration::ZERO },
    ));

    let stop = tokio_util::sync::CancellationToken::new();
    // Rows claimed ahead too: a lease leaving 2.5 s to wait for a slot.
    let settings =
        DispatchSettings { in_flight: 4, claim_ahead: 4, lease: Duration::from_secs(8), ..env.dispatch_settings() };
    assert_eq!(settings.effective_claim_ahead(), 4);
    let mut replicas = tokio::task::JoinSet::new();
    for _ in 0..2 {
        let dispatcher = env.dispatcher(env.sim_crm(&sim, Capability::ExternalId), settings.clone()).await.unwrap();
        replicas.spawn(dispatcher.run_until_stopped(stop.clone()));
    }
    let counts = eventually("every action decided", Duration::from_secs(60), || async {
        let counts = handoff_consumer::remote::ledger::count_by_state(&env.consumer_db).await?;
        let decided = counts.get(&LedgerState::Settled).copied().unwrap_or(0)
            + counts.get(&LedgerState::Review).copied().unwrap_or(0);
        Ok((decided == N).then_some(counts))
    })
    .await
    .unwrap();
    stop.cancel();
    while let Some(stopped) = replicas.join_next().await {
        stopped.unwrap().unwrap();
    }

    assert_eq!(counts.get(&LedgerState::Settled).copied(), Some(N), "{counts:?}");
    let report = sim.sim.report().await.unwrap();
    assert_eq!(report.effects, N, "one CRM task per action");
    let mut external_ids: Vec<&str> = report.tasks.iter().map(|t| t.external_id.as_str()).collect();
    external_ids.sort_unstable();
    external_ids.dedup();
    assert_eq!(external_ids.len() as i64, N, "no action has two tasks");
    // The lost reply was settled by reading back, not by a second create.
    let proof: String = sqlx::query_scalar("SELECT proof FROM handoff_consumer.crm_operation WHERE operation_key = $1")
        .bind("harbor:create-followup:v1:case-7")
        .fetch_one(&env.consumer_db)
        .await
        .unwrap();
    assert_eq!(proof, "readback_by_external_id");
    // Every call and its decision is in the event log, one row per call, once per claim.
    let decisions: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM handoff_consumer.crm_event WHERE decision IS NOT NULL AND state_after = 'settled'",
    )
    .fetch_one(&env.consumer_db)
    .await
    .unwrap();
    assert_eq!(decisions, N);
}

/// Rows claimed ahead of a free slot (`claim_ahead`) wait while every slot is busy, and a
/// dispatcher stopping with some releases them unsent: the attempt their claim counted is undone,
/// no evidence is written (nothing reached the CRM), and the next dispatcher sends each once.
#[tokio::test]
async fn rows_claimed_ahead_wait_for_a_slot_and_a_stopping_dispatcher_releases_them_unsent() {
    let (env, sim) = setup(SimConfig::default()).await;
    deliver(&env, &["case-1", "case-2", "case-3"]).await;
    // The first create, whichever key it carries, waits at the CRM until released.
    sim.sim.faults().inject(Fault { target: None, kind: FaultKind::HoldUntilReleased, times: Some(1) });
    let mut slow_http = env.http_settings(&sim);
    slow_http.timeout = Duration::from_secs(30);
    let crm = handoff_consumer::remote::connect(
        Adapter::TasksApi,
        slow_http,
        Capability::ExternalId,
        Adapter::TasksApi.default_mapping(),
    )
    .unwrap();
    let settings = DispatchSettings {
        in_flight: 1,
        claim_ahead: 1,
        lease: Duration::from_secs(40),
        call_timeout: Duration::from_secs(30),
        ..env.dispatch_settings()
    };
    assert_eq!((settings.effective_claim_ahead(), settings.hold_limit()), (1, Duration::from_secs(5)));
    let stop = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(env.dispatcher(crm, settings).await.unwrap().run_until_stopped(stop.clone()));
    let by_state = || async {
        handoff_consumer::remote::ledger::count_by_state(&env.consumer_db).await.map_err(anyhow::Error::from)
    };
    // One row in the slot's call, one claimed ahead (its attempt counted, durably), one left.
    let counts = eventually("a create held at the CRM and a row claimed ahead", WAIT, || async {
        let counts = by_state().await?;
        let dispatching = counts.get(&LedgerState::Dispatching).copied().unwrap_or(0);
        Ok((sim.sim.faults().held() == 1 && dispatching == 2).then_some(counts))
    })
    .await
    .unwrap();
    assert_eq!(counts.get(&LedgerState::Received).copied(), Some(1), "{counts:?}");
    assert_eq!(sim.creates(), 1, "the row claimed ahead waits for the slot");

    stop.cancel();
    sim.sim.faults().release_held();
    running.await.unwrap().unwrap();
    assert_eq!(sim.creates(), 1, "a stopping dispatcher sends nothing it claimed ahead");
    let rows: Vec<(String, String, i32, bool, bool, bool, i64)> = sqlx::query_as(
        "SELECT o.state, o.operation_key, o.attempts, o.lease_owner IS NULL, o.first_attempt_at IS NULL,
                o.key_sent_at IS NULL, (SELECT count(*) FROM handoff_consumer.crm_event e
                                         WHERE e.operation_key = o.operation_key)
           FROM handoff_consumer.crm_operation o ORDER BY o.state, o.operation_key",
    )
    .fetch_all(&env.consumer_db)
    .await
    .unwrap();
    let shape: Vec<(&str, i32, bool, bool, bool, i64)> =
        rows.iter().map(|r| (r.0.as_str(), r.2, r.3, r.4, r.5, r.6)).collect();
    assert_eq!(
        shape,
        [
            // Released (the one claimed ahead) and never claimed: as intake left them.
            ("received", 0, true, true, true, 0),
            ("received", 0, true, true, true, 0),
            // The slot's call: one attempt, its evidence row.
            ("settled", 1, true, false, false, 1),
        ],
        "{rows:?}"
    );

    // The next dispatcher sends each released row once.
    let next = dispatcher(&env, &sim, Capability::ExternalId).await;
    let released: Vec<&str> = rows.iter().filter(|r| r.0 == "received").map(|r| r.1.as_str()).collect();
    let mut steps = Vec::new();
    for key in &released {
        steps.extend(until_decided(&next, &env, key).await);
    }
    for key in &released {
        assert_eq!(calls_for(&steps, key), [("create", LedgerState::Settled)], "{steps:?}");
    }
    assert_eq!((sim.effects().await.unwrap(), sim.creates()), (3, 3));
}

/// A lease leaving no time to wait for a slot (the shortest the binary allows) turns claiming
/// ahead off: the running dispatcher claims only for free slots and still settles every row once,
/// rather than releasing what it claimed.
#[tokio::test]
async fn with_no_time_to_hold_the_running_dispatcher_claims_only_for_free_slots_and_settles_all() {
    let (env, sim) = setup(SimConfig::default()).await;
    deliver(&env, &["case-1", "case-2", "case-3"]).await;
    let settings = DispatchSettings { in_flight: 1, claim_ahead: 4, ..env.dispatch_settings() };
    assert_eq!((settings.hold_limit(), settings.effective_claim_ahead()), (Duration::ZERO, 0));
    let stop = tokio_util::sync::CancellationToken::new();
    let crm = env.sim_crm(&sim, Capability::ExternalId);
    let running = tokio::spawn(env.dispatcher(crm, settings).await.unwrap().run_until_stopped(stop.clone()));
    let settled = eventually("every row settled", WAIT, || async {
        let counts = handoff_consumer::remote::ledger::count_by_state(&env.consumer_db).await?;
        Ok((counts.get(&LedgerState::Settled).copied() == Some(3)).then_some(()))
    })
    .await;
    stop.cancel();
    running.await.unwrap().unwrap();
    settled.unwrap();
    assert_eq!((sim.effects().await.unwrap(), sim.creates()), (3, 3));
}

#[tokio::test]
async fn a_dry_run_replica_records_intake_and_never_calls_the_crm() {
    let (env, sim) = setup(SimConfig::default()).await;
    let relay = env.relay(env.relay_settings()).await.unwrap();
    let remote = [
        ("HANDOFF_CRM", "http".to_owned()),
        ("HANDOFF_CRM_URL", sim.url.clone()),
        ("HANDOFF_CRM_TOKEN", SimConfig::default().auth_token),
        ("HANDOFF_CRM_ACCOUNT", handoff_tests::remote::ACCOUNT.to_owned()),
    ];
    let mut dry = remote.to_vec();
    dry.push(("HANDOFF_DRY_RUN", "true".to_owned()));
    let mut replica = env.consumer_process_with(&dry).unwrap();
    env.approve("case-104", SEED_TITLE).await.unwrap();
    relay.publish_batch().await.unwrap();
    eventually("the ledger row", Duration::from_secs(60), || async {
        Ok((env.ledger_state(KEY).await.ok() == Some(LedgerState::Received)).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!((sim.effects().await.unwrap(), sim.creates()), (0, 0), "no CRM call in a dry run");
    assert!(replica.terminate().await.unwrap().success());

    // A replica without --dry-run takes the recorded intake to the CRM, once.
    let _replica = env.consumer_process_with(&remote).unwrap();
    eventually("settled", Duration::from_secs(60), || async {
        Ok((env.ledger_state(KEY).await? == LedgerState::Settled).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!((sim.effects().await.unwrap(), sim.creates()), (1, 1));

    // --dry-run with the local CRM is refused at startup, naming the setting.
    let refused = handoff_tests::process::run_binary(
        "handoff-consumer",
        &[("DATABASE_URL", env.consumer_url()), ("HANDOFF_DRY_RUN", "true".to_owned())],
        &[],
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    assert_ne!(refused.code, Some(0));
    assert!(refused.stderr.contains("--dry-run (HANDOFF_DRY_RUN) needs --crm http"), "{}", refused.stderr);
}

#[tokio::test]
async fn the_producers_trace_context_travels_through_the_stream_to_the_crm() {
    const TRACE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let (env, sim) = setup(SimConfig::default()).await;
    let relay = env.relay(env.relay_settings()).await.unwrap();
    // The SQL contract takes it as a trailing argument; a malformed one is refused and writes nothing.
    let payload = serde_json::json!({"case_id": "case-104", "title": SEED_TITLE});
    let refused = sqlx::query("SELECT handoff.record_approved_action($1, $2, 'user-17', now(), NULL, 'not-a-trace')")
        .bind(KEY)
        .bind(&payload)
        .execute(&env.producer_db)
        .await
        .unwrap_err();
    assert_eq!(refused.as_database_error().and_then(|e| e.code()).as_deref(), Some("HO422"));
    assert_eq!(env.approvals().await.unwrap(), 0);
    sqlx::query("SELECT handoff.record_approved_action($1, $2, 'user-17', now(), NULL, $3)")
        .bind(KEY)
        .bind(&payload)
        .bind(TRACE)
        .execute(&env.producer_db)
        .await
        .unwrap();
    relay.publish_batch().await.unwrap();

    // On the wire: the CloudEvents distributed-tracing extension.
    let message = env.js.get_stream(&env.stream).await.unwrap().get_raw_message(1).await.unwrap();
    let event: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
    assert_eq!(event["traceparent"], TRACE);

    // At the CRM: the same trace, with the dispatcher's call as the parent.
    let consumer = env.remote_consumer().await.unwrap();
    consumer.fetch_and_handle(WAIT).await.unwrap();
    let dispatcher = dispatcher(&env, &sim, Capability::ExternalId).await;
    until_decided(&dispatcher, &env, KEY).await;
    let traces = sim.sim.traces();
    let create = traces.iter().find(|t| t.request == "POST /v1/tasks").unwrap_or_else(|| panic!("{traces:?}"));
    let sent: handoff_shared::TraceParent = create.traceparent.parse().unwrap();
    assert_eq!(sent.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_ne!(sent.parent_id(), "00f067aa0ba902b7", "a child span of the producer's");
    assert_eq!(sim.effects().await.unwrap(), 1);

    // The Rust API takes it too, and refuses a malformed one before writing anything.
    let action = handoff_relay::ApprovedAction::parse(
        "harbor:create-followup:v1:case-105",
        serde_json::json!({"case_id": "case-105"}),
        "user-17",
        chrono::Utc::now(),
    )
    .unwrap();
    assert!(matches!(
        action.clone().with_traceparent("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
        Err(handoff_relay::RecordError::InvalidTraceParent(_))
    ));
    let action = action.with_traceparent(TRACE).unwrap();
    let mut tx = env.producer_db.begin().await.unwrap();
    handoff_relay::record_approved_action(&mut tx, &action).await.unwrap();
    tx.commit().await.unwrap();
    let stored: Option<String> =
        sqlx::query_scalar("SELECT traceparent FROM handoff.approved_action WHERE operation_key = $1")
            .bind("harbor:create-followup:v1:case-105")
            .fetch_one(&env.producer_db)
            .await
            .unwrap();
    assert_eq!(stored.as_deref(), Some(TRACE));
}

/// Seed 004: the ledger is unique per (destination account, operation key). The same key recorded
/// for two accounts is two rows; each account's dispatcher works only its own, so a lookup in one
/// account never settles or "proves absent" the other; an operator asking about the key is told
/// it lives in both, and resolves one of them by naming its account (`handoff-admin resolve
/// --account`, run as a process), which leaves the other as it was.
#[tokio::test]
async fn the_ledger_is_unique_per_account_and_key_and_each_account_is_proven_on_its_own() {
    use handoff_consumer::Crm;
    use handoff_consumer::crm::{TaskOutcome, TaskRequest};
    use handoff_consumer::remote::ledger::LedgerCrm;

    let (env, sim) = setup(SimConfig::default()).await;
    let request = TaskRequest {
        operation_key: KEY.into(),
        payload_hash: "a".repeat(64),
        payload: serde_json::json!({"title": SEED_TITLE}),
        approved_by: "ana".into(),
        traceparent: None,
    };
    for account in [handoff_tests::remote::ACCOUNT, "harbor-crm-eu"] {
        let mut tx = env.consumer_db.begin().await.unwrap();
        let first =
            LedgerCrm { account: account.into() }.create_tasks(&mut tx, std::slice::from_ref(&request)).await.unwrap();
        let again =
            LedgerCrm { account: account.into() }.create_tasks(&mut tx, std::slice::from_ref(&request)).await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(first, [TaskOutcome::Accepted], "{account}");
        assert!(matches!(again[..], [TaskOutcome::Existing { .. }]), "once per account: {again:?}");
    }
    let rows: Vec<(String, LedgerState)> = sqlx::query_as(
        "SELECT account, state FROM handoff_consumer.crm_operation WHERE operation_key = $1 ORDER BY account",
    )
    .bind(KEY)
    .fetch_all(&env.consumer_db)
    .await
    .unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");

    // The simulator plays the first account only: its dispatcher settles its own row and leaves
    // the other account's untouched.
    let dispatcher = dispatcher(&env, &sim, Capability::ExternalId).await;
    assert_eq!(calls(&dispatcher.dispatch_due().await.unwrap()), [("create", LedgerState::Settled)]);
    assert!(dispatcher.dispatch_due().await.unwrap().is_empty());
    let rows: Vec<(String, LedgerState)> = sqlx::query_as(
        "SELECT account, state FROM handoff_consumer.crm_operation WHERE operation_key = $1 ORDER BY account",
    )
    .bind(KEY)
    .fetch_all(&env.consumer_db)
    .await
    .unwrap();
    assert_eq!(
        rows,
        [
            (handoff_tests::remote::ACCOUNT.to_owned(), LedgerState::Settled),
            ("harbor-crm-eu".to_owned(), LedgerState::Received)
        ]
    );
    let events: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT account FROM handoff_consumer.crm_event WHERE operation_key = $1")
            .bind(KEY)
            .fetch_all(&env.consumer_db)
            .await
            .unwrap();
    assert_eq!(events, [handoff_tests::remote::ACCOUNT], "evidence belongs to the account it was made in");
    let error = review::history(&env.consumer_db, KEY, None).await.unwrap_err().to_string();
    assert!(error.contains("several accounts") && error.contains("harbor-crm-eu"), "{error}");
    assert_eq!(sim.effects().await.unwrap(), 1);

    // The EU account's row waits for a person (its CRM is not played here).
    sqlx::query("UPDATE handoff_consumer.crm_operation SET state = 'review' WHERE operation_key = $1 AND account = 'harbor-crm-eu'")
        .bind(KEY)
        .execute(&env.consumer_db)
        .await
        .unwrap();
    let ledger = || async {
        sqlx::query_as::<_, (String, LedgerState, Option<String>)>(
            "SELECT account, state, crm_task_id FROM handoff_consumer.crm_operation WHERE operation_key = $1 ORDER BY account",
        )
        .bind(KEY)
        .fetch_all(&env.consumer_db)
        .await
        .unwrap()
    };
    let before = ledger().await;
    // The queue names the account of the row waiting, so a person knows what `--account` to give.
    let listed = env.admin(&["list", "--state", "review"]).await.unwrap().expect_code(0).unwrap().stdout;
    assert_eq!(listed.lines().count(), 1, "{listed}");
    assert!(listed.contains(KEY) && listed.contains("account=harbor-crm-eu "), "{listed}");
    let csv = env.admin(&["export", "--state", "review"]).await.unwrap().expect_code(0).unwrap().stdout;
    assert!(csv.starts_with("operation_key,account,queue,"), "{csv}");
    assert!(csv.contains(&format!("{KEY},harbor-crm-eu,review,")), "{csv}");
    let resolve = |account: Option<&'static str>| {
        let mut args =
            vec!["resolve", KEY, "--receipt", "EU-77", "--actor", "ops-ana", "--reason", "found in the EU CRM"];
        if let Some(account) = account {
            args.extend(["--account", account]);
        }
        let env = &env;
        async move { env.admin(&args).await.unwrap() }
    };
    // Without --account, or with an account the key never went to: refused, naming the accounts, nothing changed.
    let refused = resolve(None).await.expect_code(1).unwrap().stderr;
    assert!(
        refused.contains("several accounts") && refused.contains("--account") && refused.contains("harbor-crm-eu"),
        "{refused}"
    );
    let refused = resolve(Some("harbor-crm-us")).await.expect_code(1).unwrap().stderr;
    assert!(refused.contains("no ledger row in account harbor-crm-us"), "{refused}");
    assert_eq!(ledger().await, before);
    // With it: that account's row only.
    resolve(Some("harbor-crm-eu")).await.expect_code(0).unwrap();
    let after = ledger().await;
    assert_eq!(after[0], before[0], "the other account's row is untouched");
    assert_eq!(after[1], ("harbor-crm-eu".to_owned(), LedgerState::Settled, Some("EU-77".to_owned())));
    let audit: Vec<Option<String>> =
        sqlx::query_scalar("SELECT account FROM handoff_consumer.audit WHERE operation_key = $1")
            .bind(KEY)
            .fetch_all(&env.consumer_db)
            .await
            .unwrap();
    assert_eq!(audit, [Some("harbor-crm-eu".to_owned())]);
    // Each account's history holds its own evidence and resolutions.
    let eu = review::history(&env.consumer_db, KEY, Some("harbor-crm-eu")).await.unwrap();
    assert_eq!((eu.audit.len(), eu.events.iter().filter(|e| e.kind == "operator").count()), (1, 1));
    let home = review::history(&env.consumer_db, KEY, Some(handoff_tests::remote::ACCOUNT)).await.unwrap();
    assert!(home.audit.is_empty() && home.events.iter().all(|e| e.kind != "operator"), "{home:?}");
    // An action on the key that names no account (a conflict's resolution) belongs to neither row.
    sqlx::query(
        "INSERT INTO handoff_consumer.audit (operation_key, actor, action, reason) VALUES ($1, 'ops-bo', 'resolve_conflict', 'conflict checked')",
    )
    .bind(KEY)
    .execute(&env.consumer_db)
    .await
    .unwrap();
    // `explain` shows both rows and a verdict per account, and the key's own actions once.
    let shown = env.admin(&["explain", KEY, "--no-stream"]).await.unwrap().expect_code(0).unwrap().stdout;
    assert_eq!(shown.matches("resolve_conflict by ops-bo").count(), 1, "{shown}");
    // The resolution shows as the EU row's event and its audit line, never under the other account.
    assert!(!shown.contains("[harbor-crm] operator") && !shown.contains("[harbor-crm] record_receipt"), "{shown}");
    assert!(shown.contains("verdict: sent to 2 accounts"), "{shown}");
    assert!(shown.contains("account harbor-crm-eu: settled in the remote CRM: task EU-77"), "{shown}");
    assert!(shown.contains("[harbor-crm-eu] operator"), "{shown}");
    assert_eq!(sim.effects().await.unwrap(), 1, "an operator's resolution calls no CRM");
}

/// The dispatcher's pool plans each statement once per connection (generic plans, sequential
/// scans off), so each statement must reach the ledger by its keys whatever the ledger's size:
/// checked on an empty ledger, where a generic plan is most tempted to scan an account's rows
/// instead (it did before the statements named their keys as an index condition), and after
/// 5,000 rows and ANALYZE (where an index or bitmap scan on the keys are both keyed).
#[tokio::test]
async fn the_dispatchers_statements_planned_once_reach_the_ledger_by_key_at_any_size() {
    use handoff_consumer::remote::dispatcher::connect_pool;
    use handoff_consumer::remote::ledger::DISPATCH_STATEMENTS;

    let env = TestEnv::start().await.unwrap();
    let database = handoff_shared::config::DatabaseArgs::plain(env.replica_url());
    let pool = connect_pool(&database).await.unwrap();
    for rows in [0, 5_000] {
        if rows > 0 {
            sqlx::raw_sql(
                "INSERT INTO handoff_consumer.crm_operation (operation_key, account, payload_hash, payload)
                 SELECT 'harbor:create-followup:v1:case-' || g, 'acct', md5(g::text), '{}'::jsonb
                   FROM generate_series(1, 5000) AS g;
                 ANALYZE handoff_consumer.crm_operation;",
            )
            .execute(&env.consumer_db)
            .await
            .unwrap();
        }
        for (name, sql) in DISPATCH_STATEMENTS {
            let mut conn = pool.acquire().await.unwrap();
            let plan = handoff_tests::prepared_plan(&mut conn, sql).await.unwrap();
            let shown = plan.join("\n");
            assert!(!shown.contains("Seq Scan"), "{name} at {rows} rows scans a table:\n{shown}");
            let by_key: Vec<usize> = (0..plan.len())
                .filter(|&i| plan[i].contains("Scan") && plan[i].contains("crm_operation_pkey"))
                .collect();
            assert_eq!(by_key.len(), 1, "{name} at {rows} rows reaches the ledger once by key:\n{shown}");
            for i in by_key {
                assert!(
                    plan.get(i + 1).is_some_and(|cond| cond.starts_with("Index Cond: ((operation_key = ANY")),
                    "{name} at {rows} rows reaches the ledger's primary key without its keys:\n{shown}"
                );
            }
        }
    }
}
