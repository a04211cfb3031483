-- The inbox no longer copies the CRM's task id: the task is found by its operation key, which is
-- unique in the CRM (crm_task.operation_key here, the external id in a remote CRM, whose id the
-- ledger keeps in crm_operation.crm_task_id). Recording the id meant a second write of every inbox
-- row of a batch (an UPDATE after the task insert); now a new key's row is inserted with the CRM's
-- usual outcome and only the exceptions (task_existed, conflict) are updated.
ALTER TABLE handoff_consumer.inbox DROP COLUMN task_id;
