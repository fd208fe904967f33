//! The two-phase-commit participant of one session, as one state machine:
//!
//! ```text
//! idle ──begin──▶ preparing ──prepared──▶ prepared ──commit──▶ committed
//!                     │                      │
//!                     └──fail / abort──▶ aborted ◀──abort / decision timeout
//! ```
//!
//! Commit and Abort are idempotent by transaction id: repeating a decision returns the
//! same outcome. Abort of an unknown transaction is answered "aborted" (presumed abort: the
//! coordinator may abort a transaction whose Prepare never reached this worker).

use std::collections::{HashMap, VecDeque};
use tether_protocol::{AbortCause, Outcome, TxnId};
use tether_protocol::{Result, WorkerError};
use tokio::time::Instant;

/// Decided transactions remembered per session for idempotent replies.
const DECIDED_HISTORY: usize = 256;

/// One transaction's state. `S` is the staged value: dropping it frees what it holds.
enum Txn<S> {
    /// The upload is in progress; the Prepare handler holds the staged value.
    Preparing,
    /// Staged and verified, waiting for a decision until `deadline`.
    Prepared {
        staged: S,
        deadline: Instant,
    },
    Committed,
    Aborted(AbortCause),
}

/// The transactions of one session.
pub struct Participant<S> {
    txns: HashMap<TxnId, Txn<S>>,
    decided: VecDeque<TxnId>,
}

impl<S> Default for Participant<S> {
    fn default() -> Self {
        Self {
            txns: HashMap::new(),
            decided: VecDeque::new(),
        }
    }
}

impl<S> Participant<S> {
    /// idle → preparing. A transaction id is used once.
    pub fn begin(&mut self, txn: TxnId) -> Result<()> {
        if self.txns.contains_key(&txn) {
            return Err(WorkerError::InvalidArgument(format!(
                "transaction {txn} was already prepared on this session; use a fresh transaction id"
            )));
        }
        if self.is_busy() {
            return Err(WorkerError::FailedPrecondition(format!(
                "transaction {txn}: another transaction of this session is still preparing or prepared; commit or abort it first"
            )));
        }
        self.txns.insert(txn, Txn::Preparing);
        Ok(())
    }

    /// preparing → prepared. If the transaction was aborted meanwhile, the staged value is
    /// dropped (freed) and `Aborted` is returned.
    pub fn prepared(&mut self, txn: TxnId, staged: S, deadline: Instant) -> Result<()> {
        match self.txns.get_mut(&txn) {
            Some(state @ Txn::Preparing) => {
                *state = Txn::Prepared { staged, deadline };
                Ok(())
            }
            Some(Txn::Aborted(cause)) => Err(WorkerError::Aborted(format!(
                "transaction {txn} was aborted ({cause:?}) while its upload was in progress"
            ))),
            _ => Err(WorkerError::Internal(format!(
                "transaction {txn} is not preparing; this is a worker bug"
            ))),
        }
    }

    /// preparing → aborted, when the upload failed.
    pub fn fail(&mut self, txn: TxnId) {
        if let Some(Txn::Preparing) = self.txns.get(&txn) {
            self.decide(txn, Txn::Aborted(AbortCause::PrepareFailed));
        }
    }

    /// prepared → committed, handing out the staged value to serve. Repeating a commit
    /// returns `Ok(None)`.
    pub fn commit(&mut self, txn: TxnId) -> Result<Option<S>> {
        match self.txns.remove(&txn) {
            Some(Txn::Prepared { staged, .. }) => {
                self.decide(txn, Txn::Committed);
                Ok(Some(staged))
            }
            Some(Txn::Committed) => {
                self.txns.insert(txn, Txn::Committed);
                Ok(None)
            }
            Some(Txn::Aborted(cause)) => {
                self.txns.insert(txn, Txn::Aborted(cause));
                Err(WorkerError::FailedPrecondition(format!(
                    "transaction {txn} was aborted ({cause:?}) and cannot be committed; prepare again"
                )))
            }
            Some(Txn::Preparing) => {
                self.txns.insert(txn, Txn::Preparing);
                Err(WorkerError::FailedPrecondition(format!(
                    "transaction {txn} is still uploading; wait for its Prepare reply before committing"
                )))
            }
            None => Err(WorkerError::NotFound(format!(
                "transaction {txn} is unknown to this session"
            ))),
        }
    }

    /// Any state but committed → aborted, freeing what was staged. Returns the final outcome.
    pub fn abort(&mut self, txn: TxnId) -> Result<Outcome> {
        match self.txns.get(&txn) {
            Some(Txn::Committed) => Err(WorkerError::FailedPrecondition(format!(
                "transaction {txn} is already committed and cannot be aborted"
            ))),
            Some(Txn::Aborted(cause)) => Ok(Outcome::Aborted(*cause)),
            Some(Txn::Preparing | Txn::Prepared { .. }) | None => {
                self.decide(txn, Txn::Aborted(AbortCause::Requested));
                Ok(Outcome::Aborted(AbortCause::Requested))
            }
        }
    }

    /// prepared → aborted for every transaction whose decision deadline has passed.
    /// `before_abort` runs for each one before its staged memory is freed, so that a
    /// count it raises is never behind the freed bytes a status reader sees.
    pub fn expire(&mut self, now: Instant, mut before_abort: impl FnMut(TxnId)) -> Vec<TxnId> {
        let expired: Vec<TxnId> = self
            .txns
            .iter()
            .filter(|(_, t)| matches!(t, Txn::Prepared { deadline, .. } if *deadline <= now))
            .map(|(id, _)| *id)
            .collect();
        for txn in &expired {
            before_abort(*txn);
            self.decide(*txn, Txn::Aborted(AbortCause::TimedOut));
        }
        expired
    }

    /// Transactions waiting for a decision.
    pub fn prepared_count(&self) -> usize {
        self.txns
            .values()
            .filter(|t| matches!(t, Txn::Prepared { .. }))
            .count()
    }

    /// Whether a transaction is preparing or prepared.
    pub fn is_busy(&self) -> bool {
        self.txns
            .values()
            .any(|t| matches!(t, Txn::Preparing | Txn::Prepared { .. }))
    }

    /// Staged values of prepared transactions, for accounting.
    pub fn staged(&self) -> impl Iterator<Item = &S> {
        self.txns.values().filter_map(|t| match t {
            Txn::Prepared { staged, .. } => Some(staged),
            _ => None,
        })
    }

    /// Records a decision (dropping any staged value) and forgets the oldest decisions.
    fn decide(&mut self, txn: TxnId, state: Txn<S>) {
        self.txns.insert(txn, state);
        self.decided.push_back(txn);
        while self.decided.len() > DECIDED_HISTORY {
            if let Some(old) = self.decided.pop_front() {
                self.txns.remove(&old);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// Counts drops, standing in for a staged block.
    struct Staged(Arc<AtomicUsize>);
    impl Drop for Staged {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn staged() -> (Staged, Arc<AtomicUsize>) {
        let drops = Arc::new(AtomicUsize::new(0));
        (Staged(Arc::clone(&drops)), drops)
    }

    #[tokio::test]
    async fn commit_hands_out_the_stage_once_and_is_idempotent() {
        let mut p = Participant::default();
        let txn = TxnId::new_random();
        p.begin(txn).unwrap();
        let (s, drops) = staged();
        p.prepared(txn, s, Instant::now() + Duration::from_secs(5))
            .unwrap();
        assert_eq!(p.prepared_count(), 1);
        let got = p.commit(txn).unwrap();
        assert!(got.is_some());
        assert!(p.commit(txn).unwrap().is_none(), "second commit is a no-op");
        assert!(p.abort(txn).is_err(), "abort after commit is refused");
        drop(got);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn abort_frees_and_is_idempotent() {
        let mut p = Participant::default();
        let txn = TxnId::new_random();
        p.begin(txn).unwrap();
        let (s, drops) = staged();
        p.prepared(txn, s, Instant::now() + Duration::from_secs(5))
            .unwrap();
        assert_eq!(
            p.abort(txn).unwrap(),
            Outcome::Aborted(AbortCause::Requested)
        );
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        assert_eq!(
            p.abort(txn).unwrap(),
            Outcome::Aborted(AbortCause::Requested)
        );
        assert!(matches!(
            p.commit(txn),
            Err(WorkerError::FailedPrecondition(_))
        ));
    }

    #[tokio::test]
    async fn abort_of_unknown_txn_is_presumed() {
        let mut p: Participant<Staged> = Participant::default();
        let txn = TxnId::new_random();
        assert_eq!(
            p.abort(txn).unwrap(),
            Outcome::Aborted(AbortCause::Requested)
        );
        assert!(p.begin(txn).is_err(), "an aborted id cannot be reused");
        assert!(matches!(
            p.commit(TxnId::new_random()),
            Err(WorkerError::NotFound(_))
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn undecided_prepare_is_aborted_at_its_deadline() {
        let mut p = Participant::default();
        let txn = TxnId::new_random();
        p.begin(txn).unwrap();
        let (s, drops) = staged();
        p.prepared(txn, s, Instant::now() + Duration::from_millis(300))
            .unwrap();
        tokio::time::advance(Duration::from_millis(299)).await;
        assert!(p.expire(Instant::now(), |_| {}).is_empty());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(p.expire(Instant::now(), |_| {}), vec![txn]);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        assert!(
            matches!(p.commit(txn), Err(WorkerError::FailedPrecondition(m)) if m.contains("TimedOut"))
        );
    }

    #[tokio::test]
    async fn abort_during_upload_drops_the_stage_when_it_arrives() {
        let mut p = Participant::default();
        let txn = TxnId::new_random();
        p.begin(txn).unwrap();
        assert!(p.commit(txn).is_err(), "cannot commit while uploading");
        p.abort(txn).unwrap();
        let (s, drops) = staged();
        assert!(matches!(
            p.prepared(txn, s, Instant::now()),
            Err(WorkerError::Aborted(_))
        ));
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        assert!(!p.is_busy());
    }

    #[tokio::test]
    async fn one_transaction_at_a_time() {
        let mut p: Participant<Staged> = Participant::default();
        p.begin(TxnId::new_random()).unwrap();
        assert!(matches!(
            p.begin(TxnId::new_random()),
            Err(WorkerError::FailedPrecondition(_))
        ));
    }
}
