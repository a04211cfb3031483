//! The servers a run measures against, fresh databases and streams for every measurement, the real
//! binaries as child processes, and the counters read from the OS: CPU seconds and peak RSS per
//! process (`/proc`) and per container (its cgroup).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use handoff_shared::Subjects;
use handoff_testkit::cluster::NatsCluster;
use handoff_tests::containers::{NATS_DEFAULT_ARGS, NATS_DURABLE_ARGS, Storage};
use handoff_tests::{Broker, Nats, Postgres, ServiceProcess};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, PgPool};

/// Postgres as production runs it (the test image turns durability off for speed), plus commit
/// timestamps, which the end-to-end latency is measured with.
pub const POSTGRES_ARGS: &[&str] = &[
    "-c",
    "fsync=on",
    "-c",
    "synchronous_commit=on",
    "-c",
    "full_page_writes=on",
    "-c",
    "track_commit_timestamp=on",
    "-c",
    "max_connections=300",
];

/// With `HANDOFF_BENCH_PG_STATEMENTS=1` the servers also load `pg_stat_statements` (planning
/// tracked too), and the remote section prints each drain's top statements on the consumer's
/// server per message: execution and planning time, WAL bytes and rows per call. A diagnostic:
/// the extension costs a little on every statement, so the figures of such a run are not the
/// headline ones.
pub const PG_STATEMENTS_ENV: &str = "HANDOFF_BENCH_PG_STATEMENTS";
const PG_STATEMENTS_ARGS: &[&str] = &[
    "-c",
    "shared_preload_libraries=pg_stat_statements",
    "-c",
    "pg_stat_statements.track=all",
    "-c",
    "pg_stat_statements.track_planning=on",
];

/// Whether this run profiles statements ([`PG_STATEMENTS_ENV`]).
pub fn pg_statements_profiled() -> bool {
    std::env::var(PG_STATEMENTS_ENV).is_ok_and(|v| v == "1")
}

/// What logical decoding needs (the `mq-bridge` section's server only): a WAL-reading relay
/// takes the outbox's inserts from a replication slot.
const LOGICAL_WAL_ARGS: &[&str] =
    &["-c", "wal_level=logical", "-c", "max_wal_senders=4", "-c", "max_replication_slots=4"];

/// [`POSTGRES_ARGS`], plus the statement profile when asked for.
fn postgres_args() -> Vec<&'static str> {
    let mut args = POSTGRES_ARGS.to_vec();
    if pg_statements_profiled() {
        args.extend(PG_STATEMENTS_ARGS);
    }
    args
}

/// A producer's server like [`Servers::start`]'s, with `wal_level = logical`.
pub async fn start_logical_postgres() -> Result<Postgres> {
    let mut args = postgres_args();
    args.extend(LOGICAL_WAL_ARGS);
    let mut server = Postgres::start_with(&args, Storage::Volume).await?;
    note_addressing("Postgres (wal_level logical)", server.connect_directly().await?);
    Ok(server)
}

/// The broker setting a profile runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// `nats-server -js`: `sync_interval` 2 minutes (an acknowledged message may not be on disk).
    Default,
    /// `/etc/nats/durable.conf`: `sync_interval: always`, an fsync before every acknowledgement.
    Durable,
    /// Three routed nodes with `durable.conf`, streams with 3 replicas: the production shape.
    Cluster,
}

impl Profile {
    pub const NAMES: [&str; 3] = ["default", "durable", "cluster"];

    pub fn name(self) -> &'static str {
        match self {
            Self::Default => "default",
            Self::Durable => "durable",
            Self::Cluster => "cluster",
        }
    }

    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "default" => Self::Default,
            "durable" => Self::Durable,
            "cluster" => Self::Cluster,
            other => bail!("unknown profile {other:?} ({})", Self::NAMES.join(", ")),
        })
    }

    /// Stream replicas in this profile.
    pub fn replicas(self) -> usize {
        match self {
            Self::Default | Self::Durable => 1,
            Self::Cluster => handoff_testkit::cluster::CLUSTER_NODES,
        }
    }
}

/// The Postgres servers of a run: the producer's (outbox, relay, bare loops, the CRM simulator)
/// and the consumer's own, as `deploy/compose.yaml` runs them. The pipelines (end to end, soak)
/// and the remote-CRM rows put the consumer's database on the second server, so its commits and
/// transactions share no server with the producer's or the simulator's. With `--shared-postgres`
/// both are one server (a deployment that shares a cluster); measured, the latency was the same.
#[derive(Debug)]
pub struct Servers {
    pub producer: Postgres,
    pub consumer: Option<Postgres>,
}

impl Servers {
    /// Starts the producer's server, and the consumer's unless `shared`.
    pub async fn start(shared: bool) -> Result<Self> {
        // Data on volumes: the host filesystem's speed and fsync, not the storage driver's.
        let args = postgres_args();
        let mut producer = Postgres::start_with(&args, Storage::Volume).await?;
        let mut consumer = if shared { None } else { Some(Postgres::start_with(&args, Storage::Volume).await?) };
        // Clients reach the servers without docker-proxy where the host can (see `direct`).
        let mut direct = producer.connect_directly().await?;
        if let Some(consumer) = &mut consumer {
            direct &= consumer.connect_directly().await?;
        }
        note_addressing("Postgres", direct);
        Ok(Self { producer, consumer })
    }

    fn all(&self) -> impl Iterator<Item = &Postgres> {
        std::iter::once(&self.producer).chain(self.consumer.as_ref())
    }
}

/// The servers of a run.
#[derive(Debug)]
pub struct World {
    pub postgres: Servers,
    pub nats: Broker,
    pub profile: Profile,
    pub client: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    /// Extra environment for every relay / consumer process (`--relay-env`, `--consumer-env`).
    pub relay_extra: Vec<(String, String)>,
    pub consumer_extra: Vec<(String, String)>,
    /// The key every relay signs with and every consumer verifies (in files for the processes).
    pub keys: handoff_testkit::Keys,
    /// Where the remote section runs the CRM simulator (`--crm-cpus`), while it runs.
    pub cpu_split: Option<crate::cpus::CpuSplit>,
    counter: u32,
}

/// Says how the run reaches a server: at the container's own address (no docker-proxy: the
/// production path, a plain TCP connection), or through the port published on 127.0.0.1, where
/// docker-proxy copies every byte in userspace (measured: ~19 s of CPU in a 55 s remote-CRM row at
/// 64 calls in flight, about a quarter of all the CPU the machine used, counted in no role).
fn note_addressing(server: &str, direct: bool) {
    if direct {
        eprintln!("   {server}: reached at the containers' own addresses (no docker-proxy)");
    } else {
        eprintln!(
            "   {server}: reached through ports published on 127.0.0.1 (docker-proxy on the path; figures are \
             not comparable with runs that reach the containers directly)"
        );
    }
}

impl World {
    /// Starts the Postgres servers (one if `shared_postgres`) and a NATS server for `profile`.
    pub async fn start(profile: Profile, shared_postgres: bool) -> Result<Self> {
        Self::with_postgres(Servers::start(shared_postgres).await?, profile).await
    }

    /// Starts a NATS server for `profile` next to existing Postgres servers.
    pub async fn with_postgres(postgres: Servers, profile: Profile) -> Result<Self> {
        // Stores on volumes: the host's fsync, not the storage driver's.
        let mut nats = match profile {
            Profile::Default => Broker::Single(Box::new(Nats::start_with(&NATS_DEFAULT_ARGS, Storage::Volume).await?)),
            Profile::Durable => Broker::Single(Box::new(Nats::start_with(&NATS_DURABLE_ARGS, Storage::Volume).await?)),
            Profile::Cluster => Broker::Cluster(NatsCluster::start_durable_on(Storage::Volume).await?),
        };
        let direct = match &mut nats {
            Broker::Single(nats) => nats.connect_directly().await?,
            Broker::Cluster(cluster) => cluster.connect_directly().await?,
        };
        note_addressing("NATS", direct);
        let client = async_nats::connect(nats.addrs()).await?;
        let js = async_nats::jetstream::new(client.clone());
        Ok(Self {
            postgres,
            nats,
            profile,
            client,
            js,
            relay_extra: Vec::new(),
            consumer_extra: Vec::new(),
            keys: handoff_testkit::Keys::generate()?,
            cpu_split: None,
            counter: 0,
        })
    }

    /// Stops this profile's NATS and hands back Postgres for the next profile.
    pub async fn into_postgres(self) -> Servers {
        let _ = self.client.drain().await;
        self.postgres
    }

    /// A unique name for one measurement: `<hint><n>` (stream names, subject prefixes, durables).
    pub fn unique(&mut self, hint: &str) -> String {
        self.counter += 1;
        format!("{hint}{}", self.counter)
    }

    /// A fresh database on the producer's server and a pool on it.
    pub async fn database(&self, hint: &str, connections: u32) -> Result<Database> {
        Self::database_on(&self.postgres.producer, hint, connections).await
    }

    /// A fresh database on the consumer's own server (the producer's with `--shared-postgres`).
    pub async fn consumer_database(&self, hint: &str, connections: u32) -> Result<Database> {
        Self::database_on(self.postgres.consumer.as_ref().unwrap_or(&self.postgres.producer), hint, connections).await
    }

    async fn database_on(server: &Postgres, hint: &str, connections: u32) -> Result<Database> {
        let url = server.fresh_database(hint).await?;
        let options: PgConnectOptions =
            url.parse::<PgConnectOptions>()?.log_statements(tracing::log::LevelFilter::Trace);
        // No ping per acquire (sqlx's default): the load generator should cost the machine as
        // little as it can.
        let pool =
            PgPoolOptions::new().max_connections(connections).test_before_acquire(false).connect_with(options).await?;
        Ok(Database { url, admin_url: server.admin_url(), pool })
    }

    /// Drops a database and what it holds, so runs do not accumulate data (and page cache).
    pub async fn drop_database(&self, db: Database) -> Result<()> {
        let name = db.pool.connect_options().get_database().unwrap_or_default().to_owned();
        db.pool.close().await;
        let admin = PgPoolOptions::new().max_connections(1).connect(&db.admin_url).await?;
        // The name comes from fresh_database: [a-z0-9_] only.
        sqlx::raw_sql(AssertSqlSafe(format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")))
            .execute(&admin)
            .await?;
        admin.close().await;
        Ok(())
    }

    /// Deletes a stream and its messages (ignores one that does not exist).
    pub async fn drop_stream(&self, name: &str) {
        let _ = self.js.delete_stream(name).await;
    }

    /// Messages stored in `stream` now.
    pub async fn stream_messages(&self, stream: &str) -> Result<u64> {
        let mut stream = self.js.get_stream(stream).await?;
        Ok(stream.info().await?.state.messages)
    }

    /// The durable consumer's state now (fails while it does not exist yet).
    pub async fn consumer_info(&self, durable: &str, stream: &str) -> Result<async_nats::jetstream::consumer::Info> {
        let consumer = self
            .js
            .get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(durable, stream)
            .await?;
        Ok(consumer.get_info().await?)
    }

    /// Which servers lead `stream` and its consumer `durable`, and how many hold the durable's state.
    pub async fn placement(&self, durable: &str, stream: &str) -> Result<Placement> {
        let consumer = self.consumer_info(durable, stream).await?;
        let mut stream = self.js.get_stream(stream).await?;
        let stream = stream.info().await?;
        let leader = |c: Option<&async_nats::jetstream::stream::ClusterInfo>| {
            c.and_then(|c| c.leader.clone()).unwrap_or_else(|| "-".into())
        };
        Ok(Placement {
            stream_leader: leader(stream.cluster.as_ref()),
            consumer_leader: leader(consumer.cluster.as_ref()),
            consumer_replicas: consumer.cluster.as_ref().map_or(1, |c| c.replicas.len() + 1),
        })
    }

    /// CPU seconds used so far by the Postgres containers (together) and the NATS containers
    /// (together: all three nodes of a cluster).
    pub fn servers_cpu(&self) -> (Option<f64>, Option<f64>) {
        let pg = self.postgres.all().map(|p| container_cpu_seconds(p.container().id())).sum();
        let nats = self.nats.servers().into_iter().map(|n| container_cpu_seconds(n.container().id())).sum();
        (pg, nats)
    }

    /// Peak memory of the Postgres containers and of the NATS containers (the larger of each), MiB.
    pub fn servers_peak_mib(&self) -> (Option<f64>, Option<f64>) {
        let pg = self.postgres.all().filter_map(|p| container_peak_mib(p.container().id())).reduce(f64::max);
        let nats =
            self.nats.servers().into_iter().filter_map(|n| container_peak_mib(n.container().id())).reduce(f64::max);
        (pg, nats)
    }

    /// Environment for a real `handoff-relay` against `db`, `stream` and `subjects`. Everything
    /// else is the binary's own defaults, as deployed, unless `--relay-env` says otherwise.
    pub fn relay_env(&self, db: &Database, stream: &str, subjects: &Subjects) -> Vec<(String, String)> {
        let mut env = self.base_env(db, stream, subjects);
        env.extend(self.relay_extra.iter().cloned());
        env
    }

    /// Environment for a real `handoff-consumer` replica of `durable`.
    pub fn consumer_env(
        &self,
        db: &Database,
        stream: &str,
        subjects: &Subjects,
        durable: &str,
    ) -> Vec<(String, String)> {
        let mut env = self.base_env(db, stream, subjects);
        env.push(("HANDOFF_CONSUMER_NAME".into(), durable.to_owned()));
        // The local CRM (the consumer's own database): the mode these rows measure.
        env.push(("HANDOFF_CRM".into(), "local".into()));
        env.extend(self.consumer_extra.iter().cloned());
        env
    }

    /// Workers per relay process: `--relay-env HANDOFF_RELAY_WORKERS=..` or the relay's default.
    pub fn relay_workers(&self) -> usize {
        self.relay_setting("HANDOFF_RELAY_WORKERS").unwrap_or(handoff_relay::RelaySettings::default().workers)
    }

    /// Rows per relay claim: `--relay-env HANDOFF_RELAY_BATCH_SIZE=..` or the relay's default.
    pub fn relay_batch_size(&self) -> i64 {
        self.relay_setting("HANDOFF_RELAY_BATCH_SIZE").unwrap_or(handoff_relay::RelaySettings::default().batch_size)
    }

    /// The value `--relay-env` gives `key`, if it parses.
    fn relay_setting<T: std::str::FromStr>(&self, key: &str) -> Option<T> {
        self.relay_extra.iter().find(|(k, _)| k == key).and_then(|(_, v)| v.parse().ok())
    }

    fn base_env(&self, db: &Database, stream: &str, subjects: &Subjects) -> Vec<(String, String)> {
        let log = std::env::var("HANDOFF_BENCH_SERVICE_LOG").unwrap_or_else(|_| "warn".into());
        [
            ("DATABASE_URL", db.url.clone()),
            ("NATS_URL", self.nats.url()),
            ("HANDOFF_STREAM_REPLICAS", self.profile.replicas().to_string()),
            ("HANDOFF_STREAM", stream.to_owned()),
            ("HANDOFF_SUBJECT_PREFIX", subjects.prefix().to_owned()),
            // Several processes on one host: the endpoint is off unless a row turns it on
            // (`--relay-env HANDOFF_HTTP_ADDR=...`).
            ("HANDOFF_HTTP_ADDR", String::new()),
            // Signed as deployed (the signature's own cost is the signing section's row).
            ("HANDOFF_SIGNING_KEY_FILE", self.keys.signing_file.display().to_string()),
            ("HANDOFF_VERIFY_KEY_FILES", self.keys.verify_file.display().to_string()),
            ("RUST_LOG", log),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }
}

/// A fresh database of one measurement.
#[derive(Debug, Clone)]
pub struct Database {
    pub url: String,
    /// The server's maintenance database, to drop this one from.
    admin_url: String,
    pub pool: PgPool,
}

/// A real binary under measurement.
#[derive(Debug)]
pub struct Service {
    pub role: &'static str,
    pub process: ServiceProcess,
    pid: u32,
}

impl Service {
    /// Starts `binary` (`handoff-relay` or `handoff-consumer`, next to this executable).
    pub fn spawn(role: &'static str, binary: &'static str, env: &[(String, String)]) -> Result<Self> {
        let env: Vec<(&str, String)> = env.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        let process = ServiceProcess::spawn(binary, &env)
            .with_context(|| format!("starting {binary}; build the release binaries first (scripts/bench does)"))?;
        let pid = process.pid().context("the process has no pid")?;
        Ok(Self { role, process, pid })
    }

    /// Starts another program as a measured service (`role` names it in the CPU columns).
    pub fn spawn_program(
        role: &'static str,
        program: &std::path::Path,
        args: &[&str],
        env: &[(String, String)],
    ) -> Result<Self> {
        let env: Vec<(&str, String)> = env.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        let process = ServiceProcess::spawn_program(role, program, args, &env)?;
        let pid = process.pid().context("the process has no pid")?;
        Ok(Self { role, process, pid })
    }

    /// CPU seconds (user + system) used so far.
    pub fn cpu_seconds(&self) -> Option<f64> {
        process_cpu_seconds(self.pid)
    }

    /// Peak resident set so far, MiB (VmHWM).
    pub fn peak_rss_mib(&self) -> Option<f64> {
        process_peak_rss_mib(self.pid)
    }

    /// Fails if the process has died (a crash would otherwise look like a stall).
    pub fn ensure_running(&mut self) -> Result<()> {
        if self.process.has_exited()? {
            bail!("{} (pid {}) exited during the measurement", self.role, self.pid);
        }
        Ok(())
    }

    /// SIGTERM and wait, as an orchestrator stops it.
    pub async fn stop(mut self) -> Result<()> {
        if !self.process.has_exited()? {
            self.process.terminate().await?;
        }
        Ok(())
    }
}

/// Clock ticks per second of `/proc/<pid>/stat` times (USER_HZ), read once via `getconf`.
fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// utime + stime of a process, seconds.
pub fn process_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may contain spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the name.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / clock_ticks())
}

/// VmHWM of a process, MiB.
pub fn process_peak_rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// This process's CPU seconds (bare loops and the load generator run here).
pub fn own_cpu_seconds() -> Option<f64> {
    process_cpu_seconds(std::process::id())
}

fn cgroup_file(container_id: &str, v1: &str, v2: &str) -> Option<PathBuf> {
    [
        PathBuf::from(format!("/sys/fs/cgroup/{v1}/docker/{container_id}")),
        PathBuf::from(format!("/sys/fs/cgroup/system.slice/docker-{container_id}.scope/{v2}")),
        PathBuf::from(format!("/sys/fs/cgroup/docker/{container_id}/{v2}")),
    ]
    .into_iter()
    .find(|p| p.exists())
}

/// CPU seconds a container has used: its cgroup's counter (v1 cpuacct or v2 cpu.stat) when this
/// process can see it, else the sum over the container's processes in `/proc` (including the
/// children they reaped, so Postgres backends that exited still count).
pub fn container_cpu_seconds(container_id: &str) -> Option<f64> {
    if let Some(path) = cgroup_file(container_id, "cpuacct/docker", "cpu.stat") {
        if path.is_dir() {
            let ns: f64 = std::fs::read_to_string(path.join("cpuacct.usage")).ok()?.trim().parse().ok()?;
            return Some(ns / 1e9);
        }
        let stat = std::fs::read_to_string(path).ok()?;
        let usec: f64 = stat.lines().find_map(|l| l.strip_prefix("usage_usec "))?.trim().parse().ok()?;
        return Some(usec / 1e6);
    }
    let mut total = 0.0;
    let mut found = false;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let in_container = std::fs::read_to_string(entry.path().join("cgroup")).is_ok_and(|c| c.contains(container_id));
        if in_container && let Some(seconds) = process_tree_cpu_seconds(pid) {
            total += seconds;
            found = true;
        }
    }
    found.then_some(total)
}

/// utime + stime + cutime + cstime of a process, seconds.
fn process_tree_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<f64> = rest.split_whitespace().skip(11).take(4).filter_map(|f| f.parse().ok()).collect();
    (fields.len() == 4).then(|| fields.iter().sum::<f64>() / clock_ticks())
}

/// Peak memory of a container, MiB (cgroup v1 max_usage_in_bytes or v2 memory.peak).
pub fn container_peak_mib(container_id: &str) -> Option<f64> {
    let path = cgroup_file(container_id, "memory/docker", "memory.peak")?;
    let text = if path.is_dir() {
        std::fs::read_to_string(path.join("memory.max_usage_in_bytes")).ok()?
    } else {
        std::fs::read_to_string(path).ok()?
    };
    let bytes: f64 = text.trim().parse().ok()?;
    Some(bytes / (1024.0 * 1024.0))
}

/// Waits until `count` sessions named `application_name` are idle in `LISTEN` on `db`: the relays
/// (one listener each) are running and will see the next notification.
pub async fn wait_for_listeners(db: &Database, application_name: &str, count: i64) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let listening: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND application_name = $1 AND query ILIKE 'LISTEN%'",
        )
        .bind(application_name)
        .fetch_one(&db.pool)
        .await?;
        if listening >= count {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("only {listening} of {count} {application_name} workers started within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_its_own_cpu_time_and_peak_rss() {
        assert!(own_cpu_seconds().is_some_and(|s| s >= 0.0));
        assert!(process_peak_rss_mib(std::process::id()).is_some_and(|m| m > 0.0));
    }
}

/// Where a stream and its durable are led from (see [`World::placement`]).
#[derive(Debug, Clone)]
pub struct Placement {
    pub stream_leader: String,
    pub consumer_leader: String,
    /// Servers holding the durable's state (its leader and followers).
    pub consumer_replicas: usize,
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let on = if self.stream_leader == self.consumer_leader { "on the stream leader" } else { "on a follower" };
        write!(
            f,
            "stream led by {}, consumer (R{}) led by {} ({on})",
            self.stream_leader, self.consumer_replicas, self.consumer_leader
        )
    }
}
