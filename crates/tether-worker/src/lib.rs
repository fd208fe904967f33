//! The worker side of tether: a session registry where every byte belongs to exactly one
//! session, leases and the reaper, the two-phase-commit participant that loads layer blocks,
//! forward passes, the gRPC services (the only place tonic types appear) and a domain-level
//! client for coordinators and `tether attach`.

pub mod client;
pub mod data;
pub mod error;
pub mod handshake;
pub mod heap;
pub mod ids;
pub mod leak_watch;
pub mod ledger;
pub mod load;
mod local_model;
pub mod metrics;
pub mod metrics_http;
pub mod model_dir;
pub mod model_stage;
pub mod participant;
pub mod reaper;
pub mod registry;
pub mod serve;
pub mod server;
pub mod service;
pub mod session;
pub mod stage;
pub mod staging;
pub mod status;
pub mod tls;
pub mod token;

#[cfg(test)]
mod auth_tests;
#[cfg(test)]
mod local_model_tests;
#[cfg(test)]
mod model_stage_tests;
#[cfg(test)]
mod observability_tests;
#[cfg(test)]
mod registry_tests;
#[cfg(test)]
mod service_tests;
#[cfg(test)]
pub(crate) mod testing;

pub use error::{Result, WorkerError};
pub use ids::{SessionId, TxnId};
pub use load::{PrepareBegin, PrepareUpload};
pub use model_dir::ModelDirs;
pub use registry::{RegistryConfig, SessionRegistry};
pub use serve::ForwardCall;
pub use session::{EndReason, Lease, SessionEnd};
pub use stage::{BlockSpec, ForwardInput, ForwardOutput, MAX_TOP_K, Rows, StageFactory, TokenPos};
pub use staging::TensorDigest;
pub use status::{CounterValues, MemorySource, SessionSummary, WorkerStatus};
pub use token::BearerToken;
