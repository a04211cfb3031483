-- Least privilege in the producer (application) database. Run as the role that owns the handoff
-- schema (the one `handoff-relay migrate` runs as), after every migration; it is idempotent.
--
-- Group roles (NOLOGIN); make your login roles members of them:
--   handoff_relay_runtime   the running relay: claims, publishes, settles, applies retention
--   handoff_application     the application: may only call handoff.record_approved_action
--   handoff_operator        handoff-admin: reads everything, unblocks, re-queues, pauses (audited)
--
--   CREATE ROLE relay_login LOGIN PASSWORD '...' IN ROLE handoff_relay_runtime;
--   CREATE ROLE app_login   LOGIN PASSWORD '...' IN ROLE handoff_application;
--
-- The relay runs with HANDOFF_MIGRATE=never (it cannot change the schema). To name the transaction
-- that holds outbox rows back, also grant it pg_read_all_stats (optional).

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'handoff_relay_runtime') THEN
        CREATE ROLE handoff_relay_runtime NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'handoff_application') THEN
        CREATE ROLE handoff_application NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'handoff_operator') THEN
        CREATE ROLE handoff_operator NOLOGIN;
    END IF;
END
$$;

GRANT USAGE ON SCHEMA handoff TO handoff_relay_runtime, handoff_application, handoff_operator;

-- The relay: exactly the statements in relay/src/outbox.rs and relay/src/reconcile.rs (reads).
GRANT SELECT ON handoff._sqlx_migrations TO handoff_relay_runtime;
GRANT SELECT, UPDATE (payload_hash) ON handoff.approved_action TO handoff_relay_runtime;
GRANT SELECT, UPDATE, DELETE ON handoff.outbox TO handoff_relay_runtime;
GRANT SELECT, UPDATE ON handoff.relay_cursor TO handoff_relay_runtime;
GRANT SELECT, INSERT, UPDATE, DELETE ON handoff.relay_batch TO handoff_relay_runtime;
-- UPDATE only for the row lock of retention (FOR UPDATE SKIP LOCKED); the relay never updates a range.
GRANT SELECT, INSERT, UPDATE, DELETE ON handoff.published_range TO handoff_relay_runtime;
GRANT SELECT ON handoff.outbox_delivery TO handoff_relay_runtime;
GRANT SELECT ON handoff.paused_action TO handoff_relay_runtime;

-- The application: the SQL contract only (the function is SECURITY DEFINER, see the migration
-- `least_privilege`); no table rights, so it can record an approval but never change one.
REVOKE ALL ON FUNCTION handoff.record_approved_action(text, jsonb, text, timestamptz, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION handoff.record_approved_action(text, jsonb, text, timestamptz, text, text)
    TO handoff_application;

-- The operator (handoff-admin): reads everything; changes only what its subcommands change.
GRANT SELECT ON ALL TABLES IN SCHEMA handoff TO handoff_operator;
GRANT UPDATE ON handoff.outbox TO handoff_operator;
GRANT INSERT, DELETE ON handoff.paused_action TO handoff_operator;
GRANT INSERT ON handoff.audit TO handoff_operator;
