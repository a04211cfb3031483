-- Claiming in commit order: on the happy path a relay writes one row per batch, not two per action.
--
-- Before, a relay leased each row (an UPDATE per row) and then marked each row published (a second
-- UPDATE per row); both were non-HOT because the claim index covered the columns they changed. Now:
--
--   claim    one short transaction moves a shared cursor over the next rows in commit order and
--            records that range with its lease as ONE row of handoff.relay_batch;
--   publish  with no transaction open;
--   settle   one statement marks the rows published (a HOT update each: no index covers a column
--            it changes) and deletes the range row.
--
-- Per-row state is written only for rows that fail: they leave the range path for the per-row
-- retry path (`retrying`, with the per-row lease in next_attempt_at/lease_owner as before).
--
-- No gaps in commit order. Producers commit out of id order, so a plain id cursor would skip rows
-- whose transaction was still open when the cursor passed (platform notes). Each row records the
-- id of the transaction that wrote it (`transaction_id`), and the cursor only passes rows whose
-- transaction id is below the oldest transaction id still running (`pg_snapshot_xmin`): every such
-- transaction has ended, so no row can ever appear behind the cursor. The price: a row committed
-- while an older write transaction is still open waits for that transaction to end, or for the
-- relay's held-back rescue (HANDOFF_RELAY_HELD_BACK_SECS), which hands it to the per-row path.
--
-- Retention: from this version the relay deletes published outbox rows (never approved actions) once
-- they are older than HANDOFF_RELAY_RETENTION_SECS; blocked and pending rows are never deleted.

-- Existing rows get transaction id 0 (a constant default: no table rewrite); new rows get the id of
-- their own transaction.
ALTER TABLE handoff.outbox
    ADD COLUMN transaction_id xid8    NOT NULL DEFAULT '0',
    ADD COLUMN retrying       boolean NOT NULL DEFAULT false;
ALTER TABLE handoff.outbox ALTER COLUMN transaction_id SET DEFAULT pg_current_xact_id();

-- Rows still pending from before this migration continue on the per-row path, keeping their due
-- time or a running relay's lease.
UPDATE handoff.outbox SET retrying = true WHERE state = 'pending';

-- The range claim walks this index. It is never updated by the relay (transaction_id and id do not
-- change), so marking a row published stays a HOT update.
CREATE INDEX outbox_commit_order ON handoff.outbox (transaction_id, id);

-- Due retries, in due order. Only failed rows are in it; the happy path never touches `retrying`
-- or `next_attempt_at`, so this index does not block HOT updates either.
DROP INDEX handoff.outbox_due;
CREATE INDEX outbox_retry_due ON handoff.outbox (next_attempt_at) WHERE retrying;

-- Room on each page for the published version of every row, so the mark is a HOT update (no new
-- index entries). Published rows are removed by the relay's retention, which keeps the table small.
-- Autovacuum runs after 5% of the rows changed rather than 20%: with retention deleting continuously,
-- the default lets dead rows pile up to a fifth of the table before they are reclaimed.
ALTER TABLE handoff.outbox SET (fillfactor = 50, autovacuum_vacuum_scale_factor = 0.05,
                                autovacuum_vacuum_insert_scale_factor = 0.05);
ALTER TABLE handoff.approved_action SET (autovacuum_vacuum_scale_factor = 0.05);

-- The shared cursor: every row at or before it belongs to a claimed range (or to the per-row path).
-- One row; relays serialize on its row lock for the few milliseconds a claim takes. It starts
-- behind every row that can still appear: rows from before this migration have transaction id 0
-- and are all at or before max(id); a row inserted later by a transaction that began earlier has a
-- non-zero transaction id, so it sorts after the cursor.
CREATE TABLE handoff.relay_cursor (
    singleton      boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    transaction_id xid8    NOT NULL,
    outbox_id      bigint  NOT NULL
);
INSERT INTO handoff.relay_cursor (transaction_id, outbox_id)
SELECT '0', COALESCE(max(id), 0) FROM handoff.outbox;

-- Ranges a relay holds: outbox rows after (after_transaction_id, after_outbox_id) up to and
-- including (last_transaction_id, last_outbox_id), in commit order. A range is deleted when its
-- rows are settled. If its relay dies, the lease runs out and another relay re-claims the range,
-- counting an attempt for every row still pending in it (the broker reports the re-publish as a
-- duplicate; the consumer's inbox stops it in any case).
CREATE TABLE handoff.relay_batch (
    id                   bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    after_transaction_id xid8        NOT NULL,
    after_outbox_id      bigint      NOT NULL,
    last_transaction_id  xid8        NOT NULL,
    last_outbox_id       bigint      NOT NULL,
    lease_owner          text        NOT NULL,
    lease_until          timestamptz NOT NULL,
    -- Publish attempts of the range, counted when it is claimed (before anything is sent).
    attempts             integer     NOT NULL DEFAULT 1,
    claimed_at           timestamptz NOT NULL DEFAULT now()
);
