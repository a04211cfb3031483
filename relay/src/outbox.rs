//! The outbox tables: recording approved actions (the producer API) and the relay's claim and mark
//! statements. All SQL touching `handoff.approved_action` and `handoff.outbox` lives here.
//!
//! Every relay statement is one short transaction over a whole batch: claim (lease + attempt count),
//! then, after the network, one mark for the published rows and one for the failed ones. No
//! transaction is ever open while a message is on the wire.

use std::time::Duration;

use chrono::{DateTime, Utc};
use handoff_shared::envelope::ApprovalError;
use handoff_shared::{Approval, CanonicalPayload, KeyError, OperationKey, PayloadError};
use sqlx::{Acquire, PgConnection, PgPool};

/// The SQLSTATE `handoff.record_approved_action` raises for invalid input.
pub const SQLSTATE_INVALID: &str = "HO422";
/// The SQLSTATE it raises when the key is recorded with a different payload.
pub const SQLSTATE_CONFLICT: &str = "HO409";

/// An action a person approved, validated and ready to record.
#[derive(Debug, Clone)]
pub struct ApprovedAction {
    pub key: OperationKey,
    pub payload: CanonicalPayload,
    pub approval: Approval,
}

impl ApprovedAction {
    /// Validates raw producer input; nothing is written when this fails.
    pub fn parse(
        key: &str,
        payload: serde_json::Value,
        approved_by: &str,
        approved_at: DateTime<Utc>,
    ) -> Result<Self, RecordError> {
        Ok(Self {
            key: key.parse()?,
            payload: CanonicalPayload::new(payload)?,
            approval: Approval::new(approved_by, approved_at)?,
        })
    }
}

/// What recording did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// A new approved action and its outbox row were written.
    Created,
    /// The same key was already recorded with an equal payload; nothing was written.
    AlreadyRecorded,
}

/// Why an approved action was not recorded. In every case nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error(transparent)]
    InvalidKey(#[from] KeyError),
    #[error(transparent)]
    InvalidPayload(#[from] PayloadError),
    #[error(transparent)]
    InvalidApproval(#[from] ApprovalError),
    /// Rejected by the database's own checks (SQLSTATE HO422): the SQL contract is the final word.
    #[error("rejected as invalid by handoff.record_approved_action: {0}")]
    Rejected(String),
    /// The key already names a different approved payload: a changed action needs a new approval
    /// under a new key version, never a silent overwrite.
    #[error("operation key {0} is already recorded with a different payload")]
    Conflict(OperationKey),
    /// The database failed; the caller's transaction decides what happens to its other writes.
    #[error("database error while recording an approved action")]
    Database(#[source] sqlx::Error),
}

/// Records an approved action and its outbox row **inside the caller's transaction** (pass
/// `&mut *tx`), so the business write, the approval and the delivery intent commit together.
///
/// It runs in a savepoint: on `Conflict` or `Rejected` only the savepoint rolls back and the
/// caller's transaction stays usable. The rules are the SQL function's, so both producer paths agree.
pub async fn record_approved_action(conn: &mut PgConnection, action: &ApprovedAction) -> Result<Recorded, RecordError> {
    let mut savepoint = conn.begin().await.map_err(RecordError::Database)?;
    let payload = sqlx::types::Json(action.payload.value());
    let result: Result<(bool,), sqlx::Error> =
        sqlx::query_as("SELECT created FROM handoff.record_approved_action($1, $2, $3, $4, $5)")
            .bind(action.key.as_str())
            .bind(payload)
            .bind(action.approval.approved_by())
            .bind(action.approval.approved_at())
            .bind(action.payload.hash().to_string())
            .fetch_one(&mut *savepoint)
            .await;
    match result {
        Ok((created,)) => {
            savepoint.commit().await.map_err(RecordError::Database)?;
            Ok(if created { Recorded::Created } else { Recorded::AlreadyRecorded })
        }
        // Dropping the savepoint rolls it back; the caller's transaction continues.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(SQLSTATE_CONFLICT) => {
            Err(RecordError::Conflict(action.key.clone()))
        }
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(SQLSTATE_INVALID) => {
            Err(RecordError::Rejected(e.message().to_owned()))
        }
        Err(e) => Err(RecordError::Database(e)),
    }
}

/// A row a relay holds under lease, joined with its approved action.
#[derive(Debug, sqlx::FromRow)]
pub struct ClaimedRow {
    pub id: i64,
    pub operation_key: String,
    /// Attempts including this one.
    pub attempts: i32,
    pub created_at: DateTime<Utc>,
    /// The payload as jsonb text; canonicalized by the relay.
    pub payload: String,
    pub payload_hash: Option<String>,
    pub approved_by: String,
    pub approved_at: DateTime<Utc>,
    pub recorded_at: DateTime<Utc>,
}

/// Claims up to `limit` due rows for `owner` until `now + lease`, counting the attempt.
///
/// `SKIP LOCKED` lets several relays claim disjoint batches without waiting on each other; the
/// lease (the row's `next_attempt_at`) hands a dead relay's rows to the others once it expires.
/// The `= ANY(ARRAY(...))` shape keeps the planner on the `outbox_due` index for large batches.
pub async fn claim_due_rows(
    pool: &PgPool,
    owner: &str,
    limit: i64,
    lease: Duration,
) -> Result<Vec<ClaimedRow>, sqlx::Error> {
    const CLAIM_DUE_ROWS: &str = r#"
        UPDATE handoff.outbox AS o
           SET attempts = o.attempts + 1,
               lease_owner = $2,
               next_attempt_at = now() + make_interval(secs => $3),
               updated_at = now()
          FROM handoff.approved_action AS a
         WHERE o.id = ANY(ARRAY(
                   SELECT id FROM handoff.outbox
                    WHERE state = 'pending' AND next_attempt_at <= now()
                    ORDER BY next_attempt_at
                    LIMIT $1
                      FOR UPDATE SKIP LOCKED))
           AND a.operation_key = o.operation_key
     RETURNING o.id, o.operation_key, o.attempts, o.created_at, a.payload::text AS payload,
               a.payload_hash, a.approved_by, a.approved_at, a.recorded_at"#;
    sqlx::query_as(CLAIM_DUE_ROWS).bind(limit).bind(owner).bind(lease.as_secs_f64()).fetch_all(pool).await
}

/// One published row: its stream position and whether the broker already had it.
#[derive(Debug, Clone)]
pub struct PublishedRow {
    pub id: i64,
    pub operation_key: String,
    pub sequence: u64,
    pub duplicate: bool,
    /// Set when the row had no stored hash yet (recorded through the SQL function).
    pub computed_hash: Option<String>,
}

/// Marks rows published with their PubAck, and stores hashes the relay computed, in one statement.
/// No lease check: once the broker holds the message, `published` is the truth whoever marks it.
pub async fn mark_published(pool: &PgPool, stream: &str, rows: &[PublishedRow]) -> Result<u64, sqlx::Error> {
    const MARK_PUBLISHED: &str = r#"
        WITH hashed AS (
            UPDATE handoff.approved_action AS a
               SET payload_hash = h.hash
              FROM UNNEST($5::text[], $6::text[]) AS h(operation_key, hash)
             WHERE a.operation_key = h.operation_key AND a.payload_hash IS NULL
        )
        UPDATE handoff.outbox AS o
           SET state = 'published', stream = $1, stream_sequence = u.seq, duplicate = u.dup,
               published_at = now(), updated_at = now(), lease_owner = NULL, last_error = NULL
          FROM UNNEST($2::bigint[], $3::bigint[], $4::bool[]) AS u(id, seq, dup)
         WHERE o.id = u.id AND o.state = 'pending'"#;
    if rows.is_empty() {
        return Ok(0);
    }
    let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
    let seqs: Vec<i64> = rows.iter().map(|r| r.sequence as i64).collect();
    let dups: Vec<bool> = rows.iter().map(|r| r.duplicate).collect();
    let (hash_keys, hashes): (Vec<&str>, Vec<&str>) =
        rows.iter().filter_map(|r| r.computed_hash.as_deref().map(|h| (r.operation_key.as_str(), h))).unzip();
    let done = sqlx::query(MARK_PUBLISHED)
        .bind(stream)
        .bind(ids)
        .bind(seqs)
        .bind(dups)
        .bind(hash_keys)
        .bind(hashes)
        .execute(pool)
        .await?;
    Ok(done.rows_affected())
}

/// What happens to a row whose publish did not succeed.
#[derive(Debug, Clone)]
pub struct FailedRow {
    pub id: i64,
    pub outcome: Failure,
    /// The reason, stored in `last_error` (never a payload body).
    pub error: String,
}

/// The decision for a failed row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Failure {
    /// Due again after the delay.
    RetryAfter(Duration),
    /// Stops for an operator: budget exhausted or a permanent error.
    Block,
}

/// Reschedules or blocks failed rows in one statement, only where `owner` still holds the lease
/// (if it expired, another relay owns the row now and its outcome wins).
pub async fn mark_failed(pool: &PgPool, owner: &str, rows: &[FailedRow]) -> Result<u64, sqlx::Error> {
    const MARK_FAILED: &str = r#"
        UPDATE handoff.outbox AS o
           SET state = u.state,
               next_attempt_at = now() + make_interval(secs => u.delay),
               last_error = u.error, lease_owner = NULL, updated_at = now()
          FROM UNNEST($1::bigint[], $2::text[], $3::float8[], $4::text[]) AS u(id, state, delay, error)
         WHERE o.id = u.id AND o.state = 'pending' AND o.lease_owner = $5"#;
    if rows.is_empty() {
        return Ok(0);
    }
    let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
    let states: Vec<&str> = rows
        .iter()
        .map(|r| match r.outcome {
            Failure::RetryAfter(_) => "pending",
            Failure::Block => "blocked",
        })
        .collect();
    let delays: Vec<f64> = rows
        .iter()
        .map(|r| match r.outcome {
            Failure::RetryAfter(d) => d.as_secs_f64(),
            Failure::Block => 0.0,
        })
        .collect();
    let errors: Vec<&str> = rows.iter().map(|r| r.error.as_str()).collect();
    let done =
        sqlx::query(MARK_FAILED).bind(ids).bind(states).bind(delays).bind(errors).bind(owner).execute(pool).await?;
    Ok(done.rows_affected())
}

/// Counts of outbox rows by state, for reports and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, sqlx::FromRow)]
pub struct OutboxCounts {
    pub pending: i64,
    pub published: i64,
    pub blocked: i64,
}

/// Counts rows by state.
pub async fn count_by_state(pool: &PgPool) -> Result<OutboxCounts, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT count(*) FILTER (WHERE state = 'pending')   AS pending,
                  count(*) FILTER (WHERE state = 'published') AS published,
                  count(*) FILTER (WHERE state = 'blocked')   AS blocked
             FROM handoff.outbox"#,
    )
    .fetch_one(pool)
    .await
}
