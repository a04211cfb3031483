//! The `/v1/tasks` adapter: the contract `crm-sim` speaks (`crm-sim/README.md`), shaped like the
//! providers that document idempotency keys (Stripe-style `Idempotency-Key`), a unique external id
//! and an eventually consistent search. Which of them a destination guarantees is declared
//! (`--crm-capability`); the adapter sends the operation key as all three.
//!
//! | response to a create | outcome |
//! |---|---|
//! | 2xx with our payload hash | created (or replayed): the task id is the receipt |
//! | 2xx with another hash, 409 | conflict |
//! | 400, 401, 403, 422 | permanent |
//! | a status in the non-execution rule (e.g. 429, 503), a connection never made | not executed |
//! | anything else: timeout, reset, 5xx, 429 outside the rule | unknown (read back first) |

use futures::FutureExt;
use futures::future::BoxFuture;
use handoff_shared::TraceParent;
use reqwest::StatusCode;
use serde::Deserialize;

use super::{
    Capability, CreateOutcome, HttpSettings, Readback, RemoteCrm, RemoteTask, describe, transport_failure,
    undecided_status, with_trace,
};

#[derive(Debug, Deserialize)]
struct TaskBody {
    task_id: String,
    payload_hash: String,
}

#[derive(Debug, Deserialize)]
struct QueryBody {
    tasks: Vec<TaskBody>,
}

/// A CRM reached over HTTP with the `/v1/tasks` contract.
#[derive(Debug, Clone)]
pub struct TasksApi {
    client: reqwest::Client,
    settings: HttpSettings,
    capability: Capability,
}

impl TasksApi {
    /// Builds the client (connection pool shared by all dispatches).
    pub fn new(settings: HttpSettings, capability: Capability) -> anyhow::Result<Self> {
        Ok(Self { client: settings.client()?, settings, capability })
    }

    async fn create_task(&self, task: &RemoteTask<'_>) -> CreateOutcome {
        let mut request = self.client.post(self.settings.url("/v1/tasks")).bearer_auth(&self.settings.token).json(
            &serde_json::json!({
                "external_id": task.operation_key,
                "payload_hash": task.payload_hash,
                "data": task.payload,
            }),
        );
        if matches!(self.capability, Capability::IdempotencyKey { .. }) {
            request = request.header("Idempotency-Key", task.operation_key);
        }
        request = with_trace(request, task.traceparent);
        let call = format!("POST /v1/tasks [{}]", self.settings.account);
        let response = match request.send().await {
            Ok(response) => response,
            Err(e) => return transport_failure(&e, &self.settings.not_executed, &call),
        };
        let status = response.status();
        let evidence = format!("{call} -> {}", status.as_u16());
        match status {
            s if s.is_success() => match response.json::<TaskBody>().await {
                Ok(body) if body.payload_hash == task.payload_hash => {
                    CreateOutcome::Created { task_id: body.task_id, evidence }
                }
                Ok(body) => CreateOutcome::Conflict {
                    evidence: format!("{evidence}: task {} holds payload hash {}", body.task_id, body.payload_hash),
                },
                // A success whose body was lost or garbled: it probably exists, but prove it.
                Err(e) => {
                    CreateOutcome::Unknown { retry_after: None, evidence: format!("{evidence}, unreadable body: {e}") }
                }
            },
            StatusCode::CONFLICT => CreateOutcome::Conflict { evidence },
            StatusCode::BAD_REQUEST
            | StatusCode::UNAUTHORIZED
            | StatusCode::FORBIDDEN
            | StatusCode::UNPROCESSABLE_ENTITY => CreateOutcome::Permanent { evidence },
            _ => undecided_status(&response, &self.settings.not_executed, evidence),
        }
    }

    async fn read_task(&self, operation_key: &str, traceparent: Option<TraceParent>) -> Readback {
        let account = &self.settings.account;
        let (path, lookup, authoritative) = match self.capability {
            Capability::IdempotencyKey { .. } => {
                (format!("/v1/tasks/by-key/{operation_key}"), "by idempotency key", true)
            }
            Capability::ExternalId => (format!("/v1/tasks/by-external-id/{operation_key}"), "by external id", true),
            Capability::QueryOnly { .. } => {
                (format!("/v1/tasks?external_id={operation_key}"), "by search query", false)
            }
            Capability::Nothing => {
                return Readback::Unavailable { evidence: "destination offers no readback".into() };
            }
        };
        let evidence_for = |what: String| format!("GET {lookup} [{account}] -> {what}");
        let mut request = self.client.get(self.settings.url(&path)).bearer_auth(&self.settings.token);
        request = with_trace(request, traceparent);
        let response = match request.send().await {
            Ok(response) => response,
            Err(e) => return Readback::Unavailable { evidence: evidence_for(describe(&e)) },
        };
        let status = response.status();
        let evidence = evidence_for(status.as_u16().to_string());
        if !status.is_success() {
            return match status {
                // Only the CRM's own "not found" is evidence; a 404 from a proxy or a wrong route is not.
                StatusCode::NOT_FOUND => match response.json::<serde_json::Value>().await {
                    Ok(body) if body["error"] == "not_found" => Readback::Absent { authoritative, evidence },
                    _ => Readback::Unavailable { evidence: format!("{evidence} without the CRM's not_found body") },
                },
                StatusCode::CONFLICT => Readback::Ambiguous { evidence },
                _ => Readback::Unavailable { evidence },
            };
        }
        if matches!(self.capability, Capability::QueryOnly { .. }) {
            return match response.json::<QueryBody>().await {
                Ok(body) => match body.tasks.as_slice() {
                    [] => Readback::Absent { authoritative: false, evidence: format!("{evidence}, 0 results") },
                    [task] => Readback::Found {
                        task_id: task.task_id.clone(),
                        payload_hash: task.payload_hash.clone(),
                        evidence: format!("{evidence}, 1 result"),
                    },
                    many => Readback::Ambiguous { evidence: format!("{evidence}, {} results", many.len()) },
                },
                Err(e) => Readback::Unavailable { evidence: format!("{evidence}, unreadable body: {e}") },
            };
        }
        match response.json::<TaskBody>().await {
            Ok(body) => Readback::Found { task_id: body.task_id, payload_hash: body.payload_hash, evidence },
            Err(e) => Readback::Unavailable { evidence: format!("{evidence}, unreadable body: {e}") },
        }
    }
}

impl RemoteCrm for TasksApi {
    fn capability(&self) -> Capability {
        self.capability
    }

    fn account(&self) -> &str {
        &self.settings.account
    }

    fn create<'a>(&'a self, task: &'a RemoteTask<'a>) -> BoxFuture<'a, CreateOutcome> {
        self.create_task(task).boxed()
    }

    fn readback<'a>(&'a self, operation_key: &'a str, traceparent: Option<TraceParent>) -> BoxFuture<'a, Readback> {
        self.read_task(operation_key, traceparent).boxed()
    }
}
