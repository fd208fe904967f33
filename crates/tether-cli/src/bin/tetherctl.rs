//! `tetherctl`: status, sessions, kill and drain for one tether worker.

use anyhow::Context;
use clap::Parser;
use tether_cli::ctl;

fn main() -> std::process::ExitCode {
    let cli = ctl::Cli::parse();
    let result = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
        .and_then(|runtime| runtime.block_on(ctl::run(cli)));
    tether_cli::exit_code(result)
}
