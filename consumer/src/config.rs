//! Every setting of `handoff-consumer`, as a flag and an environment variable (`handoff-consumer --help`).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use handoff_shared::Backoff;
use handoff_shared::config::{
    DatabaseArgs, LogFormat, MigrateArgs, NatsArgs, ObserveArgs, RuntimeArgs, ServiceCommand,
};
use handoff_shared::observe::HttpAddr;
use handoff_shared::signing::SignaturePolicy;
use handoff_shared::subject::Subjects;

use crate::remote::dispatcher::{DispatchSettings, LEASE_MARGIN, MIN_HOLD};
use crate::remote::{Adapter, Capability, HttpSettings, NonExecution, RecordMapping, RemoteCrm};
use crate::subscription::ConsumerReplicas;
use crate::{ConsumerSettings, SubscriptionSettings};

/// JetStream's own default (1,000) lets only four replicas of 250 messages work at once; 10,000
/// leaves room for 20 replicas' batches of 500. A crashed replica's unacked messages come back
/// after `ack_wait` either way.
pub const DEFAULT_MAX_ACK_PENDING: i64 = 10_000;

/// Where a replica serves /metrics, /healthz and /readyz unless told otherwise (the relay's
/// default is the port below, so both run side by side on one host).
pub const DEFAULT_HTTP_ADDR: &str = "0.0.0.0:9186";

/// Turns approved actions from NATS JetStream into CRM tasks, once per operation key.
#[derive(Debug, clap::Parser)]
#[command(name = "handoff-consumer", version)]
pub struct ConsumerConfig {
    #[command(subcommand)]
    pub command: Option<ServiceCommand>,
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub migrate: MigrateArgs,
    #[command(flatten)]
    pub nats: NatsArgs,
    /// JetStream stream name (created by the relay).
    #[arg(long, env = "HANDOFF_STREAM", default_value = "HANDOFF")]
    pub stream: String,
    /// Subject prefix the relay publishes under.
    #[arg(long, env = "HANDOFF_SUBJECT_PREFIX", default_value = "handoff")]
    pub subject_prefix: String,
    /// Only consume this subject (default: everything under the prefix).
    #[arg(long, env = "HANDOFF_FILTER_SUBJECT")]
    pub filter_subject: Option<String>,
    /// Durable consumer name shared by all replicas.
    #[arg(long, env = "HANDOFF_CONSUMER_NAME", default_value = "handoff-crm")]
    pub consumer_name: String,
    /// Seconds without an ack before a message is redelivered.
    #[arg(long, env = "HANDOFF_ACK_WAIT_SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub ack_wait_secs: u64,
    /// Unacknowledged messages allowed across all replicas. Keep it at least replicas x batch
    /// size: beyond max_ack_pending / batch size, further replicas get nothing to do.
    #[arg(
        long,
        env = "HANDOFF_MAX_ACK_PENDING",
        default_value_t = DEFAULT_MAX_ACK_PENDING,
        value_parser = clap::value_parser!(i64).range(1..=10_000_000)
    )]
    pub max_ack_pending: i64,
    /// Servers that hold the durable consumer's state (1-5; default: as many as the stream). 1 on
    /// an R3 stream cuts the broker's work per message (by half at low load), but while that one
    /// server is down nothing is delivered (README, "JetStream settings that matter").
    #[arg(long, env = "HANDOFF_CONSUMER_REPLICAS", value_name = "N", value_parser = consumer_replicas)]
    pub consumer_replicas: Option<ConsumerReplicas>,
    /// Messages per transaction. A pull also stops at 4 MiB (or the server's max_payload if
    /// larger), so large payloads make smaller batches.
    #[arg(
        long,
        env = "HANDOFF_CONSUMER_BATCH_SIZE",
        default_value_t = crate::ConsumerSettings::DEFAULT_BATCH_SIZE,
        value_parser = handoff_shared::config::at_least_one
    )]
    pub batch_size: usize,
    /// Failed deliveries before a message is dead-lettered.
    #[arg(long, env = "HANDOFF_DEAD_LETTER_AFTER", default_value_t = 10, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    pub dead_letter_after: i64,
    /// Seconds to wait at startup for the relay to create the stream and, through timeouts (a
    /// cluster electing a leader), to create or update the durable consumer.
    #[arg(long, env = "HANDOFF_STREAM_WAIT_SECS", default_value_t = 60)]
    pub stream_wait_secs: u64,
    /// Address of the /metrics, /healthz and /readyz endpoint; empty turns it off. Give each
    /// replica on one host its own port.
    #[arg(long, env = "HANDOFF_HTTP_ADDR", default_value = DEFAULT_HTTP_ADDR)]
    pub http_addr: HttpAddr,
    #[command(flatten)]
    pub observe: ObserveArgs,
    #[command(flatten)]
    pub runtime: RuntimeArgs,
    /// Log format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Seconds before a message of a newer envelope version (from an upgraded relay) is offered
    /// again; it is held, never dead-lettered, until a replica that reads it takes it.
    #[arg(
        long,
        env = "HANDOFF_NEWER_VERSION_DELAY_SECS",
        default_value_t = crate::consumer::DEFAULT_NEWER_VERSION_DELAY.as_secs(),
        value_parser = clap::value_parser!(u64).range(1..=86_400)
    )]
    pub newer_version_delay_secs: u64,
    /// Files of the keys whose signatures are accepted, comma-separated (during a key rotation the
    /// old and the new). Required unless --allow-unsigned.
    #[arg(long, env = "HANDOFF_VERIFY_KEY_FILES", value_name = "FILES", value_delimiter = ',')]
    pub verify_key_files: Vec<PathBuf>,
    /// Also accept unsigned messages, only while the relays are moved to signing (signed messages
    /// are still verified); counted in handoff_consumer_unsigned_messages_total.
    #[arg(long, env = "HANDOFF_ALLOW_UNSIGNED", default_value_t = false)]
    pub allow_unsigned: bool,
    #[command(flatten)]
    pub crm: CrmArgs,
    /// With --crm http: verify and record intake (inbox and ledger rows) and acknowledge, but never
    /// call the CRM; the ledger rows wait for a replica without --dry-run.
    #[arg(long, env = "HANDOFF_DRY_RUN", default_value_t = false)]
    pub dry_run: bool,
}

fn consumer_replicas(value: &str) -> Result<ConsumerReplicas, String> {
    value
        .parse()
        .ok()
        .and_then(ConsumerReplicas::new)
        .ok_or_else(|| format!("{value:?} is not a replica count from 1 to {}", ConsumerReplicas::MAX))
}

/// Where tasks are created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CrmMode {
    /// The CRM store in the consumer's own database (tasks commit with the inbox row).
    Local,
    /// A remote CRM over HTTP, through the ledger and the dispatcher.
    Http,
}

/// What the remote CRM can prove (see `remote::Capability`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CapabilityArg {
    IdempotencyKey,
    ExternalId,
    QueryOnly,
    None,
}

/// Remote CRM settings (used with `--crm http`).
#[derive(Clone, clap::Args)]
pub struct CrmArgs {
    /// Where tasks are created.
    #[arg(
        id = "crm_mode",
        value_name = "MODE",
        long = "crm",
        env = "HANDOFF_CRM",
        value_enum,
        default_value = "local"
    )]
    pub mode: CrmMode,
    /// Base URL of the remote CRM.
    #[arg(
        id = "crm_url",
        value_name = "URL",
        long = "crm-url",
        env = "HANDOFF_CRM_URL",
        required_if_eq("crm_mode", "http")
    )]
    pub url: Option<String>,
    /// Bearer token for the remote CRM (secret).
    #[arg(
        id = "crm_token",
        value_name = "TOKEN",
        long = "crm-token",
        env = "HANDOFF_CRM_TOKEN",
        hide_env_values = true,
        default_value = ""
    )]
    pub token: String,
    /// The destination account (evidence in every decision; part of the ledger's unique key).
    #[arg(
        id = "crm_account",
        value_name = "ACCOUNT",
        long = "crm-account",
        env = "HANDOFF_CRM_ACCOUNT",
        default_value = "default"
    )]
    pub account: String,
    /// Which API shape the remote CRM speaks (the adapter).
    #[arg(
        id = "crm_adapter",
        value_name = "ADAPTER",
        long = "crm-adapter",
        env = "HANDOFF_CRM_ADAPTER",
        value_enum,
        default_value = "tasks-api"
    )]
    pub adapter: Adapter,
    /// Which answers prove the CRM did not execute a create, comma-separated: `connect-failure`
    /// and HTTP statuses the CRM documents as refused before any work (e.g. 429,503), or `none`.
    /// Anything else is unknown and read back first; behind a gateway a 503 proves nothing.
    #[arg(
        long = "crm-not-executed",
        env = "HANDOFF_CRM_NOT_EXECUTED",
        value_name = "RULE",
        default_value = "connect-failure"
    )]
    pub not_executed: NonExecution,
    /// The object (record type) the upsert and unique-property adapters create; default per
    /// adapter: `Task` (upsert), `tasks` (unique-property).
    #[arg(long = "crm-object", env = "HANDOFF_CRM_OBJECT", value_name = "OBJECT")]
    pub object: Option<String>,
    /// The field holding the operation key: the external id field (upsert, default
    /// `Handoff_Key__c`) or the unique property (unique-property, default `handoff_key`).
    #[arg(long = "crm-key-field", env = "HANDOFF_CRM_KEY_FIELD", value_name = "FIELD")]
    pub key_field: Option<String>,
    /// The field holding the payload hash, write-once at the destination (default
    /// `Handoff_Payload_Hash__c` for upsert, `handoff_hash` for unique-property).
    #[arg(long = "crm-hash-field", env = "HANDOFF_CRM_HASH_FIELD", value_name = "FIELD")]
    pub hash_field: Option<String>,
    /// Record fields from the payload, comma-separated `RecordField=payload_field` (e.g.
    /// `Subject=title,Description=notes`); empty: the payload's top-level fields as they are.
    #[arg(long = "crm-field-map", env = "HANDOFF_CRM_FIELD_MAP", value_name = "MAP", default_value = "")]
    pub field_map: String,
    /// What the CRM offers to prove an outcome: decides how unknown outcomes are resolved.
    #[arg(
        id = "crm_capability",
        value_name = "CAPABILITY",
        long = "crm-capability",
        env = "HANDOFF_CRM_CAPABILITY",
        value_enum,
        default_value = "external-id"
    )]
    pub capability: CapabilityArg,
    /// How long the CRM keeps idempotency keys (its documented retention), seconds.
    #[arg(long = "crm-key-retention-secs", env = "HANDOFF_CRM_KEY_RETENTION_SECS", default_value_t = 86_400)]
    pub key_retention_secs: u64,
    /// How far the CRM's search may lag behind writes, seconds (query-only capability).
    #[arg(long = "crm-query-freshness-secs", env = "HANDOFF_CRM_QUERY_FRESHNESS_SECS", default_value_t = 30)]
    pub query_freshness_secs: u64,
    /// Whole-request timeout, milliseconds; past it an outcome is unknown.
    #[arg(
        long = "crm-timeout-ms",
        env = "HANDOFF_CRM_TIMEOUT_MS",
        default_value_t = 10_000,
        value_parser = clap::value_parser!(u64).range(1..=3_600_000)
    )]
    pub timeout_ms: u64,
    /// CRM calls in flight per replica.
    #[arg(
        long = "crm-in-flight",
        env = "HANDOFF_CRM_IN_FLIGHT",
        default_value_t = 16,
        value_parser = clap::value_parser!(i64).range(1..=4096)
    )]
    pub in_flight: i64,
    /// Rows each replica claims ahead of a free call slot, so the next call starts as soon as one
    /// ends; by default as many as --crm-in-flight (none when the lease leaves under 1 s to wait),
    /// 0 turns it off.
    #[arg(
        long = "crm-claim-ahead",
        env = "HANDOFF_CRM_CLAIM_AHEAD",
        value_parser = clap::value_parser!(i64).range(0..=4096)
    )]
    pub claim_ahead: Option<i64>,
    /// Create attempts before an action goes to review.
    #[arg(
        long = "crm-max-attempts",
        env = "HANDOFF_CRM_MAX_ATTEMPTS",
        default_value_t = 5,
        value_parser = clap::value_parser!(i32).range(1..=1000)
    )]
    pub max_attempts: i32,
    /// Delay between readbacks of an unknown outcome, milliseconds.
    #[arg(
        long = "crm-readback-interval-ms",
        env = "HANDOFF_CRM_READBACK_INTERVAL_MS",
        default_value_t = 1000,
        value_parser = clap::value_parser!(u64).range(1..=3_600_000)
    )]
    pub readback_interval_ms: u64,
    /// How long readback may be unavailable before review, seconds.
    #[arg(long = "crm-readback-window-secs", env = "HANDOFF_CRM_READBACK_WINDOW_SECS", default_value_t = 300)]
    pub readback_window_secs: u64,
    /// Lease on a ledger row while a replica calls the CRM, seconds (longer than the timeout).
    #[arg(
        long = "crm-lease-secs",
        env = "HANDOFF_CRM_LEASE_SECS",
        default_value_t = 60.0,
        value_parser = handoff_shared::config::positive_seconds
    )]
    pub lease_secs: f64,
}

impl std::fmt::Debug for CrmArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CrmArgs")
            .field("mode", &self.mode)
            .field("url", &self.url.as_deref().map(handoff_shared::config::redact_url))
            .field("token", &"<redacted>")
            .field("account", &self.account)
            .field("adapter", &self.adapter)
            .field("capability", &self.capability)
            .field("not_executed", &self.not_executed.to_string())
            .field("timeout_ms", &self.timeout_ms)
            .field("in_flight", &self.in_flight)
            .finish_non_exhaustive()
    }
}

impl CrmArgs {
    /// What the destination can prove with: declared by --crm-capability for `tasks-api`; the
    /// adapter's own for the others (upsert: external-id; unique-property: query-only with
    /// --crm-query-freshness-secs).
    pub fn capability(&self) -> Capability {
        match self.adapter {
            Adapter::TasksApi => self.declared_capability(),
            Adapter::Upsert => Capability::ExternalId,
            Adapter::UniqueProperty => {
                Capability::QueryOnly { freshness: Duration::from_secs(self.query_freshness_secs) }
            }
        }
    }

    /// The record mapping of the adapters with records, defaults per adapter.
    pub fn mapping(&self) -> anyhow::Result<RecordMapping> {
        let defaults = self.adapter.default_mapping();
        let fields = RecordMapping::parse_fields(&self.field_map)
            .map_err(|e| anyhow::anyhow!("--crm-field-map (HANDOFF_CRM_FIELD_MAP): {e}"))?;
        let mapping = RecordMapping {
            object: self.object.clone().unwrap_or(defaults.object),
            key_field: self.key_field.clone().unwrap_or(defaults.key_field),
            hash_field: self.hash_field.clone().unwrap_or(defaults.hash_field),
            fields,
        };
        for (flag, value) in [
            ("--crm-object (HANDOFF_CRM_OBJECT)", &mapping.object),
            ("--crm-key-field (HANDOFF_CRM_KEY_FIELD)", &mapping.key_field),
            ("--crm-hash-field (HANDOFF_CRM_HASH_FIELD)", &mapping.hash_field),
        ] {
            anyhow::ensure!(!value.trim().is_empty(), "{flag} must not be empty");
        }
        anyhow::ensure!(
            mapping.key_field != mapping.hash_field,
            "--crm-key-field and --crm-hash-field must name different fields"
        );
        if let Some((field, _)) =
            mapping.fields.iter().find(|(f, _)| *f == mapping.key_field || *f == mapping.hash_field)
        {
            anyhow::bail!("--crm-field-map (HANDOFF_CRM_FIELD_MAP) maps {field:?}, the key or hash field");
        }
        Ok(mapping)
    }

    /// The capability --crm-capability declares.
    fn declared_capability(&self) -> Capability {
        match self.capability {
            CapabilityArg::IdempotencyKey => {
                Capability::IdempotencyKey { retention: Duration::from_secs(self.key_retention_secs) }
            }
            CapabilityArg::ExternalId => Capability::ExternalId,
            CapabilityArg::QueryOnly => {
                Capability::QueryOnly { freshness: Duration::from_secs(self.query_freshness_secs) }
            }
            CapabilityArg::None => Capability::Nothing,
        }
    }

    /// The adapter these flags describe, ready to call the CRM.
    pub fn connect(&self) -> anyhow::Result<std::sync::Arc<dyn RemoteCrm>> {
        crate::remote::connect(self.adapter, self.http_settings()?, self.capability(), self.mapping()?)
    }

    /// The HTTP settings these flags describe.
    pub fn http_settings(&self) -> anyhow::Result<HttpSettings> {
        let timeout = Duration::from_millis(self.timeout_ms);
        // The lease covers the claim, the call and recording the decision: the timeout plus margin.
        anyhow::ensure!(
            self.lease_secs.is_finite() && self.lease_secs >= (timeout + LEASE_MARGIN).as_secs_f64(),
            "--crm-lease-secs must be at least --crm-timeout-ms plus {}s, or a live call could be taken over",
            LEASE_MARGIN.as_secs()
        );
        let settings = self.dispatch_settings();
        if self.claim_ahead.is_some_and(|n| n > 0) {
            anyhow::ensure!(
                settings.hold_limit() >= MIN_HOLD,
                "--crm-claim-ahead needs --crm-lease-secs at least --crm-timeout-ms plus {}s: a row claimed ahead \
                 must be able to wait for a slot and still end its call within the lease (set it to 0, or lengthen the lease)",
                (LEASE_MARGIN + MIN_HOLD).as_secs()
            );
        }
        Ok(HttpSettings {
            base_url: self.url.clone().ok_or_else(|| anyhow::anyhow!("--crm-url is required with --crm http"))?,
            token: self.token.clone(),
            account: self.account.clone(),
            timeout,
            connect_timeout: timeout.min(Duration::from_secs(5)),
            not_executed: self.not_executed.clone(),
        })
    }

    /// The dispatcher settings these flags describe.
    pub fn dispatch_settings(&self) -> DispatchSettings {
        DispatchSettings {
            in_flight: self.in_flight,
            claim_ahead: self.claim_ahead.unwrap_or(self.in_flight),
            lease: Duration::from_secs_f64(self.lease_secs),
            call_timeout: Duration::from_millis(self.timeout_ms),
            max_attempts: self.max_attempts,
            readback_interval: Duration::from_millis(self.readback_interval_ms),
            readback_window: Duration::from_secs(self.readback_window_secs),
            // An abandoned request may still commit until the CRM times it out: at least our timeout.
            absence_grace: Duration::from_millis(self.timeout_ms),
            ..DispatchSettings::default()
        }
    }
}

impl ConsumerConfig {
    /// Settings that are valid one by one but not together, refused before anything starts.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            !self.dry_run || self.crm.mode == CrmMode::Http,
            "--dry-run (HANDOFF_DRY_RUN) needs --crm http: with the local CRM, recording intake is creating the task"
        );
        if self.crm.mode == CrmMode::Http {
            // Before any connection is made: the URL, the lease against the timeout, the mapping.
            self.crm.http_settings()?;
            self.crm.mapping()?;
        }
        Ok(())
    }

    /// The durable consumer these flags describe.
    pub fn subscription(&self) -> anyhow::Result<SubscriptionSettings> {
        let subjects = Subjects::new(self.subject_prefix.clone())?;
        Ok(SubscriptionSettings {
            stream: self.stream.clone(),
            subjects: subjects.clone(),
            durable_name: self.consumer_name.clone(),
            filter_subject: self.filter_subject.clone().unwrap_or_else(|| subjects.all()),
            ack_wait: Duration::from_secs(self.ack_wait_secs),
            max_ack_pending: self.max_ack_pending,
            stream_wait: Duration::from_secs(self.stream_wait_secs),
            replicas: self.consumer_replicas,
        })
    }

    /// The signature policy: the verify keys read from their files, and whether unsigned
    /// messages are accepted. Neither keys nor --allow-unsigned is refused.
    pub fn signatures(&self) -> anyhow::Result<SignaturePolicy> {
        let files: Vec<PathBuf> = self.verify_key_files.iter().filter(|p| !p.as_os_str().is_empty()).cloned().collect();
        anyhow::ensure!(
            !files.is_empty() || self.allow_unsigned,
            "no verify key: set --verify-key-files (HANDOFF_VERIFY_KEY_FILES) to the key files of the relays' \
             signing keys (`handoff-admin keygen` writes them), or --allow-unsigned (HANDOFF_ALLOW_UNSIGNED=true) \
             while relays still publish unsigned messages"
        );
        SignaturePolicy::read(&files, self.allow_unsigned).context("--verify-key-files (HANDOFF_VERIFY_KEY_FILES)")
    }

    /// The processing settings these flags describe; fails when a verify key cannot be read.
    pub fn settings(&self) -> anyhow::Result<ConsumerSettings> {
        Ok(ConsumerSettings {
            batch_size: self.batch_size,
            dead_letter_after: self.dead_letter_after,
            backoff: Backoff {
                initial: Duration::from_millis(500),
                max: Duration::from_secs(60),
                ..Backoff::default()
            },
            stall_after: self.observe.stall_after(),
            sample_interval: self.observe.sample_interval(),
            migrate: self.migrate.mode,
            newer_version_delay: Duration::from_secs(self.newer_version_delay_secs),
            signatures: self.signatures()?,
            ..ConsumerSettings::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        ConsumerConfig::command().debug_assert();
    }

    #[test]
    fn numbers_that_would_stall_or_panic_are_refused_naming_the_flag() {
        for (flag, value) in [
            ("--batch-size", "0"),
            ("--crm-in-flight", "0"),
            ("--crm-lease-secs", "-3"),
            ("--crm-lease-secs", "NaN"),
            ("--max-ack-pending", "0"),
            ("--dead-letter-after", "0"),
            ("--ack-wait-secs", "0"),
            ("--crm-timeout-ms", "0"),
            ("--crm-max-attempts", "0"),
        ] {
            let assignment = format!("{flag}={value}");
            let args = ["handoff-consumer", "--database-url", "postgres://db/x", assignment.as_str()];
            let error = ConsumerConfig::try_parse_from(args).unwrap_err().to_string();
            assert!(error.contains(flag), "{flag} {value}: {error}");
        }
    }

    #[test]
    fn verify_keys_are_required_unless_unsigned_messages_are_allowed() {
        let base = ["handoff-consumer", "--database-url", "postgres://db/x"];
        let error = ConsumerConfig::try_parse_from(base).unwrap().settings().unwrap_err();
        assert!(format!("{error:#}").contains("--verify-key-files (HANDOFF_VERIFY_KEY_FILES)"), "{error:#}");
        let missing = base.iter().chain(&["--verify-key-files", "/nonexistent/a.key,/nonexistent/b.key"]);
        let error = ConsumerConfig::try_parse_from(missing).unwrap().settings().unwrap_err();
        let error = handoff_shared::logging::error_chain(error.as_ref());
        assert!(error.contains("--verify-key-files") && error.contains("/nonexistent/a.key"), "{error}");
        let migrating = ConsumerConfig::try_parse_from(base.iter().chain(&["--allow-unsigned"])).unwrap();
        assert!(migrating.settings().unwrap().signatures.allows_unsigned());
    }

    #[test]
    fn http_mode_needs_a_url_and_a_lease_longer_than_the_timeout() {
        let base = ["handoff-consumer", "--database-url", "postgres://db/x"];
        assert!(ConsumerConfig::try_parse_from(base.iter().chain(&["--crm", "http"])).is_err());
        let config =
            ConsumerConfig::try_parse_from(base.iter().chain(&["--crm", "http", "--crm-url", "http://crm"])).unwrap();
        assert_eq!(config.crm.capability(), Capability::ExternalId);
        assert!(config.crm.http_settings().is_ok());
        let config = ConsumerConfig::try_parse_from(base.iter().chain(&[
            "--crm",
            "http",
            "--crm-url",
            "http://crm",
            "--crm-timeout-ms",
            "90000",
        ]))
        .unwrap();
        assert!(config.crm.http_settings().is_err());
    }

    #[test]
    fn claim_ahead_defaults_to_the_calls_in_flight_and_needs_a_lease_with_room_to_wait() {
        let base =
            ["handoff-consumer", "--database-url", "postgres://db/x", "--crm", "http", "--crm-url", "http://crm"];
        let parse = |extra: &[&str]| ConsumerConfig::try_parse_from(base.iter().chain(extra)).unwrap().crm;
        // Default: lease 60 s, timeout 10 s: a held row may wait 45 s.
        let crm = parse(&["--crm-in-flight", "8"]);
        assert!(crm.http_settings().is_ok());
        let settings = crm.dispatch_settings();
        assert_eq!((settings.claim_ahead, settings.effective_claim_ahead()), (8, 8));
        assert_eq!(settings.hold_limit(), Duration::from_secs(45));
        // The shortest lease allowed leaves no time to wait: claiming ahead turns itself off...
        let crm = parse(&["--crm-lease-secs", "15"]);
        assert!(crm.http_settings().is_ok());
        assert_eq!(crm.dispatch_settings().effective_claim_ahead(), 0);
        // ...and asking for it explicitly with such a lease is refused, naming both settings.
        let error = parse(&["--crm-lease-secs", "15", "--crm-claim-ahead", "4"]).http_settings().unwrap_err();
        assert!(error.to_string().contains("--crm-claim-ahead needs --crm-lease-secs"), "{error}");
        assert!(parse(&["--crm-lease-secs", "15", "--crm-claim-ahead", "0"]).http_settings().is_ok());
        assert_eq!(parse(&["--crm-claim-ahead", "0"]).dispatch_settings().effective_claim_ahead(), 0);
    }

    #[test]
    fn adapter_settings_are_checked_at_startup_naming_the_setting() {
        let base =
            ["handoff-consumer", "--database-url", "postgres://db/x", "--crm", "http", "--crm-url", "http://crm"];
        let parse = |extra: &[&str]| ConsumerConfig::try_parse_from(base.iter().chain(extra)).map(|c| c.crm);
        let error = parse(&["--crm-not-executed", "connect-failure,409"]).err().unwrap().to_string();
        assert!(error.contains("--crm-not-executed") && error.contains("409"), "{error}");
        let error = parse(&["--crm-adapter", "upsert", "--crm-field-map", "Subject"]).unwrap().connect().unwrap_err();
        assert!(format!("{error:#}").contains("--crm-field-map (HANDOFF_CRM_FIELD_MAP)"), "{error:#}");
        let error = parse(&["--crm-adapter", "upsert", "--crm-hash-field", "K", "--crm-key-field", "K"])
            .unwrap()
            .mapping()
            .unwrap_err();
        assert!(format!("{error:#}").contains("--crm-key-field and --crm-hash-field"), "{error:#}");
        // Each adapter proves with its own capability; --crm-capability is for tasks-api.
        let upsert = parse(&["--crm-adapter", "upsert", "--crm-capability", "none"]).unwrap();
        assert_eq!(upsert.capability(), Capability::ExternalId);
        assert_eq!(upsert.mapping().unwrap().object, "Task");
        let unique = parse(&["--crm-adapter", "unique-property", "--crm-query-freshness-secs", "7"]).unwrap();
        assert_eq!(unique.capability(), Capability::QueryOnly { freshness: Duration::from_secs(7) });
        assert!(unique.connect().is_ok());
    }
}
