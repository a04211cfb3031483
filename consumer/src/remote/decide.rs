//! Seed 004's decision table: what to record after a create attempt or a readback, as pure
//! functions of the adapter's classification, the destination's [`Capability`], the ledger row and
//! the database's clock. Every rule has a unit test here; nothing here talks to a network.
//!
//! The one invariant: **no create is sent while an outcome is unknown** unless it cannot make a
//! second task: after an authoritative absence (proved not executed), or with the same
//! idempotency key while the destination still retains it (a replay returns the original).

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::dispatcher::DispatchSettings;
use super::ledger::ClaimedOperation;
use super::{Capability, CreateOutcome, LedgerState, Readback};

/// The outcome to record for one claimed operation.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub state: LedgerState,
    /// When the row is due again (for undecided states).
    pub after: Duration,
    pub crm_task_id: Option<String>,
    pub proof: Option<&'static str>,
    pub note: String,
}

fn decide(state: LedgerState, after: Duration, note: impl Into<String>) -> Decision {
    Decision { state, after, crm_task_id: None, proof: None, note: note.into() }
}

/// The decision after a create attempt (a first attempt, a proved-absent retry, or a replay).
pub fn after_create(
    capability: Capability,
    outcome: &CreateOutcome,
    op: &ClaimedOperation,
    settings: &DispatchSettings,
) -> Decision {
    let replay = op.prior_state == LedgerState::Replay;
    match outcome {
        CreateOutcome::Created { task_id, .. } => Decision {
            crm_task_id: Some(task_id.clone()),
            proof: Some(if replay { "replay_by_key" } else { "create_response" }),
            ..decide(
                LedgerState::Settled,
                Duration::ZERO,
                if replay {
                    format!("settled by a replay with the same key: {task_id}")
                } else {
                    format!("created as {task_id}")
                },
            )
        },
        CreateOutcome::Conflict { evidence } => decide(
            LedgerState::Review,
            Duration::ZERO,
            format!("conflict: the CRM holds different content ({evidence})"),
        ),
        CreateOutcome::Permanent { evidence } => {
            decide(LedgerState::Review, Duration::ZERO, format!("rejected, not retryable ({evidence})"))
        }
        CreateOutcome::Ambiguous { evidence } => {
            decide(LedgerState::Review, Duration::ZERO, format!("several CRM records match this key ({evidence})"))
        }
        // The replay was refused, but the attempt before it may still have been executed.
        CreateOutcome::NotExecuted { retry_after, .. } if replay => decide(
            LedgerState::Unknown,
            retry_after.unwrap_or(settings.readback_interval).max(settings.readback_interval),
            "the replay was refused before execution; the earlier attempt is still unknown: read back",
        ),
        CreateOutcome::NotExecuted { .. } if op.attempts >= settings.max_attempts => decide(
            LedgerState::Review,
            Duration::ZERO,
            format!("retry budget exhausted after {} attempts; the CRM never executed it", op.attempts),
        ),
        CreateOutcome::NotExecuted { retry_after, .. } => {
            let backoff = settings.backoff.delay(op.attempts.max(1) as u32);
            // A CRM asking for more than an hour is capped: the row is looked at again then.
            let after = retry_after.map_or(backoff, |r| r.max(backoff)).min(MAX_RETRY_AFTER);
            decide(LedgerState::Received, after, format!("not executed by the CRM; retry in {}ms", after.as_millis()))
        }
        CreateOutcome::Unknown { .. } if capability == Capability::Nothing => decide(
            LedgerState::Review,
            Duration::ZERO,
            "outcome unknown and the destination offers no way to prove it: a person must check",
        ),
        CreateOutcome::Unknown { retry_after, .. } => {
            let after = retry_after.map_or(settings.readback_interval, |r| r.max(settings.readback_interval));
            decide(
                LedgerState::Unknown,
                after.min(MAX_RETRY_AFTER),
                format!(
                    "outcome unknown: read back in {}ms before anything else",
                    after.min(MAX_RETRY_AFTER).as_millis()
                ),
            )
        }
    }
}

/// The longest a destination's `Retry-After` is honoured; the row is looked at again then.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// How long the idempotency key of `op` has been at the destination, counted from the first create
/// of the unproven episode (`key_sent_at`): a replay of a later attempt may return a task an
/// earlier one created, and its key record dates from then.
fn key_age(op: &ClaimedOperation, now: DateTime<Utc>) -> Option<Duration> {
    let sent = op.key_sent_at.or(op.first_attempt_at)?;
    Some((now - sent).to_std().unwrap_or_default())
}

/// For a destination with idempotency keys: once the CRM has forgotten the key, neither a readback
/// by key nor a retry with it proves anything, so an unknown outcome goes to a person.
pub fn retention_expired(capability: Capability, op: &ClaimedOperation, now: DateTime<Utc>) -> Option<Decision> {
    let Capability::IdempotencyKey { retention } = capability else { return None };
    let age = key_age(op, now)?;
    (age >= retention).then(|| {
        decide(
            LedgerState::Review,
            Duration::ZERO,
            format!(
                "CRM idempotency-key retention ({}s) expired while the outcome was unknown: no blind retry",
                retention.as_secs()
            ),
        )
    })
}

/// The decision after a readback of an unknown outcome.
pub fn after_readback(
    capability: Capability,
    readback: &Readback,
    op: &ClaimedOperation,
    now: DateTime<Utc>,
    settings: &DispatchSettings,
) -> Decision {
    // Ages on the database's clock, from the moment the outcome became unknown (the end of the
    // attempt, or the takeover of a dead replica's lease).
    let unknown_for = op.unknown_since.map_or(Duration::ZERO, |t| (now - t).to_std().unwrap_or_default());
    match readback {
        Readback::Found { task_id, payload_hash, .. } if *payload_hash == op.payload_hash => Decision {
            crm_task_id: Some(task_id.clone()),
            proof: Some(capability.readback_proof()),
            ..decide(LedgerState::Settled, Duration::ZERO, format!("settled by readback: {task_id} exists"))
        },
        Readback::Found { task_id, .. } => decide(
            LedgerState::Review,
            Duration::ZERO,
            format!("conflict: {task_id} exists for this key with different content"),
        ),
        Readback::Ambiguous { evidence } => {
            decide(LedgerState::Review, Duration::ZERO, format!("several CRM records match this key ({evidence})"))
        }
        _ if capability == Capability::Nothing => {
            decide(LedgerState::Review, Duration::ZERO, "no authoritative lookup: a person must check")
        }
        Readback::Absent { .. } => {
            // A search may lag behind writes; any lookup may run before a request the client
            // abandoned has committed. Absence is proof only once both have passed.
            let freshness = match capability {
                Capability::QueryOnly { freshness } => freshness,
                _ => Duration::ZERO,
            };
            let needed = settings.absence_grace + freshness;
            if unknown_for < needed {
                decide(
                    LedgerState::Unknown,
                    settings.readback_interval.min(needed - unknown_for).max(Duration::from_millis(10)),
                    format!(
                        "not found, but not proof yet: writes may take {}s to show (grace {}s, search lag {}s)",
                        needed.as_secs_f32(),
                        settings.absence_grace.as_secs_f32(),
                        freshness.as_secs_f32()
                    ),
                )
            } else {
                not_executed(op, settings, "absent by lookup after the grace and freshness windows")
            }
        }
        Readback::Unavailable { evidence } => {
            if let Some(decision) = replay(capability, op, now, settings) {
                return Decision { note: format!("{} ({evidence})", decision.note), ..decision };
            }
            if unknown_for >= settings.readback_window {
                decide(
                    LedgerState::Review,
                    Duration::ZERO,
                    format!(
                        "readback unavailable for {}s (window {}s): a person must check ({evidence})",
                        unknown_for.as_secs(),
                        settings.readback_window.as_secs()
                    ),
                )
            } else {
                decide(
                    LedgerState::Unknown,
                    settings.readback_interval,
                    format!("readback unavailable, will look again ({evidence})"),
                )
            }
        }
    }
}

/// With readback unavailable, a destination that still retains the idempotency key answers a
/// repeated create with the original task, or creates the one that is missing: the create is sent
/// again with the same key, within the retry budget, and only while the replay reaches the CRM
/// before the key's retention ends (its age plus the absence grace, which covers the request
/// timeout, is inside the retention).
fn replay(
    capability: Capability,
    op: &ClaimedOperation,
    now: DateTime<Utc>,
    settings: &DispatchSettings,
) -> Option<Decision> {
    let Capability::IdempotencyKey { retention } = capability else { return None };
    let age = key_age(op, now)?;
    if age + settings.absence_grace >= retention || op.attempts >= settings.max_attempts {
        return None;
    }
    Some(decide(
        LedgerState::Replay,
        Duration::ZERO,
        format!(
            "readback unavailable; the CRM retains the key ({}s of {}s): send again with the same key",
            age.as_secs(),
            retention.as_secs()
        ),
    ))
}

fn not_executed(op: &ClaimedOperation, settings: &DispatchSettings, why: &str) -> Decision {
    if op.attempts >= settings.max_attempts {
        decide(
            LedgerState::Review,
            Duration::ZERO,
            format!("{why}, but the retry budget ({}) is spent", settings.max_attempts),
        )
    } else {
        decide(
            LedgerState::ProvedNotExecuted,
            Duration::ZERO,
            format!("{why}: proved not executed, one new attempt with the same key"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(attempts: i32) -> ClaimedOperation {
        let now = Utc::now();
        ClaimedOperation {
            operation_key: "harbor:create-followup:v1:case-104".into(),
            account: "acct".into(),
            payload_hash: "a".repeat(64),
            payload: sqlx::types::Json(serde_json::json!({"x": 1})),
            prior_state: LedgerState::Unknown,
            attempts,
            first_attempt_at: Some(now),
            last_attempt_at: Some(now),
            key_sent_at: Some(now),
            unknown_since: Some(now),
            db_now: now,
            traceparent: None,
            before: Default::default(),
        }
    }

    /// `op` as seen `secs` after its outcome became unknown.
    fn later(op: &ClaimedOperation, secs: i64) -> DateTime<Utc> {
        op.db_now + chrono::Duration::seconds(secs)
    }

    fn settings() -> DispatchSettings {
        DispatchSettings {
            max_attempts: 3,
            readback_window: Duration::from_secs(60),
            absence_grace: Duration::from_secs(10),
            ..DispatchSettings::default()
        }
    }

    const EXTERNAL: Capability = Capability::ExternalId;

    fn unknown(evidence: &str) -> CreateOutcome {
        CreateOutcome::Unknown { retry_after: None, evidence: evidence.into() }
    }

    #[test]
    fn a_lost_reply_is_unknown_and_never_a_retry() {
        let d = after_create(EXTERNAL, &unknown("timed out"), &op(1), &settings());
        assert_eq!(d.state, LedgerState::Unknown);
        let d = after_create(Capability::Nothing, &unknown("reset"), &op(1), &settings());
        assert_eq!(d.state, LedgerState::Review);
    }

    #[test]
    fn an_unknown_answer_with_retry_after_reads_back_no_sooner_than_asked() {
        let busy = CreateOutcome::Unknown { retry_after: Some(Duration::from_secs(30)), evidence: "503".into() };
        let d = after_create(EXTERNAL, &busy, &op(1), &settings());
        assert_eq!((d.state, d.after), (LedgerState::Unknown, Duration::from_secs(30)));
        let long = CreateOutcome::Unknown { retry_after: Some(Duration::from_secs(86_400)), evidence: "503".into() };
        assert_eq!(after_create(EXTERNAL, &long, &op(1), &settings()).after, MAX_RETRY_AFTER);
    }

    #[test]
    fn refusals_retry_with_backoff_and_honour_retry_after_until_the_budget_is_spent() {
        let refused = CreateOutcome::NotExecuted { retry_after: Some(Duration::from_secs(7)), evidence: "429".into() };
        let d = after_create(EXTERNAL, &refused, &op(1), &settings());
        assert_eq!(d.state, LedgerState::Received);
        assert!(d.after >= Duration::from_secs(7));
        assert_eq!(after_create(EXTERNAL, &refused, &op(3), &settings()).state, LedgerState::Review);
    }

    #[test]
    fn conflicts_and_permanent_errors_go_to_review_at_once() {
        for outcome in [
            CreateOutcome::Conflict { evidence: "409".into() },
            CreateOutcome::Permanent { evidence: "422".into() },
            CreateOutcome::Ambiguous { evidence: "300".into() },
        ] {
            assert_eq!(after_create(EXTERNAL, &outcome, &op(1), &settings()).state, LedgerState::Review);
        }
    }

    #[test]
    fn readback_settles_only_with_our_payload() {
        let ours = Readback::Found { task_id: "T-1".into(), payload_hash: "a".repeat(64), evidence: "200".into() };
        let d = after_readback(EXTERNAL, &ours, &op(1), Utc::now(), &settings());
        assert_eq!(
            (d.state, d.crm_task_id.as_deref(), d.proof),
            (LedgerState::Settled, Some("T-1"), Some("readback_by_external_id"))
        );
        let theirs = Readback::Found { task_id: "T-1".into(), payload_hash: "b".repeat(64), evidence: "200".into() };
        assert_eq!(after_readback(EXTERNAL, &theirs, &op(1), Utc::now(), &settings()).state, LedgerState::Review);
    }

    #[test]
    fn authoritative_absence_counts_only_after_the_grace_and_then_allows_one_attempt_within_budget() {
        let absent = Readback::Absent { authoritative: true, evidence: "404".into() };
        let o = op(1);
        // A request the client abandoned may still be committing: not proof yet.
        assert_eq!(after_readback(EXTERNAL, &absent, &o, later(&o, 1), &settings()).state, LedgerState::Unknown);
        assert_eq!(
            after_readback(EXTERNAL, &absent, &o, later(&o, 11), &settings()).state,
            LedgerState::ProvedNotExecuted
        );
        let spent = op(3);
        assert_eq!(
            after_readback(EXTERNAL, &absent, &spent, later(&spent, 11), &settings()).state,
            LedgerState::Review
        );
    }

    #[test]
    fn a_search_miss_inside_the_freshness_window_is_not_proof() {
        let query = Capability::QueryOnly { freshness: Duration::from_secs(30) };
        let absent = Readback::Absent { authoritative: false, evidence: "0 results".into() };
        let o = op(1);
        // Grace (10 s) plus search lag (30 s), counted from when the outcome became unknown.
        assert_eq!(after_readback(query, &absent, &o, later(&o, 31), &settings()).state, LedgerState::Unknown);
        assert_eq!(
            after_readback(query, &absent, &o, later(&o, 41), &settings()).state,
            LedgerState::ProvedNotExecuted
        );
    }

    #[test]
    fn unavailable_readback_waits_out_its_window_then_asks_a_person() {
        let unavailable = Readback::Unavailable { evidence: "503".into() };
        let o = op(1);
        assert_eq!(after_readback(EXTERNAL, &unavailable, &o, later(&o, 0), &settings()).state, LedgerState::Unknown);
        assert_eq!(after_readback(EXTERNAL, &unavailable, &o, later(&o, 61), &settings()).state, LedgerState::Review);
    }

    #[test]
    fn unavailable_readback_replays_with_the_same_key_while_the_crm_retains_it() {
        let keyed = Capability::IdempotencyKey { retention: Duration::from_secs(3600) };
        let unavailable = Readback::Unavailable { evidence: "503".into() };
        let o = op(1);
        let d = after_readback(keyed, &unavailable, &o, later(&o, 0), &settings());
        assert_eq!((d.state, d.after), (LedgerState::Replay, Duration::ZERO), "{}", d.note);
        // Past the readback window the replay still proves the outcome: no person needed.
        assert_eq!(after_readback(keyed, &unavailable, &o, later(&o, 61), &settings()).state, LedgerState::Replay);
        // Not when the replay could arrive after the key is forgotten (age + grace >= retention) ...
        assert_eq!(after_readback(keyed, &unavailable, &o, later(&o, 3591), &settings()).state, LedgerState::Review);
        // ... counted from the first create of the episode, not the last replay ...
        let replayed = ClaimedOperation { key_sent_at: Some(o.db_now - chrono::Duration::seconds(3595)), ..op(2) };
        assert_eq!(
            after_readback(keyed, &unavailable, &replayed, later(&replayed, 0), &settings()).state,
            LedgerState::Unknown
        );
        // ... nor once the retry budget is spent: then the readback window decides.
        assert_eq!(after_readback(keyed, &unavailable, &op(3), later(&o, 0), &settings()).state, LedgerState::Unknown);
    }

    #[test]
    fn a_replay_settles_with_our_payload_and_a_refused_replay_stays_unknown() {
        let replaying = ClaimedOperation { prior_state: LedgerState::Replay, ..op(2) };
        let created = CreateOutcome::Created { task_id: "T-9".into(), evidence: "200".into() };
        let d = after_create(
            Capability::IdempotencyKey { retention: Duration::from_secs(60) },
            &created,
            &replaying,
            &settings(),
        );
        assert_eq!((d.state, d.proof), (LedgerState::Settled, Some("replay_by_key")));
        let refused = CreateOutcome::NotExecuted { retry_after: None, evidence: "connection failed".into() };
        let d = after_create(
            Capability::IdempotencyKey { retention: Duration::from_secs(60) },
            &refused,
            &replaying,
            &settings(),
        );
        assert_eq!(d.state, LedgerState::Unknown, "the attempt before the replay is still unproven");
        // Even with the budget spent: never `received`, never review without a readback.
        let spent = ClaimedOperation { prior_state: LedgerState::Replay, ..op(3) };
        let d = after_create(
            Capability::IdempotencyKey { retention: Duration::from_secs(60) },
            &refused,
            &spent,
            &settings(),
        );
        assert_eq!(d.state, LedgerState::Unknown);
    }

    #[test]
    fn a_destination_without_lookups_sends_every_unknown_outcome_to_review() {
        let unavailable = Readback::Unavailable { evidence: "no readback".into() };
        let o = op(1);
        assert_eq!(
            after_readback(Capability::Nothing, &unavailable, &o, later(&o, 0), &settings()).state,
            LedgerState::Review
        );
    }

    #[test]
    fn an_expired_idempotency_key_sends_an_unknown_outcome_to_review() {
        let keyed = Capability::IdempotencyKey { retention: Duration::from_secs(10) };
        let o = op(1);
        assert!(retention_expired(keyed, &o, later(&o, 1)).is_none());
        assert_eq!(retention_expired(keyed, &o, later(&o, 11)).map(|d| d.state), Some(LedgerState::Review));
        assert!(retention_expired(EXTERNAL, &o, later(&o, 11)).is_none());
    }
}
