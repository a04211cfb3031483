-- The ledger for a remote CRM: one row per operation key, driven to `settled` or `review` by the
-- dispatcher, never by a blind retry.
--
--   received ──claim──▶ dispatching ──2xx──────────────────────────▶ settled
--                           │  ├─409 / 4xx validation, auth──────────▶ review
--                           │  ├─429 / 503 / refused connection (not executed)──▶ received (backoff)
--                           │  └─timeout / reset / 500 / 502 / 504 ─▶ unknown
--   unknown ──readback──▶ found ──────────────────────────────────────▶ settled
--                         authoritative absence ──────────────────────▶ proved_not_executed ──▶ (one new attempt)
--                         not yet authoritative (freshness window) ───▶ unknown (look again)
--                         unavailable past the readback window ───────▶ review
--   dispatching with an expired lease (replica died mid-call) ─────────▶ unknown
--
-- Only the replica holding the lease (lease_owner, lease_until) may record an outcome.

ALTER TABLE handoff_consumer.inbox DROP CONSTRAINT inbox_outcome_check;
ALTER TABLE handoff_consumer.inbox ADD CONSTRAINT inbox_outcome_check
    CHECK (outcome IN ('task_created', 'task_existed', 'conflict', 'accepted'));

CREATE TABLE handoff_consumer.crm_operation (
    operation_key   text        PRIMARY KEY,
    -- The destination account (seed 004: record it with the operation). A dispatcher only works
    -- rows of its own account.
    account         text        NOT NULL,
    payload_hash    text        NOT NULL,
    payload         jsonb       NOT NULL,
    state           text        NOT NULL DEFAULT 'received'
                    CHECK (state IN ('received', 'dispatching', 'unknown', 'proved_not_executed', 'settled', 'review')),
    attempts        integer     NOT NULL DEFAULT 0,
    readbacks       integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    lease_owner     text,
    lease_until     timestamptz,
    first_attempt_at timestamptz,
    last_attempt_at timestamptz,
    unknown_since   timestamptz,
    crm_task_id     text,
    -- How the outcome was proven: create_response, readback_by_key, readback_by_external_id, query,
    -- operator_receipt.
    proof           text,
    note            text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);

-- The dispatcher's claim walks due, undecided rows only.
CREATE INDEX crm_operation_due ON handoff_consumer.crm_operation (account, next_attempt_at)
    WHERE state IN ('received', 'dispatching', 'unknown', 'proved_not_executed');

-- Every attempt, readback and decision with its evidence; never updated or deleted.
CREATE TABLE handoff_consumer.crm_event (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_key text        NOT NULL REFERENCES handoff_consumer.crm_operation (operation_key),
    -- attempt | readback | decision | operator
    kind          text        NOT NULL,
    replica       text,
    attempt       integer,
    -- e.g. "POST /v1/tasks -> 201", "GET /v1/tasks/by-external-id -> 404", the lookup and account used
    evidence      text        NOT NULL,
    state_after   text        NOT NULL,
    at            timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX crm_event_by_key ON handoff_consumer.crm_event (operation_key, id);

-- Operator resolutions: who, when, why. Never updated or deleted.
CREATE TABLE handoff_consumer.audit (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_key text        NOT NULL,
    actor         text        NOT NULL CHECK (btrim(actor) <> ''),
    action        text        NOT NULL,
    reason        text        NOT NULL CHECK (btrim(reason) <> ''),
    receipt       text,
    at            timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION handoff_consumer.notify_dispatch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('handoff_dispatch', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER crm_operation_notify AFTER INSERT ON handoff_consumer.crm_operation
    FOR EACH STATEMENT EXECUTE FUNCTION handoff_consumer.notify_dispatch();
