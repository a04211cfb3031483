//! The consumer's metrics, served at `/metrics` (see README "Operating it").
//!
//! Message and CRM-call counters are updated once per batch or per recorded decision; gauges that
//! need the broker or the database (the durable consumer's pending and unacknowledged messages,
//! ledger rows by state, review and dead-letter depth) are set by one sampler per replica at a fixed
//! interval, never per scrape. Labels are bounded: the action type, an outcome, a call, a state;
//! never the operation key.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::remote::LedgerState;

/// `action="namespace:action", outcome="created"`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MessageLabels {
    pub action: String,
    pub outcome: &'static str,
}

/// `call="create", result="settled"`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    pub call: &'static str,
    pub result: &'static str,
}

/// `call="create"`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabel {
    pub call: &'static str,
}

/// `path="one_statement"`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PathLabel {
    pub path: &'static str,
}

/// The path words of `handoff_consumer_batches_total`: how a batch was recorded.
pub mod path {
    /// The usual batch (every key new), in one statement.
    pub const ONE_STATEMENT: &str = "one_statement";
    /// Any other batch, in the batch transaction that decides each message.
    pub const TRANSACTION: &str = "transaction";
    pub const ALL: [&str; 2] = [ONE_STATEMENT, TRANSACTION];
}

/// `state="unknown"`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: &'static str,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// The outcome words of `handoff_consumer_messages_total`.
pub mod outcome {
    pub const CREATED: &str = "created";
    pub const ACCEPTED: &str = "accepted";
    pub const DUPLICATE: &str = "duplicate";
    pub const CONFLICT: &str = "conflict";
    pub const DEAD_LETTERED: &str = "dead_lettered";
    pub const NAKED: &str = "naked";
    /// A newer envelope version than the replica reads, offered again later.
    pub const HELD: &str = "held_newer_version";
    pub const ALL: [&str; 7] = [CREATED, ACCEPTED, DUPLICATE, CONFLICT, DEAD_LETTERED, NAKED, HELD];
}

/// Process totals behind the progress line.
#[derive(Debug, Default)]
pub struct Totals {
    pub handled: AtomicU64,
    pub created: AtomicU64,
    pub retried: AtomicU64,
}

/// Every metric a consumer replica exports. Cloning shares the values.
#[derive(Debug, Clone)]
pub struct ConsumerMetrics {
    pub messages: Family<MessageLabels, Counter>,
    pub batch_duration: Histogram,
    pub batch_paths: Family<PathLabel, Counter>,
    pub batch_errors: Counter,
    pub unsigned: Counter,
    pub pending_messages: Gauge,
    pub ack_pending_messages: Gauge,
    pub redelivered_messages: Gauge,
    pub crm_calls: Family<CallLabels, Counter>,
    pub crm_call_duration: Family<CallLabel, Histogram>,
    pub ledger_rows: Family<StateLabel, Gauge>,
    pub oldest_unknown_age: FloatGauge,
    pub review_rows: Gauge,
    pub conflict_rows: Gauge,
    pub dead_letter_rows: Gauge,
    pub paused_action_types: Gauge,
    pub sample_errors: Counter,
    pub totals: Arc<Totals>,
}

/// The ledger states sampled into `handoff_ledger_rows` (settled rows are history: they are
/// counted by `handoff_crm_calls_total`, not sampled).
pub const SAMPLED_LEDGER_STATES: [LedgerState; 6] = [
    LedgerState::Received,
    LedgerState::Dispatching,
    LedgerState::Unknown,
    LedgerState::ProvedNotExecuted,
    LedgerState::Replay,
    LedgerState::Review,
];

fn histogram() -> Histogram {
    Histogram::new(handoff_shared::observe::duration_buckets())
}

impl ConsumerMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            messages: Family::default(),
            batch_duration: histogram(),
            batch_paths: Family::default(),
            batch_errors: Counter::default(),
            unsigned: Counter::default(),
            pending_messages: Gauge::default(),
            ack_pending_messages: Gauge::default(),
            redelivered_messages: Gauge::default(),
            crm_calls: Family::default(),
            crm_call_duration: Family::new_with_constructor(histogram),
            ledger_rows: Family::default(),
            oldest_unknown_age: FloatGauge::default(),
            review_rows: Gauge::default(),
            conflict_rows: Gauge::default(),
            dead_letter_rows: Gauge::default(),
            paused_action_types: Gauge::default(),
            sample_errors: Counter::default(),
            totals: Arc::default(),
        };
        let m = metrics.clone();
        registry.register(
            "handoff_consumer_messages",
            "Messages handled, by action type and outcome (created, accepted, duplicate, conflict, dead_lettered, naked, held_newer_version)",
            m.messages,
        );
        registry.register_with_unit(
            "handoff_consumer_batch_duration",
            "Time to verify, commit and acknowledge one batch",
            Unit::Seconds,
            m.batch_duration,
        );
        registry.register(
            "handoff_consumer_batches",
            "Batches recorded, by path: one_statement (every key new) or transaction (redeliveries, conflicts, dead letters)",
            m.batch_paths.clone(),
        );
        registry.register(
            "handoff_consumer_batch_errors",
            "Batch transactions that failed (their messages were retried one by one)",
            m.batch_errors,
        );
        registry.register(
            "handoff_consumer_unsigned_messages",
            "Unsigned messages accepted under --allow-unsigned (drop the flag once this stops growing)",
            m.unsigned,
        );
        registry.register(
            "handoff_consumer_pending_messages",
            "Messages in the stream the durable consumer has not delivered yet, sampled",
            m.pending_messages,
        );
        registry.register(
            "handoff_consumer_ack_pending_messages",
            "Messages delivered to replicas and not acknowledged yet, sampled",
            m.ack_pending_messages,
        );
        registry.register(
            "handoff_consumer_redelivered_messages",
            "Unacknowledged messages delivered more than once, sampled",
            m.redelivered_messages,
        );
        registry.register(
            "handoff_crm_calls",
            "Remote CRM calls, by call and the state recorded after it",
            m.crm_calls,
        );
        registry.register_with_unit(
            "handoff_crm_call_duration",
            "Duration of remote CRM calls, by call",
            Unit::Seconds,
            m.crm_call_duration,
        );
        registry.register(
            "handoff_ledger_rows",
            "Remote-CRM ledger rows not settled, by state, sampled",
            m.ledger_rows,
        );
        registry.register_with_unit(
            "handoff_ledger_oldest_unknown_age",
            "Age of the oldest unknown outcome (0 when none), sampled",
            Unit::Seconds,
            m.oldest_unknown_age,
        );
        registry.register(
            "handoff_review_rows",
            "Ledger rows waiting for a person (state review), sampled",
            m.review_rows,
        );
        registry.register(
            "handoff_conflict_rows",
            "Unresolved conflicts (same key, different payload), sampled",
            m.conflict_rows,
        );
        registry.register("handoff_dead_letter_rows", "Unresolved dead letters, sampled", m.dead_letter_rows);
        registry.register(
            "handoff_paused_action_types",
            "Action types paused by an operator, sampled",
            m.paused_action_types,
        );
        registry.register(
            "handoff_consumer_sample_errors",
            "Failed samples (the sampled gauges keep their last value)",
            m.sample_errors,
        );
        for state in SAMPLED_LEDGER_STATES {
            let _ = metrics.ledger_rows.get_or_create(&StateLabel { state: state.as_str() });
        }
        for path in path::ALL {
            let _ = metrics.batches(path);
        }
        metrics
    }

    /// The batch counter of one [`path`].
    pub fn batches(&self, path: &'static str) -> Counter {
        self.batch_paths.get_or_create(&PathLabel { path }).clone()
    }

    /// Adds one batch's counts per (action type, outcome).
    pub fn add_messages(&self, counts: &HashMap<(String, &'static str), u64>) {
        let mut handled = 0;
        // Every outcome of an action type exists once the type is seen, at zero until it happens,
        // so `increase(...{outcome="dead_lettered"}[5m])` works before the first dead letter.
        for (action, _) in counts.keys() {
            for outcome in outcome::ALL {
                let _ = self.messages.get_or_create(&MessageLabels { action: action.clone(), outcome });
            }
        }
        for ((action, outcome), n) in counts {
            self.messages.get_or_create(&MessageLabels { action: action.clone(), outcome }).inc_by(*n);
            handled += n;
            if *outcome == outcome::CREATED || *outcome == outcome::ACCEPTED {
                self.totals.created.fetch_add(*n, Ordering::Relaxed);
            }
            if *outcome == outcome::NAKED {
                self.totals.retried.fetch_add(*n, Ordering::Relaxed);
            }
        }
        self.totals.handled.fetch_add(handled, Ordering::Relaxed);
    }
}

/// `namespace:action` of a received key, or `invalid` for a message whose key could not be read.
pub fn action_type(operation_key: Option<&str>) -> String {
    operation_key.and_then(handoff_shared::action_type_of).unwrap_or("invalid").to_owned()
}
