//! The broker side of the relay: the stream's configuration and pipelined publishing.
//!
//! Every message carries `Nats-Msg-Id` = operation key, so a re-publish inside the stream's
//! `duplicate_window` is answered with the original sequence and `duplicate: true` instead of being
//! stored twice. That is an optimisation; the consumer's unique index is the guarantee (broker dedup
//! forgets ids after the window and, for acked messages, after a restart; see platform notes).

use std::time::Duration;

use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::stream::{self, DiscardPolicy, RetentionPolicy, StorageType};
use bytes::Bytes;
use futures::future::join_all;
use handoff_shared::{Subjects, headers};

/// The stream's settings. Limits retention with `DiscardPolicy::New`: a full stream refuses new
/// messages (the relay backs off and keeps the rows) instead of silently dropping old ones.
#[derive(Debug, Clone)]
pub struct StreamSettings {
    pub name: String,
    pub subjects: Subjects,
    pub duplicate_window: Duration,
    /// How long messages are kept (0 = forever). Must be >= duplicate_window.
    pub max_age: Duration,
    /// Stream size limit in bytes (-1 = unlimited).
    pub max_bytes: i64,
    pub replicas: usize,
    pub storage: StorageType,
}

/// Why the stream could not be provisioned.
#[derive(Debug, thiserror::Error)]
pub enum StreamSetupError {
    #[error("cannot read stream {name}")]
    Info {
        name: String,
        #[source]
        source: async_nats::jetstream::context::GetStreamError,
    },
    #[error("cannot create stream {name}")]
    Create {
        name: String,
        #[source]
        source: async_nats::jetstream::context::CreateStreamError,
    },
    #[error("cannot update stream {name} (changing {changes})")]
    Update {
        name: String,
        changes: String,
        #[source]
        source: async_nats::jetstream::context::UpdateStreamError,
    },
    /// A setting JetStream cannot change on an existing stream differs from what handoff needs.
    #[error(
        "stream {name} has {setting} {found}, handoff needs {wanted}, and JetStream cannot change it on an \
         existing stream: {hint}"
    )]
    Immutable { name: String, setting: &'static str, found: String, wanted: String, hint: &'static str },
}

/// A setting of an existing stream that differed from handoff's and was changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Drift {
    pub setting: &'static str,
    pub was: String,
    pub now: String,
}

/// The stream configuration handoff wants, for a new stream (`atomic`: allowing atomic batches).
fn wanted(settings: &StreamSettings, atomic: bool) -> stream::Config {
    stream::Config {
        name: settings.name.clone(),
        subjects: vec![settings.subjects.all()],
        retention: RetentionPolicy::Limits,
        discard: DiscardPolicy::New,
        storage: settings.storage,
        duplicate_window: settings.duplicate_window,
        max_age: settings.max_age,
        max_bytes: settings.max_bytes,
        num_replicas: settings.replicas,
        allow_atomic_publish: atomic,
        ..Default::default()
    }
}

/// `existing` with only the settings handoff owns changed to `settings`, and what changed. Every
/// other setting (description, other subjects, per-subject limits, direct get, placement, ...) is
/// the operator's and stays as it is. `atomic` turns atomic batches on (never off: another relay
/// or the operator may use them). Fails on a difference JetStream cannot apply in place.
pub fn reconcile_config(
    existing: &stream::Config,
    settings: &StreamSettings,
    atomic: bool,
) -> Result<(stream::Config, Vec<Drift>), StreamSetupError> {
    let immutable = |setting, found: String, wanted: String, hint| StreamSetupError::Immutable {
        name: settings.name.clone(),
        setting,
        found,
        wanted,
        hint,
    };
    if existing.storage != settings.storage {
        return Err(immutable(
            "storage",
            format!("{:?}", existing.storage),
            format!("{:?}", settings.storage),
            "set HANDOFF_STREAM_MEMORY to match it, or drain the stream, back it up and recreate it",
        ));
    }
    if existing.retention != RetentionPolicy::Limits {
        return Err(immutable(
            "retention",
            format!("{:?}", existing.retention),
            "Limits".into(),
            "handoff needs Limits retention (messages stay until their age or size limit, for reconcile and \
             re-publishing); use another stream name (HANDOFF_STREAM)",
        ));
    }
    let mut config = existing.clone();
    let mut drift = Vec::new();
    let mut note = |setting: &'static str, was: String, now: String| {
        if was != now {
            drift.push(Drift { setting, was, now });
        }
    };
    let subject = settings.subjects.all();
    if !config.subjects.contains(&subject) {
        note("subjects", format!("{:?}", config.subjects), format!("{:?} and {subject}", config.subjects));
        config.subjects.push(subject);
    }
    note("discard", format!("{:?}", config.discard), format!("{:?}", DiscardPolicy::New));
    config.discard = DiscardPolicy::New;
    note("duplicate_window", format!("{:?}", config.duplicate_window), format!("{:?}", settings.duplicate_window));
    config.duplicate_window = settings.duplicate_window;
    note("max_age", format!("{:?}", config.max_age), format!("{:?}", settings.max_age));
    config.max_age = settings.max_age;
    note("max_bytes", config.max_bytes.to_string(), settings.max_bytes.to_string());
    config.max_bytes = settings.max_bytes;
    note("num_replicas", config.num_replicas.to_string(), settings.replicas.to_string());
    config.num_replicas = settings.replicas;
    if atomic && !config.allow_atomic_publish {
        note("allow_atomic", "false".into(), "true".into());
        config.allow_atomic_publish = true;
    }
    Ok((config, drift))
}

/// Creates the stream, or brings the settings handoff owns on an existing one to `settings`
/// (logging each change as drift) without touching any other setting; a difference JetStream
/// cannot change in place fails with what to do.
pub async fn ensure_stream(
    js: &async_nats::jetstream::Context,
    settings: &StreamSettings,
    atomic: bool,
) -> Result<stream::Info, StreamSetupError> {
    use async_nats::jetstream::ErrorCode;
    use async_nats::jetstream::context::GetStreamErrorKind;
    let name = settings.name.clone();
    let existing = match js.get_stream(&settings.name).await {
        Ok(stream) => stream.cached_info().clone(),
        Err(error) if matches!(error.kind(), GetStreamErrorKind::JetStream(e) if e.error_code() == ErrorCode::STREAM_NOT_FOUND) =>
        {
            let created = js
                .create_stream(wanted(settings, atomic))
                .await
                .map_err(|source| StreamSetupError::Create { name: name.clone(), source })?;
            tracing::info!(stream = %name, "created the stream");
            return Ok(created.cached_info().clone());
        }
        Err(source) => return Err(StreamSetupError::Info { name, source }),
    };
    let (config, drift) = reconcile_config(&existing.config, settings, atomic)?;
    if drift.is_empty() {
        return Ok(existing);
    }
    for d in &drift {
        tracing::warn!(stream = %name, setting = d.setting, was = %d.was, now = %d.now, "stream setting drifted; set back to the relay's");
    }
    let changes = drift.iter().map(|d| d.setting).collect::<Vec<_>>().join(", ");
    js.update_stream(&config).await.map_err(|source| StreamSetupError::Update { name, changes, source })
}

impl StreamSetupError {
    /// The broker did not answer in time or has no JetStream leader yet (a cluster electing one,
    /// a node starting, a moment of overload): the same request may succeed in a moment. A
    /// setting the relay refuses, or an answer JetStream gave, is not transient.
    pub fn is_transient(&self) -> bool {
        use async_nats::jetstream::context::{CreateStreamErrorKind, GetStreamErrorKind};
        match self {
            Self::Info { source, .. } => matches!(source.kind(), GetStreamErrorKind::Request),
            Self::Create { source, .. } | Self::Update { source, .. } => {
                matches!(source.kind(), CreateStreamErrorKind::TimedOut | CreateStreamErrorKind::JetStreamUnavailable)
            }
            _ => false,
        }
    }
}

/// How long [`ensure_stream_patiently`] keeps trying through transient errors.
pub const STREAM_SETUP_PATIENCE: Duration = Duration::from_secs(60);

/// The delays between stream setup attempts: 250 ms doubling to 2 s, half jittered, so relays
/// started together do not ask in lock-step.
const STREAM_SETUP_BACKOFF: handoff_shared::Backoff = handoff_shared::Backoff {
    initial: Duration::from_millis(250),
    max: Duration::from_secs(2),
    multiplier: 2.0,
    jitter: 0.5,
};

/// [`ensure_stream`], tried again ([`STREAM_SETUP_BACKOFF`]) through transient errors
/// ([`StreamSetupError::is_transient`]) for up to `patience`: relays started together against a
/// cluster that is still electing its leaders wait for it instead of exiting. Each retry is
/// logged with its cause; the last error is returned when patience runs out.
pub async fn ensure_stream_patiently(
    js: &async_nats::jetstream::Context,
    settings: &StreamSettings,
    atomic: bool,
    patience: Duration,
) -> Result<stream::Info, StreamSetupError> {
    STREAM_SETUP_BACKOFF
        .retry_until(
            tokio::time::Instant::now() + patience,
            || ensure_stream(js, settings, atomic),
            StreamSetupError::is_transient,
            |error, pause| {
                tracing::warn!(stream = %settings.name, error = %handoff_shared::logging::error_chain(error),
                    retry_in_ms = pause.as_millis() as u64, "stream setup failed; trying again");
            },
        )
        .await
}

/// How the relay publishes a claimed batch (`--publish-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum PublishMode {
    /// Every message its own JetStream publish, all in flight at once: per-message dedup (a
    /// re-publish answers `duplicate: true`); with `sync_interval: always` on R1 one fsync each.
    Pipelined,
    /// Atomic batches (ADR-50): up to [`ATOMIC_BATCH_LIMIT`] messages committed together with a
    /// few fsyncs. A batch holding an id the broker already knows is rejected whole (10201) and is
    /// then published pipelined, so old rows report duplicates and new ones are stored.
    Atomic,
    /// On a server of 2.15 or later (where a batch commits with a few fsyncs) whose stream allows
    /// atomic batches, each claim goes the way this relay has timed faster, claims of fewer than
    /// 100 rows (low load) and larger ones apart ([`crate::auto_mode`]): pipelined on a broker that
    /// stores a message in microseconds, atomic where every pipelined message waits for an fsync
    /// (`sync_interval: always`). Elsewhere pipelined (one warning).
    #[default]
    Auto,
}

/// Messages per atomic batch: the server's limit.
pub const ATOMIC_BATCH_LIMIT: usize = 1_000;
/// The oldest server with atomic batch publishing (ADR-50). 2.15 commits a batch with a few
/// fsyncs instead of one per message (nats-server PR 8539); earlier ones are correct but slower.
pub const ATOMIC_SERVER_VERSION: (u64, u64) = (2, 12);
/// "Atomic batch publish has duplicate message id": some message of the batch was already stored.
pub const ERR_BATCH_DUPLICATE: ErrorCode = ErrorCode(10201);

/// The `major.minor` of a server version string (`2.15.1`, `2.12.0-beta.1`).
pub fn server_version(version: &str) -> Option<(u64, u64)> {
    let mut parts = version.trim_start_matches('v').split(['.', '-']);
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// The oldest server `auto` publishes atomic batches to: 2.15 coalesces a batch's fsyncs.
pub const AUTO_ATOMIC_SERVER_VERSION: (u64, u64) = (2, 15);

/// Whether a server of `version` publishes atomic batches.
pub fn supports_atomic(version: &str) -> bool {
    server_version(version).is_some_and(|v| v >= ATOMIC_SERVER_VERSION)
}

/// Whether `auto` uses atomic batches on a server of `version`.
pub fn prefers_atomic(version: &str) -> bool {
    server_version(version).is_some_and(|v| v >= AUTO_ATOMIC_SERVER_VERSION)
}

/// One message to publish.
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub subject: String,
    pub key: String,
    pub body: Bytes,
}

/// Is a publish failure worth retrying with the same message id?
///
/// Timeouts, broken connections, "no responders" during leader elections (`StreamNotFound`) and a
/// full stream all clear up by themselves. An oversized message never will.
pub fn is_permanent(error: &PublishError) -> bool {
    matches!(error.kind(), PublishErrorKind::MaxPayloadExceeded)
}

/// "Duplicate message id is in process" (10158): on a replicated stream, a publish whose id the
/// leader is still replicating for an earlier publish (a retry racing its original). Retried with
/// the same id: once the original is stored, the retry answers `duplicate: true` with its sequence.
pub const ERR_ID_IN_PROCESS: ErrorCode = ErrorCode(10158);

/// Whether JetStream answered a publish with error `code`.
fn answered(error: &PublishError, code: ErrorCode) -> bool {
    std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<async_nats::jetstream::Error>())
        .is_some_and(|e| e.error_code() == code)
}

/// Whether a publish raced an earlier one of the same id still being replicated (10158).
pub fn is_id_in_process(error: &PublishError) -> bool {
    answered(error, ERR_ID_IN_PROCESS)
}

/// Every value [`failure_class`] returns.
pub const FAILURE_CLASSES: [&str; 7] =
    ["timeout", "no_responders", "connection", "max_payload", "client_backpressure", "in_process", "other"];

/// The `class` label of a failed publish in `handoff_relay_publish_failures_total`.
pub fn failure_class(error: &PublishError) -> &'static str {
    match error.kind() {
        PublishErrorKind::TimedOut => "timeout",
        // "No responders": the stream has no leader right now (elections, restarts).
        PublishErrorKind::StreamNotFound => "no_responders",
        PublishErrorKind::BrokenPipe => "connection",
        PublishErrorKind::MaxPayloadExceeded => "max_payload",
        PublishErrorKind::MaxAckPending => "client_backpressure",
        _ if is_id_in_process(error) => "in_process",
        _ => "other",
    }
}

/// Publishes `messages` as atomic batches of at most [`ATOMIC_BATCH_LIMIT`], all batches in flight
/// at once: messages 1..n-1 of a batch go out as core publishes with the batch headers (no reply),
/// the commit as a JetStream publish whose PubAck carries the batch's last sequence and count;
/// each message's sequence follows from them (a batch is stored contiguously). A batch rejected
/// because one of its ids is already stored (10201) is published again pipelined, message by
/// message, so the known ones answer `duplicate: true` and the new ones are stored. Any other
/// failure fails every message of that batch alike (it may or may not have been committed; the
/// retry settles it the same way). Results come back in input order. The core publishes go out on
/// `js`'s own connection, so they reach the server before their commit.
pub async fn publish_atomic(
    js: &async_nats::jetstream::Context,
    batch_prefix: &str,
    messages: Vec<Outgoing>,
) -> AtomicOutcome {
    let mut outcome = AtomicOutcome { results: Vec::with_capacity(messages.len()), committed: 0, fallbacks: 0 };
    let mut numbered = messages.chunks(ATOMIC_BATCH_LIMIT).enumerate().peekable();
    while numbered.peek().is_some() {
        let window: Vec<(usize, &[Outgoing])> = numbered.by_ref().take(ATOMIC_IN_FLIGHT).collect();
        settle_window(js, batch_prefix, window, &mut outcome).await;
    }
    outcome
}

/// What [`publish_atomic`] did.
#[derive(Debug)]
pub struct AtomicOutcome {
    /// One result per message, in input order.
    pub results: Vec<Result<PublishAck, PublishError>>,
    /// Atomic batches committed.
    pub committed: u64,
    /// Batches refused for a stored id (10201) and published per message instead.
    pub fallbacks: u64,
}

/// Atomic batches one relay worker keeps open at once: a stream allows 50 open batches (all
/// relays and workers together), and a claim of the default 1,000 rows is one batch.
pub const ATOMIC_IN_FLIGHT: usize = 4;

/// Sends the batches of `window`, then awaits their commits, appending one result per message.
async fn settle_window(
    js: &async_nats::jetstream::Context,
    batch_prefix: &str,
    window: Vec<(usize, &[Outgoing])>,
    into: &mut AtomicOutcome,
) {
    let mut commits = Vec::with_capacity(window.len());
    for &(i, chunk) in &window {
        commits.push(send_batch(js, &format!("{batch_prefix}-{i}"), chunk).await);
    }
    for ((_, chunk), commit) in window.into_iter().zip(commits) {
        let answer = match commit {
            Ok(ack) => ack.await,
            Err(error) => Err(error),
        };
        let results = &mut into.results;
        match answer {
            Ok(ack) => {
                let count = chunk.len() as u64;
                if ack.batch_size != Some(count) || ack.sequence < count {
                    // Not what a committed batch answers (a server that ignored the batch headers,
                    // say): do not derive sequences; settle per message (the stored ones answer
                    // as duplicates with their own sequences).
                    tracing::warn!(batch = ?ack.batch_id, stored = ?ack.batch_size, count, "atomic batch ack does not match the batch; publishing it per message");
                    results.extend(publish_pipelined(js, chunk.to_vec()).await);
                    continue;
                }
                into.committed += 1;
                let first = ack.sequence - count + 1;
                results.extend(
                    (0..count).map(|i| Ok(PublishAck { sequence: first + i, duplicate: false, ..ack.clone() })),
                );
            }
            Err(error) if is_batch_duplicate(&error) => {
                into.fallbacks += 1;
                tracing::debug!(
                    messages = chunk.len(),
                    "atomic batch holds an id the broker knows; publishing it per message"
                );
                results.extend(publish_pipelined(js, chunk.to_vec()).await);
            }
            Err(error) => {
                let kind = error.kind();
                results.push(Err(error));
                results.extend((1..chunk.len()).map(|_| Err(PublishError::new(kind))));
            }
        }
    }
}

/// Sends one atomic batch; returns the commit's PubAck future.
async fn send_batch(
    js: &async_nats::jetstream::Context,
    batch_id: &str,
    chunk: &[Outgoing],
) -> Result<async_nats::jetstream::context::PublishAckFuture, PublishError> {
    // The commit goes through `js`, on this same connection: the messages before it arrive first.
    let client = js.client();
    use async_nats::header::{NATS_BATCH_COMMIT, NATS_BATCH_COMMIT_FINAL, NATS_BATCH_ID, NATS_BATCH_SEQUENCE};
    let (last, rest) = chunk.split_last().expect("chunks are not empty");
    for (i, msg) in rest.iter().enumerate() {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(headers::MSG_ID, msg.key.as_str());
        headers.insert(headers::CONTENT_TYPE, headers::CLOUDEVENTS_JSON);
        headers.insert(NATS_BATCH_ID, batch_id);
        headers.insert(NATS_BATCH_SEQUENCE, (i + 1).to_string().as_str());
        client
            .publish_with_headers(msg.subject.clone(), headers, msg.body.clone())
            .await
            .map_err(|e| PublishError::with_source(PublishErrorKind::BrokenPipe, e))?;
    }
    let commit = PublishMessage::build()
        .payload(last.body.clone())
        .header(headers::CONTENT_TYPE, headers::CLOUDEVENTS_JSON)
        .header(NATS_BATCH_ID, batch_id)
        .header(NATS_BATCH_SEQUENCE, chunk.len().to_string().as_str())
        .header(NATS_BATCH_COMMIT, NATS_BATCH_COMMIT_FINAL)
        .message_id(&last.key);
    js.send_publish(last.subject.clone(), commit).await
}

/// Whether a publish failed because an atomic batch held an already stored id (10201).
pub fn is_batch_duplicate(error: &PublishError) -> bool {
    answered(error, ERR_BATCH_DUPLICATE)
}

/// Publishes every message pipelined: all are sent before any PubAck is awaited, so a batch costs
/// one round trip, not one per message. Results come back in input order.
pub async fn publish_pipelined(
    js: &async_nats::jetstream::Context,
    messages: Vec<Outgoing>,
) -> Vec<Result<PublishAck, PublishError>> {
    let mut pending = Vec::with_capacity(messages.len());
    for msg in messages {
        let publish = PublishMessage::build()
            .payload(msg.body)
            .header(headers::CONTENT_TYPE, headers::CLOUDEVENTS_JSON)
            .message_id(&msg.key);
        pending.push(js.send_publish(msg.subject, publish).await);
    }
    join_all(pending.into_iter().map(|sent| async move {
        match sent {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        }
    }))
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_and_a_missing_leader_are_transient_and_an_answer_is_not() {
        use async_nats::jetstream::context::{
            CreateStreamError, CreateStreamErrorKind, GetStreamError, GetStreamErrorKind,
        };
        let info = |kind| StreamSetupError::Info { name: "S".into(), source: GetStreamError::new(kind) };
        let create = |kind| StreamSetupError::Create { name: "S".into(), source: CreateStreamError::new(kind) };
        assert!(info(GetStreamErrorKind::Request).is_transient());
        assert!(create(CreateStreamErrorKind::TimedOut).is_transient());
        assert!(create(CreateStreamErrorKind::JetStreamUnavailable).is_transient());
        assert!(!info(GetStreamErrorKind::InvalidStreamName).is_transient());
        assert!(!create(CreateStreamErrorKind::InvalidStreamName).is_transient());
        assert!(!create(CreateStreamErrorKind::Response).is_transient());
    }

    fn settings() -> StreamSettings {
        StreamSettings {
            name: "HANDOFF".into(),
            subjects: Subjects::new("handoff".to_owned()).unwrap(),
            duplicate_window: Duration::from_secs(3600),
            max_age: Duration::from_secs(86_400),
            max_bytes: -1,
            replicas: 1,
            storage: StorageType::File,
        }
    }

    #[test]
    fn only_the_settings_handoff_owns_change_and_each_change_is_reported() {
        let mut existing = wanted(&settings(), false);
        assert_eq!(reconcile_config(&existing, &settings(), false).unwrap().1, [], "nothing drifted");
        existing.description = Some("owned by the platform team".into());
        existing.subjects.push("audit.>".into());
        existing.max_messages_per_subject = 1_000;
        existing.allow_direct = true;
        existing.duplicate_window = Duration::from_secs(10);
        existing.discard = DiscardPolicy::Old;
        let (config, drift) = reconcile_config(&existing, &settings(), true).unwrap();
        let changed: Vec<&str> = drift.iter().map(|d| d.setting).collect();
        assert_eq!(changed, ["discard", "duplicate_window", "allow_atomic"]);
        assert!(config.allow_atomic_publish);
        let (kept, _) = reconcile_config(&config, &settings(), false).unwrap();
        assert!(kept.allow_atomic_publish, "never turned off: another relay may use it");
        assert_eq!(config.description.as_deref(), Some("owned by the platform team"));
        assert_eq!(config.subjects, ["handoff.>", "audit.>"]);
        assert_eq!((config.max_messages_per_subject, config.allow_direct), (1_000, true));
        assert_eq!((config.discard, config.duplicate_window), (DiscardPolicy::New, Duration::from_secs(3600)));
    }

    #[test]
    fn server_versions_with_atomic_batches() {
        assert!(supports_atomic("2.15.1") && supports_atomic("2.12.0") && supports_atomic("v3.0.0"));
        assert!(!supports_atomic("2.11.9") && !supports_atomic("2.10.22-beta.1") && !supports_atomic("garbage"));
        assert!(prefers_atomic("2.15.1") && !prefers_atomic("2.14.3") && supports_atomic("2.14.3"));
    }

    #[test]
    fn a_difference_jetstream_cannot_apply_in_place_is_refused_with_what_to_do() {
        let mut existing = wanted(&settings(), false);
        existing.storage = StorageType::Memory;
        let error = reconcile_config(&existing, &settings(), false).unwrap_err().to_string();
        assert!(error.contains("storage") && error.contains("HANDOFF_STREAM_MEMORY"), "{error}");
        let mut existing = wanted(&settings(), false);
        existing.retention = RetentionPolicy::WorkQueue;
        let error = reconcile_config(&existing, &settings(), false).unwrap_err().to_string();
        assert!(error.contains("retention") && error.contains("HANDOFF_STREAM"), "{error}");
    }
}
