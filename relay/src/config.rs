//! Every setting of `handoff-relay`, as a flag and an environment variable (`handoff-relay --help`).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use async_nats::jetstream::stream::StorageType;
use handoff_shared::Backoff;
use handoff_shared::config::{
    DatabaseArgs, LogFormat, MigrateArgs, NatsArgs, ObserveArgs, RuntimeArgs, ServiceCommand,
};
use handoff_shared::observe::HttpAddr;
use handoff_shared::signing::SigningKey;
use handoff_shared::subject::Subjects;

use crate::{ReconcileSettings, RelaySettings, StreamSettings};

/// Where the relay serves /metrics, /healthz and /readyz unless told otherwise.
pub const DEFAULT_HTTP_ADDR: &str = "0.0.0.0:9185";

/// Publishes approved actions from the Postgres outbox to NATS JetStream.
#[derive(Debug, clap::Parser)]
#[command(name = "handoff-relay", version)]
pub struct RelayConfig {
    #[command(subcommand)]
    pub command: Option<ServiceCommand>,
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub migrate: MigrateArgs,
    #[command(flatten)]
    pub nats: NatsArgs,
    /// JetStream stream name.
    #[arg(long, env = "HANDOFF_STREAM", default_value = "HANDOFF")]
    pub stream: String,
    /// Subject prefix; actions go to <prefix>.<namespace>.<action>.
    #[arg(long, env = "HANDOFF_SUBJECT_PREFIX", default_value = "handoff")]
    pub subject_prefix: String,
    /// Broker de-duplication window for Nats-Msg-Id, seconds. Longer than the relay's retry horizon
    /// keeps every re-publish a broker-level duplicate.
    #[arg(long, env = "HANDOFF_DUPLICATE_WINDOW_SECS", default_value_t = 3600, value_parser = clap::value_parser!(u64).range(1..=2_592_000))]
    pub duplicate_window_secs: u64,
    /// Stream message retention, seconds (0 = keep until the size limit).
    #[arg(long, env = "HANDOFF_STREAM_MAX_AGE_SECS", default_value_t = 7 * 24 * 3600)]
    pub stream_max_age_secs: u64,
    /// Stream size limit in bytes (-1 = unlimited); when full, publishes are refused and retried.
    #[arg(
        long,
        env = "HANDOFF_STREAM_MAX_BYTES",
        default_value_t = -1,
        allow_negative_numbers = true,
        value_parser = parse_max_bytes
    )]
    pub stream_max_bytes: i64,
    /// Stream replicas (3 in production clusters).
    #[arg(long, env = "HANDOFF_STREAM_REPLICAS", default_value_t = 1, value_parser = parse_replicas)]
    pub stream_replicas: usize,
    /// Keep the stream in memory instead of files (tests only: loses data on restart).
    #[arg(long, env = "HANDOFF_STREAM_MEMORY", default_value_t = false)]
    pub stream_memory: bool,
    /// Rows claimed per batch. Each worker holds its claim's messages while it publishes them:
    /// about batch size x payload size (lower it for payloads of tens of KiB).
    #[arg(long, env = "HANDOFF_RELAY_BATCH_SIZE", default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=100_000))]
    pub batch_size: i64,
    /// Concurrent claim-publish-mark loops.
    #[arg(long, env = "HANDOFF_RELAY_WORKERS", default_value_t = 2, value_parser = handoff_shared::config::at_least_one)]
    pub workers: usize,
    /// Lease on claimed rows, seconds; a dead relay's rows are retried after it.
    #[arg(long, env = "HANDOFF_RELAY_LEASE_SECS", default_value_t = 30.0, value_parser = handoff_shared::config::positive_seconds)]
    pub lease_secs: f64,
    /// Poll interval when idle, milliseconds (LISTEN/NOTIFY wakes the relay sooner).
    #[arg(long, env = "HANDOFF_RELAY_POLL_MS", default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub poll_ms: u64,
    /// Publish attempts before a row is blocked.
    #[arg(long, env = "HANDOFF_RELAY_MAX_ATTEMPTS", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_attempts: u32,
    /// Block rows still failing after this many seconds (0 = no age limit).
    #[arg(long, env = "HANDOFF_RELAY_MAX_AGE_SECS", default_value_t = 0)]
    pub max_age_secs: u64,
    /// First retry delay, milliseconds; doubles per attempt.
    #[arg(long, env = "HANDOFF_RELAY_BACKOFF_INITIAL_MS", default_value_t = 1000)]
    pub backoff_initial_ms: u64,
    /// Longest retry delay, seconds.
    #[arg(long, env = "HANDOFF_RELAY_BACKOFF_MAX_SECS", default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub backoff_max_secs: u64,
    /// Seconds a committed row may wait behind an older, still open write transaction before it is
    /// claimed on its own instead of in commit order.
    #[arg(long, env = "HANDOFF_RELAY_HELD_BACK_SECS", default_value_t = 1.0, value_parser = handoff_shared::config::positive_seconds)]
    pub held_back_secs: f64,
    /// Delete published outbox rows (approved actions are kept) this many seconds after publishing
    /// (0 = keep forever). Keep them at least as long as the broker keeps messages, to re-publish a
    /// range if it loses acknowledged ones.
    #[arg(long, env = "HANDOFF_RELAY_RETENTION_SECS", default_value_t = 7 * 24 * 3600)]
    pub retention_secs: u64,
    /// Seconds between reconciliations of recently published rows against the stream (0 = off).
    /// Each run reads the stream at every row's sequence; mismatches go to
    /// handoff_reconcile_mismatches and a warning.
    #[arg(long, env = "HANDOFF_RECONCILE_INTERVAL_SECS", default_value_t = 0)]
    pub reconcile_interval_secs: u64,
    /// How far back each periodic reconciliation looks, seconds of publishing.
    #[arg(
        long,
        env = "HANDOFF_RECONCILE_LOOKBACK_SECS",
        default_value_t = 3600,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub reconcile_lookback_secs: u64,
    /// Address of the /metrics, /healthz and /readyz endpoint; empty turns it off.
    #[arg(long, env = "HANDOFF_HTTP_ADDR", default_value = DEFAULT_HTTP_ADDR)]
    pub http_addr: HttpAddr,
    #[command(flatten)]
    pub observe: ObserveArgs,
    /// Envelope version to write (handoffschema). Consumers hold versions newer than they read, so
    /// relays may be upgraded first; set an older version only to keep old consumers reading.
    #[arg(
        long,
        env = "HANDOFF_ENVELOPE_VERSION",
        default_value_t = handoff_shared::envelope::SCHEMA_VERSION,
        value_parser = clap::value_parser!(u32).range(
            handoff_shared::envelope::OLDEST_SCHEMA_VERSION as i64..=handoff_shared::envelope::SCHEMA_VERSION as i64
        )
    )]
    pub envelope_version: u32,
    /// File holding the key every message is signed with (`handoff-admin keygen` writes one).
    /// Required unless --unsigned.
    #[arg(long, env = "HANDOFF_SIGNING_KEY_FILE", value_name = "FILE")]
    pub signing_key_file: Option<PathBuf>,
    /// Publish unsigned messages: only while the consumers run with --allow-unsigned, during a
    /// move to signed messages.
    #[arg(long, env = "HANDOFF_UNSIGNED", default_value_t = false, conflicts_with = "signing_key_file")]
    pub unsigned: bool,
    /// How claimed batches are published: pipelined (one JetStream publish per message), atomic
    /// (atomic batches: a few fsyncs per batch with sync_interval always; needs nats-server 2.12+
    /// and allow_atomic on the stream, which the relay turns on), or auto (on 2.15+, where a batch
    /// commits with a few fsyncs, each claim goes the way the relay has timed faster, claims of
    /// fewer than 100 rows and larger ones apart: pipelined on a broker that stores in
    /// microseconds, atomic when every message waits for an fsync; else pipelined).
    #[arg(long, env = "HANDOFF_PUBLISH_MODE", value_enum, default_value = "auto")]
    pub publish_mode: crate::publisher::PublishMode,
    /// CloudEvents source attribute of published events.
    #[arg(long, env = "HANDOFF_EVENT_SOURCE", default_value = "/handoff/relay")]
    pub event_source: String,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    /// Log format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

/// `-1` (no limit) or a positive byte count.
fn parse_max_bytes(s: &str) -> Result<i64, String> {
    match s.trim().parse::<i64>() {
        Ok(-1) => Ok(-1),
        Ok(n) if n > 0 => Ok(n),
        Ok(n) => Err(format!("{n}: use -1 (no limit) or a positive number of bytes")),
        Err(e) => Err(e.to_string()),
    }
}

/// JetStream stream replicas: 1 to 5.
fn parse_replicas(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n @ 1..=5) => Ok(n),
        Ok(n) => Err(format!("{n}: a stream has 1 to 5 replicas (3 in a cluster)")),
        Err(e) => Err(e.to_string()),
    }
}

impl RelayConfig {
    /// The stream settings these flags describe.
    pub fn stream_settings(&self) -> anyhow::Result<StreamSettings> {
        Ok(StreamSettings {
            name: self.stream.clone(),
            subjects: Subjects::new(self.subject_prefix.clone())?,
            duplicate_window: Duration::from_secs(self.duplicate_window_secs),
            max_age: Duration::from_secs(self.stream_max_age_secs),
            max_bytes: self.stream_max_bytes,
            replicas: self.stream_replicas,
            storage: if self.stream_memory { StorageType::Memory } else { StorageType::File },
        })
    }

    /// The signing key (read from its file), or `None` with --unsigned; neither is refused.
    pub fn signing_key(&self) -> anyhow::Result<Option<SigningKey>> {
        match &self.signing_key_file {
            Some(path) => {
                let key = SigningKey::read(path).context("--signing-key-file (HANDOFF_SIGNING_KEY_FILE)")?;
                Ok(Some(key))
            }
            None if self.unsigned => Ok(None),
            None => anyhow::bail!(
                "no signing key: set --signing-key-file (HANDOFF_SIGNING_KEY_FILE) to a key file \
                 (`handoff-admin keygen` writes one), or --unsigned (HANDOFF_UNSIGNED=true) while the \
                 consumers still run with --allow-unsigned"
            ),
        }
    }

    /// The relay settings these flags describe; fails when the signing key cannot be read.
    pub fn relay_settings(&self) -> anyhow::Result<RelaySettings> {
        Ok(RelaySettings {
            batch_size: self.batch_size,
            lease: Duration::from_secs_f64(self.lease_secs),
            poll_interval: Duration::from_millis(self.poll_ms),
            max_attempts: self.max_attempts,
            max_age: (self.max_age_secs > 0).then(|| Duration::from_secs(self.max_age_secs)),
            backoff: Backoff {
                initial: Duration::from_millis(self.backoff_initial_ms),
                max: Duration::from_secs(self.backoff_max_secs),
                ..Backoff::default()
            },
            workers: self.workers,
            source: self.event_source.clone(),
            held_back: Duration::from_secs_f64(self.held_back_secs),
            retention: (self.retention_secs > 0).then(|| Duration::from_secs(self.retention_secs)),
            stall_after: self.observe.stall_after(),
            sample_interval: self.observe.sample_interval(),
            migrate: self.migrate.mode,
            envelope_version: self.envelope_version,
            reconcile: (self.reconcile_interval_secs > 0).then(|| ReconcileSettings {
                interval: Duration::from_secs(self.reconcile_interval_secs),
                lookback: Duration::from_secs(self.reconcile_lookback_secs),
            }),
            signing: self.signing_key()?,
            publish_mode: self.publish_mode,
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        super::RelayConfig::command().debug_assert();
    }

    #[test]
    fn numbers_that_would_stall_or_panic_are_refused_naming_the_flag() {
        use clap::Parser;
        for (flag, value) in [
            ("--batch-size", "0"),
            ("--workers", "0"),
            ("--lease-secs", "-1"),
            ("--lease-secs", "NaN"),
            ("--lease-secs", "0"),
            ("--held-back-secs", "inf"),
            ("--poll-ms", "0"),
            ("--max-attempts", "0"),
            ("--stream-replicas", "7"),
            ("--stream-max-bytes", "0"),
            ("--duplicate-window-secs", "0"),
            ("--database-max-connections", "0"),
            ("--nats-connect-timeout-secs", "0"),
            ("--stall-after-secs", "0"),
        ] {
            let assignment = format!("{flag}={value}");
            let args = ["handoff-relay", "--database-url", "postgres://db/x", assignment.as_str()];
            let error = super::RelayConfig::try_parse_from(args).unwrap_err().to_string();
            assert!(error.contains(flag), "{flag} {value}: {error}");
        }
        let args = [
            "handoff-relay",
            "--database-url",
            "postgres://db/x",
            "--lease-secs",
            "2.5",
            "--stream-max-bytes",
            "-1",
            "--unsigned",
        ];
        let config = super::RelayConfig::try_parse_from(args).unwrap();
        assert_eq!(config.relay_settings().unwrap().lease, std::time::Duration::from_millis(2500));
    }

    #[test]
    fn a_signing_key_is_required_unless_unsigned_is_chosen() {
        use clap::Parser;
        let base = ["handoff-relay", "--database-url", "postgres://db/x"];
        let error = super::RelayConfig::try_parse_from(base).unwrap().relay_settings().unwrap_err();
        assert!(format!("{error:#}").contains("--signing-key-file (HANDOFF_SIGNING_KEY_FILE)"), "{error:#}");
        let missing = base.iter().chain(&["--signing-key-file", "/nonexistent/signing.key"]);
        let error = super::RelayConfig::try_parse_from(missing).unwrap().relay_settings().unwrap_err();
        let error = handoff_shared::logging::error_chain(error.as_ref());
        assert!(error.contains("--signing-key-file") && error.contains("/nonexistent/signing.key"), "{error}");
        let both = base.iter().chain(&["--signing-key-file", "k", "--unsigned"]);
        assert!(super::RelayConfig::try_parse_from(both).is_err(), "a key and --unsigned contradict each other");
    }
}
