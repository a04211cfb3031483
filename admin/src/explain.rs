//! `handoff-admin explain KEY`: one timeline for one operation key across the approval, the outbox,
//! the stream, the inbox, the CRM (local task or remote ledger with every call and readback),
//! conflicts, dead letters and operator actions, and a verdict saying where the key stands.

use anyhow::Result;
use async_nats::jetstream::stream::RawMessageErrorKind;
use chrono::{DateTime, Utc};
use handoff_consumer::review::{self, ConsumerRecord};
use handoff_relay::outbox::{self, ProducerRecord};
use handoff_shared::{Envelope, headers};
use serde::Serialize;
use sqlx::PgPool;

/// What the stream holds at the sequence the outbox recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "found", rename_all = "snake_case")]
pub enum StreamView {
    /// The message at that sequence is this key; `hash_matches` compares its data with the approval.
    ThisKey { sequence: u64, hash_matches: Option<bool> },
    /// Another message sits at that sequence: the broker reused it after a loss.
    OtherKey { sequence: u64, key: Option<String> },
    /// Nothing at that sequence: deleted, lost, or removed by the stream's limits.
    Missing { sequence: u64, below_first_sequence: bool },
    /// The outbox has no sequence for the key (not published, or its row is past retention).
    NoSequence,
}

/// The whole explanation.
#[derive(Debug, Clone, Serialize)]
pub struct Explanation {
    pub operation_key: String,
    pub producer: Option<ProducerRecord>,
    pub stream: Option<StreamView>,
    pub consumer: Option<ConsumerRecord>,
    pub timeline: Vec<Moment>,
    pub verdict: String,
}

/// One line of the timeline.
#[derive(Debug, Clone, Serialize)]
pub struct Moment {
    pub at: Option<DateTime<Utc>>,
    pub place: &'static str,
    pub what: String,
}

/// Reads the stream at `sequence` and compares it with `key` and the approved `hash`.
pub async fn stream_view(
    js: &async_nats::jetstream::Context,
    stream_name: &str,
    key: &str,
    sequence: Option<i64>,
    approved_hash: Option<&str>,
) -> Result<StreamView> {
    let Some(sequence) = sequence.map(|s| s as u64) else { return Ok(StreamView::NoSequence) };
    let stream = js.get_stream(stream_name).await?;
    match stream.get_raw_message(sequence).await {
        Ok(message) => {
            let found = message.headers.get(headers::MSG_ID).map(|v| v.as_str().to_owned());
            if found.as_deref() != Some(key) {
                return Ok(StreamView::OtherKey { sequence, key: found });
            }
            let hash_matches = Envelope::decode(&message.payload, found.as_deref())
                .ok()
                .zip(approved_hash)
                .map(|(envelope, approved)| envelope.payload.hash().to_string() == approved);
            Ok(StreamView::ThisKey { sequence, hash_matches })
        }
        Err(error) if matches!(error.kind(), RawMessageErrorKind::NoMessageFound) => {
            let first = stream.get_info().await?.state.first_sequence;
            Ok(StreamView::Missing { sequence, below_first_sequence: sequence < first })
        }
        Err(error) => Err(error.into()),
    }
}

/// Gathers everything about `key` from what is given.
pub async fn explain(
    key: &str,
    producer: Option<&PgPool>,
    js: Option<(&async_nats::jetstream::Context, &str)>,
    consumer: Option<&PgPool>,
) -> Result<Explanation> {
    let producer_record = match producer {
        Some(pool) => Some(outbox::producer_record(pool, key).await?),
        None => None,
    };
    let stream = match (js, &producer_record) {
        (Some((js, name)), Some(record)) => {
            let sequence = record.outbox.as_ref().and_then(|o| o.stream_sequence);
            let hash = record.approval.as_ref().and_then(|a| a.payload_hash.as_deref());
            Some(stream_view(js, name, key, sequence, hash).await?)
        }
        _ => None,
    };
    let consumer_record = match consumer {
        Some(pool) => Some(review::consumer_record(pool, key).await?),
        None => None,
    };
    let timeline = timeline(producer_record.as_ref(), stream.as_ref(), consumer_record.as_ref());
    let verdict = verdict(producer_record.as_ref(), stream.as_ref(), consumer_record.as_ref());
    Ok(Explanation {
        operation_key: key.to_owned(),
        producer: producer_record,
        stream,
        consumer: consumer_record,
        timeline,
        verdict,
    })
}

fn timeline(
    producer: Option<&ProducerRecord>,
    stream: Option<&StreamView>,
    consumer: Option<&ConsumerRecord>,
) -> Vec<Moment> {
    let mut moments = Vec::new();
    let mut add =
        |at: Option<DateTime<Utc>>, place: &'static str, what: String| moments.push(Moment { at, place, what });
    if let Some(p) = producer {
        if let Some(a) = &p.approval {
            add(
                Some(a.approved_at),
                "approval",
                format!(
                    "approved by {}; payload hash {}",
                    a.approved_by,
                    a.payload_hash.as_deref().unwrap_or("(computed at first publish)")
                ),
            );
            add(Some(a.recorded_at), "approval", "recorded with its outbox row".into());
        }
        if let Some(o) = &p.outbox {
            match o.state.as_str() {
                "published" => add(
                    o.published_at,
                    "outbox",
                    format!(
                        "published to {} at sequence {} after {} attempt(s){}",
                        o.stream.as_deref().unwrap_or("?"),
                        o.stream_sequence.map_or("?".into(), |s| s.to_string()),
                        o.attempts,
                        if o.duplicate == Some(true) { "; the broker already held it (duplicate)" } else { "" }
                    ),
                ),
                "blocked" => add(
                    Some(o.updated_at),
                    "outbox",
                    format!(
                        "blocked after {} attempt(s): {}",
                        o.attempts,
                        o.last_error.as_deref().unwrap_or("no reason recorded")
                    ),
                ),
                _ => add(
                    Some(o.updated_at),
                    "outbox",
                    format!(
                        "pending after {} attempt(s){}{}{}",
                        o.attempts,
                        if o.leased { "; claimed by a relay now" } else { "" },
                        match o.next_attempt_at {
                            Some(at) => format!("; due {}", at.to_rfc3339()),
                            None => "; held (its action type is paused)".into(),
                        },
                        o.last_error.as_deref().map(|e| format!("; last error: {e}")).unwrap_or_default()
                    ),
                ),
            }
        } else if p.approval.is_some() {
            add(None, "outbox", "no outbox row: published and removed by retention".into());
        }
        for a in &p.audit {
            add(Some(a.at), "operator", format!("{} by {}: {}", a.action, a.actor, a.reason));
        }
    }
    if let Some(view) = stream {
        let what = match view {
            StreamView::ThisKey { sequence, hash_matches: Some(true) } => {
                format!("sequence {sequence} holds this key with the approved payload")
            }
            StreamView::ThisKey { sequence, hash_matches: Some(false) } => {
                format!("sequence {sequence} holds this key with a payload that does NOT match the approval")
            }
            StreamView::ThisKey { sequence, hash_matches: None } => format!("sequence {sequence} holds this key"),
            StreamView::OtherKey { sequence, key } => {
                format!(
                    "sequence {sequence} holds another message ({}): the broker reused the sequence",
                    key.as_deref().unwrap_or("no message id")
                )
            }
            StreamView::Missing { sequence, below_first_sequence: true } => {
                format!("sequence {sequence} is gone: removed by the stream's limits (age or size)")
            }
            StreamView::Missing { sequence, .. } => {
                format!("sequence {sequence} is missing from the stream: deleted or lost by the broker")
            }
            StreamView::NoSequence => "no stream sequence recorded".into(),
        };
        add(None, "stream", what);
    }
    if let Some(c) = consumer {
        if let Some(i) = &c.inbox {
            add(
                Some(i.received_at),
                "inbox",
                format!(
                    "received from sequence {} (payload hash {}): {}",
                    i.stream_sequence, i.payload_hash, i.outcome
                ),
            );
        }
        if let Some(t) = &c.task {
            add(Some(t.created_at), "crm", format!("local task {} created", t.task_id));
        }
        let several = c.ledger.len() > 1;
        for l in &c.ledger {
            // A key sent to several accounts has a history per account: each line names its own.
            let account = if several { format!("[{}] ", l.operation.account) } else { String::new() };
            add(
                Some(l.operation.created_at),
                "ledger",
                format!("{account}accepted for the remote CRM account {}", l.operation.account),
            );
            for e in &l.events {
                add(
                    Some(e.at),
                    "ledger",
                    format!(
                        "{account}{}{}{}: {} -> {}{}",
                        e.kind,
                        e.attempt.map(|a| format!(" #{a}")).unwrap_or_default(),
                        e.replica.as_deref().map(|r| format!(" by {r}")).unwrap_or_default(),
                        e.evidence,
                        e.state_after,
                        e.decision.as_deref().map(|d| format!(" ({d})")).unwrap_or_default()
                    ),
                );
            }
            for a in &l.audit {
                add(Some(a.at), "operator", format!("{account}{} by {}: {}", a.action, a.actor, a.reason));
            }
        }
        for r in &c.conflicts {
            add(
                Some(r.recorded_at),
                "conflict",
                format!(
                    "#{} {} (incoming {}, held {}){}",
                    r.id,
                    r.reason,
                    r.incoming_hash,
                    r.existing_hash,
                    resolved(r.resolved_at, r.resolved_by.as_deref(), r.resolution.as_deref())
                ),
            );
        }
        for d in &c.dead_letters {
            add(
                Some(d.recorded_at),
                "dead letter",
                format!(
                    "#{} from sequence {} after {} deliveries: {}",
                    d.id, d.stream_sequence, d.deliveries, d.reason
                ),
            );
        }
        for a in &c.audit {
            add(Some(a.at), "operator", format!("{} by {}: {}", a.action, a.actor, a.reason));
        }
    }
    // Undated lines (stream, retention) go where they belong: after what is dated before them.
    moments.sort_by_key(|m| m.at);
    moments
}

fn resolved(at: Option<DateTime<Utc>>, by: Option<&str>, how: Option<&str>) -> String {
    match at {
        Some(at) => format!("; resolved {} by {}: {}", at.to_rfc3339(), by.unwrap_or("?"), how.unwrap_or("?")),
        None => "; unresolved".into(),
    }
}

/// Where one ledger row stands.
fn ledger_verdict(o: &handoff_consumer::review::ReviewRow) -> String {
    use handoff_consumer::remote::LedgerState;
    match o.state {
        LedgerState::Settled => format!("settled in the remote CRM: task {}", o.receipt_ref.as_deref().unwrap_or("?")),
        LedgerState::Review => format!("waiting for a person (review): {}", o.note.as_deref().unwrap_or("")),
        LedgerState::Unknown => format!("outcome unknown, being read back: {}", o.note.as_deref().unwrap_or("")),
        LedgerState::Received | LedgerState::Dispatching | LedgerState::ProvedNotExecuted | LedgerState::Replay => {
            format!("remote CRM: {} after {} attempt(s)", o.state, o.attempts)
        }
    }
}

/// Where the key stands, in one sentence.
fn verdict(
    producer: Option<&ProducerRecord>,
    stream: Option<&StreamView>,
    consumer: Option<&ConsumerRecord>,
) -> String {
    let outbox = producer.and_then(|p| p.outbox.as_ref());
    let inbox = consumer.and_then(|c| c.inbox.as_ref());
    if let Some(c) = consumer {
        match c.ledger.as_slice() {
            [] => {}
            [one] => return ledger_verdict(&one.operation),
            several => {
                let each: Vec<String> = several
                    .iter()
                    .map(|l| format!("account {}: {}", l.operation.account, ledger_verdict(&l.operation)))
                    .collect();
                return format!("sent to {} accounts; {}", several.len(), each.join("; "));
            }
        }
        if c.conflicts.iter().any(|r| r.resolved_at.is_none()) {
            return "conflict: the key arrived with a different payload; waiting in the conflict queue".into();
        }
        if let Some(t) = &c.task {
            return match inbox.map(|i| i.outcome.as_str()) {
                Some("task_existed") => format!("done: the CRM already held task {} for this key", t.task_id),
                _ => format!("done: task {} created once", t.task_id),
            };
        }
        if let Some(d) = c.dead_letters.last() {
            return format!("dead-lettered: {}", d.reason);
        }
    }
    if let Some(o) = outbox {
        match o.state.as_str() {
            "blocked" => return format!("blocked at the producer: {}", o.last_error.as_deref().unwrap_or("")),
            "pending" if o.next_attempt_at.is_none() => {
                return "held at the producer: its action type is paused".into();
            }
            "pending" => return format!("waiting to be published (attempt {} so far)", o.attempts),
            _ => {}
        }
    }
    match (stream, inbox, consumer.is_some()) {
        (Some(StreamView::Missing { below_first_sequence: false, .. }), None, true) => {
            "LOST by the broker: published, missing from the stream, never received; run `handoff-admin reconcile --repair`".into()
        }
        (Some(StreamView::OtherKey { .. }), None, true) => {
            "LOST by the broker: its sequence now holds another message; run `handoff-admin reconcile --repair`".into()
        }
        (Some(StreamView::ThisKey { .. }), None, true) => "published, waiting in the stream for the consumer".into(),
        (_, Some(i), _) => format!("received by the consumer: {}", i.outcome),
        _ if producer.is_some_and(|p| p.approval.is_none()) && inbox.is_none() => "unknown key: nothing recorded anywhere".into(),
        _ if outbox.is_some_and(|o| o.state == "published") => "published".into(),
        _ => "not enough connections to say more (give the producer and consumer databases and NATS)".into(),
    }
}

/// The explanation as a person reads it.
pub fn render(e: &Explanation) -> String {
    let mut out = format!("{}\n", e.operation_key);
    for m in &e.timeline {
        let at = m.at.map_or_else(|| "-".repeat(20), |at| at.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string());
        out += &format!("  {at:<24}  {:<11}  {}\n", m.place, m.what);
    }
    out += &format!("verdict: {}\n", e.verdict);
    out
}
