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
//! The dispatcher is generic over the adapter ([`RemoteCrm`]): it claims, calls, and records
//! what [`decide`](super::decide) makes of each answer, whichever destination it talks to.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use futures::future::{BoxFuture, join_all};
use futures::{FutureExt, StreamExt, stream::FuturesUnordered};
use handoff_shared::Backoff;
use handoff_shared::config::{DatabaseArgs, Plans};
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use handoff_shared::logging::error_chain;
use handoff_shared::observe::Liveness;

use super::decide::{Decision, after_create, after_readback, retention_expired};
use super::ledger::{self, ClaimedOperation, Event, Recorded};
use super::{CreateOutcome, LedgerState, Readback, RemoteCrm, RemoteTask};
use crate::metrics::{CallLabel, CallLabels, ConsumerMetrics};

/// The channel new ledger rows signal on.
pub const NOTIFY_CHANNEL: &str = "handoff_dispatch";

/// How much longer than the longest call a lease must be: it covers the claim before the call and
/// recording the decision after it (and, for a row claimed ahead, nothing else: see
/// [`DispatchSettings::hold_limit`]).
pub const LEASE_MARGIN: Duration = Duration::from_secs(5);

/// The shortest time a row claimed ahead may wait for a slot; a lease leaving less than this does
/// not claim ahead.
pub const MIN_HOLD: Duration = Duration::from_secs(1);

/// The longest a finished call's decision waits for others to be recorded with it (see
/// [`DispatchSettings::record_batch`]). Its lease still has [`LEASE_MARGIN`] to run; this is a
/// small part of it.
pub const RECORD_LINGER: Duration = Duration::from_millis(5);

/// Connections of the dispatcher's own pool: one claim and one record statement at a time, the
/// LISTEN connection, and one for releasing unsent claims.
pub const POOL_CONNECTIONS: u32 = 4;

/// How the dispatcher's connections show in `pg_stat_activity`.
pub const APPLICATION_NAME: &str = "handoff-consumer-dispatch";

/// Opens the dispatcher's pool on the consumer's database: its statements
/// ([`ledger::DISPATCH_STATEMENTS`]) are planned once per connection
/// ([`Plans::OncePerConnection`]), where the consumer's other pool plans every execution. Measured
/// at 16 calls in flight, planning the claim and record statements afresh cost ~150 µs of the
/// database's time per message (docs/benchmarks.md).
pub async fn connect_pool(database: &DatabaseArgs) -> anyhow::Result<PgPool> {
    database.connect_with(APPLICATION_NAME, Plans::OncePerConnection, POOL_CONNECTIONS).await
}

/// How the dispatcher retries, reads back and gives up.
#[derive(Debug, Clone)]
pub struct DispatchSettings {
    /// CRM calls in flight per replica.
    pub in_flight: i64,
    /// Rows claimed ahead of a free slot, so a slot whose call ends starts the next call at once
    /// instead of waiting for a claim's commit. Their claim is durable (the attempt is counted
    /// before the call, as for any claim); a stopping dispatcher releases the ones it never sent
    /// ([`ledger::release_unsent`]), and a replica that dies holding some leaves leases the next
    /// claimer reads back, like any call in flight. 0 claims only for free slots.
    pub claim_ahead: i64,
    /// Lease on a claimed row; must exceed `call_timeout` by [`LEASE_MARGIN`] so a live call is
    /// never taken over.
    pub lease: Duration,
    /// The longest one CRM call may take (the adapter's request timeout).
    pub call_timeout: Duration,
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
            claim_ahead: 16,
            lease: Duration::from_secs(60),
            call_timeout: Duration::from_secs(10),
            max_attempts: 5,
            backoff: Backoff { initial: Duration::from_secs(1), max: Duration::from_secs(300), ..Backoff::default() },
            readback_interval: Duration::from_secs(1),
            readback_window: Duration::from_secs(300),
            absence_grace: Duration::from_secs(10),
            poll_interval: Duration::from_millis(500),
        }
    }
}

impl DispatchSettings {
    /// How long a row claimed ahead may wait for a slot: its call must still end, and its decision
    /// be recorded, within the lease.
    pub fn hold_limit(&self) -> Duration {
        self.lease.saturating_sub(self.call_timeout + LEASE_MARGIN)
    }

    /// Rows claimed ahead, as run: none when the lease leaves less than [`MIN_HOLD`] to wait in.
    pub fn effective_claim_ahead(&self) -> i64 {
        if self.hold_limit() >= MIN_HOLD { self.claim_ahead.max(0) } else { 0 }
    }

    /// The fewest rows a running dispatcher claims at once: half the rows it may claim ahead (at
    /// least one). Claiming a row per ended call would plan and commit one claim statement per
    /// call; waiting until half the rows held ahead are gone claims them in one statement while
    /// the other half still keeps every slot fed. A free slot with nothing held always has room
    /// for more than this, so it never waits for the batch to fill.
    pub fn claim_batch(&self) -> i64 {
        (self.effective_claim_ahead() / 2).max(1)
    }

    /// The finished calls a running dispatcher records in one statement: a quarter of the calls
    /// in flight (at least one). Fewer are recorded when no other call is under way, when
    /// stopping, or when the first of them has waited [`RECORD_LINGER`]: recording each call alone
    /// would plan and commit a statement per call, and a decision waiting a few milliseconds
    /// holds no slot (the call has ended) and only its own lease.
    pub fn record_batch(&self) -> usize {
        usize::try_from(self.in_flight / 4).unwrap_or(0).max(1)
    }
}

/// What one dispatch did for one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatched {
    pub operation_key: String,
    /// `create`, `replay` or `readback` (or `none` when a rule decided without calling the CRM).
    pub call: &'static str,
    /// The state recorded afterwards.
    pub state: LedgerState,
    pub note: String,
}

/// One replica's dispatcher.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    pool: PgPool,
    crm: Arc<dyn RemoteCrm>,
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
    /// A dispatcher on the consumer's database (migrated by `Consumer::build`) calling `crm`, on
    /// a pool from [`connect_pool`] (any pool works; that one saves the planning).
    pub fn new(pool: PgPool, crm: Arc<dyn RemoteCrm>, settings: DispatchSettings) -> Self {
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
        let capability = self.crm.capability();
        let (call, decision, mut events) = match op.prior_state {
            LedgerState::Received | LedgerState::ProvedNotExecuted | LedgerState::Replay => {
                let task = RemoteTask {
                    operation_key: &op.operation_key,
                    payload_hash: &op.payload_hash,
                    payload: &op.payload.0,
                    traceparent,
                };
                let outcome = self.crm.create(&task).await;
                let decision = after_create(capability, &outcome, &op, &self.settings);
                let call = if op.prior_state == LedgerState::Replay { "replay" } else { "create" };
                (call, decision, vec![("attempt", Some(op.attempts), create_evidence(call, &outcome))])
            }
            // `dispatching` here is a dead replica's expired lease: the claim recorded its attempt
            // as abandoned, and the outcome is unknown.
            LedgerState::Unknown | LedgerState::Dispatching => match retention_expired(capability, &op, now) {
                Some(decision) => ("none", decision, Vec::new()),
                None => {
                    let readback = self.crm.readback(&op.operation_key, traceparent).await;
                    let decision = after_readback(capability, &readback, &op, now, &self.settings);
                    ("readback", decision, vec![("readback", None, readback_evidence(&readback))])
                }
            },
            // The claim never returns decided rows; if it did, nothing is called and nothing changes.
            LedgerState::Settled | LedgerState::Review => (
                "none",
                Decision {
                    state: op.prior_state,
                    after: Duration::ZERO,
                    crm_task_id: None,
                    proof: None,
                    note: format!("claimed while {}: nothing to do", op.prior_state),
                },
                Vec::new(),
            ),
        };
        // One evidence row per call, carrying the decision; a decision made without a call is a
        // row of its own.
        if events.is_empty() {
            events.push(("decision", None, decision.note.clone()));
        }
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
                let last = o.events.len().saturating_sub(1);
                o.events
                    .iter()
                    .enumerate()
                    .map(|(i, (kind, attempt, evidence))| Event {
                        kind,
                        attempt: *attempt,
                        evidence,
                        // The call's row carries the decision (a lone decision row is its own note).
                        decision: (i == last && *kind != "decision").then_some(o.decision.note.as_str()),
                    })
                    .collect()
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
        let applied = match ledger::record_many(&self.pool, self.crm.account(), &items).await {
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
            let result = if applied { o.decision.state.as_str() } else { "lease_lost" };
            self.metrics.crm_calls.get_or_create(&CallLabels { call: o.call, result }).inc();
            if !applied {
                tracing::warn!(operation_key = %o.operation_key, call = o.call, note = %o.decision.note,
                    "lease lost before recording: another replica owns the key; evidence kept, decision not applied");
                continue;
            }
            if o.decision.state == LedgerState::Review {
                tracing::warn!(operation_key = %o.operation_key, call = o.call, note = %o.decision.note, "held for review");
            } else {
                tracing::info!(operation_key = %o.operation_key, call = o.call, state = %o.decision.state,
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

    /// Releases claims whose call was never sent (see [`ledger::release_unsent`]); a failure is
    /// logged, and the leases then expire and are read back like a dead replica's.
    async fn release(&self, unsent: Vec<Held>) {
        let claims: Vec<(&str, &ClaimedOperation)> = unsent.iter().map(|h| (h.claim.as_str(), &h.op)).collect();
        match ledger::release_unsent(&self.pool, self.crm.account(), &claims).await {
            Ok(released) => tracing::info!(released, "released rows claimed ahead and never sent"),
            Err(error) => tracing::error!(error = %error_chain(&error), rows = claims.len(),
                "cannot release rows claimed ahead; their leases will expire and they will be read back"),
        }
    }

    /// Dispatches until `token` is cancelled; calls in flight finish and are recorded first, and
    /// rows claimed ahead that were never sent are released.
    ///
    /// A pipeline, not waves: up to `in_flight` CRM calls are under way at all times, and the
    /// two statements around them run beside the calls rather than between them. Up to
    /// `claim_ahead` rows are claimed before a slot is free, so a call that ends is followed by
    /// the next one at once rather than by a claim's commit (a row waits at most
    /// [`DispatchSettings::hold_limit`]; past it, it is released unsent); they are claimed
    /// [`DispatchSettings::claim_batch`] or more at a time. A row being recorded
    /// keeps its lease, so a claim cannot take it. Decisions are recorded by group commit: one
    /// record statement at a time, and the calls that end while it commits go into the next one
    /// (which waits for [`DispatchSettings::record_batch`] of them, at most [`RECORD_LINGER`]),
    /// so the database sees a few statements per batch of calls rather than a transaction per
    /// call, and a slow commit never holds a free slot idle.
    ///
    /// It claims when rows may be due: after a notification (new ledger rows), a poll tick
    /// (retries and readbacks fall due by time), a claim that filled all the room it asked for,
    /// a release, or a recorded decision that leaves a row undecided.
    pub async fn run_until_stopped(self, token: CancellationToken) -> anyhow::Result<()> {
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.listen(NOTIFY_CHANNEL).await?;
        let mut poll = tokio::time::interval(self.settings.poll_interval);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let this = &self;
        let (ahead, hold_limit) = (self.settings.effective_claim_ahead(), self.settings.hold_limit());
        let (claim_batch, record_batch) = (self.settings.claim_batch(), self.settings.record_batch());
        // Calls, the claim, the record and release statements in flight, whichever ends first.
        let mut work: FuturesUnordered<BoxFuture<'_, Step>> = FuturesUnordered::new();
        let mut calls: i64 = 0;
        // Rows claimed ahead of a free slot, oldest claim first.
        let mut ready: VecDeque<Held> = VecDeque::new();
        // Finished calls waiting for the record statement in flight to commit.
        let mut ended: Vec<Outcome> = Vec::new();
        // When the oldest of them ended: it waits for others at most RECORD_LINGER.
        let mut first_ended = tokio::time::Instant::now();
        let (mut recording, mut claiming) = (false, false);
        let mut maybe_due = true;
        let heartbeat = self.liveness.register("dispatcher", self.stall_after);
        tracing::info!(account = %self.crm.account(), in_flight = self.settings.in_flight, claim_ahead = ahead,
            claim_batch, record_batch, "dispatcher running");
        loop {
            heartbeat.beat();
            // Free slots take the rows claimed ahead; one held too long, or held when stopping,
            // is released unsent. Without claiming ahead every claimed row has a free slot (and
            // the hold limit may be zero), so only a stop releases.
            let mut unsent = Vec::new();
            while let Some(held) = ready.pop_front() {
                if token.is_cancelled() || (ahead > 0 && held.since.elapsed() > hold_limit) {
                    unsent.push(held);
                } else if calls < self.settings.in_flight {
                    calls += 1;
                    work.push(async move { Step::Called(Box::new(this.call(&held.claim, held.op).await)) }.boxed());
                } else {
                    ready.push_front(held);
                    break;
                }
            }
            if !unsent.is_empty() {
                work.push(
                    async move {
                        this.release(unsent).await;
                        Step::Released
                    }
                    .boxed(),
                );
            }
            let record_now = ended.len() >= record_batch
                || calls == 0
                || token.is_cancelled()
                || first_ended.elapsed() >= RECORD_LINGER;
            if !recording && !ended.is_empty() && record_now {
                recording = true;
                let batch = std::mem::take(&mut ended);
                work.push(
                    async move {
                        let (recorded, started) = (batch.len(), std::time::Instant::now());
                        let undecided = batch.iter().any(|o| !o.decision.state.is_decided());
                        this.record(batch).await;
                        tracing::debug!(recorded, record_us = started.elapsed().as_micros() as u64, "dispatch timings");
                        Step::Recorded { undecided }
                    }
                    .boxed(),
                );
            }
            let room = self.settings.in_flight + ahead - calls - ready.len() as i64;
            if maybe_due && !claiming && room >= claim_batch && !token.is_cancelled() {
                (claiming, maybe_due) = (true, false);
                work.push(
                    async move {
                        // The hold is measured from before the claim: the lease starts no earlier.
                        let since = std::time::Instant::now();
                        let (claim, claimed) = this.claim(room).await;
                        Step::Claimed { claim, claimed, room, since }
                    }
                    .boxed(),
                );
            }
            if work.is_empty() {
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
                Some(first) = work.next() => {
                    // Everything else that has ended by now is handled in the same turn.
                    let mut steps = vec![first];
                    while let Some(Some(more)) = work.next().now_or_never() {
                        steps.push(more);
                    }
                    for step in steps {
                        match step {
                            Step::Called(outcome) => {
                                calls -= 1;
                                if ended.is_empty() {
                                    first_ended = tokio::time::Instant::now();
                                }
                                ended.push(*outcome);
                            }
                            Step::Recorded { undecided } => {
                                recording = false;
                                // Rows left undecided are due again once their lease is released.
                                maybe_due |= undecided;
                            }
                            Step::Claimed { claim, claimed, room, since } => {
                                claiming = false;
                                maybe_due |= claimed.len() as i64 == room;
                                ready.extend(claimed.into_iter().map(|op| Held { claim: claim.clone(), op, since }));
                            }
                            // Released rows are due again.
                            Step::Released => maybe_due = true,
                        }
                    }
                }
                notification = listener.recv(), if !maybe_due => {
                    if let Err(error) = notification {
                        tracing::warn!(error = %error_chain(&error), "dispatch listener failed; polling continues");
                    }
                    maybe_due = true;
                }
                _ = poll.tick(), if !maybe_due => maybe_due = true,
                // Decisions waiting for a batch have waited long enough.
                _ = tokio::time::sleep_until(first_ended + RECORD_LINGER), if !recording && !ended.is_empty() => {}
            }
        }
        Ok(())
    }
}

/// A row claimed ahead of a free slot.
struct Held {
    /// The lease token of its claim.
    claim: String,
    op: ClaimedOperation,
    /// When its claim was asked for.
    since: std::time::Instant,
}

/// What ended in the dispatcher's pipeline.
enum Step {
    /// A CRM call (or a rule's decision without one), not recorded yet.
    Called(Box<Outcome>),
    /// A record statement committed (or failed and was logged).
    Recorded { undecided: bool },
    /// A claim asked for at `since` returned these rows under the lease token `claim`, for
    /// `room` slots.
    Claimed { claim: String, claimed: Vec<ClaimedOperation>, room: i64, since: std::time::Instant },
    /// Rows claimed ahead were released unsent (or the release failed and was logged).
    Released,
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

fn create_evidence(call: &str, outcome: &CreateOutcome) -> String {
    let text = match outcome {
        CreateOutcome::Created { task_id, evidence } => format!("{evidence}: task {task_id}"),
        CreateOutcome::Conflict { evidence }
        | CreateOutcome::Permanent { evidence }
        | CreateOutcome::Ambiguous { evidence } => evidence.clone(),
        CreateOutcome::NotExecuted { retry_after, evidence } | CreateOutcome::Unknown { retry_after, evidence } => {
            match retry_after {
                Some(after) => format!("{evidence}, Retry-After {}s", after.as_secs()),
                None => evidence.clone(),
            }
        }
    };
    if call == "replay" { format!("replay with the same key: {text}") } else { text }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(in_flight: i64, claim_ahead: i64, lease_secs: u64) -> DispatchSettings {
        DispatchSettings {
            in_flight,
            claim_ahead,
            lease: Duration::from_secs(lease_secs),
            call_timeout: Duration::from_secs(10),
            ..DispatchSettings::default()
        }
    }

    #[test]
    fn claims_half_the_rows_held_ahead_at_once_and_one_without_claiming_ahead() {
        assert_eq!(settings(16, 16, 60).claim_batch(), 8);
        assert_eq!(settings(64, 64, 60).claim_batch(), 32);
        assert_eq!(settings(1, 1, 60).claim_batch(), 1);
        assert_eq!(settings(16, 0, 60).claim_batch(), 1);
        // A lease with no time to hold claims nothing ahead, so it claims for each free slot.
        assert_eq!(settings(16, 16, 15).claim_batch(), 1);
        // A free slot with nothing held always has room for a batch: in_flight + ahead - (in_flight - 1) > ahead / 2.
        for ahead in 0..40 {
            let s = settings(8, ahead, 60);
            assert!(s.effective_claim_ahead() + 1 >= s.claim_batch(), "ahead {ahead}");
        }
    }

    #[test]
    fn records_a_quarter_of_the_calls_in_flight_at_once_and_at_least_one() {
        assert_eq!(settings(1, 1, 60).record_batch(), 1);
        assert_eq!(settings(4, 4, 60).record_batch(), 1);
        assert_eq!(settings(16, 16, 60).record_batch(), 4);
        assert_eq!(settings(64, 64, 60).record_batch(), 16);
        assert!(RECORD_LINGER < LEASE_MARGIN);
    }
}
