-- Trace context: a producer may pass its W3C `traceparent` with the approval. The relay carries it
-- as the CloudEvents distributed-tracing extension; the consumer continues it in its logs and sends
-- it to the CRM. It is diagnostic: it is not part of the approved payload or its hash, so the same
-- key and payload recorded again with another trace context is still "already recorded".
--
--   SELECT * FROM handoff.record_approved_action(
--       'harbor:create-followup:v1:case-104', '{"case_id":"case-104"}', 'user-17', now(), NULL,
--       '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01');
--
-- A malformed trace context is invalid input (HO422, nothing written): the producer learns at once.

ALTER TABLE handoff.approved_action ADD COLUMN traceparent text;

-- The function gains a trailing parameter; calls with four or five arguments keep working.
DROP FUNCTION handoff.record_approved_action(text, jsonb, text, timestamptz, text);

CREATE FUNCTION handoff.record_approved_action(
    p_operation_key text,
    p_payload       jsonb,
    p_approved_by   text,
    p_approved_at   timestamptz DEFAULT now(),
    p_payload_hash  text DEFAULT NULL,
    p_traceparent   text DEFAULT NULL,
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
    IF p_traceparent IS NOT NULL AND (p_traceparent !~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
       OR p_traceparent ~ '^00-0{32}-' OR p_traceparent ~ '-0{16}-[0-9a-f]{2}$') THEN
        RAISE EXCEPTION 'traceparent must be a W3C trace context: 00-<32 hex>-<16 hex>-<2 hex>, ids not all zero'
            USING ERRCODE = 'HO422';
    END IF;

    -- A concurrent recorder of the same key waits here on the primary key until the other
    -- transaction ends, then sees its row: no race between "check" and "insert".
    INSERT INTO handoff.approved_action (operation_key, payload, payload_hash, approved_by, approved_at, traceparent)
    VALUES (p_operation_key, p_payload, p_payload_hash, btrim(p_approved_by), p_approved_at, p_traceparent)
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
