//! `handoff-chaos`: actions through several relays and consumer replicas (the real binaries) while
//! a killer SIGKILLs, at random, a relay, a consumer replica, a NATS server or the Postgres
//! server (each kind once per round of four kills, in a random order), and brings each back after
//! a random pause. Once the feed is done and the killer has
//! stopped, it waits for the pipeline to drain, prints the counts (recorded, published, stream,
//! inbox, tasks, distinct keys, duplicates, reviews, dead letters) and exits 1 on any difference.
//!
//! Shapes: `r1` is one NATS server with `sync_interval: always`; `cluster` is three nodes with R3
//! streams (one node killed at a time, so a quorum is always there once it is back). Not a timed
//! test: `scripts/chaos` runs it; CI runs a small configuration. The schedule is random but
//! repeatable: the seed is printed, and `--seed` replays it (the timing of the system under test
//! is not, so two runs with one seed differ in what each kill hits mid-flight).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use handoff_tests::cluster::NatsCluster;
use handoff_tests::containers::Storage;
use handoff_tests::{Broker, Nats, Postgres, ServiceProcess, TestEnv};
use rand::{Rng, SeedableRng, rngs::StdRng, seq::SliceRandom};

#[derive(Debug, Parser)]
#[command(name = "handoff-chaos", about = "Kill every component at random under load; count what came out")]
struct Args {
    /// Actions recorded per shape.
    #[arg(long, default_value_t = 5_000)]
    actions: i64,
    /// Recording rate, actions per second (the feed is spread over time so that kills land mid-flow).
    #[arg(long, default_value_t = 500)]
    rate: u64,
    /// The broker shapes to run, in order.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "r1,cluster")]
    shapes: Vec<Shape>,
    /// Relay processes.
    #[arg(long, default_value_t = 2)]
    relays: usize,
    /// Consumer replica processes.
    #[arg(long, default_value_t = 3)]
    consumers: usize,
    /// Mean time between kills, ms (each pause is uniform in [0.5x, 1.5x]).
    #[arg(long, default_value_t = 1_500)]
    kill_every_ms: u64,
    /// Longest a killed component stays down before it is started again, ms.
    #[arg(long, default_value_t = 1_500)]
    max_down_ms: u64,
    /// Seed of the kill schedule (random when not given; printed either way).
    #[arg(long)]
    seed: Option<u64>,
    /// How long the pipeline may take to drain after the last kill.
    #[arg(long, default_value_t = 300)]
    drain_timeout_secs: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Shape {
    /// One NATS server, `sync_interval: always`, R1.
    R1,
    /// Three NATS nodes, `sync_interval: always`, R3.
    Cluster,
}

/// What the killer can hit.
#[derive(Debug, Clone, Copy)]
enum Victim {
    Relay(usize),
    Consumer(usize),
    Nats(usize),
    Postgres,
}

/// One service process slot: its binary, its environment and the running process.
struct Slot {
    binary: &'static str,
    env: Vec<(&'static str, String)>,
    process: ServiceProcess,
}

impl Slot {
    fn spawn(binary: &'static str, env: Vec<(&'static str, String)>) -> Result<Self> {
        let process = ServiceProcess::spawn(binary, &env)?;
        Ok(Self { binary, env, process })
    }

    fn respawn(&mut self) -> Result<()> {
        self.process = ServiceProcess::spawn(self.binary, &self.env)?;
        Ok(())
    }
}

/// The counts a run ends with.
#[derive(Debug, Default, serde::Serialize)]
struct Counts {
    recorded: i64,
    published: i64,
    stream: i64,
    inbox: i64,
    tasks: i64,
    distinct_task_keys: i64,
    duplicates: i64,
    reviews: i64,
    dead_letters: i64,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "error,async_nats=off".into());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let seed = args.seed.unwrap_or_else(rand::random);
    println!("handoff-chaos: seed {seed} (--seed {seed} repeats the schedule)");
    let mut failed = Vec::new();
    for (n, &shape) in args.shapes.iter().enumerate() {
        let mut rng = StdRng::seed_from_u64(seed.wrapping_add(n as u64));
        let (counts, kills) = run(&args, shape, &mut rng).await.with_context(|| format!("shape {shape:?}"))?;
        let expected = args.actions;
        let ok =
            [counts.recorded, counts.published, counts.stream, counts.inbox, counts.tasks, counts.distinct_task_keys]
                .iter()
                .all(|&c| c == expected)
                && counts.duplicates == 0
                && counts.reviews == 0
                && counts.dead_letters == 0;
        println!(
            "{:<8} actions {expected} kills {kills}: recorded {} published {} stream {} inbox {} tasks {} distinct {} \
             duplicates {} reviews {} dead_letters {} -> {}",
            format!("{shape:?}").to_lowercase(),
            counts.recorded,
            counts.published,
            counts.stream,
            counts.inbox,
            counts.tasks,
            counts.distinct_task_keys,
            counts.duplicates,
            counts.reviews,
            counts.dead_letters,
            if ok { "OK" } else { "DIFFERENCE" }
        );
        if !ok {
            failed.push(shape);
        }
    }
    if !failed.is_empty() {
        bail!("counts differ on {failed:?}");
    }
    Ok(())
}

/// The test image's speed settings, except that a commit is acknowledged only once its WAL is
/// written: with `synchronous_commit=off` (the image's default) a SIGKILL of the server loses the
/// last commits it acknowledged, an acked consumer batch among them, and the counts would show the
/// harness's shortcut, not handoff. `fsync=off` stays: a killed process leaves the host's page
/// cache intact (this harness kills processes, not machines).
const POSTGRES_CRASH_SAFE: &[&str] =
    &["-c", "fsync=off", "-c", "synchronous_commit=on", "-c", "full_page_writes=off", "-c", "max_connections=200"];

/// The longest one recording or counting statement may take before it is tried again.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);

async fn run(args: &Args, shape: Shape, rng: &mut StdRng) -> Result<(Counts, String)> {
    eprintln!(
        "handoff-chaos: starting {shape:?} (containers, databases, {} relays, {} consumers)",
        args.relays, args.consumers
    );
    let (postgres, broker) = tokio::try_join!(Postgres::start_with(POSTGRES_CRASH_SAFE, Storage::Layer), async {
        anyhow::Ok(match shape {
            Shape::R1 => Broker::Single(Box::new(Nats::start_durable().await?)),
            Shape::Cluster => Broker::Cluster(NatsCluster::start().await?),
        })
    })?;
    let env = TestEnv::on(postgres, broker).await?;
    let mut relays = Vec::new();
    for _ in 0..args.relays {
        relays.push(Slot::spawn(
            "handoff-relay",
            [env.service_env_for_relay(), handoff_tests::quick_relay_retries()].concat(),
        )?);
    }
    let mut consumers = Vec::new();
    for _ in 0..args.consumers {
        consumers.push(Slot::spawn("handoff-consumer", env.service_env_for_consumer())?);
    }
    let nats_nodes = env.nats.servers().len();

    // The feed: chunks every 100 ms at the chosen rate, each retried until it commits (recording
    // is idempotent per key, so a chunk whose commit reply a Postgres kill lost is safe to repeat).
    let chunk = (args.rate / 10).max(1) as i64;
    let feed = {
        let producer = env.producer_url();
        let actions = args.actions;
        tokio::spawn(async move {
            let mut next = 1;
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            while next <= actions {
                tick.tick().await;
                let n = chunk.min(actions - next + 1);
                // Bounded: a connection the kill left half-open would otherwise wait forever.
                while !matches!(tokio::time::timeout(STATEMENT_TIMEOUT, record(&producer, next, n)).await, Ok(Ok(()))) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                next += n;
            }
        })
    };

    let mut kills = std::collections::BTreeMap::<&'static str, u32>::new();
    let feed_deadline = Instant::now()
        + Duration::from_secs(args.actions as u64 / args.rate.max(1) * 3)
        + Duration::from_secs(args.drain_timeout_secs);
    let mut round: Vec<u8> = Vec::new();
    while !feed.is_finished() {
        if Instant::now() > feed_deadline {
            feed.abort();
            bail!("recording {} actions did not finish by the deadline", args.actions);
        }
        let pause = rng.random_range(args.kill_every_ms / 2..=args.kill_every_ms * 3 / 2);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        // Every kind of victim once per round of four, in a random order, so that even a short
        // run hits each; which relay, replica or node is random.
        if round.is_empty() {
            round = vec![0, 1, 2, 3];
            round.shuffle(rng);
        }
        let victim = match round.pop().expect("refilled above") {
            0 => Victim::Relay(rng.random_range(0..relays.len())),
            1 => Victim::Consumer(rng.random_range(0..consumers.len())),
            2 => Victim::Nats(rng.random_range(0..nats_nodes)),
            _ => Victim::Postgres,
        };
        let down = Duration::from_millis(rng.random_range(0..=args.max_down_ms));
        match victim {
            Victim::Relay(i) => {
                relays[i].process.kill().await?;
                tokio::time::sleep(down).await;
                relays[i].respawn()?;
                *kills.entry("relay").or_default() += 1;
            }
            Victim::Consumer(i) => {
                consumers[i].process.kill().await?;
                tokio::time::sleep(down).await;
                consumers[i].respawn()?;
                *kills.entry("consumer").or_default() += 1;
            }
            Victim::Nats(i) => {
                let node = env.nats.servers()[i];
                node.kill().await?;
                tokio::time::sleep(down).await;
                node.start_again().await?;
                *kills.entry("nats").or_default() += 1;
            }
            Victim::Postgres => {
                env.postgres.kill().await?;
                tokio::time::sleep(down).await;
                env.postgres.start_again().await?;
                *kills.entry("postgres").or_default() += 1;
            }
        }
        // A service that died by itself (it must not) is started again, and reported.
        for slot in relays.iter_mut().chain(consumers.iter_mut()) {
            if slot.process.has_exited()? {
                eprintln!("handoff-chaos: {} exited by itself; starting it again", slot.binary);
                *kills.entry("exited_by_itself").or_default() += 1;
                slot.respawn()?;
            }
        }
    }
    feed.await.context("the feed task")?;
    eprintln!("handoff-chaos: {shape:?}: all {} actions recorded; waiting for the pipeline to drain", args.actions);
    if let Some(cluster) = env.nats.cluster() {
        cluster.wait_until_jetstream_ready().await?;
    }

    let deadline = Instant::now() + Duration::from_secs(args.drain_timeout_secs);
    let counts = loop {
        let counts = match tokio::time::timeout(STATEMENT_TIMEOUT, counts(&env)).await {
            Ok(counts) => counts,
            Err(_) => Err(anyhow::anyhow!("counting took over {STATEMENT_TIMEOUT:?}")),
        };
        match counts {
            Ok(c) if c.published == args.actions && c.tasks >= args.actions => break c,
            Ok(c) if Instant::now() > deadline => {
                eprintln!("handoff-chaos: not drained after {}s", args.drain_timeout_secs);
                break c;
            }
            Err(error) if Instant::now() > deadline => return Err(error.context("counting after the drain timeout")),
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    for slot in relays.iter_mut().chain(consumers.iter_mut()) {
        slot.process.terminate().await?;
    }
    let kills = kills.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",");
    Ok((counts, kills))
}

async fn record(producer_url: &str, first: i64, n: i64) -> Result<()> {
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(producer_url).await?;
    handoff_tests::approve_range(&mut conn, first, n).await
}

async fn counts(env: &TestEnv) -> Result<Counts> {
    let outbox = env.outbox().await?;
    let c = env.consumer_counts().await?;
    let distinct: i64 = sqlx::query_scalar("SELECT count(DISTINCT operation_key) FROM handoff_consumer.crm_task")
        .fetch_one(&env.consumer_db)
        .await?;
    Ok(Counts {
        recorded: env.approvals().await?,
        published: outbox.published,
        stream: env.stream_messages().await? as i64,
        inbox: c.inbox,
        tasks: c.tasks,
        distinct_task_keys: distinct,
        duplicates: c.tasks - distinct,
        reviews: c.reviews,
        dead_letters: c.dead_letters,
    })
}
