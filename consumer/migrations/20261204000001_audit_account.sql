-- An operator's resolution of a ledger row names the destination account it resolved: the
-- ledger is unique per (account, operation key), so a key sent to two accounts has two rows, each
-- resolved on its own (`handoff-admin resolve --account`). Rows from before this migration get
-- their account from the `operator` event the same resolution wrote in the same transaction (same
-- key, same now()); the key's other actions (conflicts, dead letters, pauses) name no account.
ALTER TABLE handoff_consumer.audit ADD COLUMN account text;
UPDATE handoff_consumer.audit AS a SET account = e.account
  FROM handoff_consumer.crm_event AS e
 WHERE e.operation_key = a.operation_key AND e.kind = 'operator' AND e.at = a.at
   AND a.action IN ('record_receipt', 'approve_new_attempt');
