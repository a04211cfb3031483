//! Fault injection: what the simulated CRM does wrong, for whom and how often.
//!
//! Faults are kept in memory in injection order. A request takes the first active fault whose
//! target matches it and whose kind applies to its endpoint; taking a fault with `times: Some(n)`
//! uses up one of its `n` applications. One request is affected by at most one fault.

use std::fmt;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// One injected fault.
///
/// JSON (the `POST /_admin/faults` body): `{"target": "<key or external id>" | null,
/// "times": <n ≥ 1> | null, "kind": "<kind>", ...kind fields}`, e.g.
/// `{"target":"harbor:create-followup:v1:case-104","kind":"lose_reply_after_commit","times":1}`
/// or `{"kind":"slow","delay_ms":500}`. See [`FaultKind`] for the kinds and their fields.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "FaultWire", into = "FaultWire")]
pub struct Fault {
    /// The idempotency key or external id the fault applies to; `None` applies to any request.
    ///
    /// A create matches on its `Idempotency-Key` header when it has one, else on its body's
    /// `external_id`; a read matches on the key or external id it asks for.
    pub target: Option<String>,
    /// What goes wrong.
    pub kind: FaultKind,
    /// How many matching requests it affects; `None` = until cleared.
    pub times: Option<u32>,
}

impl Fault {
    /// A fault of `kind` for every request, until cleared.
    pub fn always(kind: FaultKind) -> Self {
        Self { target: None, kind, times: None }
    }

    /// A fault of `kind` for the next request about `target` only.
    pub fn once_for(target: impl Into<String>, kind: FaultKind) -> Self {
        Self { target: Some(target.into()), kind, times: Some(1) }
    }
}

/// What goes wrong. JSON `kind` names are the snake_case variant names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// `lose_reply_after_commit`: the create is processed and committed as usual, then the
    /// reply is withheld for `lost_reply_hold` and the connection is closed without a response.
    LoseReplyAfterCommit,
    /// `fail_before_commit`: 503 `{"error":"unavailable"}` to a create, nothing stored.
    FailBeforeCommit,
    /// `gateway_503_after_commit`: the create is processed and committed as usual, then answered
    /// 503 `{"error":"unavailable"}`, as a gateway or load balancer does when the backend's reply
    /// is lost after it committed. A 503 is no proof of non-execution.
    Gateway503AfterCommit,
    /// `readback_unavailable`: 503 `{"error":"unavailable"}` on the by-key, by-external-id and
    /// query endpoints. The only kind that applies to reads; creates are unaffected.
    ReadbackUnavailable,
    /// `slow` (`delay_ms`): a create waits this long before it is processed. If the client gives
    /// up meanwhile, the connection closes, the request is abandoned and nothing is stored.
    Slow(Duration),
    /// `rate_limited` (`retry_after_ms`): 429 with `Retry-After` (whole seconds, rounded up) to a
    /// create, nothing stored.
    RateLimited { retry_after: Duration },
    /// `validation_error`: 422 `{"error":"validation",...}` to a create, nothing stored.
    ValidationError,
    /// `auth_error`: 401 `{"error":"unauthorized"}` to a create, nothing stored.
    AuthError,
    /// `reset_before_commit`: the connection of a create is closed without any response,
    /// nothing stored.
    ResetBeforeCommit,
    /// `hold_until_released`: a create waits, unprocessed, until the holds are released
    /// (`POST /_admin/faults/release`, [`Faults::release_held`]), then is processed and answered
    /// as usual; if the client gives up meanwhile the request is abandoned and nothing is stored.
    /// [`Faults::held`] tells how many wait, so a test can act while a reply is outstanding.
    HoldUntilReleased,
}

/// Which kind of endpoint a request hit, for deciding which faults apply to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Create,
    Read,
}

impl FaultKind {
    fn applies_to(self, endpoint: Endpoint) -> bool {
        match self {
            Self::ReadbackUnavailable => endpoint == Endpoint::Read,
            _ => endpoint == Endpoint::Create,
        }
    }
}

/// The active faults of one simulator (shared by the HTTP admin endpoint and [`crate::CrmSim::faults`]).
#[derive(Default)]
pub struct Faults {
    active: Mutex<Vec<Fault>>,
    /// Bumped by each release: a held request waits for the next value.
    releases: tokio::sync::watch::Sender<u64>,
    /// Requests held right now.
    held: std::sync::atomic::AtomicUsize,
}

impl fmt::Debug for Faults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Faults").field("active", &self.active()).finish()
    }
}

impl Faults {
    /// Adds a fault after the ones already active. A fault with `times: Some(0)` never applies
    /// and is not kept.
    pub fn inject(&self, fault: Fault) {
        if fault.times == Some(0) {
            tracing::debug!(?fault, "ignoring a fault that applies zero times");
            return;
        }
        tracing::info!(?fault, "fault injected");
        self.lock().push(fault);
    }

    /// Removes every fault.
    pub fn clear(&self) {
        self.lock().clear();
        tracing::info!("faults cleared");
    }

    /// The faults still active, in injection order.
    pub fn active(&self) -> Vec<Fault> {
        self.lock().clone()
    }

    /// Takes the first fault matching a request about `target` at `endpoint`, using up one of
    /// its applications.
    pub(crate) fn take(&self, target: Option<&str>, endpoint: Endpoint) -> Option<FaultKind> {
        let mut active = self.lock();
        let index = active.iter().position(|fault| {
            fault.kind.applies_to(endpoint) && fault.target.as_deref().is_none_or(|wanted| Some(wanted) == target)
        })?;
        let kind = active[index].kind;
        match active[index].times {
            Some(1) => {
                active.remove(index);
            }
            Some(left) => active[index].times = Some(left - 1),
            None => {}
        }
        tracing::info!(?kind, target, "fault applied");
        Some(kind)
    }

    /// Releases every request held by [`FaultKind::HoldUntilReleased`] now; later ones wait for
    /// the next release.
    pub fn release_held(&self) {
        self.releases.send_modify(|n| *n += 1);
        tracing::info!("held requests released");
    }

    /// How many requests are held right now.
    pub fn held(&self) -> usize {
        self.held.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits until the next [`Faults::release_held`]. Dropped (the client gave up): no longer held.
    pub(crate) async fn hold(&self) {
        struct Held<'a>(&'a std::sync::atomic::AtomicUsize);
        impl Drop for Held<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let mut releases = self.releases.subscribe();
        releases.borrow_and_update();
        self.held.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let _held = Held(&self.held);
        // The sender lives as long as `self`, so this only ends by a release.
        let _ = releases.changed().await;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Fault>> {
        // The list is only ever pushed to, cleared or edited in place under the lock, so a
        // panic elsewhere cannot leave it half-updated: a poisoned lock is safe to reuse.
        self.active.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The JSON shape of a [`Fault`]: flat, durations in milliseconds, unknown fields refused so a
/// misspelt field fails loudly instead of injecting a different fault.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultWire {
    #[serde(default)]
    target: Option<String>,
    kind: KindName,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    times: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    delay_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    retry_after_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum KindName {
    LoseReplyAfterCommit,
    FailBeforeCommit,
    #[serde(rename = "gateway_503_after_commit")]
    Gateway503AfterCommit,
    ReadbackUnavailable,
    Slow,
    RateLimited,
    ValidationError,
    AuthError,
    ResetBeforeCommit,
    HoldUntilReleased,
}

/// Why a fault's JSON was refused.
#[derive(Debug, thiserror::Error)]
pub enum FaultError {
    #[error("kind {0} needs the field {1}")]
    MissingField(&'static str, &'static str),
    #[error("field {1} does not apply to kind {0}")]
    UnexpectedField(&'static str, &'static str),
    #[error("times must be at least 1 (or null for until cleared)")]
    ZeroTimes,
    #[error("target must not be empty (use null for any request)")]
    EmptyTarget,
}

impl TryFrom<FaultWire> for Fault {
    type Error = FaultError;

    fn try_from(wire: FaultWire) -> Result<Self, Self::Error> {
        if wire.times == Some(0) {
            return Err(FaultError::ZeroTimes);
        }
        if wire.target.as_deref() == Some("") {
            return Err(FaultError::EmptyTarget);
        }
        let (name, needs) = match wire.kind {
            KindName::Slow => ("slow", Some("delay_ms")),
            KindName::RateLimited => ("rate_limited", Some("retry_after_ms")),
            KindName::LoseReplyAfterCommit => ("lose_reply_after_commit", None),
            KindName::FailBeforeCommit => ("fail_before_commit", None),
            KindName::Gateway503AfterCommit => ("gateway_503_after_commit", None),
            KindName::ReadbackUnavailable => ("readback_unavailable", None),
            KindName::ValidationError => ("validation_error", None),
            KindName::AuthError => ("auth_error", None),
            KindName::ResetBeforeCommit => ("reset_before_commit", None),
            KindName::HoldUntilReleased => ("hold_until_released", None),
        };
        for (field, present) in
            [("delay_ms", wire.delay_ms.is_some()), ("retry_after_ms", wire.retry_after_ms.is_some())]
        {
            if present && needs != Some(field) {
                return Err(FaultError::UnexpectedField(name, field));
            }
        }
        let kind = match wire.kind {
            KindName::Slow => {
                FaultKind::Slow(Duration::from_millis(wire.delay_ms.ok_or(FaultError::MissingField(name, "delay_ms"))?))
            }
            KindName::RateLimited => FaultKind::RateLimited {
                retry_after: Duration::from_millis(
                    wire.retry_after_ms.ok_or(FaultError::MissingField(name, "retry_after_ms"))?,
                ),
            },
            KindName::LoseReplyAfterCommit => FaultKind::LoseReplyAfterCommit,
            KindName::FailBeforeCommit => FaultKind::FailBeforeCommit,
            KindName::Gateway503AfterCommit => FaultKind::Gateway503AfterCommit,
            KindName::ReadbackUnavailable => FaultKind::ReadbackUnavailable,
            KindName::ValidationError => FaultKind::ValidationError,
            KindName::AuthError => FaultKind::AuthError,
            KindName::ResetBeforeCommit => FaultKind::ResetBeforeCommit,
            KindName::HoldUntilReleased => FaultKind::HoldUntilReleased,
        };
        Ok(Self { target: wire.target, kind, times: wire.times })
    }
}

impl From<Fault> for FaultWire {
    fn from(fault: Fault) -> Self {
        let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let (kind, delay_ms, retry_after_ms) = match fault.kind {
            FaultKind::LoseReplyAfterCommit => (KindName::LoseReplyAfterCommit, None, None),
            FaultKind::FailBeforeCommit => (KindName::FailBeforeCommit, None, None),
            FaultKind::Gateway503AfterCommit => (KindName::Gateway503AfterCommit, None, None),
            FaultKind::ReadbackUnavailable => (KindName::ReadbackUnavailable, None, None),
            FaultKind::Slow(delay) => (KindName::Slow, Some(millis(delay)), None),
            FaultKind::RateLimited { retry_after } => (KindName::RateLimited, None, Some(millis(retry_after))),
            FaultKind::ValidationError => (KindName::ValidationError, None, None),
            FaultKind::AuthError => (KindName::AuthError, None, None),
            FaultKind::ResetBeforeCommit => (KindName::ResetBeforeCommit, None, None),
            FaultKind::HoldUntilReleased => (KindName::HoldUntilReleased, None, None),
        };
        Self { target: fault.target, kind, times: fault.times, delay_ms, retry_after_ms }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn json_round_trips_every_kind() {
        for kind in [
            FaultKind::LoseReplyAfterCommit,
            FaultKind::FailBeforeCommit,
            FaultKind::Gateway503AfterCommit,
            FaultKind::ReadbackUnavailable,
            FaultKind::Slow(Duration::from_millis(500)),
            FaultKind::RateLimited { retry_after: Duration::from_millis(2000) },
            FaultKind::ValidationError,
            FaultKind::AuthError,
            FaultKind::ResetBeforeCommit,
            FaultKind::HoldUntilReleased,
        ] {
            let fault = Fault { target: Some("k".into()), kind, times: Some(2) };
            let text = serde_json::to_string(&fault).expect("serializes");
            assert_eq!(serde_json::from_str::<Fault>(&text).expect("parses"), fault, "{text}");
        }
    }

    #[test]
    fn json_shape_is_flat_with_milliseconds() {
        let slow = Fault::always(FaultKind::Slow(Duration::from_millis(500)));
        assert_eq!(
            serde_json::to_value(&slow).expect("serializes"),
            json!({"target": null, "kind": "slow", "delay_ms": 500})
        );
        let parsed: Fault = serde_json::from_value(json!({"kind": "rate_limited", "retry_after_ms": 1500, "times": 1}))
            .expect("parses");
        assert_eq!(
            parsed,
            Fault {
                target: None,
                kind: FaultKind::RateLimited { retry_after: Duration::from_millis(1500) },
                times: Some(1)
            }
        );
    }

    #[test]
    fn bad_json_is_refused() {
        for bad in [
            json!({"kind": "slow"}),
            json!({"kind": "auth_error", "delay_ms": 5}),
            json!({"kind": "auth_error", "times": 0}),
            json!({"kind": "auth_error", "target": ""}),
            json!({"kind": "auth_error", "taget": "k"}),
            json!({"kind": "explode"}),
        ] {
            assert!(serde_json::from_value::<Fault>(bad.clone()).is_err(), "{bad}");
        }
    }

    #[test]
    fn take_matches_target_endpoint_and_counts_down() {
        let faults = Faults::default();
        faults.inject(Fault { target: Some("a".into()), kind: FaultKind::FailBeforeCommit, times: Some(2) });
        faults.inject(Fault::always(FaultKind::ReadbackUnavailable));
        faults.inject(Fault { target: None, kind: FaultKind::AuthError, times: Some(0) });

        assert_eq!(faults.take(Some("b"), Endpoint::Create), None);
        assert_eq!(faults.take(Some("a"), Endpoint::Create), Some(FaultKind::FailBeforeCommit));
        assert_eq!(faults.take(Some("a"), Endpoint::Read), Some(FaultKind::ReadbackUnavailable));
        assert_eq!(faults.take(Some("a"), Endpoint::Create), Some(FaultKind::FailBeforeCommit));
        assert_eq!(faults.take(Some("a"), Endpoint::Create), None, "used up after two");
        assert_eq!(
            faults.take(None, Endpoint::Read),
            Some(FaultKind::ReadbackUnavailable),
            "untargeted, until cleared"
        );
        assert_eq!(faults.active().len(), 1);
        faults.clear();
        assert_eq!(faults.take(Some("a"), Endpoint::Read), None);
    }
}
