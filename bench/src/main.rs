//! `handoff-bench`: see the library docs and docs/benchmarks.md. Prints the table on stdout,
//! progress on stderr, and writes the JSON report.

use clap::Parser;
use handoff_bench::BenchArgs;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = BenchArgs::parse().effective();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let json = args.json.clone();
    // On Ctrl-C or SIGTERM the run is dropped here, which stops the services and removes the
    // containers (exiting from a signal handler would leave them behind).
    let report = tokio::select! {
        report = handoff_bench::run(args) => report?,
        _ = interrupted() => anyhow::bail!("interrupted; servers and services stopped"),
    };
    println!("{}", report.table());
    if let Some(dir) = json.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&json, serde_json::to_vec_pretty(&report)?)?;
    eprintln!("report written to {} ({:.0} s)", json.display(), report.elapsed_s);
    Ok(())
}

async fn interrupted() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async {
            match term.as_mut() {
                Some(term) => { term.recv().await; }
                None => std::future::pending::<()>().await,
            }
        } => {}
    }
}
