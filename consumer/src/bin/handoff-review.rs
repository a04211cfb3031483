//! `handoff-review`: the operators' queue for the remote-CRM ledger.
//!
//! ```text
//! handoff-review list [--state unknown --state review]     what needs a person
//! handoff-review list --state dead-letter                  messages that could not be processed
//! handoff-review list --state blocked --outbox-database-url URL   outbox rows the relay gave up on
//! handoff-review show KEY                                  the key's full history
//! handoff-review resolve KEY --receipt REF --actor A --reason R
//! handoff-review approve-retry KEY --actor A --reason R
//! handoff-review export --format csv|json [--state ...]
//! ```

use clap::{Parser, Subcommand, ValueEnum};
use handoff_consumer::review::{self, ExportFormat};
use handoff_shared::config::DatabaseArgs;

#[derive(Debug, Parser)]
#[command(name = "handoff-review", version, about = "Review queue for actions whose CRM outcome needs a person")]
struct Cli {
    #[command(flatten)]
    database: DatabaseArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Queue {
    Unknown,
    Review,
    DeadLetter,
    Blocked,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List what needs attention (default: unknown and review).
    List {
        #[arg(long = "state", value_enum)]
        states: Vec<Queue>,
        /// The producer database, for `--state blocked`.
        #[arg(long, env = "HANDOFF_OUTBOX_DATABASE_URL", hide_env_values = true)]
        outbox_database_url: Option<String>,
    },
    /// Show one key's ledger row, every attempt, readback and decision, and every resolution.
    Show { operation_key: String },
    /// Record the CRM receipt a person found, settling the key.
    Resolve {
        operation_key: String,
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
        #[arg(long)]
        actor: String,
        /// The evidence of non-execution.
        #[arg(long)]
        reason: String,
    },
    /// Export unknown and review rows (non-secret fields only).
    Export {
        #[arg(long, value_enum, default_value = "csv")]
        format: ExportFormat,
        #[arg(long = "state", value_enum)]
        states: Vec<Queue>,
    },
}

fn ledger_states(queues: &[Queue]) -> Vec<&'static str> {
    let queues = if queues.is_empty() { &[Queue::Unknown, Queue::Review][..] } else { queues };
    queues
        .iter()
        .filter_map(|q| match q {
            Queue::Unknown => Some("unknown"),
            Queue::Review => Some("review"),
            Queue::DeadLetter | Queue::Blocked => None,
        })
        .collect()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let pool = cli.database.connect("handoff-review").await?;
    match cli.command {
        Command::List { states, outbox_database_url } => {
            let ledger = ledger_states(&states);
            if !ledger.is_empty() {
                for row in review::list(&pool, &ledger).await? {
                    println!(
                        "{:<12} {:<48} attempts={} receipt={} {}",
                        row.state,
                        row.operation_key,
                        row.attempts,
                        row.receipt_ref.as_deref().unwrap_or("-"),
                        row.note.as_deref().unwrap_or("")
                    );
                }
            }
            if states.contains(&Queue::DeadLetter) {
                for row in review::dead_letters(&pool).await? {
                    println!(
                        "dead-letter  seq={} id={} deliveries={} {}",
                        row.stream_sequence,
                        row.message_id.as_deref().unwrap_or("-"),
                        row.deliveries,
                        row.reason
                    );
                }
            }
            if states.contains(&Queue::Blocked) {
                let url = outbox_database_url
                    .ok_or_else(|| anyhow::anyhow!("--state blocked needs --outbox-database-url"))?;
                let outbox = DatabaseArgs::plain(url).connect("handoff-review").await?;
                for row in review::blocked(&outbox).await? {
                    println!(
                        "blocked      {:<48} attempts={} {}",
                        row.operation_key,
                        row.attempts,
                        row.last_error.as_deref().unwrap_or("")
                    );
                }
            }
        }
        Command::Show { operation_key } => {
            println!("{}", serde_json::to_string_pretty(&review::history(&pool, &operation_key).await?)?);
        }
        Command::Resolve { operation_key, receipt, actor, reason } => {
            review::resolve_with_receipt(&pool, &operation_key, &receipt, &actor, &reason).await?;
            println!("{operation_key}: settled with receipt {receipt}");
        }
        Command::ApproveRetry { operation_key, actor, reason } => {
            review::approve_new_attempt(&pool, &operation_key, &actor, &reason).await?;
            println!("{operation_key}: one new attempt approved");
        }
        Command::Export { format, states } => {
            let rows = review::list(&pool, &ledger_states(&states)).await?;
            print!("{}", review::export(&rows, format)?);
        }
    }
    Ok(())
}
