//! W3C Trace Context: the `traceparent` a producer may attach to an approved action, carried as the
//! CloudEvents distributed-tracing extension attribute, continued in the consumer's spans and sent
//! to the CRM. A trace context is diagnostic: a malformed one is dropped, never a reason to refuse
//! or dead-letter a business action.

use std::fmt;
use std::str::FromStr;

/// A `traceparent` value (`00-<trace-id>-<parent-id>-<flags>`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    trace_id: [u8; 16],
    parent_id: [u8; 8],
    flags: u8,
}

/// Why a `traceparent` was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("traceparent must be 00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>, ids not all zero: {0:?}")]
pub struct BadTraceParent(pub String);

impl TraceParent {
    /// The trace id, 32 lowercase hex digits.
    pub fn trace_id(&self) -> String {
        hex::encode(self.trace_id)
    }

    /// The parent (span) id, 16 lowercase hex digits.
    pub fn parent_id(&self) -> String {
        hex::encode(self.parent_id)
    }

    /// Whether the caller sampled the trace.
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// The same trace with a new parent id: what a service sends downstream for the call it makes.
    pub fn child(&self) -> Self {
        let mut parent_id: [u8; 8] = rand::random();
        if parent_id == [0; 8] {
            parent_id[7] = 1;
        }
        Self { parent_id, ..*self }
    }
}

impl FromStr for TraceParent {
    type Err = BadTraceParent;

    /// Version 00 exactly; a higher version is read by its first four fields, as the
    /// specification asks; version ff is invalid.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadTraceParent(s.chars().take(80).collect());
        let parts: Vec<&str> = s.split('-').collect();
        let [version, trace, parent, flags, ..] = parts.as_slice() else { return Err(bad()) };
        let hex_field = |text: &str, len: usize| -> Option<Vec<u8>> {
            (text.len() == len && text.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
                .then(|| hex::decode(text).ok())
                .flatten()
        };
        let version = hex_field(version, 2).ok_or_else(bad)?[0];
        if version == 0xff || (version == 0 && parts.len() != 4) {
            return Err(bad());
        }
        let trace_id: [u8; 16] = hex_field(trace, 32).and_then(|v| v.try_into().ok()).ok_or_else(bad)?;
        let parent_id: [u8; 8] = hex_field(parent, 16).and_then(|v| v.try_into().ok()).ok_or_else(bad)?;
        let flags = hex_field(flags, 2).ok_or_else(bad)?[0];
        if trace_id == [0; 16] || parent_id == [0; 8] {
            return Err(bad());
        }
        Ok(Self { trace_id, parent_id, flags })
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "00-{}-{}-{:02x}", self.trace_id(), self.parent_id(), self.flags)
    }
}

impl fmt::Debug for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TraceParent({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_and_prints_the_specification_example() {
        let tp: TraceParent = EXAMPLE.parse().unwrap();
        assert_eq!(tp.to_string(), EXAMPLE);
        assert_eq!(tp.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(tp.parent_id(), "00f067aa0ba902b7");
        assert!(tp.sampled());
    }

    #[test]
    fn a_child_keeps_the_trace_and_flags_with_a_new_parent() {
        let tp: TraceParent = EXAMPLE.parse().unwrap();
        let child = tp.child();
        assert_eq!((child.trace_id(), child.sampled()), (tp.trace_id(), true));
        assert_ne!(child.parent_id(), tp.parent_id());
    }

    #[test]
    fn refuses_malformed_values() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(bad.parse::<TraceParent>().is_err(), "{bad}");
        }
        // A later version may add fields after the first four.
        assert!("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes".parse::<TraceParent>().is_ok());
    }
}
