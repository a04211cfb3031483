//! The approved payload in canonical form, and the hash that binds an approval to it.
//!
//! Canonical form is RFC 8785 (JSON Canonicalization Scheme): object members sorted by UTF-16 code
//! units, no insignificant whitespace, numbers in ECMAScript shortest form. Two producers that send
//! the same JSON value in any formatting get the same bytes and so the same [`PayloadHash`]; the
//! fixed vectors in `shared/testdata/canonical-vectors.json` pin it, so a dependency upgrade cannot
//! silently change every hash in flight.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use crate::json_string::write_json_string;
use serde::de::{MapAccess, SeqAccess, Visitor};
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
        let (canonical, hash) = canonicalize(&Node::from(&value))?;
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

/// An approved payload kept as JSON text: checked, canonicalized and hashed as
/// [`CanonicalPayload`] does (same errors, same hash), without building a [`Value`]. The relay
/// reads every payload it sends as text from Postgres and writes it as text into the envelope,
/// so a tree of owned strings and maps per row was only ever thrown away.
#[derive(Clone, PartialEq, Eq)]
pub struct PayloadText {
    /// The text without insignificant whitespace: the value as approved, numbers as written.
    compact: Vec<u8>,
    hash: PayloadHash,
}

impl PayloadText {
    /// Parses, checks and hashes JSON text.
    pub fn from_json(text: &str) -> Result<Self, PayloadError> {
        let node: Node<'_> = serde_json::from_str(text).map_err(|e| PayloadError::NotJson(e.to_string()))?;
        let (_, hash) = canonicalize(&node)?;
        Ok(Self { compact: compact(text), hash })
    }

    /// The JSON text without insignificant whitespace; it parses to the value that was hashed.
    pub fn compact(&self) -> &[u8] {
        &self.compact
    }

    /// SHA-256 of the canonical form, equal to [`CanonicalPayload::hash`] of the same value.
    pub fn hash(&self) -> PayloadHash {
        self.hash
    }
}

impl fmt::Debug for PayloadText {
    // Payloads may hold personal data: Debug shows only size and hash, never the body.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PayloadText").field("bytes", &self.compact.len()).field("hash", &self.hash).finish()
    }
}

/// Valid JSON text with the whitespace between tokens removed (whitespace inside strings is
/// part of them; control characters cannot appear there unescaped in valid JSON).
fn compact(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    let (mut in_string, mut escaped) = (false, false);
    for &byte in text.as_bytes() {
        if in_string {
            if escaped {
                escaped = false;
            } else if byte == b'\\' {
                escaped = true;
            } else if byte == b'"' {
                in_string = false;
            }
        } else if matches!(byte, b' ' | b'\t' | b'\n' | b'\r') {
            continue;
        } else if byte == b'"' {
            in_string = true;
        }
        out.push(byte);
    }
    out
}

/// A JSON value as the canonical writer needs it, borrowed where it can be: from a parsed
/// [`Value`], or straight from JSON text (strings without escapes are slices of the text).
enum Node<'a> {
    Null,
    Bool(bool),
    /// As a double, the way RFC 8785 writes every number (`Value::as_f64`).
    Number(f64),
    String(Cow<'a, str>),
    Array(Vec<Node<'a>>),
    /// Members in the order written; a repeated name keeps its last value, as [`Value`] does.
    Object(Vec<(Cow<'a, str>, Node<'a>)>),
}

impl<'a> From<&'a Value> for Node<'a> {
    fn from(value: &'a Value) -> Self {
        match value {
            Value::Null => Node::Null,
            Value::Bool(b) => Node::Bool(*b),
            // Not representable as a double only with arbitrary precision; refused when written.
            Value::Number(number) => Node::Number(number.as_f64().unwrap_or(f64::NAN)),
            Value::String(text) => Node::String(Cow::Borrowed(text)),
            Value::Array(items) => Node::Array(items.iter().map(Node::from).collect()),
            Value::Object(members) => Node::Object(
                members.iter().map(|(name, member)| (Cow::Borrowed(name.as_str()), Node::from(member))).collect(),
            ),
        }
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Node<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(NodeVisitor(std::marker::PhantomData))
    }
}

struct NodeVisitor<'a>(std::marker::PhantomData<&'a ()>);

impl<'de: 'a, 'a> Visitor<'de> for NodeVisitor<'a> {
    type Value = Node<'a>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_unit<E>(self) -> Result<Node<'a>, E> {
        Ok(Node::Null)
    }
    fn visit_bool<E>(self, b: bool) -> Result<Node<'a>, E> {
        Ok(Node::Bool(b))
    }
    // The same conversions as `Value`'s `Number::as_f64`.
    fn visit_u64<E>(self, n: u64) -> Result<Node<'a>, E> {
        Ok(Node::Number(n as f64))
    }
    fn visit_i64<E>(self, n: i64) -> Result<Node<'a>, E> {
        Ok(Node::Number(n as f64))
    }
    fn visit_f64<E>(self, n: f64) -> Result<Node<'a>, E> {
        Ok(Node::Number(n))
    }
    fn visit_borrowed_str<E>(self, text: &'de str) -> Result<Node<'a>, E> {
        Ok(Node::String(Cow::Borrowed(text)))
    }
    fn visit_str<E>(self, text: &str) -> Result<Node<'a>, E> {
        Ok(Node::String(Cow::Owned(text.to_owned())))
    }
    fn visit_string<E>(self, text: String) -> Result<Node<'a>, E> {
        Ok(Node::String(Cow::Owned(text)))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node<'a>, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Node::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node<'a>, A::Error> {
        let mut members = Vec::with_capacity(map.size_hint().unwrap_or(0));
        while let Some((name, member)) = map.next_entry::<Name<'a>, Node<'a>>()? {
            members.push((name.0, member));
        }
        Ok(Node::Object(members))
    }
}

/// A member name, borrowed from the text unless it has escapes.
struct Name<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Name<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match deserializer.deserialize_any(NodeVisitor(std::marker::PhantomData))? {
            Node::String(name) => Ok(Name(name)),
            _ => Err(serde::de::Error::custom("a member name is a string")),
        }
    }
}

/// Checks a payload (an object, not empty, at most [`MAX_PAYLOAD_BYTES`] canonical) and returns
/// its canonical bytes and their hash.
fn canonicalize(node: &Node<'_>) -> Result<(Vec<u8>, PayloadHash), PayloadError> {
    match node {
        Node::Object(members) if members.is_empty() => return Err(PayloadError::Empty),
        Node::Object(_) => {}
        _ => return Err(PayloadError::NotAnObject),
    }
    let mut canonical = Vec::with_capacity(128);
    write_canonical(node, &mut canonical)?;
    if canonical.len() > MAX_PAYLOAD_BYTES {
        return Err(PayloadError::TooLarge(canonical.len()));
    }
    let hash = PayloadHash(Sha256::digest(&canonical).into());
    Ok((canonical, hash))
}

/// Writes `value` in RFC 8785 form: members sorted by the UTF-16 code units of their names,
/// strings escaped as ECMAScript's `JSON.stringify` does (which is serde_json's compact escaping),
/// and every number as ECMAScript writes a double (so an integer beyond 2^53 is rounded, as the
/// RFC says). One pass, no allocation but the members' order per object; `serde_jcs` writes the
/// same bytes (tested) but allocates for every token, and this ran for every row a relay sends.
fn write_canonical(node: &Node<'_>, out: &mut Vec<u8>) -> Result<(), PayloadError> {
    match node {
        Node::Null => out.extend_from_slice(b"null"),
        Node::Bool(true) => out.extend_from_slice(b"true"),
        Node::Bool(false) => out.extend_from_slice(b"false"),
        Node::Number(double) => {
            if !double.is_finite() {
                return Err(PayloadError::NotCanonicalizable(format!("{double} is not a finite double")));
            }
            out.extend_from_slice(ryu_js::Buffer::new().format_finite(*double).as_bytes());
        }
        Node::String(text) => write_json_string(out, text),
        Node::Array(items) => {
            out.push(b'[');
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    out.push(b',');
                }
                write_canonical(item, out)?;
            }
            out.push(b']');
        }
        Node::Object(members) => {
            let mut sorted: Vec<&(Cow<'_, str>, Node<'_>)> = members.iter().collect();
            // Stable, so of a repeated name the last one written sorts last and is the one kept.
            // Parsed text and serde_json's map may be in any order; the RFC's is UTF-16's, which
            // differs from UTF-8's for names with characters beyond U+FFFF.
            sorted.sort_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
            out.push(b'{');
            let mut first = true;
            for (index, (name, member)) in sorted.iter().enumerate() {
                if sorted.get(index + 1).is_some_and(|(next, _)| next == name) {
                    continue;
                }
                if !first {
                    out.push(b',');
                }
                first = false;
                write_json_string(out, name);
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

impl PayloadHash {
    /// The 64 hex digits, written into `text` (no allocation).
    pub fn write_hex(self, text: &mut [u8; 64]) -> &str {
        hex::encode_to_slice(self.0, text).expect("32 bytes are 64 hex digits");
        std::str::from_utf8(text).expect("hex digits are ASCII")
    }
}

impl fmt::Display for PayloadHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.write_hex(&mut [0u8; 64]))
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
            let finite = write_canonical(&Node::from(&value), &mut ours).is_ok();
            match serde_jcs::to_vec(&value) {
                Ok(reference) => {
                    assert_eq!(String::from_utf8(ours).unwrap(), String::from_utf8(reference).unwrap(), "{value}")
                }
                Err(_) => assert!(!finite, "serde_jcs refused {value}"),
            }
        }
    }

    #[test]
    fn payload_text_hashes_what_the_parsed_value_hashes_and_keeps_the_value() {
        let mut seed = 11;
        let mut objects = 0;
        for _ in 0..5_000 {
            let value = match generated(&mut seed, 3) {
                Value::Object(members) => Value::Object(members),
                other => serde_json::json!({ "v": other }),
            };
            // Pretty-printed, so the whitespace between tokens has to go; strings keep theirs.
            let text = serde_json::to_string_pretty(&value).unwrap();
            let parsed = PayloadText::from_json(&text);
            match CanonicalPayload::new(value.clone()) {
                Ok(reference) => {
                    let parsed = parsed.unwrap();
                    assert_eq!(parsed.hash(), reference.hash(), "{text}");
                    assert_eq!(parsed.compact(), serde_json::to_vec(&value).unwrap().as_slice(), "{text}");
                    objects += 1;
                }
                Err(error) => assert_eq!(parsed.unwrap_err(), error, "{text}"),
            }
        }
        assert!(objects > 4_000, "{objects}");
    }

    #[test]
    fn payload_text_keeps_numbers_as_written_and_a_repeated_name_last() {
        let text = r#"{ "b" : 12345678901234567891, "a":1.50, "s":" x\" y ", "a" : 2 }"#;
        let parsed = PayloadText::from_json(text).unwrap();
        assert_eq!(
            std::str::from_utf8(parsed.compact()).unwrap(),
            r#"{"b":12345678901234567891,"a":1.50,"s":" x\" y ","a":2}"#
        );
        let value: Value = serde_json::from_str(text).unwrap();
        assert_eq!(value["a"], 2, "serde_json keeps the last of a repeated name");
        assert_eq!(parsed.hash(), CanonicalPayload::new(value).unwrap().hash());
        assert_eq!(PayloadText::from_json("[1]"), Err(PayloadError::NotAnObject));
        assert_eq!(PayloadText::from_json(" { } "), Err(PayloadError::Empty));
        assert!(matches!(PayloadText::from_json("{"), Err(PayloadError::NotJson(_))));
        let big = serde_json::json!({ "note": "x".repeat(MAX_PAYLOAD_BYTES) }).to_string();
        assert!(matches!(PayloadText::from_json(&big), Err(PayloadError::TooLarge(_))));
        assert!(!format!("{parsed:?}").contains("12345"), "Debug never shows the body");
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
