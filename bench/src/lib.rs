//! `handoff-bench`: measures the relay and the consumer against the bare ceilings of the machine it
//! runs on, in one run, on servers it starts itself (the test harness's containers), and prints a
//! table and writes JSON. Every figure is min / median / max over repeated runs, and every result
//! is a ratio to a ceiling measured in the same run: absolute numbers drift on a shared machine.
//!
//! * [`ceilings`]: minimal loops written for the benchmark (publish, claim+mark, inbox+task, bare
//!   relay, bare consumer, publish->consume round trip, the bare pipeline's commit->commit).
//! * [`system`]: the real release binaries (relay drain, consumer drain, end to end).
//! * [`plans`]: claim cost and query plans as the backlog grows.
//! * [`reconcile`]: `handoff-admin reconcile` over a filled outbox, stream and inbox.
//! * [`soak`]: table sizes and transaction ages under retention (only with `--soak`).
//! * [`report`]: rows, table and JSON.

pub mod ceilings;
pub mod cpus;
pub mod measure;
pub mod mq_bridge;
pub mod plans;
pub mod reconcile;
pub mod report;
pub mod signing;
pub mod soak;
pub mod system;
pub mod workload;
pub mod world;

use handoff_consumer::remote::Adapter;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{Value, json};

use crate::ceilings::FilledStream;
use crate::measure::{Sample, rates, usage};
use crate::report::{Latency, Percentiles, Report, Row, Stats};
use crate::workload::Payloads;
use crate::world::{Profile, World};

/// The peak RSS the issue allows the relay and the consumer with a 100k backlog.
const RSS_LIMIT_MIB: f64 = 50.0;

/// The note of the large payloads (a payload is at most 64 KiB canonical).
const LARGE_NOTE_BYTES: usize = 60 * 1024;
/// Actions of the large-payload relay drain: enough for several claims per worker.
const LARGE_BACKLOG: i64 = 8_000;
const LARGE_BACKLOG_QUICK: i64 = 500;

/// What to measure. `--quick` is the CI smoke configuration (well under a minute).
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "handoff-bench",
    version,
    about = "Relay and consumer throughput and latency against this machine's bare ceilings"
)]
pub struct BenchArgs {
    /// Small and fast: 5,000 actions, one run, short loads, small plans (a CI smoke test).
    #[arg(long)]
    pub quick: bool,
    /// Backlog size of the drain measurements (relay, consumer, ceilings, end-to-end maximum).
    #[arg(long, default_value_t = 100_000)]
    pub actions: i64,
    /// Backlog size in the profiles after the first (`durable`, `cluster`: their headline rows,
    /// including a pipelined relay drain, which a durable broker fsyncs message by message).
    #[arg(long, default_value_t = 50_000)]
    pub durable_actions: i64,
    /// Repetitions of every measurement (figures are min / median / max over them).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Relay process counts to measure (one worker each), compared with bare relay loops with as
    /// many workers.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub relays: Vec<usize>,
    /// Consumer replica counts to measure, compared with bare consumer loops with as many workers.
    #[arg(long, value_delimiter = ',', default_value = "1,3,6")]
    pub replicas: Vec<usize>,
    /// Relay processes (default workers) in the end-to-end pipeline.
    #[arg(long, default_value_t = 1)]
    pub e2e_relays: usize,
    /// Consumer replicas in the end-to-end pipeline.
    #[arg(long, default_value_t = 3)]
    pub e2e_replicas: usize,
    /// Offered loads, as fractions of the measured end-to-end maximum.
    #[arg(long, value_delimiter = ',', default_value = "0.1,0.5,0.9")]
    pub loads: Vec<f64>,
    /// Seconds each offered load runs.
    #[arg(long, default_value_t = 5.0)]
    pub load_secs: f64,
    /// Messages timed for the publish->consume round trip, and actions for the bare pipeline's.
    #[arg(long, default_value_t = 1_000)]
    pub rtt_samples: usize,
    /// Backlog sizes at which the claim is timed and explained (ascending; empty to skip).
    #[arg(long, default_value = "10000,100000,1000000", value_parser = parse_backlogs)]
    pub plan_backlogs: Backlogs,
    /// Broker profiles: `default` (one server, sync_interval 2 min), `durable` (one server,
    /// sync_interval always) and `cluster` (three nodes, sync_interval always, R3 streams); the
    /// first runs every row, the others the headline rows.
    #[arg(long, value_delimiter = ',', default_value = "default,durable,cluster")]
    pub profiles: Vec<String>,
    /// Also run the retention soak with this many actions (e.g. 1000000); 0 = no soak.
    #[arg(long, default_value_t = 0)]
    pub soak: i64,
    /// Offered rate of the soak, actions per second.
    #[arg(long, default_value_t = 5_000.0)]
    pub soak_rate: f64,
    /// Relay retention during the soak, seconds.
    #[arg(long, default_value_t = 30)]
    pub soak_retention_secs: u64,
    /// Latency the simulated remote CRM adds to every request, milliseconds (remote section).
    #[arg(long, default_value_t = 5)]
    pub crm_latency_ms: u64,
    /// CRM calls in flight per replica to measure in the remote section.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    pub crm_in_flight: Vec<i64>,
    /// Consumer replica counts of the remote section.
    #[arg(long, value_delimiter = ',', default_value = "1,3")]
    pub crm_replicas: Vec<usize>,
    /// Adapters of the remote section, each against the simulator speaking its shape.
    #[arg(long, value_delimiter = ',', value_enum, default_value = "tasks-api,upsert,unique-property")]
    pub crm_adapters: Vec<handoff_consumer::remote::Adapter>,
    /// Where the remote section runs the CRM simulator: `split` puts it and its Postgres server on
    /// half of the CPUs and the caller's side (this process, the consumers, their Postgres server,
    /// NATS) on the other half, as a remote CRM would be; `shared` lets them compete for every CPU.
    #[arg(long, value_enum, default_value = "split")]
    pub crm_cpus: cpus::CrmCpus,
    /// Extra environment for every relay process, KEY=VALUE (e.g. HANDOFF_RELAY_BATCH_SIZE=1000), to
    /// measure settings other than the defaults.
    #[arg(long, value_delimiter = ',')]
    pub relay_env: Vec<String>,
    /// Extra environment for every consumer process, KEY=VALUE.
    #[arg(long, value_delimiter = ',')]
    pub consumer_env: Vec<String>,
    /// Published (and received) rows `handoff-admin reconcile` checks in the reconcile section.
    #[arg(long, default_value_t = 1_000_000)]
    pub reconcile_rows: i64,
    /// Sections to run: ceilings, relay, consumer, remote, e2e, plans, reconcile, signing (the publish
    /// ceiling always runs: the consumer measurements read its stream). `remote` and `signing` run in
    /// the first profile only: the broker's fsync setting does not bear on them. Not by default:
    /// `mq-bridge`, the relay side by side with a WAL-reading relay (mq-bridge, installed from PyPI
    /// on first use), in the first profile.
    #[arg(long, value_delimiter = ',', default_value = "ceilings,relay,consumer,remote,e2e,plans,reconcile,signing")]
    pub only: Vec<String>,
    /// Run the producer's and the consumer's databases on one Postgres server. By default the
    /// pipelines give the consumer its own server, as `deploy/compose.yaml` does.
    #[arg(long)]
    pub shared_postgres: bool,
    /// Where the JSON report goes.
    #[arg(long, default_value = "target/handoff-bench/report.json")]
    pub json: PathBuf,
}

/// The backlog sizes of `--plan-backlogs`: a comma-separated list, or empty (`""`) for none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backlogs(pub Vec<i64>);

fn parse_backlogs(s: &str) -> Result<Backlogs, String> {
    s.split(',')
        .map(str::trim)
        .filter(|part| !part.is_empty())
        .map(|part| match part.parse::<i64>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("{part:?} is not a backlog size (a whole number above 0)")),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Backlogs)
}

impl BenchArgs {
    fn runs_section(&self, section: &str) -> bool {
        self.only.iter().any(|s| s == section)
    }

    /// Applies `--quick`.
    pub fn effective(mut self) -> Self {
        if self.quick {
            self.actions = 5_000;
            self.durable_actions = 2_000;
            self.runs = 1;
            self.relays = vec![1, 2];
            self.replicas = vec![1, 3];
            self.loads = vec![0.1, 0.5];
            self.load_secs = 2.0;
            self.rtt_samples = 200;
            self.plan_backlogs = Backlogs(vec![10_000]);
            self.crm_in_flight = vec![16];
            self.crm_replicas = vec![1];
            self.reconcile_rows = 5_000;
        }
        self.runs = self.runs.max(1);
        self
    }
}

/// Runs every measurement and returns the report (also printed and written by `main`).
pub async fn run(args: BenchArgs) -> Result<Report> {
    let started = Instant::now();
    let started_at = chrono::Utc::now().to_rfc3339();
    let mut report = Report {
        started_at,
        machine: machine(),
        settings: settings(&args),
        rows: Vec::new(),
        plans: Vec::new(),
        soak: None,
        not_measured: Vec::new(),
        elapsed_s: 0.0,
    };
    let mut postgres = None;
    for (i, name) in args.profiles.iter().enumerate() {
        let profile = Profile::parse(name)?;
        let mut world = match postgres.take() {
            None => World::start(profile, args.shared_postgres).await?,
            Some(pg) => World::with_postgres(pg, profile).await?,
        };
        world.relay_extra = key_values(&args.relay_env)?;
        world.consumer_extra = key_values(&args.consumer_env)?;
        // The headline rows in every profile; the full set in the first.
        let full = i == 0;
        eprintln!("== profile {} ({})", profile.name(), if full { "all rows" } else { "headline rows" });
        profile_rows(&mut world, &args, full, &mut report).await?;
        if full && args.runs_section("signing") {
            signing_rows(&world, &args, &mut report)?;
        }
        if full && args.runs_section("reconcile") {
            reconcile_rows(&mut world, &args, &mut report).await?;
        }
        if full && args.runs_section("mq-bridge") {
            mq_bridge_rows(&mut world, &args, &mut report).await?;
        }
        if full && !args.plan_backlogs.0.is_empty() && args.runs_section("plans") {
            eprintln!("== claim cost at backlogs {:?}", args.plan_backlogs.0);
            let batch = handoff_relay::RelaySettings::default().batch_size;
            report.plans = plans::claim_cost(&world, &args.plan_backlogs.0, batch).await?;
        }
        if full && args.soak > 0 {
            eprintln!(
                "== soak: {} actions at {}/s, retention {} s",
                args.soak, args.soak_rate, args.soak_retention_secs
            );
            report.soak = Some(
                soak::soak(
                    &mut world,
                    args.soak,
                    args.soak_rate,
                    args.soak_retention_secs,
                    args.e2e_relays,
                    args.e2e_replicas,
                )
                .await?,
            );
        }
        postgres = Some(world.into_postgres().await);
    }
    report.elapsed_s = started.elapsed().as_secs_f64();
    Ok(report)
}

/// `handoff-admin reconcile` over `--reconcile-rows` published and received rows, against the bare
/// stream reads it makes.
async fn reconcile_rows(world: &mut World, args: &BenchArgs, report: &mut Report) -> Result<()> {
    let n = args.reconcile_rows;
    eprintln!("-- reconcile ({n} published rows, {n} inbox rows)");
    let filled = reconcile::fill(world, n).await?;
    let ceiling = repeat(args.runs, "bare stream reads", async || reconcile::bare_reads(world, &filled).await).await?;
    let ceiling = throughput_row(
        world.profile,
        "ceiling",
        "stream_reads",
        format!("ceiling: read {n} stream sequences, {} in flight", handoff_relay::reconcile::PROBE_CONCURRENCY),
        "rows/s",
        &ceiling,
    );
    report.rows.push(ceiling.clone());
    let mut checks = Vec::new();
    let samples = repeat(args.runs, "reconcile", async || {
        let (sample, c) = reconcile::reconcile(world, &filled).await?;
        checks.push(c);
        Ok(sample)
    })
    .await?;
    let mut row = throughput_row(
        world.profile,
        "operations",
        "reconcile",
        format!("reconcile: {n} published rows against the stream, {n} inbox rows"),
        "rows/s",
        &samples,
    )
    .param("rows", n)
    .against(&ceiling);
    let seconds: Vec<f64> = samples.iter().map(|s| s.elapsed.as_secs_f64()).collect();
    row.check("seconds_per_run", json!(seconds));
    row.check("mismatches", checks.iter().map(|c| c.mismatches).max().unwrap_or_default());
    row.check("published_rows_checked", json!(checks.iter().map(|c| c.published_rows_checked).collect::<Vec<_>>()));
    row.target(
        "every row checked, nothing reported",
        checks
            .iter()
            .all(|c| c.mismatches == 0 && c.published_rows_checked == n as u64 && c.inbox_rows_checked == n as u64),
    );
    row.target("1M rows in minutes: <= 600 s per million", seconds.iter().all(|s| s / n as f64 * 1e6 <= 600.0));
    report.rows.push(row);
    reconcile::drop_filled(world, filled).await
}

/// The relay (2 processes x 1 worker: its defaults, and publishing pipelined) and mq-bridge reading
/// the WAL drain the same backlog on one Postgres server with `wal_level = logical`, in an order
/// that rotates from run to run (on a shared machine the later drains of a round tend to run
/// slower). The relay's rows are ratios to mq-bridge's; their CPU per row across relay (or
/// mq-bridge), Postgres and NATS is checked against mq-bridge's.
async fn mq_bridge_rows(world: &mut World, args: &BenchArgs, report: &mut Report) -> Result<()> {
    const RELAYS: usize = 2;
    let n = args.actions;
    eprintln!("-- mq-bridge {} side by side ({n} actions, a server with wal_level logical)", mq_bridge::VERSION);
    let (python, driver) = mq_bridge::python()?;
    let logical = crate::world::start_logical_postgres().await?;
    let usual = std::mem::replace(&mut world.postgres.producer, logical);
    // Each run: mq-bridge, the relay as deployed (auto: atomic batches here) and the relay
    // publishing message by message as mq-bridge does, in an order that rotates from run to run.
    let measured = async {
        let mut wal = (vec![], vec![]);
        let mut relay = [(vec![], vec![]), (vec![], vec![])];
        for run in 1..=args.runs {
            for step in 0..3 {
                let t = Instant::now();
                match (step + run) % 3 {
                    0 => {
                        let (sample, c) =
                            mq_bridge::drain(world, &python, &driver, n).await.context("mq-bridge drain")?;
                        wal.0.push(sample);
                        wal.1.push(c.stream_messages);
                        eprintln!("   mq-bridge: run {run}/{} done in {:.1} s", args.runs, t.elapsed().as_secs_f64());
                    }
                    mode => {
                        let pipelined = mode == 2;
                        if pipelined {
                            world.relay_extra.push(("HANDOFF_PUBLISH_MODE".into(), "pipelined".into()));
                        }
                        let drained = system::relay_drain(world, n, RELAYS, 1, false, Payloads::Small).await;
                        if pipelined {
                            world.relay_extra.pop();
                        }
                        let (sample, c) = drained.context("relay drain")?;
                        let into = &mut relay[usize::from(pipelined)];
                        into.0.push(sample);
                        into.1.push(c.stream_messages);
                        eprintln!(
                            "   relay x{RELAYS}{}: run {run}/{} done in {:.1} s",
                            if pipelined { ", pipelined" } else { "" },
                            args.runs,
                            t.elapsed().as_secs_f64()
                        );
                    }
                }
            }
        }
        anyhow::Ok((wal, relay))
    }
    .await;
    let logical = std::mem::replace(&mut world.postgres.producer, usual);
    drop(logical);
    let (wal, relay) = measured?;
    let p = world.profile;
    let stored_once = |stored: &[u64]| stored.iter().all(|&m| m == n as u64);
    let mut wal_row = throughput_row(
        p,
        "comparison",
        "mq_bridge",
        format!("mq-bridge {}: logical replication -> JetStream, msg ids, {n} backlog", mq_bridge::VERSION),
        "rows/s",
        &wal.0,
    )
    .param("version", mq_bridge::VERSION)
    .param("backlog", n);
    wal_row.check("stream_messages_per_run", json!(wal.1));
    wal_row.target("no message stored twice", stored_once(&wal.1));
    // CPU per row of everything but the load generator: the relay (or mq-bridge), Postgres, NATS.
    let cpu_per_row = |row: &Row| -> f64 {
        row.processes.iter().filter(|u| u.role != "bench").map(|u| u.cpu_us_per_item.median).sum()
    };
    let wal_cpu = cpu_per_row(&wal_row);
    report.rows.push(wal_row.clone());
    for (pipelined, (samples, stored)) in relay.iter().enumerate() {
        let (id, label) = match pipelined {
            0 => ("relays=2/wal_level_logical", "same server and backlog as mq-bridge"),
            _ => ("relays=2/pipelined/wal_level_logical", "pipelined, same server and backlog as mq-bridge"),
        };
        let mut row = throughput_row(
            p,
            "comparison",
            id,
            format!("relay: {RELAYS} process(es) x 1 worker, {label}"),
            "rows/s",
            samples,
        )
        .param("relays", RELAYS)
        .param("publish_mode", if pipelined == 1 { "pipelined" } else { "auto" })
        .param("backlog", n)
        .against(&wal_row);
        row.check("stream_messages_per_run", json!(stored));
        row.target("no message stored twice", stored_once(stored));
        let cpu = cpu_per_row(&row);
        row.check("cpu_us_per_row", cpu);
        row.check("mq_bridge_cpu_us_per_row", wal_cpu);
        row.check("cpu_per_row_vs_mq_bridge", cpu / wal_cpu);
        report.rows.push(row);
    }
    Ok(())
}

/// What signing costs per message: encoding signed against unsigned (the relay's side), opening
/// with verification against opening without (the consumer's side), on one core in this process.
fn signing_rows(world: &World, args: &BenchArgs, report: &mut Report) -> Result<()> {
    let n = signing::MESSAGES;
    eprintln!("-- signing ({n} envelopes, in process)");
    let envelopes = signing::envelopes(n)?;
    let key = &world.keys.signing;
    let policy = handoff_shared::signing::SignaturePolicy::new([key.clone()], false)?;
    let unchecked = handoff_shared::signing::SignaturePolicy::unchecked();
    let (mut unsigned, mut signed, mut plain_open, mut verified_open) = (vec![], vec![], vec![], vec![]);
    for _ in 0..args.runs {
        let (sample, unsigned_bodies) = signing::encode(&envelopes, None);
        unsigned.push(sample);
        let (sample, bodies) = signing::encode(&envelopes, Some(key));
        signed.push(sample);
        plain_open.push(signing::open(&envelopes, &unsigned_bodies, &unchecked)?);
        verified_open.push(signing::open(&envelopes, &bodies, &policy)?);
    }
    let us_per_message =
        |s: &[Sample]| Stats::of(s.iter().map(|s| s.elapsed.as_secs_f64() * 1e6 / s.items as f64).collect()).median;
    let p = world.profile;
    let encode_ceiling = throughput_row(
        p,
        "ceiling",
        "encode_unsigned",
        "ceiling: encode envelopes, unsigned".into(),
        "msg/s",
        &unsigned,
    );
    let mut encode = throughput_row(
        p,
        "signing",
        "encode_signed",
        "relay: encode and sign envelopes (HMAC-SHA256)".into(),
        "msg/s",
        &signed,
    )
    .against(&encode_ceiling);
    encode.check("sign_us_per_message", us_per_message(&signed) - us_per_message(&unsigned));
    let open_ceiling = throughput_row(
        p,
        "ceiling",
        "open_unchecked",
        "ceiling: open envelopes, no signature check".into(),
        "msg/s",
        &plain_open,
    );
    let mut open = throughput_row(
        p,
        "signing",
        "open_verified",
        "consumer: open envelopes and verify signatures".into(),
        "msg/s",
        &verified_open,
    )
    .against(&open_ceiling);
    open.check("verify_us_per_message", us_per_message(&verified_open) - us_per_message(&plain_open));
    report.rows.extend([encode_ceiling, encode, open_ceiling, open]);
    Ok(())
}

/// Repeats `measure` `runs` times.
async fn repeat<T>(runs: usize, what: &str, mut measure: impl AsyncFnMut() -> Result<T>) -> Result<Vec<T>> {
    let mut out = Vec::with_capacity(runs);
    for run in 1..=runs {
        let t = Instant::now();
        out.push(measure().await.with_context(|| format!("{what}, run {run}"))?);
        eprintln!("   {what}: run {run}/{runs} done in {:.1} s", t.elapsed().as_secs_f64());
    }
    Ok(out)
}

fn throughput_row(profile: Profile, section: &str, id: &str, label: String, unit: &str, samples: &[Sample]) -> Row {
    let mut row = Row::new(profile.name(), section, id, label, unit, rates(samples));
    row.processes = usage(samples);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let busy: Vec<f64> =
        samples.iter().map(|s| s.cpu_s.values().sum::<f64>() / s.elapsed.as_secs_f64() / cores).collect();
    row.check("cpu_utilization_median", Stats::of(busy).median);
    row
}

/// Every row of one profile (`full`: all of them; otherwise the headline rows).
async fn profile_rows(world: &mut World, args: &BenchArgs, full: bool, report: &mut Report) -> Result<()> {
    let p = world.profile;
    let n = if full { args.actions } else { args.durable_actions };
    let runs = args.runs;
    let scratch = world.database("bench_check", 1).await?;
    handoff_relay::SCHEMA.migrate(&scratch.pool).await?;
    workload::check_sql_hash(&scratch.pool).await?;
    world.drop_database(scratch).await?;

    let relay_counts: Vec<usize> = if full { args.relays.clone() } else { vec![middle(&args.relays)] };
    let replica_counts: Vec<usize> = if full { args.replicas.clone() } else { vec![middle(&args.replicas)] };

    // --- ceilings
    eprintln!("-- ceilings ({n} items)");
    let messages = ceilings::envelopes("c", n, &world.keys.signing)?;
    let mut source: Option<FilledStream> = None;
    let publish = repeat(runs, "publish ceiling", async || {
        if let Some(old) = source.take() {
            world.drop_stream(&old.name).await;
        }
        let (sample, stream) = ceilings::publish(world, &messages).await?;
        source = Some(stream);
        Ok(sample)
    })
    .await?;
    drop(messages);
    let source = source.context("no source stream")?;
    let publish_row = throughput_row(
        p,
        "ceiling",
        "publish",
        "ceiling: JetStream publish, pipelined, msg ids".into(),
        "msg/s",
        &publish,
    );
    report.rows.push(publish_row);

    // The atomic-batch ceiling, with as many batches open as the middle relay row runs relays.
    let open_batches = middle(&relay_counts);
    let atomic_messages = ceilings::envelopes("a", n, &world.keys.signing)?;
    let atomic = repeat(runs, "atomic publish ceiling", async || {
        let (sample, stream) = ceilings::publish_atomic(world, &atomic_messages, open_batches).await?;
        world.drop_stream(&stream).await;
        Ok(sample)
    })
    .await?;
    drop(atomic_messages);
    let atomic_row = throughput_row(
        p,
        "ceiling",
        &format!("publish_atomic/open={open_batches}"),
        format!("ceiling: JetStream atomic batches of {}, {open_batches} open, msg ids", ceilings::ATOMIC_BATCH),
        "msg/s",
        &atomic,
    )
    .param("open_batches", open_batches)
    .param("batch", ceilings::ATOMIC_BATCH);
    report.rows.push(atomic_row.clone());

    let ceilings = args.runs_section("ceilings");
    if full && ceilings {
        let samples = repeat(runs, "claim+mark ceiling", async || {
            let db = world.database("bench_bare", 4).await?;
            ceilings::create_bare_schema(&db.pool).await?;
            ceilings::fill_bare_outbox(&db.pool, n).await?;
            let sample = ceilings::claim_mark(world, &db.pool, n, 2).await;
            world.drop_database(db).await?;
            sample
        })
        .await?;
        report.rows.push(
            throughput_row(
                p,
                "ceiling",
                "claim_mark",
                "ceiling: claim+mark 1,000 rows, 2 workers".into(),
                "rows/s",
                &samples,
            )
            .param("workers", 2),
        );
        let samples = repeat(runs, "inbox+task ceiling", async || {
            let db = world.database("bench_bare", 4).await?;
            ceilings::create_bare_schema(&db.pool).await?;
            let sample = ceilings::inbox_task(world, &db.pool, n, 2).await;
            world.drop_database(db).await?;
            sample
        })
        .await?;
        report.rows.push(
            throughput_row(
                p,
                "ceiling",
                "inbox_task",
                "ceiling: inbox+task insert 500/tx, 2 workers".into(),
                "rows/s",
                &samples,
            )
            .param("workers", 2),
        );
    }

    let mut bare_relay: BTreeMap<usize, Row> = BTreeMap::new();
    for &workers in relay_counts.iter().filter(|_| ceilings) {
        let samples = repeat(runs, &format!("bare relay x{workers}"), async || {
            let db = world.database("bench_bare", (workers + 1) as u32).await?;
            ceilings::create_bare_schema(&db.pool).await?;
            ceilings::fill_bare_outbox(&db.pool, n).await?;
            let sample = ceilings::relay(world, &db.pool, n, workers).await;
            world.drop_database(db).await?;
            sample
        })
        .await?;
        let row = throughput_row(
            p,
            "ceiling",
            &format!("bare_relay/workers={workers}"),
            format!("ceiling: bare relay loop, {workers} worker(s)"),
            "rows/s",
            &samples,
        )
        .param("workers", workers);
        bare_relay.insert(workers, row.clone());
        report.rows.push(row);
    }

    let mut bare_consumer: BTreeMap<usize, Row> = BTreeMap::new();
    let bare_consumer_counts: Vec<(usize, bool)> = replica_counts
        .iter()
        .map(|&w| (w, false))
        .chain(full.then_some((replica_counts[0], true)))
        .filter(|_| ceilings)
        .collect();
    for (workers, double_ack) in bare_consumer_counts {
        let ack = if double_ack { "double ack" } else { "ack" };
        let samples = repeat(runs, &format!("bare consumer x{workers} ({ack})"), async || {
            let db = world.database("bench_bare", (workers + 1) as u32).await?;
            ceilings::create_bare_schema(&db.pool).await?;
            let sample = ceilings::consumer(world, &db.pool, &source, workers, double_ack).await;
            world.drop_database(db).await?;
            sample
        })
        .await?;
        // The compared ceiling sends plain acks like the consumer's (`settle` in the consumer,
        // without its flush); the double-ack row shows what waiting for each confirmation costs.
        let id = if double_ack {
            format!("bare_consumer_double_ack/workers={workers}")
        } else {
            format!("bare_consumer/workers={workers}")
        };
        let row = throughput_row(
            p,
            "ceiling",
            &id,
            format!("ceiling: bare consumer loop, {workers} worker(s), {ack}"),
            "msg/s",
            &samples,
        )
        .param("workers", workers)
        .param("double_ack", double_ack);
        if !double_ack {
            bare_consumer.insert(workers, row.clone());
        }
        report.rows.push(row);
    }

    let rtt =
        repeat(runs, "round trip", async || Ok(Percentiles::of(ceilings::round_trip(world, args.rtt_samples).await?)))
            .await?;
    let rtt_row = yardstick_row(p, "round_trip", "yardstick: JetStream publish -> pull consumer, idle", &rtt);
    report.rows.push(rtt_row.clone());
    let pipeline = repeat(runs, "bare pipeline round trip", async || {
        let db = world.database("bench_bare", 3).await?;
        ceilings::create_bare_schema(&db.pool).await?;
        let millis = ceilings::pipeline_round_trip(world, &db.pool, args.rtt_samples).await;
        world.drop_database(db).await?;
        Ok(Percentiles::of(millis?))
    })
    .await?;
    let pipeline_row = yardstick_row(
        p,
        "pipeline_round_trip",
        "yardstick: bare pipeline, commit -> claim -> publish -> inbox+task commit, idle",
        &pipeline,
    );
    report.rows.push(pipeline_row.clone());

    // --- the real relay
    eprintln!("-- relay drains ({n} actions)");
    let mut previous: Option<(f64, f64)> = None;
    let mut relay_rows: BTreeMap<usize, Row> = BTreeMap::new();
    for &relays in relay_counts.iter().filter(|_| args.runs_section("relay")) {
        let mut checks = Vec::new();
        let samples = repeat(runs, &format!("relay x{relays}"), async || {
            let (sample, c) = system::relay_drain(world, n, relays, 1, false, Payloads::Small).await?;
            checks.push(c);
            Ok(sample)
        })
        .await?;
        let mut row = throughput_row(
            p,
            "relay",
            &format!("relays={relays}"),
            format!("relay: {relays} process(es) x 1 worker, {n} backlog"),
            "rows/s",
            &samples,
        )
        .param("relays", relays)
        .param("workers_per_relay", 1)
        .param("backlog", n);
        if let Some(ceiling) = bare_relay.get(&relays) {
            row = row.against(ceiling);
            let ratio = row.ratio.unwrap_or_default();
            row.target(">= 1.0x the bare relay loop with as many workers", ratio >= 1.0);
        }
        row.check("stream_messages_per_run", json!(checks.iter().map(|c| c.stream_messages).collect::<Vec<_>>()));
        row.check("stored_duplicates", checks.iter().map(|c| c.stream_messages as i64 - n).max().unwrap_or_default());
        row.check("republished_rows", json!(checks.iter().map(|c| c.duplicates).collect::<Vec<_>>()));
        row.check("blocked", json!(checks.iter().map(|c| c.blocked).collect::<Vec<_>>()));
        row.check(
            "outbox_hot_update_share",
            json!(checks.iter().map(|c| c.hot_updates as f64 / c.updates.max(1) as f64).collect::<Vec<_>>()),
        );
        row.target("no message stored twice", checks.iter().all(|c| c.stream_messages == n as u64));
        rss_target(&mut row, "relay", n);
        scaling_target(&mut row, &mut previous);
        if relays == open_batches {
            // The relay's default mode (auto) publishes atomic batches where the server allows them.
            let ratio = row.value.median / atomic_row.value.median;
            row.check("vs_atomic_ceiling", ratio);
            row.target(">= 0.9x the bare atomic-batch loop", ratio >= 0.9);
        }
        if row.value.median >= 55_000.0 {
            row.note = Some("stretch target (>= 55k rows/s) met".into());
        }
        relay_rows.insert(relays, row.clone());
        report.rows.push(row);
    }

    // The same drain publishing message by message (`--publish-mode pipelined`), against the
    // pipelined ceilings: what atomic batches buy in this profile.
    if args.runs_section("relay") {
        let relays = open_batches;
        world.relay_extra.push(("HANDOFF_PUBLISH_MODE".into(), "pipelined".into()));
        let mut checks = Vec::new();
        let samples = repeat(runs, &format!("relay x{relays}, pipelined"), async || {
            let (sample, c) = system::relay_drain(world, n, relays, 1, false, Payloads::Small).await?;
            checks.push(c);
            Ok(sample)
        })
        .await;
        world.relay_extra.pop();
        let samples = samples?;
        let mut row = throughput_row(
            p,
            "relay",
            &format!("relays={relays}/pipelined"),
            format!("relay: {relays} process(es) x 1 worker, pipelined, {n} backlog"),
            "rows/s",
            &samples,
        )
        .param("relays", relays)
        .param("publish_mode", "pipelined")
        .param("backlog", n);
        if let Some(ceiling) = bare_relay.get(&relays) {
            row = row.against(ceiling);
        }
        if let Some(atomic) = relay_rows.get(&relays) {
            row.check("atomic_over_pipelined", atomic.value.median / row.value.median);
        }
        row.target("no message stored twice", checks.iter().all(|c| c.stream_messages == n as u64));
        report.rows.push(row);
    }

    // One relay with its default workers draining payloads near the size limit: what a claim holds
    // in memory while it is published.
    if full && args.runs_section("relay") {
        let n = if args.quick { LARGE_BACKLOG_QUICK } else { LARGE_BACKLOG };
        let payloads = Payloads::Large { note_bytes: LARGE_NOTE_BYTES };
        let (workers, batch) = (world.relay_workers(), world.relay_batch_size());
        let samples = repeat(runs, "relay x1, large payloads", async || {
            let (sample, c) = system::relay_drain(world, n, 1, workers, false, payloads).await?;
            anyhow::ensure!(c.stream_messages == n as u64, "{} messages stored for {n} rows", c.stream_messages);
            Ok(sample)
        })
        .await?;
        let mut row = throughput_row(
            p,
            "relay",
            "relays=1/large_payloads",
            format!("relay: 1 process x {workers} workers, {n} payloads of {} KiB", LARGE_NOTE_BYTES / 1024),
            "rows/s",
            &samples,
        )
        .param("workers", workers)
        .param("batch_size", batch)
        .param("note_bytes", LARGE_NOTE_BYTES)
        .param("backlog", n);
        row.check("payload_mib_per_s", row.value.median * LARGE_NOTE_BYTES as f64 / (1024.0 * 1024.0));
        // Every worker holds its claim's envelopes while it publishes: one copy of each payload,
        // plus what is in flight to the broker.
        let claims_mib = (workers as i64 * batch.min(n)) as f64 * LARGE_NOTE_BYTES as f64 / (1024.0 * 1024.0);
        let limit = RSS_LIMIT_MIB + 1.5 * claims_mib;
        if let Some(peak) = row.processes.iter().find(|u| u.role == "relay").and_then(|u| u.peak_rss_mib) {
            row.check("claimed_payloads_mib", claims_mib);
            row.target(
                format!("relay peak RSS <= {RSS_LIMIT_MIB} MiB + 1.5x the payloads its workers claim ({limit:.0} MiB)"),
                peak <= limit,
            );
        }
        report.rows.push(row);
    }

    // The same drain with the operations endpoint on and scraped every second.
    if full && args.runs_section("relay") {
        let relays = middle(&relay_counts);
        let mut scrapes = Vec::new();
        let samples = repeat(runs, &format!("relay x{relays}, endpoint scraped"), async || {
            let (sample, c) = system::relay_drain(world, n, relays, 1, true, Payloads::Small).await?;
            scrapes.push(c.scrapes);
            Ok(sample)
        })
        .await?;
        let mut row = throughput_row(
            p,
            "relay",
            &format!("relays={relays}/scraped"),
            format!("relay: {relays} process(es), /metrics scraped every 1 s, {n} backlog"),
            "rows/s",
            &samples,
        )
        .param("relays", relays)
        .param("scrape_every_s", system::SCRAPE_EVERY.as_secs())
        .param("backlog", n);
        if let Some(off) = relay_rows.get(&relays) {
            row = row.against(off);
            let ratio = row.ratio.unwrap_or_default();
            row.target(">= 0.97x the same relays with the endpoint off", ratio >= 0.97);
        }
        row.check("scrapes_per_run", json!(scrapes));
        report.rows.push(row);
    }

    // --- the real consumer
    eprintln!("-- consumer drains ({} messages)", source.messages);
    let mut previous: Option<(f64, f64)> = None;
    for &replicas in replica_counts.iter().filter(|_| args.runs_section("consumer")) {
        let mut checks = Vec::new();
        let samples = repeat(runs, &format!("consumer x{replicas}"), async || {
            let (sample, c) = system::consumer_drain(world, &source, replicas).await?;
            checks.push(c);
            Ok(sample)
        })
        .await?;
        let mut row = throughput_row(
            p,
            "consumer",
            &format!("replicas={replicas}"),
            format!("consumer: local CRM, {replicas} replica(s), {} backlog", source.messages),
            "msg/s",
            &samples,
        )
        .param("replicas", replicas)
        .param("crm", "local")
        .param("backlog", source.messages);
        if let Some(ceiling) = bare_consumer.get(&replicas) {
            row = row.against(ceiling);
            let ratio = row.ratio.unwrap_or_default();
            row.target(">= 0.9x the bare consumer loop (plain ack) with as many workers", ratio >= 0.9);
        }
        row.check("tasks_per_run", json!(checks.iter().map(|c| c.tasks).collect::<Vec<_>>()));
        row.check("duplicate_tasks", checks.iter().map(|c| c.tasks - c.distinct_keys).max().unwrap_or_default());
        row.check("dead_letters", checks.iter().map(|c| c.dead_letters).max().unwrap_or_default());
        row.check("redelivered", json!(checks.iter().map(|c| c.redelivered).collect::<Vec<_>>()));
        row.target(
            "one task per message",
            checks.iter().all(|c| c.tasks == source.messages as i64 && c.distinct_keys == c.tasks),
        );
        rss_target(&mut row, "consumer", n);
        scaling_target(&mut row, &mut previous);
        report.rows.push(row);
    }
    world.drop_stream(&source.name).await;

    // One replica handed payloads near the size limit: what its pulls hold in memory.
    if full && args.runs_section("consumer") {
        let n = if args.quick { LARGE_BACKLOG_QUICK } else { LARGE_BACKLOG };
        let payloads = Payloads::Large { note_bytes: LARGE_NOTE_BYTES };
        let messages = ceilings::envelopes_of(payloads, "lc", n, &world.keys.signing)?;
        let (_, large) = ceilings::publish(world, &messages).await?;
        drop(messages);
        let mut checks = Vec::new();
        let samples = repeat(runs, "consumer x1, large payloads", async || {
            let (sample, c) = system::consumer_drain(world, &large, 1).await?;
            checks.push(c);
            Ok(sample)
        })
        .await;
        world.drop_stream(&large.name).await;
        let samples = samples?;
        let mut row = throughput_row(
            p,
            "consumer",
            "replicas=1/large_payloads",
            format!("consumer: local CRM, 1 replica, {n} payloads of {} KiB", LARGE_NOTE_BYTES / 1024),
            "msg/s",
            &samples,
        )
        .param("replicas", 1)
        .param("note_bytes", LARGE_NOTE_BYTES)
        .param("backlog", n);
        row.check("payload_mib_per_s", row.value.median * LARGE_NOTE_BYTES as f64 / (1024.0 * 1024.0));
        row.target(
            "one task per message",
            checks.iter().all(|c| c.tasks == n && c.distinct_keys == c.tasks && c.dead_letters == 0),
        );
        // A pull asks for at most PULL_MAX_BYTES; one is handled while the next arrives.
        let pulls_mib = 2.0 * handoff_consumer::consumer::PULL_MAX_BYTES as f64 / (1024.0 * 1024.0);
        let limit = RSS_LIMIT_MIB + 4.0 * pulls_mib;
        if let Some(peak) = row.processes.iter().find(|u| u.role == "consumer").and_then(|u| u.peak_rss_mib) {
            row.target(
                format!("consumer peak RSS <= {RSS_LIMIT_MIB} MiB + 4x two pulls of messages ({limit:.0} MiB)"),
                peak <= limit,
            );
        }
        report.rows.push(row);
    }

    // --- the consumer with the remote CRM simulator
    if full && args.runs_section("remote") {
        remote_rows(world, args, report).await?;
    }

    // --- end to end
    if args.runs_section("e2e") {
        e2e_rows(world, args, full, &rtt_row, &pipeline_row, report).await?;
    }
    Ok(())
}

/// Most messages one remote-CRM measurement drains (the slow settings get fewer, sized to take
/// about [`REMOTE_TARGET_SECS`] at the ideal rate).
const REMOTE_MAX_ITEMS: i64 = 20_000;
const REMOTE_MIN_ITEMS: i64 = 500;
const REMOTE_TARGET_SECS: f64 = 3.0;

/// The CRM simulator's ceiling with `callers` back-to-back callers making `adapter`'s create
/// (a fresh simulator per run).
async fn crm_ceiling(world: &mut World, args: &BenchArgs, adapter: Adapter, callers: usize, items: i64) -> Result<Row> {
    let latency = Duration::from_millis(args.crm_latency_ms);
    let samples = repeat(args.runs, &format!("CRM calls x{callers} ({})", adapter_name(adapter)), async || {
        let (sim, db, addr) = system::start_crm_sim(world, latency, callers as i64).await?;
        let sample = ceilings::crm_calls(world, addr, adapter, callers, items).await;
        sim.stop().await?;
        world.drop_database(db).await?;
        sample
    })
    .await?;
    Ok(throughput_row(
        world.profile,
        "ceiling",
        &format!("crm_calls{}/callers={callers}", adapter_suffix(adapter)),
        format!(
            "ceiling: CRM simulator ({} ms), {callers} caller(s) back to back{}{}",
            args.crm_latency_ms,
            adapter_note(adapter),
            cpus::CpuSplit::label_suffix(world.cpu_split.as_ref())
        ),
        "calls/s",
        &samples,
    )
    .param("callers", callers)
    .param("adapter", adapter_name(adapter))
    .param("crm_latency_ms", args.crm_latency_ms))
}

/// The adapter's name as `--crm-adapter` spells it.
pub fn adapter_name(adapter: Adapter) -> &'static str {
    match adapter {
        Adapter::TasksApi => "tasks-api",
        Adapter::Upsert => "upsert",
        Adapter::UniqueProperty => "unique-property",
    }
}

/// Row-name suffix: none for `tasks-api` (its rows keep the names earlier reports used).
fn adapter_suffix(adapter: Adapter) -> String {
    match adapter {
        Adapter::TasksApi => String::new(),
        other => format!("/adapter={}", adapter_name(other)),
    }
}

fn adapter_note(adapter: Adapter) -> String {
    match adapter {
        Adapter::TasksApi => String::new(),
        other => format!(", {}", adapter_name(other)),
    }
}

/// Remote-CRM consumer throughput per adapter, in-flight limit and replica count. Each row is
/// compared with the simulator's own ceiling at as many concurrent callers making the same
/// adapter's create, and its target (issue 11) is 0.8x of min(replicas x in_flight / latency,
/// that ceiling), with the latency of one call as measured (the configured delay plus the
/// simulator's own work, which is real: it commits every task).
async fn remote_rows(world: &mut World, args: &BenchArgs, report: &mut Report) -> Result<()> {
    let split = match args.crm_cpus {
        // The simulator's database is on the producer's server: on a shared server it cannot
        // have CPUs of its own.
        cpus::CrmCpus::Split if world.postgres.consumer.is_none() => {
            eprintln!("   --crm-cpus split: one Postgres server (--shared-postgres); the simulator shares the CPUs");
            None
        }
        cpus::CrmCpus::Split => {
            let split = cpus::CpuSplit::of_this_process()?;
            if split.is_none() {
                eprintln!("   --crm-cpus split: fewer than two CPUs to split; the simulator shares them");
            }
            split
        }
        cpus::CrmCpus::Shared => None,
    };
    if let Some(split) = &split {
        eprintln!("   remote CRM section: {}", split.describe());
        split.apply(world).await?;
    }
    world.cpu_split = split.clone();
    let rows = remote_rows_placed(world, args, report).await;
    world.cpu_split = None;
    if let Some(split) = &split {
        split.restore(world).await?;
    }
    rows
}

/// [`remote_rows`] once the processes are placed.
async fn remote_rows_placed(world: &mut World, args: &BenchArgs, report: &mut Report) -> Result<()> {
    let p = world.profile;
    let placed = cpus::CpuSplit::label_suffix(world.cpu_split.as_ref());
    let latency = Duration::from_millis(args.crm_latency_ms);
    for &adapter in &args.crm_adapters {
        let name = adapter_name(adapter);
        eprintln!("-- remote CRM ({name}): latency {} ms, in flight {:?}", args.crm_latency_ms, args.crm_in_flight);
        let one = crm_ceiling(world, args, adapter, 1, REMOTE_MIN_ITEMS).await?;
        let call_ms = 1e3 / one.value.median;
        report.rows.push(one.clone().param("call_ms", call_ms));
        for &replicas in &args.crm_replicas {
            let mut previous: Option<(f64, f64)> = None;
            for &in_flight in &args.crm_in_flight {
                let callers = replicas * in_flight as usize;
                let ideal = callers as f64 / (call_ms / 1e3);
                let items =
                    ((ideal * REMOTE_TARGET_SECS) as i64).clamp(REMOTE_MIN_ITEMS, REMOTE_MAX_ITEMS.min(args.actions));
                let ceiling =
                    if callers == 1 { one.clone() } else { crm_ceiling(world, args, adapter, callers, items).await? };
                if callers > 1 {
                    report.rows.push(ceiling.clone());
                }
                let messages = ceilings::envelopes("rm", items, &world.keys.signing)?;
                let (_, source) = ceilings::publish(world, &messages).await?;
                drop(messages);
                let mut checks = Vec::new();
                let samples =
                    repeat(args.runs, &format!("remote {name} x{replicas}, in flight {in_flight}"), async || {
                        let (sample, c) =
                            system::remote_drain(world, &source, adapter, replicas, in_flight, latency).await?;
                        checks.push(c);
                        Ok(sample)
                    })
                    .await?;
                world.drop_stream(&source.name).await;
                let mut row = throughput_row(
                    p,
                    "consumer",
                    &format!("remote{}/replicas={replicas}/in_flight={in_flight}", adapter_suffix(adapter)),
                    format!(
                        "consumer: remote CRM {} ms, {replicas} replica(s) x {in_flight} in flight, {items} msgs{}{placed}",
                        args.crm_latency_ms,
                        adapter_note(adapter)
                    ),
                    "msg/s",
                    &samples,
                )
                .param("crm", "remote")
                .param("adapter", name)
                .param("crm_latency_ms", args.crm_latency_ms)
                .param("in_flight", in_flight)
                .param("replicas", replicas)
                .param("backlog", items)
                .param("crm_cpus", world.cpu_split.as_ref().map_or("shared".to_owned(), cpus::CpuSplit::describe))
                .against(&ceiling);
                let bound = ideal.min(ceiling.value.median);
                row.check("ideal_per_s", ideal);
                row.check("measured_call_ms", call_ms);
                row.check("over_ideal", row.value.median / ideal);
                row.check("over_bound", row.value.median / bound);
                row.target(
                    ">= 0.8x min(replicas x in_flight / call latency, the simulator's ceiling)",
                    row.value.median >= 0.8 * bound,
                );
                row.check("crm_effects_per_run", json!(checks.iter().map(|c| c.effects).collect::<Vec<_>>()));
                row.check(
                    "duplicate_effects",
                    checks.iter().map(|c| c.effects - c.distinct_external_ids).max().unwrap_or_default(),
                );
                row.check("review", checks.iter().map(|c| c.review).max().unwrap_or_default());
                // Little's law: calls in flight on average = rate x the latency the CRM had in the
                // run. Slots busy near 1 means the dispatcher kept every call slot full, and what
                // bounds the rate is how fast the CRM answered under the run's load (on one machine,
                // the simulator shares the cores with the consumer, its Postgres and NATS).
                let mut means: Vec<f64> = checks.iter().map(system::RemoteChecks::mean_create_ms).collect();
                means.sort_by(f64::total_cmp);
                let mean_create_ms = means.get(means.len() / 2).copied().unwrap_or_default();
                row.check("mean_create_ms_in_run", mean_create_ms);
                row.check("slots_busy", row.value.median * mean_create_ms / 1e3 / callers as f64);
                row.check(
                    "rows_with_retried_create",
                    checks.iter().map(|c| c.attempts_over_one).max().unwrap_or_default(),
                );
                row.target(
                    "one CRM task per message, none held for review",
                    checks.iter().all(|c| c.effects == items && c.distinct_external_ids == items && c.review == 0),
                );
                scaling_target_of(&mut row, &mut previous, "calls in flight");
                report.rows.push(row);
            }
        }
    }
    Ok(())
}

/// The end-to-end maximum (backlog) and the offered loads with their latency.
async fn e2e_rows(
    world: &mut World,
    args: &BenchArgs,
    full: bool,
    rtt: &Row,
    bare_pipeline: &Row,
    report: &mut Report,
) -> Result<()> {
    let p = world.profile;
    let n = if full { args.actions } else { args.durable_actions };
    let (relays, replicas) = (args.e2e_relays, args.e2e_replicas);
    let shape = format!("{relays} relay(s) x {} workers, {replicas} replica(s)", world.relay_workers());
    eprintln!("-- end to end: {shape}");
    let mut placements = Vec::new();
    let samples = repeat(args.runs, "e2e backlog", async || {
        let mut pipeline = system::Pipeline::start(world, relays, replicas, &[]).await?;
        let sample = system::e2e_backlog(world, &mut pipeline, n, 0).await;
        if p == Profile::Cluster && sample.is_ok() {
            let placement = world.placement(&pipeline.durable, &pipeline.stream).await?;
            eprintln!("   placement: {placement}");
            placements.push(placement);
        }
        pipeline.stop(world).await?;
        sample
    })
    .await?;
    let mut max_row =
        throughput_row(p, "e2e", "max", format!("end to end: backlog of {n}, {shape}"), "actions/s", &samples)
            .param("relays", relays)
            .param("replicas", replicas)
            .param("backlog", n);
    if !placements.is_empty() {
        // Which server led the stream and the durable in each run (a one-node consumer state
        // lands on any of the stream's servers): the runs' spread may follow it.
        max_row.check("placement_per_run", json!(placements.iter().map(ToString::to_string).collect::<Vec<_>>()));
    }
    if p != Profile::Cluster {
        max_row.target(">= 10k actions/s", max_row.value.median >= 10_000.0);
    }
    // The durable profiles against the default one of this run.
    let at_least = match p {
        Profile::Default => None,
        Profile::Durable => Some(0.75),
        Profile::Cluster => Some(0.6),
    };
    let default_max = report.rows.iter().find(|r| r.id == "default/e2e/max").map(|r| r.value.median);
    if let (Some(at_least), Some(default_max)) = (at_least, default_max) {
        let ratio = max_row.value.median / default_max;
        max_row.check("vs_default_profile", ratio);
        max_row.target(format!(">= {at_least}x the default profile's end to end"), ratio >= at_least);
    }
    let max = max_row.value.median;
    report.rows.push(max_row);

    let loads: Vec<f64> = if full { args.loads.clone() } else { args.loads.iter().copied().take(1).collect() };
    let first_load = loads.first().copied().unwrap_or_default();
    let mut pipeline = system::Pipeline::start(world, relays, replicas, &[]).await?;
    let mut delivered = 0_u64;
    for load in loads {
        let rate = (max * load).max(1.0);
        let mut percentiles = Vec::new();
        let mut to_mark = Vec::new();
        let mut after_mark = Vec::new();
        let mut to_consumer = Vec::new();
        let mut consumer_tx = Vec::new();
        let mut samples = Vec::new();
        for run in 1..=args.runs {
            let t = Instant::now();
            let (sample, latencies) =
                system::e2e_load(world, &mut pipeline, rate, Duration::from_secs_f64(args.load_secs), delivered)
                    .await?;
            delivered += sample.items;
            percentiles.push(Percentiles::of(latencies.total_ms));
            to_mark.push(Percentiles::of(latencies.to_mark_ms));
            after_mark.push(Percentiles::of(latencies.after_mark_ms));
            to_consumer.push(Percentiles::of(latencies.mark_to_consumer_ms));
            consumer_tx.push(Percentiles::of(latencies.consumer_tx_ms));
            samples.push(sample);
            eprintln!(
                "   e2e load {:.0}%: run {run}/{} done in {:.1} s",
                load * 100.0,
                args.runs,
                t.elapsed().as_secs_f64()
            );
        }
        let latency = Latency::of(&percentiles);
        let pct = (load * 100.0).round();
        // The floor at this load: the bare pipeline's minimal steps at the same offered rate (at
        // the lowest load only: above it the product's latency is its queueing, not its path).
        let floor = if (load - first_load).abs() < 1e-9 {
            let runs = repeat(args.runs, &format!("bare pipeline at {pct}% load"), async || {
                let producer = world.database("bench_bare_load", 4).await?;
                let consumer = world.consumer_database("bench_bare_load_consumer", 4).await?;
                ceilings::create_bare_schema(&producer.pool).await?;
                ceilings::create_bare_schema(&consumer.pool).await?;
                let millis = ceilings::pipeline_under_load(
                    world,
                    &producer.pool,
                    &consumer.pool,
                    rate,
                    Duration::from_secs_f64(args.load_secs),
                    (world.relay_workers(), replicas),
                )
                .await;
                world.drop_database(producer).await?;
                world.drop_database(consumer).await?;
                Ok(Percentiles::of(millis?))
            })
            .await?;
            let row = yardstick_row(
                p,
                &format!("bare_pipeline/load={pct}%"),
                &format!("yardstick: bare pipeline at {pct}% load ({rate:.0}/s), commit -> inbox+task commit"),
                &runs,
            )
            .param("offered_per_s", rate)
            .against(rtt);
            report.rows.push(row.clone());
            Some(row)
        } else {
            None
        };
        let mut row = throughput_row(
            p,
            "e2e",
            &format!("load={pct}%"),
            format!("end to end: offered {pct}% of max ({rate:.0}/s), achieved"),
            "actions/s",
            &samples,
        )
        .param("offered_per_s", rate)
        .param("offered_fraction", load);
        row.check("achieved_over_offered", row.value.median / rate);
        report.rows.push(row);
        let mut lat_row = Row::new(
            p.name(),
            "latency",
            &format!("e2e/load={pct}%"),
            format!("latency: recorded -> task committed at {pct}% load"),
            "ms",
            latency.p99.clone(),
        )
        .param("offered_per_s", rate)
        .against(rtt);
        // Where the time goes: up to the relay's mark, and from the mark to the task.
        let to_mark = Latency::of(&to_mark);
        let after_mark = Latency::of(&after_mark);
        lat_row.check("commit_to_mark_ms_p50_p99", json!([to_mark.p50.median, to_mark.p99.median]));
        lat_row.check("mark_to_task_ms_p50_p99", json!([after_mark.p50.median, after_mark.p99.median]));
        // The second half again: delivery up to the consumer's transaction, then that transaction.
        let (to_consumer, consumer_tx) = (Latency::of(&to_consumer), Latency::of(&consumer_tx));
        lat_row.check("mark_to_consumer_tx_ms_p50_p99", json!([to_consumer.p50.median, to_consumer.p99.median]));
        lat_row.check("consumer_tx_ms_p50_p99", json!([consumer_tx.p50.median, consumer_tx.p99.median]));
        // The same p99 against the floor of the path itself (two commits, a claim, a publish).
        lat_row.check("p99_over_bare_pipeline_p99", latency.p99.median / bare_pipeline.value.median);
        if let Some(floor) = &floor {
            lat_row.check("p99_over_bare_pipeline_at_load_p99", latency.p99.median / floor.value.median);
        }
        if (load - 0.1).abs() < 1e-9 {
            let ratio = lat_row.ratio.unwrap_or(f64::INFINITY);
            lat_row.target("p99 <= 5x the bare round trip p99", ratio <= 5.0);
        }
        lat_row.latency = Some(latency);
        report.rows.push(lat_row);
    }
    pipeline.stop(world).await?;
    Ok(())
}

/// A latency yardstick's row: its p99 is the value other rows are divided by.
fn yardstick_row(p: Profile, id: &str, label: &str, runs: &[Percentiles]) -> Row {
    let latency = Latency::of(runs);
    let mut row = Row::new(p.name(), "latency", id, label, "ms", latency.p99.clone());
    row.latency = Some(latency);
    row
}

/// The relay and consumer must stay under [`RSS_LIMIT_MIB`] (the issue states it for 100k).
fn rss_target(row: &mut Row, role: &str, backlog: i64) {
    if let Some(peak) = row.processes.iter().find(|u| u.role == role).and_then(|u| u.peak_rss_mib) {
        row.target(format!("{role} peak RSS <= {RSS_LIMIT_MIB} MiB ({backlog} backlog)"), peak <= RSS_LIMIT_MIB);
    }
}

/// More processes must not lower throughput until the CPUs are saturated: compared with the
/// previous (smaller) count unless that one already used >= 90% of the cores.
fn scaling_target(row: &mut Row, previous: &mut Option<(f64, f64)>) {
    scaling_target_of(row, previous, "processes")
}

/// [`scaling_target`] for any quantity that grows from row to row (processes, calls in flight).
fn scaling_target_of(row: &mut Row, previous: &mut Option<(f64, f64)>, what: &str) {
    let busy = row.checks.get("cpu_utilization_median").and_then(Value::as_f64).unwrap_or(0.0);
    if let Some((rate, was_busy)) = *previous {
        let held = row.value.median >= rate * 0.95 || was_busy >= 0.9;
        row.target(format!("no lower than with fewer {what}, unless the CPUs were saturated"), held);
    }
    *previous = Some((row.value.median, busy));
}

fn key_values(pairs: &[String]) -> Result<Vec<(String, String)>> {
    pairs
        .iter()
        .map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .with_context(|| format!("{p:?} is not KEY=VALUE"))
        })
        .collect()
}

fn middle(counts: &[usize]) -> usize {
    counts.get(counts.len() / 2).copied().unwrap_or(1)
}

fn machine() -> BTreeMap<String, Value> {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|s| s.trim_start_matches([' ', '\t', ':']).to_owned());
    let mem_kib: Option<f64> = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok());
    let mut m = BTreeMap::new();
    m.insert("cores".into(), json!(std::thread::available_parallelism().map_or(1, |n| n.get())));
    m.insert("cpu".into(), json!(cpu));
    m.insert("memory_gib".into(), json!(mem_kib.map(|k| (k / 1024.0 / 1024.0 * 10.0).round() / 10.0)));
    m.insert("kernel".into(), json!(read("/proc/sys/kernel/osrelease").trim()));
    m.insert("load_average_at_start".into(), json!(read("/proc/loadavg").trim()));
    m
}

fn settings(args: &BenchArgs) -> BTreeMap<String, Value> {
    let mut s = BTreeMap::new();
    s.insert("args".into(), json!(format!("{args:?}")));
    s.insert("postgres_args".into(), json!(world::POSTGRES_ARGS.join(" ")));
    s.insert(
        "postgres_image".into(),
        json!(
            std::env::var("HANDOFF_POSTGRES_IMAGE")
                .unwrap_or_else(|_| handoff_tests::containers::DEFAULT_POSTGRES_IMAGE.into())
        ),
    );
    s.insert(
        "nats_image".into(),
        json!(
            std::env::var("HANDOFF_NATS_IMAGE")
                .unwrap_or_else(|_| handoff_tests::containers::DEFAULT_NATS_IMAGE.into())
        ),
    );
    let relay = handoff_relay::RelaySettings::default();
    s.insert("relay_env".into(), json!(args.relay_env));
    s.insert("consumer_env".into(), json!(args.consumer_env));
    s.insert("relay_batch_size".into(), json!(relay.batch_size));
    s.insert("relay_workers_default".into(), json!(relay.workers));
    s.insert("consumer_batch_size".into(), json!(handoff_consumer::ConsumerSettings::default().batch_size));
    s.insert("crm_latency_ms".into(), json!(args.crm_latency_ms));
    s
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[test]
    fn an_empty_plan_backlogs_skips_the_plans_and_a_list_is_read() {
        let args = BenchArgs::try_parse_from(["handoff-bench", "--plan-backlogs", ""]).unwrap();
        assert!(args.plan_backlogs.0.is_empty());
        let args = BenchArgs::try_parse_from(["handoff-bench", "--plan-backlogs", "10000, 200000"]).unwrap();
        assert_eq!(args.plan_backlogs.0, [10_000, 200_000]);
        assert_eq!(BenchArgs::try_parse_from(["handoff-bench"]).unwrap().plan_backlogs.0, [10_000, 100_000, 1_000_000]);
        assert!(BenchArgs::try_parse_from(["handoff-bench", "--plan-backlogs", "ten"]).is_err());
    }

    #[test]
    fn the_simulator_gets_cpus_of_its_own_unless_told_to_share() {
        assert_eq!(BenchArgs::try_parse_from(["handoff-bench"]).unwrap().crm_cpus, cpus::CrmCpus::Split);
        let args = BenchArgs::try_parse_from(["handoff-bench", "--crm-cpus", "shared"]).unwrap();
        assert_eq!(args.crm_cpus, cpus::CrmCpus::Shared);
        assert!(BenchArgs::try_parse_from(["handoff-bench", "--crm-cpus", "half"]).is_err());
    }
}
