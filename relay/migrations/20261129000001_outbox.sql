-- The producer side of handoff: the approved action and its delivery state, owned by the relay.
--
-- An approved action is immutable once recorded: its key, payload and approval are what a person
-- approved. The outbox row is the delivery state machine:
--
--   pending --(relay: PubAck recorded)--> published
--   pending --(retry budget exhausted, permanent publish error, payload changed)--> blocked
--
-- Rows are never deleted by the relay; blocked rows wait for an operator.

CREATE SCHEMA IF NOT EXISTS handoff;

CREATE TABLE handoff.approved_action (
    operation_key text        PRIMARY KEY,
    -- The approved payload. jsonb equality decides "same payload" (member order and formatting
    -- do not matter), the same notion as the canonical RFC 8785 hash.
    payload       jsonb       NOT NULL,
    -- SHA-256 of the RFC 8785 form. Set by the Rust API at record time; for rows recorded by the
    -- SQL function it is computed by the relay (the single canonicalizer) when it first publishes.
    payload_hash  text        CHECK (payload_hash ~ '^[0-9a-f]{64}$'),
    approved_by   text        NOT NULL,
    approved_at   timestamptz NOT NULL,
    recorded_at   timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE handoff.outbox (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_key    text        NOT NULL UNIQUE REFERENCES handoff.approved_action (operation_key),
    state            text        NOT NULL DEFAULT 'pending'
                                 CHECK (state IN ('pending', 'published', 'blocked')),
    -- Publish attempts, counted when a relay claims the row (before it sends anything).
    attempts         integer     NOT NULL DEFAULT 0,
    -- When the row is next due. While a relay holds the row this is also its lease expiry: a relay
    -- that dies simply lets the row fall due again, and another relay takes it.
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    lease_owner      text,
    last_error       text,
    stream           text,
    stream_sequence  bigint,
    -- The PubAck said the broker already held this message id (a re-publish after a lost ack).
    duplicate        boolean,
    published_at     timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now()
);

-- The claim query walks this partial index in due order; published and blocked rows are not in it,
-- so its size tracks the backlog, not the table.
CREATE INDEX outbox_due ON handoff.outbox (next_attempt_at) WHERE state = 'pending';

-- A wake-up hint for idle relays. Polling remains the guarantee (notifications are lost while a
-- listener reconnects); one notification per statement keeps bulk inserts cheap.
CREATE FUNCTION handoff.notify_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('handoff_outbox', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_notify AFTER INSERT ON handoff.outbox
    FOR EACH STATEMENT EXECUTE FUNCTION handoff.notify_outbox();

-- The producer contract for any language. Call it inside the transaction that makes the business
-- change, so the approval and the delivery intent commit or roll back with it.
--
--   SELECT * FROM handoff.record_approved_action(
--       'harbor:create-followup:v1:case-104',
--       '{"case_id":"case-104","title":"Call about the approved repair plan"}',
--       'user-17');
--
-- Returns (recorded_key, created): created = false when the same key was already recorded with an
-- equal payload (nothing is added). Raises
--   SQLSTATE HO422 for invalid input (bad key, payload not a non-empty object or over 64 KiB,
--                  missing approver), and
--   SQLSTATE HO409 when the key is already recorded with a different payload.
-- Either error aborts the statement and changes nothing.
CREATE FUNCTION handoff.record_approved_action(
    p_operation_key text,
    p_payload       jsonb,
    p_approved_by   text,
    p_approved_at   timestamptz DEFAULT now(),
    p_payload_hash  text DEFAULT NULL,
    OUT recorded_key text,
    OUT created      boolean
) LANGUAGE plpgsql AS $$
DECLARE
    v_existing jsonb;
BEGIN
    IF p_operation_key IS NULL OR p_operation_key !~
        '^[a-z][a-z0-9-]{0,31}:[a-z][a-z0-9-]{0,63}:v[1-9][0-9]{0,3}:[A-Za-z0-9][A-Za-z0-9._-]{0,127}$' THEN
        RAISE EXCEPTION 'invalid operation key'
            USING ERRCODE = 'HO422',
                  HINT = 'expected namespace:action:vN:entity, see OperationKey';
    END IF;
    IF p_payload IS NULL OR jsonb_typeof(p_payload) <> 'object' OR p_payload = '{}'::jsonb THEN
        RAISE EXCEPTION 'payload must be a non-empty JSON object' USING ERRCODE = 'HO422';
    END IF;
    IF octet_length(p_payload::text) > 65536 THEN
        RAISE EXCEPTION 'payload is larger than 64 KiB' USING ERRCODE = 'HO422';
    END IF;
    IF p_approved_by IS NULL OR btrim(p_approved_by) = '' OR char_length(btrim(p_approved_by)) > 200
       OR p_approved_by ~ '[[:cntrl:]]' THEN
        RAISE EXCEPTION 'approved_by must be 1-200 printable characters' USING ERRCODE = 'HO422';
    END IF;
    IF p_approved_at IS NULL THEN
        RAISE EXCEPTION 'approved_at is required' USING ERRCODE = 'HO422';
    END IF;
    IF p_payload_hash IS NOT NULL AND p_payload_hash !~ '^[0-9a-f]{64}$' THEN
        RAISE EXCEPTION 'payload hash must be 64 lowercase hex digits' USING ERRCODE = 'HO422';
    END IF;

    -- A concurrent recorder of the same key waits here on the primary key until the other
    -- transaction ends, then sees its row: no race between "check" and "insert".
    INSERT INTO handoff.approved_action (operation_key, payload, payload_hash, approved_by, approved_at)
    VALUES (p_operation_key, p_payload, p_payload_hash, btrim(p_approved_by), p_approved_at)
    ON CONFLICT (operation_key) DO NOTHING;

    recorded_key := p_operation_key;
    IF FOUND THEN
        INSERT INTO handoff.outbox (operation_key) VALUES (p_operation_key);
        created := true;
        RETURN;
    END IF;

    SELECT a.payload INTO v_existing FROM handoff.approved_action a WHERE a.operation_key = p_operation_key;
    IF v_existing = p_payload THEN
        created := false;
        RETURN;
    END IF;
    RAISE EXCEPTION 'operation key % is already recorded with a different payload', p_operation_key
        USING ERRCODE = 'HO409',
              HINT = 'a changed action needs a new approval under a new key version';
END
$$;
