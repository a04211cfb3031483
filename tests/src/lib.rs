//! The integration-test harness: real Postgres and NATS (testcontainers), a fresh producer and
//! consumer database and a unique stream and subject prefix per test, so tests run in parallel
//! without stepping on each other. Relay and consumer run in-process, built through their
//! libraries exactly as the binaries build them.

pub mod broker;
pub mod faulty_api;
pub mod ops;
pub mod remote;

/// The containers and processes come from the kit users' suites use too.
pub use handoff_testkit::{cluster, containers, process};

use std::future::Future;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use async_nats::jetstream::stream::StorageType;
use handoff_consumer::{Consumer, ConsumerSettings, LocalCrm, SubscriptionSettings};
use handoff_relay::outbox::{OutboxCounts, count_by_state};
use handoff_relay::{ApprovedAction, RecordError, Recorded, Relay, RelaySettings, StreamSettings};
use handoff_shared::{Backoff, Subjects};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

pub use broker::Broker;
pub use containers::{Nats, Postgres};
pub use process::ServiceProcess;

/// The title seed 000 approves for case 104.
pub const SEED_TITLE: &str = "Call about the approved repair plan";

/// One test's world: servers, databases, broker names.
#[derive(Debug)]
pub struct TestEnv {
    pub postgres: Postgres,
    /// One NATS server, or a three-node cluster ([`TestEnv::start_on_cluster`]).
    pub nats: Broker,
    /// The application's database (approved actions + outbox).
    pub producer_db: PgPool,
    /// The consumer's own database (inbox + CRM store).
    pub consumer_db: PgPool,
    pub client: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    pub stream: String,
    pub subjects: Subjects,
    /// Broker dedup window for this test's stream.
    pub duplicate_window: Duration,
    /// The key relays sign with and consumers verify, in memory and in files for the binaries.
    pub keys: TestKeys,
}

/// A test's signing key pair (see [`handoff_testkit::Keys`]).
pub type TestKeys = handoff_testkit::Keys;

impl TestEnv {
    /// Starts Postgres and NATS and prepares fresh databases with the producer schema migrated.
    pub async fn start() -> Result<Self> {
        Self::start_with_window(Duration::from_secs(120)).await
    }

    /// Like [`TestEnv::start`] with a chosen broker duplicate window.
    pub async fn start_with_window(duplicate_window: Duration) -> Result<Self> {
        let _ = tracing_subscriber_init();
        let (postgres, nats) = tokio::try_join!(Postgres::start(), Nats::start())?;
        Self::with_servers(postgres, Broker::Single(Box::new(nats)), duplicate_window).await
    }

    /// Like [`TestEnv::start`] with one NATS server running `sync_interval: always` (an fsync before
    /// every acknowledgement), the durable single-node shape.
    pub async fn start_durable() -> Result<Self> {
        let _ = tracing_subscriber_init();
        let (postgres, nats) = tokio::try_join!(Postgres::start(), Nats::start_durable())?;
        Self::with_servers(postgres, Broker::Single(Box::new(nats)), Duration::from_secs(120)).await
    }

    /// Like [`TestEnv::start`] on a three-node NATS cluster (`sync_interval: always`), the
    /// production shape: the test's stream has three replicas.
    pub async fn start_on_cluster() -> Result<Self> {
        let _ = tracing_subscriber_init();
        let (postgres, cluster) = tokio::try_join!(Postgres::start(), cluster::NatsCluster::start())?;
        Self::with_servers(postgres, Broker::Cluster(cluster), Duration::from_secs(120)).await
    }

    /// A test's world on servers the caller started (e.g. a Postgres with other settings), with
    /// the default duplicate window.
    pub async fn on(postgres: Postgres, nats: Broker) -> Result<Self> {
        let _ = tracing_subscriber_init();
        Self::with_servers(postgres, nats, Duration::from_secs(120)).await
    }

    async fn with_servers(postgres: Postgres, nats: Broker, duplicate_window: Duration) -> Result<Self> {
        let producer_db = pool(&postgres.fresh_database("producer").await?).await?;
        let consumer_db = pool(&postgres.fresh_database("consumer").await?).await?;
        handoff_relay::SCHEMA.migrate(&producer_db).await?;
        handoff_consumer::SCHEMA.migrate(&consumer_db).await?;
        grant_roles(&producer_db, &consumer_db).await?;
        let client = async_nats::connect(nats.addrs()).await?;
        let js = async_nats::jetstream::new(client.clone());
        let id = format!("{:08x}", rand_u32());
        Ok(Self {
            postgres,
            nats,
            producer_db,
            consumer_db,
            client,
            js,
            stream: format!("T{id}"),
            subjects: Subjects::new(format!("t{id}"))?,
            duplicate_window,
            keys: TestKeys::generate()?,
        })
    }

    /// This test's stream settings (file storage, Limits, DiscardPolicy::New).
    pub fn stream_settings(&self) -> StreamSettings {
        StreamSettings {
            name: self.stream.clone(),
            subjects: self.subjects.clone(),
            duplicate_window: self.duplicate_window,
            max_age: Duration::ZERO,
            max_bytes: -1,
            replicas: self.nats.replicas(),
            storage: StorageType::File,
        }
    }

    /// This test's durable consumer, with a short `ack_wait` so crash tests see redelivery quickly.
    pub fn subscription(&self) -> SubscriptionSettings {
        SubscriptionSettings {
            stream: self.stream.clone(),
            subjects: self.subjects.clone(),
            durable_name: "crm".into(),
            filter_subject: self.subjects.all(),
            ack_wait: Duration::from_secs(1),
            max_ack_pending: 20_000,
            stream_wait: Duration::from_secs(30),
            replicas: None,
        }
    }

    /// Relay settings for tests: immediate retries, small budget.
    pub fn relay_settings(&self) -> RelaySettings {
        RelaySettings {
            backoff: Backoff { initial: Duration::ZERO, max: Duration::ZERO, multiplier: 2.0, jitter: 0.0 },
            max_attempts: 10,
            poll_interval: Duration::from_millis(100),
            // Relays run as the least-privileged role, which cannot change the schema.
            migrate: handoff_shared::migrate::MigrateMode::Never,
            signing: Some(self.keys.signing.clone()),
            ..RelaySettings::default()
        }
    }

    /// Consumer settings for tests.
    pub fn consumer_settings(&self) -> ConsumerSettings {
        ConsumerSettings {
            backoff: Backoff {
                initial: Duration::from_millis(50),
                max: Duration::from_millis(200),
                multiplier: 2.0,
                jitter: 0.0,
            },
            fetch_expires: Duration::from_secs(1),
            // Replicas run as the least-privileged role, which cannot change the schema.
            migrate: handoff_shared::migrate::MigrateMode::Never,
            signatures: self.keys.policy(),
            ..ConsumerSettings::default()
        }
    }

    /// A relay on its own connection pool and NATS connection, as a separate process would have,
    /// logged in as the relay's runtime role ([`RELAY_ROLE`]).
    pub async fn relay(&self, settings: RelaySettings) -> Result<Relay> {
        let pool = pool(&self.relay_url()).await?;
        let client = async_nats::connect(self.nats.addrs()).await?;
        Relay::build(pool, client, self.stream_settings(), settings).await
    }

    /// A consumer replica on its own pool and NATS connection, logged in as the consumer's runtime
    /// role ([`CONSUMER_ROLE`]).
    pub async fn consumer(&self, settings: ConsumerSettings) -> Result<Consumer<LocalCrm>> {
        let pool = pool(&self.replica_url()).await?;
        let client = async_nats::connect(self.nats.addrs()).await?;
        Consumer::build(pool, client, &self.subscription(), LocalCrm, settings).await
    }

    /// Environment for the real binaries, matching this test's stream, prefix and durable.
    fn service_env(&self, url: String) -> Vec<(&'static str, String)> {
        vec![
            ("DATABASE_URL", url),
            ("HANDOFF_MIGRATE", "never".into()),
            ("NATS_URL", self.nats.url()),
            ("HANDOFF_STREAM", self.stream.clone()),
            ("HANDOFF_SUBJECT_PREFIX", self.subjects.prefix().to_owned()),
            ("HANDOFF_DUPLICATE_WINDOW_SECS", self.duplicate_window.as_secs().to_string()),
            ("HANDOFF_STREAM_REPLICAS", self.nats.replicas().to_string()),
            ("HANDOFF_STREAM_MAX_AGE_SECS", "0".into()),
            ("HANDOFF_CONSUMER_NAME", "crm".into()),
            ("HANDOFF_ACK_WAIT_SECS", "1".into()),
            ("HANDOFF_MAX_ACK_PENDING", "20000".into()),
            ("HANDOFF_RELAY_LEASE_SECS", "1".into()),
            ("HANDOFF_RELAY_POLL_MS", "100".into()),
            // Several processes share this host: no endpoint unless a test asks for one.
            ("HANDOFF_HTTP_ADDR", String::new()),
            ("HANDOFF_SIGNING_KEY_FILE", self.keys.signing_file.display().to_string()),
            ("HANDOFF_VERIFY_KEY_FILES", self.keys.verify_file.display().to_string()),
            ("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into())),
        ]
    }

    /// The environment the relay binary gets (for tests that spawn it themselves).
    pub fn service_env_for_relay(&self) -> Vec<(&'static str, String)> {
        self.service_env(self.relay_url())
    }

    /// The environment a consumer replica binary gets (for tests that spawn it themselves).
    pub fn service_env_for_consumer(&self) -> Vec<(&'static str, String)> {
        self.service_env(self.replica_url())
    }

    /// The environment `handoff-admin` gets from [`TestEnv::admin`] (for tests that run it
    /// themselves, e.g. against another broker).
    pub fn admin_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("HANDOFF_PRODUCER_DATABASE_URL", self.role_url(OPERATOR_ROLE, &self.producer_db)),
            ("HANDOFF_CONSUMER_DATABASE_URL", self.role_url(OPERATOR_ROLE, &self.consumer_db)),
            ("NATS_URL", self.nats.url()),
            ("HANDOFF_STREAM", self.stream.clone()),
            ("HANDOFF_CONSUMER_NAME", "crm".to_owned()),
            ("RUST_LOG", "warn".to_owned()),
        ]
    }

    /// Starts the real `handoff-relay` binary against this test's databases and stream, with its
    /// operations endpoint off.
    pub fn relay_process(&self) -> Result<ServiceProcess> {
        self.relay_process_with(&[])
    }

    /// Starts the real `handoff-relay` binary with extra settings (e.g. `HANDOFF_HTTP_ADDR`).
    pub fn relay_process_with(&self, extra: &[(&'static str, String)]) -> Result<ServiceProcess> {
        let mut env = self.service_env(self.relay_url());
        env.extend(extra.iter().cloned());
        ServiceProcess::spawn("handoff-relay", &env)
    }

    /// Starts one real `handoff-consumer` replica.
    pub fn consumer_process(&self) -> Result<ServiceProcess> {
        self.consumer_process_with(&[])
    }

    /// Starts one real `handoff-consumer` replica with extra settings (e.g. `HANDOFF_CRM=http`).
    pub fn consumer_process_with(&self, extra: &[(&'static str, String)]) -> Result<ServiceProcess> {
        let mut env = self.service_env(self.replica_url());
        env.extend(extra.iter().cloned());
        ServiceProcess::spawn("handoff-consumer", &env)
    }

    /// Runs the real `handoff-admin` with `args` against this test's databases, broker, stream and
    /// durable consumer, to completion.
    pub async fn admin(&self, args: &[&str]) -> Result<process::CommandOutput> {
        process::run_binary("handoff-admin", &self.admin_env(), args, Duration::from_secs(120)).await
    }

    /// The producer database as the relay's runtime role.
    pub fn relay_url(&self) -> String {
        self.role_url(RELAY_ROLE, &self.producer_db)
    }

    /// The consumer database as a replica's runtime role.
    pub fn replica_url(&self) -> String {
        self.role_url(CONSUMER_ROLE, &self.consumer_db)
    }

    /// The producer database as the application's role (EXECUTE on the SQL contract only).
    pub fn application_url(&self) -> String {
        self.role_url(APPLICATION_ROLE, &self.producer_db)
    }

    fn role_url(&self, role: &str, pool: &PgPool) -> String {
        self.database_url(pool).replacen("postgres@", &format!("{role}@"), 1)
    }

    /// URL of the consumer's database as the superuser (for extra pools and processes).
    pub fn consumer_url(&self) -> String {
        self.database_url(&self.consumer_db)
    }

    /// URL of the producer's database.
    pub fn producer_url(&self) -> String {
        self.database_url(&self.producer_db)
    }

    fn database_url(&self, pool: &PgPool) -> String {
        let options = pool.connect_options();
        format!(
            "postgres://postgres@127.0.0.1:{}/{}",
            self.postgres.port(),
            options.get_database().unwrap_or("postgres")
        )
    }

    /// `envelope` as this test's relays publish it: envelope version `version`, signed with the
    /// test's key (for tests that publish by hand).
    pub fn signed(&self, envelope: &handoff_shared::Envelope, version: u32) -> bytes::Bytes {
        envelope.encode_signed(version, Some(&self.keys.signing))
    }

    /// Records the seed's follow-up for `case` through the Rust API in its own transaction.
    pub async fn approve(&self, case: &str, title: &str) -> Result<Recorded, RecordError> {
        let action = ApprovedAction::parse(
            &format!("harbor:create-followup:v1:{case}"),
            serde_json::json!({ "case_id": case, "title": title }),
            "user-17",
            chrono::Utc::now(),
        )?;
        let mut tx = self.producer_db.begin().await.map_err(RecordError::Database)?;
        let recorded = handoff_relay::record_approved_action(&mut tx, &action).await?;
        tx.commit().await.map_err(RecordError::Database)?;
        Ok(recorded)
    }

    /// Outbox rows by state.
    pub async fn outbox(&self) -> Result<OutboxCounts> {
        Ok(count_by_state(&self.producer_db).await?)
    }

    /// Changes a recorded approval's payload behind handoff's back, as only a role that can bypass
    /// triggers could (the trigger refuses everybody else): for tests of the relay's second line, the
    /// hash check.
    pub async fn tamper_with_payload(&self, key: &str, payload: serde_json::Value) -> Result<()> {
        let mut tx = self.producer_db.begin().await?;
        sqlx::query("SET LOCAL session_replication_role = replica").execute(&mut *tx).await?;
        sqlx::query("UPDATE handoff.approved_action SET payload = $2 WHERE operation_key = $1")
            .bind(key)
            .bind(payload)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Puts a task for `key` with other content (a zero hash) in the local CRM store before the
    /// action arrives: the consumer must record a conflict, never a second task.
    pub async fn seed_task_with_other_content(&self, key: &str) -> Result<()> {
        sqlx::query(
            "INSERT INTO handoff_consumer.crm_task (operation_key, payload_hash, payload, approved_by)
             VALUES ($1, repeat('0', 64), '{\"title\": \"different preexisting content\"}', 'someone-else')",
        )
        .bind(key)
        .execute(&self.consumer_db)
        .await?;
        Ok(())
    }

    /// Approved actions recorded.
    pub async fn approvals(&self) -> Result<i64> {
        Ok(sqlx::query_scalar("SELECT count(*) FROM handoff.approved_action").fetch_one(&self.producer_db).await?)
    }

    /// Tasks in the CRM store.
    pub async fn tasks(&self) -> Result<i64> {
        Ok(sqlx::query_scalar("SELECT count(*) FROM handoff_consumer.crm_task").fetch_one(&self.consumer_db).await?)
    }

    /// Consumer table counts.
    pub async fn consumer_counts(&self) -> Result<handoff_consumer::inbox::ConsumerCounts> {
        Ok(handoff_consumer::inbox::count_rows(&self.consumer_db).await?)
    }

    /// Messages stored in this test's stream.
    pub async fn stream_messages(&self) -> Result<u64> {
        let mut stream = self.js.get_stream(&self.stream).await?;
        Ok(stream.info().await?.state.messages)
    }

    /// Checks that every published row's sequence (as `handoff.outbox_delivery` says it) holds
    /// the message with that row's key; returns how many published rows there are.
    pub async fn published_sequences_match_the_stream(&self) -> Result<usize> {
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT operation_key, stream_sequence FROM handoff.outbox_delivery WHERE state = 'published' ORDER BY id",
        )
        .fetch_all(&self.producer_db)
        .await?;
        let stream = self.js.get_stream(&self.stream).await?;
        for (key, sequence) in &rows {
            let message = stream.get_raw_message(*sequence as u64).await?;
            let id = message.headers.get(handoff_shared::headers::MSG_ID).map(|v| v.as_str().to_owned());
            anyhow::ensure!(id.as_deref() == Some(key.as_str()), "sequence {sequence} holds {id:?}, not {key}");
        }
        Ok(rows.len())
    }

    /// Records `n` approved actions in one statement through the SQL producer function.
    pub async fn approve_many_via_sql(&self, first: i64, n: i64) -> Result<()> {
        approve_range(&self.producer_db, first, n).await
    }
}

/// Extra environment for relay binaries that must retry soon after the broker or database is
/// back (the defaults back off for minutes): cluster tests and `handoff-chaos`.
pub fn quick_relay_retries() -> Vec<(&'static str, String)> {
    vec![
        ("HANDOFF_RELAY_BACKOFF_INITIAL_MS", "100".to_owned()),
        ("HANDOFF_RELAY_BACKOFF_MAX_SECS", "1".to_owned()),
        ("HANDOFF_RELAY_MAX_ATTEMPTS", "100000".to_owned()),
    ]
}

/// The plan `conn` makes for `sql` as a prepared statement, one line per element, executed with
/// every parameter NULL: on connections that plan once ([`handoff_shared::config::Plans`]) the
/// generic plan, which does not depend on the values. `sql` must be the crate's own constant.
pub async fn prepared_plan(conn: &mut sqlx::PgConnection, sql: &str) -> Result<Vec<String>> {
    use sqlx::Row;
    let params = (1..=20).filter(|n| sql.contains(&format!("${n}"))).count();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("PREPARE plan_check AS {sql}"))).execute(&mut *conn).await?;
    let explain = format!("EXPLAIN EXECUTE plan_check({})", vec!["NULL"; params].join(", "));
    let plan = sqlx::raw_sql(sqlx::AssertSqlSafe(explain)).fetch_all(&mut *conn).await;
    sqlx::raw_sql("DEALLOCATE plan_check").execute(&mut *conn).await?;
    Ok(plan?.iter().map(|row| row.get::<String, _>(0).trim().to_owned()).collect())
}

/// Records the follow-ups of cases `first..first + n` in one statement through the SQL producer
/// function (idempotent per key: a range recorded again changes nothing).
pub async fn approve_range(producer: impl sqlx::PgExecutor<'_>, first: i64, n: i64) -> Result<()> {
    sqlx::query(
        r#"SELECT handoff.record_approved_action(
               'harbor:create-followup:v1:case-' || i,
               jsonb_build_object('case_id', 'case-' || i, 'title', 'Call about repair ' || i),
               'user-17')
             FROM generate_series($1::bigint, $2::bigint) AS i"#,
    )
    .bind(first)
    .bind(first + n - 1)
    .execute(producer)
    .await?;
    Ok(())
}

/// The login roles the suites run the services as, members of the group roles that
/// `deploy/sql/*-roles.sql` create and grant (the test Postgres trusts every login).
pub const RELAY_ROLE: &str = "test_relay";
pub const CONSUMER_ROLE: &str = "test_consumer";
pub const APPLICATION_ROLE: &str = "test_application";
pub const OPERATOR_ROLE: &str = "test_operator";

/// Applies the deploy/ role scripts as the schemas' owner, as an installation does after
/// `migrate`, and creates the suites' login roles in those groups.
pub async fn grant_roles(producer: &PgPool, consumer: &PgPool) -> Result<()> {
    sqlx::raw_sql(include_str!("../../deploy/sql/producer-roles.sql")).execute(producer).await?;
    sqlx::raw_sql(include_str!("../../deploy/sql/consumer-roles.sql")).execute(consumer).await?;
    for (login, group) in [
        (RELAY_ROLE, "handoff_relay_runtime"),
        (CONSUMER_ROLE, "handoff_consumer_runtime"),
        (APPLICATION_ROLE, "handoff_application"),
        (OPERATOR_ROLE, "handoff_operator"),
    ] {
        // Roles are cluster-wide; each test has its own server, but two databases share it.
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{login}') THEN \
             CREATE ROLE {login} LOGIN IN ROLE {group}; END IF; END $$;"
        )))
        .execute(producer)
        .await?;
    }
    Ok(())
}

/// Polls `check` until it returns `Some`, or fails after `timeout` saying what was awaited.
/// This waits for a state, it does not win a race: every caller states the condition it needs.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = check().await? {
            return Ok(value);
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn pool(url: &str) -> Result<PgPool> {
    PgPoolOptions::new().max_connections(10).connect(url).await.with_context(|| format!("connecting to {url}"))
}

fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now()) as u32
}

fn tracing_subscriber_init() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init()
        .map_err(|e| anyhow::anyhow!(e))
}
