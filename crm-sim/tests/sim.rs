//! The simulated CRM's wire contract, on a real Postgres (testcontainers) and over real HTTP.
//!
//! Needs Docker and the images from `scripts/build-images`. Each test starts its own Postgres and
//! simulator and proves its claim from HTTP replies and the simulator's effect count.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use handoff_crm_sim::{CrmSim, EffectsReport, Fault, FaultKind, SimConfig};
use handoff_tests::Postgres;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::postgres::PgPoolOptions;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "sim-token";

/// One Postgres, one simulator on 127.0.0.1:<ephemeral>, one client.
struct Sim {
    sim: CrmSim,
    base: String,
    http: reqwest::Client,
    shutdown: CancellationToken,
    server: JoinHandle<std::io::Result<()>>,
    _postgres: Postgres,
}

impl Sim {
    async fn start(config: SimConfig) -> Result<Self> {
        let postgres = Postgres::start().await?;
        let url = postgres.fresh_database("crm_sim").await?;
        let pool = PgPoolOptions::new().max_connections(8).connect(&url).await?;
        let sim = CrmSim::new(pool, config).await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let shutdown = CancellationToken::new();
        let server = sim.clone().spawn(listener, shutdown.clone()).await;
        let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;
        Ok(Self { sim, base, http, shutdown, server, _postgres: postgres })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `POST /v1/tasks` with the right token.
    fn create(&self, key: Option<&str>, external_id: &str, hash: &str) -> reqwest::RequestBuilder {
        let mut request =
            self.http.post(self.url("/v1/tasks")).bearer_auth(TOKEN).json(
                &json!({"external_id": external_id, "payload_hash": hash, "data": {"title": "Call the customer"}}),
            );
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        request
    }

    fn get(&self, path: &str) -> reqwest::RequestBuilder {
        self.http.get(self.url(path)).bearer_auth(TOKEN)
    }

    async fn stop(self) -> Result<()> {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), self.server).await.context("server did not stop")???;
        Ok(())
    }
}

/// A 64-hex-digit payload hash.
fn hash(n: u32) -> String {
    format!("{n:064x}")
}

async fn send(request: reqwest::RequestBuilder) -> Result<(StatusCode, Value)> {
    let response = request.send().await?;
    let status = response.status();
    let body = response.json::<Value>().await.unwrap_or(Value::Null);
    Ok((status, body))
}

/// Polls `check` every 50 ms until it returns `Some`, or fails after `within`.
async fn eventually<T, F, Fut>(within: Duration, what: &str, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(value) = check().await? {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            bail!("{what}: not within {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn create_then_replay_then_changed_hash_is_a_conflict() -> Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;

    let (status, created) = send(sim.create(Some("op-1"), "op-1", &hash(1))).await?;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(created["task_id"], "T-000001");
    assert_eq!(created["external_id"], "op-1");
    assert_eq!(created["payload_hash"], hash(1));
    assert_eq!(created["replayed"], false);
    assert!(created["created_at"].is_string());

    let (status, replayed) = send(sim.create(Some("op-1"), "op-1", &hash(1))).await?;
    assert_eq!(status, StatusCode::OK, "{replayed}");
    assert_eq!(replayed["task_id"], created["task_id"]);
    assert_eq!(replayed["replayed"], true);

    let (status, conflict) = send(sim.create(Some("op-1"), "op-1", &hash(2))).await?;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(conflict["error"], "idempotency_key_reused");

    let response = sim.get("/v1/tasks/by-key/op-1").send().await?;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-idempotency-retention-secs"], "86400");
    let task: Value = response.json().await?;
    assert_eq!((task["task_id"].clone(), task["payload_hash"].clone()), (created["task_id"].clone(), json!(hash(1))));

    let response = sim.get("/v1/tasks/by-key/never-used").send().await?;
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    assert_eq!(response.headers()["x-idempotency-retention-secs"], "86400", "on a 404 too");
    assert_eq!(response.json::<Value>().await?, json!({"error": "not_found"}));

    assert_eq!(sim.sim.effects().await?, 1);
    let requests = sim.sim.requests();
    assert_eq!((requests.creates, requests.readbacks, requests.queries), (3, 2, 0));
    sim.stop().await
}

#[tokio::test]
async fn concurrent_creates_with_one_key_make_one_task() -> Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    let attempts = (0..16).map(|_| send(sim.create(Some("op-race"), "op-race", &hash(7))));
    let results = futures::future::try_join_all(attempts).await?;
    let created = results.iter().filter(|(status, _)| *status == StatusCode::CREATED).count();
    let replayed =
        results.iter().filter(|(status, body)| *status == StatusCode::OK && body["replayed"] == true).count();
    assert_eq!((created, replayed), (1, 15), "{results:?}");
    assert_eq!(sim.sim.effects().await?, 1);
    sim.stop().await
}

#[tokio::test]
async fn a_forgotten_key_lets_a_retry_create_a_second_task() -> Result<()> {
    let config = SimConfig {
        idempotency_retention: Duration::from_secs(1),
        enforce_unique_external_id: false,
        ..SimConfig::default()
    };
    let sim = Sim::start(config).await?;

    let (status, first) = send(sim.create(Some("op-2"), "op-2", &hash(1))).await?;
    assert_eq!(status, StatusCode::CREATED);
    let response = sim.get("/v1/tasks/by-key/op-2").send().await?;
    assert_eq!(response.status(), StatusCode::OK, "remembered within retention");
    assert_eq!(response.headers()["x-idempotency-retention-secs"], "1");

    eventually(Duration::from_secs(10), "by-key readback reports the key forgotten", || async {
        let status = sim.get("/v1/tasks/by-key/op-2").send().await?.status();
        Ok((status == StatusCode::NOT_FOUND).then_some(()))
    })
    .await?;

    // Exactly like a provider past its retention: the same key is a new request.
    let (status, second) = send(sim.create(Some("op-2"), "op-2", &hash(1))).await?;
    assert_eq!(status, StatusCode::CREATED, "{second}");
    assert_ne!(second["task_id"], first["task_id"]);
    assert_eq!(sim.sim.effects().await?, 2, "the duplicate the retention window allows");

    let (status, body) = send(sim.get("/v1/tasks/by-key/op-2")).await?;
    assert_eq!(
        (status, body["task_id"].clone()),
        (StatusCode::OK, second["task_id"].clone()),
        "the key names the new task"
    );
    let (status, body) = send(sim.get("/v1/tasks/by-external-id/op-2")).await?;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(body, json!({"error": "ambiguous", "task_ids": [first["task_id"], second["task_id"]]}));
    sim.stop().await
}

#[tokio::test]
async fn unique_external_id_replays_or_conflicts_without_a_key() -> Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;

    let (status, created) = send(sim.create(None, "case-104", &hash(1))).await?;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(created["idempotency_key"], Value::Null);

    let (status, replayed) = send(sim.create(None, "case-104", &hash(1))).await?;
    assert_eq!((status, replayed["replayed"].clone()), (StatusCode::OK, json!(true)));
    assert_eq!(replayed["task_id"], created["task_id"]);

    let (status, conflict) = send(sim.create(None, "case-104", &hash(2))).await?;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(conflict["error"], "external_id_conflict");
    assert_eq!(conflict["task_id"], created["task_id"]);

    // A new key for an existing external id replays, and the key then answers readbacks.
    let (status, replayed) = send(sim.create(Some("other-key"), "case-104", &hash(1))).await?;
    assert_eq!((status, replayed["task_id"].clone()), (StatusCode::OK, created["task_id"].clone()));
    let (status, by_key) = send(sim.get("/v1/tasks/by-key/other-key")).await?;
    assert_eq!((status, by_key["task_id"].clone()), (StatusCode::OK, created["task_id"].clone()));

    let (status, by_id) = send(sim.get("/v1/tasks/by-external-id/case-104")).await?;
    assert_eq!((status, by_id["task_id"].clone()), (StatusCode::OK, created["task_id"].clone()));
    assert_eq!(by_id["data"], json!({"title": "Call the customer"}));
    let (status, _) = send(sim.get("/v1/tasks/by-external-id/case-105")).await?;
    assert_eq!(status, StatusCode::NOT_FOUND);

    assert_eq!(sim.sim.effects().await?, 1);
    sim.stop().await
}

#[tokio::test]
async fn bad_tokens_are_401_and_bad_requests_are_422_storing_nothing() -> Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    let body = json!({"external_id": "op-3", "payload_hash": hash(1), "data": {"a": 1}});

    let (status, error) = send(sim.http.post(sim.url("/v1/tasks")).json(&body)).await?;
    assert_eq!((status, error), (StatusCode::UNAUTHORIZED, json!({"error": "unauthorized"})));
    let (status, _) = send(sim.http.post(sim.url("/v1/tasks")).bearer_auth("wrong").json(&body)).await?;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = send(sim.http.get(sim.url("/v1/tasks/by-key/op-3"))).await?;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "reads need the token too");

    let too_long = "x".repeat(256);
    for bad in [
        json!({"external_id": "", "payload_hash": hash(1), "data": {"a": 1}}),
        json!({"external_id": too_long, "payload_hash": hash(1), "data": {"a": 1}}),
        json!({"external_id": "op-3", "payload_hash": "abc", "data": {"a": 1}}),
        json!({"external_id": "op-3", "payload_hash": hash(0xabc).to_uppercase(), "data": {"a": 1}}),
        json!({"external_id": "op-3", "payload_hash": hash(1), "data": {}}),
        json!({"external_id": "op-3", "payload_hash": hash(1), "data": "text"}),
        json!({"external_id": "op-3", "payload_hash": hash(1)}),
    ] {
        let (status, error) = send(sim.http.post(sim.url("/v1/tasks")).bearer_auth(TOKEN).json(&bad)).await?;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{bad}");
        assert_eq!(error["error"], "validation", "{bad}");
        assert!(error["detail"].is_string(), "{error}");
    }
    let (status, _) = send(sim.http.post(sim.url("/v1/tasks")).bearer_auth(TOKEN).body("{not json")).await?;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    let (status, _) = send(sim.create(Some(&"k".repeat(256)), "op-3", &hash(1))).await?;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "Idempotency-Key over 255 characters");
    let (status, _) = send(sim.get("/v1/tasks")).await?;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "search without external_id");
    let (status, error) = send(sim.get("/v1/nothing-here")).await?;
    assert_eq!((status, error), (StatusCode::NOT_FOUND, json!({"error": "not_found"})));

    assert_eq!(sim.sim.effects().await?, 0);
    sim.stop().await
}

#[tokio::test]
async fn lost_reply_after_commit_times_the_client_out_with_the_task_stored() -> Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    sim.sim.faults().inject(Fault::once_for("op-lost", FaultKind::LoseReplyAfterCommit));

    let started = Instant::now();
    let error = sim
        .create(Some("op-lost"), "op-lost", &hash(1))
        .timeout(Duration::from_millis(500))
        .send()
        .await
        .expect_err("the reply is lost");
    assert!(error.is_timeout(), "expected a client timeout, got {error:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(sim.sim.effects().await?, 1, "committed although the client heard nothing");

    // The unknown outcome is settled by reading back, and a retry with the key is a replay.
    let (status, task) = send(sim.get("/v1/tasks/by-key/op-lost")).await?;
    assert_eq!((status, task["payload_hash"].clone()), (StatusCode::OK, json!(hash(1))));
    let (status, replayed) = send(sim.create(Some("op-lost"), "op-lost", &hash(1))).await?;
    assert_eq!((status, replayed["task_id"].clone()), (StatusCode::OK, task["task_id"].clone()));
    assert_eq!(sim.sim.effects().await?, 1);
    sim.stop().await
}

#[tokio::test]
async fn a_lost_reply_closes_the_connection_without_a_response_after_the_hold() -> Result<()> {
    let config = SimConfig { lost_reply_hold: Duration::from_millis(300), ..SimConfig::default() };
    let sim = Sim::start(config).await?;
    sim.sim.faults().inject(Fault::once_for("op-held", FaultKind::LoseReplyAfterCommit));

    let error = sim.create(Some("op-held"), "op-held", &hash(1)).send().await.expect_err("no response");
    assert!(!error.is_timeout() && error.status().is_none(), "expected a closed connection, got {error:?}");
    assert_eq!(sim.sim.effects().await?, 1);
    assert_eq!(sim.sim.requests().creates, 1, "the client did not resend by itself");
    sim.stop().await
}

#[tokio::test]
async fn fail_before_commit_is_503_with_nothing_stored() -> Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    sim.sim.faults().inject(Fault::once_for("op-503", FaultKind::FailBeforeCommit));

    let (status, error) = send(sim.create(Some("op-503"), "op-503", &hash(1))).await?;
    assert_eq!((status, error), (StatusCode::SERVICE_UNAVAILABLE, json!({"error": "unavailable"})));
    assert_eq!(sim.sim.effects().await?, 0);
    let (status, _) = send(sim.get("/v1/tasks/by-key/op-503")).await?;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let (status, _) = send(sim.create(Some("op-503"), "op-503", &hash(1))).await?;
    assert_eq!(status, StatusCode::CREATED, "the fault applied once");
    assert_eq!(sim.sim.effects().await?, 1);
    sim.stop().await
}

#[tokio::test]
async fn a_gateway_503_after_commit_stores_the_task_like_a_success() -> Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    sim.sim.faults().inject(Fault::once_for("op-gw", FaultKind::Gateway503AfterCommit));

    let (status, error) = send(sim.create(Some("op-gw"), "op-gw", &hash(1))).await?;
    assert_eq!((status, error), (StatusCode::SERVICE_UNAVAILABLE, json!({"error": "unavailable"})));
    assert_eq!(sim.sim.effects().await?, 1, "the 503 came after the commit");
    let (status, task) = send(sim.get("/v1/tasks/by-key/op-gw")).await?;
    assert_eq!((status, task["external_id"].as_str()), (StatusCode::OK, Some("op-gw")));
    sim.stop().await
}

#[tokio::test]
async fn a_held_create_waits_unprocessed_until_released_then_is_answered() -> Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    sim.sim.faults().inject(Fault::once_for("op-held", FaultKind::HoldUntilReleased));
    let request = tokio::spawn(send(sim.create(Some("op-held"), "op-held", &hash(1))));
    eventually(Duration::from_secs(10), "the create to be held", || async {
        Ok((sim.sim.faults().held() == 1).then_some(()))
    })
    .await?;
    assert_eq!(sim.sim.effects().await?, 0, "held before anything is stored");

    let (status, released) = send(sim.http.post(sim.url("/_admin/faults/release"))).await?;
    assert_eq!((status, released), (StatusCode::OK, json!({"released": 1})));
    let (status, task) = request.await??;
    assert_eq!((status, task["replayed"].as_bool()), (StatusCode::CREATED, Some(false)));
    assert_eq!((sim.sim.effects().await?, sim.sim.faults().held()), (1, 0));
    sim.stop().await
}

#[tokio::test]
async fn rate_limited_is_429_with_retry_after_and_nothing_stored() -> Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    sim.sim.faults().inject(Fault {
        target: None,
        kind: FaultKind::RateLimited { retry_after: Duration::from_millis(1500) },
        times: Some(2),
    });

    for _ in 0..2 {
        let response = sim.create(Some("op-429"), "op-429", &hash(1)).send().await?;
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()["retry-after"], "2", "seconds, rounded up");
        assert_eq!(response.json::<Value>().await?["error"], "rate_limited");
    }
    assert_eq!(sim.sim.effects().await?, 0);
    let (status, _) = send(sim.create(Some("op-429"), "op-429", &hash(1))).await?;
    assert_eq!(status, StatusCode::CREATED);
    sim.stop().await
}

#[tokio::test]
async fn reset_before_commit_drops_the_connection_with_nothing_stored() -> Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    sim.sim.faults().inject(Fault::once_for("op-reset", FaultKind::ResetBeforeCommit));

    let error = sim.create(Some("op-reset"), "op-reset", &hash(1)).send().await.expect_err("no response");
    assert!(!error.is_timeout() && !error.is_connect() && error.status().is_none(), "got {error:?}");
    assert_eq!(sim.sim.effects().await?, 0);
    assert_eq!(sim.sim.requests().creates, 1, "the client did not resend by itself");

    let (status, _) = send(sim.create(Some("op-reset"), "op-reset", &hash(1))).await?;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(sim.sim.effects().await?, 1);
    sim.stop().await
}

#[tokio::test]
async fn readback_unavailable_refuses_every_read_for_its_target() -> Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    for op in ["op-dark", "op-lit"] {
        let (status, _) = send(sim.create(Some(op), op, &hash(1))).await?;
        assert_eq!(status, StatusCode::CREATED);
    }
    sim.sim.faults().inject(Fault {
        target: Some("op-dark".into()),
        kind: FaultKind::ReadbackUnavailable,
        times: None,
    });

    for path in ["/v1/tasks/by-key/op-dark", "/v1/tasks/by-external-id/op-dark", "/v1/tasks?external_id=op-dark"] {
        let (status, error) = send(sim.get(path)).await?;
        assert_eq!((status, error), (StatusCode::SERVICE_UNAVAILABLE, json!({"error": "unavailable"})), "{path}");
    }
    for path in ["/v1/tasks/by-key/op-lit", "/v1/tasks/by-external-id/op-lit", "/v1/tasks?external_id=op-lit"] {
        let (status, _) = send(sim.get(path)).await?;
        assert_eq!(status, StatusCode::OK, "{path}: other targets are unaffected");
    }
    let (status, _) = send(sim.create(Some("op-dark"), "op-dark", &hash(1))).await?;
    assert_eq!(status, StatusCode::OK, "creates are unaffected");

    sim.sim.faults().clear();
    let (status, _) = send(sim.get("/v1/tasks/by-key/op-dark")).await?;
    assert_eq!(status, StatusCode::OK);
    sim.stop().await
}

#[tokio::test]
async fn slow_delays_a_create_and_an_abandoned_one_stores_nothing() -> Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;

    sim.sim.faults().inject(Fault::once_for("op-slow", FaultKind::Slow(Duration::from_millis(400))));
    let started = Instant::now();
    let (status, _) = send(sim.create(Some("op-slow"), "op-slow", &hash(1))).await?;
    assert_eq!(status, StatusCode::CREATED);
    assert!(started.elapsed() >= Duration::from_millis(400), "{:?}", started.elapsed());

    let delay = Duration::from_millis(1500);
    sim.sim.faults().inject(Fault::once_for("op-gave-up", FaultKind::Slow(delay)));
    let started = Instant::now();
    let error = sim
        .create(Some("op-gave-up"), "op-gave-up", &hash(1))
        .timeout(Duration::from_millis(300))
        .send()
        .await
        .expect_err("the client gives up first");
    assert!(error.is_timeout(), "{error:?}");
    // Absence can only be shown by waiting: past the delay plus a margin, still one task.
    tokio::time::sleep((delay + Duration::from_millis(700)).saturating_sub(started.elapsed())).await;
    assert_eq!(sim.sim.effects().await?, 1, "the abandoned request was never processed");
    let (status, _) = send(sim.get("/v1/tasks/by-key/op-gave-up")).await?;
    assert_eq!(status, StatusCode::NOT_FOUND);
    sim.stop().await
}

#[tokio::test]
async fn injected_validation_and_auth_errors_and_the_admin_fault_endpoint() -> Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    let admin = |path: &str| sim.url(path);

    let injected = sim
        .http
        .post(admin("/_admin/faults"))
        .json(&json!({"target": "op-x", "kind": "validation_error", "times": 1}))
        .send()
        .await?;
    assert_eq!(injected.status(), StatusCode::NO_CONTENT);
    let injected = sim.http.post(admin("/_admin/faults")).json(&json!({"kind": "auth_error"})).send().await?;
    assert_eq!(injected.status(), StatusCode::NO_CONTENT);
    let (status, listed) = send(sim.http.get(admin("/_admin/faults"))).await?;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        listed,
        json!([
            {"target": "op-x", "kind": "validation_error", "times": 1},
            {"target": null, "kind": "auth_error"},
        ])
    );
    let (status, error) = send(sim.http.post(admin("/_admin/faults")).json(&json!({"kind": "slow"}))).await?;
    assert_eq!((status, error["error"].clone()), (StatusCode::UNPROCESSABLE_ENTITY, json!("validation")));

    let (status, error) = send(sim.create(Some("op-x"), "op-x", &hash(1))).await?;
    assert_eq!((status, error["error"].clone()), (StatusCode::UNPROCESSABLE_ENTITY, json!("validation")));
    let (status, error) = send(sim.create(Some("op-x"), "op-x", &hash(1))).await?;
    assert_eq!((status, error), (StatusCode::UNAUTHORIZED, json!({"error": "unauthorized"})), "with a good token");
    let (status, _) = send(sim.create(Some("op-y"), "op-y", &hash(1))).await?;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "untargeted: every create until cleared");
    assert_eq!(sim.sim.effects().await?, 0);

    let cleared = sim.http.delete(admin("/_admin/faults")).send().await?;
    assert_eq!(cleared.status(), StatusCode::NO_CONTENT);
    let (status, _) = send(sim.create(Some("op-x"), "op-x", &hash(1))).await?;
    assert_eq!(status, StatusCode::CREATED);
    sim.stop().await
}

#[tokio::test]
async fn the_search_lags_behind_writes_and_the_lookups_do_not() -> Result<()> {
    let config = SimConfig { query_visibility_lag: Duration::from_secs(1), ..SimConfig::default() };
    let sim = Sim::start(config).await?;

    let (status, created) = send(sim.create(Some("op-q"), "op-q", &hash(1))).await?;
    assert_eq!(status, StatusCode::CREATED);
    let (status, search) = send(sim.get("/v1/tasks?external_id=op-q")).await?;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(search["tasks"], json!([]), "just created: not yet visible to the search");
    assert!(search["as_of"].is_string());
    let (status, _) = send(sim.get("/v1/tasks/by-external-id/op-q")).await?;
    assert_eq!(status, StatusCode::OK, "the lookup reads its writes");

    let tasks = eventually(Duration::from_secs(10), "the search lists the task", || async {
        let (_, search) = send(sim.get("/v1/tasks?external_id=op-q")).await?;
        let tasks = search["tasks"].as_array().cloned().unwrap_or_default();
        Ok((!tasks.is_empty()).then_some(tasks))
    })
    .await?;
    assert_eq!(tasks.len(), 1);
    assert_eq!(tasks[0]["task_id"], created["task_id"]);
    assert!(sim.sim.requests().queries >= 2);
    sim.stop().await
}

#[tokio::test]
async fn seeded_tasks_count_as_effects_and_block_a_different_payload() -> Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    let seed = json!({"external_id": "op-s", "idempotency_key": "op-s", "payload_hash": hash(9), "data": {"title": "edited in the CRM"}});
    let (status, seeded) = send(sim.http.post(sim.url("/_admin/tasks")).json(&seed)).await?;
    assert_eq!(status, StatusCode::CREATED, "{seeded}");

    let (status, conflict) = send(sim.create(Some("op-s"), "op-s", &hash(1))).await?;
    assert_eq!((status, conflict["error"].clone()), (StatusCode::CONFLICT, json!("idempotency_key_reused")));
    let (status, conflict) = send(sim.create(None, "op-s", &hash(1))).await?;
    assert_eq!((status, conflict["error"].clone()), (StatusCode::CONFLICT, json!("external_id_conflict")));

    let (status, report) = send(sim.http.get(sim.url("/_admin/effects"))).await?;
    assert_eq!(status, StatusCode::OK);
    let report: EffectsReport = serde_json::from_value(report)?;
    assert_eq!(report.effects, 1);
    assert_eq!(report.tasks.len(), 1);
    assert_eq!(report.tasks[0].task_id, seeded["task_id"].as_str().unwrap_or_default());
    assert_eq!(report.tasks[0].idempotency_key.as_deref(), Some("op-s"));
    assert_eq!(report.tasks[0].payload_hash, hash(9));
    assert_eq!((report.requests.creates, report.requests.readbacks, report.requests.queries), (2, 0, 0));
    assert_eq!(report, sim.sim.report().await?);
    sim.stop().await
}

#[tokio::test]
async fn latency_applies_to_every_v1_request() -> Result<()> {
    let config = SimConfig { latency: Duration::from_millis(250), ..SimConfig::default() };
    let sim = Sim::start(config).await?;
    for request in [
        sim.create(None, "op-l", &hash(1)),
        sim.get("/v1/tasks/by-external-id/op-l"),
        sim.http.get(sim.url("/v1/tasks/by-key/x")),
    ] {
        let started = Instant::now();
        request.send().await?;
        assert!(started.elapsed() >= Duration::from_millis(250), "{:?}", started.elapsed());
    }
    let started = Instant::now();
    sim.http.get(sim.url("/_admin/effects")).send().await?;
    assert!(started.elapsed() < Duration::from_millis(250), "admin is not delayed");
    sim.stop().await
}

#[tokio::test]
async fn shutdown_cuts_a_held_reply_short() -> Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    sim.sim.faults().inject(Fault::always(FaultKind::LoseReplyAfterCommit));

    let request = tokio::spawn(sim.create(Some("op-h"), "op-h", &hash(1)).send());
    eventually(Duration::from_secs(10), "the create is committed", || async {
        Ok((sim.sim.effects().await? == 1).then_some(()))
    })
    .await?;
    let started = Instant::now();
    let Sim { shutdown, server, sim: handle, _postgres, .. } = sim;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), server).await.context("server stopped")???;
    assert!(started.elapsed() < Duration::from_secs(5));
    let error = request.await?.expect_err("no response, even at shutdown");
    assert!(error.status().is_none(), "{error:?}");
    assert_eq!(handle.effects().await?, 1);
    Ok(())
}
