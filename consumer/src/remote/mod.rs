//! The remote-CRM boundary: what an adapter must answer, and what each answer proves.
//!
//! A remote CRM is reached through an adapter ([`RemoteCrm`]): it makes one create call or one
//! readback and classifies the response into a [`CreateOutcome`] or a [`Readback`]. It decides
//! nothing: [`decide`] holds seed 004's decision table as pure functions, [`dispatcher`] drives the
//! ledger rows ([`ledger`]) through it, and neither knows which adapter it talks to.
//!
//! | module | what it holds |
//! |---|---|
//! | [`decide`] | the decision after a create or a readback, per [`Capability`] |
//! | [`dispatcher`] | claim, call, record: the loop every replica runs |
//! | [`ledger`] | every statement on the ledger, its evidence and the operators' audit |
//! | [`tasks_api`] | the `/v1/tasks` contract (`crm-sim`): idempotency keys, external ids, search |
//! | [`upsert`] | upsert by external id (Salesforce-shaped), the payload hash write-once on the record |
//! | [`unique_property`] | create with a unique property, 409 on a repeat, an eventually consistent search (HubSpot-shaped) |
//!
//! **Adding an adapter** is one file implementing [`RemoteCrm`] and one arm in [`Adapter`] /
//! [`connect`]; the dispatcher and the decision table do not change. An adapter owns two things
//! that belong to its destination, not to handoff: the [`Capability`] it can prove with, and which
//! answers prove that a create was *not* executed ([`NonExecution`]). Everything it cannot prove
//! is [`CreateOutcome::Unknown`] and is read back before anything else.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use handoff_shared::TraceParent;

pub mod decide;
pub mod dispatcher;
pub mod ledger;
pub mod tasks_api;
pub mod unique_property;
pub mod upsert;

/// The W3C Trace Context header every CRM call carries when the action came with a trace.
pub const TRACEPARENT: &str = "traceparent";

/// `request` carrying [`TRACEPARENT`] when the call continues the producer's trace: every adapter
/// sends it on creates and readbacks alike.
pub(crate) fn with_trace(
    request: reqwest::RequestBuilder,
    traceparent: Option<TraceParent>,
) -> reqwest::RequestBuilder {
    match traceparent {
        Some(traceparent) => request.header(TRACEPARENT, traceparent.to_string()),
        None => request,
    }
}

/// What the destination offers for proving an outcome. Declared by configuration, from the CRM's
/// documentation; the dispatcher follows the matching rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capability {
    /// Creates carry an `Idempotency-Key` the CRM remembers for `retention`: a retry with the same
    /// key and payload returns the original task. Readback by key is authoritative within
    /// retention, and while the key is retained a create with the same key is safe to repeat
    /// (it is a readback that creates only what is absent).
    IdempotencyKey { retention: Duration },
    /// Tasks carry a unique external id (the operation key): readback by it is authoritative.
    ExternalId,
    /// Only an eventually consistent search: absence counts only once `freshness` has passed since
    /// the attempt started.
    QueryOnly { freshness: Duration },
    /// Nothing reliable: an unknown outcome always goes to a person.
    Nothing,
}

impl Capability {
    /// How a readback under this capability proves a task exists (the ledger's `proof`).
    pub fn readback_proof(self) -> &'static str {
        match self {
            Capability::IdempotencyKey { .. } => "readback_by_key",
            Capability::ExternalId => "readback_by_external_id",
            Capability::QueryOnly { .. } | Capability::Nothing => "query",
        }
    }
}

/// The states of a ledger row (`handoff_consumer.crm_operation.state`); see the diagram in
/// `migrations/20261129000002_remote_crm_ledger.sql` and `20261203000001_ledger_replay.sql`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LedgerState {
    /// Recorded at intake; a create is due.
    Received,
    /// A replica holds the lease and is calling the CRM.
    Dispatching,
    /// A create may or may not have been executed: read back before anything else.
    Unknown,
    /// A readback proved the last attempt was not executed: one new attempt with the same key.
    ProvedNotExecuted,
    /// Readback is unavailable but the CRM still retains the idempotency key: the create is sent
    /// again with the same key, which returns the original task if there is one.
    Replay,
    /// The CRM holds the task; its id is the receipt.
    Settled,
    /// A person must decide.
    Review,
}

impl LedgerState {
    /// Every state, in the order of the diagram.
    pub const ALL: [LedgerState; 7] = [
        LedgerState::Received,
        LedgerState::Dispatching,
        LedgerState::Unknown,
        LedgerState::ProvedNotExecuted,
        LedgerState::Replay,
        LedgerState::Settled,
        LedgerState::Review,
    ];

    /// The name stored in the database.
    pub const fn as_str(self) -> &'static str {
        match self {
            LedgerState::Received => "received",
            LedgerState::Dispatching => "dispatching",
            LedgerState::Unknown => "unknown",
            LedgerState::ProvedNotExecuted => "proved_not_executed",
            LedgerState::Replay => "replay",
            LedgerState::Settled => "settled",
            LedgerState::Review => "review",
        }
    }

    /// Settled and review rows are decided: the dispatcher never claims them again.
    pub const fn is_decided(self) -> bool {
        matches!(self, LedgerState::Settled | LedgerState::Review)
    }

    /// A claim of a row in this state sends a create (the others read back).
    pub const fn sends_create(self) -> bool {
        matches!(self, LedgerState::Received | LedgerState::ProvedNotExecuted | LedgerState::Replay)
    }
}

impl std::fmt::Display for LedgerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A state name the ledger does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown ledger state {0:?} (expected one of received, dispatching, unknown, proved_not_executed, replay, settled, review)"
)]
pub struct UnknownLedgerState(pub String);

impl std::str::FromStr for LedgerState {
    type Err = UnknownLedgerState;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        LedgerState::ALL.into_iter().find(|state| state.as_str() == s).ok_or_else(|| UnknownLedgerState(s.to_owned()))
    }
}

impl sqlx::Type<sqlx::Postgres> for LedgerState {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        <&str as sqlx::Type<sqlx::Postgres>>::type_info()
    }

    fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
        <&str as sqlx::Type<sqlx::Postgres>>::compatible(ty)
    }
}

impl<'r> sqlx::Decode<'r, sqlx::Postgres> for LedgerState {
    fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
        Ok(<&str as sqlx::Decode<sqlx::Postgres>>::decode(value)?.parse()?)
    }
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
    /// Several records match the key at the destination: nothing was written, a person decides.
    Ambiguous { evidence: String },
    /// The CRM refused before executing anything (by this destination's [`NonExecution`] rule):
    /// safe to retry after the delay.
    NotExecuted { retry_after: Option<Duration>, evidence: String },
    /// The request may or may not have been executed. `retry_after` is the destination's own
    /// request to wait (a 429 or 503 that does not prove non-execution): the readback waits too.
    Unknown { retry_after: Option<Duration>, evidence: String },
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

/// Which answers prove that the destination did **not** execute a create: a property of the
/// destination and of what stands in front of it, not a constant. Behind a gateway or a load
/// balancer a 503 can follow a request that was forwarded and committed, so by default no status
/// proves anything: such answers are unknown and read back first (honouring `Retry-After`).
/// A connection that was never made proves that nothing was sent, unless turned off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NonExecution {
    /// A failure to connect (DNS, TCP, TLS: before a byte of the request was written).
    pub connect_failure: bool,
    /// Statuses the destination documents as answered before any work (e.g. 429, 503).
    pub statuses: Vec<u16>,
}

impl Default for NonExecution {
    fn default() -> Self {
        Self { connect_failure: true, statuses: Vec::new() }
    }
}

/// Statuses every adapter decides by itself (success, conflict, permanent): a non-execution rule
/// cannot claim them.
pub const DECIDED_STATUSES: [u16; 5] = [400, 401, 403, 409, 422];

/// A `--crm-not-executed` value that cannot be a rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NonExecutionError {
    #[error("{0:?} is neither `connect-failure`, `none` nor an HTTP status 400-599")]
    Invalid(String),
    #[error("status {0} is decided by the adapter already (conflict or permanent), it cannot mean \"not executed\"")]
    Decided(u16),
}

impl std::str::FromStr for NonExecution {
    type Err = NonExecutionError;

    /// A comma-separated list of `connect-failure` and statuses; `none` (or empty) proves nothing.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut rule = NonExecution { connect_failure: false, statuses: Vec::new() };
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            match item {
                "none" => {}
                "connect-failure" => rule.connect_failure = true,
                status => {
                    let code: u16 = status.parse().map_err(|_| NonExecutionError::Invalid(status.to_owned()))?;
                    if !(400..=599).contains(&code) {
                        return Err(NonExecutionError::Invalid(status.to_owned()));
                    }
                    if DECIDED_STATUSES.contains(&code) {
                        return Err(NonExecutionError::Decided(code));
                    }
                    if !rule.statuses.contains(&code) {
                        rule.statuses.push(code);
                    }
                }
            }
        }
        Ok(rule)
    }
}

impl std::fmt::Display for NonExecution {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut items: Vec<String> = Vec::new();
        if self.connect_failure {
            items.push("connect-failure".into());
        }
        items.extend(self.statuses.iter().map(u16::to_string));
        if items.is_empty() { f.write_str("none") } else { f.write_str(&items.join(",")) }
    }
}

/// An adapter: one destination API shape. It classifies, it never decides or retries.
pub trait RemoteCrm: std::fmt::Debug + Send + Sync {
    /// What this destination can prove with (drives the decision table).
    fn capability(&self) -> Capability;

    /// The destination account: every decision's evidence names it, and a dispatcher only works
    /// its own account's rows (a lookup in another account would "prove" absence wrongly).
    fn account(&self) -> &str;

    /// One create attempt for `task`, carrying its operation key the way the destination
    /// deduplicates (idempotency key, external id, unique property).
    fn create<'a>(&'a self, task: &'a RemoteTask<'a>) -> BoxFuture<'a, CreateOutcome>;

    /// Looks the task of `operation_key` up by whatever this destination can prove with.
    fn readback<'a>(&'a self, operation_key: &'a str, traceparent: Option<TraceParent>) -> BoxFuture<'a, Readback>;
}

/// The adapters, by the API shape they speak (`--crm-adapter`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Adapter {
    /// The `/v1/tasks` contract of `crm-sim` (README there): idempotency keys, unique external ids
    /// and a search; which of them the destination guarantees is `--crm-capability`.
    TasksApi,
    /// Upsert by external id (Salesforce-shaped `PATCH .../sobjects/<Object>/<Field>/<key>`):
    /// readback by external id is authoritative.
    Upsert,
    /// Create with a unique property (HubSpot-shaped `POST /crm/v3/objects/<type>`, 409 on a
    /// repeat) and an eventually consistent search for readback.
    UniqueProperty,
}

impl Adapter {
    /// The record mapping this adapter uses when none is configured.
    pub fn default_mapping(self) -> RecordMapping {
        let (object, key_field, hash_field) = match self {
            Adapter::TasksApi => ("tasks", "external_id", "payload_hash"),
            Adapter::Upsert => ("Task", "Handoff_Key__c", "Handoff_Payload_Hash__c"),
            Adapter::UniqueProperty => ("tasks", "handoff_key", "handoff_hash"),
        };
        RecordMapping {
            object: object.into(),
            key_field: key_field.into(),
            hash_field: hash_field.into(),
            fields: Vec::new(),
        }
    }
}

/// How an approved payload becomes a destination record (the adapters with records: `upsert`,
/// `unique-property`). The key field carries the operation key, the hash field the payload hash
/// (how a readback tells our record from another's); the other fields come from the payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordMapping {
    /// The object (record type), e.g. `Task`.
    pub object: String,
    /// The external id field or unique property holding the operation key.
    pub key_field: String,
    /// The field holding the payload hash.
    pub hash_field: String,
    /// `(record field, payload field)` pairs; empty: the payload's top-level fields as they are.
    pub fields: Vec<(String, String)>,
}

/// A payload the mapping cannot turn into a record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MappingError {
    #[error("the payload is not a JSON object")]
    NotAnObject,
    #[error("the payload has no field {0:?} (mapped to {1:?})")]
    Missing(String, String),
    #[error("the payload sets {0:?}, which the mapping reserves for the operation key or the hash")]
    Reserved(String),
}

impl RecordMapping {
    /// Parses `--crm-field-map`: comma-separated `RecordField=payload_field` pairs (empty: none).
    pub fn parse_fields(text: &str) -> Result<Vec<(String, String)>, String> {
        text.split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|pair| match pair.split_once('=') {
                Some((field, from)) if !field.trim().is_empty() && !from.trim().is_empty() => {
                    Ok((field.trim().to_owned(), from.trim().to_owned()))
                }
                _ => Err(format!("{pair:?} is not RecordField=payload_field")),
            })
            .collect()
    }

    /// The record's fields for `payload`, without the key and hash fields (the adapter adds them
    /// where its API wants them).
    pub fn fields_of(
        &self,
        payload: &serde_json::Value,
    ) -> Result<serde_json::Map<String, serde_json::Value>, MappingError> {
        let object = payload.as_object().ok_or(MappingError::NotAnObject)?;
        let record: serde_json::Map<String, serde_json::Value> = if self.fields.is_empty() {
            object.clone()
        } else {
            self.fields
                .iter()
                .map(|(field, from)| {
                    object
                        .get(from)
                        .map(|value| (field.clone(), value.clone()))
                        .ok_or_else(|| MappingError::Missing(from.clone(), field.clone()))
                })
                .collect::<Result<_, _>>()?
        };
        if let Some(reserved) = [&self.key_field, &self.hash_field].into_iter().find(|f| record.contains_key(*f)) {
            return Err(MappingError::Reserved(reserved.clone()));
        }
        Ok(record)
    }
}

/// What every HTTP adapter needs.
#[derive(Clone)]
pub struct HttpSettings {
    /// Base URL, e.g. `https://crm.example.com`.
    pub base_url: String,
    /// Bearer token (secret; never logged).
    pub token: String,
    /// The destination account, recorded with every decision as evidence.
    pub account: String,
    /// Whole-request timeout; past it the outcome is unknown.
    pub timeout: Duration,
    /// Connect timeout; a connection never made proves nothing was sent.
    pub connect_timeout: Duration,
    /// Which answers prove a create was not executed.
    pub not_executed: NonExecution,
}

impl std::fmt::Debug for HttpSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpSettings")
            .field("base_url", &handoff_shared::config::redact_url(&self.base_url))
            .field("token", &"<redacted>")
            .field("account", &self.account)
            .field("timeout", &self.timeout)
            .field("not_executed", &self.not_executed.to_string())
            .finish()
    }
}

impl HttpSettings {
    /// The HTTP client every adapter uses (one connection pool for all of a replica's calls).
    pub fn client(&self) -> anyhow::Result<reqwest::Client> {
        Ok(reqwest::Client::builder().timeout(self.timeout).connect_timeout(self.connect_timeout).build()?)
    }

    /// `path` under the base URL.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base_url.trim_end_matches('/'))
    }
}

/// The adapter `adapter`, connected with `settings`. `capability` is what the destination
/// guarantees: declared for `tasks-api`, the adapter's own for the others (see
/// `config::CrmArgs::capability`); `mapping` is used by the adapters with records.
pub fn connect(
    adapter: Adapter,
    settings: HttpSettings,
    capability: Capability,
    mapping: RecordMapping,
) -> anyhow::Result<Arc<dyn RemoteCrm>> {
    Ok(match adapter {
        Adapter::TasksApi => Arc::new(tasks_api::TasksApi::new(settings, capability)?),
        Adapter::Upsert => Arc::new(upsert::Upsert::new(settings, mapping)?),
        Adapter::UniqueProperty => Arc::new(unique_property::UniqueProperty::new(settings, capability, mapping)?),
    })
}

/// `value` as one URL path segment (operation keys hold `:`; anything else is escaped).
pub fn path_segment(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~:".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// The outcome of a create that got no usable answer, by the destination's rule: a connection
/// never made is proof nothing was sent when the rule says so.
pub fn transport_failure(error: &reqwest::Error, rule: &NonExecution, call: &str) -> CreateOutcome {
    if error.is_connect() && rule.connect_failure {
        CreateOutcome::NotExecuted {
            retry_after: None,
            evidence: format!("{call}: connection failed before sending: {}", describe(error)),
        }
    } else {
        CreateOutcome::Unknown { retry_after: None, evidence: format!("{call}: no response: {}", describe(error)) }
    }
}

/// The outcome of a create answered with a status the adapter does not decide itself (429, 5xx,
/// anything unexpected): not executed if the destination's rule says so, unknown otherwise. Either
/// way the destination's `Retry-After` is honoured.
pub fn undecided_status(response: &reqwest::Response, rule: &NonExecution, evidence: String) -> CreateOutcome {
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| parse_retry_after(v, std::time::SystemTime::now()));
    if rule.statuses.contains(&response.status().as_u16()) {
        CreateOutcome::NotExecuted { retry_after, evidence }
    } else {
        CreateOutcome::Unknown { retry_after, evidence }
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

    #[test]
    fn non_execution_rules_parse_and_refuse_what_cannot_mean_not_executed() {
        assert_eq!("".parse::<NonExecution>().unwrap(), NonExecution { connect_failure: false, statuses: vec![] });
        assert_eq!("none".parse::<NonExecution>().unwrap().to_string(), "none");
        let rule: NonExecution = "connect-failure, 429,503,429".parse().unwrap();
        assert_eq!(rule, NonExecution { connect_failure: true, statuses: vec![429, 503] });
        assert_eq!(rule.to_string(), "connect-failure,429,503");
        assert_eq!(NonExecution::default().to_string(), "connect-failure");
        assert_eq!("409".parse::<NonExecution>(), Err(NonExecutionError::Decided(409)));
        assert_eq!("200".parse::<NonExecution>(), Err(NonExecutionError::Invalid("200".into())));
        assert_eq!("refused".parse::<NonExecution>(), Err(NonExecutionError::Invalid("refused".into())));
    }

    #[test]
    fn ledger_states_round_trip_through_their_names() {
        for state in LedgerState::ALL {
            assert_eq!(state.as_str().parse::<LedgerState>(), Ok(state));
        }
        assert!("settle".parse::<LedgerState>().is_err(), "a typo is an error, not a readback");
    }

    #[test]
    fn a_record_mapping_takes_the_mapped_fields_and_refuses_what_it_cannot_map() {
        let payload = serde_json::json!({"title": "Call", "notes": "about the repair", "case_id": "case-104"});
        let mut mapping = Adapter::Upsert.default_mapping();
        assert_eq!(mapping.fields_of(&payload).unwrap().len(), 3, "no map: the payload's fields as they are");
        mapping.fields = RecordMapping::parse_fields(" Subject=title, Description=notes ").unwrap();
        let record = mapping.fields_of(&payload).unwrap();
        assert_eq!(
            serde_json::Value::Object(record),
            serde_json::json!({"Subject": "Call", "Description": "about the repair"})
        );
        mapping.fields.push(("WhatId".into(), "account".into()));
        assert_eq!(mapping.fields_of(&payload), Err(MappingError::Missing("account".into(), "WhatId".into())));
        let unmapped = Adapter::UniqueProperty.default_mapping();
        assert_eq!(
            unmapped.fields_of(&serde_json::json!({"handoff_key": "x", "title": "Call"})),
            Err(MappingError::Reserved("handoff_key".into()))
        );
        assert_eq!(unmapped.fields_of(&serde_json::json!([1])), Err(MappingError::NotAnObject));
        assert!(RecordMapping::parse_fields("Subject").is_err());
        assert!(RecordMapping::parse_fields("=title").is_err());
        assert_eq!(RecordMapping::parse_fields("").unwrap(), vec![]);
    }

    #[test]
    fn keys_are_one_path_segment() {
        assert_eq!(path_segment("harbor:create-followup:v1:case-104"), "harbor:create-followup:v1:case-104");
        assert_eq!(path_segment("a/b c?"), "a%2Fb%20c%3F");
    }
}
