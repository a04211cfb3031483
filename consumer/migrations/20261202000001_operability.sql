-- What operators need on the consumer side: depths that do not scan history, resolutions that
-- keep the record, and paused action types.

-- Ledger rows waiting for a person, counted and listed without scanning every settled row.
CREATE INDEX crm_operation_review ON handoff_consumer.crm_operation (updated_at) WHERE state = 'review';

-- Conflicts and dead letters are resolved, never deleted: who, when and how stay with the row.
ALTER TABLE handoff_consumer.review
    ADD COLUMN resolved_at timestamptz,
    ADD COLUMN resolved_by text,
    ADD COLUMN resolution  text;
CREATE INDEX review_open ON handoff_consumer.review (id) WHERE resolved_at IS NULL;

ALTER TABLE handoff_consumer.dead_letter
    ADD COLUMN resolved_at         timestamptz,
    ADD COLUMN resolved_by         text,
    ADD COLUMN resolution          text,
    -- `handoff-admin dead-letter replay`: a replica verifies the stored message again and, if it
    -- now verifies, handles it like a delivery (the inbox still decides once per key).
    ADD COLUMN replay_requested_at timestamptz,
    ADD COLUMN replay_requested_by text,
    -- What the last replay found (its outcome, or why it still fails).
    ADD COLUMN last_replay         text;
CREATE INDEX dead_letter_replay_requested ON handoff_consumer.dead_letter (id)
    WHERE replay_requested_at IS NOT NULL AND resolved_at IS NULL;
CREATE INDEX dead_letter_open ON handoff_consumer.dead_letter (id) WHERE resolved_at IS NULL;
CREATE INDEX dead_letter_by_message_id ON handoff_consumer.dead_letter (message_id);

-- Operator actions on a whole action type (pause, resume) have no key.
ALTER TABLE handoff_consumer.audit
    ALTER COLUMN operation_key DROP NOT NULL,
    ADD COLUMN action_type text;

-- Action types (`namespace:action`) an operator paused: the dispatcher holds their CRM calls.
CREATE TABLE handoff_consumer.paused_action (
    action_type text        PRIMARY KEY CHECK (action_type ~ '^[a-z][a-z0-9-]{0,31}:[a-z][a-z0-9-]{0,63}$'),
    paused_by   text        NOT NULL,
    reason      text        NOT NULL,
    paused_at   timestamptz NOT NULL DEFAULT now()
);
