//! Admission and byte accounting: every byte a session holds is a [`Reservation`] taken from
//! the worker's [`MemoryLedger`]; dropping the reservation gives the bytes back.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tether_protocol::WorkerError;

/// The worker's memory budget (`--max-memory`) and the bytes reserved against it.
#[derive(Debug)]
pub struct MemoryLedger {
    limit: u64,
    /// Most bytes one session may hold (`--max-session-memory`).
    session_limit: Option<u64>,
    reserved: AtomicU64,
}

impl MemoryLedger {
    /// A ledger admitting at most `limit` bytes at once.
    pub fn new(limit: u64) -> Self {
        Self {
            limit,
            session_limit: None,
            reserved: AtomicU64::new(0),
        }
    }

    /// The same ledger, refusing any session that would hold more than `bytes`.
    pub fn with_session_limit(mut self, bytes: Option<u64>) -> Self {
        self.session_limit = bytes;
        self
    }

    /// The admission limit in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes reserved by all sessions now.
    pub fn reserved(&self) -> u64 {
        self.reserved.load(Ordering::Acquire)
    }

    /// Bytes that can still be reserved.
    pub fn available(&self) -> u64 {
        self.limit.saturating_sub(self.reserved())
    }

    /// Reserves `bytes` for `what`, counted both here and in the session's own counter, or
    /// refuses with `ResourceExhausted` saying what was asked and what is free.
    pub fn reserve(
        self: &Arc<Self>,
        session_bytes: &Arc<AtomicU64>,
        bytes: u64,
        what: &str,
    ) -> Result<Reservation, WorkerError> {
        if let Some(cap) = self.session_limit {
            session_bytes
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                    held.checked_add(bytes).filter(|&total| total <= cap)
                })
                .map_err(|held| {
                    WorkerError::OverLimit(format!(
                        "{what}: asked {bytes} bytes, but a session may hold at most {cap} bytes (--max-session-memory) and this one holds {held}; lower the context/batch size or split the model over more workers"
                    ))
                })?;
        } else {
            session_bytes.fetch_add(bytes, Ordering::AcqRel);
        }
        let limit = self.limit;
        self.reserved
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|&total| total <= limit)
            })
            .map_err(|held| {
                session_bytes.fetch_sub(bytes, Ordering::AcqRel);
                WorkerError::ResourceExhausted {
                    what: what.to_string(),
                    asked: bytes,
                    free: limit.saturating_sub(held),
                    limit,
                    held,
                }
            })?;
        Ok(Reservation {
            ledger: Arc::clone(self),
            session_bytes: Arc::clone(session_bytes),
            bytes,
        })
    }
}

/// Bytes reserved for one session. Dropping it returns them to the ledger and the session.
#[derive(Debug)]
pub struct Reservation {
    ledger: Arc<MemoryLedger>,
    session_bytes: Arc<AtomicU64>,
    bytes: u64,
}

impl Reservation {
    /// Bytes this reservation holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.ledger.reserved.fetch_sub(self.bytes, Ordering::AcqRel);
        self.session_bytes.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_count_until_dropped() {
        let ledger = Arc::new(MemoryLedger::new(1000));
        let session = Arc::new(AtomicU64::new(0));
        let a = ledger.reserve(&session, 600, "weights").unwrap();
        assert_eq!(
            (ledger.reserved(), session.load(Ordering::Acquire)),
            (600, 600)
        );
        let err = ledger.reserve(&session, 500, "kv cache").unwrap_err();
        match err {
            WorkerError::ResourceExhausted {
                asked,
                free,
                limit,
                held,
                ..
            } => {
                assert_eq!((asked, free, limit, held), (500, 400, 1000, 600));
            }
            other => panic!("expected ResourceExhausted, got {other:?}"),
        }
        assert_eq!(
            ledger.reserved(),
            600,
            "a refused reservation takes nothing"
        );
        drop(a);
        assert_eq!((ledger.reserved(), session.load(Ordering::Acquire)), (0, 0));
    }

    #[test]
    fn a_session_limit_caps_each_session_alone() {
        let ledger = Arc::new(MemoryLedger::new(1000).with_session_limit(Some(400)));
        let (one, two) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let a = ledger.reserve(&one, 300, "weights").unwrap();
        let err = ledger.reserve(&one, 101, "kv cache").unwrap_err();
        assert!(
            matches!(&err, WorkerError::OverLimit(m) if m.contains("at most 400 bytes") && m.contains("holds 300")),
            "{err}"
        );
        assert_eq!((ledger.reserved(), one.load(Ordering::Acquire)), (300, 300));
        let b = ledger.reserve(&two, 400, "weights").unwrap();
        let c = ledger.reserve(&one, 100, "kv cache").unwrap();
        assert_eq!(ledger.reserved(), 800);
        // The worker-wide limit still applies, and a refusal there leaves the session as it was.
        let three = Arc::new(AtomicU64::new(0));
        assert!(matches!(
            ledger.reserve(&three, 201, "weights"),
            Err(WorkerError::ResourceExhausted { .. })
        ));
        assert_eq!(three.load(Ordering::Acquire), 0);
        drop((a, b, c));
        assert_eq!(ledger.reserved(), 0);
    }

    #[test]
    fn refusal_message_says_asked_and_free() {
        let ledger = Arc::new(MemoryLedger::new(10));
        let session = Arc::new(AtomicU64::new(0));
        let msg = ledger
            .reserve(&session, 11, "stage")
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("asked 11 bytes") && msg.contains("10 bytes free"),
            "{msg}"
        );
    }
}
