-- One evidence row per CRM call: the decision a call led to is kept on the call's own row
-- (`decision`, the note), instead of a second row of kind 'decision' beside every attempt and
-- readback. Rows written before keep their separate 'decision' rows; a decision made without a
-- call (an expired idempotency key) is still a row of kind 'decision'.
ALTER TABLE handoff_consumer.crm_event ADD COLUMN decision text;
