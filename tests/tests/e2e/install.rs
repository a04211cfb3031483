//! Installing handoff in a real application's database: migration bookkeeping in handoff's own
//! schemas, the `migrate` subcommand, `--migrate never`, and the upgrade of installs whose history
//! is in `public._sqlx_migrations`.

use std::time::Duration;

use handoff_tests::process::run_binary;
use handoff_tests::{TestEnv, eventually};
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::{PgPool, SqlSafeStr};

const WAIT: Duration = Duration::from_secs(60);

/// The application's own sqlx migrations, with their history in `public._sqlx_migrations` (sqlx's
/// default), as an application that uses sqlx has them.
fn application_migrator() -> Migrator {
    Migrator::with_migrations(vec![Migration::new(
        20250101000000,
        "application tables".into(),
        MigrationType::Simple,
        "CREATE TABLE repair_case (id bigint PRIMARY KEY, followup_approved boolean NOT NULL DEFAULT false)"
            .into_sql_str(),
        false,
    )])
}

async fn versions(pool: &PgPool, table: &str) -> Vec<i64> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT version FROM {table} ORDER BY version")))
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn migrate(binary: &str, url: &str) -> handoff_tests::process::CommandOutput {
    run_binary(binary, &[("DATABASE_URL", url.to_owned())], &["migrate"], WAIT).await.unwrap()
}

/// Records one action through the SQL contract and waits until a running relay published it.
async fn record_one_and_see_it_published(env: &TestEnv, pool: &PgPool) {
    sqlx::query("SELECT handoff.record_approved_action('harbor:create-followup:v1:case-1', '{\"case_id\": \"case-1\"}', 'user-17')")
        .execute(pool)
        .await
        .unwrap();
    eventually("published", WAIT, || async {
        let state: String = sqlx::query_scalar("SELECT state FROM handoff.outbox_delivery").fetch_one(pool).await?;
        Ok((state == "published").then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(env.stream_messages().await.unwrap(), 1);
}

#[tokio::test]
async fn relay_and_consumer_migrate_into_an_application_database_and_every_migrator_keeps_working() {
    let env = TestEnv::start().await.unwrap();
    let url = env.postgres.fresh_database("application").await.unwrap();
    let pool = PgPool::connect(&url).await.unwrap();
    application_migrator().run(&pool).await.unwrap();

    // Relay and consumer in the same database as the application, each with its own history.
    let out = migrate("handoff-relay", &url).await.expect_code(0).unwrap();
    assert!(out.stdout.contains("schema handoff at version"), "{}", out.stdout);
    migrate("handoff-consumer", &url).await.expect_code(0).unwrap();
    application_migrator().run(&pool).await.unwrap();
    assert_eq!(versions(&pool, "public._sqlx_migrations").await, [20250101000000]);
    let relay: Vec<i64> = handoff_relay::SCHEMA.migrator().iter().map(|m| m.version).collect();
    let consumer: Vec<i64> = handoff_consumer::SCHEMA.migrator().iter().map(|m| m.version).collect();
    assert_eq!(versions(&pool, "handoff._sqlx_migrations").await, relay);
    assert_eq!(versions(&pool, "handoff_consumer._sqlx_migrations").await, consumer);
    // Running them again changes nothing and fails nothing.
    migrate("handoff-relay", &url).await.expect_code(0).unwrap();
    migrate("handoff-consumer", &url).await.expect_code(0).unwrap();

    // A relay that may not migrate starts on the current schema and publishes.
    let _relay =
        env.relay_process_with(&[("DATABASE_URL", url.clone()), ("HANDOFF_MIGRATE", "never".to_owned())]).unwrap();
    record_one_and_see_it_published(&env, &pool).await;
}

#[tokio::test]
async fn a_service_with_migrate_never_refuses_a_schema_that_is_behind_and_says_what_to_run() {
    let env = TestEnv::start().await.unwrap();
    let url = env.postgres.fresh_database("unmigrated").await.unwrap();
    for (binary, subcommand) in
        [("handoff-relay", "handoff-relay migrate"), ("handoff-consumer", "handoff-consumer migrate")]
    {
        let out = run_binary(
            binary,
            &[
                ("DATABASE_URL", url.clone()),
                ("HANDOFF_MIGRATE", "never".to_owned()),
                ("NATS_URL", env.nats.url()),
                ("HANDOFF_STREAM", env.stream.clone()),
                ("HANDOFF_SUBJECT_PREFIX", env.subjects.prefix().to_owned()),
                ("HANDOFF_HTTP_ADDR", String::new()),
                ("HANDOFF_STREAM_WAIT_SECS", "1".to_owned()),
                ("HANDOFF_SIGNING_KEY_FILE", env.keys.signing_file.display().to_string()),
                ("HANDOFF_VERIFY_KEY_FILES", env.keys.verify_file.display().to_string()),
            ],
            &[],
            WAIT,
        )
        .await
        .unwrap();
        assert_ne!(out.code, Some(0), "{binary} started on an unmigrated schema");
        assert!(out.stderr.contains("never migrated") && out.stderr.contains(subcommand), "{binary}: {}", out.stderr);
    }
    let pool = PgPool::connect(&url).await.unwrap();
    let tables: i64 =
        sqlx::query_scalar("SELECT count(*) FROM information_schema.tables WHERE table_schema LIKE 'handoff%'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(tables, 0, "nothing was created");
}

#[tokio::test]
async fn an_install_whose_history_is_in_public_is_adopted_without_running_anything_again() {
    let env = TestEnv::start().await.unwrap();
    let url = env.postgres.fresh_database("legacy").await.unwrap();
    let pool = PgPool::connect(&url).await.unwrap();
    // The relay as released before: its migrations with sqlx's default bookkeeping table.
    let legacy = Migrator { migrations: handoff_relay::SCHEMA.migrator().migrations.clone(), ..Migrator::DEFAULT };
    legacy.run_to(20261201000001, &pool).await.unwrap();
    sqlx::query("SELECT handoff.record_approved_action('harbor:create-followup:v1:case-1', '{\"case_id\": \"case-1\"}', 'user-17')")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(versions(&pool, "public._sqlx_migrations").await, [20261129000001, 20261201000001]);

    let out = migrate("handoff-relay", &url).await.expect_code(0).unwrap();
    assert!(out.stdout.contains("2 history rows moved from public._sqlx_migrations"), "{}", out.stdout);
    assert!(versions(&pool, "public._sqlx_migrations").await.is_empty());
    let all: Vec<i64> = handoff_relay::SCHEMA.migrator().iter().map(|m| m.version).collect();
    assert_eq!(versions(&pool, "handoff._sqlx_migrations").await, all, "adopted, then the newer ones applied");
    let approvals: i64 =
        sqlx::query_scalar("SELECT count(*) FROM handoff.approved_action").fetch_one(&pool).await.unwrap();
    assert_eq!(approvals, 1, "the recorded action survived: nothing ran twice");
    migrate("handoff-relay", &url).await.expect_code(0).unwrap();
}

fn sqlstate(error: &sqlx::Error) -> Option<String> {
    error.as_database_error().and_then(|e| e.code()).map(|c| c.into_owned())
}

#[tokio::test]
async fn the_services_run_as_least_privileged_roles_and_the_application_can_only_record() {
    let env = TestEnv::start().await.unwrap();
    let _relay = env.relay_process().unwrap();
    let _consumer = env.consumer_process().unwrap();
    // The application's role records through the SQL contract, and nothing else.
    let app = PgPool::connect(&env.application_url()).await.unwrap();
    sqlx::query("SELECT handoff.record_approved_action('harbor:create-followup:v1:case-1', '{\"case_id\": \"case-1\"}', 'user-17')")
        .execute(&app)
        .await
        .unwrap();
    for forbidden in [
        "SELECT * FROM handoff.approved_action",
        "UPDATE handoff.approved_action SET payload = '{\"case_id\": \"x\"}'",
        "DELETE FROM handoff.outbox",
        "INSERT INTO handoff.outbox (operation_key) VALUES ('harbor:create-followup:v1:case-1')",
    ] {
        let error = sqlx::query(forbidden).execute(&app).await.unwrap_err();
        assert_eq!(sqlstate(&error).as_deref(), Some("42501"), "{forbidden}: {error}"); // insufficient_privilege
    }
    eventually("the task", WAIT, || async { Ok((env.tasks().await? == 1).then_some(())) }).await.unwrap();

    // The running services are logged in as their runtime roles, which cannot change the schema.
    let users: Vec<(String, String)> = sqlx::query_as(
        "SELECT DISTINCT application_name, usename::text FROM pg_stat_activity
          WHERE application_name IN ('handoff-relay', 'handoff-consumer') ORDER BY 1, 2",
    )
    .fetch_all(&env.producer_db)
    .await
    .unwrap();
    assert_eq!(
        users,
        [
            ("handoff-consumer".to_owned(), handoff_tests::CONSUMER_ROLE.to_owned()),
            ("handoff-relay".to_owned(), handoff_tests::RELAY_ROLE.to_owned())
        ]
    );
    let relay = PgPool::connect(&env.relay_url()).await.unwrap();
    for forbidden in ["CREATE TABLE handoff.extra (id int)", "UPDATE handoff.approved_action SET approved_by = 'x'"] {
        let error = sqlx::query(forbidden).execute(&relay).await.unwrap_err();
        assert_eq!(sqlstate(&error).as_deref(), Some("42501"), "{forbidden}: {error}");
    }
    let replica = PgPool::connect(&env.replica_url()).await.unwrap();
    let error = sqlx::query("DELETE FROM handoff_consumer.inbox").execute(&replica).await.unwrap_err();
    assert_eq!(sqlstate(&error).as_deref(), Some("42501"), "{error}");
}

/// The ledger migrations of this release on a ledger with rows in flight: the event log gets each
/// row's account, the key becomes (account, key), and rows sent before the upgrade are judged
/// from their first attempt (`key_sent_at`).
#[tokio::test]
async fn the_ledger_upgrade_keeps_rows_and_evidence_and_backfills_their_account() {
    let env = TestEnv::start().await.unwrap();
    let url = env.postgres.fresh_database("ledger_upgrade").await.unwrap();
    let pool = PgPool::connect(&url).await.unwrap();
    let schema = &*handoff_consumer::SCHEMA;
    schema.migrator().run_to(20261202000002, &pool).await.unwrap();
    sqlx::query(
        "INSERT INTO handoff_consumer.crm_operation
            (operation_key, account, payload_hash, payload, state, attempts, first_attempt_at, last_attempt_at)
         VALUES ('harbor:create-followup:v1:case-1', 'acct-a', repeat('a', 64), '{}', 'unknown', 1,
                 now() - interval '1 hour', now() - interval '5 minutes')",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO handoff_consumer.crm_event (operation_key, kind, attempt, evidence, state_after)
         VALUES ('harbor:create-followup:v1:case-1', 'attempt', 1, 'POST /v1/tasks -> timed out', 'unknown')",
    )
    .execute(&pool)
    .await
    .unwrap();

    let out = migrate("handoff-consumer", &url).await.expect_code(0).unwrap();
    assert!(out.stdout.contains(&schema.latest().to_string()), "{}", out.stdout);
    let (account, key_age_s): (String, f64) = sqlx::query_as(
        "SELECT e.account, extract(epoch FROM now() - o.key_sent_at)::float8
           FROM handoff_consumer.crm_event e JOIN handoff_consumer.crm_operation o USING (account, operation_key)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(account, "acct-a");
    assert!(key_age_s >= 3600.0, "retention counts from the first attempt: {key_age_s}");
    // The same key in another account is a row of its own now.
    sqlx::query(
        "INSERT INTO handoff_consumer.crm_operation (operation_key, account, payload_hash, payload)
         VALUES ('harbor:create-followup:v1:case-1', 'acct-b', repeat('a', 64), '{}')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let error = sqlx::query(
        "INSERT INTO handoff_consumer.crm_operation (operation_key, account, payload_hash, payload)
         VALUES ('harbor:create-followup:v1:case-1', 'acct-b', repeat('a', 64), '{}')",
    )
    .execute(&pool)
    .await
    .unwrap_err();
    assert_eq!(sqlstate(&error).as_deref(), Some("23505"), "unique per (account, key)");
}

#[tokio::test]
async fn a_binary_older_than_the_schema_starts_on_it_and_applies_nothing_as_in_a_rolling_upgrade() {
    let env = TestEnv::start().await.unwrap();
    let url = env.postgres.fresh_database("rolling").await.unwrap();
    let pool = PgPool::connect(&url).await.unwrap();
    migrate("handoff-relay", &url).await.expect_code(0).unwrap();
    // A newer relay migrated further: its migration is in the history, unknown to this binary.
    sqlx::query(
        "INSERT INTO handoff._sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (29991231000001, 'a newer release', true, '\\x00', 1)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let before = versions(&pool, "handoff._sqlx_migrations").await;

    let out = migrate("handoff-relay", &url).await.expect_code(0).unwrap();
    assert!(out.stdout.contains("at version 29991231000001, ahead of this binary's"), "{}", out.stdout);
    assert_eq!(versions(&pool, "handoff._sqlx_migrations").await, before, "nothing applied");
    // A relay with --migrate auto (the default) starts on it and publishes.
    let _relay =
        env.relay_process_with(&[("DATABASE_URL", url.clone()), ("HANDOFF_MIGRATE", "auto".to_owned())]).unwrap();
    record_one_and_see_it_published(&env, &pool).await;
}
