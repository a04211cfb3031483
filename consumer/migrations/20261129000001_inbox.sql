-- The consumer side of handoff, in the consumer's own database.
--
-- inbox: one row per operation key ever processed; its primary key is the guarantee that a key is
--        handled once, whatever the broker redelivers or re-stores.
-- crm_task: the local CRM store, with its own unique operation key (the receiver contract: a replay
--        returns the existing task, different content for the same key is a conflict).
-- review: what a person must look at (same key, different content).
-- dead_letter: messages that could not be processed, with the reason and the raw message.
-- Rows are never deleted by the consumer.

CREATE SCHEMA IF NOT EXISTS handoff_consumer;

CREATE TABLE handoff_consumer.inbox (
    operation_key   text        PRIMARY KEY,
    payload_hash    text        NOT NULL,
    stream_sequence bigint      NOT NULL,
    -- task_created | task_existed | conflict
    outcome         text        NOT NULL CHECK (outcome IN ('task_created', 'task_existed', 'conflict')),
    task_id         bigint,
    received_at     timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE handoff_consumer.crm_task (
    task_id       bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_key text        NOT NULL UNIQUE,
    payload_hash  text        NOT NULL,
    payload       jsonb       NOT NULL,
    approved_by   text        NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE handoff_consumer.review (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_key   text        NOT NULL,
    reason          text        NOT NULL,
    incoming_hash   text        NOT NULL,
    existing_hash   text        NOT NULL,
    stream_sequence bigint      NOT NULL,
    recorded_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX review_by_key ON handoff_consumer.review (operation_key);

CREATE TABLE handoff_consumer.dead_letter (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    stream_sequence bigint      NOT NULL,
    subject         text        NOT NULL,
    -- The Nats-Msg-Id header as received (may be absent or not a valid key).
    message_id      text,
    reason          text        NOT NULL,
    deliveries      bigint      NOT NULL,
    -- The raw message, so nothing is lost; it may hold personal data and is never logged.
    headers         jsonb       NOT NULL,
    body            bytea       NOT NULL,
    recorded_at     timestamptz NOT NULL DEFAULT now(),
    UNIQUE (stream_sequence, reason)
);
