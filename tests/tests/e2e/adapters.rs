//! The upsert (Salesforce-shaped) and unique-property (HubSpot-shaped) adapters, each against the
//! simulator speaking its shape: every case of seed 003/004 proven by counting the CRM's records
//! (effects), the requests it received and, for upserts, the updates it made (each would fire the
//! CRM's workflows).

use std::time::Duration;

use handoff_consumer::remote::dispatcher::Dispatcher;
use handoff_consumer::remote::{Adapter, LedgerState};
use handoff_crm_sim::{Fault, FaultKind, SimConfig};
use handoff_tests::remote::SimHandle;
use handoff_tests::{SEED_TITLE, TestEnv, eventually};
use serde_json::json;

use super::remote::{KEY, calls_for, deliver, setup, until_decided};

/// How long the unique-property search lags in these tests, and the freshness the adapter trusts.
const SEARCH_LAG: Duration = Duration::from_millis(300);
const FRESHNESS: Duration = Duration::from_secs(1);

fn sim_config() -> SimConfig {
    SimConfig { query_visibility_lag: SEARCH_LAG, ..SimConfig::default() }
}

async fn dispatcher(env: &TestEnv, sim: &SimHandle, adapter: Adapter) -> Dispatcher {
    env.dispatcher(env.sim_adapter(sim, adapter, FRESHNESS), env.dispatch_settings()).await.unwrap()
}

/// The proof a readback under `adapter` records.
fn readback_proof(adapter: Adapter) -> &'static str {
    match adapter {
        Adapter::UniqueProperty => "query",
        Adapter::TasksApi | Adapter::Upsert => "readback_by_external_id",
    }
}

async fn proof(env: &TestEnv, key: &str) -> Option<String> {
    sqlx::query_scalar("SELECT proof FROM handoff_consumer.crm_operation WHERE operation_key = $1")
        .bind(key)
        .fetch_one(&env.consumer_db)
        .await
        .unwrap()
}

/// One test per adapter for a case, each on its own stack (`tasks_api` too where asked: its
/// other cases are in `remote.rs`).
macro_rules! for_each_adapter {
    ($case:ident $(, $tasks_api:ident)?) => {
        mod $case {
            use handoff_consumer::remote::Adapter;

            #[tokio::test]
            async fn upsert() {
                super::$case(Adapter::Upsert).await
            }

            #[tokio::test]
            async fn unique_property() {
                super::$case(Adapter::UniqueProperty).await
            }

            $(
                #[tokio::test]
                async fn $tasks_api() {
                    super::$case(Adapter::TasksApi).await
                }
            )?
        }
    };
}

/// Puts a record of another payload under `KEY` straight into the CRM; returns its hash.
async fn seed_foreign_record(sim: &SimHandle) -> String {
    let theirs = "b".repeat(64);
    reqwest::Client::new()
        .post(format!("{}/_admin/tasks", sim.url))
        .json(&json!({"external_id": KEY, "payload_hash": theirs, "data": {"title": "someone else's follow-up"}}))
        .send()
        .await
        .unwrap()
        .error_for_status()
        .unwrap();
    theirs
}

for_each_adapter!(a_lost_reply_after_commit_settles_by_readback_with_one_effect);
async fn a_lost_reply_after_commit_settles_by_readback_with_one_effect(adapter: Adapter) {
    let (env, sim) = setup(sim_config()).await;
    deliver(&env, &["case-104"]).await;
    sim.sim.faults().inject(Fault::once_for(KEY, FaultKind::LoseReplyAfterCommit));
    let dispatcher = dispatcher(&env, &sim, adapter).await;
    let steps = calls_for(&until_decided(&dispatcher, &env, KEY).await, KEY);
    assert_eq!(steps.first(), Some(&("create", LedgerState::Unknown)), "{steps:?}");
    assert_eq!(steps.last(), Some(&("readback", LedgerState::Settled)), "{steps:?}");
    assert_eq!(steps.iter().filter(|(call, _)| *call == "create").count(), 1, "never re-sent: {steps:?}");
    let report = sim.sim.report().await.unwrap();
    assert_eq!((report.effects, report.requests.creates, report.requests.updates), (1, 1, 0));
    assert_eq!(proof(&env, KEY).await.as_deref(), Some(readback_proof(adapter)));
}

for_each_adapter!(a_reset_before_commit_makes_exactly_one_new_attempt);
async fn a_reset_before_commit_makes_exactly_one_new_attempt(adapter: Adapter) {
    let (env, sim) = setup(sim_config()).await;
    deliver(&env, &["case-104"]).await;
    sim.sim.faults().inject(Fault::once_for(KEY, FaultKind::ResetBeforeCommit));
    let dispatcher = dispatcher(&env, &sim, adapter).await;
    let steps = calls_for(&until_decided(&dispatcher, &env, KEY).await, KEY);
    let decisive: Vec<_> = steps.into_iter().filter(|c| *c != ("readback", LedgerState::Unknown)).collect();
    assert_eq!(
        decisive,
        [
            ("create", LedgerState::Unknown),
            ("readback", LedgerState::ProvedNotExecuted),
            ("create", LedgerState::Settled)
        ]
    );
    let report = sim.sim.report().await.unwrap();
    assert_eq!((report.effects, report.requests.creates, report.requests.updates), (1, 2, 0));
}

for_each_adapter!(readback_unavailable_waits_out_the_window_then_asks_a_person_without_a_second_create);
async fn readback_unavailable_waits_out_the_window_then_asks_a_person_without_a_second_create(adapter: Adapter) {
    let (env, sim) = setup(sim_config()).await;
    deliver(&env, &["case-104"]).await;
    sim.sim.faults().inject(Fault::once_for(KEY, FaultKind::LoseReplyAfterCommit));
    sim.sim.faults().inject(Fault { target: Some(KEY.into()), kind: FaultKind::ReadbackUnavailable, times: None });
    let dispatcher = dispatcher(&env, &sim, adapter).await;
    let steps = until_decided(&dispatcher, &env, KEY).await;
    let last = steps.last().unwrap();
    assert_eq!((last.call, last.state), ("readback", LedgerState::Review), "{steps:?}");
    assert!(last.note.contains("readback unavailable"), "{steps:?}");
    let report = sim.sim.report().await.unwrap();
    assert_eq!((report.effects, report.requests.creates), (1, 1), "no second create without proof");
}

for_each_adapter!(a_different_payload_under_the_key_goes_to_review_and_never_overwrites_the_record);
async fn a_different_payload_under_the_key_goes_to_review_and_never_overwrites_the_record(adapter: Adapter) {
    let (env, sim) = setup(sim_config()).await;
    // Another payload already holds the key at the CRM.
    let theirs = seed_foreign_record(&sim).await;
    deliver(&env, &["case-104"]).await;
    let dispatcher = dispatcher(&env, &sim, adapter).await;
    let steps = until_decided(&dispatcher, &env, KEY).await;
    assert_eq!(calls_for(&steps, KEY), [("create", LedgerState::Review)]);
    assert!(steps[0].note.contains("conflict"), "{steps:?}");
    let report = sim.sim.report().await.unwrap();
    assert_eq!((report.effects, report.requests.updates), (1, 0), "only the seeded record, never updated");
    assert_eq!(report.tasks[0].payload_hash, theirs);
    assert_eq!(report.tasks[0].data, json!({"title": "someone else's follow-up"}));
}

for_each_adapter!(two_replicas_racing_one_key_make_one_call);
async fn two_replicas_racing_one_key_make_one_call(adapter: Adapter) {
    let (env, sim) = setup(sim_config()).await;
    deliver(&env, &["case-104"]).await;
    sim.sim.faults().inject(Fault::once_for(KEY, FaultKind::Slow(Duration::from_millis(300))));
    let (a, b) = (dispatcher(&env, &sim, adapter).await, dispatcher(&env, &sim, adapter).await);
    let (from_a, from_b) = tokio::join!(a.dispatch_due(), b.dispatch_due());
    let (from_a, from_b) = (from_a.unwrap(), from_b.unwrap());
    assert_eq!(from_a.len() + from_b.len(), 1, "{from_a:?} {from_b:?}");
    assert_eq!((sim.effects().await.unwrap(), sim.creates()), (1, 1));
    assert_eq!(env.ledger_state(KEY).await.unwrap(), LedgerState::Settled);
}

for_each_adapter!(a_killed_replicas_call_is_taken_over_read_back_and_recorded_with_evidence, tasks_api);
async fn a_killed_replicas_call_is_taken_over_read_back_and_recorded_with_evidence(adapter: Adapter) {
    let (env, sim) = setup(SimConfig { lost_reply_hold: Duration::from_secs(120), ..sim_config() }).await;
    env.relay(env.relay_settings()).await.unwrap();
    sim.sim.faults().inject(Fault::once_for(KEY, FaultKind::LoseReplyAfterCommit));
    let name = match adapter {
        Adapter::TasksApi => "tasks-api",
        Adapter::Upsert => "upsert",
        Adapter::UniqueProperty => "unique-property",
    };
    // The real binary, selecting the adapter by its variable: it will hang in the create call.
    let mut replica = env
        .consumer_process_with(&[
            ("HANDOFF_CRM", "http".into()),
            ("HANDOFF_CRM_ADAPTER", name.into()),
            ("HANDOFF_CRM_URL", sim.url.clone()),
            ("HANDOFF_CRM_TOKEN", SimConfig::default().auth_token),
            ("HANDOFF_CRM_ACCOUNT", handoff_tests::remote::ACCOUNT.into()),
            ("HANDOFF_CRM_QUERY_FRESHNESS_SECS", FRESHNESS.as_secs().to_string()),
            ("HANDOFF_CRM_TIMEOUT_MS", "60000".into()),
            ("HANDOFF_CRM_LEASE_SECS", "66".into()),
        ])
        .unwrap();
    env.approve("case-104", SEED_TITLE).await.unwrap();
    env.relay(env.relay_settings()).await.unwrap().publish_batch().await.unwrap();
    eventually("the CRM to commit the record", Duration::from_secs(60), || async {
        Ok((sim.effects().await? == 1).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(env.ledger_state(KEY).await.unwrap(), LedgerState::Dispatching);
    replica.kill().await.unwrap();

    // The dead replica's lease (66 s) would expire by itself; expire it now, as time would.
    sqlx::query("UPDATE handoff_consumer.crm_operation SET next_attempt_at = now(), lease_until = now()")
        .execute(&env.consumer_db)
        .await
        .unwrap();
    let other = dispatcher(&env, &sim, adapter).await;
    let steps = calls_for(&until_decided(&other, &env, KEY).await, KEY);
    assert_eq!(steps.last(), Some(&("readback", LedgerState::Settled)), "{steps:?}");
    assert!(steps.iter().all(|(call, _)| *call == "readback"), "no create after the takeover: {steps:?}");
    let report = sim.sim.report().await.unwrap();
    assert_eq!((report.effects, report.requests.creates, report.requests.updates), (1, 1, 0));
    let attempts: Vec<String> = sqlx::query_scalar(
        "SELECT evidence FROM handoff_consumer.crm_event WHERE operation_key = $1 AND kind = 'attempt' ORDER BY id",
    )
    .bind(KEY)
    .fetch_all(&env.consumer_db)
    .await
    .unwrap();
    assert_eq!(attempts.len() as u64, report.requests.creates, "{attempts:?}");
    assert!(attempts[0].starts_with("abandoned: the lease of dispatcher-"), "{attempts:?}");
    let explained = env.admin(&["explain", KEY]).await.unwrap().expect_code(0).unwrap().stdout;
    assert!(explained.contains("abandoned"), "{explained}");
}

/// Why the upsert adapter needs the hash field write-once at the destination: without the
/// validation rule, the same upsert silently replaces another payload's record.
#[tokio::test]
async fn without_the_write_once_rule_an_upsert_would_overwrite_the_record() {
    let (env, sim) = setup(SimConfig { hash_write_once: false, ..sim_config() }).await;
    let theirs = seed_foreign_record(&sim).await;
    deliver(&env, &["case-104"]).await;
    let dispatcher = dispatcher(&env, &sim, Adapter::Upsert).await;
    until_decided(&dispatcher, &env, KEY).await;
    let report = sim.sim.report().await.unwrap();
    assert_eq!((report.effects, report.requests.updates), (1, 1));
    assert_ne!(report.tasks[0].payload_hash, theirs, "the other payload was replaced: the hazard the rule prevents");
}

/// The unique property guards even a search lag longer than the freshness declared: absence is
/// "proved" too early, the new create answers 409, the record it names holds our hash, and the
/// key settles with one record.
#[tokio::test]
async fn a_repeated_unique_value_with_our_hash_settles_even_when_the_search_lags_longer_than_declared() {
    let (env, sim) = setup(SimConfig { query_visibility_lag: Duration::from_secs(30), ..SimConfig::default() }).await;
    deliver(&env, &["case-104"]).await;
    sim.sim.faults().inject(Fault::once_for(KEY, FaultKind::LoseReplyAfterCommit));
    let crm = env.sim_adapter(&sim, Adapter::UniqueProperty, Duration::ZERO);
    let dispatcher = env.dispatcher(crm, env.dispatch_settings()).await.unwrap();
    let steps = until_decided(&dispatcher, &env, KEY).await;
    let decisive: Vec<_> =
        calls_for(&steps, KEY).into_iter().filter(|c| *c != ("readback", LedgerState::Unknown)).collect();
    assert_eq!(
        decisive,
        [
            ("create", LedgerState::Unknown),
            ("readback", LedgerState::ProvedNotExecuted),
            ("create", LedgerState::Settled)
        ]
    );
    let report = sim.sim.report().await.unwrap();
    assert_eq!((report.effects, report.requests.creates), (1, 2));
    let evidence: Vec<String> = sqlx::query_scalar(
        "SELECT evidence FROM handoff_consumer.crm_event WHERE operation_key = $1 AND kind = 'attempt' ORDER BY id",
    )
    .bind(KEY)
    .fetch_all(&env.consumer_db)
    .await
    .unwrap();
    assert!(
        evidence.last().unwrap().contains("-> 409") && evidence.last().unwrap().contains("it existed"),
        "{evidence:?}"
    );
}
