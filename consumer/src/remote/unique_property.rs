//! Create with a unique property, HubSpot-shaped: `POST {base}/crm/v3/objects/<type>` with
//! `{"properties": {...}}`, the operation key in a property the CRM enforces as unique. A create
//! that repeats the value answers 409 with `Existing ID: <id>` in its message; the adapter reads
//! that record by id (consistent) and settles when it holds our payload hash, or reports a
//! conflict when it holds another. Readback is the CRM's search (`POST .../search`, an `EQ` filter
//! on the key), which lags behind writes: capability `query-only`, so an empty result proves
//! absence only once `--crm-query-freshness-secs` have passed, and only for the account the
//! lookup was made with (the dispatcher works its own account's rows; the evidence names the
//! account and the method). A create sent after such a proof is still safe: the unique property
//! refuses a second record and the 409 settles it.
//!
//! | response to the create | outcome |
//! |---|---|
//! | 201 with our hash | created |
//! | 201 with another hash | conflict |
//! | 409 naming a record with our hash | created (it existed) |
//! | 409 naming a record with another hash | conflict |
//! | 409 whose record cannot be read | unknown (read back) |
//! | 400, 401, 403, 422 | permanent |
//! | a status in the non-execution rule, a connection never made | not executed |
//! | anything else | unknown |

use futures::FutureExt;
use futures::future::BoxFuture;
use handoff_shared::TraceParent;
use reqwest::StatusCode;
use serde::Deserialize;
use serde_json::json;

use super::{
    Capability, CreateOutcome, HttpSettings, Readback, RecordMapping, RemoteCrm, RemoteTask, describe, path_segment,
    transport_failure, undecided_status, with_trace,
};

#[derive(Debug, Deserialize)]
struct Object {
    id: String,
    #[serde(default)]
    properties: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug, Deserialize)]
struct SearchReply {
    results: Vec<Object>,
}

#[derive(Debug, Deserialize)]
struct ErrorReply {
    #[serde(default)]
    message: String,
}

/// A create-with-unique-property CRM.
#[derive(Debug, Clone)]
pub struct UniqueProperty {
    client: reqwest::Client,
    settings: HttpSettings,
    capability: Capability,
    mapping: RecordMapping,
}

/// The id in a conflict message's `Existing ID: <id>`.
pub fn existing_id(message: &str) -> Option<&str> {
    let (_, rest) = message.rsplit_once("Existing ID:")?;
    let id = rest.trim().split(|c: char| c.is_whitespace() || c == ',').next()?.trim_end_matches('.');
    (!id.is_empty()).then_some(id)
}

impl UniqueProperty {
    /// `capability` must be `query-only` (its freshness is the search's lag).
    pub fn new(settings: HttpSettings, capability: Capability, mapping: RecordMapping) -> anyhow::Result<Self> {
        anyhow::ensure!(
            matches!(capability, Capability::QueryOnly { .. }),
            "the unique-property adapter reads back by search: its capability is query-only"
        );
        Ok(Self { client: settings.client()?, settings, capability, mapping })
    }

    fn objects(&self) -> String {
        format!("/crm/v3/objects/{}", path_segment(&self.mapping.object))
    }

    fn hash_of(&self, object: &Object) -> String {
        object.properties.get(&self.mapping.hash_field).and_then(|v| v.as_str()).unwrap_or_default().to_owned()
    }

    async fn create_object(&self, task: &RemoteTask<'_>) -> CreateOutcome {
        let call = format!("POST {} [{}]", self.objects(), self.settings.account);
        let mut properties = match self.mapping.fields_of(task.payload) {
            Ok(fields) => fields,
            Err(e) => return CreateOutcome::Permanent { evidence: format!("{call}: not sent: {e}") },
        };
        properties.insert(self.mapping.key_field.clone(), task.operation_key.into());
        properties.insert(self.mapping.hash_field.clone(), task.payload_hash.into());
        let mut request = self
            .client
            .post(self.settings.url(&self.objects()))
            .bearer_auth(&self.settings.token)
            .json(&json!({ "properties": properties }));
        request = with_trace(request, task.traceparent);
        let response = match request.send().await {
            Ok(response) => response,
            Err(e) => return transport_failure(&e, &self.settings.not_executed, &call),
        };
        let status = response.status();
        let evidence = format!("{call} -> {}", status.as_u16());
        match status {
            s if s.is_success() => match response.json::<Object>().await {
                Ok(object) if self.hash_of(&object) == task.payload_hash => {
                    CreateOutcome::Created { task_id: object.id, evidence }
                }
                Ok(object) => CreateOutcome::Conflict {
                    evidence: format!(
                        "{evidence}: object {} holds payload hash {:?}",
                        object.id,
                        self.hash_of(&object)
                    ),
                },
                Err(e) => {
                    CreateOutcome::Unknown { retry_after: None, evidence: format!("{evidence}, unreadable body: {e}") }
                }
            },
            StatusCode::CONFLICT => {
                let message = response.json::<ErrorReply>().await.map(|e| e.message).unwrap_or_default();
                match existing_id(&message) {
                    Some(id) => self.settle_existing(id, task, evidence).await,
                    None => CreateOutcome::Unknown {
                        retry_after: None,
                        evidence: format!("{evidence} without an existing record id: read back"),
                    },
                }
            }
            StatusCode::BAD_REQUEST
            | StatusCode::UNAUTHORIZED
            | StatusCode::FORBIDDEN
            | StatusCode::UNPROCESSABLE_ENTITY => CreateOutcome::Permanent { evidence },
            _ => undecided_status(&response, &self.settings.not_executed, evidence),
        }
    }

    /// A 409 named the record holding our key: read it by id (consistent) and compare hashes.
    async fn settle_existing(&self, id: &str, task: &RemoteTask<'_>, evidence: String) -> CreateOutcome {
        let path = format!("{}/{}", self.objects(), path_segment(id));
        let lookup = format!("{evidence}: existing {id}; GET by id [{}]", self.settings.account);
        let response = match self
            .client
            .get(self.settings.url(&path))
            .query(&[("properties", format!("{},{}", self.mapping.key_field, self.mapping.hash_field))])
            .bearer_auth(&self.settings.token)
            .send()
            .await
        {
            Ok(response) if response.status().is_success() => response,
            Ok(response) => {
                return CreateOutcome::Unknown {
                    retry_after: None,
                    evidence: format!("{lookup} -> {}", response.status().as_u16()),
                };
            }
            Err(e) => {
                return CreateOutcome::Unknown { retry_after: None, evidence: format!("{lookup} -> {}", describe(&e)) };
            }
        };
        match response.json::<Object>().await {
            Ok(object) if self.hash_of(&object) == task.payload_hash => CreateOutcome::Created {
                task_id: object.id,
                evidence: format!("{lookup} -> 200, our payload hash: it existed"),
            },
            Ok(object) => CreateOutcome::Conflict {
                evidence: format!("{lookup} -> 200, payload hash {:?}", self.hash_of(&object)),
            },
            Err(e) => CreateOutcome::Unknown { retry_after: None, evidence: format!("{lookup}, unreadable body: {e}") },
        }
    }

    async fn search(&self, operation_key: &str, traceparent: Option<TraceParent>) -> Readback {
        let path = format!("{}/search", self.objects());
        let lookup = format!("POST search by {} [{}]", self.mapping.key_field, self.settings.account);
        let body = json!({
            "filterGroups": [{"filters": [{"propertyName": self.mapping.key_field, "operator": "EQ", "value": operation_key}]}],
            "properties": [self.mapping.key_field, self.mapping.hash_field],
        });
        let mut request = self.client.post(self.settings.url(&path)).bearer_auth(&self.settings.token).json(&body);
        request = with_trace(request, traceparent);
        let response = match request.send().await {
            Ok(response) => response,
            Err(e) => return Readback::Unavailable { evidence: format!("{lookup} -> {}", describe(&e)) },
        };
        let status = response.status();
        let evidence = format!("{lookup} -> {}", status.as_u16());
        if !status.is_success() {
            return Readback::Unavailable { evidence };
        }
        match response.json::<SearchReply>().await {
            Ok(reply) => match reply.results.as_slice() {
                [] => Readback::Absent { authoritative: false, evidence: format!("{evidence}, 0 results") },
                [object] => Readback::Found {
                    task_id: object.id.clone(),
                    payload_hash: self.hash_of(object),
                    evidence: format!("{evidence}, 1 result"),
                },
                many => Readback::Ambiguous { evidence: format!("{evidence}, {} results", many.len()) },
            },
            Err(e) => Readback::Unavailable { evidence: format!("{evidence}, unreadable body: {e}") },
        }
    }
}

impl RemoteCrm for UniqueProperty {
    fn capability(&self) -> Capability {
        self.capability
    }

    fn account(&self) -> &str {
        &self.settings.account
    }

    fn create<'a>(&'a self, task: &'a RemoteTask<'a>) -> BoxFuture<'a, CreateOutcome> {
        self.create_object(task).boxed()
    }

    fn readback<'a>(&'a self, operation_key: &'a str, traceparent: Option<TraceParent>) -> BoxFuture<'a, Readback> {
        self.search(operation_key, traceparent).boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_existing_record_id_is_read_from_the_conflict_message() {
        assert_eq!(existing_id("A record with handoff_key=k already exists. Existing ID: T-000017"), Some("T-000017"));
        assert_eq!(existing_id("Contact already exists. Existing ID: 12345."), Some("12345"));
        assert_eq!(existing_id("Conflict"), None);
        assert_eq!(existing_id("Existing ID: "), None);
    }
}
