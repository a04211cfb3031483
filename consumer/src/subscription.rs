//! The broker side of the consumer: the durable pull consumer all replicas share.

use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::stream::Stream;

/// The durable consumer's settings.
#[derive(Debug, Clone)]
pub struct SubscriptionSettings {
    pub stream: String,
    /// The subject layout the relay publishes under: a message must arrive on its key's subject.
    pub subjects: handoff_shared::Subjects,
    pub durable_name: String,
    /// Only these subjects (e.g. `handoff.harbor.create-followup` to scale one action separately).
    pub filter_subject: String,
    /// Redelivery after this long without an ack; a crashed replica's messages come back then.
    pub ack_wait: Duration,
    /// Unacked messages across all replicas.
    pub max_ack_pending: i64,
    /// How long to wait for the stream to exist at startup (the relay creates it).
    pub stream_wait: Duration,
}

/// Waits for the stream, then creates the durable consumer or updates it to these settings.
///
/// `max_deliver` is unlimited on purpose: the consumer dead-letters a message itself after
/// `dead_letter_after` failed deliveries, and only once the dead letter is stored. A server-side
/// limit would silently stop redelivering a message whose dead letter could not be written.
pub async fn bind(
    js: &async_nats::jetstream::Context,
    settings: &SubscriptionSettings,
) -> anyhow::Result<PullConsumer> {
    let stream = wait_for_stream(js, settings).await?;
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(settings.durable_name.clone()),
            filter_subject: settings.filter_subject.clone(),
            ack_policy: AckPolicy::Explicit,
            deliver_policy: DeliverPolicy::All,
            ack_wait: settings.ack_wait,
            max_deliver: -1,
            max_ack_pending: settings.max_ack_pending,
            ..Default::default()
        })
        .await?;
    Ok(consumer)
}

async fn wait_for_stream(
    js: &async_nats::jetstream::Context,
    settings: &SubscriptionSettings,
) -> anyhow::Result<Stream> {
    let deadline = tokio::time::Instant::now() + settings.stream_wait;
    let mut pause = Duration::from_millis(100);
    loop {
        match js.get_stream(&settings.stream).await {
            Ok(stream) => return Ok(stream),
            Err(error) if tokio::time::Instant::now() < deadline => {
                tracing::info!(stream = %settings.stream, %error, "waiting for the stream to exist");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
            }
            Err(error) => return Err(anyhow::anyhow!("stream {} not available: {error}", settings.stream)),
        }
    }
}
