-- What operators need: counts that do not scan the table, an audit trail, and paused action types.
--
-- Blocked rows join the per-row path's index. A blocked row is off the range path already (it
-- failed there or on the retry path); it now keeps `retrying = true` with `next_attempt_at =
-- 'infinity'`, so it is never due, and the sampler counts blocked rows (and the operator lists them)
-- from the small `outbox_retry_due` index instead of scanning every published row. The happy
-- path is unchanged: marking a row published touches no indexed column (HOT).
UPDATE handoff.outbox SET retrying = true, next_attempt_at = 'infinity' WHERE state = 'blocked';

-- Rows held because their action type is paused wait the same way (state `pending`, never due,
-- no attempt counted); `handoff-admin resume` makes them due again.

-- Operator actions on the producer side (unblock, re-queue after broker loss, pause, resume):
-- who, when, why. Never updated or deleted.
CREATE TABLE handoff.audit (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The key acted on, or NULL for an action on an action type (pause, resume).
    operation_key text,
    action_type   text,
    actor         text        NOT NULL CHECK (btrim(actor) <> ''),
    action        text        NOT NULL,
    reason        text        NOT NULL CHECK (btrim(reason) <> ''),
    at            timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX audit_by_key ON handoff.audit (operation_key, id);

-- Action types (`namespace:action`) an operator paused: the relay holds their rows without
-- counting attempts or blocking them.
CREATE TABLE handoff.paused_action (
    action_type text        PRIMARY KEY CHECK (action_type ~ '^[a-z][a-z0-9-]{0,31}:[a-z][a-z0-9-]{0,63}$'),
    paused_by   text        NOT NULL,
    reason      text        NOT NULL,
    paused_at   timestamptz NOT NULL DEFAULT now()
);
