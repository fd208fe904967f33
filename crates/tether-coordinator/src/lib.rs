//! The coordinator: placement of layers over workers, two-phase load, pipelined generation
//! with continuous batching, and the OpenAI-compatible HTTP API.

pub mod api;
pub mod load;
pub mod model_file;
pub mod placement;
pub mod http;
pub mod single;
pub mod engine;
pub mod local;
mod scheduler;
mod sequence;

pub use engine::{Coordinator, CoordinatorConfig, CoordinatorError};
pub use local::{LocalOptions, LocalWorker, LocalWorkers};
pub use model_file::ModelFile;
pub use placement::{Plan, place};
