//! Connection settings shared by both binaries: every flag has an environment variable, defaults are
//! named, and `Debug` never prints a secret.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

/// How long to wait for a first connection before giving up at startup.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// NATS connection settings.
#[derive(Clone, clap::Args)]
pub struct NatsArgs {
    /// NATS server URLs, comma separated (nats://, tls://).
    #[arg(long = "nats-url", env = "NATS_URL", value_delimiter = ',', default_value = "nats://127.0.0.1:4222")]
    pub urls: Vec<String>,
    /// Path to a NATS .creds file (JWT + nkey seed).
    #[arg(long = "nats-creds", env = "NATS_CREDS")]
    pub creds_file: Option<PathBuf>,
    /// NKey seed for nkey authentication (secret).
    #[arg(long = "nats-nkey", env = "NATS_NKEY", hide_env_values = true)]
    pub nkey_seed: Option<String>,
    /// User name for user/password authentication.
    #[arg(long = "nats-user", env = "NATS_USER", requires = "password")]
    pub user: Option<String>,
    /// Password for user/password authentication (secret).
    #[arg(long = "nats-password", env = "NATS_PASSWORD", hide_env_values = true)]
    pub password: Option<String>,
    /// Token for token authentication (secret).
    #[arg(long = "nats-token", env = "NATS_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// PEM file with the CA certificates that sign the server's certificate.
    #[arg(long = "nats-tls-ca", env = "NATS_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate for mutual TLS (with --nats-tls-key).
    #[arg(long = "nats-tls-cert", env = "NATS_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM client key for mutual TLS (with --nats-tls-cert).
    #[arg(long = "nats-tls-key", env = "NATS_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Refuse to connect without TLS.
    #[arg(long = "nats-tls-required", env = "NATS_TLS_REQUIRED", default_value_t = false)]
    pub tls_required: bool,
    /// Seconds to keep trying the first connection while the server is unreachable (it may start
    /// after this process); refused credentials or certificates fail at once, with the cause.
    #[arg(
        long = "nats-connect-timeout-secs",
        env = "HANDOFF_NATS_CONNECT_TIMEOUT_SECS",
        default_value_t = DEFAULT_NATS_CONNECT_TIMEOUT.as_secs(),
        value_parser = clap::value_parser!(u64).range(1..=3600)
    )]
    pub connect_timeout_secs: u64,
    /// Subject prefix of this connection's reply inboxes (default `_INBOX`). Give each service
    /// user its own (e.g. `_INBOX_handoff_relay`) and allow it only `subscribe` on `<prefix>.>`,
    /// so no other user can read its replies.
    #[arg(long = "nats-inbox-prefix", env = "NATS_INBOX_PREFIX", value_parser = parse_inbox_prefix)]
    pub inbox_prefix: Option<String>,
}

/// An inbox prefix: one or more subject tokens without wildcards.
fn parse_inbox_prefix(s: &str) -> Result<String, String> {
    let valid = !s.is_empty()
        && s.split('.').all(|t| !t.is_empty() && !t.contains(['*', '>']) && !t.contains(char::is_whitespace));
    if valid { Ok(s.to_owned()) } else { Err(format!("{s:?} is not a subject prefix (tokens without wildcards)")) }
}

/// Logs what the server reports about a live connection: permission violations and other server
/// errors at WARN (otherwise invisible: a refused publish or subscription just never answers),
/// slow consumers, lame-duck mode; connection changes at info and the client's own reconnect
/// errors at debug (an outage is logged once at its start and once at its end by the loops).
async fn log_nats_event(event: async_nats::Event) {
    use async_nats::Event;
    match event {
        Event::ServerError(error) => tracing::warn!(%error, "NATS server error"),
        Event::ClientError(error) => tracing::debug!(%error, "NATS client error"),
        Event::SlowConsumer(sid) => {
            tracing::warn!(sid, "NATS slow consumer: the server dropped messages for a subscription")
        }
        Event::LameDuckMode => {
            tracing::warn!("NATS server entered lame duck mode; the client will move to another server")
        }
        Event::Connected => tracing::info!("NATS connected"),
        Event::Disconnected => tracing::info!("NATS disconnected; reconnecting"),
        other => tracing::debug!(event = %other, "NATS event"),
    }
}

/// Whether an IO error with kind `InvalidData` is in `error`'s source chain (how a TLS handshake
/// failure, such as an untrusted certificate, reaches the NATS client's connect error).
fn is_invalid_data(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(error);
    while let Some(cause) = source {
        if cause.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::InvalidData) {
            return true;
        }
        source = cause.source();
    }
    false
}

/// Credentials a NATS URL carried.
#[derive(Clone)]
enum UrlCredentials {
    UserPassword(String, String),
    /// `nats://<token>@host`.
    Token(String),
}

/// A server address without the credentials its URL carried, and those credentials.
fn split_credentials(text: &str) -> Result<(async_nats::ServerAddr, Option<UrlCredentials>), String> {
    let bad = |e: &dyn std::fmt::Display| format!("{}: {e}", redact_url(text));
    let mut url = url::Url::parse(text).map_err(|e| bad(&e))?;
    let decode = |part: &str| percent_encoding::percent_decode_str(part).decode_utf8_lossy().into_owned();
    let credentials = match (url.username(), url.password()) {
        ("", None) => None,
        (user, Some(password)) => Some(UrlCredentials::UserPassword(decode(user), decode(password))),
        (token, None) => Some(UrlCredentials::Token(decode(token))),
    };
    let _ = url.set_username("");
    let _ = url.set_password(None);
    let addr = url.as_str().parse::<async_nats::ServerAddr>().map_err(|e| bad(&e))?;
    Ok((addr, credentials))
}

/// How long a service keeps trying its first NATS connection while the server is unreachable.
pub const DEFAULT_NATS_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// Why the first NATS connection failed. The message names the servers, the cause and what to check.
#[derive(Debug, thiserror::Error)]
#[error("cannot connect to NATS at {urls}: {cause}{hint}")]
pub struct NatsConnectError {
    pub urls: String,
    /// The whole cause chain of the last attempt.
    pub cause: String,
    hint: &'static str,
}

impl fmt::Debug for NatsArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsArgs")
            .field("urls", &self.urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>())
            .field("creds_file", &self.creds_file)
            .field("nkey_seed", &self.nkey_seed.as_ref().map(|_| "<redacted>"))
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("tls_ca", &self.tls_ca)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .field("tls_required", &self.tls_required)
            .field("connect_timeout_secs", &self.connect_timeout_secs)
            .field("inbox_prefix", &self.inbox_prefix)
            .finish()
    }
}

impl NatsArgs {
    /// Settings for a plain server at `url`, for tests and demos.
    pub fn plain(url: impl Into<String>) -> Self {
        Self {
            urls: vec![url.into()],
            creds_file: None,
            nkey_seed: None,
            user: None,
            password: None,
            token: None,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            tls_required: false,
            connect_timeout_secs: DEFAULT_NATS_CONNECT_TIMEOUT.as_secs(),
            inbox_prefix: None,
        }
    }

    /// Connects, naming the connection `name` (visible in the server's connz). While the server is
    /// unreachable the first connection is retried (a process may start before the broker) for
    /// `--nats-connect-timeout-secs`; refused credentials, an untrusted certificate or a malformed
    /// URL fail at once. Either way the error names the cause and what to check. Once connected,
    /// the client reconnects by itself for as long as the process runs.
    pub async fn connect(&self, name: &str) -> Result<async_nats::Client, NatsConnectError> {
        use async_nats::ConnectErrorKind as Kind;
        let urls = self.urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>().join(",");
        let fail = |cause: String, hint: &'static str| NatsConnectError { urls: urls.clone(), cause, hint };
        // Credentials written into a URL go to the client as options, and the URL without them:
        // the client logs server addresses (at debug), and a password must never be among them.
        let mut url_credentials = None;
        let mut addrs = Vec::with_capacity(self.urls.len());
        for text in &self.urls {
            let (addr, credentials) =
                split_credentials(text).map_err(|cause| fail(cause, " (--nats-url, NATS_URL)"))?;
            url_credentials = url_credentials.or(credentials);
            addrs.push(addr);
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(self.connect_timeout_secs);
        let mut pause = Duration::from_millis(200);
        loop {
            let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
            let mut options = self
                .options(name, remaining.clamp(Duration::from_secs(1), DEFAULT_CONNECT_TIMEOUT))
                .await
                .map_err(|e| fail(crate::logging::error_chain(e.as_ref()), " (--nats-creds, NATS_CREDS)"))?;
            options = match url_credentials.clone() {
                Some(UrlCredentials::UserPassword(user, password)) => options.user_and_password(user, password),
                Some(UrlCredentials::Token(token)) => options.token(token),
                None => options,
            };
            let error = match options.connect(addrs.clone()).await {
                Ok(client) => return Ok(client),
                Err(error) => error,
            };
            let cause = crate::logging::error_chain(&error);
            let kind = error.kind();
            let hint = match kind {
                Kind::AuthorizationViolation | Kind::Authentication => {
                    return Err(fail(
                        cause,
                        " (check --nats-user/--nats-password, --nats-token, --nats-nkey or --nats-creds)",
                    ));
                }
                // A certificate the client does not trust comes back as an IO error of kind
                // InvalidData (the TLS library's error inside): as permanent as a refused login.
                Kind::Tls | Kind::Io if kind == Kind::Tls || is_invalid_data(&error) => {
                    return Err(fail(
                        cause,
                        " (check --nats-tls-ca: it must sign the server's certificate; and --nats-tls-cert/--nats-tls-key)",
                    ));
                }
                Kind::ServerParse => return Err(fail(cause, " (--nats-url, NATS_URL)")),
                _ => " (is the server up and reachable? --nats-url, NATS_URL)",
            };
            if tokio::time::Instant::now() + pause >= deadline {
                return Err(fail(format!("{cause}; gave up after {}s", self.connect_timeout_secs), hint));
            }
            tracing::info!(error = %cause, retry_in_ms = pause.as_millis() as u64, "NATS not reachable yet");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(5));
        }
    }

    async fn options(&self, name: &str, attempt_timeout: Duration) -> anyhow::Result<async_nats::ConnectOptions> {
        let mut options = async_nats::ConnectOptions::new()
            .name(name)
            .connection_timeout(attempt_timeout)
            .event_callback(log_nats_event);
        if let Some(prefix) = &self.inbox_prefix {
            options = options.custom_inbox_prefix(prefix.clone());
        }
        if let Some(path) = &self.creds_file {
            options = options.credentials_file(path).await?;
        }
        if let Some(seed) = &self.nkey_seed {
            options = options.nkey(seed.clone());
        }
        if let (Some(user), Some(password)) = (&self.user, &self.password) {
            options = options.user_and_password(user.clone(), password.clone());
        }
        if let Some(token) = &self.token {
            options = options.token(token.clone());
        }
        if let Some(ca) = &self.tls_ca {
            options = options.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        Ok(options.require_tls(self.tls_required))
    }
}

/// Postgres connection settings.
#[derive(Clone, clap::Args)]
pub struct DatabaseArgs {
    /// Postgres URL, e.g. postgres://user:pass@host/db?sslmode=verify-full&sslrootcert=/ca.pem
    /// (the password is a secret and is never logged).
    #[arg(long = "database-url", env = "DATABASE_URL", hide_env_values = true)]
    pub url: String,
    /// Largest number of pooled connections (a relay opens one more per worker, up to this many,
    /// for its claims and settles; a consumer with --crm http up to 4 more for its dispatcher:
    /// pools of their own).
    #[arg(
        long = "database-max-connections",
        env = "DATABASE_MAX_CONNECTIONS",
        default_value_t = 8,
        value_parser = clap::value_parser!(u32).range(1..=1000)
    )]
    pub max_connections: u32,
}

impl fmt::Debug for DatabaseArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DatabaseArgs")
            .field("url", &redact_url(&self.url))
            .field("max_connections", &self.max_connections)
            .finish()
    }
}

/// How a pool's connections plan their statements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plans {
    /// Every execution is planned with its parameters (`plan_cache_mode = force_custom_plan`): a
    /// generic plan cached while a table is empty keeps its full scan when the table has grown
    /// (platform notes). What every pool uses unless it says otherwise.
    PerExecution,
    /// Each statement is planned once per connection (`plan_cache_mode = force_generic_plan`)
    /// with sequential scans off (`enable_seqscan = off`), so no execution pays for planning. Only
    /// for a pool whose every statement reaches its rows through an index, by key or as an ordered
    /// range that stops at a `LIMIT`, and is written so that its generic plan is that one whatever
    /// the table's size (e.g. `key = ANY($1)` beside a join on the key), with a test that checks
    /// those plans on an empty table.
    OncePerConnection,
}

impl Plans {
    /// The server settings each connection starts with (a pool that derives its options from
    /// another's appends these; the last value of a setting wins).
    pub fn settings(self) -> Vec<(&'static str, &'static str)> {
        match self {
            Plans::PerExecution => vec![("plan_cache_mode", "force_custom_plan")],
            Plans::OncePerConnection => vec![("plan_cache_mode", "force_generic_plan"), ("enable_seqscan", "off")],
        }
    }
}

/// Query parameters of a connection URL that hold secrets (libpq's `password`, `sslpassword`, and
/// the token some NATS tooling accepts).
const SECRET_QUERY_KEYS: [&str; 4] = ["password", "sslpassword", "token", "pass"];

/// URL schemes of NATS servers.
const NATS_SCHEMES: [&str; 4] = ["nats", "tls", "ws", "wss"];

/// A connection URL safe to log: the password of `user:password@` and the values of secret query
/// parameters (`?password=`, `sslpassword=`) become `<redacted>`. Parsed as a URL, so every form
/// of the same secret is caught; a value that does not parse is not shown at all.
pub fn redact_url(url: &str) -> String {
    const REDACTED: &str = "<redacted>";
    let Ok(mut parsed) = url::Url::parse(url) else {
        return "<unparsable URL, not shown>".to_owned();
    };
    if parsed.password().is_some() {
        let _ = parsed.set_password(Some(REDACTED));
    } else if !parsed.username().is_empty() && NATS_SCHEMES.contains(&parsed.scheme()) {
        // `nats://<token>@host`: for NATS a user name alone is a token.
        let _ = parsed.set_username(REDACTED);
    }
    if parsed.query().is_some() {
        let pairs: Vec<(String, String)> = parsed
            .query_pairs()
            .map(|(k, v)| {
                let secret = SECRET_QUERY_KEYS.contains(&k.to_ascii_lowercase().as_str());
                (k.into_owned(), if secret { REDACTED.to_owned() } else { v.into_owned() })
            })
            .collect();
        parsed.query_pairs_mut().clear().extend_pairs(pairs);
    }
    // The query serializer percent-encodes the angle brackets; show the marker as written.
    parsed.to_string().replace("%3Credacted%3E", REDACTED)
}

impl DatabaseArgs {
    /// Settings for `url` with default pool size.
    pub fn plain(url: impl Into<String>) -> Self {
        Self { url: url.into(), max_connections: 8 }
    }

    /// Opens a pool of `--database-max-connections` connections planning every execution
    /// ([`Plans::PerExecution`]). `application_name` shows in `pg_stat_activity`.
    pub async fn connect(&self, application_name: &str) -> anyhow::Result<PgPool> {
        self.connect_with(application_name, Plans::PerExecution, self.max_connections).await
    }

    /// Opens a pool of `max_connections` connections planning as `plans` says. Connections are
    /// not pinged before each use (sqlx's default doubles the round trips of every short
    /// statement): a broken connection fails its statement, which every caller already retries,
    /// and the pool replaces it.
    pub async fn connect_with(
        &self,
        application_name: &str,
        plans: Plans,
        max_connections: u32,
    ) -> anyhow::Result<PgPool> {
        let options: PgConnectOptions = self
            .url
            .parse::<PgConnectOptions>()?
            .application_name(application_name)
            .options(plans.settings())
            .log_statements(tracing::log::LevelFilter::Trace);
        Ok(PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(DEFAULT_CONNECT_TIMEOUT)
            .test_before_acquire(false)
            .connect_with(options)
            .await?)
    }
}

/// Parses a count that must be at least 1 (batch sizes, workers, calls in flight): 0 would stall
/// silently, so it is refused at startup, naming the flag (clap adds which one).
pub fn at_least_one(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("expected a whole number >= 1: {e}")),
    }
}

/// Parses seconds that must be a finite number above zero (leases, waits): a negative, zero or NaN
/// duration is refused at startup instead of panicking when it is first used.
pub fn positive_seconds(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(secs) if secs.is_finite() && secs > 0.0 && secs <= MAX_SECONDS => Ok(secs),
        Ok(secs) => Err(format!("{secs} is not a duration in seconds between 0 (excluded) and {MAX_SECONDS}")),
        Err(e) => Err(format!("expected seconds, e.g. 1.5: {e}")),
    }
}

/// The longest duration any setting takes (30 days): beyond it, a typo.
pub const MAX_SECONDS: f64 = 30.0 * 86_400.0;

/// What the operations endpoint reports, shared by both services (the address is each service's
/// own setting, so both can run on one host with their defaults).
#[derive(Debug, Clone, clap::Args)]
pub struct ObserveArgs {
    /// Seconds a loop may go without completing an iteration before /healthz answers 503.
    #[arg(
        long = "stall-after-secs",
        env = "HANDOFF_STALL_AFTER_SECS",
        default_value_t = crate::observe::DEFAULT_STALL_AFTER.as_secs(),
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub stall_after_secs: u64,
    /// Seconds between database samples of the gauges /metrics shows (never sampled per scrape).
    #[arg(
        long = "metrics-sample-secs",
        env = "HANDOFF_METRICS_SAMPLE_SECS",
        default_value_t = crate::observe::DEFAULT_SAMPLE_INTERVAL.as_secs(),
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub sample_secs: u64,
}

impl ObserveArgs {
    pub fn stall_after(&self) -> Duration {
        Duration::from_secs(self.stall_after_secs)
    }

    pub fn sample_interval(&self) -> Duration {
        Duration::from_secs(self.sample_secs)
    }
}

/// What a service does with its schema at startup (both services).
#[derive(Debug, Clone, clap::Args)]
pub struct MigrateArgs {
    /// auto: apply pending migrations at startup; never: refuse to start while the schema is behind
    /// (run the `migrate` subcommand first, with a role that may change the schema).
    #[arg(long = "migrate", env = "HANDOFF_MIGRATE", value_enum, default_value = "auto")]
    pub mode: crate::migrate::MigrateMode,
}

/// The subcommands both services share; without one, the service runs.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum ServiceCommand {
    /// Apply pending migrations to this service's schema and exit (0 when the schema is current).
    /// Needs only the database settings.
    Migrate,
    /// Ask this service's own endpoint (--http-addr) and exit 0 on 200, 1 otherwise: a container
    /// healthcheck for images without a shell or curl.
    Healthcheck {
        /// The path to ask: /healthz (the loops are alive) or /readyz (dependencies reachable).
        #[arg(long, default_value = "/healthz")]
        path: String,
    },
}

/// Runs `healthcheck` against the endpoint at `addr`; prints the answer.
pub async fn run_healthcheck(addr: crate::observe::HttpAddr, path: &str, binary: &str) -> anyhow::Result<()> {
    let addr = addr.0.ok_or_else(|| anyhow::anyhow!("the endpoint is off (--http-addr is empty): nothing to check"))?;
    let status = crate::observe::probe(addr, path, Duration::from_secs(5)).await?;
    anyhow::ensure!(status == 200, "{binary} {path}: {status}");
    println!("{binary} {path}: 200");
    Ok(())
}

/// Runs `migrate` for `schema` on the database `args` names: connects, migrates, prints what it did.
pub async fn run_migrate(args: &DatabaseArgs, schema: &crate::migrate::Schema, binary: &str) -> anyhow::Result<()> {
    let pool = args.connect(binary).await?;
    let migrated = schema.migrate(&pool).await?;
    println!(
        "{binary}: schema {} at version {}{}",
        schema.name(),
        migrated.version,
        if migrated.adopted > 0 {
            format!(" ({} history rows moved from public._sqlx_migrations)", migrated.adopted)
        } else if migrated.ahead {
            format!(", ahead of this binary's {}: a newer binary migrated it; nothing applied", schema.latest())
        } else {
            String::new()
        }
    );
    Ok(())
}

/// The async runtime a service runs on.
#[derive(Debug, Clone, clap::Args)]
pub struct RuntimeArgs {
    /// Threads of the async runtime. With 1 (the default) the process runs on one thread: its
    /// work is waiting on Postgres and NATS, and on a small machine shared with them, handing
    /// wake-ups between runtime threads costs more CPU than a second thread gives (profiled on
    /// the consumer: 42% of its CPU in the kernel's scheduler with the multi-threaded runtime).
    /// Scale out with relay workers and consumer replicas; raise this only for a process that
    /// must use several cores by itself.
    #[arg(
        long = "worker-threads",
        env = "HANDOFF_WORKER_THREADS",
        default_value_t = 1,
        value_parser = clap::value_parser!(u16).range(1..)
    )]
    pub worker_threads: u16,
}

impl RuntimeArgs {
    /// Builds the runtime: current-thread for 1, multi-threaded otherwise.
    pub fn build(&self) -> std::io::Result<tokio::runtime::Runtime> {
        match self.worker_threads {
            1 => tokio::runtime::Builder::new_current_thread().enable_all().build(),
            n => tokio::runtime::Builder::new_multi_thread().worker_threads(n.into()).enable_all().build(),
        }
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Starts tracing: `RUST_LOG` filter (default `info`), text or JSON lines on stderr, colours only
/// when stderr is a terminal.
pub fn init_tracing(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours only for a person at a terminal: `docker logs` and log shippers get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr);
    // A second init (tests calling build twice) is harmless, so the error is ignored.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// The exit of a service: success, or the whole cause chain of its error on one line, the last
/// line the process prints (and an ERROR event for log shippers).
pub fn exit_with(binary: &str, result: anyhow::Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            let chain = crate::logging::error_chain(error.as_ref());
            tracing::error!(error = %chain, "stopped");
            eprintln!("{binary}: {chain}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Cancels `token` on SIGTERM or Ctrl-C, so `run_until_stopped` finishes in-flight work and returns.
pub async fn shutdown_on_signal(token: tokio_util::sync::CancellationToken) {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(term) => term,
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGTERM; only Ctrl-C stops the process");
                let _ = ctrl_c.await;
                token.cancel();
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("shutdown requested; finishing in-flight work");
    token.cancel();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_hides_secrets() {
        let mut nats = NatsArgs::plain("nats://x");
        nats.password = Some("hunter2".into());
        nats.token = Some("tok-secret".into());
        nats.nkey_seed = Some("SUAseed".into());
        let shown = format!("{nats:?}");
        assert!(!shown.contains("hunter2") && !shown.contains("tok-secret") && !shown.contains("SUAseed"));
        let db = DatabaseArgs::plain("postgres://app:s3cret@db:5432/handoff?sslmode=require");
        let shown = format!("{db:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("postgres://app:<redacted>@db:5432/handoff?sslmode=require"));
    }

    #[test]
    fn redaction_leaves_urls_without_passwords_alone() {
        assert_eq!(redact_url("postgres://db/x"), "postgres://db/x");
        assert_eq!(redact_url("postgres://app@db/x"), "postgres://app@db/x");
        assert_eq!(redact_url("postgres://db/x?sslmode=require"), "postgres://db/x?sslmode=require");
    }

    #[test]
    fn credentials_in_a_nats_url_move_to_the_options_and_out_of_the_address() {
        let (addr, credentials) = split_credentials("nats://relay:p%40ss@nats:4222").unwrap();
        assert!(!format!("{addr:?}").contains("p%40ss") && !format!("{addr:?}").contains("relay"), "{addr:?}");
        assert!(matches!(credentials, Some(UrlCredentials::UserPassword(u, p)) if u == "relay" && p == "p@ss"));
        let (_, credentials) = split_credentials("tls://tok3n@nats:4222").unwrap();
        assert!(matches!(credentials, Some(UrlCredentials::Token(t)) if t == "tok3n"));
        assert!(split_credentials("nats://nats:4222").unwrap().1.is_none());
        assert!(split_credentials("not a url").is_err());
    }

    #[test]
    fn every_form_of_a_url_secret_is_redacted() {
        for (url, secret) in [
            ("postgres://app:s3cret@db/x", "s3cret"),
            ("postgres://app:p%40ss@db/x", "p%40ss"),
            ("postgres://db/x?user=app&password=s3cret&sslmode=require", "s3cret"),
            ("postgres://db/x?PASSWORD=s3cret", "s3cret"),
            ("postgresql://db/x?sslpassword=keypass", "keypass"),
            ("nats://relay:natspass@nats:4222", "natspass"),
            ("tls://s3cr3ttoken@nats:4222", "s3cr3ttoken"),
            ("nats://nats:4222?token=s3cr3ttoken", "s3cr3ttoken"),
        ] {
            let shown = redact_url(url);
            assert!(!shown.contains(secret), "{url} -> {shown}");
            assert!(shown.contains("<redacted>"), "{url} -> {shown}");
        }
        assert_eq!(
            redact_url("postgres://db/x?user=app&password=s3cret&sslmode=require"),
            "postgres://db/x?user=app&password=<redacted>&sslmode=require"
        );
        assert_eq!(redact_url("not a url with a secret"), "<unparsable URL, not shown>");
    }
}
