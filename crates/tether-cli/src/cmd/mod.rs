//! One module per `tether` subcommand.

pub mod attach;
pub mod bench;
pub mod bench_parallel;
pub mod bench_pipeline;
pub mod bench_serve;
pub mod cache_args;
pub mod conn_args;
pub mod context_shift;
pub mod eval;
pub mod gguf;
pub mod local;
pub mod path_on_workers;
pub mod plan;
pub mod run;
pub mod serve;
pub mod tls_args;
pub mod tokenize;
pub mod worker;
pub mod worker_link;
