//! The broker side of the consumer: the durable pull consumer all replicas share.

use std::time::Duration;

use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::stream::Stream;
use async_nats::jetstream::stream::{ConsumerError, ConsumerErrorKind};
use handoff_shared::logging::error_chain;

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
    /// Servers holding the durable consumer's state; `None` follows the stream (R3 on a 3-node
    /// cluster). See [`ConsumerReplicas`].
    pub replicas: Option<ConsumerReplicas>,
}

/// How many servers hold the durable consumer's state (its delivered and acknowledged positions),
/// when it should differ from the stream's replicas.
///
/// On an R3 stream every delivery and every ack of an R3 consumer is a raft proposal replicated to
/// the other two servers: more than half of what the cluster spends per message on the consuming
/// side (docs/benchmarks.md, "The consumer's state on one server"). With 1 the state lives on one
/// server of the stream's group, on its disk: the messages stay replicated, but while that server
/// is down nothing is delivered (the relays keep publishing into the stream) until it is back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConsumerReplicas(u8);

impl ConsumerReplicas {
    /// The most replicas JetStream allows.
    pub const MAX: u8 = 5;

    /// `replicas` servers (1-5); more than the stream has is refused by the server at startup.
    pub fn new(replicas: u8) -> Option<Self> {
        (1..=Self::MAX).contains(&replicas).then_some(Self(replicas))
    }

    pub fn get(self) -> u8 {
        self.0
    }
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
    let deadline = tokio::time::Instant::now() + settings.stream_wait;
    let stream = wait_for_stream(js, settings, deadline).await?;
    let config = pull::Config {
        durable_name: Some(settings.durable_name.clone()),
        filter_subject: settings.filter_subject.clone(),
        ack_policy: AckPolicy::Explicit,
        deliver_policy: DeliverPolicy::All,
        ack_wait: settings.ack_wait,
        max_deliver: -1,
        max_ack_pending: settings.max_ack_pending,
        // 0: as many as the stream.
        num_replicas: settings.replicas.map_or(0, |r| usize::from(r.get())),
        ..Default::default()
    };
    STARTUP_BACKOFF
        .retry_until(
            deadline,
            || stream.create_consumer(config.clone()),
            // A cluster electing a leader (a server just killed or restarted) lets the request time
            // out or go unanswered: wait for it, as for the stream, instead of exiting.
            |error| matches!(error.kind(), ConsumerErrorKind::TimedOut | ConsumerErrorKind::Request),
            |error, pause| {
                tracing::info!(stream = %settings.stream, error = %error_chain(error), retry_in_ms = pause.as_millis() as u64,
                    "creating the durable consumer failed; trying again");
            },
        )
        .await
        .map_err(|error| refusal(settings, error))
}

/// The pauses between startup attempts (reading the stream, creating the durable): 100 ms
/// doubling to 5 s, half jittered so that replicas started together do not ask in lock-step.
const STARTUP_BACKOFF: handoff_shared::Backoff = handoff_shared::Backoff {
    initial: Duration::from_millis(100),
    max: Duration::from_secs(5),
    multiplier: 2.0,
    jitter: 0.5,
};

/// The server's refusal of the durable consumer, with what to change when it is a setting of ours.
fn refusal(settings: &SubscriptionSettings, error: ConsumerError) -> anyhow::Error {
    // A cluster compares with the stream's replicas; a single server refuses any count above 1.
    let replicas_refused = matches!(
        error.kind(),
        ConsumerErrorKind::JetStream(ref e) if [ErrorCode::CONSUMER_REPLICAS_EXCEEDS_STREAM, ErrorCode::STREAM_REPLICAS_NOT_SUPPORTED].contains(&e.error_code())
    );
    match settings.replicas {
        Some(replicas) if replicas_refused => anyhow::Error::new(error).context(format!(
            "--consumer-replicas (HANDOFF_CONSUMER_REPLICAS) is {} but stream {} has fewer replicas: \
             lower it, or leave it unset to follow the stream",
            replicas.get(),
            settings.stream
        )),
        _ => anyhow::Error::new(error).context(format!(
            "cannot create or update durable consumer {} on stream {}",
            settings.durable_name, settings.stream
        )),
    }
}

async fn wait_for_stream(
    js: &async_nats::jetstream::Context,
    settings: &SubscriptionSettings,
    deadline: tokio::time::Instant,
) -> anyhow::Result<Stream> {
    STARTUP_BACKOFF
        .retry_until(
            deadline,
            || js.get_stream(&settings.stream),
            // Any error: the stream may not exist yet (the relay creates it) or the cluster may
            // still be electing its leader.
            |_| true,
            |error, pause| {
                tracing::info!(stream = %settings.stream, error = %error_chain(error), retry_in_ms = pause.as_millis() as u64,
                    "waiting for the stream to exist");
            },
        )
        .await
        .map_err(|error| anyhow::Error::new(error).context(format!("stream {} not available", settings.stream)))
}
