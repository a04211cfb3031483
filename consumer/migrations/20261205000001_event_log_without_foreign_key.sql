-- The event log no longer carries a foreign key to the ledger. Its check ran once per evidence
-- row, i.e. once per CRM call, and with the consumer's custom plans (`plan_cache_mode =
-- force_custom_plan`, see the platform notes) it was planned afresh every time: measured at 64
-- calls in flight, 8 µs of execution and 38 µs of planning per message, a sixth of the replica's
-- Postgres time. What the key guarded is held by how events are written: every statement that
-- appends an event either writes the ledger row in the same statement (claim, record) or holds
-- the ledger row's lock in the same transaction (operator actions), and ledger rows are never
-- deleted. `handoff-admin explain` still finds a key's events by `crm_event_by_key`.
ALTER TABLE handoff_consumer.crm_event DROP CONSTRAINT crm_event_operation_fkey;
