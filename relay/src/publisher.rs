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

/// Creates the stream or reconciles a changed configuration (`get_or_create` would not).
pub async fn ensure_stream(
    js: &async_nats::jetstream::Context,
    settings: &StreamSettings,
) -> Result<stream::Info, async_nats::jetstream::context::CreateStreamError> {
    js.create_or_update_stream(stream::Config {
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
    })
    .await
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
