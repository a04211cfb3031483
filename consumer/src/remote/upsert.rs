//! Upsert by external id, Salesforce-shaped: `PATCH {base}/services/data/v60.0/sobjects/<Object>/<KeyField>/<key>`
//! creates the record (201) or updates the one that holds the key (200, or 204 without a body);
//! several records holding it answer 300. `GET` on the same path reads the record back and is
//! authoritative (capability `external-id`).
//!
//! **An upsert overwrites.** A different payload under the same key must never replace the
//! approved one, so every record carries the payload hash in its hash field, and the destination
//! must make that field write-once: in Salesforce, a validation rule on the object,
//! `AND(NOT(ISNEW()), ISCHANGED(Handoff_Payload_Hash__c))`, whose error the adapter recognises
//! (400 `FIELD_CUSTOM_VALIDATION_EXCEPTION` naming the hash field) as a conflict: review, the
//! record untouched. A repeated upsert with our own hash is an update of identical fields, but
//! updates fire the CRM's workflows: after an unknown outcome the dispatcher reads back first and
//! re-sends only what is proven absent.
//!
//! | response to the upsert | outcome |
//! |---|---|
//! | 201, or 200 with the record id | created (200: it held our hash already) |
//! | 204 | unknown: no receipt, read back |
//! | 300 | ambiguous: several records, review |
//! | 400 validation error on the hash field | conflict: another payload holds the key |
//! | other 400, 401, 403, 404 | permanent |
//! | a status in the non-execution rule, a connection never made | not executed |
//! | anything else | unknown |

use futures::FutureExt;
use futures::future::BoxFuture;
use handoff_shared::TraceParent;
use reqwest::StatusCode;
use serde::Deserialize;

use super::{
    Capability, CreateOutcome, HttpSettings, Readback, RecordMapping, RemoteCrm, RemoteTask, describe, path_segment,
    transport_failure, undecided_status, with_trace,
};

/// The REST API version the paths are under.
pub const API: &str = "/services/data/v60.0";

#[derive(Debug, Deserialize)]
struct UpsertReply {
    id: String,
}

#[derive(Debug, Deserialize)]
struct ApiError {
    #[serde(rename = "errorCode")]
    error_code: String,
    #[serde(default)]
    fields: Vec<String>,
}

/// An upsert-by-external-id CRM.
#[derive(Debug, Clone)]
pub struct Upsert {
    client: reqwest::Client,
    settings: HttpSettings,
    mapping: RecordMapping,
}

impl Upsert {
    pub fn new(settings: HttpSettings, mapping: RecordMapping) -> anyhow::Result<Self> {
        Ok(Self { client: settings.client()?, settings, mapping })
    }

    fn record_path(&self, key: &str) -> String {
        format!(
            "{API}/sobjects/{}/{}/{}",
            path_segment(&self.mapping.object),
            path_segment(&self.mapping.key_field),
            path_segment(key)
        )
    }

    async fn upsert(&self, task: &RemoteTask<'_>) -> CreateOutcome {
        let call =
            format!("PATCH upsert {}.{} [{}]", self.mapping.object, self.mapping.key_field, self.settings.account);
        let mut fields = match self.mapping.fields_of(task.payload) {
            Ok(fields) => fields,
            Err(e) => return CreateOutcome::Permanent { evidence: format!("{call}: not sent: {e}") },
        };
        fields.insert(self.mapping.hash_field.clone(), task.payload_hash.into());
        let mut request = self
            .client
            .patch(self.settings.url(&self.record_path(task.operation_key)))
            .bearer_auth(&self.settings.token)
            .json(&fields);
        request = with_trace(request, task.traceparent);
        let response = match request.send().await {
            Ok(response) => response,
            Err(e) => return transport_failure(&e, &self.settings.not_executed, &call),
        };
        let status = response.status();
        let evidence = format!("{call} -> {}", status.as_u16());
        match status {
            StatusCode::CREATED | StatusCode::OK => match response.json::<UpsertReply>().await {
                Ok(reply) if status == StatusCode::CREATED => CreateOutcome::Created { task_id: reply.id, evidence },
                // Updated: the record held our hash already (the hash is write-once).
                Ok(reply) => CreateOutcome::Created {
                    task_id: reply.id,
                    evidence: format!("{evidence}: updated the record that holds the key"),
                },
                Err(e) => {
                    CreateOutcome::Unknown { retry_after: None, evidence: format!("{evidence}, unreadable body: {e}") }
                }
            },
            StatusCode::NO_CONTENT => CreateOutcome::Unknown {
                retry_after: None,
                evidence: format!("{evidence}: updated, no record id in the reply"),
            },
            StatusCode::MULTIPLE_CHOICES => {
                CreateOutcome::Ambiguous { evidence: format!("{evidence}: several records hold the key") }
            }
            StatusCode::BAD_REQUEST => {
                let errors: Vec<ApiError> = response.json().await.unwrap_or_default();
                let hash_locked = errors.iter().any(|e| {
                    e.error_code == "FIELD_CUSTOM_VALIDATION_EXCEPTION" && e.fields.contains(&self.mapping.hash_field)
                });
                let codes: Vec<&str> = errors.iter().map(|e| e.error_code.as_str()).collect();
                if hash_locked {
                    CreateOutcome::Conflict {
                        evidence: format!("{evidence} {codes:?}: the record holds another payload hash (write-once)"),
                    }
                } else {
                    CreateOutcome::Permanent { evidence: format!("{evidence} {codes:?}") }
                }
            }
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN | StatusCode::NOT_FOUND => {
                CreateOutcome::Permanent { evidence }
            }
            _ => undecided_status(&response, &self.settings.not_executed, evidence),
        }
    }

    async fn read(&self, operation_key: &str, traceparent: Option<TraceParent>) -> Readback {
        let lookup = format!(
            "GET by external id {}.{} [{}]",
            self.mapping.object, self.mapping.key_field, self.settings.account
        );
        let mut request =
            self.client.get(self.settings.url(&self.record_path(operation_key))).bearer_auth(&self.settings.token);
        request = with_trace(request, traceparent);
        let response = match request.send().await {
            Ok(response) => response,
            Err(e) => return Readback::Unavailable { evidence: format!("{lookup} -> {}", describe(&e)) },
        };
        let status = response.status();
        let evidence = format!("{lookup} -> {}", status.as_u16());
        match status {
            StatusCode::OK => match response.json::<serde_json::Value>().await {
                Ok(record) => match record["Id"].as_str() {
                    Some(id) => Readback::Found {
                        task_id: id.to_owned(),
                        // A record without our hash field is someone else's: a conflict.
                        payload_hash: record[&self.mapping.hash_field].as_str().unwrap_or_default().to_owned(),
                        evidence,
                    },
                    None => Readback::Unavailable { evidence: format!("{evidence}, a record without an Id") },
                },
                Err(e) => Readback::Unavailable { evidence: format!("{evidence}, unreadable body: {e}") },
            },
            // Only the CRM's own NOT_FOUND is evidence; a 404 from a proxy or a wrong route is not.
            StatusCode::NOT_FOUND => match response.json::<Vec<ApiError>>().await {
                Ok(errors) if errors.iter().any(|e| e.error_code == "NOT_FOUND") => {
                    Readback::Absent { authoritative: true, evidence }
                }
                _ => Readback::Unavailable { evidence: format!("{evidence} without the CRM's NOT_FOUND body") },
            },
            StatusCode::MULTIPLE_CHOICES => Readback::Ambiguous { evidence },
            _ => Readback::Unavailable { evidence },
        }
    }
}

impl RemoteCrm for Upsert {
    fn capability(&self) -> Capability {
        Capability::ExternalId
    }

    fn account(&self) -> &str {
        &self.settings.account
    }

    fn create<'a>(&'a self, task: &'a RemoteTask<'a>) -> BoxFuture<'a, CreateOutcome> {
        self.upsert(task).boxed()
    }

    fn readback<'a>(&'a self, operation_key: &'a str, traceparent: Option<TraceParent>) -> BoxFuture<'a, Readback> {
        self.read(operation_key, traceparent).boxed()
    }
}
