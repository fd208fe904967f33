//! The coordinator: placement of layers over workers, two-phase load, pipelined generation
//! with continuous batching, and the OpenAI-compatible HTTP API.

pub mod api;
pub mod constraint;
pub mod discovery;
#[cfg(test)]
mod discovery_tests;
pub mod engine;
mod handoff;
mod handoff_probe;
pub mod http;
pub mod lifecycle;
pub mod load;
pub mod load_report;
mod loss;
pub mod model_file;
pub mod placement;
mod prefix;
pub mod progress;
mod scheduler;
mod sequence;
mod stage_call;

pub use discovery::WorkerDns;
pub use engine::{Coordinator, CoordinatorConfig, CoordinatorError};
pub use lifecycle::{ModelChangeError, ModelChangeReport, ModelLoad};
pub use load_report::{LoadReport, WorkerLoad};
pub use model_file::ModelFile;
pub use placement::{Plan, place};
pub use progress::{LoadProgress, WorkerProgress};
