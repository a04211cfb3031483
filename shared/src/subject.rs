//! Subject and header names both sides agree on.
//!
//! Each action type gets its own subject, `<prefix>.<namespace>.<action>`, so a platform can bind a
//! consumer (and scale it) per action with a filter subject, and the stream captures `<prefix>.>`.

use crate::OperationKey;

/// Header names on every handoff message.
pub mod headers {
    /// JetStream's de-duplication header; always the operation key.
    pub const MSG_ID: &str = "Nats-Msg-Id";
    /// Structured-mode CloudEvents content type (CloudEvents NATS protocol binding).
    pub const CONTENT_TYPE: &str = "Content-Type";
    /// The value of [`CONTENT_TYPE`].
    pub const CLOUDEVENTS_JSON: &str = "application/cloudevents+json; charset=utf-8";
}

/// Why a subject prefix was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("subject prefix must be dot-separated tokens of [A-Za-z0-9_-], got {0:?}")]
pub struct BadPrefix(pub String);

/// The subject layout under one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subjects {
    prefix: String,
}

impl Subjects {
    /// Validates the prefix: no wildcards, no empty tokens, so every key maps to exactly one subject.
    pub fn new(prefix: impl Into<String>) -> Result<Self, BadPrefix> {
        let prefix = prefix.into();
        let ok = !prefix.is_empty()
            && prefix.split('.').all(|token| {
                !token.is_empty() && token.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
            });
        if ok { Ok(Self { prefix }) } else { Err(BadPrefix(prefix)) }
    }

    /// The prefix itself.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The subject one action is published on.
    pub fn for_key(&self, key: &OperationKey) -> String {
        format!("{}.{}.{}", self.prefix, key.namespace(), key.action())
    }

    /// The filter that matches every action under the prefix (the stream's subject).
    pub fn all(&self) -> String {
        format!("{}.>", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_subject_per_action_type_under_the_prefix() {
        let subjects = Subjects::new("handoff.prod").unwrap();
        let key: OperationKey = "harbor:create-followup:v1:case-104".parse().unwrap();
        assert_eq!(subjects.for_key(&key), "handoff.prod.harbor.create-followup");
        assert_eq!(subjects.all(), "handoff.prod.>");
    }

    #[test]
    fn refuses_wildcards_and_empty_tokens() {
        for bad in ["", "a..b", "a.*", "a.>", "a b", ".a", "a."] {
            assert!(Subjects::new(bad).is_err(), "{bad:?}");
        }
    }
}
