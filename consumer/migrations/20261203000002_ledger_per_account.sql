-- The ledger is unique per (destination account, operation key), as seed 004 asks: the same key
-- sent to two accounts is two effects, each proven in its own account (a dispatcher only works
-- its own account's rows, and a lookup in one account proves nothing about another). The event
-- log names the account of each row it belongs to.
--
-- Backfilling crm_event.account rewrites the event log once; on a large log, run `migrate`
-- before the upgrade window (the consumer refuses to start with --migrate never until it has).

ALTER TABLE handoff_consumer.crm_event ADD COLUMN account text;
UPDATE handoff_consumer.crm_event AS e SET account = o.account
  FROM handoff_consumer.crm_operation AS o WHERE o.operation_key = e.operation_key;
ALTER TABLE handoff_consumer.crm_event ALTER COLUMN account SET NOT NULL;

ALTER TABLE handoff_consumer.crm_event DROP CONSTRAINT crm_event_operation_key_fkey;
ALTER TABLE handoff_consumer.crm_operation DROP CONSTRAINT crm_operation_pkey;
-- Key first: operators and the inbox look a key up without its account, on this index's prefix
-- (no second index for every ledger update to maintain).
ALTER TABLE handoff_consumer.crm_operation ADD CONSTRAINT crm_operation_pkey PRIMARY KEY (operation_key, account);
ALTER TABLE handoff_consumer.crm_event ADD CONSTRAINT crm_event_operation_fkey
    FOREIGN KEY (operation_key, account) REFERENCES handoff_consumer.crm_operation (operation_key, account);
