//! Reconciliation, the producer's half: do the messages the outbox says were published still sit in
//! the stream at the sequences their PubAcks named?
//!
//! A broker can lose acknowledged messages (an OS crash with the default `sync_interval`, a lost
//! volume) and, after a file-level loss, hand the lost sequence numbers to new messages. Neither
//! shows in the outbox: every row still says `published`. This module walks published rows in
//! commit order, a chunk at a time (the commit-order index; no index on the sequence, which would
//! make every mark a non-HOT update), and reads the stream at each row's sequence, many reads in
//! flight. `handoff-admin reconcile` adds the consumer's half (inbox and CRM); the relay runs this
//! half periodically (`--reconcile-interval-secs`) and exports what it finds as
//! `handoff_reconcile_mismatches`.
//!
//! Everything here reads, except [`requeue`], which puts rows the broker lost back on the per-row
//! path under the same key; the broker's dedup and the consumer's inbox keep the effect single.

use std::time::Duration;

use async_nats::jetstream::stream::{RawMessageErrorKind, Stream};
use chrono::{DateTime, Utc};
use futures::StreamExt;
use handoff_shared::headers;
use sqlx::PgPool;

/// Reads of the stream in flight at once.
pub const PROBE_CONCURRENCY: usize = 256;
/// Outbox rows examined per statement.
pub const CHUNK_ROWS: i64 = 10_000;

/// What reconciliation can find wrong with one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MismatchKind {
    /// Published, no longer in the stream at its sequence, never received by the consumer.
    LostByBroker,
    /// The stream holds another key at the row's sequence (the broker reused it after a loss).
    SequenceReused,
    /// The consumer received a key the producer has no record of.
    NotRecordedByProducer,
    /// The consumer recorded the key but its CRM task (or ledger row) is missing.
    TaskMissing,
}

impl MismatchKind {
    pub const ALL: [Self; 4] =
        [Self::LostByBroker, Self::SequenceReused, Self::NotRecordedByProducer, Self::TaskMissing];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::LostByBroker => "lost_by_broker",
            Self::SequenceReused => "sequence_reused",
            Self::NotRecordedByProducer => "not_recorded_by_producer",
            Self::TaskMissing => "task_missing",
        }
    }
}

/// Which published rows to look at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Every published row the outbox still keeps.
    All,
    /// Rows published at or after this time.
    Since(DateTime<Utc>),
    /// Rows whose stream sequence is in `first..=last`.
    Sequences { first: u64, last: u64 },
}

impl Scope {
    /// The scope as filters: published (or received) at or after, and the inclusive sequence range.
    pub fn bounds(self) -> (Option<DateTime<Utc>>, i64, i64) {
        match self {
            Self::All => (None, 1, i64::MAX),
            Self::Since(at) => (Some(at), 1, i64::MAX),
            Self::Sequences { first, last } => (None, first as i64, last.min(i64::MAX as u64) as i64),
        }
    }
}

impl std::str::FromStr for Scope {
    type Err = String;

    /// `A..B` (inclusive), `A..` or `..B`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (first, last) = s.split_once("..").ok_or_else(|| format!("expected A..B, got {s:?}"))?;
        let bound = |text: &str, default: u64| -> Result<u64, String> {
            if text.trim().is_empty() { Ok(default) } else { text.trim().parse().map_err(|e| format!("{text:?}: {e}")) }
        };
        let (first, last) = (bound(first, 1)?, bound(last, i64::MAX as u64)?);
        if first == 0 || first > last {
            return Err(format!("sequences start at 1 and A <= B, got {s:?}"));
        }
        Ok(Self::Sequences { first, last })
    }
}

/// A published row, as reconciliation needs it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct PublishedRow {
    pub operation_key: String,
    pub stream_sequence: i64,
    pub published_at: DateTime<Utc>,
}

/// Where a walk over the outbox continues.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Position {
    transaction_id: String,
    outbox_id: i64,
}

impl Position {
    pub fn start() -> Self {
        Self { transaction_id: "0".into(), outbox_id: 0 }
    }
}

/// One chunk of the walk.
#[derive(Debug)]
pub struct Chunk {
    /// Published rows in scope, in commit order.
    pub rows: Vec<PublishedRow>,
    /// Where the next chunk starts; `None` at the end of the outbox.
    pub next: Option<Position>,
}

/// The next published rows in `scope` after `after`, examining at most `limit` outbox rows.
pub async fn published_chunk(pool: &PgPool, scope: Scope, after: &Position, limit: i64) -> Result<Chunk, sqlx::Error> {
    // Rows published with a range are listed in its `handoff.published_range` row: the ranges that
    // overlap the chunk (those ending inside it, and the first one ending after it) are unnested
    // and joined whole, not probed per row as the view `outbox_delivery` does.
    const PUBLISHED_CHUNK: &str = r#"
        WITH chunk AS MATERIALIZED (
            SELECT transaction_id, id, operation_key, state, retrying, stream_sequence, published_at
              FROM handoff.outbox
             WHERE (transaction_id, id) > ($1::text::xid8, $2::bigint)
             ORDER BY transaction_id, id
             LIMIT $3
        ), first AS (
            SELECT transaction_id, id FROM chunk ORDER BY transaction_id, id LIMIT 1
        ), last AS (
            SELECT transaction_id, id FROM chunk ORDER BY transaction_id DESC, id DESC LIMIT 1
        ), ranges AS (
            SELECT p.outbox_ids, p.stream_sequences, p.published_at
              FROM handoff.published_range AS p
             WHERE (p.last_transaction_id, p.last_outbox_id) >= ((SELECT transaction_id FROM first), (SELECT id FROM first))
               AND (p.last_transaction_id, p.last_outbox_id) < ((SELECT transaction_id FROM last), (SELECT id FROM last))
             UNION ALL
            (SELECT p.outbox_ids, p.stream_sequences, p.published_at
               FROM handoff.published_range AS p
              WHERE (p.last_transaction_id, p.last_outbox_id) >= ((SELECT transaction_id FROM last), (SELECT id FROM last))
              ORDER BY p.last_transaction_id, p.last_outbox_id
              LIMIT 1)
        ), listed AS (
            SELECT u.id, u.sequence, r.published_at
              FROM ranges AS r CROSS JOIN LATERAL unnest(r.outbox_ids, r.stream_sequences) AS u(id, sequence)
        ), published AS (
            SELECT c.transaction_id, c.id, c.operation_key,
                   COALESCE(l.sequence, c.stream_sequence) AS stream_sequence,
                   COALESCE(l.published_at, c.published_at) AS published_at
              FROM chunk AS c
              LEFT JOIN listed AS l ON l.id = c.id AND c.state = 'pending' AND NOT c.retrying
             WHERE (c.state = 'published' AND c.stream_sequence IS NOT NULL) OR l.id IS NOT NULL
        ), tail AS (
            SELECT transaction_id::text AS transaction_id, id FROM last
        )
        SELECT c.operation_key, c.stream_sequence, c.published_at,
               (SELECT transaction_id FROM tail) AS last_transaction_id, (SELECT id FROM tail) AS last_id,
               (SELECT count(*) FROM chunk) AS examined
          FROM (SELECT 1) AS one
          LEFT JOIN published AS c
            ON ($4::timestamptz IS NULL OR c.published_at >= $4)
           AND c.stream_sequence BETWEEN $5 AND $6
         ORDER BY c.transaction_id, c.id"#;
    #[derive(sqlx::FromRow)]
    struct Line {
        operation_key: Option<String>,
        stream_sequence: Option<i64>,
        published_at: Option<DateTime<Utc>>,
        last_transaction_id: Option<String>,
        last_id: Option<i64>,
        examined: i64,
    }
    let (since, first, last) = scope.bounds();
    let lines: Vec<Line> = sqlx::query_as(PUBLISHED_CHUNK)
        .bind(&after.transaction_id)
        .bind(after.outbox_id)
        .bind(limit)
        .bind(since)
        .bind(first)
        .bind(last)
        .fetch_all(pool)
        .await?;
    let next = lines.first().and_then(|line| {
        let more = line.examined >= limit;
        line.last_transaction_id
            .clone()
            .zip(line.last_id)
            .filter(|_| more)
            .map(|(transaction_id, outbox_id)| Position { transaction_id, outbox_id })
    });
    let rows = lines
        .into_iter()
        .filter_map(|l| {
            Some(PublishedRow {
                operation_key: l.operation_key?,
                stream_sequence: l.stream_sequence?,
                published_at: l.published_at?,
            })
        })
        .collect();
    Ok(Chunk { rows, next })
}

/// What the stream holds at a row's sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AtSequence {
    /// The row's own message.
    Same,
    /// Nothing: deleted or lost.
    Missing,
    /// Another message: the sequence was reused. `key` is its `Nats-Msg-Id`, if any.
    Other { key: Option<String> },
    /// Below the stream's first sequence: removed by the stream's own limits (age, size), as
    /// configured. Not a loss.
    Expired,
}

/// Why the stream could not be read.
#[derive(Debug, thiserror::Error)]
#[error("reading stream sequence {sequence}")]
pub struct ProbeError {
    pub sequence: u64,
    #[source]
    pub source: async_nats::jetstream::stream::RawMessageError,
}

/// Reads the stream at every row's sequence, [`PROBE_CONCURRENCY`] reads in flight. Results are
/// in the order of `rows`. `first_sequence` is the stream's first sequence (from its info).
pub async fn probe(stream: &Stream, rows: &[PublishedRow], first_sequence: u64) -> Result<Vec<AtSequence>, ProbeError> {
    // Owned inputs: a future borrowing from `rows` per item would not be `Send` for every lifetime.
    let wanted: Vec<(u64, String)> = rows.iter().map(|r| (r.stream_sequence as u64, r.operation_key.clone())).collect();
    let reads = futures::stream::iter(wanted.into_iter().map(|(sequence, key)| {
        let stream = stream.clone();
        async move { probe_one(&stream, sequence, &key, first_sequence).await }
    }))
    .buffered(PROBE_CONCURRENCY);
    reads.collect::<Vec<_>>().await.into_iter().collect()
}

/// What the stream holds at `sequence`, compared with `key`.
pub async fn probe_one(
    stream: &Stream,
    sequence: u64,
    key: &str,
    first_sequence: u64,
) -> Result<AtSequence, ProbeError> {
    if sequence < first_sequence {
        return Ok(AtSequence::Expired);
    }
    match stream.get_raw_message(sequence).await {
        Ok(message) => {
            let found = message.headers.get(headers::MSG_ID).map(|v| v.as_str().to_owned());
            Ok(if found.as_deref() == Some(key) { AtSequence::Same } else { AtSequence::Other { key: found } })
        }
        Err(error) if matches!(error.kind(), RawMessageErrorKind::NoMessageFound) => Ok(AtSequence::Missing),
        Err(source) => Err(ProbeError { sequence, source }),
    }
}

/// Keys whose rows [`requeue`] put back, and when each will be published.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct Requeued {
    pub operation_key: String,
    pub due_at: DateTime<Utc>,
}

/// Puts published rows the broker lost back on the per-row path, under the same key, with an
/// audit row each. A row is due once `duplicate_window` has passed since it was first published:
/// until then the broker still remembers its message id (deleting a message does not forget it)
/// and would answer a re-publish with `duplicate: true` and store nothing. After a broker restart
/// the ids of lost messages are forgotten anyway; waiting the window is then only cautious.
///
/// Only rows still published are touched, so running it twice, or while relays run, changes
/// nothing more. Returns the rows re-queued.
pub async fn requeue(
    pool: &PgPool,
    keys: &[String],
    duplicate_window: Duration,
    actor: &str,
    reason: &str,
) -> Result<Vec<Requeued>, sqlx::Error> {
    // The row's sequence and publish time come from the view: a row published with a range has
    // them in the range's row, not its own. Once re-queued (`retrying`) it has its own state again.
    const REQUEUE: &str = r#"
        WITH lost AS (
            SELECT d.id, d.stream_sequence, d.published_at
              FROM handoff.outbox_delivery AS d
             WHERE d.operation_key = ANY($1::text[]) AND d.state = 'published'
        ), requeued AS (
            UPDATE handoff.outbox AS o
               SET state = 'pending', retrying = true, attempts = 0, lease_owner = NULL,
                   next_attempt_at = GREATEST(now(), l.published_at + make_interval(secs => $2)),
                   last_error = 're-queued after broker loss (was stream sequence ' || l.stream_sequence || ')',
                   -- The lost sequence is kept: if the broker still answers "duplicate" with it,
                   -- the relay knows nothing was stored and tries again after the window.
                   stream_sequence = l.stream_sequence,
                   stream = NULL, duplicate = NULL, published_at = NULL, updated_at = now()
              FROM lost AS l
             WHERE o.id = l.id AND (o.state = 'published' OR (o.state = 'pending' AND NOT o.retrying))
         RETURNING o.operation_key, o.next_attempt_at AS due_at
        ), audit AS (
            INSERT INTO handoff.audit (operation_key, actor, action, reason)
            SELECT operation_key, $3, 'requeue_after_broker_loss', $4 FROM requeued
        )
        SELECT operation_key, due_at FROM requeued ORDER BY operation_key"#;
    sqlx::query_as(REQUEUE)
        .bind(keys)
        .bind(duplicate_window.as_secs_f64())
        .bind(actor)
        .bind(reason)
        .fetch_all(pool)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_ranges_parse_inclusive_and_open() {
        assert_eq!("5..9".parse::<Scope>().unwrap(), Scope::Sequences { first: 5, last: 9 });
        assert_eq!("5..".parse::<Scope>().unwrap(), Scope::Sequences { first: 5, last: i64::MAX as u64 });
        assert_eq!("..9".parse::<Scope>().unwrap(), Scope::Sequences { first: 1, last: 9 });
        for bad in ["9..5", "0..3", "x..y", "12"] {
            assert!(bad.parse::<Scope>().is_err(), "{bad}");
        }
    }
}
