//! `handoff-admin status`: one screen of how the whole path stands, from whatever it is given
//! (producer database, broker, consumer database), with the seeds' three measures.

use std::collections::BTreeMap;

use anyhow::Result;
use handoff_consumer::inbox;
use handoff_consumer::remote::{LedgerState, ledger};
use handoff_relay::outbox;
use serde::Serialize;
use sqlx::PgPool;

/// Everything `status` reports; each part is present when its connection was given.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Status {
    pub outbox: Option<OutboxStatus>,
    pub stream: Option<StreamStatus>,
    pub consumer: Option<ConsumerStatus>,
    pub measures: Option<Measures>,
}

#[derive(Debug, Clone, Serialize)]
pub struct OutboxStatus {
    /// Exact (`status` counts the whole outbox; the relay's sampled gauge estimates above 100,000).
    pub pending: i64,
    pub published: i64,
    pub blocked: i64,
    pub oldest_pending_s: f64,
    pub held_back: i64,
    pub held_back_s: f64,
    pub held_back_by: Option<String>,
    pub paused: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StreamStatus {
    pub name: String,
    pub messages: u64,
    pub first_sequence: u64,
    pub last_sequence: u64,
    /// The durable consumer, if it exists.
    pub durable: Option<DurableStatus>,
}

#[derive(Debug, Clone, Serialize)]
pub struct DurableStatus {
    pub name: String,
    pub pending: u64,
    pub unacknowledged: usize,
    pub redelivered: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct ConsumerStatus {
    /// Inbox rows by outcome.
    pub inbox: BTreeMap<String, i64>,
    /// Tasks in the local CRM store.
    pub local_tasks: i64,
    /// Remote-CRM ledger rows by state.
    pub ledger: BTreeMap<LedgerState, i64>,
    pub conflicts: i64,
    pub dead_letters: i64,
    pub paused: Vec<String>,
}

/// The seeds' measures of a handoff: how much settled without a person, duplicates, and how many
/// operations are still uncertain.
#[derive(Debug, Clone, Serialize)]
pub struct Measures {
    /// Keys received by the consumer.
    pub actions: i64,
    /// Of those, settled without a person: a task created or found (local), or a ledger row settled
    /// by a CRM response or a readback (not by an operator's receipt).
    pub settled_without_person: i64,
    pub settled_without_person_share: f64,
    /// Tasks beyond one per key in the local CRM store (the unique index keeps it at 0; a remote
    /// CRM's own count per external id is the evidence there).
    pub duplicates: i64,
    /// Ledger rows whose outcome is not confirmed: unknown, or waiting in review.
    pub uncertain_without_confirmation: i64,
}

/// Gathers the status from what is given.
pub async fn gather(
    producer: Option<&PgPool>,
    js: Option<(&async_nats::jetstream::Context, &str, &str)>,
    consumer: Option<&PgPool>,
) -> Result<Status> {
    let mut status = Status::default();
    if let Some(pool) = producer {
        let sample = outbox::sample_backlog(pool).await?;
        let counts = outbox::count_by_state(pool).await?;
        status.outbox = Some(OutboxStatus {
            pending: counts.pending,
            published: counts.published,
            blocked: counts.blocked,
            oldest_pending_s: sample.oldest_pending_s,
            held_back: sample.held_back,
            held_back_s: sample.held_back_s,
            held_back_by: sample.held_back_by,
            paused: outbox::paused_action_types(pool).await?.into_iter().map(|p| p.action_type).collect(),
        });
    }
    if let Some((js, stream_name, durable)) = js {
        let stream = js.get_stream(stream_name).await?;
        let info = stream.get_info().await?;
        let durable = match stream.consumer_info(durable).await {
            Ok(info) => Some(DurableStatus {
                name: info.name,
                pending: info.num_pending,
                unacknowledged: info.num_ack_pending,
                redelivered: info.num_redelivered,
            }),
            Err(_) => None,
        };
        status.stream = Some(StreamStatus {
            name: stream_name.to_owned(),
            messages: info.state.messages,
            first_sequence: info.state.first_sequence,
            last_sequence: info.state.last_sequence,
            durable,
        });
    }
    if let Some(pool) = consumer {
        let inbox_counts: Vec<(String, i64)> =
            sqlx::query_as("SELECT outcome, count(*) FROM handoff_consumer.inbox GROUP BY outcome")
                .fetch_all(pool)
                .await?;
        let counts = inbox::count_rows(pool).await?;
        let depths = inbox::sample_depths(pool).await?;
        let ledger = ledger::count_by_state(pool).await?;
        let paused: Vec<String> =
            sqlx::query_scalar("SELECT action_type FROM handoff_consumer.paused_action ORDER BY action_type")
                .fetch_all(pool)
                .await?;
        let inbox: BTreeMap<String, i64> = inbox_counts.into_iter().collect();
        let actions: i64 = inbox.values().sum();
        let settled_by_crm: i64 = sqlx::query_scalar(
            r#"SELECT count(*) FROM handoff_consumer.crm_operation
                WHERE state = 'settled' AND proof IS DISTINCT FROM 'operator_receipt'"#,
        )
        .fetch_one(pool)
        .await?;
        let duplicates: i64 =
            sqlx::query_scalar("SELECT count(*) - count(DISTINCT operation_key) FROM handoff_consumer.crm_task")
                .fetch_one(pool)
                .await?;
        let local_settled =
            inbox.get("task_created").copied().unwrap_or(0) + inbox.get("task_existed").copied().unwrap_or(0);
        let settled_without_person = local_settled + settled_by_crm;
        status.measures = Some(Measures {
            actions,
            settled_without_person,
            settled_without_person_share: if actions == 0 {
                1.0
            } else {
                settled_without_person as f64 / actions as f64
            },
            duplicates,
            uncertain_without_confirmation: ledger.get(&LedgerState::Unknown).copied().unwrap_or(0)
                + ledger.get(&LedgerState::Review).copied().unwrap_or(0),
        });
        status.consumer = Some(ConsumerStatus {
            inbox,
            local_tasks: counts.tasks,
            ledger,
            conflicts: depths.conflicts,
            dead_letters: depths.dead_letters,
            paused,
        });
    }
    Ok(status)
}

/// The status as a person reads it.
pub fn render(status: &Status) -> String {
    let mut out = String::new();
    if let Some(o) = &status.outbox {
        out += &format!(
            "outbox     pending {} (oldest {:.0}s)  published {}  blocked {}\n",
            o.pending, o.oldest_pending_s, o.published, o.blocked
        );
        if o.held_back > 0 {
            out += &format!(
                "           held back {} rows for {:.0}s by {}\n",
                o.held_back,
                o.held_back_s,
                o.held_back_by.as_deref().unwrap_or("an open transaction not visible to this role (grant pg_monitor)")
            );
        }
        out += &format!("           paused {}\n", list_or_none(&o.paused));
    }
    if let Some(s) = &status.stream {
        out += &format!(
            "stream     {}  messages {}  first {}  last {}\n",
            s.name, s.messages, s.first_sequence, s.last_sequence
        );
        match &s.durable {
            Some(d) => {
                out += &format!(
                    "consumer   {}  pending {}  unacknowledged {}  redelivered {}\n",
                    d.name, d.pending, d.unacknowledged, d.redelivered
                )
            }
            None => out += "consumer   (durable consumer not found)\n",
        }
    }
    if let Some(c) = &status.consumer {
        out += &format!("inbox      {}\n", counts(&c.inbox));
        out += &format!("crm        local tasks {}  ledger {}\n", c.local_tasks, counts(&c.ledger));
        out += &format!(
            "queues     review {}  conflicts {}  dead letters {}\n",
            c.ledger.get(&LedgerState::Review).copied().unwrap_or(0),
            c.conflicts,
            c.dead_letters
        );
        out += &format!("           paused dispatch {}\n", list_or_none(&c.paused));
    }
    if let Some(m) = &status.measures {
        out += &format!(
            "measures   settled without a person {}/{} ({:.2}%)  duplicates {}  uncertain without confirmation {}\n",
            m.settled_without_person,
            m.actions,
            m.settled_without_person_share * 100.0,
            m.duplicates,
            m.uncertain_without_confirmation
        );
    }
    if out.is_empty() {
        out = "nothing to report: give --producer-database-url, --consumer-database-url and/or --nats-url\n".into();
    }
    out
}

fn counts<K: std::fmt::Display>(map: &BTreeMap<K, i64>) -> String {
    if map.is_empty() {
        return "empty".into();
    }
    map.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join("  ")
}

fn list_or_none(items: &[String]) -> String {
    if items.is_empty() { "none".into() } else { items.join(", ") }
}
