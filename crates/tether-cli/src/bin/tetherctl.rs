//! `tetherctl`: status, sessions, kill and drain for one tether worker.

use clap::Parser;
use tether_cli::ctl;

fn main() -> anyhow::Result<()> {
    let cli = ctl::Cli::parse();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(ctl::run(cli))
}
