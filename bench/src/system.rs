//! The product under measurement: the real `handoff-relay` and `handoff-consumer` release binaries
//! as separate processes (so each has its own RSS and CPU counters), with their default settings.
//!
//! * relay drain: `relays` processes, one worker each, drain a backlog of approved actions that
//!   commits at once while they idle in LISTEN; the clock runs from that commit until the stream
//!   holds every message (then the bench waits until every row is marked published).
//! * consumer drain: `replicas` processes drain a stream already holding the actions; the clock
//!   runs from the first delivery until the durable has nothing pending or unacknowledged.
//! * end to end: relays and replicas running, a backlog recorded at once (the maximum), then steady
//!   offered loads; latency per action from the producer's commit to the consumer's commit, both
//!   read from Postgres commit timestamps (`track_commit_timestamp`, one clock).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use handoff_shared::Subjects;

use crate::ceilings::FilledStream;
use crate::measure::{Meter, Sample};
use crate::workload::{self, Payloads};
use crate::world::{Database, Service, World, wait_for_listeners};

/// How often progress is polled (NATS stream/consumer info: no database load).
const POLL: Duration = Duration::from_millis(10);
/// How often the remote drain asks the consumer's database whether every ledger row is settled.
const SETTLED_POLL: Duration = Duration::from_millis(50);
/// How long a drain waits for one consumer info before it looks again.
const INFO_WAIT: Duration = Duration::from_millis(200);
/// Longest a single drain may take before the run is declared stuck.
const STUCK: Duration = Duration::from_secs(600);

/// Counters a relay drain reads from the outbox afterwards.
#[derive(Debug, Clone, Default)]
pub struct RelayChecks {
    pub stream_messages: u64,
    pub published: i64,
    pub duplicates: i64,
    pub blocked: i64,
    /// Updates of outbox rows that were HOT (no index entries), of all updates.
    pub hot_updates: i64,
    pub updates: i64,
    /// Successful `/metrics` reads during the drain (0 unless scraped).
    pub scrapes: u64,
}

/// Reads `/metrics` of every endpoint every [`SCRAPE_EVERY`] until `stop`; returns the reads that
/// answered 200 with a body. A failed read is an error: the endpoint must keep answering under load.
async fn scrape_until(endpoints: Vec<std::net::SocketAddr>, stop: tokio_util::sync::CancellationToken) -> Result<u64> {
    let mut reads = 0;
    if endpoints.is_empty() {
        return Ok(reads);
    }
    let mut tick = tokio::time::interval(SCRAPE_EVERY);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return Ok(reads),
            _ = tick.tick() => {}
        }
        for addr in &endpoints {
            let (status, body) = handoff_tests::ops::get(*addr, "/metrics").await?;
            ensure!(
                status == 200 && body.contains("handoff_relay_batches_total"),
                "/metrics of {addr} answered {status}"
            );
            reads += 1;
        }
    }
}

/// How often the scraper reads each relay's `/metrics` when a drain is scraped.
pub const SCRAPE_EVERY: Duration = Duration::from_secs(1);

/// `relays` relay processes with `workers` each drain a backlog of `n` actions. With `scrape`,
/// each serves its operations endpoint and a scraper reads its `/metrics` every
/// [`SCRAPE_EVERY`] during the drain (as Prometheus would, at an aggressive interval); the checks
/// count the scrapes.
pub async fn relay_drain(
    world: &mut World,
    n: i64,
    relays: usize,
    workers: usize,
    scrape: bool,
    payloads: Payloads,
) -> Result<(Sample, RelayChecks)> {
    let db = world.database("bench_relay", 4).await?;
    handoff_relay::SCHEMA.migrate(&db.pool).await?;
    let stream = world.unique("RELAY");
    let subjects = Subjects::new(stream.to_lowercase())?;
    let mut env = world.relay_env(&db, &stream, &subjects);
    env.push(("HANDOFF_RELAY_WORKERS".into(), workers.to_string()));
    let mut services = Vec::new();
    let mut endpoints = Vec::new();
    for _ in 0..relays {
        let mut env = env.clone();
        if scrape {
            let addr = handoff_tests::ops::free_local_addr()?;
            env.push(("HANDOFF_HTTP_ADDR".into(), addr.to_string()));
            endpoints.push(addr);
        }
        services.push(Service::spawn("relay", "handoff-relay", &env)?);
    }
    wait_for_listeners(&db, "handoff-relay", relays as i64).await?;
    let scraping = tokio_util::sync::CancellationToken::new();
    let scraper = tokio::spawn(scrape_until(endpoints, scraping.clone()));

    // The backlog commits at once: the clock starts at the commit, which notifies the relays.
    let batch = "r";
    let mut tx = db.pool.begin().await?;
    workload::record_actions_of(&mut *tx, payloads, batch, 1, n).await?;
    let meter = Meter::start(world, &services);
    tx.commit().await?;
    let started = Instant::now();
    loop {
        if world.stream_messages(&stream).await? >= n as u64 {
            break;
        }
        if started.elapsed() > STUCK {
            bail!("relays stuck: {} of {n} messages after {STUCK:?}", world.stream_messages(&stream).await?);
        }
        for s in &mut services {
            s.ensure_running()?;
        }
        tokio::time::sleep(POLL).await;
    }
    let sample = meter.finish(world, &services, n as u64);
    scraping.cancel();
    let scrapes = scraper.await??;
    let mut checks = relay_checks(world, &db, &stream, n).await?;
    checks.scrapes = scrapes;
    for s in services {
        s.stop().await?;
    }
    world.drop_stream(&stream).await;
    world.drop_database(db).await?;
    Ok((sample, checks))
}

async fn relay_checks(world: &World, db: &Database, stream: &str, n: i64) -> Result<RelayChecks> {
    // Marks land just after the last PubAck: wait for them.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (published, duplicates, blocked) = loop {
        let counts: (i64, i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE state = 'published'), count(*) FILTER (WHERE duplicate),
                    count(*) FILTER (WHERE state = 'blocked') FROM handoff.outbox_delivery",
        )
        .fetch_one(&db.pool)
        .await?;
        if counts.0 + counts.2 >= n || Instant::now() > deadline {
            break counts;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Statistics are flushed by each backend at most once a second.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (hot_updates, updates): (i64, i64) = sqlx::query_as(
        "SELECT n_tup_hot_upd, n_tup_upd FROM pg_stat_user_tables WHERE schemaname = 'handoff' AND relname = 'outbox'",
    )
    .fetch_one(&db.pool)
    .await?;
    let stream_messages = world.stream_messages(stream).await?;
    ensure!(published == n, "{published} of {n} rows marked published ({blocked} blocked)");
    Ok(RelayChecks { stream_messages, published, duplicates, blocked, hot_updates, updates, scrapes: 0 })
}

/// Counters a consumer drain reads afterwards.
#[derive(Debug, Clone, Default)]
pub struct ConsumerChecks {
    pub tasks: i64,
    pub distinct_keys: i64,
    pub dead_letters: i64,
    pub redelivered: u64,
}

/// `replicas` consumer processes drain `source` (already full) on a new durable.
pub async fn consumer_drain(
    world: &mut World,
    source: &FilledStream,
    replicas: usize,
) -> Result<(Sample, ConsumerChecks)> {
    let db = world.database("bench_consumer", 4).await?;
    handoff_consumer::SCHEMA.migrate(&db.pool).await?;
    let durable = world.unique("crm");
    let env = world.consumer_env(&db, &source.name, &source.subjects, &durable);
    let mut services = Vec::new();
    for _ in 0..replicas {
        services.push(Service::spawn("consumer", "handoff-consumer", &env)?);
    }
    let total = source.messages;
    let sample = drain_durable(world, &mut services, &durable, source, &db.pool, async || Ok(true)).await?;
    let counts: (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM handoff_consumer.crm_task),
                (SELECT count(DISTINCT operation_key) FROM handoff_consumer.crm_task),
                (SELECT count(*) FROM handoff_consumer.dead_letter)",
    )
    .fetch_one(&db.pool)
    .await?;
    let info = world.consumer_info(&durable, &source.name).await?;
    for s in services {
        s.stop().await?;
    }
    let _ = world.js.delete_consumer_from_stream(&durable, &source.name).await;
    world.drop_database(db).await?;
    let checks = ConsumerChecks {
        tasks: counts.0,
        distinct_keys: counts.1,
        dead_letters: counts.2,
        redelivered: info.num_redelivered as u64,
    };
    ensure!(checks.tasks == total as i64, "{} tasks for {total} messages", checks.tasks);
    Ok((sample, checks))
}

/// Per-action latencies of one phase.
#[derive(Debug, Clone, Default)]
pub struct Latencies {
    /// Producer commit to the consumer's commit of the task.
    pub total_ms: Vec<f64>,
    /// Producer commit to the relay's mark (claim, publish, PubAcks).
    pub to_mark_ms: Vec<f64>,
    /// The relay's mark to the consumer's commit (delivery, consumer transaction). The two
    /// overlap slightly: the consumer may commit before the mark statement starts.
    pub after_mark_ms: Vec<f64>,
    /// The relay's mark to the start of the consumer's transaction (the inbox row's
    /// `received_at`): delivery, the pull, verification. Negative when the consumer started
    /// before the relay's mark statement (it receives each message at its publish).
    pub mark_to_consumer_ms: Vec<f64>,
    /// The consumer's transaction, from its start to its commit (inbox, task, commit flush).
    pub consumer_tx_ms: Vec<f64>,
    /// First producer commit to last consumer commit, seconds.
    pub span_s: f64,
}

/// A running pipeline: producer and consumer databases, relays and replicas.
#[derive(Debug)]
pub struct Pipeline {
    pub producer: Database,
    pub consumer: Database,
    pub stream: String,
    pub durable: String,
    pub services: Vec<Service>,
    /// Actions recorded so far (the next batch label is numbered after them).
    pub phases: usize,
}

impl Pipeline {
    /// Starts `relays` relay processes (default workers) and `replicas` consumers on fresh
    /// databases and a fresh stream; `extra` adds environment (e.g. a short retention).
    pub async fn start(
        world: &mut World,
        relays: usize,
        replicas: usize,
        extra: &[(&'static str, String)],
    ) -> Result<Self> {
        let producer = world.database("bench_e2e_producer", 8).await?;
        let consumer = world.consumer_database("bench_e2e_consumer", 8).await?;
        handoff_relay::SCHEMA.migrate(&producer.pool).await?;
        handoff_consumer::SCHEMA.migrate(&consumer.pool).await?;
        let stream = world.unique("E2E");
        let subjects = Subjects::new(stream.to_lowercase())?;
        let durable = world.unique("crm");
        let mut services = Vec::new();
        let mut relay_env = world.relay_env(&producer, &stream, &subjects);
        relay_env.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
        for _ in 0..relays {
            services.push(Service::spawn("relay", "handoff-relay", &relay_env)?);
        }
        wait_for_listeners(&producer, "handoff-relay", relays as i64).await?;
        let consumer_env = world.consumer_env(&consumer, &stream, &subjects, &durable);
        for _ in 0..replicas {
            services.push(Service::spawn("consumer", "handoff-consumer", &consumer_env)?);
        }
        let pipeline = Self { producer, consumer, stream, durable, services, phases: 0 };
        // Replicas are up when the durable has their pull requests waiting.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if world.consumer_info(&pipeline.durable, &pipeline.stream).await.is_ok_and(|i| i.num_waiting >= replicas) {
                break;
            }
            if Instant::now() > deadline {
                bail!("consumers did not start pulling within 60 s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(pipeline)
    }

    /// Waits until the stream holds `total` messages and the durable has acked them all.
    pub async fn wait_until_delivered(&mut self, world: &World, total: u64) -> Result<()> {
        let started = Instant::now();
        loop {
            for s in &mut self.services {
                s.ensure_running()?;
            }
            if world.stream_messages(&self.stream).await? >= total {
                let info = world.consumer_info(&self.durable, &self.stream).await?;
                if info.num_pending == 0 && info.num_ack_pending == 0 && info.ack_floor.stream_sequence >= total {
                    return Ok(());
                }
            }
            if started.elapsed() > STUCK {
                bail!("pipeline stuck before {total} actions were delivered");
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// A new batch label for the next phase's keys.
    pub fn next_batch(&mut self) -> String {
        self.phases += 1;
        format!("p{}", self.phases)
    }

    /// Latency of every action of `batch`, producer commit to consumer commit (ms), split at the
    /// relay's mark (`published_at`, the start of the statement that recorded the PubAcks), and
    /// the span from the first producer commit to the last consumer commit (s).
    pub async fn latencies(&self, batch: &str) -> Result<Latencies> {
        let pattern = format!("{}{batch}-%", workload::KEY_PREFIX);
        let recorded: Vec<(String, Option<f64>, Option<f64>)> = sqlx::query_as(
            "SELECT a.operation_key, extract(epoch FROM pg_xact_commit_timestamp(a.xmin))::float8,
                    extract(epoch FROM o.published_at)::float8
               FROM handoff.approved_action AS a JOIN handoff.outbox_delivery AS o USING (operation_key)
              WHERE a.operation_key LIKE $1",
        )
        .bind(&pattern)
        .fetch_all(&self.producer.pool)
        .await?;
        // The task's commit, and the start of the transaction that committed it (the inbox row's
        // `received_at` is that transaction's `now()`).
        let created: HashMap<String, (Option<f64>, f64)> = sqlx::query_as::<_, (String, Option<f64>, f64)>(
            "SELECT t.operation_key, extract(epoch FROM pg_xact_commit_timestamp(t.xmin))::float8,
                    extract(epoch FROM i.received_at)::float8
               FROM handoff_consumer.crm_task AS t JOIN handoff_consumer.inbox AS i USING (operation_key)
              WHERE t.operation_key LIKE $1",
        )
        .bind(&pattern)
        .fetch_all(&self.consumer.pool)
        .await?
        .into_iter()
        .map(|(key, done, began)| (key, (done, began)))
        .collect();
        let mut out = Latencies::default();
        let (mut first, mut last) = (f64::INFINITY, f64::NEG_INFINITY);
        for (key, at, published) in recorded {
            let at = at.context("no commit timestamp: is track_commit_timestamp on?")?;
            let (done, began) = created.get(&key).copied().with_context(|| format!("no task for {key}"))?;
            let done = done.context("no commit timestamp for the task: is track_commit_timestamp on?")?;
            out.total_ms.push((done - at) * 1e3);
            out.consumer_tx_ms.push((done - began) * 1e3);
            if let Some(published) = published {
                out.to_mark_ms.push((published - at) * 1e3);
                out.after_mark_ms.push((done - published) * 1e3);
                out.mark_to_consumer_ms.push((began - published) * 1e3);
            }
            first = first.min(at);
            last = last.max(done);
        }
        out.span_s = last - first;
        Ok(out)
    }

    /// Stops every process (SIGTERM) and drops the databases and stream.
    pub async fn stop(self, world: &World) -> Result<()> {
        for s in self.services {
            s.stop().await?;
        }
        world.drop_stream(&self.stream).await;
        world.drop_database(self.producer).await?;
        world.drop_database(self.consumer).await?;
        Ok(())
    }
}

/// The pipeline's maximum: `n` actions recorded at once, timed until the last task commits.
pub async fn e2e_backlog(world: &World, pipeline: &mut Pipeline, n: i64, total_before: u64) -> Result<Sample> {
    let batch = pipeline.next_batch();
    let mut tx = pipeline.producer.pool.begin().await?;
    workload::record_actions(&mut *tx, &batch, 1, n).await?;
    let meter = Meter::start(world, &pipeline.services);
    tx.commit().await?;
    pipeline.wait_until_delivered(world, total_before + n as u64).await?;
    let mut sample = meter.finish(world, &pipeline.services, n as u64);
    // From the backlog's commit to the last task's commit (not to when the poll noticed it).
    sample.elapsed = Duration::from_secs_f64(pipeline.latencies(&batch).await?.span_s);
    Ok(sample)
}

/// One steady offered load: `rate` actions/s for `duration`; returns the sample (throughput from
/// the first commit to the last task) and every action's latencies.
pub async fn e2e_load(
    world: &World,
    pipeline: &mut Pipeline,
    rate: f64,
    duration: Duration,
    total_before: u64,
) -> Result<(Sample, Latencies)> {
    let batch = pipeline.next_batch();
    let meter = Meter::start(world, &pipeline.services);
    let recorded = workload::offer_load(&pipeline.producer.pool, &batch, rate, duration).await?;
    pipeline.wait_until_delivered(world, total_before + recorded as u64).await?;
    let latencies = pipeline.latencies(&batch).await?;
    let mut sample = meter.finish(world, &pipeline.services, recorded as u64);
    sample.elapsed = Duration::from_secs_f64(latencies.span_s);
    Ok((sample, latencies))
}

/// Waits until `services` have acked all of `source` on `durable` and `done` says the rest of the
/// work is over; the clock runs from the first delivery (process start-up is not throughput).
///
/// The first delivery is seen in the durable's info, or, while the JetStream API does not answer
/// (a busy R3 cluster can time out info requests for seconds, which once started this clock only
/// after the drain was over), in `db`: the consumer's first inbox row.
async fn drain_durable(
    world: &World,
    services: &mut [Service],
    durable: &str,
    source: &FilledStream,
    db: &sqlx::PgPool,
    mut done: impl AsyncFnMut() -> Result<bool>,
) -> Result<Sample> {
    let started = Instant::now();
    let mut meter = None;
    let (mut failed_infos, mut last_error) = (0u64, None);
    // Once every message is acked (the ack floor never goes back), only `done` is asked: a
    // consumer info every POLL is a hundred JetStream API requests a second, load the rows whose
    // work goes on after the acks (the remote CRM's calls) would otherwise carry and their
    // ceilings do not.
    let mut all_acked = false;
    loop {
        if started.elapsed() > STUCK {
            bail!(
                "consumers stuck after {STUCK:?} ({failed_infos} consumer info requests failed, last: {last_error:?})"
            );
        }
        for s in services.iter_mut() {
            s.ensure_running()?;
        }
        if all_acked {
            if done().await? {
                break;
            }
            tokio::time::sleep(POLL).await;
            continue;
        }
        // The clock starts at the first sign of consumption, whichever comes first: the first inbox
        // row (a cheap look at a table still empty), or a delivery the consumer info reports. An
        // info request may take seconds on a cluster (elections, a busy API): it is given up after
        // INFO_WAIT so that it never holds the clock back (measured before: a 3-replica drain of
        // 100k on the cluster reported 43k msg/s when the clock started seconds late).
        if meter.is_none()
            && sqlx::query_scalar::<_, bool>("SELECT EXISTS (SELECT 1 FROM handoff_consumer.inbox)")
                .fetch_one(db)
                .await?
        {
            meter = Some(Meter::start(world, services));
        }
        let info = match tokio::time::timeout(INFO_WAIT, world.consumer_info(durable, &source.name)).await {
            Ok(info) => info,
            Err(_) => Err(anyhow::anyhow!("no answer within {INFO_WAIT:?}")),
        };
        if meter.is_none() && info.as_ref().is_ok_and(|info| info.delivered.stream_sequence > 0) {
            meter = Some(Meter::start(world, services));
        }
        let info = match info {
            Ok(info) => info,
            Err(error) => {
                // Not created yet (the first replica creates the durable when it starts), or the
                // API is busy: look again.
                failed_infos += 1;
                last_error = Some(format!("{error:#}"));
                tokio::time::sleep(POLL).await;
                continue;
            }
        };
        all_acked =
            info.ack_floor.stream_sequence >= source.messages && info.num_pending == 0 && info.num_ack_pending == 0;
        if all_acked && done().await? {
            break;
        }
        tokio::time::sleep(POLL).await;
    }
    if failed_infos > 0 {
        eprintln!(
            "   ({failed_infos} consumer info requests failed during the drain; last: {})",
            last_error.unwrap_or_default()
        );
    }
    let meter = meter.context("everything was done before the first poll saw a delivery")?;
    Ok(meter.finish(world, services, source.messages))
}

/// Starts `handoff-crm-sim` (its own process and database) answering every request after
/// `latency`, with a connection pool large enough for `concurrency` requests at once (the
/// simulator's own pool must not be what is measured). Returns it once it accepts connections.
pub async fn start_crm_sim(
    world: &World,
    latency: Duration,
    concurrency: i64,
) -> Result<(Service, Database, std::net::SocketAddr)> {
    let crm_db = world.database("bench_crm_sim", 2).await?;
    let listen = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0")?;
        probe.local_addr()?
    };
    let log = std::env::var("HANDOFF_BENCH_SERVICE_LOG").unwrap_or_else(|_| "warn".into());
    let sim_env: Vec<(String, String)> = [
        ("DATABASE_URL", crm_db.url.clone()),
        ("DATABASE_MAX_CONNECTIONS", concurrency.clamp(8, 64).to_string()),
        ("CRM_SIM_LISTEN", listen.to_string()),
        ("CRM_SIM_LATENCY_MS", latency.as_millis().to_string()),
        ("RUST_LOG", log),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    let spawn = || Service::spawn("crm-sim", "handoff-crm-sim", &sim_env);
    let mut sim = match &world.cpu_split {
        Some(split) => split.on_crm_cpus(spawn)?,
        None => spawn()?,
    };
    let ready = Instant::now();
    while tokio::net::TcpStream::connect(listen).await.is_err() {
        sim.ensure_running()?;
        ensure!(ready.elapsed() < Duration::from_secs(60), "handoff-crm-sim did not listen on {listen}");
        tokio::time::sleep(POLL).await;
    }
    Ok((sim, crm_db, listen))
}

/// What a remote-CRM drain found afterwards.
#[derive(Debug, Clone, Default)]
pub struct RemoteChecks {
    /// Tasks the simulated CRM holds (its own database): the effects.
    pub effects: i64,
    pub distinct_external_ids: i64,
    pub settled: i64,
    pub review: i64,
    /// Ledger rows that needed more than one create attempt (the CRM refused or timed out).
    pub attempts_over_one: i64,
    /// Creates the replicas timed (their `handoff_crm_call_duration_seconds{call="create"}`) and
    /// the seconds those calls took together: the CRM's latency in this run, under its load.
    pub create_calls: f64,
    pub create_seconds: f64,
}

impl RemoteChecks {
    /// The mean create latency the replicas saw in this run, ms.
    pub fn mean_create_ms(&self) -> f64 {
        self.create_seconds * 1e3 / self.create_calls.max(1.0)
    }
}

/// Prints the top statements on the server of `pool` since the last reset, per message
/// ([`crate::world::PG_STATEMENTS_ENV`]).
async fn print_statement_profile(pool: &sqlx::PgPool, messages: u64) -> Result<()> {
    let rows: Vec<(String, i64, i64, f64, f64, i64)> = sqlx::query_as(
        "SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 90), calls, rows, total_exec_time, total_plan_time,
                wal_bytes::int8
           FROM pg_stat_statements ORDER BY total_exec_time + total_plan_time DESC LIMIT 10",
    )
    .fetch_all(pool)
    .await?;
    let n = messages.max(1) as f64;
    eprintln!("   statements per message (exec µs, plan µs, WAL bytes, calls, rows per call):");
    for (query, calls, rows, exec_ms, plan_ms, wal) in rows {
        eprintln!(
            "   {:>7.1} {:>7.1} {:>6.0} {calls:>7} {:>6.1}  {query}",
            exec_ms * 1e3 / n,
            plan_ms * 1e3 / n,
            wal as f64 / n,
            rows as f64 / calls.max(1) as f64
        );
    }
    Ok(())
}

/// The remote-CRM consumer: `replicas` consumers with `--crm http` and `in_flight` CRM calls per
/// replica drain `source` through the simulated CRM (`handoff-crm-sim`, its own process and
/// database) answering every request after `latency`. The clock runs from the first delivery
/// until every ledger row is settled (intake acks at the ledger commit; the dispatchers are
/// what this measures).
pub async fn remote_drain(
    world: &mut World,
    source: &FilledStream,
    adapter: handoff_consumer::remote::Adapter,
    replicas: usize,
    in_flight: i64,
    latency: Duration,
) -> Result<(Sample, RemoteChecks)> {
    // The consumer's database on its own server, the simulator's on the other: a remote CRM does
    // not commit on the consumer's database server.
    let db = world.consumer_database("bench_remote", 4).await?;
    handoff_consumer::SCHEMA.migrate(&db.pool).await?;
    let (sim, crm_db, listen) = start_crm_sim(world, latency, replicas as i64 * in_flight).await?;

    let durable = world.unique("crm");
    let mut env = world.consumer_env(&db, &source.name, &source.subjects, &durable);
    env.retain(|(k, _)| !k.starts_with("HANDOFF_CRM"));
    env.extend(
        [
            ("HANDOFF_CRM", "http".to_owned()),
            ("HANDOFF_CRM_URL", format!("http://{listen}")),
            ("HANDOFF_CRM_TOKEN", "sim-token".to_owned()),
            ("HANDOFF_CRM_IN_FLIGHT", in_flight.to_string()),
            ("HANDOFF_CRM_ADAPTER", crate::adapter_name(adapter).to_owned()),
        ]
        .map(|(k, v)| (k.to_owned(), v)),
    );
    // `--consumer-env HANDOFF_CRM_...` still applies (the last value of a variable wins).
    env.extend(world.consumer_extra.iter().filter(|(k, _)| k.starts_with("HANDOFF_CRM_")).cloned());
    let mut services = vec![sim];
    // Each replica's endpoint is read once, after the drain: its call-duration histogram says how
    // long the CRM took to answer in this run, so the row shows how busy the slots were.
    let mut endpoints = Vec::new();
    for _ in 0..replicas {
        let addr = handoff_tests::ops::free_local_addr()?;
        let mut env = env.clone();
        env.push(("HANDOFF_HTTP_ADDR".into(), addr.to_string()));
        endpoints.push(addr);
        services.push(Service::spawn("consumer", "handoff-consumer", &env)?);
    }
    let total = source.messages;
    // Intake acks after the ledger row commits, so once everything is acked every row exists; the
    // open rows are then looked for on the ledger's partial index of unsettled states.
    // Asked at most every SETTLED_POLL, and only through that index: the check must not load the
    // server it measures. On a ledger this young there are no statistics, so the planner reads the
    // table from the start each time: 15 ms per check, a sixth of one core at 50 ms polls, taken
    // from the simulator the row is compared with (measured at 64 in flight). The index holds only
    // the open rows: a few µs. The clock may overrun by up to one interval, under 1% of a drain.
    let mut last_check: Option<Instant> = None;
    let all_settled = async || {
        if last_check.is_some_and(|at| at.elapsed() < SETTLED_POLL) {
            return Ok(false);
        }
        last_check = Some(Instant::now());
        let mut tx = db.pool.begin().await?;
        sqlx::query("SET LOCAL enable_seqscan = off").execute(&mut *tx).await?;
        let done: bool = sqlx::query_scalar(
            "SELECT NOT EXISTS (SELECT 1 FROM handoff_consumer.crm_operation
              WHERE state IN ('received', 'dispatching', 'unknown', 'proved_not_executed', 'replay'))",
        )
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(done)
    };
    let profiled = crate::world::pg_statements_profiled();
    if profiled {
        sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements").execute(&db.pool).await?;
        sqlx::query("SELECT pg_stat_statements_reset()").execute(&db.pool).await?;
    }
    let sample = drain_durable(world, &mut services, &durable, source, &db.pool, all_settled).await?;
    if profiled {
        print_statement_profile(&db.pool, source.messages).await?;
    }
    let (settled, review, attempts_over_one): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE state = 'settled'), count(*) FILTER (WHERE state = 'review'),
                count(*) FILTER (WHERE attempts > 1)
           FROM handoff_consumer.crm_operation",
    )
    .fetch_one(&db.pool)
    .await?;
    let (effects, distinct_external_ids): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT external_id) FROM crm_sim.tasks")
            .fetch_one(&crm_db.pool)
            .await?;
    let (mut create_calls, mut create_seconds) = (0.0, 0.0);
    for addr in endpoints {
        let (status, body) = handoff_tests::ops::get(addr, "/metrics").await?;
        ensure!(status == 200, "/metrics of replica {addr} answered {status}");
        let series = |name: &str| handoff_tests::ops::series(&body, &format!("{name}{{call=\"create\"}}"));
        create_calls += series("handoff_crm_call_duration_seconds_count").unwrap_or_default();
        create_seconds += series("handoff_crm_call_duration_seconds_sum").unwrap_or_default();
    }
    for s in services {
        s.stop().await?;
    }
    let _ = world.js.delete_consumer_from_stream(&durable, &source.name).await;
    world.drop_database(db).await?;
    world.drop_database(crm_db).await?;
    let checks = RemoteChecks {
        effects,
        distinct_external_ids,
        settled,
        review,
        attempts_over_one,
        create_calls,
        create_seconds,
    };
    ensure!(
        checks.effects == total as i64 && checks.settled == total as i64,
        "{} CRM tasks and {} settled rows for {total} messages",
        checks.effects,
        checks.settled
    );
    Ok((sample, checks))
}
