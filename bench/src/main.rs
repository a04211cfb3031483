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
    let report = handoff_bench::run(args).await?;
    println!("{}", report.table());
    if let Some(dir) = json.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&json, serde_json::to_vec_pretty(&report)?)?;
    eprintln!("report written to {} ({:.0} s)", json.display(), report.elapsed_s);
    Ok(())
}
