//! The approved payload in canonical form, and the hash that binds an approval to it.
//!
//! Canonical form is RFC 8785 (JSON Canonicalization Scheme): object members sorted by UTF-16 code
//! units, no insignificant whitespace, numbers in ECMAScript shortest form. Two producers that send
//! the same JSON value in any formatting get the same bytes and so the same [`PayloadHash`]; the
//! fixed vectors in `shared/testdata/canonical-vectors.json` pin it, so a dependency upgrade cannot
//! silently change every hash in flight.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// Largest canonical payload accepted. An approved action is a small instruction, not a document;
/// the limit keeps one message well under NATS' default 1 MiB `max_payload` with headers.
pub const MAX_PAYLOAD_BYTES: usize = 64 * 1024;

/// Why a JSON value cannot be an approved payload.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    /// The text is not JSON at all.
    #[error("payload is not valid JSON: {0}")]
    NotJson(String),
    /// Payloads are objects so they can grow new fields without breaking consumers.
    #[error("payload must be a JSON object")]
    NotAnObject,
    /// An empty object approves nothing.
    #[error("payload must not be an empty object")]
    Empty,
    /// See [`MAX_PAYLOAD_BYTES`].
    #[error("payload is {0} bytes in canonical form; the limit is {MAX_PAYLOAD_BYTES}")]
    TooLarge(usize),
    /// A value JCS cannot represent (a non-finite number); unreachable from parsed JSON.
    #[error("payload cannot be canonicalized: {0}")]
    NotCanonicalizable(String),
}

/// A JSON object in RFC 8785 canonical form, at most [`MAX_PAYLOAD_BYTES`] long.
#[derive(Clone, PartialEq, Eq)]
pub struct CanonicalPayload {
    value: Value,
    canonical: Vec<u8>,
    /// SHA-256 of `canonical`, computed once: the relay checks it against the stored hash and
    /// writes it into the envelope, the consumer compares it with the declared one.
    hash: PayloadHash,
}

impl CanonicalPayload {
    /// Validates and canonicalizes a JSON value.
    pub fn new(value: Value) -> Result<Self, PayloadError> {
        match &value {
            Value::Object(map) if map.is_empty() => return Err(PayloadError::Empty),
            Value::Object(_) => {}
            _ => return Err(PayloadError::NotAnObject),
        }
        let canonical = serde_jcs::to_vec(&value).map_err(|e| PayloadError::NotCanonicalizable(e.to_string()))?;
        if canonical.len() > MAX_PAYLOAD_BYTES {
            return Err(PayloadError::TooLarge(canonical.len()));
        }
        let hash = PayloadHash(Sha256::digest(&canonical).into());
        Ok(Self { value, canonical, hash })
    }

    /// Parses JSON text and canonicalizes it.
    pub fn from_json(text: &[u8]) -> Result<Self, PayloadError> {
        let value = serde_json::from_slice(text).map_err(|e| PayloadError::NotJson(e.to_string()))?;
        Self::new(value)
    }

    /// The JSON value.
    pub fn value(&self) -> &Value {
        &self.value
    }

    /// The canonical bytes, the input of the hash.
    pub fn canonical_bytes(&self) -> &[u8] {
        &self.canonical
    }

    /// SHA-256 of the canonical bytes.
    pub fn hash(&self) -> PayloadHash {
        self.hash
    }
}

impl fmt::Debug for CanonicalPayload {
    // Payloads may hold personal data: Debug shows only size and hash, never the body.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CanonicalPayload").field("bytes", &self.canonical.len()).field("hash", &self.hash()).finish()
    }
}

/// SHA-256 of a [`CanonicalPayload`], written as 64 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct PayloadHash([u8; 32]);

/// Why text is not a payload hash.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("payload hash must be 64 lowercase hex digits")]
pub struct BadHash;

impl FromStr for PayloadHash {
    type Err = BadHash;
    fn from_str(s: &str) -> Result<Self, BadHash> {
        // Lowercase digits only: one spelling per hash, so stored and declared hashes compare as text.
        fn digit(b: u8) -> Result<u8, BadHash> {
            match b {
                b'0'..=b'9' => Ok(b - b'0'),
                b'a'..=b'f' => Ok(b - b'a' + 10),
                _ => Err(BadHash),
            }
        }
        let text = s.as_bytes();
        if text.len() != 64 {
            return Err(BadHash);
        }
        let mut bytes = [0u8; 32];
        for (byte, pair) in bytes.iter_mut().zip(text.chunks_exact(2)) {
            *byte = digit(pair[0])? << 4 | digit(pair[1])?;
        }
        Ok(Self(bytes))
    }
}

impl TryFrom<String> for PayloadHash {
    type Error = BadHash;
    fn try_from(value: String) -> Result<Self, BadHash> {
        value.parse()
    }
}

impl From<PayloadHash> for String {
    fn from(hash: PayloadHash) -> String {
        hash.to_string()
    }
}

impl fmt::Display for PayloadHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut text = [0u8; 64];
        hex::encode_to_slice(self.0, &mut text).expect("32 bytes are 64 hex digits");
        f.write_str(std::str::from_utf8(&text).expect("hex digits are ASCII"))
    }
}

impl fmt::Debug for PayloadHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PayloadHash({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct Vector {
        name: String,
        input: String,
        canonical: String,
        sha256: String,
    }

    #[test]
    fn fixed_vectors_pin_the_canonical_form_and_hash() {
        let vectors: Vec<Vector> = serde_json::from_str(include_str!("../testdata/canonical-vectors.json")).unwrap();
        assert!(vectors.len() >= 3);
        for v in vectors {
            let payload = CanonicalPayload::from_json(v.input.as_bytes()).unwrap();
            assert_eq!(std::str::from_utf8(payload.canonical_bytes()).unwrap(), v.canonical, "{}", v.name);
            assert_eq!(payload.hash().to_string(), v.sha256, "{}", v.name);
            assert_eq!(v.sha256.parse::<PayloadHash>().unwrap(), payload.hash());
        }
    }

    #[test]
    fn formatting_and_member_order_do_not_change_the_hash() {
        let a = CanonicalPayload::from_json(br#"{"a":1,"b":[true,null]}"#).unwrap();
        let b = CanonicalPayload::from_json(b"{ \"b\" : [ true , null ] ,\n \"a\" : 1.0 }").unwrap();
        assert_eq!(a.hash(), b.hash());
        let c = CanonicalPayload::from_json(br#"{"a":2,"b":[true,null]}"#).unwrap();
        assert_ne!(a.hash(), c.hash());
    }

    #[test]
    fn rejects_what_is_not_an_approvable_payload() {
        assert!(matches!(CanonicalPayload::from_json(b"{"), Err(PayloadError::NotJson(_))));
        assert_eq!(CanonicalPayload::from_json(b"[1]"), Err(PayloadError::NotAnObject));
        assert_eq!(CanonicalPayload::from_json(b"\"x\""), Err(PayloadError::NotAnObject));
        assert_eq!(CanonicalPayload::from_json(b"{}"), Err(PayloadError::Empty));
        let big = serde_json::json!({ "note": "x".repeat(MAX_PAYLOAD_BYTES) });
        assert!(matches!(CanonicalPayload::new(big), Err(PayloadError::TooLarge(_))));
    }

    #[test]
    fn debug_output_never_contains_the_body() {
        let p = CanonicalPayload::from_json(br#"{"customer":"Jane Roe"}"#).unwrap();
        assert!(!format!("{p:?}").contains("Jane"));
    }

    #[test]
    fn hash_text_is_strict() {
        assert_eq!("ab".parse::<PayloadHash>(), Err(BadHash));
        assert_eq!("A".repeat(64).parse::<PayloadHash>(), Err(BadHash));
        assert_eq!("g".repeat(64).parse::<PayloadHash>(), Err(BadHash));
        assert_eq!(format!("{}é", "0".repeat(62)).parse::<PayloadHash>(), Err(BadHash), "64 bytes, not digits");
        let text = "0123456789abcdef".repeat(4);
        assert_eq!(text.parse::<PayloadHash>().unwrap().to_string(), text);
    }
}
