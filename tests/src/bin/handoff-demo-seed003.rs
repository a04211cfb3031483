//! Seed 003 on real infrastructure: three approved welcome actions through the relay, JetStream and
//! a consumer replica talking to the CRM simulator over HTTP: one succeeds, one loses its reply
//! after the CRM committed, one loses its reply and cannot be read back. The replica is restarted
//! in between. Prints the seed's BASELINE / FIRST_RUN / RESTART / SUMMARY / CHECK lines.
//!
//! `--review-minutes N` (default 4) and `--hourly-rate R` (default 30.00) price the review queue.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Result, ensure};
use handoff_consumer::remote::Capability;
use handoff_consumer::remote::dispatcher::{DispatchSettings, Dispatched};
use handoff_consumer::remote::{LedgerState, ledger};
use handoff_crm_sim::{Fault, FaultKind, SimConfig};
use handoff_relay::ApprovedAction;
use handoff_tests::TestEnv;
use serde_json::json;

const LEADS: [&str; 3] = ["lead-201", "lead-202", "lead-203"];

fn key(lead: &str) -> String {
    format!("acme:send-welcome:v1:{lead}")
}

fn flag(name: &str, default: f64) -> f64 {
    std::env::args().skip_while(|a| a != name).nth(1).and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[tokio::main]
async fn main() -> Result<()> {
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "error,async_nats=off".into());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let review_minutes_each = flag("--review-minutes", 4.0);
    let hourly_rate = flag("--hourly-rate", 30.0);
    eprintln!("starting Postgres, NATS and the CRM simulator...");
    let env = TestEnv::start().await?;

    // The naive baseline: the lost reply is retried with a fresh request id, so the CRM cannot
    // recognise it. Against its own simulator, so its effects are counted apart.
    let naive = env.crm_sim(SimConfig::default()).await?;
    naive.sim.faults().inject(Fault { target: None, kind: FaultKind::LoseReplyAfterCommit, times: Some(1) });
    let client = reqwest::Client::builder().timeout(Duration::from_millis(500)).build()?;
    for attempt in 1..=2 {
        let _ = client
            .post(format!("{}/v1/tasks", naive.url))
            .bearer_auth(SimConfig::default().auth_token)
            .json(&json!({"external_id": format!("attempt-{attempt}-{}", rand::random::<u32>()),
                          "payload_hash": "0".repeat(64), "data": {"recipient_ref": "lead-202", "template": "welcome-v1"}}))
            .send()
            .await;
    }
    let naive_effects = naive.effects().await?;
    println!("BASELINE {}", json!({"attempts": 2, "duplicates": naive_effects - 1, "external_actions": naive_effects}));

    // The safe path.
    let sim = env.crm_sim(SimConfig::default()).await?;
    sim.sim.faults().inject(Fault::once_for(key("lead-202"), FaultKind::LoseReplyAfterCommit));
    sim.sim.faults().inject(Fault::once_for(key("lead-203"), FaultKind::LoseReplyAfterCommit));
    sim.sim.faults().inject(Fault { target: Some(key("lead-203")), kind: FaultKind::ReadbackUnavailable, times: None });

    let relay = env.relay(env.relay_settings()).await?;
    for lead in LEADS {
        let action = ApprovedAction::parse(
            &key(lead),
            json!({"recipient_ref": lead, "template": "welcome-v1"}),
            "user-17",
            chrono::Utc::now(),
        )?;
        let mut tx = env.producer_db.begin().await?;
        handoff_relay::record_approved_action(&mut tx, &action).await?;
        tx.commit().await?;
    }
    ensure!(relay.publish_batch().await?.published == 3, "three actions published");
    let consumer = env.remote_consumer().await?;
    ensure!(consumer.fetch_and_handle(Duration::from_secs(5)).await?.len() == 3, "three actions taken in");

    // No readback grace: an unavailable readback goes straight to review, as in the seed.
    let settings = DispatchSettings { readback_window: Duration::ZERO, ..env.dispatch_settings() };
    let first = env.dispatcher(env.sim_crm(&sim, Capability::ExternalId), settings.clone()).await?;
    let first_run = run(&env, &first.dispatch_due().await?).await?;
    println!("FIRST_RUN {}", serde_json::to_string(&first_run)?);

    // Restart: the replica (intake and dispatcher) is gone; a new one starts on the same database.
    drop((first, consumer));
    let restarted = env.dispatcher(env.sim_crm(&sim, Capability::ExternalId), settings).await?;
    let recovered = run(&env, &restarted.dispatch_due().await?).await?;
    println!("RESTART {}", serde_json::to_string(&recovered)?);

    let states: BTreeMap<String, i64> = ledger::count_by_state(&env.consumer_db)
        .await?
        .into_iter()
        .map(|(s, n)| (s.as_str().to_uppercase(), n))
        .collect();
    let provider_actions = sim.effects().await?;
    let report = sim.sim.report().await?;
    let distinct: std::collections::HashSet<_> = report.tasks.iter().map(|t| &t.external_id).collect();
    let duplicates = provider_actions - distinct.len() as i64;
    let reviews = states.get("REVIEW").copied().unwrap_or(0);
    let review_minutes = reviews as f64 * review_minutes_each;
    let review_cost = review_minutes / 60.0 * hourly_rate;
    println!(
        "SUMMARY {}",
        json!({
            "duplicates": duplicates,
            "logical_actions": LEADS.len(),
            "provider_actions": provider_actions,
            "review_cost_usd": format!("{review_cost:.2}"),
            "review_minutes": if review_minutes.fract() == 0.0 { json!(review_minutes as i64) } else { json!(review_minutes) },
            "states": states,
        })
    );
    let pass = naive_effects - 1 == 1
        && provider_actions == 3
        && duplicates == 0
        && states == BTreeMap::from([("REVIEW".to_string(), 1), ("SETTLED".to_string(), 2)]);
    println!("CHECK {}", if pass { "PASS" } else { "FAIL" });
    ensure!(pass, "seed 003 acceptance rule not met");
    Ok(())
}

/// One line per action in the seed's shape: attempts, key, path, state.
async fn run(env: &TestEnv, dispatched: &[Dispatched]) -> Result<Vec<serde_json::Value>> {
    let mut rows = Vec::new();
    for lead in LEADS {
        let key = key(lead);
        let (state, attempts): (String, i32) =
            sqlx::query_as("SELECT state, attempts FROM handoff_consumer.crm_operation WHERE operation_key = $1")
                .bind(&key)
                .fetch_one(&env.consumer_db)
                .await?;
        let path = match dispatched.iter().find(|d| d.operation_key == key) {
            None => "cached",
            Some(d) if d.call == "create" && d.state == LedgerState::Settled => "sent",
            Some(d) if d.state == LedgerState::Unknown => "hold",
            Some(d) if d.state == LedgerState::Settled => "reconciled",
            Some(d) if d.state == LedgerState::Review => "manual",
            Some(_) => "other",
        };
        rows.push(json!({"attempts": attempts, "key": key, "path": path, "state": state.to_uppercase()}));
    }
    Ok(rows)
}
