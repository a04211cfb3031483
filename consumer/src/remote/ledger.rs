//! The remote-CRM ledger (`handoff_consumer.crm_operation`), its evidence (`crm_event`) and the
//! operators' audit (`audit`): every statement on those tables. See the state diagram in
//! `migrations/20261129000002_remote_crm_ledger.sql` and [`LedgerState`].

use std::sync::LazyLock;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgConnection, PgPool};

use super::LedgerState;
use super::decide::Decision;
use crate::crm::{Crm, CrmError, TaskOutcome, TaskRequest};
use crate::inbox::{self, Arrival};

/// The intake side of a remote CRM: inside the consumer's batch transaction, each new key gets a
/// ledger row (`received`) that the dispatcher will drive to `settled` or `review`. The message is
/// acked once this is committed: from then on the database, not the broker, owns the retries.
#[derive(Debug, Clone)]
pub struct LedgerCrm {
    /// The destination account, recorded on every ledger row: the ledger is unique per
    /// (account, operation key), and a dispatcher only works its own account's rows.
    pub account: String,
}

/// [`LedgerCrm`]'s half of [`Crm::create_usual`]: a `received` ledger row per arrival (`$1` keys,
/// `$2` hashes) for the account `$5`.
static ACCEPT_USUAL: LazyLock<String> = LazyLock::new(|| {
    inbox::with_new_arrivals(
        r#"
        INSERT INTO handoff_consumer.crm_operation (operation_key, account, payload_hash, payload, traceparent)
        SELECT k, $5, h, p, t FROM UNNEST($1::text[], $2::text[], $6::jsonb[], $7::text[]) AS u(k, h, p, t)
        RETURNING operation_key, NULL::bigint"#,
    )
});

impl Crm for LedgerCrm {
    const USUAL_OUTCOME: &'static str = crate::inbox::outcome::ACCEPTED;

    async fn create_tasks(
        &self,
        conn: &mut PgConnection,
        requests: &[TaskRequest],
    ) -> Result<Vec<TaskOutcome>, CrmError> {
        const ACCEPT: &str = r#"
            INSERT INTO handoff_consumer.crm_operation (operation_key, account, payload_hash, payload, traceparent)
            SELECT k, $1, h, p, t FROM UNNEST($2::text[], $3::text[], $4::jsonb[], $5::text[]) AS u(k, h, p, t)
            ON CONFLICT (operation_key, account) DO NOTHING
            RETURNING operation_key"#;
        const EXISTING: &str = r#"
            SELECT operation_key, payload_hash FROM handoff_consumer.crm_operation
             WHERE account = $2 AND operation_key = ANY($1::text[])"#;
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<&str> = requests.iter().map(|r| r.operation_key.as_str()).collect();
        let accepted: Vec<(String,)> = sqlx::query_as(ACCEPT)
            .bind(&self.account)
            .bind(&keys)
            .bind(requests.iter().map(|r| r.payload_hash.as_str()).collect::<Vec<_>>())
            .bind(requests.iter().map(|r| r.payload.clone()).collect::<Vec<_>>())
            .bind(requests.iter().map(|r| r.traceparent.as_deref()).collect::<Vec<_>>())
            .fetch_all(&mut *conn)
            .await?;
        let accepted: std::collections::HashSet<String> = accepted.into_iter().map(|(k,)| k).collect();
        // A ledger row can already exist only if the inbox lost its row (a restore, a purge): compare
        // rather than silently accept a payload that will never be sent.
        let existing: std::collections::HashMap<String, String> = if accepted.len() < requests.len() {
            sqlx::query_as::<_, (String, String)>(EXISTING)
                .bind(&keys)
                .bind(&self.account)
                .fetch_all(&mut *conn)
                .await?
                .into_iter()
                .collect()
        } else {
            Default::default()
        };
        Ok(requests
            .iter()
            .map(|r| {
                if accepted.contains(&r.operation_key) {
                    TaskOutcome::Accepted
                } else if existing.get(&r.operation_key) == Some(&r.payload_hash) {
                    TaskOutcome::Existing { task_id: -1 }
                } else {
                    TaskOutcome::Conflict { task_id: -1 }
                }
            })
            .collect())
    }

    async fn create_usual(
        &self,
        pool: &PgPool,
        arrivals: &[Arrival],
        requests: &[TaskRequest],
    ) -> Result<Option<Vec<TaskOutcome>>, CrmError> {
        let query = inbox::bind_new_arrivals(
            sqlx::query_as(sqlx::AssertSqlSafe(ACCEPT_USUAL.as_str())),
            arrivals,
            Self::USUAL_OUTCOME,
        )
        .bind(&self.account)
        .bind(requests.iter().map(|r| r.payload.clone()).collect::<Vec<_>>())
        .bind(requests.iter().map(|r| r.traceparent.as_deref()).collect::<Vec<_>>());
        crate::crm::run_usual(query, pool, arrivals, |_| Some(TaskOutcome::Accepted)).await
    }
}

/// A ledger row a dispatcher holds under lease.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ClaimedOperation {
    pub operation_key: String,
    pub account: String,
    pub payload_hash: String,
    pub payload: sqlx::types::Json<serde_json::Value>,
    /// The state before the claim: `received` / `proved_not_executed` / `replay` (a create
    /// follows), `unknown` (a readback follows) or `dispatching` (its replica died mid-call:
    /// readback).
    pub prior_state: LedgerState,
    /// Create attempts, including one this claim starts.
    pub attempts: i32,
    pub first_attempt_at: Option<DateTime<Utc>>,
    /// When the last create attempt started.
    pub last_attempt_at: Option<DateTime<Utc>>,
    /// When the first create of the current unproven episode was sent: the oldest moment the
    /// destination may have recorded the idempotency key (reset when an attempt is proved not
    /// executed). Key retention is judged from it.
    pub key_sent_at: Option<DateTime<Utc>>,
    pub unknown_since: Option<DateTime<Utc>>,
    /// The database's clock at the claim: every age is measured on this one clock, never the
    /// application host's (a skewed host clock must not shorten a freshness or retention window).
    pub db_now: DateTime<Utc>,
    /// The producer's trace context, sent on to the CRM.
    pub traceparent: Option<String>,
    /// The attempt columns as they were before the claim: what [`release_unsent`] restores.
    #[sqlx(flatten)]
    pub before: BeforeClaim,
}

/// A claimed row's attempt columns before its claim changed them, so a claim whose call was never
/// sent can be undone exactly ([`release_unsent`]).
#[derive(Debug, Clone, Default, sqlx::FromRow)]
pub struct BeforeClaim {
    pub prior_first_attempt_at: Option<DateTime<Utc>>,
    pub prior_last_attempt_at: Option<DateTime<Utc>>,
    pub prior_key_sent_at: Option<DateTime<Utc>>,
    pub prior_unknown_since: Option<DateTime<Utc>>,
}

impl ClaimedOperation {
    /// The claim starts a create (counted as an attempt), not a readback.
    pub fn creates(&self) -> bool {
        self.prior_state.sends_create()
    }
}

/// The dispatcher's statements by name. Its pool plans each once per connection
/// ([`handoff_shared::config::Plans::OncePerConnection`]), so each is written to have the keyed
/// plan whatever the ledger's size; a test checks their generic plans on an empty ledger.
pub const DISPATCH_STATEMENTS: [(&str, &str); 3] =
    [("claim_due", CLAIM_DUE), ("release_unsent", RELEASE_UNSENT), ("record_many", RECORD_DECISIONS)];

const CLAIM_DUE: &str = r#"
    WITH due AS (
        SELECT operation_key, state AS prior_state, lease_owner AS prior_owner,
               state IN ('received', 'proved_not_executed', 'replay') AS creates,
               first_attempt_at AS prior_first_attempt_at, last_attempt_at AS prior_last_attempt_at,
               key_sent_at AS prior_key_sent_at, unknown_since AS prior_unknown_since
          FROM handoff_consumer.crm_operation
         WHERE state IN ('received', 'dispatching', 'unknown', 'proved_not_executed', 'replay')
           AND next_attempt_at <= now()
           AND account = $4
           -- A paused action type's calls wait (readbacks too: an operator is looking).
           AND NOT EXISTS (SELECT 1 FROM handoff_consumer.paused_action AS p
                            WHERE p.action_type = split_part(operation_key, ':', 1) || ':' || split_part(operation_key, ':', 2))
         ORDER BY next_attempt_at
         LIMIT $1
           FOR UPDATE SKIP LOCKED
    ), claimed AS (
        UPDATE handoff_consumer.crm_operation AS o
           SET state = CASE WHEN due.creates THEN 'dispatching' ELSE 'unknown' END,
               attempts = o.attempts + CASE WHEN due.creates THEN 1 ELSE 0 END,
               readbacks = o.readbacks + CASE WHEN due.creates THEN 0 ELSE 1 END,
               first_attempt_at = COALESCE(o.first_attempt_at, now()),
               last_attempt_at = CASE WHEN due.creates THEN now() ELSE o.last_attempt_at END,
               key_sent_at = CASE WHEN due.creates THEN COALESCE(o.key_sent_at, now()) ELSE o.key_sent_at END,
               -- A replay continues the unknown episode; a first or proved-absent attempt starts afresh.
               unknown_since = CASE WHEN due.prior_state IN ('received', 'proved_not_executed') THEN NULL
                                    WHEN due.prior_state = 'dispatching' THEN now()
                                    ELSE o.unknown_since END,
               lease_owner = $2,
               lease_until = now() + make_interval(secs => $3),
               next_attempt_at = now() + make_interval(secs => $3),
               updated_at = now()
          FROM due
         -- The keys again as an index condition: the plan is the keyed lookup at any table size
         -- (see DISPATCH_STATEMENTS).
         WHERE o.account = $4 AND o.operation_key = ANY(ARRAY(SELECT operation_key FROM due))
           AND o.operation_key = due.operation_key
     RETURNING o.operation_key, o.account, o.payload_hash, o.payload, due.prior_state, due.prior_owner,
               o.attempts, o.first_attempt_at, o.last_attempt_at, o.key_sent_at, o.unknown_since,
               now() AS db_now, o.traceparent, due.prior_first_attempt_at, due.prior_last_attempt_at,
               due.prior_key_sent_at, due.prior_unknown_since
    ), abandoned AS (
        INSERT INTO handoff_consumer.crm_event (account, operation_key, kind, replica, attempt, evidence, state_after)
        SELECT account, operation_key, 'attempt', prior_owner, attempts,
               'abandoned: the lease of ' || COALESCE(prior_owner, 'a replica') || ' expired before it recorded attempt '
                   || attempts || '; the request may have reached the CRM',
               'unknown'
          FROM claimed WHERE prior_state = 'dispatching'
    )
    SELECT operation_key, account, payload_hash, payload, prior_state, attempts, first_attempt_at,
           last_attempt_at, key_sent_at, unknown_since, db_now, traceparent, prior_first_attempt_at,
           prior_last_attempt_at, prior_key_sent_at, prior_unknown_since
      FROM claimed"#;

/// Claims up to `limit` due operations of `account` for `owner` for `lease`. A create claim
/// (`received`, `proved_not_executed`, `replay`) counts the attempt and records its start *before*
/// the call; an expired `dispatching` lease becomes `unknown`, because its replica may have reached
/// the CRM before dying, and its attempt gets its evidence row now (`abandoned`), so every create
/// ever sent has one.
///
/// Only rows of the dispatcher's own account are claimed: a readback in another account would
/// find nothing and wrongly "prove" non-execution.
pub async fn claim_due(
    pool: &PgPool,
    account: &str,
    owner: &str,
    limit: i64,
    lease: Duration,
) -> Result<Vec<ClaimedOperation>, sqlx::Error> {
    sqlx::query_as(CLAIM_DUE).bind(limit).bind(owner).bind(lease.as_secs_f64()).bind(account).fetch_all(pool).await
}

const RELEASE_UNSENT: &str = r#"
    UPDATE handoff_consumer.crm_operation AS o
       SET state = CASE WHEN r.creates THEN r.prior_state ELSE o.state END,
           attempts = o.attempts - CASE WHEN r.creates THEN 1 ELSE 0 END,
           readbacks = o.readbacks - CASE WHEN r.creates THEN 0 ELSE 1 END,
           first_attempt_at = CASE WHEN r.creates THEN r.first_attempt_at ELSE o.first_attempt_at END,
           last_attempt_at = CASE WHEN r.creates THEN r.last_attempt_at ELSE o.last_attempt_at END,
           key_sent_at = CASE WHEN r.creates THEN r.key_sent_at ELSE o.key_sent_at END,
           unknown_since = CASE WHEN r.creates THEN r.unknown_since ELSE o.unknown_since END,
           lease_owner = NULL, lease_until = NULL, next_attempt_at = now(), updated_at = now()
      FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bool[], $5::timestamptz[], $6::timestamptz[],
                  $7::timestamptz[], $8::timestamptz[])
           AS r(operation_key, owner, prior_state, creates, first_attempt_at, last_attempt_at, key_sent_at,
                unknown_since)
     WHERE o.account = $9 AND o.operation_key = ANY($1::text[]) AND o.operation_key = r.operation_key
       AND o.lease_owner = r.owner"#;

/// Undoes claims whose call was never sent (rows a dispatcher claimed ahead of a free slot and
/// is stopping with, or held too long to send within their lease), each only while `owner` still
/// holds it: a create claim gets its prior state and attempt columns back (the attempt it counted
/// never happened), a readback claim stays `unknown` with one readback fewer. No evidence row is
/// written: nothing reached the CRM. The rows are due again at once. Returns how many were released.
pub async fn release_unsent(
    pool: &PgPool,
    account: &str,
    claims: &[(&str, &ClaimedOperation)],
) -> Result<u64, sqlx::Error> {
    if claims.is_empty() {
        return Ok(0);
    }
    let done = sqlx::query(RELEASE_UNSENT)
        .bind(claims.iter().map(|(_, op)| op.operation_key.as_str()).collect::<Vec<_>>())
        .bind(claims.iter().map(|(owner, _)| *owner).collect::<Vec<_>>())
        .bind(claims.iter().map(|(_, op)| op.prior_state.as_str()).collect::<Vec<_>>())
        .bind(claims.iter().map(|(_, op)| op.creates()).collect::<Vec<_>>())
        .bind(claims.iter().map(|(_, op)| op.before.prior_first_attempt_at).collect::<Vec<_>>())
        .bind(claims.iter().map(|(_, op)| op.before.prior_last_attempt_at).collect::<Vec<_>>())
        .bind(claims.iter().map(|(_, op)| op.before.prior_key_sent_at).collect::<Vec<_>>())
        .bind(claims.iter().map(|(_, op)| op.before.prior_unknown_since).collect::<Vec<_>>())
        .bind(account)
        .execute(pool)
        .await?;
    Ok(done.rows_affected())
}

/// One entry of the event log.
#[derive(Debug, Clone)]
pub struct Event<'a> {
    /// attempt | readback | decision | operator
    pub kind: &'static str,
    pub attempt: Option<i32>,
    pub evidence: &'a str,
    /// The decision this call led to (its note), on the call's own row.
    pub decision: Option<&'a str>,
}

/// Records a decision and its evidence, only if `owner` still holds the lease (see
/// [`record_many`]). Returns false when the lease was lost.
pub async fn record(
    pool: &PgPool,
    account: &str,
    owner: &str,
    operation_key: &str,
    decision: &Decision,
    events: &[Event<'_>],
) -> Result<bool, sqlx::Error> {
    let applied = record_many(pool, account, &[Recorded { owner, operation_key, decision, events }]).await?;
    Ok(applied.first().copied().unwrap_or(false))
}

/// One decision to record: the lease token it was claimed under, the key, the decision and the
/// evidence that led to it.
#[derive(Debug, Clone, Copy)]
pub struct Recorded<'a> {
    pub owner: &'a str,
    pub operation_key: &'a str,
    pub decision: &'a Decision,
    pub events: &'a [Event<'a>],
}

const RECORD_DECISIONS: &str = r#"
    WITH decision AS (
        SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::float8[], $5::text[], $6::text[], $7::text[])
                   AS d(operation_key, owner, state, after_s, crm_task_id, proof, note)
    ), applied AS (
        UPDATE handoff_consumer.crm_operation AS o
           SET state = d.state,
               next_attempt_at = now() + make_interval(secs => d.after_s),
               crm_task_id = COALESCE(d.crm_task_id, o.crm_task_id),
               proof = COALESCE(d.proof, o.proof),
               note = d.note,
               unknown_since = CASE WHEN d.state = 'unknown' THEN COALESCE(o.unknown_since, now())
                                    ELSE o.unknown_since END,
               -- Proved not executed: no key record at the destination dates from this episode.
               key_sent_at = CASE WHEN d.state IN ('received', 'proved_not_executed') THEN NULL
                                  ELSE o.key_sent_at END,
               lease_owner = NULL, lease_until = NULL, updated_at = now()
          FROM decision AS d
         WHERE o.account = $13 AND o.operation_key = ANY($1::text[]) AND o.operation_key = d.operation_key
           AND o.lease_owner = d.owner
     RETURNING o.operation_key, o.state
    ), events AS (
        INSERT INTO handoff_consumer.crm_event
               (account, operation_key, kind, replica, attempt, evidence, decision, state_after)
        SELECT $13, e.operation_key, e.kind, e.replica, e.attempt, e.evidence, e.decision,
               COALESCE(a.state, 'lease_lost')
          FROM UNNEST($8::text[], $9::text[], $10::text[], $11::int4[], $12::text[], $14::text[])
               WITH ORDINALITY AS e(operation_key, kind, replica, attempt, evidence, decision, n)
          LEFT JOIN applied AS a USING (operation_key)
         ORDER BY e.n
    )
    SELECT operation_key FROM applied"#;

/// Records many decisions of `account`'s rows and their evidence in one statement (one round trip, one commit): each
/// decision applies only if its lease token still holds the row. A row whose lease was lost keeps
/// its state, but its events are still appended (state_after `lease_lost`), so the evidence of
/// what this replica saw, a CRM receipt included, is never lost. Returns, per item in order,
/// whether the decision was applied.
///
/// Events keep their order: they are inserted in array order, so ids (the event log's order per
/// key) follow the order the dispatcher produced them in.
pub async fn record_many(pool: &PgPool, account: &str, items: &[Recorded<'_>]) -> Result<Vec<bool>, sqlx::Error> {
    if items.is_empty() {
        return Ok(Vec::new());
    }
    let mut event_keys = Vec::new();
    let mut kinds = Vec::new();
    let mut replicas = Vec::new();
    let mut attempts = Vec::new();
    let mut evidence = Vec::new();
    let mut decisions = Vec::new();
    for item in items {
        for event in item.events {
            event_keys.push(item.operation_key);
            kinds.push(event.kind);
            replicas.push(item.owner);
            attempts.push(event.attempt);
            evidence.push(event.evidence);
            decisions.push(event.decision);
        }
    }
    let applied: Vec<String> = sqlx::query_scalar(RECORD_DECISIONS)
        .bind(items.iter().map(|i| i.operation_key).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.owner).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.decision.state.as_str()).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.decision.after.as_secs_f64()).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.decision.crm_task_id.as_deref()).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.decision.proof).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.decision.note.as_str()).collect::<Vec<_>>())
        .bind(event_keys)
        .bind(kinds)
        .bind(replicas)
        .bind(attempts)
        .bind(evidence)
        .bind(account)
        .bind(decisions)
        .fetch_all(pool)
        .await?;
    let applied: std::collections::HashSet<&str> = applied.iter().map(String::as_str).collect();
    Ok(items.iter().map(|i| applied.contains(i.operation_key)).collect())
}

/// Appends one event to `account`'s row of `operation_key`. The caller holds that row's lock in the
/// same transaction: the event log has no foreign key to the ledger (migration `20261205000001`).
pub async fn insert_event(
    conn: &mut PgConnection,
    account: &str,
    operation_key: &str,
    event: &Event<'_>,
    replica: Option<&str>,
    state_after: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO handoff_consumer.crm_event (account, operation_key, kind, replica, attempt, evidence, state_after, decision)
         VALUES ($7, $1, $2, $3, $4, $5, $6, $8)",
    )
    .bind(operation_key)
    .bind(event.kind)
    .bind(replica)
    .bind(event.attempt)
    .bind(event.evidence)
    .bind(state_after)
    .bind(account)
    .bind(event.decision)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Ledger rows by state, for reports and tests.
pub async fn count_by_state(pool: &PgPool) -> Result<std::collections::BTreeMap<LedgerState, i64>, sqlx::Error> {
    let rows: Vec<(LedgerState, i64)> =
        sqlx::query_as("SELECT state, count(*) FROM handoff_consumer.crm_operation GROUP BY state")
            .fetch_all(pool)
            .await?;
    Ok(rows.into_iter().collect())
}

/// One ledger row as an operator sees it (and as it is exported).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct ReviewRow {
    pub operation_key: String,
    /// The destination account the row belongs to (the ledger is unique per account and key).
    pub account: String,
    pub state: LedgerState,
    pub attempts: i32,
    /// The CRM's task id, or the receipt an operator recorded.
    pub receipt_ref: Option<String>,
    pub note: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// One event of a key's history.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct EventRow {
    pub kind: String,
    pub replica: Option<String>,
    pub attempt: Option<i32>,
    pub evidence: String,
    /// The decision the call led to (rows from before 20261203000003 have it in a row of kind
    /// `decision` instead).
    pub decision: Option<String>,
    pub state_after: String,
    pub at: DateTime<Utc>,
}

/// One operator resolution.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct AuditRow {
    pub actor: String,
    pub action: String,
    pub reason: String,
    pub receipt: Option<String>,
    pub at: DateTime<Utc>,
}

/// Ledger rows in these states, oldest first.
pub async fn list(pool: &PgPool, states: &[LedgerState]) -> Result<Vec<ReviewRow>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT operation_key, account, state, attempts, crm_task_id AS receipt_ref, note, created_at, updated_at
             FROM handoff_consumer.crm_operation
            WHERE state = ANY($1::text[])
            ORDER BY created_at, operation_key"#,
    )
    .bind(states.iter().map(|s| s.as_str()).collect::<Vec<_>>())
    .fetch_all(pool)
    .await
}

/// A key's ledger rows: one per destination account that received it (normally one).
pub async fn operations(pool: &PgPool, key: &str) -> Result<Vec<ReviewRow>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT operation_key, account, state, attempts, crm_task_id AS receipt_ref, note, created_at, updated_at
             FROM handoff_consumer.crm_operation WHERE operation_key = $1 ORDER BY account"#,
    )
    .bind(key)
    .fetch_all(pool)
    .await
}

/// The evidence of `account`'s row of `key`, in the order it was recorded.
pub async fn events(pool: &PgPool, key: &str, account: &str) -> Result<Vec<EventRow>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT kind, replica, attempt, evidence, decision, state_after, at
             FROM handoff_consumer.crm_event WHERE operation_key = $1 AND account = $2 ORDER BY id"#,
    )
    .bind(key)
    .bind(account)
    .fetch_all(pool)
    .await
}

/// The operator resolutions of `account`'s row of `key`, oldest first. A key's actions that name
/// no account (conflicts, dead letters, pauses) are not a ledger row's: see `review::consumer_record`.
pub async fn audit_trail(pool: &PgPool, key: &str, account: &str) -> Result<Vec<AuditRow>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT actor, action, reason, receipt, at FROM handoff_consumer.audit
            WHERE operation_key = $1 AND account = $2 ORDER BY id"#,
    )
    .bind(key)
    .bind(account)
    .fetch_all(pool)
    .await
}

/// Locks a key's rows, one per account, for an operator's resolution: per account, its state and
/// whether a replica's lease still holds it. Empty when the key has no ledger row.
pub async fn lock_for_resolution(
    conn: &mut PgConnection,
    key: &str,
) -> Result<Vec<(String, LedgerState, bool)>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT account, state, (lease_owner IS NOT NULL AND lease_until > now()) AS leased
             FROM handoff_consumer.crm_operation WHERE operation_key = $1 ORDER BY account FOR UPDATE"#,
    )
    .bind(key)
    .fetch_all(&mut *conn)
    .await
}

/// An operator's resolution of a locked row: its new state (due now), the receipt if one was
/// recorded (then the proof is `operator_receipt`) and the note. A new attempt starts a new
/// episode: no key record dates from it yet.
pub async fn apply_resolution(
    conn: &mut PgConnection,
    account: &str,
    key: &str,
    new_state: LedgerState,
    receipt: Option<&str>,
    note: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        r#"UPDATE handoff_consumer.crm_operation
              SET state = $2, next_attempt_at = now(), lease_owner = NULL, lease_until = NULL,
                  crm_task_id = COALESCE($3, crm_task_id),
                  proof = CASE WHEN $3 IS NULL THEN proof ELSE 'operator_receipt' END,
                  key_sent_at = CASE WHEN $2 = 'proved_not_executed' THEN NULL ELSE key_sent_at END,
                  note = $4, updated_at = now()
            WHERE account = $5 AND operation_key = $1"#,
    )
    .bind(key)
    .bind(new_state.as_str())
    .bind(receipt)
    .bind(note)
    .bind(account)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// One operator action for the audit table: on a key, or on a whole action type.
#[derive(Debug, Clone, Copy)]
pub struct Audit<'a> {
    pub key: Option<&'a str>,
    /// The destination account of the ledger row acted on (ledger resolutions only).
    pub account: Option<&'a str>,
    pub action_type: Option<&'a str>,
    pub actor: &'a str,
    pub action: &'a str,
    pub reason: &'a str,
    pub receipt: Option<&'a str>,
}

impl<'a> Audit<'a> {
    /// An action on one key.
    pub fn on_key(key: &'a str, actor: &'a str, action: &'a str, reason: &'a str) -> Self {
        Self { key: Some(key), account: None, action_type: None, actor, action, reason, receipt: None }
    }

    /// An action on a whole action type (pause, resume).
    pub fn on_type(action_type: &'a str, actor: &'a str, action: &'a str, reason: &'a str) -> Self {
        Self { key: None, account: None, action_type: Some(action_type), actor, action, reason, receipt: None }
    }
}

/// Appends an audit row (actor and reason trimmed; never updated or deleted).
pub async fn insert_audit(conn: &mut PgConnection, audit: &Audit<'_>) -> Result<(), sqlx::Error> {
    sqlx::query(
        r#"INSERT INTO handoff_consumer.audit (operation_key, action_type, actor, action, reason, receipt, account)
           VALUES ($1, $2, $3, $4, $5, $6, $7)"#,
    )
    .bind(audit.key)
    .bind(audit.action_type)
    .bind(audit.actor.trim())
    .bind(audit.action)
    .bind(audit.reason.trim())
    .bind(audit.receipt)
    .bind(audit.account)
    .execute(&mut *conn)
    .await?;
    Ok(())
}
