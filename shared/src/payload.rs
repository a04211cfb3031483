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
        let mut canonical = Vec::with_capacity(128);
        write_canonical(&value, &mut canonical)?;
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

/// Writes `value` in RFC 8785 form: members sorted by the UTF-16 code units of their names,
/// strings escaped as ECMAScript's `JSON.stringify` does (which is serde_json's compact escaping),
/// and every number as ECMAScript writes a double (so an integer beyond 2^53 is rounded, as the
/// RFC says). One pass, no allocation but the members' order per object; `serde_jcs` writes the
/// same bytes (tested) but allocates for every token, and this ran for every row a relay sends.
fn write_canonical(value: &Value, out: &mut Vec<u8>) -> Result<(), PayloadError> {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(number) => {
            let double = number
                .as_f64()
                .filter(|d| d.is_finite())
                .ok_or_else(|| PayloadError::NotCanonicalizable(format!("{number} is not a finite double")))?;
            out.extend_from_slice(ryu_js::Buffer::new().format_finite(double).as_bytes());
        }
        Value::String(text) => serde_json::to_writer(&mut *out, text).expect("a string serializes"),
        Value::Array(items) => {
            out.push(b'[');
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    out.push(b',');
                }
                write_canonical(item, out)?;
            }
            out.push(b']');
        }
        Value::Object(members) => {
            let mut sorted: Vec<(&String, &Value)> = members.iter().collect();
            // serde_json's map is in UTF-8 byte order (or insertion order with `preserve_order`);
            // the RFC's is UTF-16's, which differs for names with characters beyond U+FFFF.
            sorted.sort_unstable_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
            out.push(b'{');
            for (index, (name, member)) in sorted.into_iter().enumerate() {
                if index > 0 {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, name).expect("a string serializes");
                out.push(b':');
                write_canonical(member, out)?;
            }
            out.push(b'}');
        }
    }
    Ok(())
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

    /// A value built from `seed` by a small deterministic generator: nested objects and arrays,
    /// names and strings from an alphabet with control characters, quotes, escapes, non-ASCII and
    /// characters beyond U+FFFF, and numbers of every kind serde_json holds.
    fn generated(seed: &mut u64, depth: u32) -> Value {
        fn next(seed: &mut u64) -> u64 {
            // SplitMix64.
            *seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = *seed;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn text(seed: &mut u64) -> String {
            const ALPHABET: [char; 16] = [
                'a',
                'B',
                '1',
                '"',
                '\\',
                '/',
                '\n',
                '\u{1}',
                '\u{7f}',
                'é',
                '€',
                '\u{80}',
                '\u{e000}',
                '\u{fb33}',
                '😀',
                '\u{10ffff}',
            ];
            (0..next(seed) % 6).map(|_| ALPHABET[(next(seed) % 16) as usize]).collect()
        }
        let kind = if depth == 0 { next(seed) % 5 } else { next(seed) % 7 };
        match kind {
            0 => Value::Null,
            1 => Value::Bool(next(seed).is_multiple_of(2)),
            2 => Value::String(text(seed)),
            3 => match next(seed) % 5 {
                0 => Value::from(next(seed)),
                1 => Value::from(-((next(seed) >> 1) as i64)),
                2 => Value::from(next(seed) % 1000),
                3 => Value::from(f64::from_bits(next(seed) >> 2)),
                _ => Value::from((next(seed) % 100_000) as f64 / 1000.0),
            },
            4 => Value::from(f64::from_bits(next(seed) >> 1).clamp(-1e300, 1e300)),
            5 => Value::Array((0..next(seed) % 4).map(|_| generated(seed, depth - 1)).collect()),
            _ => Value::Object((0..next(seed) % 6).map(|_| (text(seed), generated(seed, depth - 1))).collect()),
        }
    }

    #[test]
    fn the_canonical_writer_writes_what_serde_jcs_writes() {
        let mut seed = 7;
        for _ in 0..5_000 {
            let value = generated(&mut seed, 3);
            let mut ours = Vec::new();
            let finite = write_canonical(&value, &mut ours).is_ok();
            match serde_jcs::to_vec(&value) {
                Ok(reference) => {
                    assert_eq!(String::from_utf8(ours).unwrap(), String::from_utf8(reference).unwrap(), "{value}")
                }
                Err(_) => assert!(!finite, "serde_jcs refused {value}"),
            }
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
