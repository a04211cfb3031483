//! The consumer's tables: inbox (dedup by operation key), review and dead-letter. Every statement is
//! batched (`UNNEST`) and runs inside the batch transaction the caller passes in.

use std::collections::{HashMap, HashSet};

use sqlx::{PgConnection, PgPool};

/// The words of the inbox's `outcome` column (the migrations' CHECK constraint lists the same).
pub mod outcome {
    pub const TASK_CREATED: &str = "task_created";
    pub const TASK_EXISTED: &str = "task_existed";
    pub const CONFLICT: &str = "conflict";
    pub const ACCEPTED: &str = "accepted";
}

/// A verified message to record in the inbox.
#[derive(Debug, Clone)]
pub struct Arrival {
    pub operation_key: String,
    pub payload_hash: String,
    pub stream_sequence: i64,
}

/// Inserts arrivals whose key is new, with `outcome` (the CRM's usual one, see
/// [`Crm::USUAL_OUTCOME`](crate::crm::Crm::USUAL_OUTCOME)), and returns those keys. A key already
/// present (a redelivery, a re-publish after the broker forgot the id, or a conflicting payload) is
/// left untouched.
pub async fn insert_new_arrivals(
    conn: &mut PgConnection,
    arrivals: &[Arrival],
    outcome: &str,
) -> Result<HashSet<String>, sqlx::Error> {
    const INSERT_NEW_ARRIVALS: &str = r#"
        INSERT INTO handoff_consumer.inbox (operation_key, payload_hash, stream_sequence, outcome)
        SELECT k, h, s, $4 FROM UNNEST($1::text[], $2::text[], $3::bigint[]) AS u(k, h, s)
        ON CONFLICT (operation_key) DO NOTHING
        RETURNING operation_key"#;
    let keys: Vec<&str> = arrivals.iter().map(|a| a.operation_key.as_str()).collect();
    let hashes: Vec<&str> = arrivals.iter().map(|a| a.payload_hash.as_str()).collect();
    let seqs: Vec<i64> = arrivals.iter().map(|a| a.stream_sequence).collect();
    let rows: Vec<(String,)> = sqlx::query_as(INSERT_NEW_ARRIVALS)
        .bind(keys)
        .bind(hashes)
        .bind(seqs)
        .bind(outcome)
        .fetch_all(&mut *conn)
        .await?;
    Ok(rows.into_iter().map(|(k,)| k).collect())
}

/// The inbox's half of the one-statement batch ([`Crm::create_usual`](crate::crm::Crm::create_usual)):
/// `crm_insert` (the CRM's own `INSERT`, with its parameters from `$5` on) preceded by the insert of
/// every arrival (`$1` keys, `$2` payload hashes, `$3` stream sequences, `$4` outcome) as a
/// data-modifying CTE. Neither insert has `ON CONFLICT`: a key the inbox (or the CRM) already holds
/// fails the whole statement with a unique violation ([`is_not_usual`]), so it writes all or nothing.
/// Built once from constant SQL only (no input reaches the text), hence `AssertSqlSafe` where it runs.
pub(crate) fn with_new_arrivals(crm_insert: &str) -> String {
    format!(
        r#"
        WITH arrived AS (
            INSERT INTO handoff_consumer.inbox (operation_key, payload_hash, stream_sequence, outcome)
            SELECT k, h, s, $4 FROM UNNEST($1::text[], $2::text[], $3::bigint[]) AS u(k, h, s)
        )
        {crm_insert}"#
    )
}

/// A [`with_new_arrivals`] statement: it returns each created row's operation key and, where the
/// CRM has one, its task id.
pub(crate) type UsualQuery<'q> =
    sqlx::query::QueryAs<'q, sqlx::Postgres, (String, Option<i64>), sqlx::postgres::PgArguments>;

/// Binds the inbox's parameters (`$1`-`$4`) of a [`with_new_arrivals`] statement.
pub(crate) fn bind_new_arrivals<'q>(
    query: UsualQuery<'q>,
    arrivals: &'q [Arrival],
    outcome: &'q str,
) -> UsualQuery<'q> {
    query
        .bind(arrivals.iter().map(|a| a.operation_key.as_str()).collect::<Vec<_>>())
        .bind(arrivals.iter().map(|a| a.payload_hash.as_str()).collect::<Vec<_>>())
        .bind(arrivals.iter().map(|a| a.stream_sequence).collect::<Vec<_>>())
        .bind(outcome)
}

/// Whether `error` is a [`with_new_arrivals`] statement finding a key already held: the batch is
/// not the usual one, nothing was written, and the batch transaction decides each message instead.
pub fn is_not_usual(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(e) if e.is_unique_violation())
}

/// The recorded payload hash of each key already in the inbox.
pub async fn recorded_hashes(conn: &mut PgConnection, keys: &[&str]) -> Result<HashMap<String, String>, sqlx::Error> {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT operation_key, payload_hash FROM handoff_consumer.inbox WHERE operation_key = ANY($1::text[])",
    )
    .bind(keys)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows.into_iter().collect())
}

/// Corrects the outcome of new arrivals the CRM did not handle the usual way (the task already
/// existed, or held other content). The task itself is found by its operation key in the CRM.
pub async fn record_unusual_outcomes(
    conn: &mut PgConnection,
    outcomes: &[(&str, &'static str)],
) -> Result<(), sqlx::Error> {
    const RECORD_OUTCOMES: &str = r#"
        UPDATE handoff_consumer.inbox AS i SET outcome = u.outcome
          FROM UNNEST($1::text[], $2::text[]) AS u(k, outcome)
         WHERE i.operation_key = u.k"#;
    if outcomes.is_empty() {
        return Ok(());
    }
    let keys: Vec<&str> = outcomes.iter().map(|o| o.0).collect();
    let kinds: Vec<&str> = outcomes.iter().map(|o| o.1).collect();
    sqlx::query(RECORD_OUTCOMES).bind(keys).bind(kinds).execute(&mut *conn).await?;
    Ok(())
}

/// Something a person must decide: the same key arrived with content different from what is held.
#[derive(Debug, Clone)]
pub struct ReviewItem {
    pub operation_key: String,
    pub reason: String,
    pub incoming_hash: String,
    pub existing_hash: String,
    pub stream_sequence: i64,
}

/// Adds review items.
pub async fn record_reviews(conn: &mut PgConnection, items: &[ReviewItem]) -> Result<(), sqlx::Error> {
    const RECORD_REVIEWS: &str = r#"
        INSERT INTO handoff_consumer.review (operation_key, reason, incoming_hash, existing_hash, stream_sequence)
        SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[])"#;
    if items.is_empty() {
        return Ok(());
    }
    sqlx::query(RECORD_REVIEWS)
        .bind(items.iter().map(|i| i.operation_key.as_str()).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.reason.as_str()).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.incoming_hash.as_str()).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.existing_hash.as_str()).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.stream_sequence).collect::<Vec<_>>())
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// A message that cannot be processed, kept whole.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    pub stream_sequence: i64,
    pub subject: String,
    pub message_id: Option<String>,
    pub reason: String,
    pub deliveries: i64,
    pub headers: serde_json::Value,
    pub body: Vec<u8>,
}

/// Adds dead letters. A redelivered poison message (crash before its Term) is recorded once.
pub async fn record_dead_letters(conn: &mut PgConnection, letters: &[DeadLetter]) -> Result<(), sqlx::Error> {
    const RECORD_DEAD_LETTERS: &str = r#"
        INSERT INTO handoff_consumer.dead_letter
               (stream_sequence, subject, message_id, reason, deliveries, headers, body)
        SELECT * FROM UNNEST($1::bigint[], $2::text[], $3::text[], $4::text[], $5::bigint[], $6::jsonb[], $7::bytea[])
        ON CONFLICT (stream_sequence, reason) DO NOTHING"#;
    if letters.is_empty() {
        return Ok(());
    }
    sqlx::query(RECORD_DEAD_LETTERS)
        .bind(letters.iter().map(|l| l.stream_sequence).collect::<Vec<_>>())
        .bind(letters.iter().map(|l| l.subject.as_str()).collect::<Vec<_>>())
        .bind(letters.iter().map(|l| l.message_id.as_deref()).collect::<Vec<_>>())
        .bind(letters.iter().map(|l| l.reason.as_str()).collect::<Vec<_>>())
        .bind(letters.iter().map(|l| l.deliveries).collect::<Vec<_>>())
        .bind(letters.iter().map(|l| l.headers.clone()).collect::<Vec<_>>())
        .bind(letters.iter().map(|l| l.body.clone()).collect::<Vec<_>>())
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Row counts of the consumer's tables, for reports and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, sqlx::FromRow)]
pub struct ConsumerCounts {
    pub inbox: i64,
    pub tasks: i64,
    pub reviews: i64,
    pub dead_letters: i64,
}

/// Counts rows in every consumer table.
pub async fn count_rows(pool: &PgPool) -> Result<ConsumerCounts, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT (SELECT count(*) FROM handoff_consumer.inbox)       AS inbox,
                  (SELECT count(*) FROM handoff_consumer.crm_task)    AS tasks,
                  (SELECT count(*) FROM handoff_consumer.review)      AS reviews,
                  (SELECT count(*) FROM handoff_consumer.dead_letter) AS dead_letters"#,
    )
    .fetch_one(pool)
    .await
}

/// Depths of what waits in the consumer's database (see [`sample_depths`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DepthSample {
    /// Ledger rows not settled, by state (`review` included).
    pub ledger: std::collections::BTreeMap<crate::remote::LedgerState, i64>,
    /// Age of the oldest unknown outcome, seconds (0 when none).
    pub oldest_unknown_s: f64,
    /// Unresolved conflicts.
    pub conflicts: i64,
    /// Unresolved dead letters.
    pub dead_letters: i64,
    pub paused: i64,
    /// Messages the durable consumer has not delivered yet (filled in by the caller).
    pub pending_messages: u64,
}

/// Counts what waits, from partial indexes only: undecided ledger rows (`crm_operation_due`),
/// ledger rows in review, unresolved conflicts and dead letters. Settled history is never scanned.
pub async fn sample_depths(pool: &PgPool) -> Result<DepthSample, sqlx::Error> {
    const SAMPLE_DEPTHS: &str = r#"
        WITH undecided AS MATERIALIZED (
            -- The dispatcher's partial index holds exactly these rows.
            SELECT state, unknown_since FROM handoff_consumer.crm_operation
             WHERE state IN ('received', 'dispatching', 'unknown', 'proved_not_executed', 'replay')
        )
        SELECT (SELECT count(*) FROM undecided WHERE state = 'received') AS received,
               (SELECT count(*) FROM undecided WHERE state = 'dispatching') AS dispatching,
               (SELECT count(*) FROM undecided WHERE state = 'unknown') AS unknown,
               (SELECT count(*) FROM undecided WHERE state = 'proved_not_executed') AS proved_not_executed,
               (SELECT count(*) FROM undecided WHERE state = 'replay') AS replay,
               (SELECT count(*) FROM handoff_consumer.crm_operation WHERE state = 'review') AS review,
               COALESCE((SELECT extract(epoch FROM now() - min(unknown_since))::float8 FROM undecided
                          WHERE state = 'unknown'), 0) AS oldest_unknown_s,
               (SELECT count(*) FROM handoff_consumer.review WHERE resolved_at IS NULL) AS conflicts,
               (SELECT count(*) FROM handoff_consumer.dead_letter WHERE resolved_at IS NULL) AS dead_letters,
               (SELECT count(*) FROM handoff_consumer.paused_action) AS paused"#;
    #[derive(sqlx::FromRow)]
    struct Row {
        received: i64,
        dispatching: i64,
        unknown: i64,
        proved_not_executed: i64,
        replay: i64,
        review: i64,
        oldest_unknown_s: f64,
        conflicts: i64,
        dead_letters: i64,
        paused: i64,
    }
    let row: Row = sqlx::query_as(SAMPLE_DEPTHS).fetch_one(pool).await?;
    use crate::remote::LedgerState;
    let ledger = [
        (LedgerState::Received, row.received),
        (LedgerState::Dispatching, row.dispatching),
        (LedgerState::Unknown, row.unknown),
        (LedgerState::ProvedNotExecuted, row.proved_not_executed),
        (LedgerState::Replay, row.replay),
        (LedgerState::Review, row.review),
    ]
    .into_iter()
    .collect();
    Ok(DepthSample {
        ledger,
        oldest_unknown_s: row.oldest_unknown_s,
        conflicts: row.conflicts,
        dead_letters: row.dead_letters,
        paused: row.paused,
        pending_messages: 0,
    })
}

/// A dead letter an operator asked to replay, locked for this transaction.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct StoredLetter {
    pub id: i64,
    pub stream_sequence: i64,
    pub subject: String,
    pub message_id: Option<String>,
    pub deliveries: i64,
    pub body: Vec<u8>,
}

/// Locks up to `limit` dead letters whose replay was requested and that are still unresolved
/// (`SKIP LOCKED`: another replica's replays are left alone).
pub async fn lock_replay_requests(conn: &mut PgConnection, limit: i64) -> Result<Vec<StoredLetter>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT id, stream_sequence, subject, message_id, deliveries, body FROM handoff_consumer.dead_letter
            WHERE replay_requested_at IS NOT NULL AND resolved_at IS NULL
            ORDER BY id LIMIT $1
              FOR UPDATE SKIP LOCKED"#,
    )
    .bind(limit)
    .fetch_all(&mut *conn)
    .await
}

/// Resolves replayed letters with their outcome (by whoever asked for the replay), and clears the
/// request of those that still fail, noting why.
pub async fn finish_replays(
    conn: &mut PgConnection,
    resolved: &[(i64, String)],
    still_failing: &[(i64, String)],
) -> Result<(), sqlx::Error> {
    const FINISH_REPLAYS: &str = r#"
        WITH resolved AS (
            UPDATE handoff_consumer.dead_letter AS d
               SET resolved_at = now(), resolved_by = d.replay_requested_by, resolution = u.resolution,
                   replay_requested_at = NULL, last_replay = u.resolution
              FROM UNNEST($1::bigint[], $2::text[]) AS u(id, resolution)
             WHERE d.id = u.id
        )
        UPDATE handoff_consumer.dead_letter AS d
           SET replay_requested_at = NULL, last_replay = u.note
          FROM UNNEST($3::bigint[], $4::text[]) AS u(id, note)
         WHERE d.id = u.id"#;
    sqlx::query(FINISH_REPLAYS)
        .bind(resolved.iter().map(|r| r.0).collect::<Vec<_>>())
        .bind(resolved.iter().map(|r| r.1.as_str()).collect::<Vec<_>>())
        .bind(still_failing.iter().map(|r| r.0).collect::<Vec<_>>())
        .bind(still_failing.iter().map(|r| r.1.as_str()).collect::<Vec<_>>())
        .execute(&mut *conn)
        .await?;
    Ok(())
}
