//! `handoff-admin reconcile`: compares, for a range, the published outbox rows, the stream, the
//! inbox and the CRM, and names every key that differs (see [`MismatchKind`]). `--repair`
//! re-queues the rows the broker lost, under the same key, with an audit row each.
//!
//! It works in chunks (outbox rows in commit order, inbox rows in key order; see
//! `handoff_relay::reconcile`), reads the stream many messages at a time, and only reads, except
//! for the repair: safe to run while relays and consumers run.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::Result;
use chrono::{DateTime, Utc};
use handoff_consumer::review;
use handoff_relay::outbox;
use handoff_relay::reconcile::{self, AtSequence, MismatchKind, Position, Requeued, Scope};
use serde::Serialize;
use sqlx::PgPool;

/// One key that differs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Mismatch {
    pub kind: MismatchKind,
    pub operation_key: String,
    /// The sequence the outbox (or, for keys the producer never recorded, the inbox) names.
    pub stream_sequence: Option<i64>,
    /// For a reused sequence: the message id found there.
    pub found: Option<String>,
    /// Whether `--repair` puts it back (the consumer never received it).
    pub repairable: bool,
}

/// What a run found and did.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub published_rows_checked: u64,
    pub inbox_rows_checked: u64,
    /// Published rows whose message is gone from the stream but which the consumer received: no
    /// loss, nothing to repair.
    pub gone_after_delivery: u64,
    pub mismatches: Vec<Mismatch>,
    pub repaired: Vec<Requeued>,
    pub elapsed_s: f64,
}

impl Report {
    pub fn count(&self, kind: MismatchKind) -> usize {
        self.mismatches.iter().filter(|m| m.kind == kind).count()
    }
}

/// What to repair with, if anything.
#[derive(Debug, Clone)]
pub struct Repair {
    pub actor: String,
    pub reason: String,
}

/// Runs the comparison over `scope`.
pub async fn run(
    producer: &PgPool,
    js: &async_nats::jetstream::Context,
    stream_name: &str,
    consumer: &PgPool,
    scope: Scope,
    repair: Option<&Repair>,
) -> Result<Report> {
    let started = Instant::now();
    let stream = js.get_stream(stream_name).await?;
    let info = stream.get_info().await?;
    let (first_sequence, duplicate_window) = (info.state.first_sequence, info.config.duplicate_window);
    let mut report = Report {
        published_rows_checked: 0,
        inbox_rows_checked: 0,
        gone_after_delivery: 0,
        mismatches: Vec::new(),
        repaired: Vec::new(),
        elapsed_s: 0.0,
    };

    // Producer -> stream -> consumer: is every published row still where its PubAck said?
    let mut position = Position::start();
    loop {
        let chunk = reconcile::published_chunk(producer, scope, &position, reconcile::CHUNK_ROWS).await?;
        report.published_rows_checked += chunk.rows.len() as u64;
        let found = reconcile::probe(&stream, &chunk.rows, first_sequence).await?;
        let suspects: Vec<(usize, AtSequence)> =
            found.into_iter().enumerate().filter(|(_, at)| *at != AtSequence::Same).collect();
        if !suspects.is_empty() {
            let keys: Vec<String> = suspects.iter().map(|(i, _)| chunk.rows[*i].operation_key.clone()).collect();
            let received = review::received_keys(consumer, &keys).await?;
            for (i, at) in suspects {
                let row = &chunk.rows[i];
                let delivered = received.contains(&row.operation_key);
                let mismatch = |kind, found| Mismatch {
                    kind,
                    operation_key: row.operation_key.clone(),
                    stream_sequence: Some(row.stream_sequence),
                    found,
                    repairable: !delivered,
                };
                match at {
                    AtSequence::Same => {}
                    AtSequence::Other { key } => report.mismatches.push(mismatch(MismatchKind::SequenceReused, key)),
                    // Gone before the consumer saw it: lost (to the stream's limits, too, if the
                    // consumer was away longer than the stream keeps messages).
                    AtSequence::Missing | AtSequence::Expired if !delivered => {
                        report.mismatches.push(mismatch(MismatchKind::LostByBroker, None))
                    }
                    AtSequence::Missing | AtSequence::Expired => report.gone_after_delivery += 1,
                }
            }
        }
        match chunk.next {
            Some(next) => position = next,
            None => break,
        }
    }

    // Consumer -> producer and CRM: was everything received recorded, and did it reach the CRM?
    let (since, first, last) = scope.bounds();
    let mut after = String::new();
    loop {
        let chunk = review::inbox_chunk(consumer, &after, reconcile::CHUNK_ROWS, since, first, last).await?;
        report.inbox_rows_checked += chunk.keys.len() as u64;
        let keys: Vec<String> = chunk.keys.iter().map(|(k, _)| k.clone()).collect();
        let recorded = outbox::recorded_keys(producer, &keys).await?;
        for (key, sequence) in &chunk.keys {
            if !recorded.contains(key) {
                report.mismatches.push(Mismatch {
                    kind: MismatchKind::NotRecordedByProducer,
                    operation_key: key.clone(),
                    stream_sequence: Some(*sequence),
                    found: None,
                    repairable: false,
                });
            }
        }
        let missing: HashSet<&String> = chunk.task_missing.iter().collect();
        for (key, sequence) in chunk.keys.iter().filter(|(k, _)| missing.contains(k)) {
            report.mismatches.push(Mismatch {
                kind: MismatchKind::TaskMissing,
                operation_key: key.clone(),
                stream_sequence: Some(*sequence),
                found: None,
                repairable: false,
            });
        }
        match chunk.next {
            Some(next) => after = next,
            None => break,
        }
    }

    if let Some(repair) = repair {
        let keys: Vec<String> =
            report.mismatches.iter().filter(|m| m.repairable).map(|m| m.operation_key.clone()).collect();
        if !keys.is_empty() {
            report.repaired =
                reconcile::requeue(producer, &keys, duplicate_window, &repair.actor, &repair.reason).await?;
        }
    }
    report.mismatches.sort_by(|a, b| (a.kind, &a.operation_key).cmp(&(b.kind, &b.operation_key)));
    report.elapsed_s = started.elapsed().as_secs_f64();
    Ok(report)
}

/// Parses `--since`: an RFC 3339 time, or an age such as `90m`, `2h`, `7d` counted back from now.
pub fn parse_since(text: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(at) = DateTime::parse_from_rfc3339(text) {
        return Ok(at.with_timezone(&Utc));
    }
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let n: u64 =
        number.parse().map_err(|_| format!("expected an RFC 3339 time or an age like 90m, 2h, 7d: {text:?}"))?;
    let seconds = match unit {
        "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        "d" => n * 86_400,
        _ => return Err(format!("unknown unit {unit:?} in {text:?}: use s, m, h or d")),
    };
    Ok(Utc::now() - chrono::Duration::from_std(Duration::from_secs(seconds)).map_err(|e| e.to_string())?)
}

/// The report as a person reads it.
pub fn render(report: &Report) -> String {
    let mut out = format!(
        "checked {} published rows and {} inbox rows in {:.1}s\n",
        report.published_rows_checked, report.inbox_rows_checked, report.elapsed_s
    );
    for kind in MismatchKind::ALL {
        out += &format!("{:<26} {}\n", kind.as_str(), report.count(kind));
    }
    if report.gone_after_delivery > 0 {
        out += &format!(
            "{:<26} {} (received before they left the stream: nothing to repair)\n",
            "gone_after_delivery", report.gone_after_delivery
        );
    }
    for m in &report.mismatches {
        out += &format!(
            "{:<26} {}  sequence {}{}{}\n",
            m.kind.as_str(),
            m.operation_key,
            m.stream_sequence.map_or("-".into(), |s| s.to_string()),
            m.found.as_deref().map(|f| format!("  (holds {f})")).unwrap_or_default(),
            if m.repairable { "  repairable" } else { "" }
        );
    }
    for r in &report.repaired {
        out += &format!("re-queued                  {}  publishes from {}\n", r.operation_key, r.due_at.to_rfc3339());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_takes_a_time_or_an_age() {
        assert_eq!(parse_since("2026-11-29T10:00:00Z").unwrap().to_rfc3339(), "2026-11-29T10:00:00+00:00");
        let two_hours = Utc::now() - parse_since("2h").unwrap();
        assert!((7190..=7210).contains(&two_hours.num_seconds()), "{two_hours}");
        for bad in ["", "h", "2w", "yesterday"] {
            assert!(parse_since(bad).is_err(), "{bad}");
        }
    }
}
