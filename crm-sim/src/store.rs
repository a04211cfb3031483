//! The simulated CRM's durable state: tasks and idempotency records in schema `crm_sim`.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sqlx::{PgConnection, PgPool};

/// Longest external id or idempotency key the CRM accepts, in characters.
pub const MAX_ID_CHARS: usize = 255;

/// A task as the CRM reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Task {
    /// `T-000001`, `T-000002`, ...: assigned by the CRM in creation order.
    pub task_id: String,
    pub external_id: String,
    /// The `Idempotency-Key` of the request that created the task, if it had one.
    pub idempotency_key: Option<String>,
    pub payload_hash: String,
    pub data: Value,
    pub created_at: DateTime<Utc>,
}

/// A validated task to create.
#[derive(Debug, Clone)]
pub(crate) struct NewTask {
    pub external_id: String,
    pub payload_hash: String,
    pub data: Map<String, Value>,
}

/// What a create did.
#[derive(Debug)]
pub(crate) enum Created {
    /// A new task: one more provider effect.
    New(Task),
    /// Nothing new: the key or the external id already names a task with this payload hash.
    Replayed(Task),
}

/// What an upsert by external id did (the Salesforce-shaped surface).
#[derive(Debug)]
pub(crate) enum Upserted {
    /// No record had the external id: a new one, one more provider effect.
    Created(Task),
    /// One record had it and now holds the request's fields: an update (it fires the CRM's
    /// workflows, though no new effect is counted).
    Updated(Task),
    /// One record had it with another payload hash, which is write-once: refused, unchanged.
    HashLocked { task_id: String },
    /// Several records have the external id: refused, nothing changed.
    Multiple(Vec<String>),
}

/// What a create with a unique property did (the HubSpot-shaped surface).
#[derive(Debug)]
pub(crate) enum UniqueCreated {
    Created(Task),
    /// A record already holds the unique value: refused, nothing changed.
    Exists(Task),
}

/// Why a create was refused (nothing was written).
#[derive(Debug, thiserror::Error)]
pub(crate) enum CreateError {
    #[error("idempotency key already used for {task_id} with a different payload hash")]
    KeyReused { task_id: String },
    #[error("external id already used by {task_id} with a different payload hash")]
    ExternalIdConflict { task_id: String },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// The body of `POST /v1/tasks` and `POST /_admin/tasks` (the latter also reads `idempotency_key`).
#[derive(Debug, Deserialize)]
pub(crate) struct TaskBody {
    external_id: String,
    payload_hash: String,
    data: Value,
    #[serde(default)]
    pub idempotency_key: Option<String>,
}

impl TaskBody {
    /// Parses and validates a request body; the error is the `detail` of a 422.
    pub fn parse(body: &[u8]) -> Result<(NewTask, Option<String>), String> {
        let body: TaskBody = serde_json::from_slice(body).map_err(|err| format!("invalid JSON body: {err}"))?;
        validate_id("external_id", &body.external_id)?;
        if let Some(key) = &body.idempotency_key {
            validate_id("idempotency_key", key)?;
        }
        if body.payload_hash.len() != 64 || !body.payload_hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err("payload_hash must be 64 lowercase hex characters (a SHA-256 digest)".into());
        }
        let data = match body.data {
            Value::Object(map) if !map.is_empty() => map,
            _ => return Err("data must be a non-empty JSON object".into()),
        };
        Ok((NewTask { external_id: body.external_id, payload_hash: body.payload_hash, data }, body.idempotency_key))
    }
}

/// External ids and idempotency keys: 1-255 characters, no control characters (Postgres text
/// cannot hold NUL, and a key is echoed in logs and headers).
pub(crate) fn validate_id(field: &str, value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err(format!("{field} must not be empty"));
    }
    if value.chars().count() > MAX_ID_CHARS {
        return Err(format!("{field} must be at most {MAX_ID_CHARS} characters"));
    }
    if value.chars().any(char::is_control) {
        return Err(format!("{field} must not contain control characters"));
    }
    Ok(())
}

#[derive(sqlx::FromRow)]
struct TaskRow {
    id: i64,
    external_id: String,
    idempotency_key: Option<String>,
    payload_hash: String,
    data: Value,
    created_at: DateTime<Utc>,
}

impl From<TaskRow> for Task {
    fn from(row: TaskRow) -> Self {
        Self {
            task_id: task_id(row.id),
            external_id: row.external_id,
            idempotency_key: row.idempotency_key,
            payload_hash: row.payload_hash,
            data: row.data,
            created_at: row.created_at,
        }
    }
}

fn task_id(id: i64) -> String {
    format!("T-{id:06}")
}

/// Advisory lock classes (first argument of `pg_advisory_xact_lock(int, int)`), so a key and an
/// external id with the same hash never wait for each other.
const KEY_LOCK: i32 = 0x4352_4d01;
const EXTERNAL_ID_LOCK: i32 = 0x4352_4d02;

#[derive(Debug, Clone)]
pub(crate) struct Store {
    pool: PgPool,
    retention: Duration,
    unique_external_id: bool,
}

impl Store {
    pub fn new(pool: PgPool, retention: Duration, unique_external_id: bool) -> Self {
        Self { pool, retention, unique_external_id }
    }

    /// The create decision and its writes, in one transaction: the task and its idempotency
    /// record commit together or not at all.
    pub async fn create(&self, key: Option<&str>, new: &NewTask) -> Result<Created, CreateError> {
        let mut tx = self.pool.begin().await?;
        // Concurrent requests with the same key or external id are serialised, so two of them
        // cannot both see "absent" and both create. Always key first, then external id: one order
        // for everybody, no deadlock.
        if let Some(key) = key {
            lock(&mut tx, KEY_LOCK, key).await?;
        }
        if self.unique_external_id {
            lock(&mut tx, EXTERNAL_ID_LOCK, &new.external_id).await?;
        }

        if let Some(key) = key {
            let record: Option<(i64, String, bool)> = sqlx::query_as(
                "SELECT task_id, payload_hash, created_at > now() - make_interval(secs => $2)
                 FROM crm_sim.idempotency_keys WHERE idempotency_key = $1",
            )
            .bind(key)
            .bind(self.retention.as_secs_f64())
            .fetch_optional(&mut *tx)
            .await?;
            match record {
                Some((id, hash, true)) if hash == new.payload_hash => {
                    let task = task_by_id(&mut tx, id).await?;
                    tx.commit().await?;
                    return Ok(Created::Replayed(task));
                }
                Some((id, _, true)) => return Err(CreateError::KeyReused { task_id: task_id(id) }),
                // Older than the retention: the provider has forgotten the key, and the request
                // proceeds as a new one (its record is replaced below).
                Some((_, _, false)) | None => {}
            }
        }

        if self.unique_external_id {
            let existing: Vec<TaskRow> = sqlx::query_as(
                "SELECT id, external_id, idempotency_key, payload_hash, data, created_at
                 FROM crm_sim.tasks WHERE external_id = $1 ORDER BY id",
            )
            .bind(&new.external_id)
            .fetch_all(&mut *tx)
            .await?;
            let first = existing.first().map(|row| row.id);
            if let Some(same) = existing.into_iter().find(|row| row.payload_hash == new.payload_hash) {
                // The key now answers with this task too, as a provider that stores the
                // response per key would (a by-key readback after a lost reply finds it).
                if let Some(key) = key {
                    remember_key(&mut tx, key, same.id, &new.payload_hash).await?;
                }
                tx.commit().await?;
                return Ok(Created::Replayed(same.into()));
            }
            if let Some(first) = first {
                return Err(CreateError::ExternalIdConflict { task_id: task_id(first) });
            }
        }

        let row = insert_task(&mut tx, key, new).await?;
        if let Some(key) = key {
            remember_key(&mut tx, key, row.id, &new.payload_hash).await?;
        }
        tx.commit().await?;
        Ok(Created::New(row.into()))
    }

    /// Upsert by external id: create if absent, update the one record otherwise, unless its payload
    /// hash differs and `hash_write_once` (the validation rule an org installs) refuses it.
    pub async fn upsert(&self, new: &NewTask, hash_write_once: bool) -> Result<Upserted, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        lock(&mut tx, EXTERNAL_ID_LOCK, &new.external_id).await?;
        let existing: Vec<TaskRow> = sqlx::query_as(
            "SELECT id, external_id, idempotency_key, payload_hash, data, created_at
             FROM crm_sim.tasks WHERE external_id = $1 ORDER BY id",
        )
        .bind(&new.external_id)
        .fetch_all(&mut *tx)
        .await?;
        let upserted = match existing.as_slice() {
            [] => Upserted::Created(insert_task(&mut tx, None, new).await?.into()),
            [one] if hash_write_once && one.payload_hash != new.payload_hash => {
                return Ok(Upserted::HashLocked { task_id: task_id(one.id) });
            }
            [one] => {
                let row: TaskRow = sqlx::query_as(
                    "UPDATE crm_sim.tasks SET payload_hash = $2, data = $3 WHERE id = $1
                     RETURNING id, external_id, idempotency_key, payload_hash, data, created_at",
                )
                .bind(one.id)
                .bind(&new.payload_hash)
                .bind(Value::Object(new.data.clone()))
                .fetch_one(&mut *tx)
                .await?;
                Upserted::Updated(row.into())
            }
            many => return Ok(Upserted::Multiple(many.iter().map(|row| task_id(row.id)).collect())),
        };
        tx.commit().await?;
        Ok(upserted)
    }

    /// A create whose external id is a unique property: refused when a record holds the value.
    pub async fn create_unique(&self, new: &NewTask) -> Result<UniqueCreated, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        lock(&mut tx, EXTERNAL_ID_LOCK, &new.external_id).await?;
        let existing: Option<TaskRow> = sqlx::query_as(
            "SELECT id, external_id, idempotency_key, payload_hash, data, created_at
             FROM crm_sim.tasks WHERE external_id = $1 ORDER BY id LIMIT 1",
        )
        .bind(&new.external_id)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(row) = existing {
            return Ok(UniqueCreated::Exists(row.into()));
        }
        let row = insert_task(&mut tx, None, new).await?;
        tx.commit().await?;
        Ok(UniqueCreated::Created(row.into()))
    }

    /// A task by its id (`T-000001`), read-your-writes.
    pub async fn by_task_id(&self, id: &str) -> Result<Option<Task>, sqlx::Error> {
        let Some(id) = id.strip_prefix("T-").and_then(|n| n.parse::<i64>().ok()) else { return Ok(None) };
        let row: Option<TaskRow> = sqlx::query_as(
            "SELECT id, external_id, idempotency_key, payload_hash, data, created_at FROM crm_sim.tasks WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(Task::from))
    }

    /// Puts a task in directly, without idempotency or uniqueness checks (the admin seed). A key
    /// record for `key` is created or replaced.
    pub async fn seed(&self, key: Option<&str>, new: &NewTask) -> Result<Task, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        if let Some(key) = key {
            lock(&mut tx, KEY_LOCK, key).await?;
        }
        let row = insert_task(&mut tx, key, new).await?;
        if let Some(key) = key {
            remember_key(&mut tx, key, row.id, &new.payload_hash).await?;
        }
        tx.commit().await?;
        Ok(row.into())
    }

    /// The task an idempotency key names, unless the key is unknown or older than the retention.
    pub async fn by_key(&self, key: &str) -> Result<Option<Task>, sqlx::Error> {
        let row: Option<TaskRow> = sqlx::query_as(
            "SELECT t.id, t.external_id, t.idempotency_key, t.payload_hash, t.data, t.created_at
             FROM crm_sim.idempotency_keys k JOIN crm_sim.tasks t ON t.id = k.task_id
             WHERE k.idempotency_key = $1 AND k.created_at > now() - make_interval(secs => $2)",
        )
        .bind(key)
        .bind(self.retention.as_secs_f64())
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(Task::from))
    }

    /// Every task with this external id, oldest first (read-your-writes: no visibility lag).
    pub async fn by_external_id(&self, external_id: &str) -> Result<Vec<Task>, sqlx::Error> {
        let rows: Vec<TaskRow> = sqlx::query_as(
            "SELECT id, external_id, idempotency_key, payload_hash, data, created_at
             FROM crm_sim.tasks WHERE external_id = $1 ORDER BY id",
        )
        .bind(external_id)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(Task::from).collect())
    }

    /// The search: tasks with this external id created at least `lag` ago, and that horizon.
    pub async fn search(&self, external_id: &str, lag: Duration) -> Result<(Vec<Task>, DateTime<Utc>), sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        let as_of: DateTime<Utc> = sqlx::query_scalar("SELECT now() - make_interval(secs => $1)")
            .bind(lag.as_secs_f64())
            .fetch_one(&mut *conn)
            .await?;
        let rows: Vec<TaskRow> = sqlx::query_as(
            "SELECT id, external_id, idempotency_key, payload_hash, data, created_at
             FROM crm_sim.tasks WHERE external_id = $1 AND created_at <= $2 ORDER BY id",
        )
        .bind(external_id)
        .bind(as_of)
        .fetch_all(&mut *conn)
        .await?;
        Ok((rows.into_iter().map(Task::from).collect(), as_of))
    }

    /// Number of tasks ever created: the provider effects.
    pub async fn effects(&self) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar("SELECT count(*) FROM crm_sim.tasks").fetch_one(&self.pool).await
    }

    /// Every task, oldest first.
    pub async fn all_tasks(&self) -> Result<Vec<Task>, sqlx::Error> {
        let rows: Vec<TaskRow> = sqlx::query_as(
            "SELECT id, external_id, idempotency_key, payload_hash, data, created_at FROM crm_sim.tasks ORDER BY id",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(Task::from).collect())
    }
}

async fn lock(conn: &mut PgConnection, class: i32, value: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_xact_lock($1, hashtext($2))").bind(class).bind(value).execute(conn).await?;
    Ok(())
}

async fn task_by_id(conn: &mut PgConnection, id: i64) -> Result<Task, sqlx::Error> {
    let row: TaskRow = sqlx::query_as(
        "SELECT id, external_id, idempotency_key, payload_hash, data, created_at FROM crm_sim.tasks WHERE id = $1",
    )
    .bind(id)
    .fetch_one(conn)
    .await?;
    Ok(row.into())
}

async fn insert_task(conn: &mut PgConnection, key: Option<&str>, new: &NewTask) -> Result<TaskRow, sqlx::Error> {
    sqlx::query_as(
        "INSERT INTO crm_sim.tasks (external_id, idempotency_key, payload_hash, data) VALUES ($1, $2, $3, $4)
         RETURNING id, external_id, idempotency_key, payload_hash, data, created_at",
    )
    .bind(&new.external_id)
    .bind(key)
    .bind(&new.payload_hash)
    .bind(Value::Object(new.data.clone()))
    .fetch_one(conn)
    .await
}

/// Creates or replaces (a forgotten key is reused) the idempotency record for `key`.
async fn remember_key(conn: &mut PgConnection, key: &str, id: i64, payload_hash: &str) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO crm_sim.idempotency_keys (idempotency_key, task_id, payload_hash) VALUES ($1, $2, $3)
         ON CONFLICT (idempotency_key) DO UPDATE
         SET task_id = EXCLUDED.task_id, payload_hash = EXCLUDED.payload_hash, created_at = now()",
    )
    .bind(key)
    .bind(id)
    .bind(payload_hash)
    .execute(conn)
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_ids_are_padded_not_truncated() {
        assert_eq!(task_id(1), "T-000001");
        assert_eq!(task_id(1_234_567), "T-1234567");
    }

    #[test]
    fn bodies_are_validated() {
        let hash = "a".repeat(64);
        let ok = format!(r#"{{"external_id":"op-1","payload_hash":"{hash}","data":{{"title":"call"}}}}"#);
        let (task, key) = TaskBody::parse(ok.as_bytes()).expect("valid");
        assert_eq!((task.external_id.as_str(), key), ("op-1", None));

        let long = "x".repeat(256);
        for (body, why) in [
            ("not json".to_owned(), "invalid JSON"),
            (format!(r#"{{"external_id":"","payload_hash":"{hash}","data":{{"a":1}}}}"#), "empty"),
            (format!(r#"{{"external_id":"{long}","payload_hash":"{hash}","data":{{"a":1}}}}"#), "at most 255"),
            (r#"{"external_id":"a","payload_hash":"ABC","data":{"a":1}}"#.to_owned(), "64 lowercase hex"),
            (format!(r#"{{"external_id":"a","payload_hash":"{}","data":{{"a":1}}}}"#, "A".repeat(64)), "lowercase"),
            (format!(r#"{{"external_id":"a","payload_hash":"{hash}","data":{{}}}}"#), "non-empty JSON object"),
            (format!(r#"{{"external_id":"a","payload_hash":"{hash}","data":[1]}}"#), "non-empty JSON object"),
            (format!(r#"{{"external_id":"a\u0000b","payload_hash":"{hash}","data":{{"a":1}}}}"#), "control"),
        ] {
            let err = TaskBody::parse(body.as_bytes()).expect_err(&body);
            assert!(err.contains(why), "{body}: {err}");
        }
    }
}
