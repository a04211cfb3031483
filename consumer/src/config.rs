//! Every setting of `handoff-consumer`, as a flag and an environment variable (`handoff-consumer --help`).

use std::time::Duration;

use handoff_shared::Backoff;
use handoff_shared::config::{DatabaseArgs, LogFormat, NatsArgs};
use handoff_shared::subject::Subjects;

use crate::{ConsumerSettings, SubscriptionSettings};

/// Turns approved actions from NATS JetStream into CRM tasks, once per operation key.
#[derive(Debug, clap::Parser)]
#[command(name = "handoff-consumer", version)]
pub struct ConsumerConfig {
    #[command(flatten)]
    pub database: DatabaseArgs,
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
    #[arg(long, env = "HANDOFF_ACK_WAIT_SECS", default_value_t = 30)]
    pub ack_wait_secs: u64,
    /// Unacknowledged messages allowed across all replicas.
    #[arg(long, env = "HANDOFF_MAX_ACK_PENDING", default_value_t = 1000)]
    pub max_ack_pending: i64,
    /// Messages per transaction.
    #[arg(long, env = "HANDOFF_CONSUMER_BATCH_SIZE", default_value_t = 250)]
    pub batch_size: usize,
    /// Failed deliveries before a message is dead-lettered.
    #[arg(long, env = "HANDOFF_DEAD_LETTER_AFTER", default_value_t = 10)]
    pub dead_letter_after: i64,
    /// Seconds to wait at startup for the relay to create the stream.
    #[arg(long, env = "HANDOFF_STREAM_WAIT_SECS", default_value_t = 60)]
    pub stream_wait_secs: u64,
    /// Log format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

impl ConsumerConfig {
    /// The durable consumer these flags describe.
    pub fn subscription(&self) -> anyhow::Result<SubscriptionSettings> {
        let subjects = Subjects::new(self.subject_prefix.clone())?;
        Ok(SubscriptionSettings {
            stream: self.stream.clone(),
            durable_name: self.consumer_name.clone(),
            filter_subject: self.filter_subject.clone().unwrap_or_else(|| subjects.all()),
            ack_wait: Duration::from_secs(self.ack_wait_secs),
            max_ack_pending: self.max_ack_pending,
            stream_wait: Duration::from_secs(self.stream_wait_secs),
        })
    }

    /// The processing settings these flags describe.
    pub fn settings(&self) -> ConsumerSettings {
        ConsumerSettings {
            batch_size: self.batch_size,
            dead_letter_after: self.dead_letter_after,
            backoff: Backoff {
                initial: Duration::from_millis(500),
                max: Duration::from_secs(60),
                ..Backoff::default()
            },
            ..ConsumerSettings::default()
        }
    }
}
