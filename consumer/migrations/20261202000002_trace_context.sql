-- The producer's W3C trace context, kept with what the consumer recorded so the dispatcher can send
-- it to the remote CRM (as `traceparent`, with a new parent id per call) and operators can follow a
-- key into their tracing system. Diagnostic only: never part of a decision.
ALTER TABLE handoff_consumer.crm_operation ADD COLUMN traceparent text;
ALTER TABLE handoff_consumer.crm_task ADD COLUMN traceparent text;
