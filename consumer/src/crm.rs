//! The CRM boundary. [`Crm`] is what the consumer needs from a destination; [`LocalCrm`] is the
//! store in the consumer's own database, which can join the batch transaction and so gives
//! "inbox row and task commit together". A remote CRM (unknown outcomes, readback) implements the
//! same trait outside the transaction, with its own ledger.

use std::collections::HashMap;
use std::sync::LazyLock;

use sqlx::{PgConnection, PgPool};

use crate::inbox::{self, Arrival, outcome};

/// One task to create: the verified action.
#[derive(Debug, Clone)]
pub struct TaskRequest {
    pub operation_key: String,
    pub payload_hash: String,
    pub payload: serde_json::Value,
    pub approved_by: String,
    /// The producer's trace context, kept with the task (diagnostic only).
    pub traceparent: Option<String>,
}

/// What the CRM did for one request (the receiver contract of seed 000).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskOutcome {
    /// A new task.
    Created { task_id: i64 },
    /// The CRM already held this key with the same content: the existing task is returned.
    Existing { task_id: i64 },
    /// The CRM holds different content for this key: a person must decide.
    Conflict { task_id: i64 },
    /// Recorded for dispatch to a remote CRM (see `ledger::LedgerCrm`); the outcome comes later.
    Accepted,
}

impl TaskOutcome {
    /// The inbox outcome that records this.
    pub fn inbox_outcome(self) -> &'static str {
        match self {
            Self::Created { .. } => outcome::TASK_CREATED,
            Self::Existing { .. } => outcome::TASK_EXISTED,
            Self::Conflict { .. } => outcome::CONFLICT,
            Self::Accepted => outcome::ACCEPTED,
        }
    }
}

/// Why the CRM call failed as a whole. Transient: the batch is retried.
#[derive(Debug, thiserror::Error)]
pub enum CrmError {
    #[error("CRM store database error")]
    Database(#[from] sqlx::Error),
    #[error("the one-statement batch returned no usable row for {0}")]
    Incomplete(String),
}

/// A destination that creates one task per operation key.
pub trait Crm: Send + Sync {
    /// The inbox outcome a new key is recorded with before the CRM is asked: what this CRM does
    /// with a new key unless something is wrong. Only arrivals whose outcome turns out different
    /// are written a second time, so the usual batch costs one inbox statement, not two.
    const USUAL_OUTCOME: &'static str;

    /// Creates tasks for `requests`, in the consumer's transaction `conn`. Returns one outcome per
    /// request, in order. Must be idempotent per key.
    fn create_tasks(
        &self,
        conn: &mut PgConnection,
        requests: &[TaskRequest],
    ) -> impl Future<Output = Result<Vec<TaskOutcome>, CrmError>> + Send;

    /// The usual batch in one statement with no transaction around it: records every arrival in
    /// the inbox with [`Self::USUAL_OUTCOME`] and creates its task, all or nothing
    /// ([`inbox::with_new_arrivals`]). `requests[i]` is `arrivals[i]`'s, every key once. Returns
    /// `None`, having written nothing, when any key is already held by the inbox or the CRM; the
    /// batch transaction ([`Self::create_tasks`]) then decides each message. Otherwise one outcome
    /// per request, in order, each the usual one.
    fn create_usual(
        &self,
        pool: &PgPool,
        arrivals: &[Arrival],
        requests: &[TaskRequest],
    ) -> impl Future<Output = Result<Option<Vec<TaskOutcome>>, CrmError>> + Send;
}

/// Runs a [`inbox::with_new_arrivals`] statement and maps its rows back to `arrivals`' order with
/// `outcome` (given the row's task id; `None` from it means the row lacks what the CRM returns).
/// `None` when a key was already held.
pub(crate) async fn run_usual<'q>(
    query: inbox::UsualQuery<'q>,
    pool: &PgPool,
    arrivals: &[Arrival],
    outcome: impl Fn(Option<i64>) -> Option<TaskOutcome>,
) -> Result<Option<Vec<TaskOutcome>>, CrmError> {
    let rows = match query.fetch_all(pool).await {
        Ok(rows) => rows,
        Err(error) if inbox::is_not_usual(&error) => return Ok(None),
        Err(error) => return Err(error.into()),
    };
    let created: HashMap<String, Option<i64>> = rows.into_iter().collect();
    arrivals
        .iter()
        .map(|a| {
            // Unreachable: the statement fails unless every arrival got its row, task id included.
            created
                .get(&a.operation_key)
                .and_then(|&task_id| outcome(task_id))
                .ok_or_else(|| CrmError::Incomplete(a.operation_key.clone()))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// [`LocalCrm`]'s half of [`Crm::create_usual`]: the tasks of the arrivals (`$1` keys, `$2` hashes).
static CREATE_USUAL_TASKS: LazyLock<String> = LazyLock::new(|| {
    inbox::with_new_arrivals(
        r#"
        INSERT INTO handoff_consumer.crm_task (operation_key, payload_hash, payload, approved_by, traceparent)
        SELECT * FROM UNNEST($1::text[], $2::text[], $5::jsonb[], $6::text[], $7::text[])
        RETURNING operation_key, task_id"#,
    )
});

/// The CRM store in the consumer's database (`handoff_consumer.crm_task`).
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalCrm;

impl Crm for LocalCrm {
    const USUAL_OUTCOME: &'static str = outcome::TASK_CREATED;

    async fn create_tasks(
        &self,
        conn: &mut PgConnection,
        requests: &[TaskRequest],
    ) -> Result<Vec<TaskOutcome>, CrmError> {
        // The unique constraint on operation_key decides; ON CONFLICT keeps the transaction alive.
        const CREATE_TASKS: &str = r#"
            INSERT INTO handoff_consumer.crm_task (operation_key, payload_hash, payload, approved_by, traceparent)
            SELECT * FROM UNNEST($1::text[], $2::text[], $3::jsonb[], $4::text[], $5::text[])
            ON CONFLICT (operation_key) DO NOTHING
            RETURNING operation_key, task_id"#;
        const EXISTING_TASKS: &str = r#"
            SELECT operation_key, task_id, payload_hash FROM handoff_consumer.crm_task
             WHERE operation_key = ANY($1::text[])"#;
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<&str> = requests.iter().map(|r| r.operation_key.as_str()).collect();
        let created: Vec<(String, i64)> = sqlx::query_as(CREATE_TASKS)
            .bind(&keys)
            .bind(requests.iter().map(|r| r.payload_hash.as_str()).collect::<Vec<_>>())
            .bind(requests.iter().map(|r| r.payload.clone()).collect::<Vec<_>>())
            .bind(requests.iter().map(|r| r.approved_by.as_str()).collect::<Vec<_>>())
            .bind(requests.iter().map(|r| r.traceparent.as_deref()).collect::<Vec<_>>())
            .fetch_all(&mut *conn)
            .await?;
        let created: std::collections::HashMap<String, i64> = created.into_iter().collect();
        let existing: std::collections::HashMap<String, (i64, String)> = if created.len() < requests.len() {
            let rows: Vec<(String, i64, String)> =
                sqlx::query_as(EXISTING_TASKS).bind(&keys).fetch_all(&mut *conn).await?;
            rows.into_iter().map(|(k, id, h)| (k, (id, h))).collect()
        } else {
            Default::default()
        };
        Ok(requests
            .iter()
            .map(|r| match created.get(&r.operation_key) {
                Some(&task_id) => TaskOutcome::Created { task_id },
                None => match existing.get(&r.operation_key) {
                    Some((task_id, hash)) if *hash == r.payload_hash => TaskOutcome::Existing { task_id: *task_id },
                    Some((task_id, _)) => TaskOutcome::Conflict { task_id: *task_id },
                    // Unreachable: a conflicting insert implies a visible row in this transaction.
                    None => TaskOutcome::Conflict { task_id: -1 },
                },
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
            sqlx::query_as(sqlx::AssertSqlSafe(CREATE_USUAL_TASKS.as_str())),
            arrivals,
            Self::USUAL_OUTCOME,
        )
        .bind(requests.iter().map(|r| r.payload.clone()).collect::<Vec<_>>())
        .bind(requests.iter().map(|r| r.approved_by.as_str()).collect::<Vec<_>>())
        .bind(requests.iter().map(|r| r.traceparent.as_deref()).collect::<Vec<_>>());
        run_usual(query, pool, arrivals, |task_id| task_id.map(|task_id| TaskOutcome::Created { task_id })).await
    }
}
