-- Least privilege in the consumer's own database. Run as the role that owns the handoff_consumer
-- schema (the one `handoff-consumer migrate` runs as), after every migration; it is idempotent.
--
--   handoff_consumer_runtime  a running replica: intake, the ledger and its dispatcher, replays
--   handoff_operator          handoff-admin: reads everything, resolves (audited)
--
--   CREATE ROLE consumer_login LOGIN PASSWORD '...' IN ROLE handoff_consumer_runtime;
--
-- The replicas run with HANDOFF_MIGRATE=never (they cannot change the schema).

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'handoff_consumer_runtime') THEN
        CREATE ROLE handoff_consumer_runtime NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'handoff_operator') THEN
        CREATE ROLE handoff_operator NOLOGIN;
    END IF;
END
$$;

GRANT USAGE ON SCHEMA handoff_consumer TO handoff_consumer_runtime, handoff_operator;

-- A replica: exactly the statements in consumer/src (inbox, crm, ledger, review's reads).
GRANT SELECT ON handoff_consumer._sqlx_migrations TO handoff_consumer_runtime;
GRANT SELECT, INSERT, UPDATE ON handoff_consumer.inbox TO handoff_consumer_runtime;
GRANT SELECT, INSERT ON handoff_consumer.crm_task TO handoff_consumer_runtime;
GRANT SELECT, INSERT, UPDATE ON handoff_consumer.crm_operation TO handoff_consumer_runtime;
GRANT SELECT, INSERT ON handoff_consumer.crm_event TO handoff_consumer_runtime;
GRANT SELECT, INSERT ON handoff_consumer.review TO handoff_consumer_runtime;
GRANT SELECT, INSERT, UPDATE ON handoff_consumer.dead_letter TO handoff_consumer_runtime;
GRANT SELECT ON handoff_consumer.paused_action TO handoff_consumer_runtime;

-- The operator (handoff-admin).
GRANT SELECT ON ALL TABLES IN SCHEMA handoff_consumer TO handoff_operator;
GRANT UPDATE ON handoff_consumer.crm_operation, handoff_consumer.review, handoff_consumer.dead_letter
    TO handoff_operator;
GRANT INSERT ON handoff_consumer.crm_event, handoff_consumer.audit TO handoff_operator;
GRANT INSERT, DELETE ON handoff_consumer.paused_action TO handoff_operator;
