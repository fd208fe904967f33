//! The worker side of tether: a session registry where every byte belongs to exactly one
//! session, leases and the reaper, the two-phase-commit participant that loads layer blocks,
//! forward passes, the gRPC services (`grpc`, the only place tonic types appear), the data
//! links' server (`link`) and embedded workers. The wire's types are `tether_protocol`'s;
//! the client is `tether_client`.

pub mod embedded;
pub mod grpc;
pub mod handshake;
pub use tether_protocol::heap;
pub mod leak_watch;
pub mod ledger;
pub mod link;
pub mod load;
mod local_model;
pub mod metrics;
pub mod metrics_http;
pub mod model_dir;
pub mod model_stage;
pub mod participant;
mod read_ahead;
pub mod reaper;
pub mod registry;
pub mod serve;
pub mod server;
pub mod session;
pub mod stage;
pub mod staging;
pub mod status;

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

pub use load::{PrepareBegin, PrepareUpload};
pub use model_dir::ModelDirs;
pub use registry::{RegistryConfig, SessionRegistry};
pub use stage::StageFactory;
pub use staging::TensorDigest;
// The wire's types that the registry's API takes and returns, for the worker's users.
pub use tether_protocol::{
    BearerToken, BlockSpec, CounterValues, EndReason, ForwardCall, ForwardInput, ForwardOutput,
    Lease, MAX_TOP_K, MemorySource, Result, Rows, SessionEnd, SessionId, SessionSummary, TokenPos,
    TxnId, WorkerError, WorkerStatus,
};
