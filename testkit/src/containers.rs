//! Postgres and NATS JetStream containers for integration tests (testcontainers 0.28).
//!
//! Images come from `HANDOFF_POSTGRES_IMAGE` (default [`DEFAULT_POSTGRES_IMAGE`], the official
//! `postgres:15`) and `HANDOFF_NATS_IMAGE` (default [`DEFAULT_NATS_IMAGE`], the official `nats`).
//! Without a registry, build images locally and point the variables at them (handoff's own
//! repository does: `scripts/build-images` builds `handoff-test/postgres:15` and
//! `handoff-test/nats:2.15.1`, and its `.cargo/config.toml` names them).
//!
//! Ports are published on 127.0.0.1 only (the Postgres image trusts everyone) and clients
//! connect to `127.0.0.1:<host port>`, which also works when the tests themselves run inside a
//! container. That path goes through docker-proxy (a userspace copy of every byte, two more
//! context switches per round trip: measured, about a third of one core during a remote-CRM
//! benchmark row). A benchmark can ask for the container's own address on its Docker network
//! instead ([`Postgres::connect_directly`], [`Nats::connect_directly`]), which the host reaches
//! without the proxy when Docker runs on this host. Containers are removed when the value is
//! dropped.

use std::{
    hash::{BuildHasher, RandomState},
    net::{Ipv4Addr, TcpListener},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result, bail};
use sqlx::{AssertSqlSafe, Connection, PgConnection};
use testcontainers::{
    ContainerAsync, GenericImage, ImageExt,
    bollard::models::{HostConfig, Mount, MountType},
    core::{IntoContainerPort, WaitFor},
    runners::AsyncRunner,
};
use tokio::{io::AsyncReadExt, net::TcpStream};

/// Image used for Postgres unless `HANDOFF_POSTGRES_IMAGE` is set.
pub const DEFAULT_POSTGRES_IMAGE: &str = "postgres:15";
/// Image used for NATS unless `HANDOFF_NATS_IMAGE` is set (2.12.3 or later: see the README on
/// lost acknowledged writes in 2.12.1).
pub const DEFAULT_NATS_IMAGE: &str = "nats:2.12";

const POSTGRES_PORT: u16 = 5432;
const NATS_PORT: u16 = 4222;
/// PGDATA in the image `scripts/build-images` builds (and in the official one).
const POSTGRES_DATA: &str = "/var/lib/postgresql/data";
/// The JetStream store directory both argument sets below use.
pub(crate) const NATS_DATA: &str = "/data";
/// JetStream with the default `sync_interval` (2 minutes).
pub const NATS_DEFAULT_ARGS: [&str; 3] = ["-js", "--store_dir", "/data"];
/// JetStream with `sync_interval: always`, from the config file only our image carries.
pub const NATS_DURABLE_ARGS: [&str; 2] = ["-c", "/etc/nats/durable.conf"];
const STARTUP_TIMEOUT: Duration = Duration::from_secs(120);
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Where a server keeps its data.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Storage {
    /// The container's writable layer (the default, and right for tests). On Docker's
    /// fuse-overlayfs storage driver every write goes through a FUSE daemon: slow, its CPU counted in
    /// no container, and fsync not the disk's.
    #[default]
    Layer,
    /// An anonymous volume, removed with the container: the host filesystem's speed and fsync, as
    /// a production server has. The benchmark uses this.
    Volume,
}

impl Storage {
    fn mounts(self, data_dir: &str) -> Option<Vec<Mount>> {
        match self {
            Self::Layer => None,
            // A new volume is filled from the image's content at that path (Postgres's
            // initialised cluster) before the server starts.
            Self::Volume => Some(vec![Mount {
                target: Some(data_dir.to_owned()),
                typ: Some(MountType::VOLUME),
                ..Default::default()
            }]),
        }
    }
}

/// A Postgres server in a container, reachable as the trusted superuser `postgres`.
#[derive(Debug)]
pub struct Postgres {
    container: ContainerAsync<GenericImage>,
    port: u16,
    /// Where clients connect: `127.0.0.1:<port>`, or the container's own address.
    addr: String,
}

impl Postgres {
    /// Starts the container and waits until it answers `SELECT 1`.
    ///
    /// Waiting for the log line alone is not enough for the official `postgres` image, whose
    /// entrypoint runs a temporary server (which logs the same line) before the real one.
    pub async fn start() -> Result<Self> {
        Self::start_with(&[], Storage::Layer).await
    }

    /// Like [`Postgres::start`], with server arguments replacing the image's CMD when `args` is not
    /// empty (e.g. `["-c", "fsync=on"]`; the test image's CMD turns fsync off for speed), and the
    /// data directory where `storage` says. The benchmark uses this for production-like
    /// durability and commit timestamps.
    pub async fn start_with(args: &[&str], storage: Storage) -> Result<Self> {
        let image_ref = image_from_env("HANDOFF_POSTGRES_IMAGE", DEFAULT_POSTGRES_IMAGE);
        let (name, tag) = split_image(&image_ref);
        let started = Instant::now();
        // The host port is chosen here and bound explicitly, so that it stays the same when the
        // container is killed and started again ([`Postgres::start_again`]).
        let (container, port) = start_on_a_free_port("Postgres", &image_ref, |port| {
            let mut image = GenericImage::new(name, tag)
                .with_exposed_port(POSTGRES_PORT.tcp())
                .with_wait_for(WaitFor::message_on_stderr("database system is ready to accept connections"))
                .with_env_var("POSTGRES_HOST_AUTH_METHOD", "trust")
                .with_mapped_port(port, POSTGRES_PORT.tcp())
                .with_startup_timeout(STARTUP_TIMEOUT)
                .with_host_config_modifier(move |config| {
                    config.mounts = storage.mounts(POSTGRES_DATA);
                    bind_to_loopback(config);
                });
            if !args.is_empty() {
                image = image.with_cmd(args.iter().copied());
            }
            image.start()
        })
        .await?;
        let pg = Self { container, port, addr: format!("127.0.0.1:{port}") };
        pg.wait_until_queryable().await?;
        tracing::info!(image = %image_ref, port, elapsed_ms = started.elapsed().as_millis() as u64, "Postgres container ready");
        Ok(pg)
    }

    /// Kills the server at once (SIGKILL to the container: no shutdown checkpoint; the data
    /// directory is as the crash left it, and the next start recovers from the WAL).
    pub async fn kill(&self) -> Result<()> {
        kill_container(self.container.id()).await.context("killing the Postgres container")?;
        tracing::info!(port = self.port, "Postgres container killed");
        Ok(())
    }

    /// Starts the container again after [`Postgres::kill`] on the same host port, and waits until it
    /// answers `SELECT 1` (crash recovery included).
    pub async fn start_again(&self) -> Result<()> {
        start_again_on_its_port("Postgres", &self.container, self.port, POSTGRES_PORT).await?;
        self.wait_until_queryable().await?;
        tracing::info!(port = self.port, "Postgres container started again");
        Ok(())
    }

    async fn wait_until_queryable(&self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            match select_one(&self.admin_url()).await {
                Ok(1) => return Ok(()),
                Ok(other) => bail!("SELECT 1 returned {other}"),
                Err(err) if Instant::now() < deadline => {
                    tracing::debug!("Postgres not ready yet: {err:#}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(err) => {
                    return Err(err.context(format!(
                        "Postgres on port {} did not answer SELECT 1 within {READY_TIMEOUT:?}",
                        self.port
                    )));
                }
            }
        }
    }

    /// URL of the `postgres` maintenance database, as the superuser.
    pub fn admin_url(&self) -> String {
        self.url_for("postgres")
    }

    /// The host port Postgres is published on (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// From now on, URLs name the container's address on its Docker network and Postgres's own
    /// port, bypassing docker-proxy, if the host reaches it there (checked with a query); returns
    /// whether it does. For servers that are not restarted (the address may change).
    pub async fn connect_directly(&mut self) -> Result<bool> {
        let Some(addr) = direct_addr(&self.container, POSTGRES_PORT).await else { return Ok(false) };
        let url = format!("postgres://postgres@{addr}/postgres");
        if matches!(tokio::time::timeout(Duration::from_secs(2), select_one(&url)).await, Ok(Ok(1))) {
            self.addr = addr;
            return Ok(true);
        }
        Ok(false)
    }

    /// The underlying container, e.g. to stop or inspect it.
    pub fn container(&self) -> &ContainerAsync<GenericImage> {
        &self.container
    }

    /// Creates a new, empty database with a unique name starting with (a sanitised)
    /// `name_hint`, and returns its URL.
    pub async fn fresh_database(&self, name_hint: &str) -> Result<String> {
        let name = unique_db_name(name_hint);
        let mut conn =
            PgConnection::connect(&self.admin_url()).await.context("connecting to the Postgres admin database")?;
        // `name` is made of [a-z0-9_] only (see unique_db_name), so quoting it is enough.
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&mut conn)
            .await
            .with_context(|| format!("creating database {name}"))?;
        conn.close().await?;
        Ok(self.url_for(&name))
    }

    fn url_for(&self, database: &str) -> String {
        format!("postgres://postgres@{}/{database}", self.addr)
    }
}

/// A NATS server with JetStream (store in `/data`) whose host port survives restarts.
#[derive(Debug)]
pub struct Nats {
    container: ContainerAsync<GenericImage>,
    port: u16,
    /// Where clients connect: `127.0.0.1:<port>`, or the container's own address
    /// ([`Nats::connect_directly`]).
    addr: String,
}

impl Nats {
    /// Starts `nats-server -js --store_dir /data` (JetStream with the default `sync_interval`).
    pub async fn start() -> Result<Self> {
        Self::start_with_args(&NATS_DEFAULT_ARGS).await
    }

    /// Starts the server with `/etc/nats/durable.conf` (JetStream in `/data`,
    /// `sync_interval: always`). Only the image from `scripts/build-images` has that file.
    pub async fn start_durable() -> Result<Self> {
        Self::start_with_args(&NATS_DURABLE_ARGS).await
    }

    /// Starts the server with these arguments (they replace the image's CMD).
    pub async fn start_with_args(args: &[&str]) -> Result<Self> {
        Self::start_with(args, Storage::Layer).await
    }

    /// Starts the server with these arguments and the host directory `host_dir` mounted read-only
    /// at `container_dir` (e.g. certificates for `--tls`).
    pub async fn start_with_files(args: &[&str], host_dir: &str, container_dir: &str) -> Result<Self> {
        Self::start_inner(args, Storage::Layer, Some((host_dir.to_owned(), container_dir.to_owned()))).await
    }

    /// Starts the server with these arguments and its JetStream store (`/data`) where `storage`
    /// says.
    pub async fn start_with(args: &[&str], storage: Storage) -> Result<Self> {
        Self::start_inner(args, storage, None).await
    }

    /// Starts `nats-server -js` from another image than `HANDOFF_NATS_IMAGE` (another server
    /// version, say).
    pub async fn start_image(image_ref: &str) -> Result<Self> {
        Self::start_from(image_ref.to_owned(), &NATS_DEFAULT_ARGS, Storage::Layer, None).await
    }

    async fn start_inner(args: &[&str], storage: Storage, files: Option<(String, String)>) -> Result<Self> {
        Self::start_from(image_from_env("HANDOFF_NATS_IMAGE", DEFAULT_NATS_IMAGE), args, storage, files).await
    }

    async fn start_from(
        image_ref: String,
        args: &[&str],
        storage: Storage,
        files: Option<(String, String)>,
    ) -> Result<Self> {
        Self::start_placed(image_ref, args, storage, files, None).await
    }

    /// Starts a node of a cluster: `image_ref` with `args`, named `placement.container` on the
    /// Docker network `placement.network` (created if it does not exist yet), where the other
    /// nodes reach it by that name.
    pub(crate) async fn start_on_network(
        image_ref: String,
        args: &[&str],
        storage: Storage,
        placement: &Placement,
    ) -> Result<Self> {
        Self::start_placed(image_ref, args, storage, None, Some(placement)).await
    }

    async fn start_placed(
        image_ref: String,
        args: &[&str],
        storage: Storage,
        files: Option<(String, String)>,
        placement: Option<&Placement>,
    ) -> Result<Self> {
        let (name, tag) = split_image(&image_ref);
        let started = Instant::now();
        // The host port is chosen here and bound explicitly, so that it stays the same when
        // the container is stopped and started again.
        let (container, port) = start_on_a_free_port("NATS", &image_ref, |port| {
            let mut request = GenericImage::new(name, tag)
                .with_exposed_port(NATS_PORT.tcp())
                .with_wait_for(WaitFor::message_on_stderr("Server is ready"))
                .with_cmd(args.iter().copied())
                .with_mapped_port(port, NATS_PORT.tcp())
                .with_startup_timeout(STARTUP_TIMEOUT);
            if let Some(placement) = placement {
                request = request.with_network(&placement.network).with_container_name(&placement.container);
            }
            request
                .with_host_config_modifier({
                    let files = files.clone();
                    move |config| {
                        let mut mounts = storage.mounts(NATS_DATA).unwrap_or_default();
                        if let Some((host, container)) = &files {
                            mounts.push(Mount {
                                source: Some(host.clone()),
                                target: Some(container.clone()),
                                typ: Some(MountType::BIND),
                                read_only: Some(true),
                                ..Default::default()
                            });
                        }
                        config.mounts = (!mounts.is_empty()).then_some(mounts);
                        bind_to_loopback(config);
                    }
                })
                .start()
        })
        .await?;
        let nats = Self { container, port, addr: format!("127.0.0.1:{port}") };
        nats.wait_until_ready().await?;
        tracing::info!(image = %image_ref, port, elapsed_ms = started.elapsed().as_millis() as u64, "NATS container ready");
        Ok(nats)
    }

    /// `nats://127.0.0.1:<port>`, the same before and after [`Nats::restart`] (or the
    /// container's own address after [`Nats::connect_directly`]).
    pub fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    /// From now on, [`Nats::url`] names the container's address on its Docker network and the
    /// server's own port, bypassing docker-proxy, if the server greets a client there; returns
    /// whether it does. For servers that are not restarted (the address may change).
    pub async fn connect_directly(&mut self) -> Result<bool> {
        let Some(addr) = direct_addr(&self.container, NATS_PORT).await else { return Ok(false) };
        let Ok(socket) = addr.parse::<std::net::SocketAddr>() else { return Ok(false) };
        if nats_greets(socket).await {
            self.addr = addr;
            return Ok(true);
        }
        Ok(false)
    }

    /// The host port NATS is published on (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The underlying container.
    pub fn container(&self) -> &ContainerAsync<GenericImage> {
        &self.container
    }

    /// Stops and starts the same container (JetStream data in `/data` is kept) on the same
    /// host port, and waits until it accepts clients again.
    pub async fn restart(&self) -> Result<()> {
        self.stop().await?;
        self.start_again().await
    }

    /// Kills the server at once (SIGKILL: no shutdown, no last flush); [`Nats::start_again`]
    /// brings it back with its JetStream store as the kill left it.
    pub async fn kill(&self) -> Result<()> {
        kill_container(self.container.id()).await.context("killing the NATS container")?;
        tracing::info!(port = self.port, "NATS container killed");
        Ok(())
    }

    /// Stops the server (SIGTERM, then SIGKILL after 10 s); clients see the connection drop.
    pub async fn stop(&self) -> Result<()> {
        self.container.stop_with_timeout(Some(10)).await.context("stopping the NATS container")?;
        tracing::info!(port = self.port, "NATS container stopped");
        Ok(())
    }

    /// Starts the container again after [`Nats::stop`] and waits until it accepts clients.
    pub async fn start_again(&self) -> Result<()> {
        start_again_on_its_port("NATS", &self.container, self.port, NATS_PORT).await?;
        self.wait_until_ready().await?;
        tracing::info!(port = self.port, "NATS container started again");
        Ok(())
    }

    /// Waits until the server greets a TCP client with its `INFO` line. The log line used at
    /// first start cannot be used again: the log still holds the previous run's.
    async fn wait_until_ready(&self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if nats_greets((Ipv4Addr::LOCALHOST, self.port).into()).await {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("NATS on port {} did not accept clients within {READY_TIMEOUT:?}", self.port);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Starts a container whose host port is chosen here ([`free_port`]), so that it keeps that port
/// across restarts. Another process could take the port between the probe and the bind: a few
/// ports are tried.
async fn start_on_a_free_port<F, Fut>(
    what: &str,
    image_ref: &str,
    start: F,
) -> Result<(ContainerAsync<GenericImage>, u16)>
where
    F: Fn(u16) -> Fut,
    Fut: std::future::Future<Output = testcontainers::core::error::Result<ContainerAsync<GenericImage>>>,
{
    let mut last_err = None;
    for _ in 0..3 {
        let port = free_port()?;
        match start(port).await {
            Ok(container) => return Ok((container, port)),
            Err(err) => {
                tracing::warn!("starting {what} on host port {port} failed: {err}");
                last_err = Some(err);
            }
        }
    }
    Err(anyhow::Error::from(last_err.expect("at least one attempt"))
        .context(format!("starting {what} container from image {image_ref}")))
}

/// Starts a stopped or killed container again and checks it came back on `port`.
async fn start_again_on_its_port(
    what: &str,
    container: &ContainerAsync<GenericImage>,
    port: u16,
    container_port: u16,
) -> Result<()> {
    container.start().await.with_context(|| format!("starting the {what} container again"))?;
    let now = container.get_host_port_ipv4(container_port).await?;
    if now != port {
        bail!("{what} came back on host port {now}, expected {port}");
    }
    Ok(())
}

/// SIGKILL to a container's main process, through the Docker API testcontainers uses.
async fn kill_container(id: &str) -> Result<()> {
    use testcontainers::bollard::{Docker, query_parameters::KillContainerOptionsBuilder};
    let docker = Docker::connect_with_defaults().context("connecting to Docker")?;
    docker.kill_container(id, Some(KillContainerOptionsBuilder::default().signal("SIGKILL").build())).await?;
    Ok(())
}

/// Restricts a running container to the CPUs in `cpus` (Docker's `--cpuset-cpus` syntax, e.g.
/// `"1"` or `"0-1"`), through the Docker API testcontainers uses: a benchmark keeps a stand-in for a
/// remote server off the CPUs of the processes it measures.
pub async fn set_container_cpus(container: &ContainerAsync<GenericImage>, cpus: &str) -> Result<()> {
    use testcontainers::bollard::{Docker, models::ContainerUpdateBody};
    let docker = Docker::connect_with_defaults().context("connecting to Docker")?;
    let update = ContainerUpdateBody { cpuset_cpus: Some(cpus.to_owned()), ..Default::default() };
    docker
        .update_container(container.id(), update)
        .await
        .with_context(|| format!("restricting container {} to CPUs {cpus}", container.id()))?;
    Ok(())
}

/// Where a cluster node runs: its Docker network and its container name on it.
#[derive(Debug, Clone)]
pub(crate) struct Placement {
    pub network: String,
    pub container: String,
}

/// True when a NATS server at `addr` sends its `INFO {...}` greeting. (docker-proxy accepts
/// connections before the server inside listens, so a successful connect alone says nothing.)
async fn nats_greets(addr: std::net::SocketAddr) -> bool {
    let attempt = async {
        let mut stream = TcpStream::connect(addr).await?;
        let mut greeting = [0u8; 5];
        stream.read_exact(&mut greeting).await?;
        std::io::Result::Ok(&greeting == b"INFO ")
    };
    matches!(tokio::time::timeout(Duration::from_secs(2), attempt).await, Ok(Ok(true)))
}

/// What `SELECT 1` returns on a new connection to `url`.
async fn select_one(url: &str) -> Result<i32> {
    let mut conn = PgConnection::connect(url).await?;
    let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut conn).await?;
    conn.close().await?;
    Ok(one)
}

/// `<the container's IP on its Docker network>:<port>`, if Docker reports one. (testcontainers'
/// `get_bridge_ip_address` looks the network up by the network mode, which is `default` for a
/// container on the default bridge, and finds none.)
async fn direct_addr(container: &ContainerAsync<GenericImage>, port: u16) -> Option<String> {
    use testcontainers::bollard::Docker;
    let docker = Docker::connect_with_defaults().ok()?;
    let inspected = docker.inspect_container(container.id(), None).await.ok()?;
    let networks = inspected.network_settings?.networks?;
    let ip = networks
        .values()
        .filter_map(|endpoint| endpoint.ip_address.as_deref()?.parse::<std::net::IpAddr>().ok())
        .find(|ip| !ip.is_unspecified())?;
    Some(std::net::SocketAddr::new(ip, port).to_string())
}

/// Publishes every port binding on 127.0.0.1 instead of all interfaces.
fn bind_to_loopback(config: &mut HostConfig) {
    for bindings in config.port_bindings.iter_mut().flat_map(|m| m.values_mut()) {
        for binding in bindings.iter_mut().flatten() {
            binding.host_ip = Some(Ipv4Addr::LOCALHOST.to_string());
        }
    }
}

/// A port that is free on 127.0.0.1 now, chosen below the kernel's ephemeral range
/// (32768-60999 by default) so that outgoing connections and other tests' `bind(0)` are
/// unlikely to take it while the container is stopped.
fn free_port() -> Result<u16> {
    const LOW: u64 = 20_000;
    const HIGH: u64 = 32_000;
    let random = RandomState::new();
    for attempt in 0u32..200 {
        let candidate = LOW + random.hash_one((std::process::id(), attempt)) % (HIGH - LOW);
        let candidate = u16::try_from(candidate).expect("below 32000");
        if TcpListener::bind((Ipv4Addr::LOCALHOST, candidate)).is_ok() {
            return Ok(candidate);
        }
    }
    bail!("no free port found in {LOW}..{HIGH} on 127.0.0.1")
}

pub(crate) fn image_from_env(var: &str, default: &str) -> String {
    match std::env::var(var) {
        Ok(value) if !value.trim().is_empty() => value.trim().to_owned(),
        _ => default.to_owned(),
    }
}

/// Splits `registry:5000/name:tag` into name and tag (tag `latest` when there is none).
fn split_image(image: &str) -> (&str, &str) {
    match image.rsplit_once(':') {
        Some((name, tag)) if !tag.contains('/') => (name, tag),
        _ => (image, "latest"),
    }
}

/// `<hint>_<pid>_<counter>_<micros>`: lowercase [a-z0-9_], at most 63 bytes, unique within
/// this process and very likely across processes sharing a server.
fn unique_db_name(hint: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let mut prefix: String =
        hint.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' }).take(24).collect();
    if !prefix.starts_with(|c: char| c.is_ascii_lowercase()) {
        prefix.insert_str(0, "db_");
    }
    let micros = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() % 1_000_000_000_000);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}_{}_{n}_{micros}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_image_references() {
        assert_eq!(split_image("postgres:15"), ("postgres", "15"));
        assert_eq!(split_image("nats"), ("nats", "latest"));
        assert_eq!(
            split_image("registry:5000/handoff-test/nats:2.15.1"),
            ("registry:5000/handoff-test/nats", "2.15.1")
        );
        assert_eq!(split_image("registry:5000/nats"), ("registry:5000/nats", "latest"));
    }

    #[test]
    fn database_names_are_safe_and_unique() {
        let a = unique_db_name("Relay Test: claim/mark, ünïcode and a very long hint indeed");
        let b = unique_db_name("Relay Test: claim/mark, ünïcode and a very long hint indeed");
        assert_ne!(a, b);
        for name in [&a, &b, &unique_db_name("9lives"), &unique_db_name("")] {
            assert!(name.len() <= 63, "{name}");
            assert!(name.starts_with(|c: char| c.is_ascii_lowercase()), "{name}");
            assert!(name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'), "{name}");
        }
    }
}
