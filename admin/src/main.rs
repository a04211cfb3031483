//! `handoff-admin`: parses the command line and runs one subcommand (see the library).

use std::process::ExitCode;

use clap::Parser;
use handoff_admin::Cli;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    handoff_shared::config::init_tracing(handoff_shared::config::LogFormat::Text);
    match handoff_admin::run(cli).await {
        Ok(code) => code,
        Err(error) => {
            let chain = handoff_shared::logging::error_chain(error.as_ref());
            eprintln!("handoff-admin: {chain}");
            ExitCode::FAILURE
        }
    }
}
