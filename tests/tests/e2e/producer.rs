//! Recording approved actions: both producer paths (Rust API, SQL function) follow the same rules.

use handoff_relay::{ApprovedAction, RecordError, Recorded, record_approved_action};
use handoff_tests::{SEED_TITLE, TestEnv};
use serde_json::json;

const KEY: &str = "harbor:create-followup:v1:case-104";

fn followup(title: &str) -> ApprovedAction {
    ApprovedAction::parse(KEY, json!({"case_id": "case-104", "title": title}), "user-17", chrono::Utc::now()).unwrap()
}

fn sqlstate(error: &sqlx::Error) -> Option<String> {
    error.as_database_error().and_then(|e| e.code()).map(|c| c.into_owned())
}

#[tokio::test]
async fn approval_and_outbox_row_roll_back_together_when_the_second_write_fails() {
    let env = TestEnv::start().await.unwrap();
    // A real fault between the two writes: the outbox insert fails after the approval insert ran.
    sqlx::raw_sql(
        r#"CREATE TABLE app_case_note (case_id text, note text);
           CREATE FUNCTION fail_outbox() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN RAISE EXCEPTION 'injected fault between approval and outbox writes'; END $$;
           CREATE TRIGGER fail_outbox BEFORE INSERT ON handoff.outbox FOR EACH ROW EXECUTE FUNCTION fail_outbox();"#,
    )
    .execute(&env.producer_db)
    .await
    .unwrap();

    // Rust API inside the application's own transaction, next to its business write.
    let mut tx = env.producer_db.begin().await.unwrap();
    sqlx::query("INSERT INTO app_case_note VALUES ('case-104', 'approved')").execute(&mut *tx).await.unwrap();
    let err = record_approved_action(&mut tx, &followup(SEED_TITLE)).await.unwrap_err();
    assert!(matches!(err, RecordError::Database(_)), "{err:?}");
    tx.rollback().await.unwrap();

    // SQL function path.
    let err = sqlx::query("SELECT handoff.record_approved_action($1, $2, 'user-17')")
        .bind(KEY)
        .bind(json!({"case_id": "case-104", "title": SEED_TITLE}))
        .execute(&env.producer_db)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("injected fault"), "{err}");

    assert_eq!(env.approvals().await.unwrap(), 0);
    assert_eq!(env.outbox().await.unwrap(), Default::default());
    let notes: i64 =
        sqlx::query_scalar("SELECT count(*) FROM app_case_note").fetch_one(&env.producer_db).await.unwrap();
    assert_eq!(notes, 0);
}

#[tokio::test]
async fn the_same_approval_recorded_twice_yields_one_key_and_one_row_on_both_paths() {
    let env = TestEnv::start().await.unwrap();
    assert_eq!(env.approve("case-104", SEED_TITLE).await.unwrap(), Recorded::Created);
    assert_eq!(env.approve("case-104", SEED_TITLE).await.unwrap(), Recorded::AlreadyRecorded);

    // The SQL path sees the same action (members in another order) as already recorded...
    let (key, created): (String, bool) =
        sqlx::query_as("SELECT * FROM handoff.record_approved_action($1, $2::jsonb, 'user-99')")
            .bind(KEY)
            .bind(format!(r#"{{"title": "{SEED_TITLE}", "case_id": "case-104"}}"#))
            .fetch_one(&env.producer_db)
            .await
            .unwrap();
    assert_eq!((key.as_str(), created), (KEY, false));
    // ...and records a new one once, however often it is called.
    for expected in [true, false, false] {
        let (_, created): (String, bool) =
            sqlx::query_as("SELECT * FROM handoff.record_approved_action('harbor:create-followup:v1:case-105', '{\"case_id\":\"case-105\"}', 'u')")
                .fetch_one(&env.producer_db)
                .await
                .unwrap();
        assert_eq!(created, expected);
    }
    assert_eq!(env.approvals().await.unwrap(), 2);
    assert_eq!(env.outbox().await.unwrap().pending, 2);
}

#[tokio::test]
async fn the_same_key_with_changed_content_is_a_conflict_that_changes_nothing() {
    let env = TestEnv::start().await.unwrap();
    env.approve("case-104", SEED_TITLE).await.unwrap();

    // Rust API: a typed conflict, and the caller's transaction is still usable (savepoint).
    let mut tx = env.producer_db.begin().await.unwrap();
    let err = record_approved_action(&mut tx, &followup("Different approved instruction")).await.unwrap_err();
    assert!(matches!(err, RecordError::Conflict(ref k) if k.as_str() == KEY), "{err:?}");
    let still_usable: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut *tx).await.unwrap();
    assert_eq!(still_usable, 1);
    tx.commit().await.unwrap();

    // SQL path: SQLSTATE HO409.
    let err = sqlx::query("SELECT handoff.record_approved_action($1, $2, 'user-17')")
        .bind(KEY)
        .bind(json!({"case_id": "case-104", "title": "Different approved instruction"}))
        .execute(&env.producer_db)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&err).as_deref(), Some("HO409"));

    assert_eq!(env.approvals().await.unwrap(), 1);
    assert_eq!(env.outbox().await.unwrap().pending, 1);
    let title: String = sqlx::query_scalar("SELECT payload->>'title' FROM handoff.approved_action")
        .fetch_one(&env.producer_db)
        .await
        .unwrap();
    assert_eq!(title, SEED_TITLE);
}

#[tokio::test]
async fn invalid_input_never_enqueues_on_either_path() {
    let env = TestEnv::start().await.unwrap();
    let now = chrono::Utc::now();
    let big = "x".repeat(70 * 1024);
    let rust_cases = [
        ("harbor:create-followup:v1:", json!({"title": "Call"}), "user-17"),
        ("harbor:create-followup:v1:case/104", json!({"title": "Call"}), "user-17"),
        ("harbor:create-followup:case-104", json!({"title": "Call"}), "user-17"),
        (KEY, json!({}), "user-17"),
        (KEY, json!(["not", "an", "object"]), "user-17"),
        (KEY, json!({ "title": big }), "user-17"),
        (KEY, json!({"title": "Call"}), "   "),
    ];
    for (key, payload, approver) in rust_cases {
        let err = ApprovedAction::parse(key, payload, approver, now).unwrap_err();
        assert!(
            matches!(
                err,
                RecordError::InvalidKey(_) | RecordError::InvalidPayload(_) | RecordError::InvalidApproval(_)
            ),
            "{err:?}"
        );
    }

    let sql_cases: [(&str, serde_json::Value, Option<&str>); 7] = [
        ("harbor:create-followup:v1:", json!({"title": "Call"}), Some("user-17")),
        ("harbor:create-followup:v1:jane@example.com", json!({"title": "Call"}), Some("user-17")),
        ("harbor:create-followup:v0:case-104", json!({"title": "Call"}), Some("user-17")),
        (KEY, json!({}), Some("user-17")),
        (KEY, json!("text"), Some("user-17")),
        (KEY, json!({ "title": big }), Some("user-17")),
        (KEY, json!({"title": "Call"}), None),
    ];
    for (key, payload, approver) in sql_cases {
        let err = sqlx::query("SELECT handoff.record_approved_action($1, $2, $3)")
            .bind(key)
            .bind(payload)
            .bind(approver)
            .execute(&env.producer_db)
            .await
            .unwrap_err();
        assert_eq!(sqlstate(&err).as_deref(), Some("HO422"), "{key}: {err}");
    }
    assert_eq!(env.approvals().await.unwrap(), 0);
    assert_eq!(env.outbox().await.unwrap(), Default::default());
}

#[tokio::test]
async fn a_recorded_approval_cannot_be_changed_and_the_approved_payload_is_what_is_published() {
    let env = TestEnv::start().await.unwrap();
    // The SQL path without a hash: the relay computes it at the first publish.
    sqlx::query(
        "SELECT handoff.record_approved_action('harbor:create-followup:v1:case-1', '{\"case_id\": \"case-1\", \"title\": \"approved\"}', 'user-17')",
    )
    .execute(&env.producer_db)
    .await
    .unwrap();
    for change in [
        "UPDATE handoff.approved_action SET payload = '{\"case_id\": \"case-1\", \"title\": \"edited\"}'",
        "UPDATE handoff.approved_action SET approved_by = 'someone-else'",
        "UPDATE handoff.approved_action SET operation_key = 'harbor:create-followup:v1:case-2'",
        "DELETE FROM handoff.approved_action",
    ] {
        let error = sqlx::query(change).execute(&env.producer_db).await.unwrap_err();
        assert_eq!(sqlstate(&error).as_deref(), Some("HO403"), "{change}: {error}");
    }

    let relay = env.relay(env.relay_settings()).await.unwrap();
    assert_eq!(relay.publish_batch().await.unwrap().published, 1);
    let message = env.js.get_stream(&env.stream).await.unwrap().get_raw_message(1).await.unwrap();
    let event: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
    assert_eq!(event["data"]["title"], "approved");
    // The relay filled in the hash it computed (the one change allowed: a wrong hash filled in
    // earlier would only block the row), and it binds from now on.
    let (hash,): (Option<String>,) =
        sqlx::query_as("SELECT payload_hash FROM handoff.approved_action").fetch_one(&env.producer_db).await.unwrap();
    assert_eq!(hash.as_deref(), event["handoffhash"].as_str());
    let error = sqlx::query("UPDATE handoff.approved_action SET payload_hash = repeat('0', 64)")
        .execute(&env.producer_db)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&error).as_deref(), Some("HO403"));
}
