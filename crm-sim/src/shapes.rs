//! Two more API shapes over the same store, as real CRMs answer (shapes, not the vendors' whole
//! APIs; see `README.md`):
//!
//! * **upsert by external id** (Salesforce-shaped): `PATCH /services/data/v60.0/sobjects/{object}/{field}/{value}`
//!   creates (201) or updates (200) the record whose external id field holds `value`; several
//!   matches answer 300. The payload hash field is write-once when `hash_write_once` (an org's
//!   validation rule): an update changing it is refused with 400 `FIELD_CUSTOM_VALIDATION_EXCEPTION`.
//!   `GET` on the same path reads the record back (read-your-writes).
//! * **create with a unique property** (HubSpot-shaped): `POST /crm/v3/objects/{object}` with
//!   `{"properties": {...}}`; a value of the unique property that a record holds already answers 409
//!   with `Existing ID: <id>` in the message. `GET /crm/v3/objects/{object}/{id}` reads by id
//!   (consistent); `POST /crm/v3/objects/{object}/search` filters on the unique property and lags
//!   behind writes by `query_visibility_lag`.
//!
//! Records are the simulator's tasks: the external id / unique value is the task's `external_id`,
//! the hash field its `payload_hash`, and the other fields its `data`. Faults apply per request and
//! per key (the external id or unique value) exactly as on `/v1`.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Map, Value, json};

use crate::Inner;
use crate::http::{answer_create, create_fault, readback_refused};
use crate::store::{NewTask, Task, UniqueCreated, Upserted, validate_id};

/// The REST API version of the upsert shape's paths.
pub const UPSERT_API: &str = "/services/data/v60.0";

pub(crate) fn routes() -> axum::Router<Arc<Inner>> {
    axum::Router::new()
        .route(&format!("{UPSERT_API}/sobjects/{{object}}/{{field}}/{{value}}"), get(upsert_read).patch(upsert))
        .route("/crm/v3/objects/{object}", post(unique_create))
        .route("/crm/v3/objects/{object}/search", post(unique_search))
        .route("/crm/v3/objects/{object}/{id}", get(unique_read))
}

/// A Salesforce-shaped error: a list of `{message, errorCode, fields}`.
fn sf_error(status: StatusCode, code: &str, message: &str, fields: &[&str]) -> Response {
    (status, Json(json!([{"message": message, "errorCode": code, "fields": fields}]))).into_response()
}

fn sf_record(sim: &Inner, object: &str, field: &str, task: &Task) -> Value {
    let mut record = match &task.data {
        Value::Object(map) => map.clone(),
        _ => Map::new(),
    };
    record.insert(
        "attributes".into(),
        json!({"type": object, "url": format!("{UPSERT_API}/sobjects/{object}/{}", task.task_id)}),
    );
    record.insert("Id".into(), json!(task.task_id));
    record.insert(field.into(), json!(task.external_id));
    record.insert(sim.config.upsert_hash_field.clone(), json!(task.payload_hash));
    Value::Object(record)
}

fn sf_multiple(object: &str, ids: &[String]) -> Response {
    let urls: Vec<String> = ids.iter().map(|id| format!("{UPSERT_API}/sobjects/{object}/{id}")).collect();
    (StatusCode::MULTIPLE_CHOICES, Json(json!(urls))).into_response()
}

/// A valid 64-lowercase-hex hash, or the reason it is not.
fn valid_hash(value: Option<&Value>, field: &str) -> Result<String, String> {
    match value.and_then(Value::as_str) {
        Some(h) if h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) => Ok(h.to_owned()),
        _ => Err(format!("{field} must be 64 lowercase hex characters (a SHA-256 digest)")),
    }
}

/// `PATCH /services/data/v60.0/sobjects/{object}/{field}/{value}`: upsert by external id.
async fn upsert(
    State(sim): State<Arc<Inner>>,
    Path((object, field, value)): Path<(String, String, String)>,
    body: Bytes,
) -> Response {
    sim.counters.creates.fetch_add(1, Ordering::Relaxed);
    let after = match create_fault(&sim, Some(&value)).await {
        Ok(after) => after,
        Err(answer) => return answer,
    };
    let hash_field = sim.config.upsert_hash_field.clone();
    let parsed =
        serde_json::from_slice::<Value>(&body).map_err(|e| format!("invalid JSON body: {e}")).and_then(|body| {
            validate_id(&field, &value)?;
            let Value::Object(mut fields) = body else { return Err("the body must be a JSON object of fields".into()) };
            let hash = valid_hash(fields.get(&hash_field), &hash_field)?;
            fields.remove(&hash_field);
            if fields.is_empty() {
                return Err("the record needs at least one field besides the hash".into());
            }
            Ok(NewTask { external_id: value.clone(), payload_hash: hash, data: fields })
        });
    let new = match parsed {
        Ok(new) => new,
        Err(message) => return sf_error(StatusCode::BAD_REQUEST, "JSON_PARSER_ERROR", &message, &[]),
    };
    let answer = match sim.store.upsert(&new, sim.config.hash_write_once).await {
        Ok(Upserted::Created(task)) => {
            tracing::info!(task_id = %task.task_id, external_id = %task.external_id, "record created by upsert");
            (StatusCode::CREATED, Json(json!({"id": task.task_id, "success": true, "errors": [], "created": true})))
                .into_response()
        }
        Ok(Upserted::Updated(task)) => {
            sim.counters.updates.fetch_add(1, Ordering::Relaxed);
            tracing::info!(task_id = %task.task_id, external_id = %task.external_id, "record updated by upsert");
            (StatusCode::OK, Json(json!({"id": task.task_id, "success": true, "errors": [], "created": false})))
                .into_response()
        }
        Ok(Upserted::HashLocked { task_id }) => sf_error(
            StatusCode::BAD_REQUEST,
            "FIELD_CUSTOM_VALIDATION_EXCEPTION",
            &format!("{hash_field} is write-once: record {task_id} holds another payload"),
            &[&hash_field],
        ),
        Ok(Upserted::Multiple(ids)) => sf_multiple(&object, &ids),
        Err(err) => sf_error(StatusCode::INTERNAL_SERVER_ERROR, "UNKNOWN_EXCEPTION", &err.to_string(), &[]),
    };
    answer_create(&sim, after, &value, answer).await
}

/// `GET /services/data/v60.0/sobjects/{object}/{field}/{value}`: the record by external id.
async fn upsert_read(
    State(sim): State<Arc<Inner>>,
    Path((object, field, value)): Path<(String, String, String)>,
) -> Response {
    sim.counters.readbacks.fetch_add(1, Ordering::Relaxed);
    if readback_refused(&sim, &value) {
        return sf_error(StatusCode::SERVICE_UNAVAILABLE, "SERVER_UNAVAILABLE", "unavailable", &[]);
    }
    let not_found = || sf_error(StatusCode::NOT_FOUND, "NOT_FOUND", "The requested resource does not exist", &[]);
    if validate_id(&field, &value).is_err() {
        return not_found();
    }
    match sim.store.by_external_id(&value).await {
        Ok(tasks) => match tasks.as_slice() {
            [] => not_found(),
            [task] => (StatusCode::OK, Json(sf_record(&sim, &object, &field, task))).into_response(),
            many => sf_multiple(&object, &many.iter().map(|t| t.task_id.clone()).collect::<Vec<_>>()),
        },
        Err(err) => sf_error(StatusCode::INTERNAL_SERVER_ERROR, "UNKNOWN_EXCEPTION", &err.to_string(), &[]),
    }
}

/// A HubSpot-shaped error.
fn hs_error(status: StatusCode, category: &str, message: &str) -> Response {
    (status, Json(json!({"status": "error", "category": category, "message": message}))).into_response()
}

fn hs_object(sim: &Inner, task: &Task) -> Value {
    let mut properties = match &task.data {
        Value::Object(map) => map.clone(),
        _ => Map::new(),
    };
    properties.insert(sim.config.unique_property.clone(), json!(task.external_id));
    properties.insert(sim.config.hash_property.clone(), json!(task.payload_hash));
    json!({"id": task.task_id, "properties": properties, "createdAt": task.created_at, "archived": false})
}

/// `POST /crm/v3/objects/{object}`: a create whose unique property repeats answers 409.
async fn unique_create(State(sim): State<Arc<Inner>>, Path(_object): Path<String>, body: Bytes) -> Response {
    sim.counters.creates.fetch_add(1, Ordering::Relaxed);
    let (unique, hash_property) = (sim.config.unique_property.clone(), sim.config.hash_property.clone());
    let parsed =
        serde_json::from_slice::<Value>(&body).map_err(|e| format!("invalid JSON body: {e}")).and_then(|body| {
            let Some(Value::Object(mut properties)) = body.get("properties").cloned() else {
                return Err("the body must be {\"properties\": {...}}".to_owned());
            };
            let value = match properties.remove(&unique) {
                Some(Value::String(v)) => v,
                _ => return Err(format!("property {unique} (unique) is required")),
            };
            validate_id(&unique, &value)?;
            let hash = valid_hash(properties.get(&hash_property), &hash_property)?;
            properties.remove(&hash_property);
            if properties.is_empty() {
                return Err("the object needs at least one property besides the key and the hash".into());
            }
            Ok(NewTask { external_id: value, payload_hash: hash, data: properties })
        });
    // Faults match the unique value, as on /v1 the external id.
    let target = parsed.as_ref().ok().map(|new| new.external_id.clone());
    let after = match create_fault(&sim, target.as_deref()).await {
        Ok(after) => after,
        Err(answer) => return answer,
    };
    let new = match parsed {
        Ok(new) => new,
        Err(message) => return hs_error(StatusCode::BAD_REQUEST, "VALIDATION_ERROR", &message),
    };
    let answer = match sim.store.create_unique(&new).await {
        Ok(UniqueCreated::Created(task)) => {
            tracing::info!(task_id = %task.task_id, external_id = %task.external_id, "object created");
            (StatusCode::CREATED, Json(hs_object(&sim, &task))).into_response()
        }
        Ok(UniqueCreated::Exists(task)) => hs_error(
            StatusCode::CONFLICT,
            "CONFLICT",
            &format!("A record with {unique}={} already exists. Existing ID: {}", task.external_id, task.task_id),
        ),
        Err(err) => hs_error(StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL_ERROR", &err.to_string()),
    };
    answer_create(&sim, after, &new.external_id, answer).await
}

/// `GET /crm/v3/objects/{object}/{id}`: by id, consistent. Faults match the id.
async fn unique_read(State(sim): State<Arc<Inner>>, Path((_object, id)): Path<(String, String)>) -> Response {
    sim.counters.readbacks.fetch_add(1, Ordering::Relaxed);
    if readback_refused(&sim, &id) {
        return hs_error(StatusCode::SERVICE_UNAVAILABLE, "SERVICE_UNAVAILABLE", "unavailable");
    }
    match sim.store.by_task_id(&id).await {
        Ok(Some(task)) => (StatusCode::OK, Json(hs_object(&sim, &task))).into_response(),
        Ok(None) => hs_error(StatusCode::NOT_FOUND, "OBJECT_NOT_FOUND", &format!("no object with id {id}")),
        Err(err) => hs_error(StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL_ERROR", &err.to_string()),
    }
}

/// `POST /crm/v3/objects/{object}/search` with one `EQ` filter on the unique property: lags
/// behind writes by `query_visibility_lag`. Faults match the filter's value.
async fn unique_search(State(sim): State<Arc<Inner>>, Path(_object): Path<String>, body: Bytes) -> Response {
    sim.counters.queries.fetch_add(1, Ordering::Relaxed);
    let unique = &sim.config.unique_property;
    let value = serde_json::from_slice::<Value>(&body).ok().and_then(|body| {
        let filter = body.pointer("/filterGroups/0/filters/0")?.clone();
        (filter["propertyName"] == json!(unique) && filter["operator"] == "EQ")
            .then(|| filter["value"].as_str().map(str::to_owned))
            .flatten()
    });
    let Some(value) = value else {
        return hs_error(
            StatusCode::BAD_REQUEST,
            "VALIDATION_ERROR",
            &format!("search needs filterGroups[0].filters[0] = {{propertyName: {unique}, operator: EQ, value}}"),
        );
    };
    if readback_refused(&sim, &value) {
        return hs_error(StatusCode::SERVICE_UNAVAILABLE, "SERVICE_UNAVAILABLE", "unavailable");
    }
    match sim.store.search(&value, sim.config.query_visibility_lag).await {
        Ok((tasks, _)) => {
            let results: Vec<Value> = tasks.iter().map(|task| hs_object(&sim, task)).collect();
            (StatusCode::OK, Json(json!({"total": results.len(), "results": results}))).into_response()
        }
        Err(err) => hs_error(StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL_ERROR", &err.to_string()),
    }
}
