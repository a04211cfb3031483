//! The operation key: the stable identity of one approved business action.
//!
//! Shape: `namespace:action:vN:entity`, e.g. `harbor:create-followup:v1:case-104`.
//!
//! | part      | charset                         | length |
//! |-----------|---------------------------------|--------|
//! | namespace | `[a-z][a-z0-9-]*`               | 1-32   |
//! | action    | `[a-z][a-z0-9-]*`               | 1-64   |
//! | version   | `v` then `1`-`9999`, no leading 0 | 2-5  |
//! | entity    | `[A-Za-z0-9][A-Za-z0-9._-]*`    | 1-128  |
//!
//! The key is derived from business identity the application controls (a case number, an order id),
//! never from a random id per attempt and never from model-generated text, so every retry of the same
//! approved action carries the same key. It travels in logs, metrics, subjects and message ids, so it
//! must carry **no personal data**: use an internal record id, not an e-mail address or a name. The
//! charset makes the common mistakes (spaces, `@`, `/`) impossible. Namespace and action become NATS
//! subject tokens, hence lowercase and no dots. The same rules are enforced by the SQL producer
//! function `handoff.record_approved_action` (see `relay/migrations`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Longest namespace accepted.
pub const MAX_NAMESPACE_LEN: usize = 32;
/// Longest action name accepted.
pub const MAX_ACTION_LEN: usize = 64;
/// Highest key version accepted (`v9999`).
pub const MAX_VERSION: u16 = 9999;
/// Longest entity id accepted.
pub const MAX_ENTITY_LEN: usize = 128;
/// The longest CloudEvents type of a key ([`OperationKey::write_event_type`]): `namespace.action.v9999`.
pub const MAX_EVENT_TYPE_LEN: usize = MAX_NAMESPACE_LEN + 1 + MAX_ACTION_LEN + 1 + "v9999".len();

/// Why a string is not an operation key. Each variant names the part that is wrong so a producer can
/// fix its key derivation rather than guess.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// A key has exactly four `:`-separated parts; anything else is a different kind of identifier.
    #[error("operation key must have four parts `namespace:action:vN:entity`, found {0}")]
    WrongShape(usize),
    /// Namespace and action become subject tokens, so they are restricted to lowercase words.
    #[error("operation key {part} must match [a-z][a-z0-9-]* and be 1-{max} characters")]
    BadName { part: &'static str, max: usize },
    /// Versions let an action's meaning change without reusing old keys; `v0` or `v01` would be ambiguous.
    #[error("operation key version must be v1..v{MAX_VERSION} without leading zeros")]
    BadVersion,
    /// The entity id is the business identity; it is restricted so it cannot smuggle personal data
    /// formats (spaces, `@`) or subject wildcards.
    #[error("operation key entity must match [A-Za-z0-9][A-Za-z0-9._-]* and be 1-{MAX_ENTITY_LEN} characters")]
    BadEntity,
}

/// A validated `namespace:action:vN:entity` key. Construct with [`OperationKey::new`] or `parse`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct OperationKey {
    text: String,
    // Byte offsets of the three separators, so accessors do not re-split.
    seps: [usize; 3],
}

/// `namespace:action` of a stored or received key text, without validating the rest; `None` when it
/// has fewer than three parts. For metrics labels of rows and messages that may be malformed.
pub fn action_type_of(key: &str) -> Option<&str> {
    let second = key.match_indices(':').nth(1)?.0;
    Some(&key[..second])
}

impl OperationKey {
    /// Builds a key from its parts, validating each.
    pub fn new(namespace: &str, action: &str, version: u16, entity: &str) -> Result<Self, KeyError> {
        format!("{namespace}:{action}:v{version}:{entity}").parse()
    }

    /// The whole key as text.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The business namespace (`harbor`).
    pub fn namespace(&self) -> &str {
        &self.text[..self.seps[0]]
    }

    /// The action type (`create-followup`).
    pub fn action(&self) -> &str {
        &self.text[self.seps[0] + 1..self.seps[1]]
    }

    /// `namespace:action` (`harbor:create-followup`): what metrics label, pause and filter by.
    pub fn action_type(&self) -> &str {
        &self.text[..self.seps[1]]
    }

    /// The version token including its `v` (`v1`).
    pub fn version(&self) -> &str {
        &self.text[self.seps[1] + 1..self.seps[2]]
    }

    /// The CloudEvents `type` for this key, `namespace.action.vN`, written into `out` (no
    /// allocation per message).
    pub fn write_event_type<'b>(&self, out: &'b mut [u8; MAX_EVENT_TYPE_LEN]) -> &'b str {
        let prefix = &self.text.as_bytes()[..self.seps[2]];
        let out = &mut out[..prefix.len()];
        for (to, &from) in out.iter_mut().zip(prefix) {
            *to = if from == b':' { b'.' } else { from };
        }
        std::str::from_utf8(out).expect("a key is text and only ASCII colons were replaced")
    }

    /// The business entity (`case-104`).
    pub fn entity(&self) -> &str {
        &self.text[self.seps[2] + 1..]
    }
}

fn is_name(s: &str, max: usize) -> bool {
    let mut bytes = s.bytes();
    matches!(bytes.next(), Some(b'a'..=b'z'))
        && s.len() <= max
        && bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

fn is_version(s: &str) -> bool {
    let Some(digits) = s.strip_prefix('v') else {
        return false;
    };
    !digits.is_empty() && !digits.starts_with('0') && digits.len() <= 4 && digits.bytes().all(|b| b.is_ascii_digit())
}

fn is_entity(s: &str) -> bool {
    let mut bytes = s.bytes();
    matches!(bytes.next(), Some(b) if b.is_ascii_alphanumeric())
        && s.len() <= MAX_ENTITY_LEN
        && bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl FromStr for OperationKey {
    type Err = KeyError;

    fn from_str(text: &str) -> Result<Self, KeyError> {
        let parts: Vec<&str> = text.split(':').collect();
        let [namespace, action, version, entity] = parts[..] else {
            return Err(KeyError::WrongShape(parts.len()));
        };
        if !is_name(namespace, MAX_NAMESPACE_LEN) {
            return Err(KeyError::BadName { part: "namespace", max: MAX_NAMESPACE_LEN });
        }
        if !is_name(action, MAX_ACTION_LEN) {
            return Err(KeyError::BadName { part: "action", max: MAX_ACTION_LEN });
        }
        if !is_version(version) {
            return Err(KeyError::BadVersion);
        }
        if !is_entity(entity) {
            return Err(KeyError::BadEntity);
        }
        let first = namespace.len();
        let second = first + 1 + action.len();
        let third = second + 1 + version.len();
        Ok(Self { text: text.to_owned(), seps: [first, second, third] })
    }
}

impl TryFrom<String> for OperationKey {
    type Error = KeyError;
    fn try_from(value: String) -> Result<Self, KeyError> {
        value.parse()
    }
}

impl From<OperationKey> for String {
    fn from(key: OperationKey) -> String {
        key.text
    }
}

impl fmt::Display for OperationKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl fmt::Debug for OperationKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OperationKey({})", self.text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_event_type_is_namespace_action_and_version_joined_by_dots() {
        let longest = format!(
            "{}:{}:v{MAX_VERSION}:{}",
            "n".repeat(MAX_NAMESPACE_LEN),
            "a".repeat(MAX_ACTION_LEN),
            "e".repeat(MAX_ENTITY_LEN)
        );
        for text in ["harbor:create-followup:v1:case-104", "a:b:v12:c.d-e", longest.as_str()] {
            let key: OperationKey = text.parse().unwrap();
            let expected = format!("{}.{}.{}", key.namespace(), key.action(), key.version());
            assert_eq!(key.write_event_type(&mut [0; MAX_EVENT_TYPE_LEN]), expected);
        }
    }

    #[test]
    fn parses_the_seed_key_into_its_parts() {
        let key: OperationKey = "harbor:create-followup:v1:case-104".parse().unwrap();
        assert_eq!(key.namespace(), "harbor");
        assert_eq!(key.action(), "create-followup");
        assert_eq!(key.version(), "v1");
        assert_eq!(key.entity(), "case-104");
        assert_eq!(OperationKey::new("harbor", "create-followup", 1, "case-104").unwrap(), key);
    }

    #[test]
    fn rejects_keys_that_break_each_rule() {
        let cases = [
            ("harbor:create-followup:case-104", KeyError::WrongShape(3)),
            ("harbor:create:v1:a:b", KeyError::WrongShape(5)),
            ("Harbor:create:v1:a", KeyError::BadName { part: "namespace", max: 32 }),
            ("harbor:create.task:v1:a", KeyError::BadName { part: "action", max: 64 }),
            (":create:v1:a", KeyError::BadName { part: "namespace", max: 32 }),
            ("harbor:create:v0:a", KeyError::BadVersion),
            ("harbor:create:v01:a", KeyError::BadVersion),
            ("harbor:create:1:a", KeyError::BadVersion),
            ("harbor:create:v10000:a", KeyError::BadVersion),
            ("harbor:create:v1:", KeyError::BadEntity),
            ("harbor:create:v1:case 104", KeyError::BadEntity),
            ("harbor:create:v1:jane@example.com", KeyError::BadEntity),
            ("harbor:create:v1:case/104", KeyError::BadEntity),
            ("harbor:create:v1:-104", KeyError::BadEntity),
        ];
        for (text, expected) in cases {
            assert_eq!(text.parse::<OperationKey>().unwrap_err(), expected, "{text}");
        }
        let long_entity = format!("harbor:create:v1:{}", "a".repeat(MAX_ENTITY_LEN + 1));
        assert_eq!(long_entity.parse::<OperationKey>().unwrap_err(), KeyError::BadEntity);
    }

    #[test]
    fn round_trips_through_serde_as_a_plain_string() {
        let key: OperationKey = "harbor:create-followup:v9999:A.b_c-1".parse().unwrap();
        let json = serde_json::to_string(&key).unwrap();
        assert_eq!(json, "\"harbor:create-followup:v9999:A.b_c-1\"");
        assert_eq!(serde_json::from_str::<OperationKey>(&json).unwrap(), key);
        assert!(serde_json::from_str::<OperationKey>("\"nope\"").is_err());
    }
}
