//! The dispatcher: drives remote-CRM ledger rows to `settled` or `review`.
//!
//! Retries are scheduled by the database, not by JetStream redelivery: the message was acked when
//! its ledger row committed, so a slow CRM, a long `Retry-After` or a readback window never holds
//! broker acks (`ack_wait`, `max_ack_pending` stay about intake only). Each replica runs a
//! dispatcher; `FOR UPDATE SKIP LOCKED` and a lease make sure only one replica works a key at a
//! time, and a replica that dies mid-call leaves an expired `dispatching` lease that the next
//! claimer turns into `unknown` and reads back. **No create is ever sent while an outcome is
//! unknown**: a second create needs proof of non-execution (an authoritative readback) first.
//!
//! The decisions are pure functions ([`after_create`], [`after_readback`]) so each rule of
//! seed 004's table is unit-tested without a network.

use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::join_all;
use futures::{FutureExt, StreamExt, stream::FuturesUnordered};
use handoff_shared::Backoff;
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use handoff_shared::logging::error_chain;
use handoff_shared::observe::Liveness;

use crate::ledger::{self, ClaimedOperation, Decision, Event, Recorded, state};
use crate::metrics::{CallLabel, CallLabels, ConsumerMetrics};
use crate::remote::{Capability, CreateOutcome, HttpCrm, Readback, RemoteTask};

/// The channel new ledger rows signal on.
pub const NOTIFY_CHANNEL: &str = "handoff_dispatch";

/// How the dispatcher retries, reads back and gives up.
#[derive(Debug, Clone)]
pub struct DispatchSettings {
    /// Rows claimed at once = CRM calls in flight per replica.
    pub in_flight: i64,
    /// Lease on a claimed row; must exceed the HTTP timeout so a live call is never taken over.
    pub lease: Duration,
    /// Create attempts before a row goes to review.
    pub max_attempts: i32,
    /// Delay before retrying a create the CRM refused without executing (429/503).
    pub backoff: Backoff,
    /// Delay between readbacks of an unknown outcome.
    pub readback_interval: Duration,
    /// How long readback may stay unavailable before a person must decide.
    pub readback_window: Duration,
    /// How long after an unknown outcome an authoritative "not found" starts to count as proof:
    /// a request the client gave up on may still be committing at the CRM. At least the HTTP
    /// timeout; more for CRMs known to keep working on abandoned requests.
    pub absence_grace: Duration,
    /// Idle poll interval (new rows also wake the dispatcher through LISTEN/NOTIFY).
    pub poll_interval: Duration,
}

impl Default for DispatchSettings {
    fn default() -> Self {
        Self {
            in_flight: 16,
            lease: Duration::from_secs(60),
            max_attempts: 5,
            backoff: Backoff { initial: Duration::from_secs(1), max: Duration::from_secs(300), ..Backoff::default() },
            readback_interval: Duration::from_secs(1),
            readback_window: Duration::from_secs(300),
            absence_grace: Duration::from_secs(10),
            poll_interval: Duration::from_millis(500),
        }
    }
}

/// What one dispatch did for one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatched {
    pub operation_key: String,
    /// `create` or `readback` (or `none` when a rule decided without calling the CRM).
    pub call: &'static str,
    /// The state recorded afterwards.
    pub state: &'static str,
    pub note: String,
}

/// One replica's dispatcher.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    pool: PgPool,
    crm: HttpCrm,
    settings: DispatchSettings,
    owner: String,
    /// Each claim gets its own lease token (`owner:n`), so two claims of one dispatcher can never
    /// both record a decision for the same row.
    claims: std::sync::Arc<std::sync::atomic::AtomicU64>,
    metrics: ConsumerMetrics,
    liveness: Liveness,
    stall_after: Duration,
}

impl Dispatcher {
    /// A dispatcher on the consumer's database (migrated by `Consumer::build`).
    pub fn new(pool: PgPool, crm: HttpCrm, settings: DispatchSettings) -> Self {
        let owner = format!("dispatcher-{:016x}", rand::random::<u64>());
        let metrics = ConsumerMetrics::register(&mut prometheus_client::registry::Registry::default());
        Self {
            pool,
            crm,
            settings,
            owner,
            claims: Default::default(),
            metrics,
            liveness: Liveness::default(),
            stall_after: handoff_shared::observe::DEFAULT_STALL_AFTER,
        }
    }

    /// Reports CRM calls in the replica's `metrics` and the dispatch loop's heartbeat in its
    /// `liveness` (bound `stall_after`), so they show on the replica's endpoint.
    pub fn observed_by(mut self, metrics: &ConsumerMetrics, liveness: &Liveness, stall_after: Duration) -> Self {
        self.metrics = metrics.clone();
        self.liveness = liveness.clone();
        self.stall_after = stall_after;
        self
    }

    /// The lease token of the next claim.
    fn next_claim(&self) -> String {
        format!("{}:{}", self.owner, self.claims.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }

    /// Claims due rows, works them concurrently (one CRM call or none each) and records every
    /// decision in one statement. One step of [`Dispatcher::run_until_stopped`], for tests and
    /// tools that drive the dispatcher by hand.
    pub async fn dispatch_due(&self) -> Result<Vec<Dispatched>, sqlx::Error> {
        let claim = self.next_claim();
        let claimed =
            ledger::claim_due(&self.pool, self.crm.account(), &claim, self.settings.in_flight, self.settings.lease)
                .await?;
        let outcomes = join_all(claimed.into_iter().map(|op| self.call(&claim, op))).await;
        Ok(self.record(outcomes).await)
    }

    /// Makes the call a claimed row needs and decides; records nothing.
    async fn call(&self, claim: &str, op: ClaimedOperation) -> Outcome {
        // The producer's trace continues: this call is a child span of it, and the CRM hears of it.
        let traceparent = op
            .traceparent
            .as_deref()
            .and_then(|tp| tp.parse::<handoff_shared::TraceParent>().ok())
            .map(|tp| tp.child());
        let span = match traceparent {
            Some(tp) => {
                tracing::info_span!("crm_call", operation_key = %op.operation_key, trace_id = %tp.trace_id(), span_id = %tp.parent_id())
            }
            None => tracing::info_span!("crm_call", operation_key = %op.operation_key),
        };
        self.call_in_span(claim, op, traceparent).instrument(span).await
    }

    async fn call_in_span(
        &self,
        claim: &str,
        op: ClaimedOperation,
        traceparent: Option<handoff_shared::TraceParent>,
    ) -> Outcome {
        let started = std::time::Instant::now();
        let now = op.db_now;
        let (call, decision, mut events) = match op.prior_state.as_str() {
            state::RECEIVED | state::PROVED_NOT_EXECUTED => {
                let outcome = self
                    .crm
                    .create(&RemoteTask {
                        operation_key: &op.operation_key,
                        payload_hash: &op.payload_hash,
                        payload: &op.payload.0,
                        traceparent,
                    })
                    .await;
                let decision = after_create(self.crm.capability(), &outcome, &op, &self.settings);
                ("create", decision, vec![("attempt", Some(op.attempts), create_evidence(&outcome))])
            }
            _ => match retention_expired(self.crm.capability(), &op, now) {
                Some(decision) => ("none", decision, Vec::new()),
                None => {
                    let readback = self.crm.readback(&op.operation_key, traceparent).await;
                    let decision = after_readback(self.crm.capability(), &readback, &op, now, &self.settings);
                    ("readback", decision, vec![("readback", None, readback_evidence(&readback))])
                }
            },
        };
        if op.prior_state == state::DISPATCHING {
            events.insert(
                0,
                (
                    "decision",
                    Some(op.attempts),
                    "lease expired while dispatching: the replica may have reached the CRM".into(),
                ),
            );
        }
        events.push(("decision", None, decision.note.clone()));
        if call != "none" {
            self.metrics.crm_call_duration.get_or_create(&CallLabel { call }).observe(started.elapsed().as_secs_f64());
        }
        tracing::debug!(operation_key = %op.operation_key, call, call_us = started.elapsed().as_micros() as u64, "call timings");
        Outcome { claim: claim.to_owned(), operation_key: op.operation_key, call, decision, events }
    }

    /// Claims up to `room` due rows under a new lease token; a failure is logged and claims nothing
    /// (the next poll tries again).
    async fn claim(&self, room: i64) -> (String, Vec<ClaimedOperation>) {
        let claim = self.next_claim();
        match ledger::claim_due(&self.pool, self.crm.account(), &claim, room, self.settings.lease).await {
            Ok(claimed) => (claim, claimed),
            Err(error) => {
                tracing::error!(error = %error_chain(&error), "claiming due rows failed; retrying at the next poll");
                (claim, Vec::new())
            }
        }
    }

    /// Records the decisions of finished calls in one statement, and logs each.
    async fn record(&self, outcomes: Vec<Outcome>) -> Vec<Dispatched> {
        let events: Vec<Vec<Event<'_>>> = outcomes
            .iter()
            .map(|o| {
                o.events.iter().map(|(kind, attempt, evidence)| Event { kind, attempt: *attempt, evidence }).collect()
            })
            .collect();
        let items: Vec<Recorded<'_>> = outcomes
            .iter()
            .zip(&events)
            .map(|(o, events)| Recorded {
                owner: &o.claim,
                operation_key: &o.operation_key,
                decision: &o.decision,
                events,
            })
            .collect();
        let applied = match ledger::record_many(&self.pool, &items).await {
            Ok(applied) => applied,
            Err(error) => {
                // The leases will expire and the next claimer reads back, so nothing is retried
                // blindly; each outcome is logged so the evidence survives the failed write.
                let error = error_chain(&error);
                for o in &outcomes {
                    tracing::error!(operation_key = %o.operation_key, call = o.call, note = %o.decision.note, %error,
                        "cannot record the decision; the key will be read back after its lease");
                }
                return Vec::new();
            }
        };
        drop(items);
        drop(events);
        let mut done = Vec::with_capacity(outcomes.len());
        for (o, applied) in outcomes.into_iter().zip(applied) {
            let result = if applied { o.decision.state } else { "lease_lost" };
            self.metrics.crm_calls.get_or_create(&CallLabels { call: o.call, result }).inc();
            if !applied {
                tracing::warn!(operation_key = %o.operation_key, call = o.call, note = %o.decision.note,
                    "lease lost before recording: another replica owns the key; evidence kept, decision not applied");
                continue;
            }
            if o.decision.state == state::REVIEW {
                tracing::warn!(operation_key = %o.operation_key, call = o.call, note = %o.decision.note, "held for review");
            } else {
                tracing::info!(operation_key = %o.operation_key, call = o.call, state = o.decision.state,
                    note = %o.decision.note, "dispatched");
            }
            done.push(Dispatched {
                operation_key: o.operation_key,
                call: o.call,
                state: o.decision.state,
                note: o.decision.note,
            });
        }
        done
    }

    /// Dispatches until `token` is cancelled; calls in flight finish and are recorded first.
    ///
    /// A pipeline, not waves: up to `in_flight` calls are in flight at all times. When calls end,
    /// those that have ended are recorded together (one statement) and their room is claimed
    /// again at once, so one slow call never holds up the others and the database sees a few
    /// statements per batch of calls rather than a transaction per call.
    ///
    /// It claims when rows may be due: after a notification (new ledger rows), a poll tick
    /// (retries and readbacks fall due by time), a claim that filled all the room it asked for,
    /// or a recorded decision that leaves a row undecided.
    pub async fn run_until_stopped(self, token: CancellationToken) -> anyhow::Result<()> {
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.listen(NOTIFY_CHANNEL).await?;
        let mut poll = tokio::time::interval(self.settings.poll_interval);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let this = &self;
        let start = |claim: String, op: ClaimedOperation| async move { this.call(&claim, op).await };
        let mut calls = FuturesUnordered::new();
        let mut maybe_due = true;
        let heartbeat = self.liveness.register("dispatcher", self.stall_after);
        tracing::info!(account = %self.crm.account(), in_flight = self.settings.in_flight, "dispatcher running");
        loop {
            heartbeat.beat();
            let room = self.settings.in_flight - calls.len() as i64;
            if maybe_due && room > 0 && !token.is_cancelled() {
                let (claim, claimed) = self.claim(room).await;
                maybe_due = claimed.len() as i64 == room;
                calls.extend(claimed.into_iter().map(|op| start(claim.clone(), op)));
            }
            if calls.is_empty() {
                tokio::select! {
                    // Stop requested while idle.
                    _ = token.cancelled() => break,
                    // New ledger rows: dispatch now.
                    notification = listener.recv() => {
                        if let Err(error) = notification {
                            tracing::warn!(error = %error_chain(&error), "dispatch listener failed; polling continues");
                        }
                    }
                    _ = poll.tick() => {}
                }
                maybe_due = true;
                continue;
            }
            tokio::select! {
                Some(first) = calls.next() => {
                    // Everything else that has ended by now goes into the same statement.
                    let mut ended = vec![first];
                    while let Some(Some(more)) = calls.next().now_or_never() {
                        ended.push(more);
                    }
                    let undecided = ended.iter().any(|o| !matches!(o.decision.state, state::SETTLED | state::REVIEW));
                    // The freed room is claimed while the decisions are recorded: two statements
                    // on two connections, whose commits the server flushes together. A row being
                    // recorded is leased, so the claim cannot take it.
                    let room = self.settings.in_flight - calls.len() as i64;
                    let (recorded, started) = (ended.len(), std::time::Instant::now());
                    let claimed = if maybe_due && room > 0 && !token.is_cancelled() {
                        let (_, (claim, claimed)) = tokio::join!(self.record(ended), self.claim(room));
                        maybe_due = claimed.len() as i64 == room;
                        let count = claimed.len();
                        calls.extend(claimed.into_iter().map(|op| start(claim.clone(), op)));
                        count
                    } else {
                        self.record(ended).await;
                        0
                    };
                    tracing::debug!(recorded, claimed, in_flight = calls.len(),
                        record_and_claim_us = started.elapsed().as_micros() as u64, "dispatch timings");
                    maybe_due |= undecided;
                }
                notification = listener.recv(), if !maybe_due => {
                    if let Err(error) = notification {
                        tracing::warn!(error = %error_chain(&error), "dispatch listener failed; polling continues");
                    }
                    maybe_due = true;
                }
                _ = poll.tick(), if !maybe_due => maybe_due = true,
            }
        }
        Ok(())
    }
}

/// A finished call whose decision is not recorded yet.
#[derive(Debug)]
struct Outcome {
    /// The lease token of the claim the row came with.
    claim: String,
    operation_key: String,
    call: &'static str,
    decision: Decision,
    events: Vec<(&'static str, Option<i32>, String)>,
}

fn create_evidence(outcome: &CreateOutcome) -> String {
    match outcome {
        CreateOutcome::Created { task_id, evidence } => format!("{evidence}: task {task_id}"),
        CreateOutcome::Conflict { evidence }
        | CreateOutcome::Permanent { evidence }
        | CreateOutcome::Unknown { evidence } => evidence.clone(),
        CreateOutcome::NotExecuted { retry_after, evidence } => match retry_after {
            Some(after) => format!("{evidence}, Retry-After {}s", after.as_secs()),
            None => evidence.clone(),
        },
    }
}

fn readback_evidence(readback: &Readback) -> String {
    match readback {
        Readback::Found { task_id, payload_hash, evidence } => {
            format!("{evidence}: task {task_id}, hash {payload_hash}")
        }
        Readback::Absent { evidence, .. } | Readback::Ambiguous { evidence } | Readback::Unavailable { evidence } => {
            evidence.clone()
        }
    }
}

fn decide(state: &'static str, after: Duration, note: impl Into<String>) -> Decision {
    Decision { state, after, crm_task_id: None, proof: None, note: note.into() }
}

/// The decision after a create attempt.
pub fn after_create(
    capability: Capability,
    outcome: &CreateOutcome,
    op: &ClaimedOperation,
    settings: &DispatchSettings,
) -> Decision {
    match outcome {
        CreateOutcome::Created { task_id, .. } => Decision {
            crm_task_id: Some(task_id.clone()),
            proof: Some("create_response"),
            ..decide(state::SETTLED, Duration::ZERO, format!("created as {task_id}"))
        },
        CreateOutcome::Conflict { evidence } => {
            decide(state::REVIEW, Duration::ZERO, format!("conflict: the CRM holds different content ({evidence})"))
        }
        CreateOutcome::Permanent { evidence } => {
            decide(state::REVIEW, Duration::ZERO, format!("rejected, not retryable ({evidence})"))
        }
        CreateOutcome::NotExecuted { .. } if op.attempts >= settings.max_attempts => decide(
            state::REVIEW,
            Duration::ZERO,
            format!("retry budget exhausted after {} attempts; the CRM never executed it", op.attempts),
        ),
        CreateOutcome::NotExecuted { retry_after, .. } => {
            let backoff = settings.backoff.delay(op.attempts.max(1) as u32);
            // A CRM asking for more than an hour is capped: the row is looked at again then.
            let after = retry_after.map_or(backoff, |r| r.max(backoff)).min(Duration::from_secs(3600));
            decide(state::RECEIVED, after, format!("not executed by the CRM; retry in {}ms", after.as_millis()))
        }
        CreateOutcome::Unknown { .. } if capability == Capability::Nothing => decide(
            state::REVIEW,
            Duration::ZERO,
            "outcome unknown and the destination offers no way to prove it: a person must check",
        ),
        CreateOutcome::Unknown { .. } => {
            decide(state::UNKNOWN, settings.readback_interval, "outcome unknown: read back before anything else")
        }
    }
}

/// For a destination with idempotency keys: once the CRM has forgotten the key, neither a readback
/// by key nor a retry with it proves anything, so an unknown outcome goes to a person.
pub fn retention_expired(capability: Capability, op: &ClaimedOperation, now: DateTime<Utc>) -> Option<Decision> {
    let Capability::IdempotencyKey { retention } = capability else { return None };
    // The attempt whose outcome is unknown is the last one; its key record dates from then.
    let started = op.last_attempt_at?;
    let age = (now - started).to_std().unwrap_or_default();
    (age >= retention).then(|| {
        decide(
            state::REVIEW,
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
    let proof = match capability {
        Capability::IdempotencyKey { .. } => "readback_by_key",
        Capability::ExternalId => "readback_by_external_id",
        Capability::QueryOnly { .. } | Capability::Nothing => "query",
    };
    // Ages on the database's clock, from the moment the outcome became unknown (the end of the
    // attempt, or the takeover of a dead replica's lease).
    let unknown_for = op.unknown_since.map_or(Duration::ZERO, |t| (now - t).to_std().unwrap_or_default());
    match readback {
        Readback::Found { task_id, payload_hash, .. } if *payload_hash == op.payload_hash => Decision {
            crm_task_id: Some(task_id.clone()),
            proof: Some(proof),
            ..decide(state::SETTLED, Duration::ZERO, format!("settled by readback: {task_id} exists"))
        },
        Readback::Found { task_id, .. } => decide(
            state::REVIEW,
            Duration::ZERO,
            format!("conflict: {task_id} exists for this key with different content"),
        ),
        Readback::Ambiguous { evidence } => {
            decide(state::REVIEW, Duration::ZERO, format!("several CRM records match this key ({evidence})"))
        }
        _ if capability == Capability::Nothing => {
            decide(state::REVIEW, Duration::ZERO, "no authoritative lookup: a person must check")
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
                    state::UNKNOWN,
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
            if unknown_for >= settings.readback_window {
                decide(
                    state::REVIEW,
                    Duration::ZERO,
                    format!(
                        "readback unavailable for {}s (window {}s): a person must check ({evidence})",
                        unknown_for.as_secs(),
                        settings.readback_window.as_secs()
                    ),
                )
            } else {
                decide(
                    state::UNKNOWN,
                    settings.readback_interval,
                    format!("readback unavailable, will look again ({evidence})"),
                )
            }
        }
    }
}

fn not_executed(op: &ClaimedOperation, settings: &DispatchSettings, why: &str) -> Decision {
    if op.attempts >= settings.max_attempts {
        decide(
            state::REVIEW,
            Duration::ZERO,
            format!("{why}, but the retry budget ({}) is spent", settings.max_attempts),
        )
    } else {
        decide(
            state::PROVED_NOT_EXECUTED,
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
            prior_state: state::UNKNOWN.into(),
            attempts,
            first_attempt_at: Some(now),
            last_attempt_at: Some(now),
            unknown_since: Some(now),
            db_now: now,
            traceparent: None,
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

    #[test]
    fn a_lost_reply_is_unknown_and_never_a_retry() {
        let d = after_create(EXTERNAL, &CreateOutcome::Unknown { evidence: "timed out".into() }, &op(1), &settings());
        assert_eq!(d.state, state::UNKNOWN);
        let d = after_create(
            Capability::Nothing,
            &CreateOutcome::Unknown { evidence: "reset".into() },
            &op(1),
            &settings(),
        );
        assert_eq!(d.state, state::REVIEW);
    }

    #[test]
    fn refusals_retry_with_backoff_and_honour_retry_after_until_the_budget_is_spent() {
        let refused = CreateOutcome::NotExecuted { retry_after: Some(Duration::from_secs(7)), evidence: "429".into() };
        let d = after_create(EXTERNAL, &refused, &op(1), &settings());
        assert_eq!(d.state, state::RECEIVED);
        assert!(d.after >= Duration::from_secs(7));
        assert_eq!(after_create(EXTERNAL, &refused, &op(3), &settings()).state, state::REVIEW);
    }

    #[test]
    fn conflicts_and_permanent_errors_go_to_review_at_once() {
        for outcome in
            [CreateOutcome::Conflict { evidence: "409".into() }, CreateOutcome::Permanent { evidence: "422".into() }]
        {
            assert_eq!(after_create(EXTERNAL, &outcome, &op(1), &settings()).state, state::REVIEW);
        }
    }

    #[test]
    fn readback_settles_only_with_our_payload() {
        let ours = Readback::Found { task_id: "T-1".into(), payload_hash: "a".repeat(64), evidence: "200".into() };
        let d = after_readback(EXTERNAL, &ours, &op(1), Utc::now(), &settings());
        assert_eq!(
            (d.state, d.crm_task_id.as_deref(), d.proof),
            (state::SETTLED, Some("T-1"), Some("readback_by_external_id"))
        );
        let theirs = Readback::Found { task_id: "T-1".into(), payload_hash: "b".repeat(64), evidence: "200".into() };
        assert_eq!(after_readback(EXTERNAL, &theirs, &op(1), Utc::now(), &settings()).state, state::REVIEW);
    }

    #[test]
    fn authoritative_absence_counts_only_after_the_grace_and_then_allows_one_attempt_within_budget() {
        let absent = Readback::Absent { authoritative: true, evidence: "404".into() };
        let o = op(1);
        // A request the client abandoned may still be committing: not proof yet.
        assert_eq!(after_readback(EXTERNAL, &absent, &o, later(&o, 1), &settings()).state, state::UNKNOWN);
        assert_eq!(after_readback(EXTERNAL, &absent, &o, later(&o, 11), &settings()).state, state::PROVED_NOT_EXECUTED);
        let spent = op(3);
        assert_eq!(after_readback(EXTERNAL, &absent, &spent, later(&spent, 11), &settings()).state, state::REVIEW);
    }

    #[test]
    fn a_search_miss_inside_the_freshness_window_is_not_proof() {
        let query = Capability::QueryOnly { freshness: Duration::from_secs(30) };
        let absent = Readback::Absent { authoritative: false, evidence: "0 results".into() };
        let o = op(1);
        // Grace (10 s) plus search lag (30 s), counted from when the outcome became unknown.
        assert_eq!(after_readback(query, &absent, &o, later(&o, 31), &settings()).state, state::UNKNOWN);
        assert_eq!(after_readback(query, &absent, &o, later(&o, 41), &settings()).state, state::PROVED_NOT_EXECUTED);
    }

    #[test]
    fn unavailable_readback_waits_out_its_window_then_asks_a_person() {
        let unavailable = Readback::Unavailable { evidence: "503".into() };
        let o = op(1);
        assert_eq!(after_readback(EXTERNAL, &unavailable, &o, later(&o, 0), &settings()).state, state::UNKNOWN);
        assert_eq!(after_readback(EXTERNAL, &unavailable, &o, later(&o, 61), &settings()).state, state::REVIEW);
        // An idempotency key is no excuse for a blind retry: the same rule applies.
        let keyed = Capability::IdempotencyKey { retention: Duration::from_secs(3600) };
        assert_eq!(after_readback(keyed, &unavailable, &o, later(&o, 0), &settings()).state, state::UNKNOWN);
    }

    #[test]
    fn a_destination_without_lookups_sends_every_unknown_outcome_to_review() {
        let unavailable = Readback::Unavailable { evidence: "no readback".into() };
        let o = op(1);
        assert_eq!(
            after_readback(Capability::Nothing, &unavailable, &o, later(&o, 0), &settings()).state,
            state::REVIEW
        );
    }

    #[test]
    fn an_expired_idempotency_key_sends_an_unknown_outcome_to_review() {
        let keyed = Capability::IdempotencyKey { retention: Duration::from_secs(10) };
        let o = op(1);
        assert!(retention_expired(keyed, &o, later(&o, 1)).is_none());
        assert_eq!(retention_expired(keyed, &o, later(&o, 11)).map(|d| d.state), Some(state::REVIEW));
        assert!(retention_expired(EXTERNAL, &o, later(&o, 11)).is_none());
    }
}
