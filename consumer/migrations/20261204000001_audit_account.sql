-- An operator's resolution of a ledger row names the destination account it resolved: the
-- ledger is unique per (account, operation key), so a key sent to two accounts has two rows, each
-- resolved on its own (`handoff-admin resolve --account`). Rows from before this migration get
-- the account of their key where the key has one ledger row; the rest (conflicts, dead letters,
-- pauses, a key in several accounts) stay NULL.
ALTER TABLE handoff_consumer.audit ADD COLUMN account text;
UPDATE handoff_consumer.audit AS a SET account = o.account
  FROM handoff_consumer.crm_operation AS o
 WHERE o.operation_key = a.operation_key
   AND a.action IN ('record_receipt', 'approve_new_attempt')
   AND NOT EXISTS (SELECT 1 FROM handoff_consumer.crm_operation AS other
                    WHERE other.operation_key = o.operation_key AND other.account <> o.account);
