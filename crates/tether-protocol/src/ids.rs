//! Session and transaction ids: UUIDs, parsed from the wire with a clear error.

use crate::error::WorkerError;
use std::fmt;
use uuid::Uuid;

/// The id of one session, chosen by the worker when the session opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub Uuid);

/// The id of one two-phase-commit transaction, chosen by the coordinator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TxnId(pub Uuid);

impl SessionId {
    /// A fresh random id.
    pub fn new_random() -> Self {
        Self(Uuid::new_v4())
    }

    /// Parses the 36-character text form; `InvalidArgument` otherwise.
    pub fn parse(text: &str) -> Result<Self, WorkerError> {
        parse_uuid("session id", text).map(Self)
    }
}

impl TxnId {
    /// A fresh random id.
    pub fn new_random() -> Self {
        Self(Uuid::new_v4())
    }

    /// Parses the 36-character text form; `InvalidArgument` otherwise.
    pub fn parse(text: &str) -> Result<Self, WorkerError> {
        parse_uuid("transaction id", text).map(Self)
    }
}

fn parse_uuid(what: &str, text: &str) -> Result<Uuid, WorkerError> {
    Uuid::parse_str(text).map_err(|e| {
        let shown: String = text.chars().take(64).collect();
        WorkerError::InvalidArgument(format!("{what} {shown:?} is not a UUID: {e}"))
    })
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for TxnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_through_text() {
        let id = SessionId::new_random();
        assert_eq!(SessionId::parse(&id.to_string()), Ok(id));
        let txn = TxnId::new_random();
        assert_eq!(TxnId::parse(&txn.to_string()), Ok(txn));
    }

    #[test]
    fn garbage_is_an_invalid_argument_naming_the_field() {
        let err = SessionId::parse("not-a-uuid").unwrap_err();
        assert!(matches!(&err, WorkerError::InvalidArgument(m) if m.contains("session id")));
    }
}
