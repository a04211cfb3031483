//! `handoff-admin`: the operators' command. It reads the producer database, the broker and the
//! consumer database (each only when a subcommand needs it), prints for people, and `--json` for
//! scripts. Every change it makes records actor, time and reason in an audit table; nothing is
//! ever deleted.
//!
//! * [`status`]: the whole path on one screen, with the seeds' measures.
//! * [`explain`]: one key's timeline across every table and the stream.
//! * [`reconcile`]: published rows against the stream and the consumer; `--repair`.
//! * [`queue`]: the queues (`list`, `export`; `blocked`, `conflicts`, `dead-letter`), resolved with
//!   `resolve`, `approve-retry`, `blocked unblock`, `conflicts resolve`, `dead-letter replay`.
//! * `pause` / `resume` of an action type, at the relays and at the dispatchers.
//! * `keygen`: a new message signing key pair (see [`handoff_shared::signing`]).

pub mod connect;
pub mod explain;
pub mod queue;
pub mod reconcile;
pub mod status;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
use handoff_relay::reconcile::Scope;
use handoff_shared::config::NatsArgs;
use handoff_shared::signing::{KeyId, SigningKey};
use std::path::PathBuf;

use crate::connect::{Connections, jetstream};
use crate::queue::Queue;

/// Exit status of `reconcile` when it found keys that differ (0 means everything matched).
pub const EXIT_MISMATCHES: u8 = 3;

/// Operators' command for handoff: status, explain, reconcile, the queues, pause and resume.
#[derive(Debug, Parser)]
#[command(name = "handoff-admin", version)]
pub struct Cli {
    #[command(flatten)]
    pub connections: Connections,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// How the whole path stands: outbox, stream, durable consumer, inbox, CRM, queues, paused
    /// action types, and the measures (settled without a person, duplicates, uncertain).
    Status {
        #[command(flatten)]
        nats: NatsArgs,
        /// Skip the broker (no NATS connection).
        #[arg(long)]
        no_stream: bool,
    },
    /// One key's timeline across approval, outbox, stream, inbox, CRM, review, dead letters and
    /// operator actions, with a verdict.
    #[command(alias = "show")]
    Explain {
        operation_key: String,
        #[command(flatten)]
        nats: NatsArgs,
        /// Skip the broker (no NATS connection).
        #[arg(long)]
        no_stream: bool,
    },
    /// Compare published outbox rows, the stream, the inbox and the CRM for a range and name every
    /// key that differs. Exits 3 when something differs.
    Reconcile {
        /// Rows published (and received) at or after this time: RFC 3339 or an age (90m, 2h, 7d).
        #[arg(long, value_parser = reconcile::parse_since, conflicts_with = "sequences")]
        since: Option<chrono::DateTime<chrono::Utc>>,
        /// Rows whose stream sequence is in A..B (inclusive; A.. and ..B are open).
        #[arg(long)]
        sequences: Option<Scope>,
        /// Re-queue the keys the broker lost for publishing under the same key (audited).
        #[arg(long, requires = "actor")]
        repair: bool,
        /// Who repairs (recorded in the audit row).
        #[arg(long)]
        actor: Option<String>,
        /// Why (recorded in the audit row).
        #[arg(long, default_value = "reconcile --repair: lost by the broker")]
        reason: String,
        #[command(flatten)]
        nats: NatsArgs,
    },
    /// List what needs a person (default: unknown and review ledger rows).
    List {
        #[arg(long = "state", value_enum)]
        states: Vec<Queue>,
    },
    /// Record the CRM receipt a person found, settling the key.
    Resolve {
        operation_key: String,
        /// The destination account whose ledger row to settle; needed only when the key went to
        /// several accounts.
        #[arg(long)]
        account: Option<String>,
        #[arg(long)]
        receipt: String,
        #[arg(long)]
        actor: String,
        #[arg(long)]
        reason: String,
    },
    /// Allow exactly one new attempt with the same key, after proving the CRM never executed it.
    ApproveRetry {
        operation_key: String,
        /// The destination account whose ledger row may try again; needed only when the key went
        /// to several accounts.
        #[arg(long)]
        account: Option<String>,
        #[arg(long)]
        actor: String,
        /// The evidence of non-execution.
        #[arg(long)]
        reason: String,
    },
    /// Export the queues (non-secret fields only, no payloads).
    Export {
        #[arg(long, value_enum, default_value = "csv")]
        format: handoff_consumer::review::ExportFormat,
        #[arg(long = "state", value_enum)]
        states: Vec<Queue>,
    },
    /// Outbox rows the relay gave up on (producer database).
    #[command(subcommand)]
    Blocked(BlockedCommand),
    /// Same key, different payload (consumer database).
    #[command(subcommand)]
    Conflicts(ConflictsCommand),
    /// Messages that could not be processed (consumer database).
    #[command(subcommand)]
    DeadLetter(DeadLetterCommand),
    /// Pause an action type (`namespace:action`): relays hold its rows without counting attempts,
    /// dispatchers hold its CRM calls. Applies to each database given.
    Pause {
        action_type: String,
        #[arg(long)]
        actor: String,
        #[arg(long)]
        reason: String,
    },
    /// Resume a paused action type: held rows are published, held calls made.
    Resume {
        action_type: String,
        #[arg(long)]
        actor: String,
        #[arg(long)]
        reason: String,
    },
    /// Write a new message signing key pair (HMAC-SHA256: both files hold the same secret, so
    /// both are secrets). Existing files are never overwritten. Needs no connection.
    Keygen {
        /// Where the relays' signing key goes (HANDOFF_SIGNING_KEY_FILE).
        #[arg(long, value_name = "FILE")]
        signing_key: PathBuf,
        /// Where the consumers' verify key goes (one of HANDOFF_VERIFY_KEY_FILES).
        #[arg(long, value_name = "FILE")]
        verify_key: PathBuf,
        /// The key's id in every signed message (default: a fingerprint of the secret).
        #[arg(long, value_parser = parse_key_id)]
        key_id: Option<KeyId>,
        /// When both files already hold the same valid key, keep it and exit 0 (for a one-shot
        /// that runs at every deployment); one file without the other is still an error.
        #[arg(long)]
        keep_existing: bool,
    },
}

fn parse_key_id(s: &str) -> Result<KeyId, String> {
    KeyId::new(s).map_err(|e| e.to_string())
}

#[derive(Debug, Subcommand)]
pub enum BlockedCommand {
    /// List blocked rows with their last error.
    List,
    /// Put a blocked row back for publishing (same key, fresh attempt budget; audited).
    Unblock {
        operation_key: String,
        #[arg(long)]
        actor: String,
        #[arg(long)]
        reason: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum ConflictsCommand {
    /// List unresolved conflicts.
    List,
    /// Show one conflict.
    Show { id: i64 },
    /// Record a person's decision and close the conflict (the approved task stays as it is).
    Resolve {
        id: i64,
        #[arg(long)]
        actor: String,
        #[arg(long)]
        reason: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum DeadLetterCommand {
    /// List unresolved dead letters.
    List,
    /// Show one dead letter with its headers (and its body with --body: it may hold personal data).
    Show {
        id: i64,
        #[arg(long)]
        body: bool,
    },
    /// Ask the replicas to replay a dead letter once its cause is fixed (audited); a replica handles
    /// it within its sample interval, and the inbox still decides once per key.
    Replay {
        id: i64,
        #[arg(long)]
        actor: String,
        #[arg(long)]
        reason: String,
    },
}

/// Runs one command; the exit code says whether reconciliation found differences.
pub async fn run(cli: Cli) -> Result<ExitCode> {
    let c = &cli.connections;
    match cli.command {
        Command::Keygen { signing_key, verify_key, key_id, keep_existing } => {
            anyhow::ensure!(signing_key != verify_key, "--signing-key and --verify-key must be two files");
            if keep_existing && (signing_key.exists() || verify_key.exists()) {
                let (signing, verify) = (SigningKey::read(&signing_key)?, SigningKey::read(&verify_key)?);
                anyhow::ensure!(
                    signing == verify,
                    "{} and {} hold different keys ({} and {})",
                    signing_key.display(),
                    verify_key.display(),
                    signing.id(),
                    verify.id()
                );
                println!(
                    "key {}: kept the existing pair in {} and {}",
                    signing.id(),
                    signing_key.display(),
                    verify_key.display()
                );
                return Ok(ExitCode::SUCCESS);
            }
            let key = SigningKey::generate(key_id)?;
            key.write(&signing_key, "signing")?;
            if let Err(error) = key.write(&verify_key, "verify") {
                // Leave nothing half made: a signing key without its verify key is useless.
                let _ = std::fs::remove_file(&signing_key);
                return Err(error.into());
            }
            println!(
                "key {}: signing key in {}, verify key in {} (both secret, mode 0600)",
                key.id(),
                signing_key.display(),
                verify_key.display()
            );
        }
        Command::Status { nats, no_stream } => {
            let (producer, consumer) = (c.producer_if_given().await?, c.consumer_if_given().await?);
            let js = if no_stream { None } else { Some(jetstream(&nats).await?) };
            let status = status::gather(
                producer.as_ref(),
                js.as_ref().map(|js| (js, c.stream.as_str(), c.consumer_name.as_str())),
                consumer.as_ref(),
            )
            .await?;
            print(cli.json, &status, status::render)?;
        }
        Command::Explain { operation_key, nats, no_stream } => {
            let (producer, consumer) = (c.producer_if_given().await?, c.consumer_if_given().await?);
            anyhow::ensure!(
                producer.is_some() || consumer.is_some(),
                "explain needs a database: --producer-database-url and/or --consumer-database-url"
            );
            let js = if no_stream || producer.is_none() { None } else { Some(jetstream(&nats).await?) };
            let explanation = explain::explain(
                &operation_key,
                producer.as_ref(),
                js.as_ref().map(|js| (js, c.stream.as_str())),
                consumer.as_ref(),
            )
            .await?;
            print(cli.json, &explanation, explain::render)?;
        }
        Command::Reconcile { since, sequences, repair, actor, reason, nats } => {
            let producer = c.producer("reconcile").await?;
            let consumer = c.consumer("reconcile").await?;
            let js = jetstream(&nats).await?;
            let scope = match (since, sequences) {
                (Some(at), _) => Scope::Since(at),
                (None, Some(range)) => range,
                (None, None) => Scope::All,
            };
            let repair = repair.then(|| reconcile::Repair { actor: actor.unwrap_or_default(), reason });
            let report = reconcile::run(&producer, &js, &c.stream, &consumer, scope, repair.as_ref()).await?;
            print(cli.json, &report, reconcile::render)?;
            if !report.mismatches.is_empty() {
                return Ok(ExitCode::from(EXIT_MISMATCHES));
            }
        }
        Command::List { states } => {
            let (consumer, producer) = queue_databases(c, "list", &states).await?;
            let rows = queue::list(consumer.as_ref(), producer.as_ref(), &states).await?;
            print(cli.json, &rows, queue::render)?;
        }
        Command::Resolve { operation_key, account, receipt, actor, reason } => {
            let consumer = c.consumer("resolve").await?;
            handoff_consumer::review::resolve_with_receipt(
                &consumer,
                &operation_key,
                account.as_deref(),
                &receipt,
                &actor,
                &reason,
            )
            .await?;
            println!("{operation_key}: settled with receipt {receipt}");
        }
        Command::ApproveRetry { operation_key, account, actor, reason } => {
            let consumer = c.consumer("approve-retry").await?;
            handoff_consumer::review::approve_new_attempt(
                &consumer,
                &operation_key,
                account.as_deref(),
                &actor,
                &reason,
            )
            .await?;
            println!("{operation_key}: one new attempt approved");
        }
        Command::Export { format, states } => {
            let (consumer, producer) = queue_databases(c, "export", &states).await?;
            let rows = queue::list(consumer.as_ref(), producer.as_ref(), &states).await?;
            print!("{}", queue::export(&rows, format)?);
        }
        Command::Blocked(BlockedCommand::List) => {
            let producer = c.producer("blocked list").await?;
            let rows = queue::list(None, Some(&producer), &[Queue::Blocked]).await?;
            print(cli.json, &rows, queue::render)?;
        }
        Command::Blocked(BlockedCommand::Unblock { operation_key, actor, reason }) => {
            let producer = c.producer("blocked unblock").await?;
            handoff_relay::outbox::unblock(&producer, &operation_key, &actor, &reason).await?;
            println!("{operation_key}: unblocked; the relay publishes it at its next claim");
        }
        Command::Conflicts(ConflictsCommand::List) => {
            let consumer = c.consumer("conflicts list").await?;
            let rows = queue::list(Some(&consumer), None, &[Queue::Conflict]).await?;
            print(cli.json, &rows, queue::render)?;
        }
        Command::Conflicts(ConflictsCommand::Show { id }) => {
            let consumer = c.consumer("conflicts show").await?;
            let row = handoff_consumer::review::conflict(&consumer, id).await?;
            print(cli.json, &row, |r| format!("{r:#?}\n"))?;
        }
        Command::Conflicts(ConflictsCommand::Resolve { id, actor, reason }) => {
            let consumer = c.consumer("conflicts resolve").await?;
            let row = handoff_consumer::review::resolve_conflict(&consumer, id, &actor, &reason).await?;
            println!("conflict {id} ({}): resolved by {actor}", row.operation_key);
        }
        Command::DeadLetter(DeadLetterCommand::List) => {
            let consumer = c.consumer("dead-letter list").await?;
            let rows = queue::list(Some(&consumer), None, &[Queue::DeadLetter]).await?;
            print(cli.json, &rows, queue::render)?;
        }
        Command::DeadLetter(DeadLetterCommand::Show { id, body }) => {
            let consumer = c.consumer("dead-letter show").await?;
            let letter = handoff_consumer::review::dead_letter(&consumer, id).await?;
            print(cli.json, &letter, |l| format!("{l:#?}\n"))?;
            if body {
                println!("{}", String::from_utf8_lossy(&letter.body));
            }
        }
        Command::DeadLetter(DeadLetterCommand::Replay { id, actor, reason }) => {
            let consumer = c.consumer("dead-letter replay").await?;
            handoff_consumer::review::request_replay(&consumer, id, &actor, &reason).await?;
            println!("dead letter {id}: replay requested; a replica handles it within its sample interval");
        }
        Command::Pause { action_type, actor, reason } => {
            handoff_relay::outbox::check_action_type(&action_type)?;
            let (producer, consumer) = (c.producer_if_given().await?, c.consumer_if_given().await?);
            anyhow::ensure!(
                producer.is_some() || consumer.is_some(),
                "pause needs --producer-database-url (relays hold rows) and/or --consumer-database-url (dispatchers hold calls)"
            );
            if let Some(pool) = &producer {
                handoff_relay::outbox::pause(pool, &action_type, &actor, &reason).await?;
                println!("{action_type}: paused at the producer; relays hold its rows within their sample interval");
            }
            if let Some(pool) = &consumer {
                handoff_consumer::review::pause(pool, &action_type, &actor, &reason).await?;
                println!("{action_type}: paused at the consumer; dispatchers hold its CRM calls from their next claim");
            }
        }
        Command::Resume { action_type, actor, reason } => {
            handoff_relay::outbox::check_action_type(&action_type)?;
            let (producer, consumer) = (c.producer_if_given().await?, c.consumer_if_given().await?);
            anyhow::ensure!(
                producer.is_some() || consumer.is_some(),
                "resume needs --producer-database-url and/or --consumer-database-url"
            );
            if let Some(pool) = &producer {
                handoff_relay::outbox::resume(pool, &action_type, &actor, &reason).await?;
                println!(
                    "{action_type}: resumed at the producer; relays release its rows within their sample interval"
                );
            }
            if let Some(pool) = &consumer {
                handoff_consumer::review::resume(pool, &action_type, &actor, &reason).await?;
                println!("{action_type}: resumed at the consumer");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The databases the named queues live in: the consumer's for all but `blocked`, the producer's
/// for `blocked`.
async fn queue_databases(
    c: &Connections,
    command: &str,
    queues: &[Queue],
) -> Result<(Option<sqlx::PgPool>, Option<sqlx::PgPool>)> {
    let queues = if queues.is_empty() { &queue::DEFAULT_QUEUES[..] } else { queues };
    let consumer = if queues.iter().any(|q| *q != Queue::Blocked) { Some(c.consumer(command).await?) } else { None };
    let producer = if queues.contains(&Queue::Blocked) {
        Some(c.producer(&format!("{command} --state blocked")).await?)
    } else {
        None
    };
    Ok((consumer, producer))
}

fn print<T: serde::Serialize>(json: bool, value: &T, render: fn(&T) -> String) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(value)?);
    } else {
        print!("{}", render(value));
    }
    Ok(())
}
