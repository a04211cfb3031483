//! The whole path in one call: Postgres with a producer and a consumer database, NATS JetStream,
//! the relay and a consumer replica (in this process or as the real binaries), optionally the CRM
//! simulator behind the consumer.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use async_nats::jetstream::stream::StorageType;
use handoff_consumer::remote::dispatcher::{DispatchSettings, Dispatcher};
use handoff_consumer::remote::ledger::LedgerCrm;
use handoff_consumer::remote::{Adapter, Capability, HttpSettings, NonExecution};
use handoff_consumer::{Consumer, ConsumerSettings, LocalCrm, SubscriptionSettings};
use handoff_crm_sim::{CrmSim, SimConfig};
use handoff_relay::{ApprovedAction, Recorded, Relay, RelaySettings, StreamSettings};
use handoff_shared::Subjects;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::containers::{Nats, Postgres};
use crate::keys::Keys;
use crate::process::ServiceProcess;

/// How the relay and the consumer run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Services {
    /// As tasks in this process, built through their libraries exactly as the binaries build them
    /// (the default: nothing to build or install).
    #[default]
    InProcess,
    /// As the real `handoff-relay` and `handoff-consumer` binaries (see [`crate::process`] for
    /// where they are looked up), configured through their environment variables.
    Processes,
    /// Not at all: only the servers and migrated databases (your test runs its own).
    None,
}

/// The account the consumer records for the CRM simulator.
pub const SIM_ACCOUNT: &str = "testkit";

/// Settings for [`Stack::start`]; every default suits a test.
#[derive(Debug, Clone)]
pub struct StackBuilder {
    stream: String,
    subject_prefix: String,
    durable: String,
    services: Services,
    crm_sim: bool,
    duplicate_window: Duration,
    ack_wait: Duration,
}

impl Default for StackBuilder {
    fn default() -> Self {
        let id = format!("{:08x}", crate::unique_u32());
        Self {
            stream: format!("HANDOFF_{id}"),
            subject_prefix: format!("handoff{id}"),
            durable: "handoff-crm".into(),
            services: Services::InProcess,
            crm_sim: false,
            duplicate_window: Duration::from_secs(120),
            ack_wait: Duration::from_secs(5),
        }
    }
}

impl StackBuilder {
    /// The JetStream stream (default: `HANDOFF_<random>`, so stacks never share one).
    pub fn stream(mut self, name: impl Into<String>) -> Self {
        self.stream = name.into();
        self
    }

    /// The subject prefix (default: `handoff<random>`).
    pub fn subject_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.subject_prefix = prefix.into();
        self
    }

    /// The durable consumer's name (default `handoff-crm`).
    pub fn durable(mut self, name: impl Into<String>) -> Self {
        self.durable = name.into();
        self
    }

    /// How relay and consumer run (default [`Services::InProcess`]).
    pub fn services(mut self, services: Services) -> Self {
        self.services = services;
        self
    }

    /// Put the CRM simulator behind the consumer (`--crm http`, external-id capability)
    /// instead of the CRM store in the consumer's own database.
    pub fn with_crm_sim(mut self) -> Self {
        self.crm_sim = true;
        self
    }

    /// The broker's de-duplication window (default 120 s).
    pub fn duplicate_window(mut self, window: Duration) -> Self {
        self.duplicate_window = window;
        self
    }

    /// Redelivery after this long without an ack (default 5 s, so crash tests stay short).
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// Starts everything; fails with the cause if any part does not come up.
    pub async fn start(self) -> Result<Stack> {
        let subjects = Subjects::new(self.subject_prefix.clone())?;
        let (postgres, nats) = tokio::try_join!(Postgres::start(), Nats::start())?;
        let producer_url = postgres.fresh_database("producer").await?;
        let consumer_url = postgres.fresh_database("consumer").await?;
        let producer = pool(&producer_url).await?;
        let consumer = pool(&consumer_url).await?;
        handoff_relay::SCHEMA.migrate(&producer).await.context("migrating the producer database")?;
        handoff_consumer::SCHEMA.migrate(&consumer).await.context("migrating the consumer database")?;
        let client = async_nats::connect(nats.url()).await.context("connecting to NATS")?;
        let js = async_nats::jetstream::new(client.clone());
        let keys = Keys::generate()?;
        let crm = if self.crm_sim { Some(CrmSimulator::start(&postgres).await?) } else { None };
        let mut stack = Stack {
            postgres,
            nats,
            producer_url,
            consumer_url,
            producer,
            consumer,
            client,
            js,
            keys,
            crm,
            stream: self.stream,
            subjects,
            durable: self.durable,
            duplicate_window: self.duplicate_window,
            ack_wait: self.ack_wait,
            running: Running::Nothing,
        };
        stack.running = match self.services {
            Services::InProcess => stack.start_in_process().await?,
            Services::Processes => stack.start_processes()?,
            Services::None => Running::Nothing,
        };
        Ok(stack)
    }
}

/// The CRM simulator on 127.0.0.1 with its own database; stopped with the stack.
#[derive(Debug)]
pub struct CrmSimulator {
    pub sim: CrmSim,
    /// Its base URL (`http://127.0.0.1:<port>`).
    pub url: String,
    stop: CancellationToken,
}

impl CrmSimulator {
    async fn start(postgres: &Postgres) -> Result<Self> {
        let pool = pool(&postgres.fresh_database("crm").await?).await?;
        let sim = CrmSim::new(pool, SimConfig::default()).await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let stop = CancellationToken::new();
        drop(sim.clone().spawn(listener, stop.clone()).await);
        Ok(Self { sim, url, stop })
    }
}

impl Drop for CrmSimulator {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

enum Running {
    Nothing,
    InProcess { token: CancellationToken, tasks: JoinSet<Result<()>> },
    Processes(Vec<ServiceProcess>),
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Nothing => f.write_str("Nothing"),
            Self::InProcess { tasks, .. } => write!(f, "InProcess({} tasks)", tasks.len()),
            Self::Processes(processes) => write!(f, "Processes({})", processes.len()),
        }
    }
}

/// A CRM task the consumer created for an operation key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Task {
    pub operation_key: String,
    /// The task's id in the CRM: the CRM store's row id, or the simulator's receipt.
    pub id: String,
}

/// A running stack. Everything is stopped and removed when it is dropped; [`Stack::stop`] stops
/// the services gracefully first.
#[derive(Debug)]
pub struct Stack {
    pub postgres: Postgres,
    pub nats: Nats,
    producer_url: String,
    consumer_url: String,
    producer: PgPool,
    consumer: PgPool,
    client: async_nats::Client,
    js: async_nats::jetstream::Context,
    keys: Keys,
    crm: Option<CrmSimulator>,
    stream: String,
    subjects: Subjects,
    durable: String,
    duplicate_window: Duration,
    ack_wait: Duration,
    running: Running,
}

impl Stack {
    /// Settings to change before [`StackBuilder::start`].
    pub fn builder() -> StackBuilder {
        StackBuilder::default()
    }

    /// Starts everything with the defaults: relay and consumer in this process, the local CRM store.
    pub async fn start() -> Result<Self> {
        StackBuilder::default().start().await
    }

    /// The application's database (approved actions and the outbox), as the owner.
    pub fn producer_url(&self) -> &str {
        &self.producer_url
    }

    /// The consumer's own database (inbox, CRM store or ledger), as the owner.
    pub fn consumer_url(&self) -> &str {
        &self.consumer_url
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn nats_url(&self) -> String {
        self.nats.url()
    }

    pub fn producer_pool(&self) -> &PgPool {
        &self.producer
    }

    pub fn consumer_pool(&self) -> &PgPool {
        &self.consumer
    }

    /// A NATS connection to the stack's server (the one [`Stack::jetstream`] uses).
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    pub fn jetstream(&self) -> &async_nats::jetstream::Context {
        &self.js
    }

    pub fn stream(&self) -> &str {
        &self.stream
    }

    pub fn subjects(&self) -> &Subjects {
        &self.subjects
    }

    /// The signing key pair the services use (and its files).
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The CRM simulator, when the stack was built [`StackBuilder::with_crm_sim`].
    pub fn crm_sim(&self) -> Option<&CrmSimulator> {
        self.crm.as_ref()
    }

    /// Records an approved action in its own transaction through the Rust producer API, as an
    /// application does inside its business transaction (`handoff_relay::record_approved_action`).
    /// `payload` must be a JSON object; recording the same key and payload again is a no-op.
    pub async fn record(&self, key: &str, payload: serde_json::Value, approved_by: &str) -> Result<Recorded> {
        let action = ApprovedAction::parse(key, payload, approved_by, chrono::Utc::now())?;
        let mut tx = self.producer.begin().await?;
        let recorded = handoff_relay::record_approved_action(&mut tx, &action).await?;
        tx.commit().await?;
        Ok(recorded)
    }

    /// Waits until the CRM holds the task for `key` (the CRM store's row, or the simulator's
    /// settled call), at most `timeout`.
    pub async fn wait_for_task(&self, key: &str, timeout: Duration) -> Result<Task> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(task) = self.task(key).await? {
                return Ok(task);
            }
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "no CRM task for {key} after {timeout:?} (is the relay or the consumer failing? see the test's log)"
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The CRM task for `key`, if there is one now.
    pub async fn task(&self, key: &str) -> Result<Option<Task>> {
        let id: Option<String> = if self.crm.is_some() {
            sqlx::query_scalar(
                "SELECT crm_task_id FROM handoff_consumer.crm_operation WHERE operation_key = $1 AND state = 'settled'",
            )
            .bind(key)
            .fetch_optional(&self.consumer)
            .await?
            .flatten()
        } else {
            sqlx::query_scalar("SELECT task_id::text FROM handoff_consumer.crm_task WHERE operation_key = $1")
                .bind(key)
                .fetch_optional(&self.consumer)
                .await?
        };
        Ok(id.map(|id| Task { operation_key: key.to_owned(), id }))
    }

    /// CRM tasks created so far: rows in the CRM store, or the simulator's effects.
    pub async fn task_count(&self) -> Result<i64> {
        match &self.crm {
            Some(crm) => crm.sim.effects().await,
            None => Ok(sqlx::query_scalar("SELECT count(*) FROM handoff_consumer.crm_task")
                .fetch_one(&self.consumer)
                .await?),
        }
    }

    /// Messages stored in the stream.
    pub async fn stream_messages(&self) -> Result<u64> {
        Ok(self.js.get_stream(&self.stream).await?.info().await?.state.messages)
    }

    /// The stream settings the relay uses (file storage, no age limit).
    pub fn stream_settings(&self) -> StreamSettings {
        StreamSettings {
            name: self.stream.clone(),
            subjects: self.subjects.clone(),
            duplicate_window: self.duplicate_window,
            max_age: Duration::ZERO,
            max_bytes: -1,
            replicas: 1,
            storage: StorageType::File,
        }
    }

    /// The durable consumer the replicas share.
    pub fn subscription(&self) -> SubscriptionSettings {
        SubscriptionSettings {
            stream: self.stream.clone(),
            subjects: self.subjects.clone(),
            durable_name: self.durable.clone(),
            filter_subject: self.subjects.all(),
            ack_wait: self.ack_wait,
            max_ack_pending: 20_000,
            stream_wait: Duration::from_secs(30),
            replicas: None,
        }
    }

    /// Relay settings for tests: signing with the stack's key, quick polling and retries.
    pub fn relay_settings(&self) -> RelaySettings {
        RelaySettings {
            poll_interval: Duration::from_millis(100),
            backoff: handoff_shared::Backoff {
                initial: Duration::from_millis(50),
                max: Duration::from_secs(1),
                ..handoff_shared::Backoff::default()
            },
            signing: Some(self.keys.signing.clone()),
            ..RelaySettings::default()
        }
    }

    /// Consumer settings for tests: verifying the stack's key, quick retries.
    pub fn consumer_settings(&self) -> ConsumerSettings {
        ConsumerSettings {
            fetch_expires: Duration::from_secs(1),
            backoff: handoff_shared::Backoff {
                initial: Duration::from_millis(50),
                max: Duration::from_secs(1),
                ..handoff_shared::Backoff::default()
            },
            signatures: self.keys.policy(),
            ..ConsumerSettings::default()
        }
    }

    fn http_settings(crm: &CrmSimulator) -> HttpSettings {
        HttpSettings {
            base_url: crm.url.clone(),
            token: crm.sim.config().auth_token.clone(),
            account: SIM_ACCOUNT.into(),
            timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(1),
            not_executed: NonExecution::default(),
        }
    }

    async fn start_in_process(&self) -> Result<Running> {
        let token = CancellationToken::new();
        let mut tasks = JoinSet::new();
        let relay = Relay::build(
            pool(&self.producer_url).await?,
            async_nats::connect(self.nats.url()).await?,
            self.stream_settings(),
            self.relay_settings(),
        )
        .await
        .context("building the relay")?;
        tasks.spawn(relay.run_until_stopped(token.clone()));
        let consumer_pool = pool(&self.consumer_url).await?;
        let client = async_nats::connect(self.nats.url()).await?;
        match &self.crm {
            None => {
                let consumer =
                    Consumer::build(consumer_pool, client, &self.subscription(), LocalCrm, self.consumer_settings())
                        .await
                        .context("building the consumer")?;
                tasks.spawn(consumer.run_until_stopped(token.clone()));
            }
            Some(crm) => {
                let ledger = LedgerCrm { account: SIM_ACCOUNT.into() };
                let consumer = Consumer::build(
                    consumer_pool.clone(),
                    client,
                    &self.subscription(),
                    ledger,
                    self.consumer_settings(),
                )
                .await
                .context("building the consumer")?;
                tasks.spawn(consumer.run_until_stopped(token.clone()));
                let settings =
                    DispatchSettings { poll_interval: Duration::from_millis(50), ..DispatchSettings::default() };
                let adapter = handoff_consumer::remote::connect(
                    Adapter::TasksApi,
                    Self::http_settings(crm),
                    Capability::ExternalId,
                    Adapter::TasksApi.default_mapping(),
                )?;
                let dispatch_pool = handoff_consumer::remote::dispatcher::connect_pool(
                    &handoff_shared::config::DatabaseArgs::plain(self.consumer_url.as_str()),
                )
                .await?;
                let dispatcher = Dispatcher::new(dispatch_pool, adapter, settings);
                tasks.spawn(dispatcher.run_until_stopped(token.clone()));
            }
        }
        Ok(Running::InProcess { token, tasks })
    }

    /// The environment variables the binaries get, for `database_url`.
    pub fn service_env(&self, database_url: &str) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("DATABASE_URL", database_url.to_owned()),
            ("NATS_URL", self.nats.url()),
            ("HANDOFF_STREAM", self.stream.clone()),
            ("HANDOFF_SUBJECT_PREFIX", self.subjects.prefix().to_owned()),
            ("HANDOFF_DUPLICATE_WINDOW_SECS", self.duplicate_window.as_secs().to_string()),
            ("HANDOFF_STREAM_MAX_AGE_SECS", "0".into()),
            ("HANDOFF_CONSUMER_NAME", self.durable.clone()),
            ("HANDOFF_ACK_WAIT_SECS", self.ack_wait.as_secs().max(1).to_string()),
            ("HANDOFF_RELAY_POLL_MS", "100".into()),
            ("HANDOFF_HTTP_ADDR", String::new()),
            ("HANDOFF_MIGRATE", "never".into()),
            ("HANDOFF_SIGNING_KEY_FILE", self.keys.signing_file.display().to_string()),
            ("HANDOFF_VERIFY_KEY_FILES", self.keys.verify_file.display().to_string()),
            ("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into())),
        ];
        if let Some(crm) = &self.crm {
            let http = Self::http_settings(crm);
            env.extend([
                ("HANDOFF_CRM", "http".to_owned()),
                ("HANDOFF_CRM_URL", http.base_url),
                ("HANDOFF_CRM_TOKEN", http.token),
                ("HANDOFF_CRM_ACCOUNT", http.account),
                ("HANDOFF_CRM_ADAPTER", "tasks-api".to_owned()),
                ("HANDOFF_CRM_CAPABILITY", "external-id".to_owned()),
            ]);
        }
        env
    }

    fn start_processes(&self) -> Result<Running> {
        let relay = ServiceProcess::spawn("handoff-relay", &self.service_env(&self.producer_url))?;
        let consumer = ServiceProcess::spawn("handoff-consumer", &self.service_env(&self.consumer_url))?;
        Ok(Running::Processes(vec![relay, consumer]))
    }

    /// Stops the services as an orchestrator would (cancellation, or SIGTERM to the binaries) and
    /// reports the first failure of any of them; then drops the servers.
    pub async fn stop(mut self) -> Result<()> {
        match std::mem::replace(&mut self.running, Running::Nothing) {
            Running::Nothing => {}
            Running::InProcess { token, mut tasks } => {
                token.cancel();
                while let Some(done) = tasks.join_next().await {
                    done.context("a service task panicked")??;
                }
            }
            Running::Processes(processes) => {
                for mut process in processes {
                    let status = process.terminate().await?;
                    anyhow::ensure!(status.success(), "a service exited with {status}");
                }
            }
        }
        Ok(())
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        if let Running::InProcess { token, .. } = &self.running {
            token.cancel();
        }
    }
}

async fn pool(url: &str) -> Result<PgPool> {
    PgPoolOptions::new().max_connections(10).connect(url).await.with_context(|| format!("connecting to {url}"))
}
