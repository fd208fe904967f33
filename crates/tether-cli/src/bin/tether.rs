//! `tether`: run, serve and inspect GGUF models.

use clap::{Parser, Subcommand};
use std::io::IsTerminal;
use tether_cli::cmd;

#[derive(Parser, Debug)]
#[command(
    name = "tether",
    version,
    about = "Serve GGUF language models from a pool of workers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the OpenAI-compatible HTTP API over workers (embedded ones when none are given).
    // Boxed: serve has by far the most flags.
    Serve(Box<cmd::serve::ServeArgs>),
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
    /// Print what each worker would hold for a model: layers, weights, KV, scratch, free memory.
    Plan(cmd::plan::PlanArgs),
    /// Serve one device's memory to coordinators over gRPC, session by session.
    Worker(cmd::worker::WorkerArgs),
    /// Open a session on a worker, load layers into it and hold it (a debugging client).
    Attach(cmd::attach::AttachArgs),
}

fn main() -> std::process::ExitCode {
    tether_cli::timings::mark_process_start();
    let cli = Cli::parse();
    // Long-running services log their lifecycle by default and give floods' memory back;
    // one-shot commands stay quiet.
    let default_filter = match cli.command {
        Command::Worker(_) | Command::Attach(_) | Command::Serve(_) => {
            tether_worker::heap::one_malloc_arena();
            "info"
        }
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TETHER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Serve(args) => cmd::serve::run(*args),
        Command::Run(args) => cmd::run::run(args),
        Command::Eval(args) => cmd::eval::run(args),
        Command::Bench(args) => cmd::bench::run(args),
        Command::Tokenize(args) => cmd::tokenize::run(args),
        Command::Gguf(command) => cmd::gguf::run(command),
        Command::Plan(args) => cmd::plan::run(args),
        Command::Worker(args) => cmd::worker::run(args),
        Command::Attach(args) => cmd::attach::run(args),
    };
    tether_cli::exit_code(result)
}
