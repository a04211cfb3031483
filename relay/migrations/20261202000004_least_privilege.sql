-- The application may be given nothing but EXECUTE on the SQL contract (deploy/sql/producer-roles.sql):
-- the function runs with its owner's rights, so the caller needs no table rights and can therefore
-- record an approval but never change or remove one. A fixed search_path keeps a caller's own
-- objects from being resolved inside it (every reference in the body is schema-qualified or in
-- pg_catalog).
ALTER FUNCTION handoff.record_approved_action(text, jsonb, text, timestamptz, text, text)
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp;
