//! The domain side of tether's wire, shared by the worker, its client and the coordinator:
//! ids, errors, lease, session and transaction types, the forward call, the gRPC
//! conversions (the only place generated types meet domain types) and the data link's
//! frames, and the TLS settings of both ends of a link.

pub mod block;
pub mod error;
pub mod file_identity;
pub mod forward;
pub mod grpc;
pub mod heap;
pub mod ids;
pub mod link;
pub mod prepare_timings;
pub mod session;
pub mod status;
pub mod tls;
pub mod token;
pub mod txn;

pub use block::BlockSpec;
pub use error::{Result, WorkerError, error_chain};
pub use file_identity::FileIdentity;
pub use forward::{
    ForwardCall, ForwardInput, ForwardOutput, MAX_TOP_K, Rows, SharedArea, TokenPos,
};
pub use ids::{SessionId, TxnId};
pub use prepare_timings::PrepareTimings;
pub use session::{EndReason, Lease, SessionEnd};
pub use status::{CounterValues, MemorySource, SessionSummary, WorkerStatus};
pub use token::BearerToken;
pub use txn::{AbortCause, Outcome};

/// Largest gRPC message by default, on both ends: room for a 16 MiB batch of hidden states
/// and 4 MiB tensor chunks, far below anything that could exhaust memory.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 64 << 20;
