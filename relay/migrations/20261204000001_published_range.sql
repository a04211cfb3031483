-- Settling a range without a write per row.
--
-- Before, settling a range marked every published row (a HOT update each): the last per-row write
-- on the happy path. Now a range whose rows were all published is recorded ONCE, as a row of
-- handoff.published_range holding the ids of its rows and their stream sequences (in one array
-- each), and the outbox rows are not touched at all: they keep state `pending`, `retrying = false`,
-- behind the cursor. Rows that fail still get their own state (the per-row retry path), and so do
-- rows published on the per-row path or by a relay that lost its range lease.
--
-- A row's delivery state is therefore read from the view handoff.outbox_delivery, never from the
-- outbox's own columns: the row's own state when it has one (published, blocked, or on the per-row
-- path), else `published` with its sequence from the range that lists it. Ranges never overlap
-- (they come from the cursor), so a row is listed by at most one range; the range is found through
-- its end (the primary key) in one index probe.
--
-- Retention deletes a range together with the rows it lists, once the range was published longer
-- ago than the retention. A row re-queued after a broker loss has `retrying = true` and its own
-- state again, so the range no longer speaks for it (and its deletion does not take the row).

CREATE TABLE handoff.published_range (
    -- The range's span in commit order: rows after `after_*` up to and including `last_*`.
    last_transaction_id  xid8        NOT NULL,
    last_outbox_id       bigint      NOT NULL,
    after_transaction_id xid8        NOT NULL,
    after_outbox_id      bigint      NOT NULL,
    stream               text        NOT NULL,
    -- The rows published with the range (rows of the span that had left for the per-row path are
    -- not listed) and their stream sequences, position for position.
    outbox_ids           bigint[]    NOT NULL,
    stream_sequences     bigint[]    NOT NULL,
    -- Rows whose PubAck said the broker already held the message id (usually none).
    duplicate_ids        bigint[]    NOT NULL DEFAULT '{}',
    -- Publish attempts of the range, as counted when it was claimed.
    attempts             integer     NOT NULL,
    published_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (last_transaction_id, last_outbox_id),
    CHECK (cardinality(outbox_ids) = cardinality(stream_sequences) AND cardinality(outbox_ids) > 0)
);
ALTER TABLE handoff.published_range SET (autovacuum_vacuum_scale_factor = 0.05);

-- Every outbox row with its delivery state. Use this (never handoff.outbox's own state columns) to
-- ask what happened to a row.
CREATE VIEW handoff.outbox_delivery AS
SELECT o.id, o.operation_key, o.transaction_id, o.retrying,
       CASE WHEN r.published_at IS NOT NULL THEN 'published' ELSE o.state END AS state,
       COALESCE(r.attempts, o.attempts) AS attempts,
       CASE WHEN r.published_at IS NULL THEN o.next_attempt_at END AS next_attempt_at,
       CASE WHEN r.published_at IS NULL THEN o.lease_owner END AS lease_owner,
       o.last_error,
       COALESCE(r.stream, o.stream) AS stream,
       COALESCE(r.stream_sequence, o.stream_sequence) AS stream_sequence,
       COALESCE(r.duplicate, o.duplicate) AS duplicate,
       COALESCE(r.published_at, o.published_at) AS published_at,
       o.created_at,
       COALESCE(r.published_at, o.updated_at) AS updated_at
  FROM handoff.outbox AS o
  LEFT JOIN LATERAL (
       SELECT p.stream, p.attempts, p.published_at, p.stream_sequences[i.pos] AS stream_sequence,
              o.id = ANY(p.duplicate_ids) AS duplicate
         FROM (SELECT *
                 FROM handoff.published_range AS p
                WHERE (p.last_transaction_id, p.last_outbox_id) >= (o.transaction_id, o.id)
                ORDER BY p.last_transaction_id, p.last_outbox_id
                LIMIT 1) AS p
        CROSS JOIN LATERAL (SELECT array_position(p.outbox_ids, o.id) AS pos) AS i
        WHERE o.state = 'pending' AND NOT o.retrying
          AND (p.after_transaction_id, p.after_outbox_id) < (o.transaction_id, o.id)
          AND i.pos IS NOT NULL) AS r ON true;
