//! A two-phase-commit transaction's outcome, as the participant decides it and the
//! coordinator reads it.

/// Why a transaction was aborted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AbortCause {
    /// The coordinator sent Abort.
    Requested,
    /// The upload failed or broke off.
    PrepareFailed,
    /// No decision came within the timeout (presumed abort).
    TimedOut,
}

/// A transaction's final state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Committed: the staged block serves.
    Committed,
    /// Aborted: the staged block was freed.
    Aborted(AbortCause),
}
