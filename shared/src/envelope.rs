//! The message envelope: one approved action as a CloudEvents 1.0 event in structured JSON mode.
//!
//! ```json
//! {"specversion":"1.0","id":"harbor:create-followup:v1:case-104","type":"harbor.create-followup.v1",
//!  "source":"/handoff/relay","time":"2026-11-29T10:00:00Z","datacontenttype":"application/json",
//!  "handoffhash":"<sha256 of canonical data>","handoffapprovedby":"u-17",
//!  "handoffapprovedat":"2026-11-29T09:59:00Z","handoffschema":1,"data":{...}}
//! ```
//!
//! `data` is the approved value as stored: the relay writes the outbox's jsonb text without its
//! whitespace ([`OutgoingEnvelope`]), so numbers keep their digits; the hash covers the RFC 8785
//! form of the same value, which the consumer recomputes.
//!
//! `id` is the operation key (CloudEvents consumers de-duplicate on `source` + `id`), `type` is the
//! action with its version, and the `handoff*` extension attributes carry the payload hash and the
//! approval so the consumer can verify the payload is exactly what a person approved;
//! `handoffkeyid` and `handoffsig` sign every other attribute (see [`crate::signing`]), so only a
//! holder of a signing key can publish an action the consumer accepts. A producer's
//! W3C trace context travels as the distributed-tracing extension (`traceparent`). Any CloudEvents
//! SDK can read the stream.

use bytes::Bytes;
use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::json_string::write_json_string;
use crate::key::MAX_EVENT_TYPE_LEN;
use crate::payload::PayloadText;
use crate::signing::{SignatureError, SignaturePolicy, Signed, SignedFields, SigningKey};
use crate::timestamp::TimestampText;
use crate::{CanonicalPayload, KeyError, OperationKey, PayloadError, PayloadHash, TraceParent};

/// The newest envelope version this build writes and reads, in the `handoffschema` attribute. Bump
/// on an incompatible change; a consumer holds (never dead-letters) a newer version it cannot read,
/// so relays and consumers can be upgraded in either order.
pub const SCHEMA_VERSION: u32 = 1;
/// The oldest envelope version this build still reads.
pub const OLDEST_SCHEMA_VERSION: u32 = 1;
/// Longest approver id accepted.
pub const MAX_APPROVER_LEN: usize = 200;

/// Who approved the action and when. `approved_by` is an internal user id; like every envelope
/// field except the key it is never logged.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Approval {
    approved_by: String,
    approved_at: DateTime<Utc>,
}

/// Why an approval record is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApprovalError {
    /// An action nobody approved must not be sent.
    #[error("approved_by must be 1-{MAX_APPROVER_LEN} characters without control characters")]
    BadApprover,
}

impl Approval {
    /// Validates the approver id (trimmed, non-empty, bounded, printable).
    pub fn new(approved_by: &str, approved_at: DateTime<Utc>) -> Result<Self, ApprovalError> {
        let approved_by = approved_by.trim();
        if approved_by.is_empty()
            || approved_by.chars().count() > MAX_APPROVER_LEN
            || approved_by.chars().any(char::is_control)
        {
            return Err(ApprovalError::BadApprover);
        }
        Ok(Self { approved_by: approved_by.to_owned(), approved_at })
    }

    /// The approver's id.
    pub fn approved_by(&self) -> &str {
        &self.approved_by
    }

    /// When the approval was given.
    pub fn approved_at(&self) -> DateTime<Utc> {
        self.approved_at
    }
}

impl std::fmt::Debug for Approval {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Approval").field("approved_at", &self.approved_at).finish_non_exhaustive()
    }
}

/// One approved action on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    pub key: OperationKey,
    pub payload: CanonicalPayload,
    pub approval: Approval,
    /// CloudEvents `source`: which relay deployment published it.
    pub source: String,
    /// CloudEvents `time`: when the action was recorded by the producer.
    pub time: DateTime<Utc>,
    /// The producer's W3C trace context (CloudEvents distributed-tracing extension), if it gave one.
    pub traceparent: Option<TraceParent>,
}

/// Why a message is not a valid envelope. Every variant is permanent: redelivering the same bytes
/// cannot fix it, so the consumer dead-letters the message with this reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    #[error("message body is not a CloudEvents JSON object: {0}")]
    NotCloudEvent(String),
    #[error("unsupported CloudEvents specversion {0:?}")]
    SpecVersion(String),
    #[error("unsupported handoff schema version {0}")]
    SchemaVersion(u32),
    /// Written by a newer relay than this consumer: not a bad message, a consumer not upgraded yet.
    /// The consumer holds it (a long nak) instead of dead-lettering it.
    #[error("handoff schema version {found} is newer than this consumer reads ({newest}); held until it is upgraded")]
    NewerVersion { found: u32, newest: u32 },
    #[error("event id is not an operation key: {0}")]
    BadKey(#[from] KeyError),
    #[error("event type {found:?} does not match the key (expected {expected:?})")]
    TypeMismatch { expected: String, found: String },
    #[error("message has no {0} header")]
    MissingHeader(&'static str),
    /// The broker de-duplicated on a different identity than the envelope claims: forged or buggy.
    #[error("Nats-Msg-Id header does not equal the event id")]
    KeyHeaderMismatch,
    #[error("event data is not an approvable payload: {0}")]
    BadPayload(#[from] PayloadError),
    #[error("handoffhash is not a sha256 hex digest")]
    BadHash,
    /// The payload is not the one that was approved.
    #[error("payload hash mismatch: event declares {declared}, data hashes to {computed}")]
    HashMismatch { declared: PayloadHash, computed: PayloadHash },
    #[error("approval is invalid: {0}")]
    BadApproval(#[from] ApprovalError),
    #[error(transparent)]
    Signature(#[from] SignatureError),
}

/// An envelope as read off the wire ([`CloudEventHead`] writes one).
#[derive(Deserialize)]
struct CloudEvent {
    specversion: String,
    id: String,
    source: String,
    #[serde(rename = "type")]
    kind: String,
    time: DateTime<Utc>,
    datacontenttype: String,
    handoffhash: String,
    handoffapprovedby: String,
    handoffapprovedat: DateTime<Utc>,
    handoffschema: u32,
    /// CloudEvents distributed-tracing extension.
    #[serde(default)]
    traceparent: Option<String>,
    /// The id of the key that signed the other attributes.
    #[serde(default)]
    handoffkeyid: Option<String>,
    /// HMAC-SHA256 of the other attributes, hex.
    #[serde(default)]
    handoffsig: Option<String>,
    data: Value,
}

/// Room for an envelope's attributes besides its data: a signed one with a trace context is about
/// 500 bytes, so the body is written without growing its buffer.
const ENVELOPE_HEAD_BYTES: usize = 640;

/// An envelope's attributes as written, in [`CloudEvent`]'s order, borrowed (from what is being
/// written without copying its strings, or from a [`CloudEvent`] read). `data` follows them as the
/// last member, written by [`write_body`] ([`CloudEventHead::write`]; serde's derive is the tests'
/// oracle for it).
#[cfg_attr(test, derive(Serialize))]
struct CloudEventHead<'a> {
    specversion: &'a str,
    id: &'a str,
    source: &'a str,
    #[cfg_attr(test, serde(rename = "type"))]
    kind: &'a str,
    /// Formatted once ([`signed_time`], which is how chrono serializes a timestamp): the same text
    /// goes on the wire and into the signature.
    time: &'a str,
    datacontenttype: &'a str,
    handoffhash: &'a str,
    handoffapprovedby: &'a str,
    handoffapprovedat: &'a str,
    handoffschema: u32,
    #[cfg_attr(test, serde(skip_serializing_if = "Option::is_none"))]
    traceparent: Option<&'a str>,
    #[cfg_attr(test, serde(skip_serializing_if = "Option::is_none"))]
    handoffkeyid: Option<&'a str>,
    #[cfg_attr(test, serde(skip_serializing_if = "Option::is_none"))]
    handoffsig: Option<&'a str>,
}

impl<'a> CloudEventHead<'a> {
    /// What a signature covers, formatted from the parsed values (so both ends agree whatever the
    /// JSON spelling of a timestamp).
    fn signed(&self) -> SignedFields<'a> {
        SignedFields {
            id: self.id,
            source: self.source,
            kind: self.kind,
            time: self.time,
            datacontenttype: self.datacontenttype,
            hash: self.handoffhash,
            approved_by: self.handoffapprovedby,
            approved_at: self.handoffapprovedat,
            schema: self.handoffschema,
            traceparent: self.traceparent,
        }
    }

    /// The attributes as a JSON object, members in declaration order, strings escaped as
    /// serde_json escapes them; what `serde_json::to_writer` writes for the derived `Serialize`
    /// (tested), without its per-member formatter calls.
    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(br#"{"specversion":"#);
        write_json_string(out, self.specversion);
        for (name, value) in [
            (&br#","id":"#[..], self.id),
            (br#","source":"#, self.source),
            (br#","type":"#, self.kind),
            (br#","time":"#, self.time),
            (br#","datacontenttype":"#, self.datacontenttype),
            (br#","handoffhash":"#, self.handoffhash),
            (br#","handoffapprovedby":"#, self.handoffapprovedby),
            (br#","handoffapprovedat":"#, self.handoffapprovedat),
        ] {
            out.extend_from_slice(name);
            write_json_string(out, value);
        }
        out.extend_from_slice(br#","handoffschema":"#);
        let mut digits = [0u8; 10];
        let mut first = digits.len();
        let mut schema = self.handoffschema;
        loop {
            first -= 1;
            digits[first] = b'0' + (schema % 10) as u8;
            schema /= 10;
            if schema == 0 {
                break;
            }
        }
        out.extend_from_slice(&digits[first..]);
        for (name, value) in [
            (&br#","traceparent":"#[..], self.traceparent),
            (br#","handoffkeyid":"#, self.handoffkeyid),
            (br#","handoffsig":"#, self.handoffsig),
        ] {
            if let Some(value) = value {
                out.extend_from_slice(name);
                write_json_string(out, value);
            }
        }
        out.push(b'}');
    }
}

impl CloudEvent {
    fn head<'a>(&'a self, time: &'a str, approved_at: &'a str) -> CloudEventHead<'a> {
        CloudEventHead {
            specversion: &self.specversion,
            id: &self.id,
            source: &self.source,
            kind: &self.kind,
            time,
            datacontenttype: &self.datacontenttype,
            handoffhash: &self.handoffhash,
            handoffapprovedby: &self.handoffapprovedby,
            handoffapprovedat: approved_at,
            handoffschema: self.handoffschema,
            traceparent: self.traceparent.as_deref(),
            handoffkeyid: self.handoffkeyid.as_deref(),
            handoffsig: self.handoffsig.as_deref(),
        }
    }

    fn check_signature(&self, policy: &SignaturePolicy) -> Result<Signed, SignatureError> {
        let (time, approved_at) = (signed_time(self.time), signed_time(self.handoffapprovedat));
        let head = self.head(time.as_str(), approved_at.as_str());
        policy.check(&head.signed(), head.handoffkeyid, head.handoffsig)
    }
}

/// How chrono serializes a timestamp (RFC 3339, as many fraction digits as needed, `Z`).
fn signed_time(time: DateTime<Utc>) -> TimestampText {
    TimestampText::new(time)
}

/// The CloudEvents `type` for a key: `namespace.action.vN`.
pub fn event_type(key: &OperationKey) -> String {
    key.write_event_type(&mut [0; MAX_EVENT_TYPE_LEN]).to_owned()
}

/// An envelope's `data`: a parsed value, or JSON text written as it is.
enum Data<'a> {
    /// With the length of its canonical form, about what it takes written.
    Value(&'a Value, usize),
    Text(&'a [u8]),
}

/// What every envelope body is written from.
struct Attributes<'a> {
    key: &'a OperationKey,
    hash: PayloadHash,
    approval: &'a Approval,
    source: &'a str,
    time: DateTime<Utc>,
    traceparent: Option<TraceParent>,
}

/// The message body (structured-mode CloudEvents JSON) in envelope version `version`, signed with
/// `signing` (unsigned without one).
fn write_body(attributes: &Attributes<'_>, data: Data<'_>, version: u32, signing: Option<&SigningKey>) -> Bytes {
    let mut hash = [0u8; 64];
    let hash = attributes.hash.write_hex(&mut hash);
    let mut kind = [0; MAX_EVENT_TYPE_LEN];
    let kind = attributes.key.write_event_type(&mut kind);
    let traceparent = attributes.traceparent.map(|tp| tp.to_string());
    let (time, approved_at) = (signed_time(attributes.time), signed_time(attributes.approval.approved_at()));
    let mut head = CloudEventHead {
        specversion: "1.0",
        id: attributes.key.as_str(),
        source: attributes.source,
        kind,
        time: time.as_str(),
        datacontenttype: "application/json",
        handoffhash: hash,
        handoffapprovedby: attributes.approval.approved_by(),
        handoffapprovedat: approved_at.as_str(),
        handoffschema: version,
        traceparent: traceparent.as_deref(),
        handoffkeyid: None,
        handoffsig: None,
    };
    let mut signature = [0; 64];
    if let Some(key) = signing {
        head.handoffsig = Some(key.sign_into(&head.signed(), &mut signature));
        head.handoffkeyid = Some(key.id().as_str());
    }
    let data_len = match data {
        Data::Value(_, size) => size,
        Data::Text(text) => text.len(),
    };
    let mut body = Vec::with_capacity(ENVELOPE_HEAD_BYTES + data_len);
    head.write(&mut body);
    // The head is an object of at least one member: reopen it for `data`.
    body.pop();
    body.extend_from_slice(br#","data":"#);
    match data {
        // The JSON value as approved, not its canonical form: RFC 8785 writes every number as a
        // double, so an integer beyond 2^53 would arrive rounded.
        Data::Value(value, _) => serde_json::to_writer(&mut body, value).expect("a JSON value serializes"),
        Data::Text(text) => body.extend_from_slice(text),
    }
    body.push(b'}');
    Bytes::from(body)
}

/// An envelope to write whose payload is JSON text ([`PayloadText`]), everything borrowed: what
/// the relay writes for each outbox row. The body is the one [`Envelope::encode_signed`] writes
/// for the same value, with `data` as the stored text (without insignificant whitespace).
#[derive(Debug, Clone, Copy)]
pub struct OutgoingEnvelope<'a> {
    pub key: &'a OperationKey,
    pub payload: &'a PayloadText,
    pub approval: &'a Approval,
    /// CloudEvents `source`: which relay deployment publishes it.
    pub source: &'a str,
    /// CloudEvents `time`: when the action was recorded by the producer.
    pub time: DateTime<Utc>,
    pub traceparent: Option<TraceParent>,
}

impl OutgoingEnvelope<'_> {
    /// The message body in envelope version `version`, signed with `key` (unsigned without one).
    pub fn encode_signed(&self, version: u32, key: Option<&SigningKey>) -> Bytes {
        let attributes = Attributes {
            key: self.key,
            hash: self.payload.hash(),
            approval: self.approval,
            source: self.source,
            time: self.time,
            traceparent: self.traceparent,
        };
        write_body(&attributes, Data::Text(self.payload.compact()), version, key)
    }
}

impl Envelope {
    /// The message body (structured-mode CloudEvents JSON), in this build's newest version.
    pub fn encode(&self) -> Bytes {
        self.encode_as(SCHEMA_VERSION)
    }

    /// The message body in envelope version `version` (a relay told to write an older version
    /// while consumers are upgraded after it), unsigned.
    pub fn encode_as(&self, version: u32) -> Bytes {
        self.encode_signed(version, None)
    }

    /// The message body in envelope version `version`, signed with `key` (unsigned without one).
    pub fn encode_signed(&self, version: u32, key: Option<&SigningKey>) -> Bytes {
        let attributes = Attributes {
            key: &self.key,
            hash: self.payload.hash(),
            approval: &self.approval,
            source: &self.source,
            time: self.time,
            traceparent: self.traceparent,
        };
        write_body(&attributes, Data::Value(self.payload.value(), self.payload.canonical_bytes().len()), version, key)
    }

    /// Parses and checks a message as [`Envelope::open`] does, **without checking its signature**:
    /// for tools that read the stream (the consumer opens messages with its signature policy).
    pub fn decode(body: &[u8], msg_id: Option<&str>) -> Result<Self, EnvelopeError> {
        Self::decode_up_to(body, msg_id, SCHEMA_VERSION)
    }

    /// [`Envelope::decode`] for a reader of versions up to `newest`.
    pub fn decode_up_to(body: &[u8], msg_id: Option<&str>, newest: u32) -> Result<Self, EnvelopeError> {
        Self::open(body, msg_id, newest, &SignaturePolicy::unchecked()).map(|(envelope, _)| envelope)
    }

    /// Parses and verifies a message for a reader of envelope versions up to `newest`: body shape
    /// and version, then the signature under `policy` before anything else is trusted, then the
    /// key, `Nats-Msg-Id` (`msg_id`) equal to the key, the type, and the payload hash recomputed
    /// from the data. A newer version is [`EnvelopeError::NewerVersion`] (every version up to
    /// `newest` has this version's fields: a version adds attributes, it does not change these).
    pub fn open(
        body: &[u8],
        msg_id: Option<&str>,
        newest: u32,
        policy: &SignaturePolicy,
    ) -> Result<(Self, Signed), EnvelopeError> {
        let event: CloudEvent =
            serde_json::from_slice(body).map_err(|e| EnvelopeError::NotCloudEvent(e.to_string()))?;
        if event.specversion != "1.0" {
            return Err(EnvelopeError::SpecVersion(event.specversion));
        }
        if event.handoffschema > newest {
            return Err(EnvelopeError::NewerVersion { found: event.handoffschema, newest });
        }
        if event.handoffschema < OLDEST_SCHEMA_VERSION {
            return Err(EnvelopeError::SchemaVersion(event.handoffschema));
        }
        let signed = event.check_signature(policy)?;
        let key: OperationKey = event.id.parse()?;
        let msg_id = msg_id.ok_or(EnvelopeError::MissingHeader(crate::headers::MSG_ID))?;
        if msg_id != key.as_str() {
            return Err(EnvelopeError::KeyHeaderMismatch);
        }
        let expected = event_type(&key);
        if event.kind != expected {
            return Err(EnvelopeError::TypeMismatch { expected, found: event.kind });
        }
        let declared: PayloadHash = event.handoffhash.parse().map_err(|_| EnvelopeError::BadHash)?;
        let payload = CanonicalPayload::new(event.data)?;
        let computed = payload.hash();
        if computed != declared {
            return Err(EnvelopeError::HashMismatch { declared, computed });
        }
        let approval = Approval::new(&event.handoffapprovedby, event.handoffapprovedat)?;
        // Diagnostic only: a malformed trace context is dropped, never a reason to refuse the action.
        let traceparent = event.traceparent.and_then(|tp| tp.parse().ok());
        Ok((Self { key, payload, approval, source: event.source, time: event.time, traceparent }, signed))
    }
}

/// RFC 3339 with millisecond precision, as used in reports.
pub fn rfc3339(time: DateTime<Utc>) -> String {
    time.to_rfc3339_opts(SecondsFormat::Millis, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Envelope {
        let at = DateTime::parse_from_rfc3339("2026-11-29T10:00:00Z").unwrap().with_timezone(&Utc);
        Envelope {
            key: "harbor:create-followup:v1:case-104".parse().unwrap(),
            payload: CanonicalPayload::from_json(br#"{"case_id":"case-104","title":"Call"}"#).unwrap(),
            approval: Approval::new("u-17", at).unwrap(),
            source: "/handoff/test".into(),
            time: at,
            traceparent: None,
        }
    }

    #[test]
    fn carries_the_trace_context_as_the_cloudevents_extension_and_drops_a_malformed_one() {
        let mut env = sample();
        env.traceparent = Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".parse().unwrap());
        let body = env.encode();
        let mut json: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["traceparent"], "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        assert_eq!(Envelope::decode(&body, Some(env.key.as_str())).unwrap(), env);
        json["traceparent"] = "garbage".into();
        let decoded = Envelope::decode(&serde_json::to_vec(&json).unwrap(), Some(env.key.as_str())).unwrap();
        assert_eq!(decoded.traceparent, None, "the action stands; only the trace is lost");
        assert!(!String::from_utf8_lossy(&sample().encode()).contains("traceparent"), "absent when not given");
    }

    #[test]
    fn data_arrives_as_approved_and_signed_envelopes_open() {
        let mut env = sample();
        // Canonical form rounds integers beyond 2^53 (RFC 8785 numbers are doubles); the consumer
        // must still get the value that was approved, and a float stays a float.
        env.payload =
            CanonicalPayload::from_json(br#"{ "title": "Call", "account": 12345678901234567891, "n": 1.0 }"#).unwrap();
        let key = SigningKey::new(crate::signing::KeyId::new("k1").unwrap(), vec![7; 32]).unwrap();
        let body = env.encode_signed(SCHEMA_VERSION, Some(&key));
        let json: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["data"]["account"].as_u64(), Some(12_345_678_901_234_567_891));
        assert_eq!(json["data"]["n"].as_f64(), Some(1.0));
        assert_eq!(json["handoffkeyid"], "k1");
        let policy = SignaturePolicy::new(vec![key], false).unwrap();
        assert_eq!(Envelope::open(&body, Some(env.key.as_str()), SCHEMA_VERSION, &policy).unwrap().0, env);
    }

    #[test]
    fn an_envelope_written_from_payload_text_is_the_one_written_from_the_value() {
        let mut env = sample();
        env.traceparent = Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".parse().unwrap());
        env.payload =
            CanonicalPayload::from_json(br#"{"title":"Call","account":12345678901234567891,"n":1.0}"#).unwrap();
        let key = SigningKey::new(crate::signing::KeyId::new("k1").unwrap(), vec![7; 32]).unwrap();
        fn outgoing<'a>(env: &'a Envelope, text: &'a PayloadText) -> OutgoingEnvelope<'a> {
            OutgoingEnvelope {
                key: &env.key,
                payload: text,
                approval: &env.approval,
                source: &env.source,
                time: env.time,
                traceparent: env.traceparent,
            }
        }
        // Text in serde_json's own member order: the same bytes, signed or not.
        let compact = PayloadText::from_json(&serde_json::to_string(env.payload.value()).unwrap()).unwrap();
        for signing in [None, Some(&key)] {
            assert_eq!(
                outgoing(&env, &compact).encode_signed(SCHEMA_VERSION, signing),
                env.encode_signed(SCHEMA_VERSION, signing)
            );
        }
        // Text as Postgres writes jsonb (its own order, spaces): the same envelope opens.
        let stored = PayloadText::from_json(r#"{"n": 1.0, "title": "Call", "account": 12345678901234567891}"#).unwrap();
        let body = outgoing(&env, &stored).encode_signed(SCHEMA_VERSION, Some(&key));
        assert!(
            std::str::from_utf8(&body)
                .unwrap()
                .ends_with(r#","data":{"n":1.0,"title":"Call","account":12345678901234567891}}"#)
        );
        let policy = SignaturePolicy::new(vec![key], false).unwrap();
        assert_eq!(Envelope::open(&body, Some(env.key.as_str()), SCHEMA_VERSION, &policy).unwrap().0, env);
    }

    #[test]
    fn the_written_head_is_what_serde_json_writes_for_it() {
        // Seeded so a failure is repeatable; strings from a pool with every character class the
        // escaping treats differently.
        let mut state: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move |bound: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % bound as u64) as usize
        };
        let pieces = [
            "a", "Z9", "\"", "\\", "/", "\n", "\r", "\t", "\u{8}", "\u{c}", "\u{0}", "\u{1f}", "\u{7f}", "é", "€",
            "😀", " ", ":",
        ];
        let mut strings: Vec<String> = Vec::new();
        for _ in 0..11 * 2_000 {
            strings.push((0..next(6)).map(|_| pieces[next(pieces.len())]).collect());
        }
        let mut strings = strings.iter().map(String::as_str);
        let mut next_str = || strings.next().unwrap();
        for i in 0..2_000 {
            let mut optional = || if next(2) == 0 { None } else { Some(next_str()) };
            let (traceparent, keyid, sig) = (optional(), optional(), optional());
            let head = CloudEventHead {
                specversion: next_str(),
                id: next_str(),
                source: next_str(),
                kind: next_str(),
                time: next_str(),
                datacontenttype: next_str(),
                handoffhash: next_str(),
                handoffapprovedby: next_str(),
                handoffapprovedat: next_str(),
                handoffschema: [0, 1, 2, 9, 10, 99, 12_345, u32::MAX][i % 8],
                traceparent,
                handoffkeyid: keyid,
                handoffsig: sig,
            };
            let mut written = Vec::new();
            head.write(&mut written);
            let expected = serde_json::to_vec(&head).unwrap();
            assert_eq!(String::from_utf8(written).unwrap(), String::from_utf8(expected).unwrap());
        }
    }

    #[test]
    fn round_trips_and_reads_as_a_cloudevent() {
        let env = sample();
        let body = env.encode();
        let json: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["specversion"], "1.0");
        assert_eq!(json["id"], "harbor:create-followup:v1:case-104");
        assert_eq!(json["type"], "harbor.create-followup.v1");
        assert_eq!(json["handoffhash"], env.payload.hash().to_string());
        assert_eq!(Envelope::decode(&body, Some(env.key.as_str())).unwrap(), env);
    }

    #[test]
    fn rejects_a_tampered_payload_with_a_hash_mismatch() {
        let body = sample().encode();
        let mut json: Value = serde_json::from_slice(&body).unwrap();
        json["data"]["title"] = "Call someone else".into();
        let err = Envelope::decode(&serde_json::to_vec(&json).unwrap(), Some("harbor:create-followup:v1:case-104"));
        assert!(matches!(err, Err(EnvelopeError::HashMismatch { .. })), "{err:?}");
    }

    #[test]
    fn rejects_a_message_id_that_is_not_the_key() {
        let body = sample().encode();
        assert_eq!(
            Envelope::decode(&body, Some("harbor:create-followup:v1:case-105")),
            Err(EnvelopeError::KeyHeaderMismatch)
        );
        assert_eq!(Envelope::decode(&body, None), Err(EnvelopeError::MissingHeader("Nats-Msg-Id")));
    }

    #[test]
    fn rejects_garbage_and_foreign_events() {
        assert!(matches!(Envelope::decode(b"not json", Some("x")), Err(EnvelopeError::NotCloudEvent(_))));
        let mut json: Value = serde_json::from_slice(&sample().encode()).unwrap();
        json["type"] = "harbor.delete-everything.v1".into();
        assert!(matches!(
            Envelope::decode(&serde_json::to_vec(&json).unwrap(), Some("harbor:create-followup:v1:case-104")),
            Err(EnvelopeError::TypeMismatch { .. })
        ));
    }

    #[test]
    fn a_newer_version_is_told_apart_from_a_bad_one() {
        let mut json: Value = serde_json::from_slice(&sample().encode()).unwrap();
        json["handoffschema"] = (SCHEMA_VERSION + 1).into();
        let body = serde_json::to_vec(&json).unwrap();
        let key = Some("harbor:create-followup:v1:case-104");
        assert_eq!(
            Envelope::decode(&body, key),
            Err(EnvelopeError::NewerVersion { found: SCHEMA_VERSION + 1, newest: SCHEMA_VERSION })
        );
        assert!(Envelope::decode_up_to(&body, key, SCHEMA_VERSION + 1).is_ok(), "an upgraded reader reads it");
        json["handoffschema"] = 0.into();
        let body = serde_json::to_vec(&json).unwrap();
        assert_eq!(Envelope::decode(&body, key), Err(EnvelopeError::SchemaVersion(0)));
    }

    #[test]
    fn a_signed_envelope_opens_with_its_key_and_any_change_is_refused() {
        use crate::signing::KeyId;
        let key = SigningKey::generate(Some(KeyId::new("k1").unwrap())).unwrap();
        let policy = SignaturePolicy::new([key.clone()], false).unwrap();
        let msg_id = Some("harbor:create-followup:v1:case-104");
        let mut env = sample();
        env.time += chrono::Duration::nanoseconds(123_456_789);
        let body = env.encode_signed(SCHEMA_VERSION, Some(&key));
        let (opened, signed) = Envelope::open(&body, msg_id, SCHEMA_VERSION, &policy).unwrap();
        assert_eq!((opened, signed), (env.clone(), Signed::By(key.id().clone())));
        let json: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["handoffkeyid"], "k1");
        for (attribute, value) in [
            ("handoffapprovedby", Value::from("u-18")),
            ("source", "/elsewhere".into()),
            ("time", "2026-11-29T10:00:01Z".into()),
            ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
        ] {
            let mut forged = json.clone();
            forged[attribute] = value;
            let error = Envelope::open(&serde_json::to_vec(&forged).unwrap(), msg_id, SCHEMA_VERSION, &policy);
            assert!(
                matches!(error, Err(EnvelopeError::Signature(SignatureError::BadSignature(_)))),
                "{attribute}: {error:?}"
            );
        }
        // A payload changed with its hash recomputed, as a forger who knows SHA-256 would.
        let mut forged = json.clone();
        forged["data"]["title"] = "Call someone else".into();
        let payload = CanonicalPayload::new(forged["data"].clone()).unwrap();
        forged["handoffhash"] = payload.hash().to_string().into();
        let error = Envelope::open(&serde_json::to_vec(&forged).unwrap(), msg_id, SCHEMA_VERSION, &policy);
        assert!(matches!(error, Err(EnvelopeError::Signature(SignatureError::BadSignature(_)))), "{error:?}");
        // Unsigned: refused by the policy, read by tools.
        let unsigned = env.encode();
        let error = Envelope::open(&unsigned, msg_id, SCHEMA_VERSION, &policy).unwrap_err();
        assert_eq!(error, EnvelopeError::Signature(SignatureError::Unsigned));
        assert!(Envelope::decode(&unsigned, msg_id).is_ok());
    }

    #[test]
    fn approval_needs_a_real_approver() {
        let now = Utc::now();
        assert!(Approval::new("  ", now).is_err());
        assert!(Approval::new("a\nb", now).is_err());
        assert!(Approval::new(&"a".repeat(MAX_APPROVER_LEN + 1), now).is_err());
        assert_eq!(Approval::new(" u-1 ", now).unwrap().approved_by(), "u-1");
    }
}
