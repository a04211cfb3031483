//! The operators' review queue: what needs a person, the full history of one key, and the two
//! resolutions a person can make. Every resolution writes an audit row (actor, time, reason) and
//! never deletes anything. Exports carry non-secret fields only: no payload bodies, no credentials.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use crate::ledger::{self, Event, state};

/// One ledger row as an operator sees it (and as it is exported).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct ReviewRow {
    pub operation_key: String,
    pub state: String,
    pub attempts: i32,
    /// The CRM's task id, or the receipt an operator recorded.
    pub receipt_ref: Option<String>,
    pub note: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// One event of a key's history.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct EventRow {
    pub kind: String,
    pub replica: Option<String>,
    pub attempt: Option<i32>,
    pub evidence: String,
    pub state_after: String,
    pub at: DateTime<Utc>,
}

/// One operator resolution.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct AuditRow {
    pub actor: String,
    pub action: String,
    pub reason: String,
    pub receipt: Option<String>,
    pub at: DateTime<Utc>,
}

/// A dead-lettered message, without its body.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct DeadLetterRow {
    pub id: i64,
    pub stream_sequence: i64,
    pub message_id: Option<String>,
    pub reason: String,
    pub deliveries: i64,
    pub recorded_at: DateTime<Utc>,
}

/// A blocked outbox row (producer database).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct BlockedRow {
    pub operation_key: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub updated_at: DateTime<Utc>,
}

/// Why a resolution was refused. Nothing is changed in any case.
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    #[error("no ledger row for operation key {0}")]
    NotFound(String),
    /// Only undecided rows that no replica is working on can be resolved by a person.
    #[error("operation key {key} is {state}{}; only unknown or review rows not held by a replica can be resolved", if *.leased { " and leased by a replica" } else { "" })]
    NotResolvable { key: String, state: String, leased: bool },
    /// Every resolution names who made it and why.
    #[error("{0} must not be empty")]
    Missing(&'static str),
    #[error("review database error")]
    Database(#[from] sqlx::Error),
}

/// Ledger rows in these states, oldest first.
pub async fn list(pool: &PgPool, states: &[&str]) -> Result<Vec<ReviewRow>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT operation_key, state, attempts, crm_task_id AS receipt_ref, note, created_at, updated_at
             FROM handoff_consumer.crm_operation
            WHERE state = ANY($1::text[])
            ORDER BY created_at, operation_key"#,
    )
    .bind(states)
    .fetch_all(pool)
    .await
}

/// Dead letters, oldest first.
pub async fn dead_letters(pool: &PgPool) -> Result<Vec<DeadLetterRow>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT id, stream_sequence, message_id, reason, deliveries, recorded_at
             FROM handoff_consumer.dead_letter ORDER BY id"#,
    )
    .fetch_all(pool)
    .await
}

/// Blocked outbox rows from the producer database.
pub async fn blocked(outbox: &PgPool) -> Result<Vec<BlockedRow>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT operation_key, attempts, last_error, updated_at
             FROM handoff.outbox WHERE state = 'blocked' ORDER BY updated_at"#,
    )
    .fetch_all(outbox)
    .await
}

/// A key's ledger row, every event and every resolution.
#[derive(Debug, Clone, Serialize)]
pub struct History {
    pub operation: ReviewRow,
    pub events: Vec<EventRow>,
    pub audit: Vec<AuditRow>,
}

/// The full history of one key.
pub async fn history(pool: &PgPool, key: &str) -> Result<History, ReviewError> {
    let operation: ReviewRow = sqlx::query_as(
        r#"SELECT operation_key, state, attempts, crm_task_id AS receipt_ref, note, created_at, updated_at
             FROM handoff_consumer.crm_operation WHERE operation_key = $1"#,
    )
    .bind(key)
    .fetch_optional(pool)
    .await?
    .ok_or_else(|| ReviewError::NotFound(key.to_owned()))?;
    let events = sqlx::query_as(
        r#"SELECT kind, replica, attempt, evidence, state_after, at
             FROM handoff_consumer.crm_event WHERE operation_key = $1 ORDER BY id"#,
    )
    .bind(key)
    .fetch_all(pool)
    .await?;
    let audit = sqlx::query_as(
        r#"SELECT actor, action, reason, receipt, at FROM handoff_consumer.audit WHERE operation_key = $1 ORDER BY id"#,
    )
    .bind(key)
    .fetch_all(pool)
    .await?;
    Ok(History { operation, events, audit })
}

/// A person found the task in the CRM: record its receipt and settle the key.
pub async fn resolve_with_receipt(
    pool: &PgPool,
    key: &str,
    receipt: &str,
    actor: &str,
    reason: &str,
) -> Result<(), ReviewError> {
    if receipt.trim().is_empty() {
        return Err(ReviewError::Missing("receipt"));
    }
    resolve(pool, key, actor, reason, "record_receipt", Some(receipt), state::SETTLED).await
}

/// A person proved the CRM never executed the action: allow exactly one new attempt with the same
/// key and the same approved payload (a changed payload needs a new approval and a new key).
pub async fn approve_new_attempt(pool: &PgPool, key: &str, actor: &str, reason: &str) -> Result<(), ReviewError> {
    resolve(pool, key, actor, reason, "approve_new_attempt", None, state::PROVED_NOT_EXECUTED).await
}

async fn resolve(
    pool: &PgPool,
    key: &str,
    actor: &str,
    reason: &str,
    action: &'static str,
    receipt: Option<&str>,
    new_state: &'static str,
) -> Result<(), ReviewError> {
    if actor.trim().is_empty() {
        return Err(ReviewError::Missing("actor"));
    }
    if reason.trim().is_empty() {
        return Err(ReviewError::Missing("reason"));
    }
    let mut tx = pool.begin().await?;
    // Lock the row so a dispatcher cannot claim it between the check and the update.
    let current: Option<(String, bool)> = sqlx::query_as(
        r#"SELECT state, (lease_owner IS NOT NULL AND lease_until > now()) AS leased
             FROM handoff_consumer.crm_operation WHERE operation_key = $1 FOR UPDATE"#,
    )
    .bind(key)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((current, leased)) = current else { return Err(ReviewError::NotFound(key.to_owned())) };
    if leased || !(current == state::UNKNOWN || current == state::REVIEW) {
        return Err(ReviewError::NotResolvable { key: key.to_owned(), state: current, leased });
    }
    let note = format!("{action} by {actor}: {reason}");
    sqlx::query(
        r#"UPDATE handoff_consumer.crm_operation
              SET state = $2, next_attempt_at = now(), lease_owner = NULL, lease_until = NULL,
                  crm_task_id = COALESCE($3, crm_task_id),
                  proof = CASE WHEN $3 IS NULL THEN proof ELSE 'operator_receipt' END,
                  note = $4, updated_at = now()
            WHERE operation_key = $1"#,
    )
    .bind(key)
    .bind(new_state)
    .bind(receipt)
    .bind(&note)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO handoff_consumer.audit (operation_key, actor, action, reason, receipt) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(key)
    .bind(actor.trim())
    .bind(action)
    .bind(reason.trim())
    .bind(receipt)
    .execute(&mut *tx)
    .await?;
    ledger::insert_event(&mut tx, key, &Event { kind: "operator", attempt: None, evidence: &note }, None, new_state)
        .await?;
    tx.commit().await?;
    Ok(())
}

/// Export formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportFormat {
    Csv,
    Json,
}

/// Renders rows for export: key, state, attempts, receipt ref, note, created, updated.
pub fn export(rows: &[ReviewRow], format: ExportFormat) -> anyhow::Result<String> {
    Ok(match format {
        ExportFormat::Json => serde_json::to_string_pretty(rows)?,
        ExportFormat::Csv => {
            let mut out = String::from("operation_key,state,attempts,receipt_ref,note,created_at,updated_at\n");
            for r in rows {
                let fields = [
                    r.operation_key.clone(),
                    r.state.clone(),
                    r.attempts.to_string(),
                    r.receipt_ref.clone().unwrap_or_default(),
                    r.note.clone().unwrap_or_default(),
                    r.created_at.to_rfc3339(),
                    r.updated_at.to_rfc3339(),
                ];
                out.push_str(&fields.iter().map(|f| csv_field(f)).collect::<Vec<_>>().join(","));
                out.push('\n');
            }
            out
        }
    })
}

/// RFC 4180 quoting, plus a leading `'` for cells a spreadsheet would run as a formula.
fn csv_field(value: &str) -> String {
    let value =
        if value.starts_with(['=', '+', '-', '@', '\t', '\r']) { format!("'{value}") } else { value.to_owned() };
    if value.contains([',', '"', '\n', '\r']) { format!("\"{}\"", value.replace('"', "\"\"")) } else { value }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_quotes_separators_and_defuses_formulas() {
        assert_eq!(csv_field("plain"), "plain");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
        assert_eq!(csv_field("=SUM(A1)"), "'=SUM(A1)");
    }
}
