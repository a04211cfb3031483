//! The outbox tables: recording approved actions (the producer API) and the relay's claim, settle
//! and retention statements. All SQL touching `handoff.approved_action`, `handoff.outbox` and the
//! relay's own tables (`relay_cursor`, `relay_batch`, `published_range`) lives here.
//!
//! Two claim paths (see the migration `claim_by_range` for the why):
//! * **Range** (new rows, the happy path): one short transaction moves the shared cursor over the
//!   next rows in commit order and leases them as one `relay_batch` row. No per-row write.
//! * **Per row** (rows that failed, or were held back): the row's own lease and attempt count,
//!   `FOR UPDATE SKIP LOCKED` on the `outbox_retry_due` index.
//!
//! After the network, one statement ([`settle`]) releases the range and records its published rows
//! once, in the range's own `handoff.published_range` row (their ids and stream sequences; no write
//! per row), and reschedules or blocks the failed ones on their own rows. Rows of the per-row path
//! are marked one by one. A row's delivery state is therefore read from the view
//! `handoff.outbox_delivery` (see the migration `published_range`), never from the outbox's own
//! state columns. Blocked rows stay on the per-row path, never due (`next_attempt_at =
//! 'infinity'`), so they are counted from its small index. Every relay statement is short and
//! covers a whole batch; no transaction is ever open while a message is on the wire.

use std::time::Duration;

use chrono::{DateTime, Utc};
use handoff_shared::envelope::ApprovalError;
use handoff_shared::trace::BadTraceParent;
use handoff_shared::{Approval, CanonicalPayload, KeyError, OperationKey, PayloadError, TraceParent};
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
    /// The caller's W3C trace context, carried to the consumer and the CRM (not part of the
    /// approved payload).
    pub traceparent: Option<TraceParent>,
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
            traceparent: None,
        })
    }

    /// Attaches the caller's W3C `traceparent` (from the request that approved the action).
    pub fn with_traceparent(self, traceparent: &str) -> Result<Self, RecordError> {
        Ok(Self { traceparent: Some(traceparent.parse()?), ..self })
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
    #[error(transparent)]
    InvalidTraceParent(#[from] BadTraceParent),
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
        sqlx::query_as("SELECT created FROM handoff.record_approved_action($1, $2, $3, $4, $5, $6)")
            .bind(action.key.as_str())
            .bind(payload)
            .bind(action.approval.approved_by())
            .bind(action.approval.approved_at())
            .bind(action.payload.hash().to_string())
            .bind(action.traceparent.map(|tp| tp.to_string()))
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
    pub traceparent: Option<String>,
    /// For a row re-queued after the broker lost its message: the sequence the lost message had.
    /// A PubAck naming it as a duplicate means the broker still remembers the id of the message it
    /// lost (inside its duplicate window) and stored nothing.
    pub lost_sequence: Option<i64>,
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
           a.approved_at, a.recorded_at, a.traceparent, o.stream_sequence AS lost_sequence
      FROM handoff.relay_batch AS b
      JOIN handoff.outbox AS o
        ON (o.transaction_id, o.id) > (b.after_transaction_id, b.after_outbox_id)
       AND (o.transaction_id, o.id) <= (b.last_transaction_id, b.last_outbox_id)
     CROSS JOIN LATERAL (
           SELECT payload::text AS payload, payload_hash, approved_by, approved_at, recorded_at, traceparent
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
     RETURNING o.id, o.operation_key, o.attempts, o.created_at, o.stream_sequence
    )
    SELECT c.id, c.operation_key, c.attempts, c.created_at, a.payload, a.payload_hash, a.approved_by,
           a.approved_at, a.recorded_at, a.traceparent, c.stream_sequence AS lost_sequence
      FROM claimed AS c
     CROSS JOIN LATERAL (
           SELECT payload::text AS payload, payload_hash, approved_by, approved_at, recorded_at, traceparent
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
/// * When its snapshot shows a row after the cursor (`seen`, the cursor as the snapshot has it),
///   the statement locks the cursor's row before it scans (`cursor` is `FOR NO KEY UPDATE`): under
///   READ COMMITTED a claim that finds another relay moving the cursor waits for it and then reads
///   the moved value, so the range starts where the other one ended and ranges never overlap. The
///   lock is held for this one statement only (no explicit transaction, nothing held across round
///   trips); a claim with nothing to do takes no lock and no transaction id. The scan still reads
///   the statement's snapshot: if the moved cursor has left no row below this snapshot's horizon,
///   nothing is claimed and the claim reports `contended` (the caller claims again at once, on a
///   fresh snapshot). An earlier form moved the cursor by compare-and-set after the scan; a claim
///   that lost the race had scanned its whole range for nothing (measured with 4 relays: more
///   lost claims than ranges claimed).
/// * The result always has a first status row; the rows of the range, with their approvals
///   (looked up per row by primary key, see [`ROWS_IN_RANGE`]), follow in commit order.
pub const CLAIM_NEW_RANGE: &str = r#"
    WITH seen AS MATERIALIZED (
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
    ), work AS MATERIALIZED (
        SELECT NOT (SELECT expired_range OR due_retries FROM priority)
               AND EXISTS (SELECT 1 FROM handoff.outbox AS o
                            WHERE (o.transaction_id, o.id) > ((SELECT transaction_id FROM seen), (SELECT outbox_id FROM seen))
                              AND o.transaction_id < (SELECT xmin FROM horizon)) AS found
    ), cursor AS MATERIALIZED (
        SELECT transaction_id, outbox_id FROM handoff.relay_cursor WHERE (SELECT found FROM work) FOR NO KEY UPDATE
    ), next AS MATERIALIZED (
        SELECT o.transaction_id, o.id, o.operation_key, o.created_at, o.state, o.retrying
          FROM handoff.outbox AS o
         WHERE (o.transaction_id, o.id) > ((SELECT transaction_id FROM cursor), (SELECT outbox_id FROM cursor))
           AND o.transaction_id < (SELECT xmin FROM horizon)
         ORDER BY o.transaction_id, o.id
         LIMIT $1
    ), last AS (
        SELECT transaction_id, id FROM next ORDER BY transaction_id DESC, id DESC LIMIT 1
    ), moved AS (
        UPDATE handoff.relay_cursor AS c SET transaction_id = last.transaction_id, outbox_id = last.id
          FROM last
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
               EXISTS (SELECT 1 FROM cursor) AND NOT EXISTS (SELECT 1 FROM moved)
                   AND (EXISTS (SELECT 1 FROM last)
                        OR (SELECT (transaction_id, outbox_id) FROM seen)
                           IS DISTINCT FROM (SELECT (transaction_id, outbox_id) FROM cursor)) AS contended,
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
           r.recorded_at, r.traceparent
      FROM status AS s
      LEFT JOIN (
           SELECT n.transaction_id, n.id, n.operation_key, n.created_at, a.payload, a.payload_hash,
                  a.approved_by, a.approved_at, a.recorded_at, a.traceparent
             FROM next AS n
            CROSS JOIN LATERAL (
                  SELECT payload::text AS payload, payload_hash, approved_by, approved_at, recorded_at, traceparent
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
    traceparent: Option<String>,
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
                traceparent: line.traceparent,
                // New rows were never published.
                lost_sequence: None,
            })
        })
        .collect();
    Ok(RangeClaim::Claimed(Claim { lease: Lease::Range { batch_id }, rows, more_due, held_back_by }))
}

/// [`horizon_passed`]: `$1` a transaction id, as text.
pub const HORIZON_PASSED: &str = "SELECT pg_snapshot_xmin(pg_current_snapshot()) > $1::text::xid8";

/// Whether every transaction older than `transaction_id` has ended, so rows it held back can be
/// claimed in commit order. One tiny query: cheap enough to poll every millisecond for a while.
pub async fn horizon_passed(pool: &PgPool, transaction_id: u64) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(HORIZON_PASSED).bind(transaction_id.to_string()).fetch_one(pool).await
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
    /// Its action type is paused: waits, never due, with the attempt not counted, until the action
    /// type is resumed ([`release_resumed`]).
    Hold,
}

/// What [`settle`] wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, sqlx::FromRow)]
pub struct Settled {
    pub published: i64,
    pub failed: i64,
}

/// The settle statement (see [`settle`]): `$1` stream; published rows `$2` ids, `$3` sequences,
/// `$4` duplicate flags, `$5` attempts; computed hashes `$6` keys, `$7` hashes; failed rows `$8` ids,
/// `$9` states (`pending`, `blocked`, or `held`: pending and never due), `$10` delays (s), `$11`
/// errors, `$12` attempts; `$13` owner; `$14` range (or NULL).
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
           SET state = CASE WHEN u.state = 'held' THEN 'pending' ELSE u.state END,
               attempts = u.attempts, retrying = true,
               -- Blocked and held rows are never due (see the migration `operability`).
               next_attempt_at = CASE WHEN u.state IN ('blocked', 'held') THEN 'infinity'
                                      ELSE now() + make_interval(secs => u.delay) END,
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

/// A range's settle (see [`settle`]): releases the range `$6` if `$5` still holds it and records
/// its published rows once, as one `handoff.published_range` row: `$1` stream, `$2` outbox ids,
/// `$3` their sequences, `$4` the ids the broker already held. No outbox row is written (see the
/// migration `published_range`). `held` is false when the lease was lost: nothing was written.
const SETTLE_RANGE_HEAD: &str = r#"
    WITH released AS (
        DELETE FROM handoff.relay_batch WHERE id = $6 AND lease_owner = $5
     RETURNING after_transaction_id, after_outbox_id, last_transaction_id, last_outbox_id, attempts
    ), recorded AS (
        INSERT INTO handoff.published_range
               (last_transaction_id, last_outbox_id, after_transaction_id, after_outbox_id, stream,
                outbox_ids, stream_sequences, duplicate_ids, attempts)
        SELECT r.last_transaction_id, r.last_outbox_id, r.after_transaction_id, r.after_outbox_id, $1,
               $2::bigint[], $3::bigint[], $4::bigint[], r.attempts
          FROM released AS r
         WHERE cardinality($2::bigint[]) > 0
     RETURNING 1
    )"#;

/// [`SETTLE_RANGE_HEAD`] alone: the happy path, a fraction of the size of [`SETTLE`] (planned once
/// per worker connection, see [`worker_statements`]).
pub static SETTLE_RANGE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{SETTLE_RANGE_HEAD}
    SELECT EXISTS (SELECT 1 FROM released) AS held, 0::bigint AS failed"
    )
});

/// [`SETTLE_RANGE_HEAD`] with failed rows, recorded on the per-row path while the range is held:
/// `$7` ids, `$8` states, `$9` delays (s), `$10` errors, `$11` attempts (as in [`SETTLE`]).
pub static SETTLE_RANGE_WITH_FAILURES: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "{SETTLE_RANGE_HEAD}, failed AS (
        UPDATE handoff.outbox AS o
           SET state = CASE WHEN u.state = 'held' THEN 'pending' ELSE u.state END,
               attempts = u.attempts, retrying = true,
               next_attempt_at = CASE WHEN u.state IN ('blocked', 'held') THEN 'infinity'
                                      ELSE now() + make_interval(secs => u.delay) END,
               last_error = u.error, lease_owner = NULL, updated_at = now()
          FROM UNNEST($7::bigint[], $8::text[], $9::float8[], $10::text[], $11::int[])
                   AS u(id, state, delay, error, attempts)
         WHERE o.id = u.id AND o.id = ANY($7::bigint[]) AND o.state = 'pending' AND NOT o.retrying
           AND EXISTS (SELECT 1 FROM released)
     RETURNING o.id
    )
    SELECT EXISTS (SELECT 1 FROM released) AS held, (SELECT count(*) FROM failed) AS failed"
    )
});

/// The statements of a batch's happy path, which the relay's workers run on connections that
/// plan each statement once ([`handoff_shared::config::Plans::OncePerConnection`]): each reaches
/// the outbox, the approvals and the ranges through an index whatever their size, which a test
/// checks on an empty outbox and a filled one. Every other statement is planned per execution.
pub fn worker_statements() -> [(&'static str, &'static str); 6] {
    [
        ("claim_new_range", CLAIM_NEW_RANGE),
        ("store_hashes", STORE_HASHES),
        ("settle_range", SETTLE_RANGE.as_str()),
        ("settle_range_with_failures", SETTLE_RANGE_WITH_FAILURES.as_str()),
        ("settle", SETTLE),
        ("horizon_passed", HORIZON_PASSED),
    ]
}

/// Stores hashes the relay computed for rows recorded without one (through the SQL function):
/// `$1` keys, `$2` hashes. Idempotent (only a missing hash is filled in), so it runs on its own
/// before a range's settle.
const STORE_HASHES: &str = r#"
    UPDATE handoff.approved_action AS a
       SET payload_hash = h.hash
      FROM UNNEST($1::text[], $2::text[]) AS h(operation_key, hash)
     WHERE a.operation_key = h.operation_key AND a.operation_key = ANY($1::text[])
       AND a.payload_hash IS NULL"#;

/// Records a claim's outcome: published rows with their PubAck (and hashes the relay computed),
/// failed rows rescheduled on the per-row path or blocked, and the range released.
///
/// * A range still held: its published rows are recorded once, in the range's own
///   `handoff.published_range` row, with no write per row ([`SETTLE_RANGE`]); failed rows get their
///   own state. Read a row's state through the view `handoff.outbox_delivery`.
/// * A range whose lease ran out and was taken over: its published rows are marked one by one
///   ([`SETTLE`]): once the broker holds the message, `published` is the truth, whoever holds the
///   lease now. The update changes no indexed column, so it is HOT. Failed rows are left to the
///   relay that holds the range now: its outcome wins.
/// * Rows of the retry path: marked one by one, failed rows only while `owner` holds their lease.
pub async fn settle(
    pool: &PgPool,
    owner: &str,
    stream: &str,
    lease: Lease,
    published: &[PublishedRow],
    failed: &[FailedRow],
) -> Result<Settled, sqlx::Error> {
    let (hash_keys, hashes): (Vec<&str>, Vec<&str>) =
        published.iter().filter_map(|r| r.computed_hash.as_deref().map(|h| (r.operation_key.as_str(), h))).unzip();
    match lease {
        Lease::Nothing => Ok(Settled::default()),
        Lease::Rows if published.is_empty() && failed.is_empty() => Ok(Settled::default()),
        Lease::Rows => settle_rows(pool, owner, stream, None, published, failed, (hash_keys, hashes)).await,
        Lease::Range { batch_id } => {
            if !hash_keys.is_empty() {
                sqlx::query(STORE_HASHES).bind(&hash_keys).bind(&hashes).execute(pool).await?;
            }
            let statement = if failed.is_empty() { SETTLE_RANGE.as_str() } else { SETTLE_RANGE_WITH_FAILURES.as_str() };
            let failures = Failures::of(failed);
            let duplicates: Vec<i64> = published.iter().filter(|r| r.duplicate).map(|r| r.id).collect();
            let query = sqlx::query_as(statement)
                .bind(stream)
                .bind(published.iter().map(|r| r.id).collect::<Vec<_>>())
                .bind(published.iter().map(|r| r.sequence as i64).collect::<Vec<_>>())
                .bind(duplicates)
                .bind(owner)
                .bind(batch_id);
            let query = if failed.is_empty() {
                query
            } else {
                query
                    .bind(failures.ids)
                    .bind(failures.states)
                    .bind(failures.delays)
                    .bind(failures.errors)
                    .bind(failures.attempts)
            };
            let (held, failed_count): (bool, i64) = query.fetch_one(pool).await?;
            if held {
                return Ok(Settled { published: published.len() as i64, failed: failed_count });
            }
            tracing::info!(
                batch_id,
                rows = published.len(),
                "range lease lost before its settle; marking its published rows one by one"
            );
            settle_rows(pool, owner, stream, Some(batch_id), published, &[], (Vec::new(), Vec::new())).await
        }
    }
}

/// Failed rows as the settle statements' parallel arrays.
struct Failures<'a> {
    ids: Vec<i64>,
    states: Vec<&'static str>,
    delays: Vec<f64>,
    errors: Vec<&'a str>,
    attempts: Vec<i32>,
}

impl<'a> Failures<'a> {
    fn of(failed: &'a [FailedRow]) -> Self {
        Self {
            ids: failed.iter().map(|r| r.id).collect(),
            states: failed
                .iter()
                .map(|r| match r.outcome {
                    Failure::RetryAfter(_) => "pending",
                    Failure::Block => "blocked",
                    Failure::Hold => "held",
                })
                .collect(),
            delays: failed
                .iter()
                .map(|r| match r.outcome {
                    Failure::RetryAfter(d) => d.as_secs_f64(),
                    Failure::Block | Failure::Hold => 0.0,
                })
                .collect(),
            errors: failed.iter().map(|r| r.error.as_str()).collect(),
            attempts: failed.iter().map(|r| r.attempts).collect(),
        }
    }
}

/// [`SETTLE`]: every row written one by one.
async fn settle_rows(
    pool: &PgPool,
    owner: &str,
    stream: &str,
    batch_id: Option<i64>,
    published: &[PublishedRow],
    failed: &[FailedRow],
    (hash_keys, hashes): (Vec<&str>, Vec<&str>),
) -> Result<Settled, sqlx::Error> {
    let failures = Failures::of(failed);
    sqlx::query_as(SETTLE)
        .bind(stream)
        .bind(published.iter().map(|r| r.id).collect::<Vec<_>>())
        .bind(published.iter().map(|r| r.sequence as i64).collect::<Vec<_>>())
        .bind(published.iter().map(|r| r.duplicate).collect::<Vec<_>>())
        .bind(published.iter().map(|r| r.attempts).collect::<Vec<_>>())
        .bind(hash_keys)
        .bind(hashes)
        .bind(failures.ids)
        .bind(failures.states)
        .bind(failures.delays)
        .bind(failures.errors)
        .bind(failures.attempts)
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

/// One step of range retention (see [`delete_expired_ranges`]): `$1` outbox rows at most, `$2`
/// retention seconds.
///
/// The oldest ranges come first in their primary key (commit order). The chunk takes ranges until
/// they list `$1` rows (at least one range); the expired ones are locked (`SKIP LOCKED`: another
/// relay's pass skips them) and deleted with the rows they list that the range still speaks for
/// (not re-queued: `NOT retrying`).
pub const DELETE_EXPIRED_RANGES: &str = r#"
    WITH oldest AS MATERIALIZED (
        SELECT last_transaction_id, last_outbox_id, published_at,
               sum(cardinality(outbox_ids)) OVER (ORDER BY last_transaction_id, last_outbox_id) AS listed
          FROM (SELECT * FROM handoff.published_range
                 ORDER BY last_transaction_id, last_outbox_id
                 LIMIT $1) AS p
    ), chunk AS MATERIALIZED (
        SELECT * FROM oldest WHERE listed <= $1
         UNION ALL
        (SELECT * FROM oldest ORDER BY last_transaction_id, last_outbox_id LIMIT 1)
    ), doomed AS MATERIALIZED (
        SELECT p.last_transaction_id, p.last_outbox_id, p.outbox_ids
          FROM handoff.published_range AS p
          JOIN (SELECT DISTINCT last_transaction_id, last_outbox_id, published_at FROM chunk) AS c
         USING (last_transaction_id, last_outbox_id)
         WHERE c.published_at < now() - make_interval(secs => $2)
           FOR UPDATE OF p SKIP LOCKED
    ), deleted_rows AS (
        DELETE FROM handoff.outbox AS o
         WHERE o.id = ANY(ARRAY(SELECT unnest(outbox_ids) FROM doomed))
           AND o.state = 'pending' AND NOT o.retrying
     RETURNING 1
    ), deleted_ranges AS (
        DELETE FROM handoff.published_range AS p
         USING doomed AS d
         WHERE (p.last_transaction_id, p.last_outbox_id) = (d.last_transaction_id, d.last_outbox_id)
     RETURNING 1
    )
    SELECT (SELECT count(*) FROM deleted_ranges) AS ranges,
           (SELECT count(*) FROM deleted_rows) AS deleted,
           (SELECT count(*) = 0 FROM oldest)
             OR EXISTS (SELECT 1 FROM chunk WHERE published_at >= now() - make_interval(secs => $2)) AS reached_young"#;

/// One step of range retention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct RangeRetentionStep {
    /// Ranges deleted.
    pub ranges: i64,
    /// Outbox rows deleted with them.
    pub deleted: i64,
    /// The step reached a range that is not old enough yet (or there was none): the pass can stop.
    pub reached_young: bool,
}

/// Deletes the oldest published ranges older than `retention`, with the outbox rows they list, up
/// to about `limit` rows in one short statement. Ranges are deleted oldest first, so a pass stops at
/// the first young one; a range another relay's pass holds is skipped.
pub async fn delete_expired_ranges(
    pool: &PgPool,
    limit: i64,
    retention: Duration,
) -> Result<RangeRetentionStep, sqlx::Error> {
    sqlx::query_as(DELETE_EXPIRED_RANGES).bind(limit).bind(retention.as_secs_f64()).fetch_one(pool).await
}

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

/// Counts rows by delivery state (as `handoff.outbox_delivery` says it), reading the whole table:
/// for reports and tests. The published ranges' lists are joined whole (a hash join), not probed
/// per row as the view does.
pub async fn count_by_state(pool: &PgPool) -> Result<OutboxCounts, sqlx::Error> {
    sqlx::query_as(
        r#"WITH listed AS (
               SELECT unnest(outbox_ids) AS id FROM handoff.published_range
           ), rows AS (
               SELECT CASE WHEN o.state = 'pending' AND NOT o.retrying AND l.id IS NOT NULL THEN 'published'
                           ELSE o.state END AS state
                 FROM handoff.outbox AS o LEFT JOIN listed AS l ON l.id = o.id
           )
           SELECT count(*) FILTER (WHERE state = 'pending')   AS pending,
                  count(*) FILTER (WHERE state = 'published') AS published,
                  count(*) FILTER (WHERE state = 'blocked')   AS blocked
             FROM rows"#,
    )
    .fetch_one(pool)
    .await
}

/// The backlog as the sampler sees it (see [`sample_backlog`]).
#[derive(Debug, Clone, Default, PartialEq, sqlx::FromRow)]
pub struct BacklogSample {
    /// Rows not yet acknowledged by the broker (new, in a claimed range, or retrying).
    pub pending: i64,
    pub blocked: i64,
    /// Age of the oldest pending row, seconds (0 when none).
    pub oldest_pending_s: f64,
    /// Committed rows waiting behind an older open write transaction.
    pub held_back: i64,
    /// Age of that transaction, seconds, when the role may see it in `pg_stat_activity`;
    /// otherwise the age of the oldest held-back row (how long it has held rows back at least).
    pub held_back_s: f64,
    /// The transaction holding rows back: `pid`, application and database, when visible.
    pub held_back_by: Option<String>,
    /// Action types paused by an operator.
    pub paused: i64,
    /// `pending` or `held_back` is above [`EXACT_BACKLOG_COUNT`] and estimated from row ids.
    pub estimated: bool,
}

/// Up to this many new and held-back rows are counted exactly; above it the sampler estimates
/// from row ids (counting a million-row backlog exactly every few seconds costs a second of a core
/// each time, and an operator reads "about a million" the same way).
pub const EXACT_BACKLOG_COUNT: i64 = 100_000;

/// Counts the backlog without scanning published rows: new rows after the cursor are read from the
/// commit-order index from the cursor on (at most [`EXACT_BACKLOG_COUNT`] of them, then estimated
/// from ids), held-back rows from the horizon on (likewise), rows in claimed ranges through the few
/// range rows, and retrying, held and blocked rows from the per-row path's small index. `NOT
/// retrying` keeps rows rescued to the per-row path from being counted twice. The oldest pending
/// row is the first in commit order, or an older retrying one.
pub async fn sample_backlog(pool: &PgPool) -> Result<BacklogSample, sqlx::Error> {
    const SAMPLE_BACKLOG: &str = r#"
        WITH cursor AS MATERIALIZED (
            SELECT transaction_id, outbox_id FROM handoff.relay_cursor
        ), horizon AS MATERIALIZED (
            SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin
        ), head AS MATERIALIZED (
            SELECT o.id, o.created_at
              FROM handoff.outbox AS o
             WHERE (o.transaction_id, o.id) > ((SELECT transaction_id FROM cursor), (SELECT outbox_id FROM cursor))
               AND o.state = 'pending' AND NOT o.retrying
             ORDER BY o.transaction_id, o.id
             LIMIT $1
        ), tail AS MATERIALIZED (
            SELECT o.id, o.created_at
              FROM handoff.outbox AS o
             WHERE o.transaction_id >= (SELECT xmin FROM horizon)
               AND o.state = 'pending' AND NOT o.retrying
             ORDER BY o.transaction_id, o.id
             LIMIT $1
        ), in_ranges AS MATERIALIZED (
            SELECT o.created_at
              FROM handoff.relay_batch AS b
              JOIN handoff.outbox AS o
                ON (o.transaction_id, o.id) > (b.after_transaction_id, b.after_outbox_id)
               AND (o.transaction_id, o.id) <= (b.last_transaction_id, b.last_outbox_id)
             WHERE o.state = 'pending' AND NOT o.retrying
        ), per_row AS MATERIALIZED (
            SELECT o.created_at, o.state
              FROM handoff.outbox AS o
             WHERE o.retrying
        ), holder AS (
            SELECT a.pid, a.application_name, a.datname, a.xact_start
              FROM pg_stat_activity AS a
             WHERE a.backend_xid IS NOT NULL
               AND a.backend_xid::text::bigint = (SELECT xmin FROM horizon)::text::bigint % 4294967296
             LIMIT 1
        ), counted AS (
            SELECT (SELECT count(*) FROM head) AS head, (SELECT count(*) FROM tail) AS tail,
                   (SELECT max(id) FROM handoff.outbox) AS max_id
        )
        SELECT CASE WHEN c.head < $1 THEN c.head
                    ELSE GREATEST($1, c.max_id - (SELECT outbox_id FROM cursor)) END
                 + (SELECT count(*) FROM in_ranges)
                 + (SELECT count(*) FROM per_row WHERE state = 'pending') AS pending,
               (SELECT count(*) FROM per_row WHERE state = 'blocked') AS blocked,
               COALESCE(extract(epoch FROM now() - LEAST(
                   (SELECT min(created_at) FROM head),
                   (SELECT min(created_at) FROM in_ranges),
                   (SELECT min(created_at) FROM per_row WHERE state = 'pending')))::float8, 0) AS oldest_pending_s,
               CASE WHEN c.tail < $1 THEN c.tail
                    ELSE GREATEST($1, c.max_id - (SELECT min(id) FROM tail) + 1) END AS held_back,
               CASE WHEN c.tail > 0 THEN
                   COALESCE(extract(epoch FROM now() - (SELECT xact_start FROM holder))::float8,
                            extract(epoch FROM now() - (SELECT min(created_at) FROM tail))::float8)
               ELSE 0 END AS held_back_s,
               CASE WHEN c.tail > 0 THEN
                   (SELECT format('pid %s (%s) in database %s', pid, COALESCE(NULLIF(application_name, ''), 'no application name'),
                                  COALESCE(datname, '?')) FROM holder)
               END AS held_back_by,
               (SELECT count(*) FROM handoff.paused_action) AS paused,
               c.head >= $1 OR c.tail >= $1 AS estimated
          FROM counted AS c"#;
    sqlx::query_as(SAMPLE_BACKLOG).bind(EXACT_BACKLOG_COUNT).fetch_one(pool).await
}

/// One key on the producer side, for `handoff-admin explain`: the approval, the outbox row (gone
/// after retention for published rows), and operator actions.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ProducerRecord {
    pub approval: Option<ApprovalRow>,
    pub outbox: Option<OutboxRow>,
    pub audit: Vec<AuditRow>,
}

/// The approved action as recorded (no payload body: it may hold personal data).
#[derive(Debug, Clone, serde::Serialize, sqlx::FromRow)]
pub struct ApprovalRow {
    pub payload_hash: Option<String>,
    pub traceparent: Option<String>,
    pub approved_by: String,
    pub approved_at: DateTime<Utc>,
    pub recorded_at: DateTime<Utc>,
}

/// The outbox row as an operator reads it.
#[derive(Debug, Clone, serde::Serialize, sqlx::FromRow)]
pub struct OutboxRow {
    pub state: String,
    pub attempts: i32,
    /// `None` when the row is never due by itself (blocked, or held while its action type is paused).
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    pub stream: Option<String>,
    pub stream_sequence: Option<i64>,
    pub duplicate: Option<bool>,
    pub published_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// Claimed by a relay right now (a range or a row lease that has not run out).
    pub leased: bool,
}

/// An operator action on the producer side.
#[derive(Debug, Clone, serde::Serialize, sqlx::FromRow)]
pub struct AuditRow {
    pub operation_key: Option<String>,
    pub action_type: Option<String>,
    pub actor: String,
    pub action: String,
    pub reason: String,
    pub at: DateTime<Utc>,
}

/// Everything the producer database holds about `key`.
pub async fn producer_record(pool: &PgPool, key: &str) -> Result<ProducerRecord, sqlx::Error> {
    let approval = sqlx::query_as(
        r#"SELECT payload_hash, traceparent, approved_by, approved_at, recorded_at
             FROM handoff.approved_action WHERE operation_key = $1"#,
    )
    .bind(key)
    .fetch_optional(pool)
    .await?;
    let outbox = sqlx::query_as(
        r#"SELECT o.state, o.attempts, NULLIF(o.next_attempt_at, 'infinity') AS next_attempt_at, o.last_error,
                  o.stream, o.stream_sequence, o.duplicate, o.published_at, o.created_at, o.updated_at,
                  (o.state = 'pending' AND (
                      (o.retrying AND o.lease_owner IS NOT NULL AND o.next_attempt_at > now())
                      OR EXISTS (SELECT 1 FROM handoff.relay_batch AS b
                                  WHERE (o.transaction_id, o.id) > (b.after_transaction_id, b.after_outbox_id)
                                    AND (o.transaction_id, o.id) <= (b.last_transaction_id, b.last_outbox_id)
                                    AND b.lease_until > now()))) AS leased
             FROM handoff.outbox_delivery AS o WHERE o.operation_key = $1"#,
    )
    .bind(key)
    .fetch_optional(pool)
    .await?;
    let audit = sqlx::query_as(
        r#"SELECT operation_key, action_type, actor, action, reason, at FROM handoff.audit
            WHERE operation_key = $1
               OR action_type = split_part($1, ':', 1) || ':' || split_part($1, ':', 2)
            ORDER BY id"#,
    )
    .bind(key)
    .fetch_all(pool)
    .await?;
    Ok(ProducerRecord { approval, outbox, audit })
}

/// Which of `keys` have an approved action (for reconciliation: a key the consumer received that
/// the producer never recorded).
pub async fn recorded_keys(pool: &PgPool, keys: &[String]) -> Result<std::collections::HashSet<String>, sqlx::Error> {
    let rows: Vec<String> =
        sqlx::query_scalar("SELECT operation_key FROM handoff.approved_action WHERE operation_key = ANY($1::text[])")
            .bind(keys)
            .fetch_all(pool)
            .await?;
    Ok(rows.into_iter().collect())
}

/// An action type an operator paused.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct PausedAction {
    pub action_type: String,
    pub paused_by: String,
    pub reason: String,
    pub paused_at: DateTime<Utc>,
}

/// The paused action types, by name.
pub async fn paused_action_types(pool: &PgPool) -> Result<Vec<PausedAction>, sqlx::Error> {
    sqlx::query_as("SELECT action_type, paused_by, reason, paused_at FROM handoff.paused_action ORDER BY action_type")
        .fetch_all(pool)
        .await
}

/// Makes held rows due again whose action type is no longer paused, in one statement (the tail of
/// the per-row path's index: held rows are never due). The relay runs it with every sample, so a
/// `resume` takes effect within the sample interval even if a relay held a row on a stale view of
/// the pauses. Returns how many rows were released.
pub async fn release_resumed(pool: &PgPool) -> Result<u64, sqlx::Error> {
    const RELEASE_RESUMED: &str = r#"
        UPDATE handoff.outbox AS o
           SET next_attempt_at = now(), last_error = 'released: action type resumed', updated_at = now()
         WHERE o.retrying AND o.next_attempt_at = 'infinity' AND o.state = 'pending'
           AND NOT EXISTS (SELECT 1 FROM handoff.paused_action AS p
                            WHERE p.action_type = split_part(o.operation_key, ':', 1) || ':' || split_part(o.operation_key, ':', 2))"#;
    Ok(sqlx::query(RELEASE_RESUMED).execute(pool).await?.rows_affected())
}

/// Why an operator action on the producer side was refused. Nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("no outbox row for operation key {0}")]
    NotFound(String),
    #[error("operation key {key} is {state}, not blocked; only blocked rows can be unblocked")]
    NotBlocked { key: String, state: String },
    #[error("{0:?} is not an action type (namespace:action)")]
    BadActionType(String),
    /// Every operator action names who made it and why.
    #[error("{0} must not be empty")]
    Missing(&'static str),
    #[error("producer database error")]
    Database(#[from] sqlx::Error),
}

fn require(actor: &str, reason: &str) -> Result<(), OperatorError> {
    if actor.trim().is_empty() {
        return Err(OperatorError::Missing("actor"));
    }
    if reason.trim().is_empty() {
        return Err(OperatorError::Missing("reason"));
    }
    Ok(())
}

/// Puts a blocked row back on the per-row path, due now, with a fresh attempt budget and an audit
/// row. A row blocked because its payload no longer matches its approval is blocked again at its
/// next claim: restore the approved payload first (or approve a new key version).
pub async fn unblock(pool: &PgPool, key: &str, actor: &str, reason: &str) -> Result<(), OperatorError> {
    require(actor, reason)?;
    let mut tx = pool.begin().await?;
    // The row is locked; its delivery state is read through the view.
    let state: Option<String> = sqlx::query_scalar(
        r#"SELECT d.state FROM handoff.outbox AS o JOIN handoff.outbox_delivery AS d USING (id)
            WHERE o.operation_key = $1 FOR UPDATE OF o"#,
    )
    .bind(key)
    .fetch_optional(&mut *tx)
    .await?;
    match state.as_deref() {
        None => return Err(OperatorError::NotFound(key.to_owned())),
        Some("blocked") => {}
        Some(other) => return Err(OperatorError::NotBlocked { key: key.to_owned(), state: other.to_owned() }),
    }
    sqlx::query(
        r#"UPDATE handoff.outbox
              SET state = 'pending', retrying = true, attempts = 0, next_attempt_at = now(), lease_owner = NULL,
                  last_error = 'unblocked by ' || $2 || ': ' || $3 || ' (was: ' || COALESCE(last_error, '?') || ')',
                  updated_at = now()
            WHERE operation_key = $1"#,
    )
    .bind(key)
    .bind(actor.trim())
    .bind(reason.trim())
    .execute(&mut *tx)
    .await?;
    audit(&mut tx, Some(key), None, actor, "unblock", reason).await?;
    tx.commit().await?;
    Ok(())
}

/// Pauses an action type: relays hold its rows (within their sample interval) without counting
/// attempts or blocking them. Pausing a paused type only adds the audit row.
pub async fn pause(pool: &PgPool, action_type: &str, actor: &str, reason: &str) -> Result<bool, OperatorError> {
    require(actor, reason)?;
    check_action_type(action_type)?;
    let mut tx = pool.begin().await?;
    let added = sqlx::query(
        "INSERT INTO handoff.paused_action (action_type, paused_by, reason) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
    )
    .bind(action_type)
    .bind(actor.trim())
    .bind(reason.trim())
    .execute(&mut *tx)
    .await?
    .rows_affected()
        > 0;
    audit(&mut tx, None, Some(action_type), actor, "pause", reason).await?;
    tx.commit().await?;
    Ok(added)
}

/// Resumes an action type: relays release its held rows within their sample interval.
pub async fn resume(pool: &PgPool, action_type: &str, actor: &str, reason: &str) -> Result<bool, OperatorError> {
    require(actor, reason)?;
    check_action_type(action_type)?;
    let mut tx = pool.begin().await?;
    let removed = sqlx::query("DELETE FROM handoff.paused_action WHERE action_type = $1")
        .bind(action_type)
        .execute(&mut *tx)
        .await?
        .rows_affected()
        > 0;
    audit(&mut tx, None, Some(action_type), actor, "resume", reason).await?;
    tx.commit().await?;
    Ok(removed)
}

/// `namespace:action`, as the key grammar spells those two parts.
pub fn check_action_type(action_type: &str) -> Result<(), OperatorError> {
    let probe = format!("{action_type}:v1:x");
    match probe.parse::<OperationKey>() {
        Ok(key) if key.action_type() == action_type => Ok(()),
        _ => Err(OperatorError::BadActionType(action_type.to_owned())),
    }
}

async fn audit(
    conn: &mut PgConnection,
    key: Option<&str>,
    action_type: Option<&str>,
    actor: &str,
    action: &str,
    reason: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO handoff.audit (operation_key, action_type, actor, action, reason) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(key)
    .bind(action_type)
    .bind(actor.trim())
    .bind(action)
    .bind(reason.trim())
    .execute(&mut *conn)
    .await?;
    Ok(())
}
