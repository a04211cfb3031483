//! The relay's metrics, served at `/metrics` (see README "Operating it").
//!
//! Counters and histograms are updated by the batch loop, once per batch (per-action counts are
//! summed in the batch first). Gauges that need the database (backlog, oldest pending age, rows
//! held back) are set by one sampler per process at a fixed interval, never per scrape. Labels
//! are bounded: the action type (`namespace:action`), an outcome or a class; never the operation
//! key.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

/// `action="namespace:action"`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabel {
    pub action: String,
}

/// `class="timeout"` etc.: why a publish failed.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassLabel {
    pub class: &'static str,
}

/// `reason="retry_budget"` etc.: why a row was blocked.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

/// `state="pending"` / `state="blocked"`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: &'static str,
}

/// `way="pipelined"` etc.: how a claim was published ([`crate::auto_mode::Way::label`]).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WayLabel {
    pub way: &'static str,
}

/// `kind="lost_by_broker"` etc.: a reconciliation finding.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: &'static str,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// The `reason` values of `handoff_relay_blocked_total`.
pub const BLOCK_REASONS: [&str; 4] = ["retry_budget", "permanent_error", "payload_changed", "invalid_row"];

/// Process totals behind the progress line (label families cannot be summed).
#[derive(Debug, Default)]
pub struct Totals {
    pub published: AtomicU64,
    pub failed_publishes: AtomicU64,
}

impl Totals {
    pub fn add(&self, published: u64, failed_publishes: u64) {
        self.published.fetch_add(published, Ordering::Relaxed);
        self.failed_publishes.fetch_add(failed_publishes, Ordering::Relaxed);
    }
}

/// Every metric the relay exports. Cloning shares the values.
#[derive(Debug, Clone)]
pub struct RelayMetrics {
    pub published: Family<ActionLabel, Counter>,
    pub broker_duplicates: Family<ActionLabel, Counter>,
    pub publish_failures: Family<ClassLabel, Counter>,
    pub blocked: Family<ReasonLabel, Counter>,
    pub held_paused: Family<ActionLabel, Counter>,
    pub batches: Counter,
    pub batch_errors: Counter,
    pub claims_published: Family<WayLabel, Counter>,
    pub atomic_batches: Counter,
    pub atomic_fallbacks: Counter,
    pub claim_duration: Histogram,
    pub publish_duration: Histogram,
    pub settle_duration: Histogram,
    pub outbox_rows: Family<StateLabel, Gauge>,
    pub oldest_pending_age: FloatGauge,
    pub held_back_rows: Gauge,
    pub held_back_transaction_age: FloatGauge,
    pub reconcile_mismatches: Family<KindLabel, Gauge>,
    pub reconcile_runs: Counter,
    pub paused_action_types: Gauge,
    pub sample_errors: Counter,
    pub totals: Arc<Totals>,
}

fn histogram() -> Histogram {
    Histogram::new(handoff_shared::observe::duration_buckets())
}

impl RelayMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            published: Family::default(),
            broker_duplicates: Family::default(),
            publish_failures: Family::default(),
            blocked: Family::default(),
            held_paused: Family::default(),
            batches: Counter::default(),
            batch_errors: Counter::default(),
            claims_published: Family::default(),
            atomic_batches: Counter::default(),
            atomic_fallbacks: Counter::default(),
            claim_duration: histogram(),
            publish_duration: histogram(),
            settle_duration: histogram(),
            outbox_rows: Family::default(),
            oldest_pending_age: FloatGauge::default(),
            held_back_rows: Gauge::default(),
            held_back_transaction_age: FloatGauge::default(),
            reconcile_mismatches: Family::default(),
            reconcile_runs: Counter::default(),
            paused_action_types: Gauge::default(),
            sample_errors: Counter::default(),
            totals: Arc::default(),
        };
        let m = metrics.clone();
        registry.register(
            "handoff_relay_published",
            "Outbox rows the broker acknowledged (duplicates included), by action type",
            m.published,
        );
        registry.register(
            "handoff_relay_broker_duplicates",
            "PubAcks that said the broker already held the message id (a re-publish), by action type",
            m.broker_duplicates,
        );
        registry.register("handoff_relay_publish_failures", "Failed publishes, by class", m.publish_failures);
        registry.register("handoff_relay_blocked", "Rows moved to blocked, by reason", m.blocked);
        registry.register(
            "handoff_relay_held_paused",
            "Claimed rows held back because their action type is paused, by action type",
            m.held_paused,
        );
        registry.register("handoff_relay_batches", "Claim-publish-settle batches completed", m.batches);
        registry.register(
            "handoff_relay_claims_published",
            "Claims sent to the broker, by how: pipelined, atomic, or pipelined_first (auto screening pipelined on a large claim's first rows)",
            m.claims_published,
        );
        registry.register(
            "handoff_relay_atomic_batches",
            "Atomic batches committed (--publish-mode atomic or auto on nats-server 2.15+)",
            m.atomic_batches,
        );
        registry.register(
            "handoff_relay_atomic_fallbacks",
            "Atomic batches the broker refused because one of their ids was already stored (10201), then published per message",
            m.atomic_fallbacks,
        );
        registry.register(
            "handoff_relay_batch_errors",
            "Batches that failed as a whole (the database, usually)",
            m.batch_errors,
        );
        registry.register_with_unit(
            "handoff_relay_claim_duration",
            "Time to claim a batch",
            Unit::Seconds,
            m.claim_duration,
        );
        registry.register_with_unit(
            "handoff_relay_publish_duration",
            "Time from the first publish of a batch to its last PubAck",
            Unit::Seconds,
            m.publish_duration,
        );
        registry.register_with_unit(
            "handoff_relay_settle_duration",
            "Time to record a batch's outcome",
            Unit::Seconds,
            m.settle_duration,
        );
        registry.register(
            "handoff_outbox_rows",
            "Outbox rows by state (pending, blocked), sampled; new rows beyond 100,000 are estimated from row ids",
            m.outbox_rows,
        );
        registry.register_with_unit(
            "handoff_outbox_oldest_pending_age",
            "Age of the oldest pending outbox row (0 when none), sampled",
            Unit::Seconds,
            m.oldest_pending_age,
        );
        registry.register(
            "handoff_outbox_held_back_rows",
            "Committed rows waiting behind an older, still open write transaction, sampled",
            m.held_back_rows,
        );
        registry.register_with_unit(
            "handoff_outbox_held_back_transaction_age",
            "Age of the open transaction holding rows back (0 when none), sampled",
            Unit::Seconds,
            m.held_back_transaction_age,
        );
        registry.register(
            "handoff_reconcile_mismatches",
            "Keys that differ between outbox, stream and consumer at the last reconciliation, by kind",
            m.reconcile_mismatches,
        );
        registry.register("handoff_reconcile_runs", "Periodic reconciliations completed", m.reconcile_runs);
        registry.register(
            "handoff_paused_action_types",
            "Action types paused by an operator, sampled",
            m.paused_action_types,
        );
        registry.register(
            "handoff_relay_sample_errors",
            "Failed database samples (the sampled gauges keep their last value)",
            m.sample_errors,
        );
        // Every bounded label value exists from the start, at zero, so alerts and dashboards can use
        // `rate()` and `increase()` on it before the first event. Per-action series appear with the
        // first row of that action type.
        for class in crate::publisher::FAILURE_CLASSES {
            let _ = metrics.publish_failures.get_or_create(&ClassLabel { class });
        }
        for reason in BLOCK_REASONS {
            let _ = metrics.blocked.get_or_create(&ReasonLabel { reason });
        }
        for state in ["pending", "blocked"] {
            let _ = metrics.outbox_rows.get_or_create(&StateLabel { state });
        }
        for kind in crate::reconcile::MismatchKind::ALL {
            let _ = metrics.reconcile_mismatches.get_or_create(&KindLabel { kind: kind.as_str() });
        }
        metrics
    }

    /// Adds one batch's per-action counts to `family`.
    pub fn add_per_action(family: &Family<ActionLabel, Counter>, counts: &HashMap<&str, u64>) {
        for (action, n) in counts {
            family.get_or_create(&ActionLabel { action: (*action).to_owned() }).inc_by(*n);
        }
    }
}

/// `namespace:action` of a stored key (its whole text if it is malformed; such a row is blocked).
pub fn action_type(operation_key: &str) -> &str {
    handoff_shared::action_type_of(operation_key).unwrap_or(operation_key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_action_type_is_the_first_two_parts_of_the_key() {
        assert_eq!(action_type("harbor:create-followup:v1:case-104"), "harbor:create-followup");
        assert_eq!(action_type("odd"), "odd");
    }

    #[test]
    fn names_follow_prometheus_conventions() {
        let mut registry = Registry::default();
        let metrics = RelayMetrics::register(&mut registry);
        metrics.published.get_or_create(&ActionLabel { action: "harbor:create-followup".into() }).inc_by(3);
        metrics.claim_duration.observe(0.002);
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();
        assert!(text.contains("handoff_relay_published_total{action=\"harbor:create-followup\"} 3"), "{text}");
        assert!(text.contains("# TYPE handoff_relay_claim_duration_seconds histogram"), "{text}");
        assert!(text.contains("handoff_outbox_rows{state=\"blocked\"} 0"), "{text}");
        assert!(text.contains("handoff_outbox_oldest_pending_age_seconds 0"), "{text}");
    }
}
