//! Errors of the worker's domain, each with the gRPC meaning it maps to at the edge.

/// What went wrong in a worker operation. The variant decides the gRPC status code; the
/// message says what was being done, with what, and what to do.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum WorkerError {
    /// A session, transaction or tensor the request names does not exist (NOT_FOUND).
    #[error("{0}")]
    NotFound(String),
    /// The request is malformed: bad sizes, positions, ids (INVALID_ARGUMENT).
    #[error("{0}")]
    InvalidArgument(String),
    /// The request is valid but the state does not allow it now (FAILED_PRECONDITION).
    #[error("{0}")]
    FailedPrecondition(String),
    /// A Prepare named the worker's own copy of the model (`local_path`) and the worker
    /// would not or could not use it: no `--model-dir`, outside it, missing, or not the
    /// coordinator's file (FAILED_PRECONDITION, marked so that the client streams instead).
    #[error("{0}")]
    LocalFile(String),
    /// Admission refused: not enough memory (RESOURCE_EXHAUSTED).
    #[error(
        "{what}: asked {asked} bytes, {free} bytes free (limit {limit} bytes, {held} held by sessions); free memory by ending sessions, or lower the context/batch size"
    )]
    ResourceExhausted {
        /// What was being reserved.
        what: String,
        /// Bytes asked for.
        asked: u64,
        /// Bytes that could still be reserved.
        free: u64,
        /// The admission limit.
        limit: u64,
        /// Bytes held by all sessions at the time.
        held: u64,
    },
    /// Admission refused by a configured limit other than free memory: sessions in all or
    /// per client, bytes per session (RESOURCE_EXHAUSTED).
    #[error("{0}")]
    OverLimit(String),
    /// The worker is draining or shutting down (UNAVAILABLE).
    #[error("{0}")]
    Unavailable(String),
    /// The transaction was aborted (ABORTED).
    #[error("{0}")]
    Aborted(String),
    /// A bug or device failure on the worker (INTERNAL).
    #[error("{0}")]
    Internal(String),
}

/// Result type of worker operations.
pub type Result<T> = std::result::Result<T, WorkerError>;

/// An error and every error under it, joined, skipping causes already quoted by the one
/// above (tonic and hyper often repeat them). Both ends of a link report chains this way.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    append_causes(error.to_string(), error.source())
}

/// `text` followed by `cause` and every error under it, each one left out when `text`
/// already holds it.
pub fn append_causes(
    mut text: String,
    mut cause: Option<&(dyn std::error::Error + 'static)>,
) -> String {
    while let Some(e) = cause {
        let part = e.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        cause = e.source();
    }
    text
}
