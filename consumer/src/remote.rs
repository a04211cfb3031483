//! The HTTP adapter for a remote CRM, and what each kind of destination can prove.
//!
//! Every response is classified where it is received (seed 004's decision table):
//!
//! | response | meaning | what the dispatcher does |
//! |---|---|---|
//! | 2xx | settled; the CRM's task id is the receipt | settle |
//! | 409, or a 2xx whose hash is not ours | the key holds different content | review |
//! | 400, 401, 403, 422 | permanent: retrying the same request cannot help | review |
//! | 429 (honouring `Retry-After`: seconds or an HTTP date), 503, connection refused | the CRM did not execute it | retry with backoff |
//! | timeout, reset, 500, 502, 504 | the request may have been executed | unknown: read back first |

use std::time::Duration;

use handoff_shared::TraceParent;
use reqwest::StatusCode;
use serde::Deserialize;

/// The W3C Trace Context header every CRM call carries when the action came with a trace.
pub const TRACEPARENT: &str = "traceparent";

/// What the destination offers for proving an outcome. Declared by configuration, from the CRM's
/// documentation; the dispatcher follows the matching rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capability {
    /// Creates carry an `Idempotency-Key` the CRM remembers for `retention`: a retry with the same
    /// key and payload returns the original task. Readback by key is authoritative within retention.
    IdempotencyKey { retention: Duration },
    /// Tasks carry a unique external id (the operation key): readback by it is authoritative.
    ExternalId,
    /// Only an eventually consistent search: absence counts only once `freshness` has passed since
    /// the attempt started.
    QueryOnly { freshness: Duration },
    /// Nothing reliable: an unknown outcome always goes to a person.
    Nothing,
}

/// One request to the CRM: the verified action.
#[derive(Debug, Clone)]
pub struct RemoteTask<'a> {
    pub operation_key: &'a str,
    pub payload_hash: &'a str,
    pub payload: &'a serde_json::Value,
    /// The trace context to send (`traceparent`), already a child of the producer's.
    pub traceparent: Option<TraceParent>,
}

/// What a create call proved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreateOutcome {
    /// The CRM holds the task (created now, or replayed for this key).
    Created { task_id: String, evidence: String },
    /// The CRM holds different content for this key.
    Conflict { evidence: String },
    /// Rejected for a reason a retry cannot fix (validation, authorization).
    Permanent { evidence: String },
    /// The CRM refused before executing anything: safe to retry after the delay.
    NotExecuted { retry_after: Option<Duration>, evidence: String },
    /// The request may or may not have been executed.
    Unknown { evidence: String },
}

/// What a readback proved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readback {
    /// A task for this key exists; `payload_hash` says whether it is ours.
    Found { task_id: String, payload_hash: String, evidence: String },
    /// No task was found. `authoritative` is the lookup's own guarantee; the dispatcher still
    /// applies time rules (key retention, query freshness) before treating it as proof.
    Absent { authoritative: bool, evidence: String },
    /// More than one task matches: the key is not unique at the destination.
    Ambiguous { evidence: String },
    /// The lookup could not be made.
    Unavailable { evidence: String },
}

#[derive(Debug, Deserialize)]
struct TaskBody {
    task_id: String,
    payload_hash: String,
}

#[derive(Debug, Deserialize)]
struct QueryBody {
    tasks: Vec<TaskBody>,
}

/// Settings of the HTTP adapter.
#[derive(Clone)]
pub struct HttpCrmSettings {
    /// Base URL, e.g. `https://crm.example.com`.
    pub base_url: String,
    /// Bearer token (secret; never logged).
    pub token: String,
    /// The destination account, recorded with every decision as evidence.
    pub account: String,
    pub capability: Capability,
    /// Whole-request timeout; past it the outcome is unknown.
    pub timeout: Duration,
    /// Connect timeout; a connection never made proves nothing was sent.
    pub connect_timeout: Duration,
}

impl std::fmt::Debug for HttpCrmSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpCrmSettings")
            .field("base_url", &self.base_url)
            .field("token", &"<redacted>")
            .field("account", &self.account)
            .field("capability", &self.capability)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// A CRM reached over HTTP with the contract in `crm-sim/README.md`.
#[derive(Debug, Clone)]
pub struct HttpCrm {
    client: reqwest::Client,
    settings: HttpCrmSettings,
}

impl HttpCrm {
    /// Builds the client (connection pool shared by all dispatches).
    pub fn new(settings: HttpCrmSettings) -> anyhow::Result<Self> {
        let client =
            reqwest::Client::builder().timeout(settings.timeout).connect_timeout(settings.connect_timeout).build()?;
        Ok(Self { client, settings })
    }

    /// The declared capability.
    pub fn capability(&self) -> Capability {
        self.settings.capability
    }

    /// The destination account.
    pub fn account(&self) -> &str {
        &self.settings.account
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.settings.base_url.trim_end_matches('/'))
    }

    /// One create attempt. The operation key is the external id, and the idempotency key when
    /// the destination supports one.
    pub async fn create(&self, task: &RemoteTask<'_>) -> CreateOutcome {
        let mut request =
            self.client.post(self.url("/v1/tasks")).bearer_auth(&self.settings.token).json(&serde_json::json!({
                "external_id": task.operation_key,
                "payload_hash": task.payload_hash,
                "data": task.payload,
            }));
        if matches!(self.settings.capability, Capability::IdempotencyKey { .. }) {
            request = request.header("Idempotency-Key", task.operation_key);
        }
        if let Some(traceparent) = task.traceparent {
            request = request.header(TRACEPARENT, traceparent.to_string());
        }
        let account = &self.settings.account;
        let response = match request.send().await {
            Ok(response) => response,
            // No connection was made, so nothing was sent.
            Err(e) if e.is_connect() => {
                return CreateOutcome::NotExecuted {
                    retry_after: None,
                    evidence: format!("POST /v1/tasks [{account}]: connection failed before sending: {e}"),
                };
            }
            Err(e) => {
                return CreateOutcome::Unknown {
                    evidence: format!("POST /v1/tasks [{account}]: no response: {}", describe(&e)),
                };
            }
        };
        let status = response.status();
        let evidence = format!("POST /v1/tasks [{account}] -> {}", status.as_u16());
        match status {
            s if s.is_success() => match response.json::<TaskBody>().await {
                Ok(body) if body.payload_hash == task.payload_hash => {
                    CreateOutcome::Created { task_id: body.task_id, evidence }
                }
                Ok(body) => CreateOutcome::Conflict {
                    evidence: format!("{evidence}: task {} holds payload hash {}", body.task_id, body.payload_hash),
                },
                // A success whose body was lost or garbled: it probably exists, but prove it.
                Err(e) => CreateOutcome::Unknown { evidence: format!("{evidence}, unreadable body: {e}") },
            },
            StatusCode::CONFLICT => CreateOutcome::Conflict { evidence },
            StatusCode::BAD_REQUEST
            | StatusCode::UNAUTHORIZED
            | StatusCode::FORBIDDEN
            | StatusCode::UNPROCESSABLE_ENTITY => CreateOutcome::Permanent { evidence },
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => {
                let retry_after = response
                    .headers()
                    .get(reqwest::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| parse_retry_after(v, std::time::SystemTime::now()));
                CreateOutcome::NotExecuted { retry_after, evidence }
            }
            // 500, 502, 504 and anything else: the request may have been processed.
            _ => CreateOutcome::Unknown { evidence },
        }
    }

    /// Looks the task up by whatever this destination can prove with.
    pub async fn readback(&self, operation_key: &str, traceparent: Option<TraceParent>) -> Readback {
        let account = &self.settings.account;
        let (path, lookup, authoritative) = match self.settings.capability {
            Capability::IdempotencyKey { .. } => {
                (format!("/v1/tasks/by-key/{}", operation_key), "by idempotency key", true)
            }
            Capability::ExternalId => (format!("/v1/tasks/by-external-id/{}", operation_key), "by external id", true),
            Capability::QueryOnly { .. } => {
                (format!("/v1/tasks?external_id={}", operation_key), "by search query", false)
            }
            Capability::Nothing => {
                return Readback::Unavailable { evidence: "destination offers no readback".into() };
            }
        };
        let evidence_for = |what: String| format!("GET {lookup} [{account}] -> {what}");
        let mut request = self.client.get(self.url(&path)).bearer_auth(&self.settings.token);
        if let Some(traceparent) = traceparent {
            request = request.header(TRACEPARENT, traceparent.to_string());
        }
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
        if matches!(self.settings.capability, Capability::QueryOnly { .. }) {
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

/// The error and its causes, without the URL (it could carry credentials into notes and exports).
fn describe(error: &reqwest::Error) -> String {
    if error.is_timeout() {
        "timed out".into()
    } else {
        let mut text = String::from(if error.is_connect() {
            "connection failed"
        } else if error.is_body() || error.is_decode() {
            "response body failed"
        } else {
            "request failed"
        });
        let mut source = std::error::Error::source(error);
        while let Some(cause) = source {
            text.push_str(": ");
            text.push_str(&cause.to_string());
            source = cause.source();
        }
        text
    }
}

/// A `Retry-After` value (RFC 9110 10.2.3): delay seconds, or an HTTP date (IMF-fixdate, and the
/// obsolete RFC 850 and asctime forms recipients must accept), as the wait from `now`; a date in
/// the past is no wait. `None` when it is neither.
pub fn parse_retry_after(value: &str, now: std::time::SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_is_read_as_seconds_or_as_an_http_date() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        assert_eq!(parse_retry_after(" 120 ", now), Some(Duration::from_secs(120)));
        assert_eq!(parse_retry_after("Sun, 06 Nov 1994 08:51:37 GMT", now), Some(Duration::from_secs(120)));
        assert_eq!(parse_retry_after("Sunday, 06-Nov-94 08:50:37 GMT", now), Some(Duration::from_secs(60)));
        assert_eq!(parse_retry_after("Sun Nov  6 08:49:47 1994", now), Some(Duration::from_secs(10)));
        assert_eq!(parse_retry_after("Sun, 06 Nov 1994 08:00:00 GMT", now), Some(Duration::ZERO), "already past");
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("-5", now), None);
    }
}
