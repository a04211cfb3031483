//! The queues a person works: ledger rows whose outcome is unknown or in review, conflicts, dead
//! letters, and outbox rows the relay blocked. One row shape for listing and export (no payloads,
//! no secrets).

use anyhow::Result;
use chrono::{DateTime, Utc};
use handoff_consumer::remote::LedgerState;
use handoff_consumer::review::{self, ExportFormat};
use serde::Serialize;
use sqlx::PgPool;

/// A queue to list or export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Queue {
    /// Ledger rows whose CRM outcome is unknown (being read back).
    Unknown,
    /// Ledger rows waiting for a person.
    Review,
    /// Same key, different payload (unresolved).
    Conflict,
    /// Messages that could not be processed (unresolved).
    DeadLetter,
    /// Outbox rows the relay gave up on (producer database).
    Blocked,
}

/// One row of any queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QueueRow {
    pub queue: Queue,
    /// The operation key (or, for a dead letter without a readable key, its message id or `-`).
    pub operation_key: String,
    /// The destination account (ledger rows: the ledger is unique per account and key, so one key
    /// may be in a queue once per account; `resolve --account` names it).
    pub account: Option<String>,
    /// The row's own id where the queue has one (conflicts, dead letters).
    pub id: Option<i64>,
    pub attempts: Option<i64>,
    /// The CRM's task id or an operator's receipt (ledger rows).
    pub receipt_ref: Option<String>,
    /// Why it is in the queue.
    pub note: String,
    pub since: DateTime<Utc>,
}

/// The queues `list` shows when none is named.
pub const DEFAULT_QUEUES: [Queue; 2] = [Queue::Unknown, Queue::Review];

/// Rows of `queues` (default: [`DEFAULT_QUEUES`]), oldest first within each queue. The blocked
/// queue is in the producer database, the others in the consumer database.
pub async fn list(consumer: Option<&PgPool>, producer: Option<&PgPool>, queues: &[Queue]) -> Result<Vec<QueueRow>> {
    let queues = if queues.is_empty() { &DEFAULT_QUEUES[..] } else { queues };
    let needs_consumer = || anyhow::anyhow!("this queue is in the consumer database");
    let mut rows = Vec::new();
    for &queue in queues {
        match queue {
            Queue::Unknown | Queue::Review => {
                let state = if queue == Queue::Unknown { LedgerState::Unknown } else { LedgerState::Review };
                for r in review::list(consumer.ok_or_else(needs_consumer)?, &[state]).await? {
                    rows.push(QueueRow {
                        queue,
                        operation_key: r.operation_key,
                        account: Some(r.account),
                        id: None,
                        attempts: Some(r.attempts.into()),
                        receipt_ref: r.receipt_ref,
                        note: r.note.unwrap_or_default(),
                        since: r.updated_at,
                    });
                }
            }
            Queue::Conflict => {
                for r in review::open_conflicts(consumer.ok_or_else(needs_consumer)?).await? {
                    rows.push(QueueRow {
                        queue,
                        operation_key: r.operation_key,
                        account: None,
                        id: Some(r.id),
                        attempts: None,
                        receipt_ref: None,
                        note: format!("{} (incoming {}, held {})", r.reason, r.incoming_hash, r.existing_hash),
                        since: r.recorded_at,
                    });
                }
            }
            Queue::DeadLetter => {
                for r in review::dead_letters(consumer.ok_or_else(needs_consumer)?).await? {
                    rows.push(QueueRow {
                        queue,
                        operation_key: r.message_id.unwrap_or_else(|| "-".into()),
                        account: None,
                        id: Some(r.id),
                        attempts: Some(r.deliveries),
                        receipt_ref: None,
                        note: format!("sequence {}: {}", r.stream_sequence, r.reason),
                        since: r.recorded_at,
                    });
                }
            }
            Queue::Blocked => {
                let producer =
                    producer.ok_or_else(|| anyhow::anyhow!("the blocked queue needs the producer database"))?;
                for r in review::blocked(producer).await? {
                    rows.push(QueueRow {
                        queue,
                        operation_key: r.operation_key,
                        account: None,
                        id: None,
                        attempts: Some(r.attempts.into()),
                        receipt_ref: None,
                        note: r.last_error.unwrap_or_default(),
                        since: r.updated_at,
                    });
                }
            }
        }
    }
    Ok(rows)
}

/// Rows as a person reads them.
pub fn render(rows: &Vec<QueueRow>) -> String {
    let mut out = String::new();
    for r in rows {
        let queue = serde_json::to_value(r.queue).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
        out += &format!(
            "{:<12} {:<48} {}{}attempts={} receipt={} {}\n",
            queue,
            r.operation_key,
            r.account.as_deref().map(|a| format!("account={a} ")).unwrap_or_default(),
            r.id.map(|id| format!("#{id} ")).unwrap_or_default(),
            r.attempts.map_or("-".into(), |a| a.to_string()),
            r.receipt_ref.as_deref().unwrap_or("-"),
            r.note
        );
    }
    if out.is_empty() {
        out = "nothing in these queues\n".into();
    }
    out
}

/// Export: key, account, queue, id, attempts, receipt ref, note, since.
pub fn export(rows: &[QueueRow], format: ExportFormat) -> Result<String> {
    Ok(match format {
        ExportFormat::Json => serde_json::to_string_pretty(rows)?,
        ExportFormat::Csv => {
            let mut out = String::from("operation_key,account,queue,id,attempts,receipt_ref,note,since\n");
            for r in rows {
                let queue = serde_json::to_value(r.queue)?.as_str().unwrap_or_default().to_owned();
                let fields = [
                    r.operation_key.clone(),
                    r.account.clone().unwrap_or_default(),
                    queue,
                    r.id.map(|i| i.to_string()).unwrap_or_default(),
                    r.attempts.map(|a| a.to_string()).unwrap_or_default(),
                    r.receipt_ref.clone().unwrap_or_default(),
                    r.note.clone(),
                    r.since.to_rfc3339(),
                ];
                out.push_str(&fields.iter().map(|f| review::csv_field(f)).collect::<Vec<_>>().join(","));
                out.push('\n');
            }
            out
        }
    })
}
