//! The approved actions a run moves: keys, payloads, their canonical hashes, the envelopes the
//! relay would publish, and the application that records them (a backlog at once, or a steady
//! offered load).
//!
//! Payloads are small follow-up instructions like the seed's, about 110 bytes canonical:
//! `{"case_id":"case-7","due":"2026-12-01","priority":"normal","title":"Call about the approved repair plan 7"}`.
//! Their RFC 8785 form is plain string concatenation (ASCII, members already in code-unit order),
//! so Postgres can compute the same SHA-256 the Rust producer API stores ([`check_sql_hash`] proves
//! it for a sample): a backlog of a million rows is one `INSERT ... SELECT`, recorded as the Rust
//! API records it (hash set), not through a million round trips.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use bytes::Bytes;
use chrono::Utc;
use handoff_shared::envelope::SCHEMA_VERSION;
use handoff_shared::signing::SigningKey;
use handoff_shared::{Approval, CanonicalPayload, Envelope, OperationKey};
use sqlx::PgPool;

/// Every benchmark key is `bench:create-followup:v1:<entity>`.
pub const KEY_PREFIX: &str = "bench:create-followup:v1:";

/// The operation key of action `i` in `batch` (a label that keeps phases apart, e.g. `b1`).
pub fn key(batch: &str, i: i64) -> String {
    format!("{KEY_PREFIX}{batch}-{i}")
}

/// The payload of action `i`, as JSON.
pub fn payload(i: i64) -> serde_json::Value {
    serde_json::json!({
        "case_id": format!("case-{i}"),
        "due": "2026-12-01",
        "priority": "normal",
        "title": format!("Call about the approved repair plan {i}"),
    })
}

/// Records approved actions `first..first + n` of `batch` in one transaction, as the Rust producer
/// API records them (payload hash set, approval, outbox row), computing everything in Postgres.
/// `$5` > 0 adds a `note` of that many bytes ([`Payloads::Large`]).
const RECORD_ACTIONS: &str = r#"
    WITH actions AS (
        SELECT $3::text || $4::text || '-' || i AS operation_key,
               '{"case_id":"case-' || i || '","due":"2026-12-01",'
               || CASE WHEN $5 > 0 THEN '"note":"' || repeat('x', $5) || '",' ELSE '' END
               || '"priority":"normal","title":"Call about the approved repair plan ' || i || '"}' AS canonical
          FROM generate_series($1::bigint, $2::bigint) AS i
    ), approved AS (
        INSERT INTO handoff.approved_action (operation_key, payload, payload_hash, approved_by, approved_at)
        SELECT operation_key, canonical::jsonb, encode(sha256(convert_to(canonical, 'UTF8')), 'hex'), 'user-17', now()
          FROM actions
    )
    INSERT INTO handoff.outbox (operation_key) SELECT operation_key FROM actions"#;

/// The payloads a backlog holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payloads {
    /// Follow-ups of about 110 bytes, as the seed's.
    Small,
    /// Follow-ups carrying a note of this many bytes (the relay hashes what it reads: a payload
    /// that does not hash to the stored hash is blocked, and the drain's checks fail).
    Large { note_bytes: usize },
}

impl Payloads {
    /// The payload of action `i`, as JSON (what [`record_actions_of`] records for it).
    pub fn payload(self, i: i64) -> serde_json::Value {
        match self {
            Payloads::Small => payload(i),
            Payloads::Large { note_bytes } => {
                let mut payload = payload(i);
                payload["note"] = "x".repeat(note_bytes).into();
                payload
            }
        }
    }
}

/// Records `n` actions of `batch` starting at `first` in one statement, with `payloads`.
pub async fn record_actions_of<'e>(
    conn: impl sqlx::PgExecutor<'e>,
    payloads: Payloads,
    batch: &str,
    first: i64,
    n: i64,
) -> Result<()> {
    let note_bytes = match payloads {
        Payloads::Small => 0,
        Payloads::Large { note_bytes } => i32::try_from(note_bytes)?,
    };
    sqlx::query(RECORD_ACTIONS)
        .bind(first)
        .bind(first + n - 1)
        .bind(KEY_PREFIX)
        .bind(batch)
        .bind(note_bytes)
        .execute(conn)
        .await?;
    Ok(())
}

/// Records `n` actions of `batch` starting at `first` in one statement: on a pool they commit
/// together; on a connection inside a transaction, with it.
pub async fn record_actions<'e>(conn: impl sqlx::PgExecutor<'e>, batch: &str, first: i64, n: i64) -> Result<()> {
    record_actions_of(conn, Payloads::Small, batch, first, n).await
}

/// Proves that [`RECORD_ACTIONS`] stores the hash the Rust producer API computes.
pub async fn check_sql_hash(pool: &PgPool) -> Result<()> {
    let i = 4711_i64;
    let sql: String = sqlx::query_scalar(
        r#"SELECT encode(sha256(convert_to('{"case_id":"case-' || $1 || '","due":"2026-12-01","priority":"normal","title":"Call about the approved repair plan ' || $1 || '"}', 'UTF8')), 'hex')"#,
    )
    .bind(i)
    .fetch_one(pool)
    .await?;
    let rust = CanonicalPayload::new(payload(i))?.hash().to_string();
    ensure!(sql == rust, "the SQL payload hash {sql} differs from the canonical hash {rust}");
    Ok(())
}

/// The envelope the relay publishes for action `i` of `batch`, encoded and signed with `signing`.
pub fn envelope(batch: &str, i: i64, signing: &SigningKey) -> Result<(String, Bytes)> {
    envelope_of(Payloads::Small, batch, i, signing)
}

/// [`envelope`] with `payloads`.
pub fn envelope_of(payloads: Payloads, batch: &str, i: i64, signing: &SigningKey) -> Result<(String, Bytes)> {
    let envelope = envelope_value_of(payloads, batch, i)?;
    Ok((envelope.key.to_string(), envelope.encode_signed(SCHEMA_VERSION, Some(signing))))
}

/// The envelope of action `i` of `batch`.
pub fn envelope_value(batch: &str, i: i64) -> Result<Envelope> {
    envelope_value_of(Payloads::Small, batch, i)
}

fn envelope_value_of(payloads: Payloads, batch: &str, i: i64) -> Result<Envelope> {
    let key: OperationKey = key(batch, i).parse()?;
    let now = Utc::now();
    Ok(Envelope {
        key,
        payload: CanonicalPayload::new(payloads.payload(i))?,
        approval: Approval::new("user-17", now)?,
        source: "/handoff/bench".into(),
        time: now,
        traceparent: None,
    })
}

/// An application recording actions at `rate` per second for `duration`, one transaction every
/// 10 ms holding the actions due by then (as many producers' commits would arrive). Keys are
/// `batch-first ..`. Returns how many it recorded. Falls behind (and says so) if the database
/// cannot keep up.
pub async fn offer_load(pool: &PgPool, batch: &str, rate: f64, duration: Duration) -> Result<i64> {
    offer(rate, duration, |first, n| record_actions(pool, batch, first, n)).await
}

/// The clock of [`offer_load`]: every 10 ms, `record(first, n)` commits the `n` actions due since
/// the last tick, numbered from 1. Returns how many were recorded.
pub async fn offer<F: Future<Output = Result<()>>>(
    rate: f64,
    duration: Duration,
    mut record: impl FnMut(i64, i64) -> F,
) -> Result<i64> {
    const TICK: Duration = Duration::from_millis(10);
    let start = Instant::now();
    let mut recorded = 0_i64;
    let mut ticker = tokio::time::interval(TICK);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while start.elapsed() < duration {
        ticker.tick().await;
        let due = (rate * start.elapsed().as_secs_f64()) as i64;
        let n = due - recorded;
        if n > 0 {
            record(recorded + 1, n).await?;
            recorded = due;
        }
    }
    let expected = (rate * duration.as_secs_f64()) as i64;
    if recorded + (rate * 0.05) as i64 + 1 < expected {
        tracing::warn!(recorded, expected, "the load generator fell behind its offered rate");
    }
    Ok(recorded)
}
