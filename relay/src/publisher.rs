//! The broker side of the relay: the stream's configuration and pipelined publishing.
//!
//! Every message carries `Nats-Msg-Id` = operation key, so a re-publish inside the stream's
//! `duplicate_window` is answered with the original sequence and `duplicate: true` instead of being
//! stored twice. That is an optimisation; the consumer's unique index is the guarantee (broker dedup
//! forgets ids after the window and, for acked messages, after a restart; see platform notes).

use std::time::Duration;

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

/// The stream configuration handoff wants, for a new stream.
fn wanted(settings: &StreamSettings) -> stream::Config {
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
        ..Default::default()
    }
}

/// `existing` with only the settings handoff owns changed to `settings`, and what changed. Every
/// other setting (description, other subjects, per-subject limits, direct get, placement, ...) is
/// the operator's and stays as it is. Fails on a difference JetStream cannot apply in place.
pub fn reconcile_config(
    existing: &stream::Config,
    settings: &StreamSettings,
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
    Ok((config, drift))
}

/// Creates the stream, or brings the settings handoff owns on an existing one to `settings`
/// (logging each change as drift) without touching any other setting; a difference JetStream
/// cannot change in place fails with what to do.
pub async fn ensure_stream(
    js: &async_nats::jetstream::Context,
    settings: &StreamSettings,
) -> Result<stream::Info, StreamSetupError> {
    use async_nats::jetstream::ErrorCode;
    use async_nats::jetstream::context::GetStreamErrorKind;
    let name = settings.name.clone();
    let existing = match js.get_stream(&settings.name).await {
        Ok(stream) => stream.cached_info().clone(),
        Err(error) if matches!(error.kind(), GetStreamErrorKind::JetStream(e) if e.error_code() == ErrorCode::STREAM_NOT_FOUND) =>
        {
            let created = js
                .create_stream(wanted(settings))
                .await
                .map_err(|source| StreamSetupError::Create { name: name.clone(), source })?;
            tracing::info!(stream = %name, "created the stream");
            return Ok(created.cached_info().clone());
        }
        Err(source) => return Err(StreamSetupError::Info { name, source }),
    };
    let (config, drift) = reconcile_config(&existing.config, settings)?;
    if drift.is_empty() {
        return Ok(existing);
    }
    for d in &drift {
        tracing::warn!(stream = %name, setting = d.setting, was = %d.was, now = %d.now, "stream setting drifted; set back to the relay's");
    }
    let changes = drift.iter().map(|d| d.setting).collect::<Vec<_>>().join(", ");
    js.update_stream(&config).await.map_err(|source| StreamSetupError::Update { name, changes, source })
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

/// Every value [`failure_class`] returns.
pub const FAILURE_CLASSES: [&str; 6] =
    ["timeout", "no_responders", "connection", "max_payload", "client_backpressure", "other"];

/// The `class` label of a failed publish in `handoff_relay_publish_failures_total`.
pub fn failure_class(error: &PublishError) -> &'static str {
    match error.kind() {
        PublishErrorKind::TimedOut => "timeout",
        // "No responders": the stream has no leader right now (elections, restarts).
        PublishErrorKind::StreamNotFound => "no_responders",
        PublishErrorKind::BrokenPipe => "connection",
        PublishErrorKind::MaxPayloadExceeded => "max_payload",
        PublishErrorKind::MaxAckPending => "client_backpressure",
        _ => "other",
    }
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
        let mut existing = wanted(&settings());
        assert_eq!(reconcile_config(&existing, &settings()).unwrap().1, [], "nothing drifted");
        existing.description = Some("owned by the platform team".into());
        existing.subjects.push("audit.>".into());
        existing.max_messages_per_subject = 1_000;
        existing.allow_direct = true;
        existing.duplicate_window = Duration::from_secs(10);
        existing.discard = DiscardPolicy::Old;
        let (config, drift) = reconcile_config(&existing, &settings()).unwrap();
        let changed: Vec<&str> = drift.iter().map(|d| d.setting).collect();
        assert_eq!(changed, ["discard", "duplicate_window"]);
        assert_eq!(config.description.as_deref(), Some("owned by the platform team"));
        assert_eq!(config.subjects, ["handoff.>", "audit.>"]);
        assert_eq!((config.max_messages_per_subject, config.allow_direct), (1_000, true));
        assert_eq!((config.discard, config.duplicate_window), (DiscardPolicy::New, Duration::from_secs(3600)));
    }

    #[test]
    fn a_difference_jetstream_cannot_apply_in_place_is_refused_with_what_to_do() {
        let mut existing = wanted(&settings());
        existing.storage = StorageType::Memory;
        let error = reconcile_config(&existing, &settings()).unwrap_err().to_string();
        assert!(error.contains("storage") && error.contains("HANDOFF_STREAM_MEMORY"), "{error}");
        let mut existing = wanted(&settings());
        existing.retention = RetentionPolicy::WorkQueue;
        let error = reconcile_config(&existing, &settings()).unwrap_err().to_string();
        assert!(error.contains("retention") && error.contains("HANDOFF_STREAM"), "{error}");
    }
}
