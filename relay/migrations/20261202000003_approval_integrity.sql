-- A recorded approval is what a person approved: it never changes.
--
-- Before, a payload changed after handoff.record_approved_action (SQL path, no hash passed) and
-- before the first claim was published as if approved: the relay hashes what it reads at first
-- publish. Now every UPDATE of an approved action is refused (SQLSTATE HO403), except the relay
-- filling in the payload hash it computed for a row recorded without one. A DELETE is refused too
-- while an outbox row references the approval (the foreign key said so already); afterwards the
-- application may remove its own history. A changed action needs a new approval under a new key
-- version. The relay's hash check stays as the second line: a role that can bypass triggers
-- (a superuser, session_replication_role = replica) still cannot get a changed payload published.

CREATE FUNCTION handoff.refuse_approval_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF EXISTS (SELECT 1 FROM handoff.outbox WHERE operation_key = OLD.operation_key) THEN
            RAISE EXCEPTION 'approved action % is referenced by its outbox row and cannot be deleted', OLD.operation_key
                USING ERRCODE = 'HO403';
        END IF;
        RETURN OLD;
    END IF;
    IF NEW.operation_key IS DISTINCT FROM OLD.operation_key
       OR NEW.payload IS DISTINCT FROM OLD.payload
       OR NEW.approved_by IS DISTINCT FROM OLD.approved_by
       OR NEW.approved_at IS DISTINCT FROM OLD.approved_at
       OR NEW.recorded_at IS DISTINCT FROM OLD.recorded_at
       OR NEW.traceparent IS DISTINCT FROM OLD.traceparent
       OR (OLD.payload_hash IS NOT NULL AND NEW.payload_hash IS DISTINCT FROM OLD.payload_hash) THEN
        RAISE EXCEPTION 'approved action % is immutable', OLD.operation_key
            USING ERRCODE = 'HO403',
                  HINT = 'a changed action needs a new approval under a new key version';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER approved_action_is_immutable BEFORE UPDATE OR DELETE ON handoff.approved_action
    FOR EACH ROW EXECUTE FUNCTION handoff.refuse_approval_change();
