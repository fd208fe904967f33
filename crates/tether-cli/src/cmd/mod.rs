//! One module per `tether` subcommand.

pub mod bench;
pub mod eval;
pub mod gguf;
pub mod run;
pub mod tokenize;
