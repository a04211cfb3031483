//! The HTTP surface: `/v1/*` (the CRM API, bearer token) and `/_admin/*` (faults and effects).

use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::faults::{Endpoint, Fault, FaultKind};
use crate::store::{CreateError, Created, Task, TaskBody, validate_id};
use crate::{EffectsReport, Inner};

/// The header a create may carry; its value is the provider-side idempotency key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Present on every by-key readback: how long the CRM remembers an idempotency key, in seconds.
pub const RETENTION_HEADER: &str = "x-idempotency-retention-secs";

pub(crate) fn router(sim: Arc<Inner>) -> Router {
    // route_layer: the layer added last runs first, so latency is added before the token is
    // checked (a wrong token is as slow as a right one).
    let api = Router::new()
        .route("/v1/tasks", post(create_task).get(search_tasks))
        .route("/v1/tasks/by-key/{key}", get(task_by_key))
        .route("/v1/tasks/by-external-id/{external_id}", get(task_by_external_id))
        .merge(crate::shapes::routes())
        .route_layer(middleware::from_fn_with_state(sim.clone(), authorize))
        .route_layer(middleware::from_fn_with_state(sim.clone(), record_trace))
        .route_layer(middleware::from_fn_with_state(sim.clone(), add_latency));
    let admin = Router::new()
        .route("/_admin/faults", get(list_faults).post(inject_fault).delete(clear_faults))
        .route("/_admin/faults/release", post(release_held))
        .route("/_admin/effects", get(effects))
        .route("/_admin/traces", get(traces))
        .route("/_admin/tasks", post(seed_task));
    api.merge(admin).fallback(not_found).with_state(sim)
}

/// Everything a `/v1` request can be refused with.
#[derive(Debug, thiserror::Error)]
enum ApiError {
    #[error("unauthorized")]
    Unauthorized,
    #[error("validation: {0}")]
    Validation(String),
    #[error("not found")]
    NotFound,
    #[error("idempotency key reused with a different payload hash (task {task_id})")]
    KeyReused { task_id: String },
    #[error("external id conflict (task {task_id})")]
    ExternalIdConflict { task_id: String },
    #[error("several tasks share the external id")]
    Ambiguous { task_ids: Vec<String> },
    #[error("unavailable")]
    Unavailable,
    #[error("rate limited")]
    RateLimited { retry_after: Duration },
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
}

impl From<CreateError> for ApiError {
    fn from(err: CreateError) -> Self {
        match err {
            CreateError::KeyReused { task_id } => Self::KeyReused { task_id },
            CreateError::ExternalIdConflict { task_id } => Self::ExternalIdConflict { task_id },
            CreateError::Database(err) => Self::Database(err),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            Self::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"))],
                Json(json!({"error": "unauthorized"})),
            )
                .into_response(),
            Self::Validation(detail) => {
                (StatusCode::UNPROCESSABLE_ENTITY, Json(json!({"error": "validation", "detail": detail})))
                    .into_response()
            }
            Self::NotFound => (StatusCode::NOT_FOUND, Json(json!({"error": "not_found"}))).into_response(),
            Self::KeyReused { task_id } => {
                (StatusCode::CONFLICT, Json(json!({"error": "idempotency_key_reused", "task_id": task_id})))
                    .into_response()
            }
            Self::ExternalIdConflict { task_id } => {
                (StatusCode::CONFLICT, Json(json!({"error": "external_id_conflict", "task_id": task_id})))
                    .into_response()
            }
            Self::Ambiguous { task_ids } => {
                (StatusCode::CONFLICT, Json(json!({"error": "ambiguous", "task_ids": task_ids}))).into_response()
            }
            Self::Unavailable => {
                (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"error": "unavailable"}))).into_response()
            }
            Self::RateLimited { retry_after } => {
                // Retry-After carries whole seconds; round up so a client never retries early.
                let secs = retry_after.as_millis().div_ceil(1000);
                (
                    StatusCode::TOO_MANY_REQUESTS,
                    [(header::RETRY_AFTER, secs.to_string())],
                    Json(json!({"error": "rate_limited", "retry_after_secs": secs})),
                )
                    .into_response()
            }
            Self::Database(err) => {
                tracing::error!(error = %err, "database error");
                (StatusCode::INTERNAL_SERVER_ERROR, Json(json!({"error": "internal"}))).into_response()
            }
        }
    }
}

/// A response that makes hyper close the connection without writing anything.
///
/// hyper encodes a response head only into its write buffer and polls the body before flushing;
/// a body whose first frame is an error aborts the connection with the buffer unflushed. The
/// client sees the connection close with no status line at all: the reply is lost, not refused.
fn drop_connection() -> Response {
    let body = futures::stream::once(async { Err::<Bytes, _>(io::Error::other("reply withheld by fault injection")) });
    Response::new(Body::from_stream(body))
}

/// The create response: the task and whether it already existed.
#[derive(Debug, Serialize)]
struct TaskReply {
    #[serde(flatten)]
    task: Task,
    replayed: bool,
}

async fn add_latency(State(sim): State<Arc<Inner>>, request: Request, next: Next) -> Response {
    if !sim.config.latency.is_zero() && sim.pause(sim.config.latency).await.is_err() {
        return drop_connection();
    }
    next.run(request).await
}

/// Keeps the W3C `traceparent` of every API request that carries one, so tests can see the trace
/// context reach the CRM.
async fn record_trace(State(sim): State<Arc<Inner>>, request: Request, next: Next) -> Response {
    if let Some(value) = request.headers().get("traceparent").and_then(|v| v.to_str().ok()) {
        sim.record_trace(format!("{} {}", request.method(), request.uri().path()), value.to_owned());
    }
    next.run(request).await
}

/// `GET /_admin/traces`: the `traceparent` headers received, oldest first.
async fn traces(State(sim): State<Arc<Inner>>) -> Response {
    Json(sim.traces()).into_response()
}

async fn authorize(State(sim): State<Arc<Inner>>, request: Request, next: Next) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "));
    if presented != Some(sim.config.auth_token.as_str()) {
        return ApiError::Unauthorized.into_response();
    }
    next.run(request).await
}

/// `POST /v1/tasks`.
async fn create_task(State(sim): State<Arc<Inner>>, headers: HeaderMap, body: Bytes) -> Response {
    sim.counters.creates.fetch_add(1, Ordering::Relaxed);
    let key = match idempotency_key(&headers) {
        Ok(key) => key,
        Err(detail) => return ApiError::Validation(detail).into_response(),
    };
    let parsed = TaskBody::parse(&body);
    // Faults are matched before validation, on the key or else the external id, so that an
    // injected 401/429/503 answers whatever the body says.
    let target = key.clone().or_else(|| parsed.as_ref().ok().map(|(task, _)| task.external_id.clone()));
    let after = match create_fault(&sim, target.as_deref()).await {
        Ok(after) => after,
        Err(answer) => return answer,
    };
    let new = match parsed {
        Ok((new, _)) => new,
        Err(detail) => return ApiError::Validation(detail).into_response(),
    };

    let outcome = sim.store.create(key.as_deref(), &new).await;
    match &outcome {
        Ok(Created::New(task)) => {
            tracing::info!(task_id = %task.task_id, external_id = %task.external_id, key = ?key, "task created");
        }
        Ok(Created::Replayed(task)) => {
            tracing::info!(task_id = %task.task_id, external_id = %task.external_id, key = ?key, "create replayed");
        }
        Err(err) => tracing::info!(external_id = %new.external_id, key = ?key, error = %err, "create refused"),
    }
    let answer = match outcome {
        Ok(Created::New(task)) => (StatusCode::CREATED, Json(TaskReply { task, replayed: false })).into_response(),
        Ok(Created::Replayed(task)) => (StatusCode::OK, Json(TaskReply { task, replayed: true })).into_response(),
        Err(err) => ApiError::from(err).into_response(),
    };
    answer_create(&sim, after, &new.external_id, answer).await
}

/// What a create's fault does once the request has been processed.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct AfterCommit {
    lose_reply: bool,
    gateway_503: bool,
}

/// Takes the fault for a create about `target` (every shape's create goes through here): the
/// answer when the fault refuses or drops the request before anything is processed, or what to
/// do with the reply after processing.
pub(crate) async fn create_fault(sim: &Inner, target: Option<&str>) -> Result<AfterCommit, Response> {
    match sim.faults.take(target, Endpoint::Create) {
        None | Some(FaultKind::ReadbackUnavailable) => Ok(AfterCommit::default()),
        Some(FaultKind::LoseReplyAfterCommit) => Ok(AfterCommit { lose_reply: true, gateway_503: false }),
        Some(FaultKind::Gateway503AfterCommit) => Ok(AfterCommit { lose_reply: false, gateway_503: true }),
        Some(FaultKind::FailBeforeCommit) => Err(ApiError::Unavailable.into_response()),
        Some(FaultKind::RateLimited { retry_after }) => Err(ApiError::RateLimited { retry_after }.into_response()),
        Some(FaultKind::ValidationError) => {
            Err(ApiError::Validation("rejected by fault injection".into()).into_response())
        }
        Some(FaultKind::AuthError) => Err(ApiError::Unauthorized.into_response()),
        Some(FaultKind::ResetBeforeCommit) => Err(drop_connection()),
        Some(FaultKind::Slow(delay)) => {
            // If the client gives up during the delay, hyper sees the connection close and drops
            // this future: the request is abandoned before anything is stored.
            if sim.pause(delay).await.is_err() {
                return Err(drop_connection());
            }
            Ok(AfterCommit::default())
        }
        Some(FaultKind::HoldUntilReleased) => {
            // As with `slow`: a client that gives up drops this future before anything is stored.
            tokio::select! {
                () = sim.faults.hold() => Ok(AfterCommit::default()),
                () = sim.stopping.cancelled() => Err(drop_connection()),
            }
        }
    }
}

/// The reply to a processed create about `target`, as its fault wants it delivered.
pub(crate) async fn answer_create(sim: &Inner, after: AfterCommit, target: &str, answer: Response) -> Response {
    if after.lose_reply {
        tracing::info!(target, hold = ?sim.config.lost_reply_hold, "losing the reply");
        // Hold the request so the client times out first; then close without answering. A
        // shutdown ends the hold early (same outcome for the client: no reply).
        let _ = sim.pause(sim.config.lost_reply_hold).await;
        return drop_connection();
    }
    if after.gateway_503 {
        tracing::info!(target, "answering 503 after the commit (gateway fault)");
        return ApiError::Unavailable.into_response();
    }
    answer
}

fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, String> {
    let Some(value) = headers.get(IDEMPOTENCY_KEY) else {
        return Ok(None);
    };
    let key = value.to_str().map_err(|_| "Idempotency-Key must be visible ASCII".to_owned())?;
    validate_id("Idempotency-Key", key)?;
    Ok(Some(key.to_owned()))
}

/// Is a read about `target` refused by a `ReadbackUnavailable` fault?
pub(crate) fn readback_refused(sim: &Inner, target: &str) -> bool {
    sim.faults.take(Some(target), Endpoint::Read).is_some()
}

/// `GET /v1/tasks/by-key/{key}`.
async fn task_by_key(State(sim): State<Arc<Inner>>, key: Result<Path<String>, PathRejection>) -> Response {
    sim.counters.readbacks.fetch_add(1, Ordering::Relaxed);
    let retention = [(RETENTION_HEADER, sim.config.idempotency_retention.as_secs().to_string())];
    let result = async {
        let Path(key) = key.map_err(|err| ApiError::Validation(err.body_text()))?;
        if readback_refused(&sim, &key) {
            return Err(ApiError::Unavailable);
        }
        // A key the CRM would refuse cannot name a task.
        if validate_id("key", &key).is_err() {
            return Err(ApiError::NotFound);
        }
        sim.store.by_key(&key).await?.ok_or(ApiError::NotFound)
    }
    .await;
    match result {
        Ok(task) => (retention, Json(task)).into_response(),
        Err(err) => (retention, err).into_response(),
    }
}

/// `GET /v1/tasks/by-external-id/{external_id}`.
async fn task_by_external_id(
    State(sim): State<Arc<Inner>>,
    external_id: Result<Path<String>, PathRejection>,
) -> Result<Json<Task>, ApiError> {
    sim.counters.readbacks.fetch_add(1, Ordering::Relaxed);
    let Path(external_id) = external_id.map_err(|err| ApiError::Validation(err.body_text()))?;
    if readback_refused(&sim, &external_id) {
        return Err(ApiError::Unavailable);
    }
    if validate_id("external_id", &external_id).is_err() {
        return Err(ApiError::NotFound);
    }
    let mut tasks = sim.store.by_external_id(&external_id).await?;
    match tasks.len() {
        0 => Err(ApiError::NotFound),
        1 => Ok(Json(tasks.remove(0))),
        _ => Err(ApiError::Ambiguous { task_ids: tasks.into_iter().map(|task| task.task_id).collect() }),
    }
}

#[derive(Debug, Deserialize)]
struct SearchParams {
    external_id: Option<String>,
}

/// `GET /v1/tasks?external_id=X`: eventually consistent, see `query_visibility_lag`.
async fn search_tasks(
    State(sim): State<Arc<Inner>>,
    params: Result<Query<SearchParams>, QueryRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    sim.counters.queries.fetch_add(1, Ordering::Relaxed);
    let Query(params) = params.map_err(|err| ApiError::Validation(err.body_text()))?;
    let external_id = params.external_id.ok_or_else(|| ApiError::Validation("external_id is required".into()))?;
    if readback_refused(&sim, &external_id) {
        return Err(ApiError::Unavailable);
    }
    validate_id("external_id", &external_id).map_err(ApiError::Validation)?;
    let (tasks, as_of) = sim.store.search(&external_id, sim.config.query_visibility_lag).await?;
    Ok(Json(json!({"tasks": tasks, "as_of": as_of})))
}

/// `GET /_admin/faults`.
async fn list_faults(State(sim): State<Arc<Inner>>) -> Json<Vec<Fault>> {
    Json(sim.faults.active())
}

/// `POST /_admin/faults`.
async fn inject_fault(State(sim): State<Arc<Inner>>, body: Bytes) -> Response {
    match serde_json::from_slice::<Fault>(&body) {
        Ok(fault) => {
            sim.faults.inject(fault);
            StatusCode::NO_CONTENT.into_response()
        }
        Err(err) => ApiError::Validation(err.to_string()).into_response(),
    }
}

/// `POST /_admin/faults/release`: releases the held requests; answers how many were held.
async fn release_held(State(sim): State<Arc<Inner>>) -> Json<serde_json::Value> {
    let held = sim.faults.held();
    sim.faults.release_held();
    Json(serde_json::json!({ "released": held }))
}

/// `DELETE /_admin/faults`.
async fn clear_faults(State(sim): State<Arc<Inner>>) -> StatusCode {
    sim.faults.clear();
    StatusCode::NO_CONTENT
}

/// `GET /_admin/effects`.
async fn effects(State(sim): State<Arc<Inner>>) -> Result<Json<EffectsReport>, ApiError> {
    Ok(Json(sim.report().await?))
}

/// `POST /_admin/tasks`: puts a task in as if the CRM already held it.
async fn seed_task(State(sim): State<Arc<Inner>>, body: Bytes) -> Result<(StatusCode, Json<Task>), ApiError> {
    let (new, key) = TaskBody::parse(&body).map_err(ApiError::Validation)?;
    let task = sim.store.seed(key.as_deref(), &new).await?;
    tracing::info!(task_id = %task.task_id, external_id = %task.external_id, key = ?key, "task seeded");
    Ok((StatusCode::CREATED, Json(task)))
}

async fn not_found() -> ApiError {
    ApiError::NotFound
}
