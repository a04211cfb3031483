//! The remote-CRM side of the harness: a CRM simulator on loopback with its own database, and a
//! consumer replica plus dispatcher wired to it over HTTP.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use handoff_consumer::Consumer;
use handoff_consumer::remote::dispatcher::{DispatchSettings, Dispatcher};
use handoff_consumer::remote::ledger::LedgerCrm;
use handoff_consumer::remote::{Adapter, Capability, HttpSettings, LedgerState, NonExecution, RemoteCrm};
use handoff_crm_sim::{CrmSim, SimConfig};
use tokio_util::sync::CancellationToken;

use crate::TestEnv;

/// The destination account the tests use.
pub const ACCOUNT: &str = "harbor-crm";

/// A running simulator; stopped on drop.
#[derive(Debug)]
pub struct SimHandle {
    pub sim: CrmSim,
    pub url: String,
    stop: CancellationToken,
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl SimHandle {
    /// Provider effects: tasks the CRM ever created.
    pub async fn effects(&self) -> Result<i64> {
        self.sim.effects().await
    }

    /// Create requests the CRM received.
    pub fn creates(&self) -> u64 {
        self.sim.requests().creates
    }

    /// Puts a task into the CRM directly (it counts as an effect).
    pub async fn seed_task(&self, external_id: &str, payload_hash: &str, data: serde_json::Value) -> Result<()> {
        let response = reqwest::Client::new()
            .post(format!("{}/_admin/tasks", self.url))
            .json(&serde_json::json!({"external_id": external_id, "payload_hash": payload_hash, "data": data}))
            .send()
            .await?;
        anyhow::ensure!(response.status().is_success(), "seeding failed: {}", response.status());
        Ok(())
    }
}

impl TestEnv {
    /// Starts a CRM simulator with a fresh database on 127.0.0.1.
    pub async fn crm_sim(&self, config: SimConfig) -> Result<SimHandle> {
        let url = self.postgres.fresh_database("crm").await?;
        let pool = sqlx::PgPool::connect(&url).await?;
        let sim = CrmSim::new(pool, config).await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let stop = CancellationToken::new();
        drop(sim.clone().spawn(listener, stop.clone()).await);
        Ok(SimHandle { sim, url, stop })
    }

    /// HTTP settings for `sim`: short timeouts so a lost reply is unknown quickly, and the
    /// default non-execution rule (only a connection never made proves nothing was sent).
    pub fn http_settings(&self, sim: &SimHandle) -> HttpSettings {
        HttpSettings {
            base_url: sim.url.clone(),
            token: SimConfig::default().auth_token,
            account: ACCOUNT.into(),
            timeout: Duration::from_millis(500),
            connect_timeout: Duration::from_millis(500),
            not_executed: NonExecution::default(),
        }
    }

    /// The `/v1/tasks` adapter on `sim`, declaring `capability`, with the default rule.
    pub fn sim_crm(&self, sim: &SimHandle, capability: Capability) -> Arc<dyn RemoteCrm> {
        self.sim_crm_with(sim, capability, NonExecution::default())
    }

    /// `adapter` on `sim` (which speaks every shape), with the default rule and mapping; the
    /// unique-property adapter's search is trusted after `freshness`.
    pub fn sim_adapter(&self, sim: &SimHandle, adapter: Adapter, freshness: Duration) -> Arc<dyn RemoteCrm> {
        let capability = match adapter {
            Adapter::TasksApi | Adapter::Upsert => Capability::ExternalId,
            Adapter::UniqueProperty => Capability::QueryOnly { freshness },
        };
        handoff_consumer::remote::connect(adapter, self.http_settings(sim), capability, adapter.default_mapping())
            .expect("an HTTP client")
    }

    /// The `/v1/tasks` adapter on `sim` with the non-execution rule `not_executed`.
    pub fn sim_crm_with(
        &self,
        sim: &SimHandle,
        capability: Capability,
        not_executed: NonExecution,
    ) -> Arc<dyn RemoteCrm> {
        let settings = HttpSettings { not_executed, ..self.http_settings(sim) };
        handoff_consumer::remote::connect(Adapter::TasksApi, settings, capability, Adapter::TasksApi.default_mapping())
            .expect("an HTTP client")
    }

    /// Dispatcher settings for tests: immediate readbacks and retries, short windows.
    pub fn dispatch_settings(&self) -> DispatchSettings {
        DispatchSettings {
            in_flight: 16,
            // Off: tests that want rows claimed ahead ask for them (with a lease long enough).
            claim_ahead: 0,
            lease: Duration::from_secs(5),
            call_timeout: Duration::from_millis(500),
            max_attempts: 5,
            backoff: handoff_shared::Backoff {
                initial: Duration::ZERO,
                max: Duration::ZERO,
                multiplier: 2.0,
                jitter: 0.0,
            },
            readback_interval: Duration::ZERO,
            readback_window: Duration::from_secs(2),
            absence_grace: Duration::from_millis(500),
            poll_interval: Duration::from_millis(50),
        }
    }

    /// A consumer replica whose CRM is remote: intake writes ledger rows.
    pub async fn remote_consumer(&self) -> Result<Consumer<LedgerCrm>> {
        let pool = sqlx::PgPool::connect(&self.replica_url()).await?;
        let client = async_nats::connect(self.nats.addrs()).await?;
        Consumer::build(
            pool,
            client,
            &self.subscription(),
            LedgerCrm { account: ACCOUNT.into() },
            self.consumer_settings(),
        )
        .await
    }

    /// A dispatcher on its own pool, as another replica would have.
    pub async fn dispatcher(&self, crm: Arc<dyn RemoteCrm>, settings: DispatchSettings) -> Result<Dispatcher> {
        let database = handoff_shared::config::DatabaseArgs::plain(self.replica_url());
        let pool = handoff_consumer::remote::dispatcher::connect_pool(&database).await?;
        Ok(Dispatcher::new(pool, crm, settings))
    }

    /// The ledger state of one key.
    pub async fn ledger_state(&self, key: &str) -> Result<LedgerState> {
        Ok(sqlx::query_scalar("SELECT state FROM handoff_consumer.crm_operation WHERE operation_key = $1")
            .bind(key)
            .fetch_one(&self.consumer_db)
            .await?)
    }
}
