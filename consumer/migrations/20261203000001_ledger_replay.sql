-- Idempotency-key destinations: with readback unavailable, a create is sent again with the same
-- key while the destination still retains it (state `replay`; the replay returns the original
-- task or creates the missing one). Retention is judged from `key_sent_at`: the first create of
-- the current unproven episode, reset when an attempt is proved not executed.
--
--   unknown ──readback unavailable, key retained, budget left──▶ replay ──claim──▶ dispatching
--   dispatching ──2xx with our hash──▶ settled (proof replay_by_key)
--               └─refused / unknown──▶ unknown (the attempt before the replay is still unproven)

ALTER TABLE handoff_consumer.crm_operation DROP CONSTRAINT crm_operation_state_check;
ALTER TABLE handoff_consumer.crm_operation ADD CONSTRAINT crm_operation_state_check
    CHECK (state IN ('received', 'dispatching', 'unknown', 'proved_not_executed', 'replay', 'settled', 'review'));

ALTER TABLE handoff_consumer.crm_operation ADD COLUMN key_sent_at timestamptz;
-- Rows already sent: the oldest moment a key can date from is their first attempt.
UPDATE handoff_consumer.crm_operation SET key_sent_at = first_attempt_at
 WHERE state IN ('dispatching', 'unknown', 'review', 'settled');

DROP INDEX handoff_consumer.crm_operation_due;
CREATE INDEX crm_operation_due ON handoff_consumer.crm_operation (account, next_attempt_at)
    WHERE state IN ('received', 'dispatching', 'unknown', 'proved_not_executed', 'replay');
