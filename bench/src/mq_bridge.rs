//! A relay that reads the write-ahead log, side by side with handoff's: mq-bridge
//! (<https://github.com/marcomq/mq-bridge>, a Rust engine installed from PyPI) takes the approved
//! actions' inserts from a logical replication slot and publishes each to JetStream with a
//! message id, writing nothing per row to the database. It is what issue 10 measured handoff
//! against before the range claim (no per-row UPDATE, but no multi-relay safety, no per-row
//! failure state and no operation key as message id). Both drain the same backlog, recorded by the
//! same statement, on the same Postgres server (`wal_level = logical`) and the same broker.
//!
//! The driver is `bench/mq_bridge_drain.py`, run by the Python of a virtual environment the bench
//! makes on first use (`target/mq-bridge-<version>`, or [`VENV_ENV`]) with `pip install`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use handoff_shared::Subjects;

use crate::ceilings::stream_settings;
use crate::measure::{Meter, Sample};
use crate::workload;
use crate::world::{Service, World};

/// The release measured: pinned, so a run compares with the same engine until this changes.
pub const VERSION: &str = "1.2.0";
/// Overrides where the virtual environment with mq-bridge is (made there if missing).
pub const VENV_ENV: &str = "HANDOFF_BENCH_MQ_BRIDGE_VENV";
/// Rows per batch: the relay's claim.
const BATCH_SIZE: i64 = 1_000;
/// The driver, written next to the environment's Python at run time.
const DRIVER: &str = include_str!("../mq_bridge_drain.py");
/// The publication the slot decodes: the approved actions, which carry what a message needs.
const PUBLICATION: &str = "handoff_bench_wal";
/// How often the drain polls the stream and the slot.
const POLL: Duration = Duration::from_millis(10);
/// Longest a drain (or the route's start) may take before the run is declared stuck.
const STUCK: Duration = Duration::from_secs(600);

/// The Python with mq-bridge [`VERSION`] and the driver beside it, installing both if needed.
pub fn python() -> Result<(PathBuf, PathBuf)> {
    let dir =
        std::env::var_os(VENV_ENV).map_or_else(|| PathBuf::from(format!("target/mq-bridge-{VERSION}")), PathBuf::from);
    let python = dir.join("bin").join("python");
    let check = format!("import importlib.metadata as m, mq_bridge; assert m.version('mq-bridge') == '{VERSION}'");
    let installed = python.is_file() && Command::new(&python).args(["-c", &check]).status().is_ok_and(|s| s.success());
    if !installed {
        eprintln!("   installing mq-bridge {VERSION} from PyPI into {}", dir.display());
        run(Command::new("python3").args(["-m", "venv"]).arg(&dir))?;
        run(Command::new(&python).args(["-m", "pip", "install", "--quiet", &format!("mq-bridge=={VERSION}")]))?;
        run(Command::new(&python).args(["-c", &check]))?;
    }
    let driver = dir.join("mq_bridge_drain.py");
    std::fs::write(&driver, DRIVER).with_context(|| format!("writing {}", driver.display()))?;
    Ok((python, driver))
}

fn run(command: &mut Command) -> Result<()> {
    let status = command.status().with_context(|| format!("running {command:?}"))?;
    ensure!(status.success(), "{command:?} failed: {status}");
    Ok(())
}

/// What a drain found in the stream afterwards.
#[derive(Debug, Clone, Default)]
pub struct WalChecks {
    pub stream_messages: u64,
}

/// mq-bridge drains a backlog of `n` actions recorded at once, as [`crate::system::relay_drain`]
/// drains it: the route is started and streaming from its slot before the backlog commits, and
/// the clock runs from that commit until the stream holds every message.
pub async fn drain(world: &mut World, python: &Path, driver: &Path, n: i64) -> Result<(Sample, WalChecks)> {
    let db = world.database("bench_wal", 2).await?;
    handoff_relay::SCHEMA.migrate(&db.pool).await?;
    let stream = world.unique("WAL");
    let subjects = Subjects::new(stream.to_lowercase())?;
    handoff_relay::publisher::ensure_stream(
        &world.js,
        &stream_settings(&stream, &subjects, world.profile.replicas()),
        false,
    )
    .await?;
    let slot = format!("{}_slot", stream.to_lowercase());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE PUBLICATION {PUBLICATION} FOR TABLE handoff.approved_action")))
        .execute(&db.pool)
        .await?;
    sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')").bind(&slot).execute(&db.pool).await?;
    let env: Vec<(String, String)> = [
        ("MQB_DATABASE_URL", db.url.clone()),
        ("MQB_PUBLICATION", PUBLICATION.to_owned()),
        ("MQB_SLOT", slot.clone()),
        ("MQB_NATS_URL", world.nats.url()),
        ("MQB_STREAM", stream.clone()),
        ("MQB_SUBJECT", format!("{}.wal", subjects.prefix())),
        ("MQB_BATCH_SIZE", BATCH_SIZE.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    let driver = driver.to_str().context("the driver's path is not UTF-8")?;
    let mut service = Service::spawn_program("mq-bridge", python, &[driver], &env)?;
    // Streaming from the slot: the slot is active.
    let started = Instant::now();
    loop {
        let active: Option<bool> = sqlx::query_scalar("SELECT active FROM pg_replication_slots WHERE slot_name = $1")
            .bind(&slot)
            .fetch_optional(&db.pool)
            .await?;
        if active == Some(true) {
            break;
        }
        service.ensure_running()?;
        ensure!(started.elapsed() < STUCK, "mq-bridge did not start streaming from slot {slot}");
        tokio::time::sleep(POLL).await;
    }

    let mut tx = db.pool.begin().await?;
    workload::record_actions(&mut *tx, "w", 1, n).await?;
    let meter = Meter::start(world, std::slice::from_ref(&service));
    tx.commit().await?;
    let started = Instant::now();
    loop {
        let stored = world.stream_messages(&stream).await?;
        if stored >= n as u64 {
            break;
        }
        if started.elapsed() > STUCK {
            bail!("mq-bridge stuck: {stored} of {n} messages after {STUCK:?}");
        }
        service.ensure_running()?;
        tokio::time::sleep(POLL).await;
    }
    let sample = meter.finish(world, std::slice::from_ref(&service), n as u64);
    service.stop().await?;
    let checks = WalChecks { stream_messages: world.stream_messages(&stream).await? };
    // A database with a logical slot cannot be dropped; the slot is inactive once the route stopped.
    sqlx::query("SELECT pg_drop_replication_slot($1)").bind(&slot).execute(&db.pool).await?;
    world.drop_stream(&stream).await;
    world.drop_database(db).await?;
    Ok((sample, checks))
}
