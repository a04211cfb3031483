//! The operations endpoint both services serve (`--http-addr`): Prometheus metrics, liveness and
//! readiness.
//!
//! * `GET /metrics`: the process's [`Registry`] in the Prometheus text format. Gauges that need the
//!   database are sampled by the service at a fixed interval, never per scrape, so a scrape costs
//!   no query and a busy Prometheus cannot load the database.
//! * `GET /healthz`: 200 while every registered loop has completed an iteration within its bound
//!   ([`Liveness`]); 503 naming the stalled loops otherwise. An orchestrator restarts the process.
//! * `GET /readyz`: 200 when every [`Readiness`] check passes (database reachable and migrated, NATS
//!   connected, stream and consumer present); 503 with the failing checks otherwise. Each check
//!   is bounded by [`READY_CHECK_TIMEOUT`].

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures::future::BoxFuture;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::registry::Registry;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// How long a service loop may go without completing an iteration before `/healthz` reports it: a batch
/// takes milliseconds, an idle loop wakes every poll interval, and pauses after errors beat while
/// they wait. A minute means a statement or a publish that hangs.
pub const DEFAULT_STALL_AFTER: Duration = Duration::from_secs(60);
/// How often the backlog gauges are sampled: a few cheap index scans per interval, whatever the
/// scrape rate.
pub const DEFAULT_SAMPLE_INTERVAL: Duration = Duration::from_secs(5);
/// How long one readiness check may take before it counts as failed.
pub const READY_CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// Where the endpoint listens: an address, or off (an empty value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpAddr(pub Option<SocketAddr>);

impl std::str::FromStr for HttpAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.is_empty() {
            return Ok(Self(None));
        }
        s.parse::<SocketAddr>()
            .map(|addr| Self(Some(addr)))
            .map_err(|e| format!("expected HOST:PORT (e.g. 0.0.0.0:9185) or an empty value for off: {e}"))
    }
}

impl fmt::Display for HttpAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(addr) => write!(f, "{addr}"),
            None => f.write_str(""),
        }
    }
}

/// The loops of one process, each with the longest time it may go without completing an iteration.
#[derive(Debug, Clone, Default)]
pub struct Liveness {
    loops: Arc<Mutex<Vec<Weak<Heartbeat>>>>,
}

/// One loop's heartbeat. The loop calls [`Heartbeat::beat`] once per iteration, including idle ones;
/// a heartbeat that is dropped (its loop ended) is no longer checked.
#[derive(Debug)]
pub struct Heartbeat {
    name: String,
    bound: Duration,
    origin: Instant,
    last_ms: AtomicU64,
}

impl Heartbeat {
    /// The loop completed an iteration.
    pub fn beat(&self) {
        self.last_ms.store(self.origin.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Waits `duration`, beating while it waits (a deliberate pause, such as a backoff after errors,
    /// is not a stall). Returns false, early, when `token` is cancelled.
    pub async fn pause(&self, duration: Duration, token: &CancellationToken) -> bool {
        let deadline = tokio::time::Instant::now() + duration;
        let step = (self.bound / 4).max(Duration::from_millis(10));
        loop {
            self.beat();
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return true;
            }
            tokio::select! {
                _ = token.cancelled() => return false,
                _ = tokio::time::sleep_until(deadline.min(now + step)) => {}
            }
        }
    }

    /// Time since the last beat.
    pub fn since_last(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.origin.elapsed().saturating_sub(last)
    }
}

/// A loop that missed its bound.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Stalled {
    pub name: String,
    pub since_last_secs: u64,
    pub bound_secs: u64,
}

impl Liveness {
    /// Registers a loop that must beat at least every `bound`. Counts as beaten now.
    pub fn register(&self, name: impl Into<String>, bound: Duration) -> Arc<Heartbeat> {
        let heartbeat =
            Arc::new(Heartbeat { name: name.into(), bound, origin: Instant::now(), last_ms: AtomicU64::new(0) });
        let mut loops = self.loops.lock().unwrap_or_else(|e| e.into_inner());
        loops.retain(|weak| weak.strong_count() > 0);
        loops.push(Arc::downgrade(&heartbeat));
        heartbeat
    }

    /// The live loops that have not beaten within their bound (a zero bound is always missed).
    pub fn stalled(&self) -> Vec<Stalled> {
        let loops = self.loops.lock().unwrap_or_else(|e| e.into_inner());
        loops
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|h| h.since_last() >= h.bound)
            .map(|h| Stalled {
                name: h.name.clone(),
                since_last_secs: h.since_last().as_secs(),
                bound_secs: h.bound.as_secs(),
            })
            .collect()
    }

    /// How many live loops are registered.
    pub fn loops(&self) -> usize {
        self.loops.lock().unwrap_or_else(|e| e.into_inner()).iter().filter(|w| w.strong_count() > 0).count()
    }
}

/// The result of one readiness check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub ok: bool,
    /// What failed (never a secret), or what was found.
    pub detail: String,
}

impl Check {
    pub fn ok(name: &'static str, detail: impl Into<String>) -> Self {
        Self { name, ok: true, detail: detail.into() }
    }

    pub fn failed(name: &'static str, detail: impl Into<String>) -> Self {
        Self { name, ok: false, detail: detail.into() }
    }

    /// Runs `check` under [`READY_CHECK_TIMEOUT`]; a timeout is a failure.
    pub async fn bounded(name: &'static str, check: impl Future<Output = Check>) -> Check {
        match tokio::time::timeout(READY_CHECK_TIMEOUT, check).await {
            Ok(check) => check,
            Err(_) => Self::failed(name, format!("no answer within {READY_CHECK_TIMEOUT:?}")),
        }
    }
}

/// What a service must reach to do its work.
pub trait Readiness: Send + Sync + 'static {
    fn check(&self) -> BoxFuture<'_, Vec<Check>>;
}

/// The database answers and has every migration this binary embeds.
pub async fn check_database(pool: &sqlx::PgPool, schema: &crate::migrate::Schema) -> Check {
    const NAME: &str = "database";
    match schema.applied(pool).await {
        Ok(Some(version)) if version >= schema.latest() => Check::ok(NAME, format!("{} at {version}", schema.name())),
        Ok(version) => Check::failed(
            NAME,
            format!("schema {} at {version:?}, this binary needs {}", schema.name(), schema.latest()),
        ),
        Err(error) => Check::failed(NAME, crate::logging::error_chain(&error)),
    }
}

/// The NATS connection is up.
pub fn check_nats(client: &async_nats::Client) -> Check {
    match client.connection_state() {
        async_nats::connection::State::Connected => Check::ok("nats", "connected"),
        state => Check::failed("nats", format!("{state}")),
    }
}

/// Everything the endpoint serves.
#[derive(Clone)]
pub struct Endpoint {
    pub registry: Arc<Registry>,
    pub liveness: Liveness,
    pub readiness: Arc<dyn Readiness>,
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint").field("liveness", &self.liveness).finish_non_exhaustive()
    }
}

impl Endpoint {
    /// The router, for serving or calling in-process.
    pub fn router(self) -> Router {
        Router::new()
            .route("/metrics", get(metrics))
            .route("/healthz", get(healthz))
            .route("/readyz", get(readyz))
            .with_state(self)
    }

    /// Binds `addr` (the `--http-addr` setting named `setting`), failing with a message that names
    /// the setting when it cannot.
    pub async fn bind(addr: SocketAddr, setting: &str) -> anyhow::Result<TcpListener> {
        TcpListener::bind(addr).await.map_err(|e| anyhow::anyhow!("{setting}={addr}: cannot listen: {e}"))
    }

    /// Serves until `token` is cancelled.
    pub async fn serve(self, listener: TcpListener, token: CancellationToken) -> std::io::Result<()> {
        axum::serve(listener, self.router()).with_graceful_shutdown(token.cancelled_owned()).await
    }
}

async fn metrics(State(endpoint): State<Endpoint>) -> Response {
    let mut body = String::with_capacity(16 * 1024);
    match prometheus_text::encode(&mut body, &endpoint.registry) {
        Ok(()) => ([(header::CONTENT_TYPE, prometheus_text::CONTENT_TYPE)], body).into_response(),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "cannot encode metrics\n").into_response(),
    }
}

async fn healthz(State(endpoint): State<Endpoint>) -> Response {
    let stalled = endpoint.liveness.stalled();
    if stalled.is_empty() {
        (StatusCode::OK, format!("ok: {} loops alive\n", endpoint.liveness.loops())).into_response()
    } else {
        let lines: String = stalled
            .iter()
            .map(|s| {
                format!("stalled: {} (no iteration for {}s, bound {}s)\n", s.name, s.since_last_secs, s.bound_secs)
            })
            .collect();
        (StatusCode::SERVICE_UNAVAILABLE, lines).into_response()
    }
}

async fn readyz(State(endpoint): State<Endpoint>) -> Response {
    let checks = endpoint.readiness.check().await;
    let status = if checks.iter().all(|c| c.ok) { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, axum::Json(checks)).into_response()
}

/// `GET path` on the endpoint at `addr` (an unspecified address such as `0.0.0.0` means this
/// host): the status code. For the `healthcheck` subcommand, which container runtimes run inside
/// images that hold nothing but the binary (no shell, no curl).
pub async fn probe(addr: SocketAddr, path: &str, timeout: Duration) -> anyhow::Result<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let target = if addr.ip().is_unspecified() {
        SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), addr.port())
    } else {
        addr
    };
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(target).await?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut head = [0u8; 64];
        let read = stream.read(&mut head).await?;
        anyhow::Ok(String::from_utf8_lossy(&head[..read]).into_owned())
    };
    let head = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| anyhow::anyhow!("{target}{path}: no answer within {timeout:?}"))?
        .map_err(|e| e.context(format!("{target}{path}")))?;
    // "HTTP/1.1 200 OK"
    head.split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("{target}{path}: not an HTTP answer"))
}

/// Standard histogram buckets for the durations of database statements, publishes and CRM calls,
/// in seconds: 0.5 ms to about 16 s, doubling.
pub fn duration_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.0005, 2.0, 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_addr_is_an_address_or_off() {
        assert_eq!("".parse::<HttpAddr>().unwrap(), HttpAddr(None));
        assert_eq!(" ".parse::<HttpAddr>().unwrap(), HttpAddr(None));
        assert_eq!("127.0.0.1:9185".parse::<HttpAddr>().unwrap().0, Some("127.0.0.1:9185".parse().unwrap()));
        assert!("localhost".parse::<HttpAddr>().is_err());
    }

    #[test]
    fn a_loop_that_misses_its_bound_is_stalled_and_a_dropped_one_is_forgotten() {
        let liveness = Liveness::default();
        let fresh = liveness.register("fresh", Duration::from_secs(60));
        // A zero bound is missed at once: no iteration can complete within it.
        let stuck = liveness.register("stuck", Duration::ZERO);
        fresh.beat();
        let stalled = liveness.stalled();
        assert_eq!(stalled.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["stuck"]);
        drop(stuck);
        assert!(liveness.stalled().is_empty());
        assert_eq!(liveness.loops(), 1);
    }
}
