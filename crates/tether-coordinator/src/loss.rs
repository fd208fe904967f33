//! Why the scheduler stopped serving its model, as a value: the scheduler branches on it (a
//! session end that the load's watcher recorded wins over the failed call it caused) and
//! health reports its text. Every way ends in loading the model again.

use crate::engine::CoordinatorError;
use crate::load::SessionLoss;
use tether_client::ClientError;

/// Why a loaded model stopped being served.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Loss {
    /// A worker's session ended: the worker crashed, shut down, reaped or killed it.
    #[error("{0}")]
    SessionEnded(#[source] SessionLoss),
    /// The worker list changed (`--worker-dns`): the model moves to the new list.
    #[error("the worker list changed to [{}]", .0.join(", "))]
    WorkersChanged(Vec<String>),
    /// A call to a worker failed (forward, KV clear or truncate).
    #[error("{0}")]
    Call(#[source] ClientError),
    /// A worker answered with something other than what was asked.
    #[error("{0}")]
    BadReply(String),
    /// The scheduler's own bookkeeping does not fit the wire (a bug).
    #[error("{0}")]
    Internal(String),
    /// Loading over the resolved workers failed; it is retried.
    #[error("loading over the resolved workers failed: {0}")]
    Load(#[source] CoordinatorError),
}
