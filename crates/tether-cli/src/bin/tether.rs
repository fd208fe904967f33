//! `tether`: run, serve and inspect GGUF models.

use clap::{Parser, Subcommand};
use tether_cli::cmd;

#[derive(Parser, Debug)]
#[command(name = "tether", version, about = "Serve GGUF language models from a pool of workers")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate text from a prompt (the demo model when no --model is given).
    Run(cmd::run::RunArgs),
    /// Write the logits of every position of a token sequence.
    Eval(cmd::eval::EvalArgs),
    /// Measure prompt and generation speed.
    Bench(cmd::bench::BenchArgs),
    /// Tokenize text with a model's tokenizer.
    Tokenize(cmd::tokenize::TokenizeArgs),
    /// GGUF file tools.
    #[command(subcommand)]
    Gguf(cmd::gguf::GgufCommand),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TETHER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Run(args) => cmd::run::run(args),
        Command::Eval(args) => cmd::eval::run(args),
        Command::Bench(args) => cmd::bench::run(args),
        Command::Tokenize(args) => cmd::tokenize::run(args),
        Command::Gguf(command) => cmd::gguf::run(command),
    }
}
