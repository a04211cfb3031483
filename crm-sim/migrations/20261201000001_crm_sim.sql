-- The simulated CRM's own storage (schema crm_sim). It plays the remote provider: the
-- consumer never reads these tables, it only talks HTTP to the simulator.
--
-- tasks: every task the CRM ever created (one row = one provider effect). external_id is not
--        unique here on purpose: uniqueness is a provider setting (enforce_unique_external_id),
--        and a provider without it can end up holding several tasks for one external id.
-- idempotency_keys: the provider's idempotency records. A record older than the configured
--        retention is ignored and replaced by the next request with that key, as real providers
--        forget keys after 24 hours or so.

CREATE SCHEMA IF NOT EXISTS crm_sim;

CREATE TABLE crm_sim.tasks (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    external_id     text        NOT NULL,
    payload_hash    text        NOT NULL,
    data            jsonb       NOT NULL,
    -- The Idempotency-Key of the request that created the task, if it carried one.
    idempotency_key text,
    created_at      timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX tasks_external_id_idx ON crm_sim.tasks (external_id, created_at);

CREATE TABLE crm_sim.idempotency_keys (
    idempotency_key text        PRIMARY KEY,
    task_id         bigint      NOT NULL REFERENCES crm_sim.tasks (id),
    payload_hash    text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
