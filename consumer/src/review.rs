//! The operators' review queue: what needs a person, the full history of one key, and the two
//! resolutions a person can make. Every resolution writes an audit row (actor, time, reason) and
//! never deletes anything. Exports carry non-secret fields only: no payload bodies, no credentials.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;

use crate::remote::LedgerState;
use crate::remote::ledger::{self, Event};
pub use crate::remote::ledger::{AuditRow, EventRow, ReviewRow};

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
    /// The key went to several destination accounts; each is its own row, acted on by naming it.
    #[error("operation key {key} has ledger rows in several accounts ({}); name the one you mean with --account", .accounts.join(", "))]
    SeveralAccounts { key: String, accounts: Vec<String> },
    /// The key has ledger rows, but none in the account named.
    #[error("operation key {key} has no ledger row in account {account} (it has: {})", .accounts.join(", "))]
    NotInAccount { key: String, account: String, accounts: Vec<String> },
    /// Only undecided rows that no replica is working on can be resolved by a person.
    #[error("operation key {key} is {state}{}; only unknown or review rows not held by a replica can be resolved", if *.leased { " and leased by a replica" } else { "" })]
    NotResolvable { key: String, state: LedgerState, leased: bool },
    /// Every resolution names who made it and why.
    #[error("{0} must not be empty")]
    Missing(&'static str),
    #[error("no {0} with id {1}")]
    NoSuchRow(&'static str, i64),
    /// Resolved rows stay as they were resolved.
    #[error("{0} {1} is resolved already")]
    AlreadyResolved(&'static str, i64),
    #[error("review database error")]
    Database(#[from] sqlx::Error),
}

/// Unresolved dead letters, oldest first.
pub async fn dead_letters(pool: &PgPool) -> Result<Vec<DeadLetterRow>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT id, stream_sequence, message_id, reason, deliveries, recorded_at
             FROM handoff_consumer.dead_letter WHERE resolved_at IS NULL ORDER BY id"#,
    )
    .fetch_all(pool)
    .await
}

/// Unresolved conflicts, oldest first.
pub async fn open_conflicts(pool: &PgPool) -> Result<Vec<ConflictRow>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT id, operation_key, reason, incoming_hash, existing_hash, stream_sequence, recorded_at,
                  resolved_at, resolved_by, resolution
             FROM handoff_consumer.review WHERE resolved_at IS NULL ORDER BY id"#,
    )
    .fetch_all(pool)
    .await
}

/// Blocked outbox rows from the producer database (from the per-row path's index: blocked rows
/// are never due, see the relay's migration `operability`).
pub async fn blocked(outbox: &PgPool) -> Result<Vec<BlockedRow>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT operation_key, attempts, last_error, updated_at
             FROM handoff.outbox WHERE retrying AND next_attempt_at = 'infinity' AND state = 'blocked'
            ORDER BY updated_at"#,
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

/// The full history of one key's ledger row: the only one, or `account`'s.
pub async fn history(pool: &PgPool, key: &str, account: Option<&str>) -> Result<History, ReviewError> {
    let mut rows = ledger::operations(pool, key).await?;
    let operation = pick_account(key, account, &mut rows, |r| &r.account)?;
    Ok(history_of(pool, operation).await?)
}

/// The full history of each of a key's ledger rows, one per destination account (normally one;
/// none when the key never reached the remote-CRM path).
pub async fn histories(pool: &PgPool, key: &str) -> Result<Vec<History>, sqlx::Error> {
    let mut all = Vec::new();
    for operation in ledger::operations(pool, key).await? {
        all.push(history_of(pool, operation).await?);
    }
    Ok(all)
}

async fn history_of(pool: &PgPool, operation: ReviewRow) -> Result<History, sqlx::Error> {
    let events = ledger::events(pool, &operation.operation_key, &operation.account).await?;
    let audit = ledger::audit_trail(pool, &operation.operation_key, &operation.account).await?;
    Ok(History { operation, events, audit })
}

/// The one row of `rows` (a key's ledger rows, by account) an operator means: the only one, or
/// the one in `account`. Anything else is refused, naming the accounts there are.
fn pick_account<T>(
    key: &str,
    account: Option<&str>,
    rows: &mut Vec<T>,
    account_of: impl Fn(&T) -> &String,
) -> Result<T, ReviewError> {
    let accounts = || rows.iter().map(|r| account_of(r).clone()).collect::<Vec<_>>();
    match account {
        _ if rows.is_empty() => Err(ReviewError::NotFound(key.to_owned())),
        Some(wanted) => match rows.iter().position(|r| account_of(r) == wanted) {
            Some(at) => Ok(rows.swap_remove(at)),
            None => {
                Err(ReviewError::NotInAccount { key: key.to_owned(), account: wanted.to_owned(), accounts: accounts() })
            }
        },
        None if rows.len() == 1 => Ok(rows.remove(0)),
        None => Err(ReviewError::SeveralAccounts { key: key.to_owned(), accounts: accounts() }),
    }
}

/// Ledger rows in these states, oldest first.
pub async fn list(pool: &PgPool, states: &[LedgerState]) -> Result<Vec<ReviewRow>, sqlx::Error> {
    ledger::list(pool, states).await
}

/// A person found the task in the CRM: record its receipt and settle the key (its row in
/// `account`, which may be left out when the key has one ledger row).
pub async fn resolve_with_receipt(
    pool: &PgPool,
    key: &str,
    account: Option<&str>,
    receipt: &str,
    actor: &str,
    reason: &str,
) -> Result<(), ReviewError> {
    if receipt.trim().is_empty() {
        return Err(ReviewError::Missing("receipt"));
    }
    resolve(pool, key, account, actor, reason, "record_receipt", Some(receipt), LedgerState::Settled).await
}

/// A person proved the CRM never executed the action: allow exactly one new attempt with the same
/// key and the same approved payload (a changed payload needs a new approval and a new key), in
/// `account` (which may be left out when the key has one ledger row).
pub async fn approve_new_attempt(
    pool: &PgPool,
    key: &str,
    account: Option<&str>,
    actor: &str,
    reason: &str,
) -> Result<(), ReviewError> {
    resolve(pool, key, account, actor, reason, "approve_new_attempt", None, LedgerState::ProvedNotExecuted).await
}

#[allow(clippy::too_many_arguments)]
async fn resolve(
    pool: &PgPool,
    key: &str,
    account: Option<&str>,
    actor: &str,
    reason: &str,
    action: &'static str,
    receipt: Option<&str>,
    new_state: LedgerState,
) -> Result<(), ReviewError> {
    require(actor, reason)?;
    let mut tx = pool.begin().await?;
    // Locked, so a dispatcher cannot claim it between the check and the update (all of the key's
    // rows: the refusal naming the accounts must see them all).
    let mut rows = ledger::lock_for_resolution(&mut tx, key).await?;
    let (account, current, leased) = pick_account(key, account, &mut rows, |(account, ..)| account)?;
    if leased || !matches!(current, LedgerState::Unknown | LedgerState::Review) {
        return Err(ReviewError::NotResolvable { key: key.to_owned(), state: current, leased });
    }
    let note = format!("{action} by {actor}: {reason}");
    ledger::apply_resolution(&mut tx, &account, key, new_state, receipt, &note).await?;
    let audit =
        ledger::Audit { key: Some(key), account: Some(&account), action_type: None, actor, action, reason, receipt };
    ledger::insert_audit(&mut tx, &audit).await?;
    ledger::insert_event(
        &mut tx,
        &account,
        key,
        &Event { kind: "operator", attempt: None, evidence: &note, decision: None },
        None,
        new_state.as_str(),
    )
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

/// Renders rows for export: key, account, state, attempts, receipt ref, note, created, updated.
pub fn export(rows: &[ReviewRow], format: ExportFormat) -> anyhow::Result<String> {
    Ok(match format {
        ExportFormat::Json => serde_json::to_string_pretty(rows)?,
        ExportFormat::Csv => {
            let mut out = String::from("operation_key,account,state,attempts,receipt_ref,note,created_at,updated_at\n");
            for r in rows {
                let fields = [
                    r.operation_key.clone(),
                    r.account.clone(),
                    r.state.to_string(),
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
pub fn csv_field(value: &str) -> String {
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

/// Everything the consumer database holds about one key, for `handoff-admin explain`: in either
/// CRM mode and in every end state (a dead-lettered message is found by its `Nats-Msg-Id`).
#[derive(Debug, Clone, Serialize)]
pub struct ConsumerRecord {
    pub inbox: Option<InboxRow>,
    /// The local CRM's task (`--crm local`).
    pub task: Option<TaskRow>,
    /// The remote CRM ledger rows and their histories (`--crm http`): one per destination account
    /// the key went to, normally one.
    pub ledger: Vec<History>,
    pub conflicts: Vec<ConflictRow>,
    pub dead_letters: Vec<DeadLetterRow>,
    pub audit: Vec<AuditRow>,
}

/// The inbox row of a key.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct InboxRow {
    pub payload_hash: String,
    pub stream_sequence: i64,
    pub outcome: String,
    pub received_at: DateTime<Utc>,
}

/// A task in the local CRM store (no payload body).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct TaskRow {
    pub task_id: i64,
    pub payload_hash: String,
    pub created_at: DateTime<Utc>,
}

/// A conflict: the key arrived with content different from what was held.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct ConflictRow {
    pub id: i64,
    pub operation_key: String,
    pub reason: String,
    pub incoming_hash: String,
    pub existing_hash: String,
    pub stream_sequence: i64,
    pub recorded_at: DateTime<Utc>,
    pub resolved_at: Option<DateTime<Utc>>,
    pub resolved_by: Option<String>,
    pub resolution: Option<String>,
}

/// Everything about `key` in the consumer's database.
pub async fn consumer_record(pool: &PgPool, key: &str) -> Result<ConsumerRecord, sqlx::Error> {
    let inbox = sqlx::query_as(
        "SELECT payload_hash, stream_sequence, outcome, received_at FROM handoff_consumer.inbox WHERE operation_key = $1",
    )
    .bind(key)
    .fetch_optional(pool)
    .await?;
    let task = sqlx::query_as(
        "SELECT task_id, payload_hash, created_at FROM handoff_consumer.crm_task WHERE operation_key = $1",
    )
    .bind(key)
    .fetch_optional(pool)
    .await?;
    let ledger = histories(pool, key).await?;
    let conflicts = sqlx::query_as(
        r#"SELECT id, operation_key, reason, incoming_hash, existing_hash, stream_sequence, recorded_at,
                  resolved_at, resolved_by, resolution
             FROM handoff_consumer.review WHERE operation_key = $1 ORDER BY id"#,
    )
    .bind(key)
    .fetch_all(pool)
    .await?;
    let dead_letters = sqlx::query_as(
        r#"SELECT id, stream_sequence, message_id, reason, deliveries, recorded_at
             FROM handoff_consumer.dead_letter WHERE message_id = $1 ORDER BY id"#,
    )
    .bind(key)
    .fetch_all(pool)
    .await?;
    // Each ledger history carries its own account's resolutions; these are the others (conflicts,
    // dead letters, pauses of the key's action type), shown once whatever the accounts.
    let audit = sqlx::query_as(
        r#"SELECT actor, action, reason, receipt, at FROM handoff_consumer.audit
            WHERE account IS NULL
              AND (operation_key = $1 OR action_type = split_part($1, ':', 1) || ':' || split_part($1, ':', 2))
            ORDER BY id"#,
    )
    .bind(key)
    .fetch_all(pool)
    .await?;
    Ok(ConsumerRecord { inbox, task, ledger, conflicts, dead_letters, audit })
}

/// Consumer-side findings of one chunk of inbox rows (see [`inbox_chunk`]).
#[derive(Debug, Clone, Default)]
pub struct InboxChunk {
    /// Keys in scope, with their stream sequence, in key order.
    pub keys: Vec<(String, i64)>,
    /// Keys recorded as handled whose task (local) or ledger row (remote) is missing.
    pub task_missing: Vec<String>,
    /// Where the next chunk starts; `None` at the end.
    pub next: Option<String>,
}

/// The next `limit` inbox rows after `after` (key order, the primary key), restricted to rows
/// received since `since` and with a stream sequence in `first..=last`; and which of them lack
/// their task or ledger row.
pub async fn inbox_chunk(
    pool: &PgPool,
    after: &str,
    limit: i64,
    since: Option<DateTime<Utc>>,
    first: i64,
    last: i64,
) -> Result<InboxChunk, sqlx::Error> {
    const INBOX_CHUNK: &str = r#"
        WITH chunk AS MATERIALIZED (
            SELECT operation_key, stream_sequence, outcome, received_at FROM handoff_consumer.inbox
             WHERE operation_key > $1 ORDER BY operation_key LIMIT $2
        )
        SELECT c.operation_key, c.stream_sequence,
               ($3::timestamptz IS NULL OR c.received_at >= $3) AND c.stream_sequence BETWEEN $4 AND $5 AS in_scope,
               CASE c.outcome
                    WHEN 'task_created' THEN NOT EXISTS (SELECT 1 FROM handoff_consumer.crm_task AS t
                                                          WHERE t.operation_key = c.operation_key)
                    WHEN 'task_existed' THEN NOT EXISTS (SELECT 1 FROM handoff_consumer.crm_task AS t
                                                          WHERE t.operation_key = c.operation_key)
                    WHEN 'accepted' THEN NOT EXISTS (SELECT 1 FROM handoff_consumer.crm_operation AS o
                                                      WHERE o.operation_key = c.operation_key)
                    ELSE false END AS task_missing
          FROM chunk AS c ORDER BY c.operation_key"#;
    let rows: Vec<(String, i64, bool, bool)> =
        sqlx::query_as(INBOX_CHUNK).bind(after).bind(limit).bind(since).bind(first).bind(last).fetch_all(pool).await?;
    let next = (rows.len() as i64 >= limit).then(|| rows.last().map(|r| r.0.clone())).flatten();
    let mut chunk = InboxChunk { next, ..InboxChunk::default() };
    for (key, sequence, in_scope, task_missing) in rows {
        if !in_scope {
            continue;
        }
        if task_missing {
            chunk.task_missing.push(key.clone());
        }
        chunk.keys.push((key, sequence));
    }
    Ok(chunk)
}

/// Which of `keys` the inbox holds.
pub async fn received_keys(pool: &PgPool, keys: &[String]) -> Result<std::collections::HashSet<String>, sqlx::Error> {
    let rows: Vec<String> =
        sqlx::query_scalar("SELECT operation_key FROM handoff_consumer.inbox WHERE operation_key = ANY($1::text[])")
            .bind(keys)
            .fetch_all(pool)
            .await?;
    Ok(rows.into_iter().collect())
}

/// Pauses CRM calls of an action type (`namespace:action`): the dispatchers stop claiming its rows
/// at their next claim. Returns false when it was paused already (the audit row is added anyway).
pub async fn pause(pool: &PgPool, action_type: &str, actor: &str, reason: &str) -> Result<bool, ReviewError> {
    require(actor, reason)?;
    let mut tx = pool.begin().await?;
    let added = sqlx::query(
        "INSERT INTO handoff_consumer.paused_action (action_type, paused_by, reason) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
    )
    .bind(action_type)
    .bind(actor.trim())
    .bind(reason.trim())
    .execute(&mut *tx)
    .await?
    .rows_affected()
        > 0;
    ledger::insert_audit(&mut tx, &ledger::Audit::on_type(action_type, actor, "pause", reason)).await?;
    tx.commit().await?;
    Ok(added)
}

/// Resumes CRM calls of an action type. Returns false when it was not paused.
pub async fn resume(pool: &PgPool, action_type: &str, actor: &str, reason: &str) -> Result<bool, ReviewError> {
    require(actor, reason)?;
    let mut tx = pool.begin().await?;
    let removed = sqlx::query("DELETE FROM handoff_consumer.paused_action WHERE action_type = $1")
        .bind(action_type)
        .execute(&mut *tx)
        .await?
        .rows_affected()
        > 0;
    ledger::insert_audit(&mut tx, &ledger::Audit::on_type(action_type, actor, "resume", reason)).await?;
    tx.commit().await?;
    // Wake the dispatchers: the rows are due already.
    sqlx::query("SELECT pg_notify($1, '')").bind(crate::remote::dispatcher::NOTIFY_CHANNEL).execute(pool).await?;
    Ok(removed)
}

fn require(actor: &str, reason: &str) -> Result<(), ReviewError> {
    if actor.trim().is_empty() {
        return Err(ReviewError::Missing("actor"));
    }
    if reason.trim().is_empty() {
        return Err(ReviewError::Missing("reason"));
    }
    Ok(())
}

/// One conflict, by id.
pub async fn conflict(pool: &PgPool, id: i64) -> Result<ConflictRow, ReviewError> {
    sqlx::query_as(
        r#"SELECT id, operation_key, reason, incoming_hash, existing_hash, stream_sequence, recorded_at,
                  resolved_at, resolved_by, resolution
             FROM handoff_consumer.review WHERE id = $1"#,
    )
    .bind(id)
    .fetch_optional(pool)
    .await?
    .ok_or(ReviewError::NoSuchRow("conflict", id))
}

/// A person decided a conflict (the approved task stays as it is; a changed action needs a new
/// approval under a new key version): resolves it with an audit row. Nothing else changes.
pub async fn resolve_conflict(pool: &PgPool, id: i64, actor: &str, reason: &str) -> Result<ConflictRow, ReviewError> {
    require(actor, reason)?;
    let mut tx = pool.begin().await?;
    let key: Option<(String, bool)> = sqlx::query_as(
        "SELECT operation_key, resolved_at IS NOT NULL FROM handoff_consumer.review WHERE id = $1 FOR UPDATE",
    )
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((key, resolved)) = key else { return Err(ReviewError::NoSuchRow("conflict", id)) };
    if resolved {
        return Err(ReviewError::AlreadyResolved("conflict", id));
    }
    sqlx::query(
        "UPDATE handoff_consumer.review SET resolved_at = now(), resolved_by = $2, resolution = $3 WHERE id = $1",
    )
    .bind(id)
    .bind(actor.trim())
    .bind(reason.trim())
    .execute(&mut *tx)
    .await?;
    ledger::insert_audit(&mut tx, &ledger::Audit::on_key(&key, actor, "resolve_conflict", reason)).await?;
    tx.commit().await?;
    conflict(pool, id).await
}

/// A dead letter in full, for `dead-letter show`: its headers, and its body only when asked for
/// (it may hold personal data).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct DeadLetterDetail {
    pub id: i64,
    pub stream_sequence: i64,
    pub subject: String,
    pub message_id: Option<String>,
    pub reason: String,
    pub deliveries: i64,
    pub headers: sqlx::types::Json<serde_json::Value>,
    #[serde(skip)]
    pub body: Vec<u8>,
    pub recorded_at: DateTime<Utc>,
    pub replay_requested_at: Option<DateTime<Utc>>,
    pub replay_requested_by: Option<String>,
    pub last_replay: Option<String>,
    pub resolved_at: Option<DateTime<Utc>>,
    pub resolved_by: Option<String>,
    pub resolution: Option<String>,
}

/// One dead letter, by id.
pub async fn dead_letter(pool: &PgPool, id: i64) -> Result<DeadLetterDetail, ReviewError> {
    sqlx::query_as(
        r#"SELECT id, stream_sequence, subject, message_id, reason, deliveries, headers, body, recorded_at,
                  replay_requested_at, replay_requested_by, last_replay, resolved_at, resolved_by, resolution
             FROM handoff_consumer.dead_letter WHERE id = $1"#,
    )
    .bind(id)
    .fetch_optional(pool)
    .await?
    .ok_or(ReviewError::NoSuchRow("dead letter", id))
}

/// Asks the replicas to replay a dead letter once its cause is fixed (they pick it up at their
/// next sample interval; see `Consumer::replay_requested`), with an audit row.
pub async fn request_replay(pool: &PgPool, id: i64, actor: &str, reason: &str) -> Result<(), ReviewError> {
    require(actor, reason)?;
    let mut tx = pool.begin().await?;
    let row: Option<(Option<String>, bool)> = sqlx::query_as(
        "SELECT message_id, resolved_at IS NOT NULL FROM handoff_consumer.dead_letter WHERE id = $1 FOR UPDATE",
    )
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((message_id, resolved)) = row else { return Err(ReviewError::NoSuchRow("dead letter", id)) };
    if resolved {
        return Err(ReviewError::AlreadyResolved("dead letter", id));
    }
    sqlx::query(
        r#"UPDATE handoff_consumer.dead_letter SET replay_requested_at = now(), replay_requested_by = $2
            WHERE id = $1"#,
    )
    .bind(id)
    .bind(actor.trim())
    .execute(&mut *tx)
    .await?;
    let reason = format!("dead letter {id}: {}", reason.trim());
    let audit = ledger::Audit {
        key: message_id.as_deref(),
        account: None,
        action_type: None,
        actor,
        action: "replay_dead_letter",
        reason: &reason,
        receipt: None,
    };
    ledger::insert_audit(&mut tx, &audit).await?;
    tx.commit().await?;
    Ok(())
}
