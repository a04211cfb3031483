//! The outbox tables: recording approved actions (the producer API) and the relay's claim, settle
//! and retention statements. All SQL touching `handoff.approved_action`, `handoff.outbox` and the
//! relay's own tables (`relay_cursor`, `relay_batch`) lives here.
//!
//! Two claim paths (see the migration `claim_by_range` for the why):
//! * **Range** (new rows, the happy path): one short transaction moves the shared cursor over the
//!   next rows in commit order and leases them as one `relay_batch` row. No per-row write.
//! * **Per row** (rows that failed, or were held back): the row's own lease and attempt count,
//!   `FOR UPDATE SKIP LOCKED` on the `outbox_retry_due` index.
//!
//! After the network, one statement ([`settle`]) marks the published rows, reschedules or blocks
//! the failed ones and releases the range. Every relay statement is short and covers a whole batch;
//! no transaction is ever open while a message is on the wire.

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

/// A row a relay holds, joined with its approved action.
#[derive(Debug, sqlx::FromRow)]
pub struct ClaimedRow {
    pub id: i64,
    pub operation_key: String,
    /// Attempts including this one: the range's attempts on the range path, the row's own on the
    /// retry path.
    pub attempts: i32,
    pub created_at: DateTime<Utc>,
    /// The payload as jsonb text; canonicalized by the relay.
    pub payload: String,
    pub payload_hash: Option<String>,
    pub approved_by: String,
    pub approved_at: DateTime<Utc>,
    pub recorded_at: DateTime<Utc>,
}

/// How claimed rows are held, and so how [`settle`] releases them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lease {
    /// Nothing was claimed.
    Nothing,
    /// A range of the outbox in commit order, leased as one `handoff.relay_batch` row.
    Range { batch_id: i64 },
    /// Rows leased one by one (the retry path): `lease_owner` and `next_attempt_at` on each row.
    Rows,
}

/// What one claim produced.
#[derive(Debug)]
pub struct Claim {
    pub lease: Lease,
    pub rows: Vec<ClaimedRow>,
    /// The claim was full: more rows may be due right now.
    pub more_due: bool,
    /// Committed rows wait behind an older transaction that is still open (see the migration
    /// `claim_by_range`): the transaction id of the oldest such row. It becomes claimable when
    /// every transaction older than it has ended ([`horizon_passed`]).
    pub held_back_by: Option<u64>,
}

impl Claim {
    fn nothing(held_back_by: Option<u64>) -> Self {
        Self { lease: Lease::Nothing, rows: Vec::new(), more_due: false, held_back_by }
    }
}

/// Re-claims one range whose relay let its lease run out (it died, or stalled), counting an
/// attempt for the whole range. Ranges are few (one per running batch), so this is a tiny scan.
pub async fn claim_expired_range(pool: &PgPool, owner: &str, lease: Duration) -> Result<Option<Claim>, sqlx::Error> {
    const CLAIM_EXPIRED_RANGE: &str = r#"
        UPDATE handoff.relay_batch AS b
           SET lease_owner = $1, lease_until = now() + make_interval(secs => $2), attempts = b.attempts + 1
         WHERE b.id = (SELECT id FROM handoff.relay_batch
                        WHERE lease_until <= now()
                        ORDER BY id
                        LIMIT 1
                          FOR UPDATE SKIP LOCKED)
     RETURNING b.id"#;
    let batch: Option<i64> =
        sqlx::query_scalar(CLAIM_EXPIRED_RANGE).bind(owner).bind(lease.as_secs_f64()).fetch_optional(pool).await?;
    let Some(batch_id) = batch else { return Ok(None) };
    let rows = sqlx::query_as(ROWS_IN_RANGE).bind(batch_id).fetch_all(pool).await?;
    tracing::info!(batch_id, rows = rows.len(), "re-claimed a range whose lease ran out");
    // Another expired range may be waiting: look again before idling.
    Ok(Some(Claim { lease: Lease::Range { batch_id }, rows, more_due: true, held_back_by: None }))
}

/// The rows of a range still waiting to be published, with their approved actions. Rows that moved
/// to the per-row path (a failure, a held-back rescue) or were published already are skipped.
/// The approval is looked up per row by primary key (`LATERAL ... LIMIT 1`): joined plainly, a
/// range that is a few percent of the table can be planned as a hash join over all approvals.
pub const ROWS_IN_RANGE: &str = r#"
    SELECT o.id, o.operation_key, b.attempts, o.created_at, a.payload, a.payload_hash, a.approved_by,
           a.approved_at, a.recorded_at
      FROM handoff.relay_batch AS b
      JOIN handoff.outbox AS o
        ON (o.transaction_id, o.id) > (b.after_transaction_id, b.after_outbox_id)
       AND (o.transaction_id, o.id) <= (b.last_transaction_id, b.last_outbox_id)
     CROSS JOIN LATERAL (
           SELECT payload::text AS payload, payload_hash, approved_by, approved_at, recorded_at
             FROM handoff.approved_action
            WHERE operation_key = o.operation_key
            LIMIT 1) AS a
     WHERE b.id = $1 AND o.state = 'pending' AND NOT o.retrying
     ORDER BY o.transaction_id, o.id"#;

/// The retry-path claim (see [`claim_retry_rows`]): `$1` limit, `$2` owner, `$3` lease seconds.
pub const CLAIM_RETRY_ROWS: &str = r#"
    WITH claimed AS (
        UPDATE handoff.outbox AS o
           SET attempts = o.attempts + 1,
               lease_owner = $2,
               next_attempt_at = now() + make_interval(secs => $3),
               updated_at = now()
         WHERE o.id = ANY(ARRAY(
                   SELECT id FROM handoff.outbox
                    WHERE retrying AND next_attempt_at <= now()
                    ORDER BY next_attempt_at
                    LIMIT $1
                      FOR UPDATE SKIP LOCKED))
     RETURNING o.id, o.operation_key, o.attempts, o.created_at
    )
    SELECT c.id, c.operation_key, c.attempts, c.created_at, a.payload, a.payload_hash, a.approved_by,
           a.approved_at, a.recorded_at
      FROM claimed AS c
     CROSS JOIN LATERAL (
           SELECT payload::text AS payload, payload_hash, approved_by, approved_at, recorded_at
             FROM handoff.approved_action
            WHERE operation_key = c.operation_key
            LIMIT 1) AS a"#;

/// Claims up to `limit` due rows of the per-row retry path for `owner` until `now + lease`,
/// counting the attempt.
///
/// `SKIP LOCKED` lets several relays claim disjoint batches without waiting on each other; the
/// lease (the row's `next_attempt_at`) hands a dead relay's rows to the others once it expires.
/// The `= ANY(ARRAY(...))` shape keeps the planner on the `outbox_retry_due` index for large batches.
pub async fn claim_retry_rows(
    pool: &PgPool,
    owner: &str,
    limit: i64,
    lease: Duration,
) -> Result<Vec<ClaimedRow>, sqlx::Error> {
    sqlx::query_as(CLAIM_RETRY_ROWS).bind(limit).bind(owner).bind(lease.as_secs_f64()).fetch_all(pool).await
}

/// Claims the next range of new rows in commit order, in one statement and one round trip:
/// `$1` rows at most, leased to `$2` for `$3` seconds; with `$4` it first looks for work that goes
/// first (an expired range, due retries) and claims nothing if there is some.
///
/// * The range is the next `$1` rows after the cursor whose transaction id is below the horizon
///   (`pg_snapshot_xmin`: every older transaction has ended, so no row can appear behind it).
///   The cursor and the horizon are init plans, so this is an index range scan on
///   `outbox_commit_order` that stops after `$1` entries, whatever the backlog; nothing is sorted.
/// * The cursor moves by compare-and-set: the update matches only if the cursor still holds the
///   value this statement read. If another relay moved it first, READ COMMITTED re-checks the
///   condition on the new version, nothing is written and the claim reports `contended` (the
///   caller just claims again). Ranges therefore never overlap, without a lock held across
///   statements or an explicit transaction.
/// * The result always has a first status row; the rows of the range, with their approvals
///   (looked up per row by primary key, see [`ROWS_IN_RANGE`]), follow in commit order.
pub const CLAIM_NEW_RANGE: &str = r#"
    WITH cursor AS MATERIALIZED (
        SELECT transaction_id, outbox_id FROM handoff.relay_cursor
    ), horizon AS MATERIALIZED (
        SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin
    ), priority AS MATERIALIZED (
        -- The retry check is a scalar subquery in index order, which keeps it on its (small)
        -- partial index. As an EXISTS the planner drops ORDER BY and LIMIT and, expecting an early
        -- hit, may scan the whole outbox sequentially (seen: 40 ms per claim on 40k rows).
        SELECT $4 AND EXISTS (SELECT 1 FROM handoff.relay_batch WHERE lease_until <= now()) AS expired_range,
               $4 AND (SELECT next_attempt_at FROM handoff.outbox WHERE retrying AND next_attempt_at <= now()
                        ORDER BY next_attempt_at LIMIT 1) IS NOT NULL AS due_retries
    ), next AS MATERIALIZED (
        SELECT o.transaction_id, o.id, o.operation_key, o.created_at, o.state, o.retrying
          FROM handoff.outbox AS o
         WHERE (o.transaction_id, o.id) > ((SELECT transaction_id FROM cursor), (SELECT outbox_id FROM cursor))
           AND o.transaction_id < (SELECT xmin FROM horizon)
           AND NOT (SELECT expired_range OR due_retries FROM priority)
         ORDER BY o.transaction_id, o.id
         LIMIT $1
    ), last AS (
        SELECT transaction_id, id FROM next ORDER BY transaction_id DESC, id DESC LIMIT 1
    ), moved AS (
        UPDATE handoff.relay_cursor AS c SET transaction_id = last.transaction_id, outbox_id = last.id
          FROM last
         WHERE c.transaction_id = (SELECT transaction_id FROM cursor)
           AND c.outbox_id = (SELECT outbox_id FROM cursor)
     RETURNING c.outbox_id
    ), batch AS (
        INSERT INTO handoff.relay_batch
               (after_transaction_id, after_outbox_id, last_transaction_id, last_outbox_id, lease_owner, lease_until)
        SELECT c.transaction_id, c.outbox_id, last.transaction_id, last.id, $2, now() + make_interval(secs => $3)
          FROM cursor AS c, last, moved
     RETURNING id
    ), status AS (
        SELECT (SELECT id FROM batch) AS batch_id,
               (SELECT count(*) FROM next) AS scanned,
               EXISTS (SELECT 1 FROM last) AND NOT EXISTS (SELECT 1 FROM moved) AS contended,
               p.expired_range,
               p.due_retries,
               -- The oldest committed row the horizon has not passed: the transaction to wait for.
               -- Such rows are all after the cursor (it never passes the horizon), and a plain
               -- bound on the first index column starts the scan at the horizon: only the tail.
               (SELECT o.transaction_id::text FROM handoff.outbox AS o
                 WHERE o.transaction_id >= (SELECT xmin FROM horizon)
                   AND o.state = 'pending' AND NOT o.retrying
                 ORDER BY o.transaction_id, o.id
                 LIMIT 1) AS held_back_by
          FROM priority AS p
    )
    SELECT s.batch_id, s.scanned, s.contended, s.expired_range, s.due_retries, s.held_back_by,
           r.id, r.operation_key, r.created_at, r.payload, r.payload_hash, r.approved_by, r.approved_at,
           r.recorded_at
      FROM status AS s
      LEFT JOIN (
           SELECT n.transaction_id, n.id, n.operation_key, n.created_at, a.payload, a.payload_hash,
                  a.approved_by, a.approved_at, a.recorded_at
             FROM next AS n
            CROSS JOIN LATERAL (
                  SELECT payload::text AS payload, payload_hash, approved_by, approved_at, recorded_at
                    FROM handoff.approved_action
                   WHERE operation_key = n.operation_key
                   LIMIT 1) AS a
            WHERE n.state = 'pending' AND NOT n.retrying) AS r
        ON s.batch_id IS NOT NULL
     ORDER BY r.transaction_id NULLS FIRST, r.id"#;

/// One line of [`CLAIM_NEW_RANGE`]'s result: the status, and a claimed row if there is one.
#[derive(Debug, sqlx::FromRow)]
struct RangeLine {
    batch_id: Option<i64>,
    scanned: i64,
    contended: bool,
    expired_range: bool,
    due_retries: bool,
    held_back_by: Option<String>,
    id: Option<i64>,
    operation_key: Option<String>,
    created_at: Option<DateTime<Utc>>,
    payload: Option<String>,
    payload_hash: Option<String>,
    approved_by: Option<String>,
    approved_at: Option<DateTime<Utc>>,
    recorded_at: Option<DateTime<Utc>>,
}

/// What [`claim_new_range`] found.
#[derive(Debug)]
pub enum RangeClaim {
    /// A range (possibly empty) or nothing to claim.
    Claimed(Claim),
    /// Work that goes first is waiting; nothing was claimed.
    Priority { expired_range: bool, due_retries: bool },
    /// Another relay moved the cursor first; nothing was claimed. Claim again.
    Contended,
}

/// Claims the next range of new rows in commit order (see [`CLAIM_NEW_RANGE`] and the migration
/// `claim_by_range`): one statement that writes one cursor update and one range row, however many
/// rows it covers. With `check_priority`, defers to expired ranges and due retries.
pub async fn claim_new_range(
    pool: &PgPool,
    owner: &str,
    limit: i64,
    lease: Duration,
    check_priority: bool,
) -> Result<RangeClaim, sqlx::Error> {
    let lines: Vec<RangeLine> = sqlx::query_as(CLAIM_NEW_RANGE)
        .bind(limit)
        .bind(owner)
        .bind(lease.as_secs_f64())
        .bind(check_priority)
        .fetch_all(pool)
        .await?;
    let Some(status) = lines.first() else { return Err(sqlx::Error::RowNotFound) };
    if status.expired_range || status.due_retries {
        return Ok(RangeClaim::Priority { expired_range: status.expired_range, due_retries: status.due_retries });
    }
    if status.contended {
        return Ok(RangeClaim::Contended);
    }
    let held_back_by = status.held_back_by.as_deref().and_then(|xid| xid.parse().ok());
    let Some(batch_id) = status.batch_id else { return Ok(RangeClaim::Claimed(Claim::nothing(held_back_by))) };
    let more_due = status.scanned >= limit;
    let rows = lines
        .into_iter()
        .filter_map(|line| {
            Some(ClaimedRow {
                id: line.id?,
                operation_key: line.operation_key?,
                // A new range: every row's first attempt.
                attempts: 1,
                created_at: line.created_at?,
                payload: line.payload?,
                payload_hash: line.payload_hash,
                approved_by: line.approved_by?,
                approved_at: line.approved_at?,
                recorded_at: line.recorded_at?,
            })
        })
        .collect();
    Ok(RangeClaim::Claimed(Claim { lease: Lease::Range { batch_id }, rows, more_due, held_back_by }))
}

/// Whether every transaction older than `transaction_id` has ended, so rows it held back can be
/// claimed in commit order. One tiny query: cheap enough to poll every millisecond for a while.
pub async fn horizon_passed(pool: &PgPool, transaction_id: u64) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_snapshot_xmin(pg_current_snapshot()) > $1::text::xid8")
        .bind(transaction_id.to_string())
        .fetch_one(pool)
        .await
}

/// Hands committed rows that have waited at least `held_back` behind an older open transaction to
/// the per-row retry path, due now. Without this, one long write transaction anywhere in the
/// cluster would hold back every row committed after it began. Only the tail of the commit order
/// (rows at or above the horizon) is scanned. Returns how many rows moved.
pub async fn rescue_held_back_rows(pool: &PgPool, held_back: Duration, limit: i64) -> Result<u64, sqlx::Error> {
    const RESCUE_HELD_BACK_ROWS: &str = r#"
        UPDATE handoff.outbox AS o
           SET retrying = true, next_attempt_at = now(), updated_at = now()
         WHERE o.id = ANY(ARRAY(
                   SELECT id FROM handoff.outbox
                    -- Above the horizon, hence after the cursor; the scan starts at the horizon.
                    WHERE transaction_id >= pg_snapshot_xmin(pg_current_snapshot())
                      AND state = 'pending' AND NOT retrying
                      AND created_at <= now() - make_interval(secs => $1)
                    ORDER BY transaction_id, id
                    LIMIT $2
                      FOR UPDATE SKIP LOCKED))"#;
    let done = sqlx::query(RESCUE_HELD_BACK_ROWS).bind(held_back.as_secs_f64()).bind(limit).execute(pool).await?;
    Ok(done.rows_affected())
}

/// One published row: its stream position and whether the broker already had it.
#[derive(Debug, Clone)]
pub struct PublishedRow {
    pub id: i64,
    pub operation_key: String,
    /// Attempts including the one that published it.
    pub attempts: i32,
    pub sequence: u64,
    pub duplicate: bool,
    /// Set when the row had no stored hash yet (recorded through the SQL function).
    pub computed_hash: Option<String>,
}

/// What happens to a row whose publish did not succeed.
#[derive(Debug, Clone)]
pub struct FailedRow {
    pub id: i64,
    /// Attempts so far, including the failed one.
    pub attempts: i32,
    pub outcome: Failure,
    /// The reason, stored in `last_error` (never a payload body).
    pub error: String,
}

/// The decision for a failed row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Failure {
    /// Due again after the delay, on the per-row retry path.
    RetryAfter(Duration),
    /// Stops for an operator: budget exhausted or a permanent error.
    Block,
}

/// What [`settle`] wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, sqlx::FromRow)]
pub struct Settled {
    pub published: i64,
    pub failed: i64,
}

/// The settle statement (see [`settle`]): `$1` stream; published rows `$2` ids, `$3` sequences,
/// `$4` duplicate flags, `$5` attempts; computed hashes `$6` keys, `$7` hashes; failed rows `$8` ids,
/// `$9` states, `$10` delays (s), `$11` errors, `$12` attempts; `$13` owner; `$14` range (or NULL).
pub const SETTLE: &str = r#"
    WITH hashed AS (
        UPDATE handoff.approved_action AS a
           SET payload_hash = h.hash
          FROM UNNEST($6::text[], $7::text[]) AS h(operation_key, hash)
         WHERE a.operation_key = h.operation_key AND a.operation_key = ANY($6::text[])
           AND a.payload_hash IS NULL
    ), published AS (
        UPDATE handoff.outbox AS o
           SET state = 'published', attempts = u.attempts, stream = $1, stream_sequence = u.seq,
               duplicate = u.dup, published_at = now(), updated_at = now(),
               lease_owner = NULL, last_error = NULL, retrying = false
          FROM UNNEST($2::bigint[], $3::bigint[], $4::bool[], $5::int[]) AS u(id, seq, dup, attempts)
         -- `o.id = ANY(..)` gives the planner an index path to exactly these rows: joined with
         -- the unnested arrays alone, a batch that is 1% of the table gets a hash join over a
         -- sequential scan of all of it (the platform notes' claim trap, in the mark).
         WHERE o.id = u.id AND o.id = ANY($2::bigint[]) AND o.state = 'pending'
     RETURNING o.id
    ), range_held AS (
        SELECT EXISTS (SELECT 1 FROM handoff.relay_batch WHERE id = $14 AND lease_owner = $13) AS held
    ), failed AS (
        UPDATE handoff.outbox AS o
           SET state = u.state, attempts = u.attempts, retrying = (u.state = 'pending'),
               next_attempt_at = now() + make_interval(secs => u.delay),
               last_error = u.error, lease_owner = NULL, updated_at = now()
          FROM UNNEST($8::bigint[], $9::text[], $10::float8[], $11::text[], $12::int[])
                   AS u(id, state, delay, error, attempts),
               range_held AS r
         WHERE o.id = u.id AND o.id = ANY($8::bigint[]) AND o.state = 'pending'
           AND CASE WHEN $14::bigint IS NULL THEN o.lease_owner = $13
                    ELSE r.held AND NOT o.retrying END
     RETURNING o.id
    ), released AS (
        DELETE FROM handoff.relay_batch WHERE id = $14 AND lease_owner = $13
    )
    SELECT (SELECT count(*) FROM published) AS published, (SELECT count(*) FROM failed) AS failed"#;

/// The happy path of [`SETTLE`]: a range whose rows were all published, with no hash to store.
/// The same published-row update, without the parts that have nothing to do: a statement a
/// fraction of the size is planned in a fraction of the time, and every settle is planned afresh
/// (`force_custom_plan`), which at low load costs more than the update itself.
pub const SETTLE_PUBLISHED_RANGE: &str = r#"
    WITH published AS (
        UPDATE handoff.outbox AS o
           SET state = 'published', attempts = u.attempts, stream = $1, stream_sequence = u.seq,
               duplicate = u.dup, published_at = now(), updated_at = now()
          FROM UNNEST($2::bigint[], $3::bigint[], $4::bool[], $5::int[]) AS u(id, seq, dup, attempts)
         WHERE o.id = u.id AND o.id = ANY($2::bigint[]) AND o.state = 'pending'
     RETURNING o.id
    ), released AS (
        DELETE FROM handoff.relay_batch WHERE id = $7 AND lease_owner = $6
    )
    SELECT (SELECT count(*) FROM published) AS published, 0::bigint AS failed"#;

/// Records a claim's outcome in one statement: published rows with their PubAck (and hashes the
/// relay computed), failed rows rescheduled on the per-row path or blocked, and the range released.
///
/// Published rows are marked whoever holds the lease now: once the broker holds the message,
/// `published` is the truth. The update changes no indexed column, so it is HOT (no index entries).
/// Failed rows are recorded only while `owner` still holds their lease (the range, or the row on the
/// retry path): if it ran out, another relay owns them now and its outcome wins.
pub async fn settle(
    pool: &PgPool,
    owner: &str,
    stream: &str,
    lease: Lease,
    published: &[PublishedRow],
    failed: &[FailedRow],
) -> Result<Settled, sqlx::Error> {
    let batch_id = match lease {
        Lease::Nothing => return Ok(Settled::default()),
        Lease::Range { batch_id } => Some(batch_id),
        Lease::Rows if published.is_empty() && failed.is_empty() => return Ok(Settled::default()),
        Lease::Rows => None,
    };
    let (hash_keys, hashes): (Vec<&str>, Vec<&str>) =
        published.iter().filter_map(|r| r.computed_hash.as_deref().map(|h| (r.operation_key.as_str(), h))).unzip();
    if let (Some(batch_id), true, true) = (batch_id, failed.is_empty(), hash_keys.is_empty()) {
        return sqlx::query_as(SETTLE_PUBLISHED_RANGE)
            .bind(stream)
            .bind(published.iter().map(|r| r.id).collect::<Vec<_>>())
            .bind(published.iter().map(|r| r.sequence as i64).collect::<Vec<_>>())
            .bind(published.iter().map(|r| r.duplicate).collect::<Vec<_>>())
            .bind(published.iter().map(|r| r.attempts).collect::<Vec<_>>())
            .bind(owner)
            .bind(batch_id)
            .fetch_one(pool)
            .await;
    }
    let states: Vec<&str> = failed
        .iter()
        .map(|r| match r.outcome {
            Failure::RetryAfter(_) => "pending",
            Failure::Block => "blocked",
        })
        .collect();
    let delays: Vec<f64> = failed
        .iter()
        .map(|r| match r.outcome {
            Failure::RetryAfter(d) => d.as_secs_f64(),
            Failure::Block => 0.0,
        })
        .collect();
    sqlx::query_as(SETTLE)
        .bind(stream)
        .bind(published.iter().map(|r| r.id).collect::<Vec<_>>())
        .bind(published.iter().map(|r| r.sequence as i64).collect::<Vec<_>>())
        .bind(published.iter().map(|r| r.duplicate).collect::<Vec<_>>())
        .bind(published.iter().map(|r| r.attempts).collect::<Vec<_>>())
        .bind(hash_keys)
        .bind(hashes)
        .bind(failed.iter().map(|r| r.id).collect::<Vec<_>>())
        .bind(states)
        .bind(delays)
        .bind(failed.iter().map(|r| r.error.as_str()).collect::<Vec<_>>())
        .bind(failed.iter().map(|r| r.attempts).collect::<Vec<_>>())
        .bind(owner)
        .bind(batch_id)
        .fetch_one(pool)
        .await
}

/// Where a retention pass stopped: the last row it examined, in commit order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetentionPosition {
    /// `transaction_id` as text (sqlx has no `xid8` type).
    pub transaction_id: String,
    pub outbox_id: i64,
}

impl RetentionPosition {
    /// Before every row.
    pub fn start() -> Self {
        Self { transaction_id: "0".into(), outbox_id: 0 }
    }
}

/// One step of retention.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetentionStep {
    pub examined: i64,
    pub deleted: i64,
    /// The chunk reached rows that are not old enough yet: the pass can stop.
    pub reached_young: bool,
    /// Where the next step continues (None when nothing was examined).
    pub next: Option<RetentionPosition>,
}

/// One retention step (see [`delete_expired`]): after (`$1` transaction id as text, `$2` outbox
/// id), `$3` rows, `$4` retention seconds.
pub const DELETE_EXPIRED: &str = r#"
    WITH chunk AS MATERIALIZED (
        SELECT transaction_id, id, state, published_at, retrying
          FROM handoff.outbox
         WHERE (transaction_id, id) > ($1::text::xid8, $2::bigint)
           AND (transaction_id, id) <= ((SELECT transaction_id FROM handoff.relay_cursor),
                                        (SELECT outbox_id FROM handoff.relay_cursor))
         ORDER BY transaction_id, id
         LIMIT $3
    ), doomed AS (
        SELECT o.id, o.operation_key
          FROM handoff.outbox AS o JOIN chunk AS c ON c.id = o.id
         WHERE c.state = 'published' AND c.published_at < now() - make_interval(secs => $4)
           FOR UPDATE OF o SKIP LOCKED
    ), deleted AS (
        DELETE FROM handoff.outbox AS o USING doomed AS d WHERE o.id = d.id RETURNING o.operation_key
    ), last AS (
        SELECT transaction_id::text AS transaction_id, id FROM chunk ORDER BY transaction_id DESC, id DESC LIMIT 1
    )
    SELECT (SELECT count(*) FROM chunk) AS examined,
           (SELECT count(*) FROM deleted) AS deleted,
           EXISTS (SELECT 1 FROM chunk
                    WHERE (state = 'published' AND published_at >= now() - make_interval(secs => $4))
                       OR (state = 'pending' AND NOT retrying)) AS reached_young,
           (SELECT transaction_id FROM last) AS last_transaction_id,
           (SELECT id FROM last) AS last_id"#;

/// The approved action stays: it is the approval record, and it keeps "same key + different
/// payload is a conflict" (and "same key + same payload adds nothing") true at the producer for
/// ever, not only during the retention.
/// Deletes published outbox rows published more than `retention` ago among
/// the next `limit` rows after `after` in commit order, in one short statement.
///
/// Rows are walked in commit order, which is roughly age order: the walk stops at the first chunk
/// that holds a row still too young (published recently, or not yet claimed), so a pass costs the
/// old rows plus one chunk, not the table. Blocked rows and rows still on the retry path are kept
/// and walked over. Only rows behind the claim cursor are looked at. `SKIP LOCKED` lets two relays
/// run retention at once without waiting on each other.
pub async fn delete_expired(
    pool: &PgPool,
    after: &RetentionPosition,
    limit: i64,
    retention: Duration,
) -> Result<RetentionStep, sqlx::Error> {
    let (examined, deleted, reached_young, last_transaction_id, last_id): (
        i64,
        i64,
        bool,
        Option<String>,
        Option<i64>,
    ) = sqlx::query_as(DELETE_EXPIRED)
        .bind(&after.transaction_id)
        .bind(after.outbox_id)
        .bind(limit)
        .bind(retention.as_secs_f64())
        .fetch_one(pool)
        .await?;
    let next = last_transaction_id
        .zip(last_id)
        .map(|(transaction_id, outbox_id)| RetentionPosition { transaction_id, outbox_id });
    Ok(RetentionStep { examined, deleted, reached_young, next })
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
