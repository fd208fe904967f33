//! Loading a layer block into a session by two-phase commit: Prepare (plan, admit, build,
//! receive — or read from the worker's own copy of the model — and verify every tensor),
//! then Commit (serve) or Abort (free).

use crate::ledger::Reservation;
use crate::local_model::LocalModel;
use crate::metrics::{TensorSourceKind, TxnOp};
use crate::registry::{SessionRegistry, unknown_session};
use crate::session::{OwnedStage, SessionState, UploadSlot};
use crate::staging::{Staging, TensorDigest};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;
use tether_protocol::BlockSpec;
use tether_protocol::Outcome;
use tether_protocol::{FileIdentity, PrepareTimings};
use tether_protocol::{Result, WorkerError};
use tether_protocol::{SessionId, TxnId};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The opening message of a Prepare.
#[derive(Clone, Debug)]
pub struct PrepareBegin {
    /// The session loading the block.
    pub session: SessionId,
    /// The transaction, chosen by the coordinator.
    pub txn: TxnId,
    /// The model file's bytes before its tensor data.
    pub gguf_header: Vec<u8>,
    /// Length of the whole model file.
    pub gguf_file_bytes: u64,
    /// The block.
    pub spec: BlockSpec,
    /// Every tensor the client will send.
    pub tensors: Vec<TensorDigest>,
    /// How long the prepared state waits for a decision; `None` = the worker's default.
    pub decision_timeout: Option<Duration>,
    /// The worker's own copy of the model to read the tensors from (within its
    /// `--model-dir`); `None`: the client sends them in chunks.
    pub local_path: Option<String>,
    /// With `local_path`: the identity of the coordinator's copy. When the worker's file
    /// has it, the tensors are read without CRC-32 checks (the digests' CRC-32s are then
    /// 0); when it has not, the Prepare is refused as a local read.
    pub same_file: Option<FileIdentity>,
}

/// A Prepare whose block is built and reserved, receiving tensor bytes. Dropping it before
/// [`PrepareUpload::finish`] aborts the transaction and frees the block.
pub struct PrepareUpload {
    registry: Arc<SessionRegistry>,
    session: SessionId,
    txn: TxnId,
    staging: Staging,
    /// The block, owned by the session: ending the session frees it under this upload.
    slot: UploadSlot,
    /// Set once the block moved to the prepared state (or failed and was freed).
    done: bool,
    cancel: CancellationToken,
    decision_timeout: Duration,
    /// Where the tensors came from: with `LocalFile` they are all staged already and no
    /// chunk is accepted.
    source: TensorSourceKind,
    /// Planning and allocation so far; the rest is filled in by [`PrepareUpload::finish`].
    timings: PrepareTimings,
    /// When the tensor bytes began to come (or the worker began reading its own copy).
    bytes_since: std::time::Instant,
}

/// Marks the transaction failed, and frees its block, if Prepare stops before handing over
/// to [`PrepareUpload`].
struct FailGuard<'a> {
    registry: &'a SessionRegistry,
    session: SessionId,
    txn: TxnId,
    slot: Option<UploadSlot>,
    armed: bool,
}

impl Drop for FailGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            if self.slot.as_ref().is_some_and(UploadSlot::free) {
                crate::heap::return_freed_heap();
            }
            self.registry.fail_prepare(self.session, self.txn);
        }
    }
}

impl SessionRegistry {
    /// Phase one, first half: plans the block from the header, admits it against the memory
    /// limit (RESOURCE_EXHAUSTED otherwise), and builds it. Tensor bytes follow through the
    /// returned upload.
    pub async fn begin_prepare(self: &Arc<Self>, begin: PrepareBegin) -> Result<PrepareUpload> {
        let PrepareBegin {
            session,
            txn,
            gguf_header,
            gguf_file_bytes,
            spec,
            tensors,
            decision_timeout,
            local_path,
            same_file,
        } = begin;
        let (session_bytes, cancel) = self
            .open_prepare(session, txn)
            .inspect_err(|_| self.metrics.count_txn(TxnOp::Prepare, false))?;
        let mut guard = FailGuard {
            registry: self,
            session,
            txn,
            slot: None,
            armed: true,
        };

        let mut timings = PrepareTimings::default();
        let started = std::time::Instant::now();
        let gguf_header = Arc::new(gguf_header);
        let local = match local_path {
            Some(requested) => Some(
                self.open_local_model(
                    session,
                    txn,
                    requested,
                    &gguf_header,
                    gguf_file_bytes,
                    same_file,
                )
                .await?,
            ),
            None => None,
        };
        let factory = Arc::clone(&self.factory);
        let plan = self
            .run_blocking("planning the layer block", move || {
                factory.plan(&gguf_header, gguf_file_bytes, &spec)
            })
            .await?;
        let mut staging = Staging::new(plan.tensors(), &tensors)?;
        if local.as_ref().is_some_and(LocalModel::is_same_file) {
            // The very file the coordinator mapped: a checksum would compare it with itself.
            staging.skip_checksums();
        }
        timings.plan = started.elapsed();
        let allocating = std::time::Instant::now();
        let what = format!(
            "prepare {txn} of session {session}: layers {}..{}",
            spec.first_layer, spec.last_layer
        );
        let reservation = self.reserve_for(session, &session_bytes, plan.total_bytes(), &what)?;
        let stage = self
            .run_blocking("building the layer block", move || plan.build())
            .await?;
        let slot = self.hand_to_session(session, txn, OwnedStage::new(stage, reservation))?;
        guard.slot = Some(slot.clone());
        timings.allocate = allocating.elapsed();
        tracing::debug!(session = %session, txn = %txn, plan_ms = timings.plan.as_millis(), allocate_ms = timings.allocate.as_millis(), "prepare: block planned and allocated");
        let bytes_since = std::time::Instant::now();
        let source = match local {
            Some(local) => {
                staging = self
                    .stage_from_local(session, txn, local, staging, slot.clone(), cancel.clone())
                    .await?;
                TensorSourceKind::LocalFile
            }
            None => TensorSourceKind::Network,
        };
        let timeout = decision_timeout
            .unwrap_or(self.config.decision_timeout)
            .min(self.config.max_decision_timeout);
        guard.armed = false;
        Ok(PrepareUpload {
            registry: Arc::clone(self),
            session,
            txn,
            staging,
            slot,
            done: false,
            cancel,
            decision_timeout: timeout,
            source,
            timings,
            bytes_since,
        })
    }

    /// Opens the worker's own copy of the model that a Prepare names, checking its place,
    /// length and header; a refusal is logged and counted.
    async fn open_local_model(
        &self,
        session: SessionId,
        txn: TxnId,
        requested: String,
        header: &Arc<Vec<u8>>,
        file_bytes: u64,
        same_file: Option<FileIdentity>,
    ) -> Result<LocalModel> {
        let dirs = self.config.model_dirs.clone();
        let header = Arc::clone(header);
        let opened = self
            .run_blocking("opening the worker's copy of the model", move || {
                LocalModel::open(&dirs, &requested, &header, file_bytes, same_file)
            })
            .await;
        self.note_local_refusal(session, txn, &opened);
        opened
    }

    /// Reserves `bytes` for a Prepare of `session`, refused once the session has ended: a
    /// reservation taken after the end would hold bytes that no session counts.
    pub(crate) fn reserve_for(
        &self,
        session: SessionId,
        session_bytes: &Arc<AtomicU64>,
        bytes: u64,
        what: &str,
    ) -> Result<Reservation> {
        let inner = self.lock();
        if !inner.sessions.contains_key(&session) {
            return Err(ended_during_prepare(session, "planning"));
        }
        self.ledger.reserve(session_bytes, bytes, what)
    }

    /// Gives the built block to its session, which from now on frees it when it ends; a
    /// session that ended during the build gets nothing and the block is freed here.
    fn hand_to_session(
        &self,
        session: SessionId,
        txn: TxnId,
        staged: OwnedStage,
    ) -> Result<UploadSlot> {
        let slot = UploadSlot::new(staged);
        let mut inner = self.lock();
        match inner.sessions.get_mut(&session) {
            Some(s) => {
                s.upload = Some(slot.clone());
                Ok(slot)
            }
            None => {
                drop(inner);
                slot.free();
                crate::heap::return_freed_heap();
                tracing::info!(session = %session, txn = %txn, "prepare: the session ended while its block was built; freed");
                Err(ended_during_prepare(session, "the build of its block"))
            }
        }
    }

    /// Reads every tensor of `staging` from `local` into the block, off the async threads.
    /// The read stops when the session ends (which frees the block) or when this future is
    /// dropped (the Prepare call went away; its upload then frees the block).
    async fn stage_from_local(
        self: &Arc<Self>,
        session: SessionId,
        txn: TxnId,
        local: LocalModel,
        mut staging: Staging,
        slot: UploadSlot,
        session_cancel: CancellationToken,
    ) -> Result<Staging> {
        let cancel = session_cancel.child_token();
        let _stop_when_dropped = cancel.clone().drop_guard();
        let registry = Arc::clone(self);
        let read = self
            .run_blocking("reading tensors from the worker's copy of the model", move || {
                let bytes = slot
                    .with(|staged| {
                        local.stage_into(
                            &mut staging,
                            staged.stage.as_mut(),
                            &cancel,
                            &registry.metrics,
                        )
                    })
                    .ok_or_else(|| ended_during_prepare(session, "the read of its tensors"))??;
                tracing::info!(session = %session, txn = %txn, bytes, path = %local.path().display(), "tensors read from the worker's own copy of the model");
                Ok(staging)
            })
            .await;
        self.note_local_refusal(session, txn, &read);
        read
    }

    fn note_local_refusal<T>(&self, session: SessionId, txn: TxnId, result: &Result<T>) {
        if let Err(WorkerError::LocalFile(why)) = result {
            self.metrics.count_local_refused();
            tracing::warn!(session = %session, txn = %txn, "not reading the model from this worker's own copy: {why}");
        }
    }

    /// Starts transaction `txn` in `session`: its byte counter and cancellation token.
    fn open_prepare(
        &self,
        session: SessionId,
        txn: TxnId,
    ) -> Result<(Arc<AtomicU64>, CancellationToken)> {
        let mut inner = self.lock();
        let s = inner
            .sessions
            .get_mut(&session)
            .ok_or_else(|| unknown_session(session))?;
        if let SessionState::Serving { spec: serving, .. } = &s.state {
            return Err(WorkerError::FailedPrecondition(format!(
                "session {session} already serves layers {}..{}; a session serves one block, open another session for more",
                serving.first_layer, serving.last_layer
            )));
        }
        s.participant.begin(txn)?;
        Ok((Arc::clone(&s.bytes), s.cancel.clone()))
    }

    /// Runs blocking work on the tracked blocking pool.
    pub(crate) async fn run_blocking<T: Send + 'static>(
        &self,
        what: &str,
        work: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> Result<T> {
        self.tracker
            .spawn_blocking(work)
            .await
            .map_err(|e| WorkerError::Internal(format!("{what} failed: {e}")))?
    }

    pub(crate) fn fail_prepare(&self, session: SessionId, txn: TxnId) {
        self.metrics.count_txn(TxnOp::Prepare, false);
        if let Some(s) = self.lock().sessions.get_mut(&session) {
            s.participant.fail(txn);
            s.upload = None;
        }
        tracing::info!(session = %session, txn = %txn, "prepare failed; staged memory freed");
    }

    /// Phase two: the prepared block of `txn` serves. Idempotent.
    pub fn commit(&self, session: SessionId, txn: TxnId) -> Result<Outcome> {
        let outcome = self.commit_inner(session, txn);
        self.metrics.count_txn(TxnOp::Commit, outcome.is_ok());
        outcome
    }

    fn commit_inner(&self, session: SessionId, txn: TxnId) -> Result<Outcome> {
        let mut inner = self.lock();
        let s = inner
            .sessions
            .get_mut(&session)
            .ok_or_else(|| unknown_session(session))?;
        if let Some(staged) = s.participant.commit(txn)? {
            let spec = staged.stage.shape().spec;
            let kv_pool = Arc::clone(&staged.kv_pool);
            s.state = SessionState::Serving {
                slot: Arc::new(std::sync::Mutex::new(staged)),
                spec,
                kv_pool,
            };
            tracing::info!(session = %session, txn = %txn, bytes = s.bytes(), "committed: layers {}..{} serve", spec.first_layer, spec.last_layer);
        }
        Ok(Outcome::Committed)
    }

    /// Phase two: the prepared block of `txn` is freed. Idempotent.
    pub fn abort(&self, session: SessionId, txn: TxnId) -> Result<Outcome> {
        let outcome = self.abort_inner(session, txn);
        self.metrics.count_txn(TxnOp::Abort, outcome.is_ok());
        outcome
    }

    fn abort_inner(&self, session: SessionId, txn: TxnId) -> Result<Outcome> {
        let mut inner = self.lock();
        let s = inner
            .sessions
            .get_mut(&session)
            .ok_or_else(|| unknown_session(session))?;
        let outcome = s.participant.abort(txn)?;
        tracing::info!(session = %session, txn = %txn, "aborted");
        Ok(outcome)
    }
}

impl PrepareUpload {
    /// The transaction.
    pub fn txn(&self) -> TxnId {
        self.txn
    }

    /// Resolves when the session ends (the upload must then stop).
    pub fn session_ended(&self) -> tokio_util::sync::WaitForCancellationFutureOwned {
        self.cancel.clone().cancelled_owned()
    }

    /// Checks one chunk of a tensor and copies it into the block.
    pub fn accept(&mut self, name: &str, offset: u64, data: &[u8]) -> Result<()> {
        if self.source == TensorSourceKind::LocalFile {
            return Err(WorkerError::InvalidArgument(format!(
                "chunk for tensor {name:?}: this Prepare read its tensors from the worker's own copy of the model; send End without chunks"
            )));
        }
        let staging = &mut self.staging;
        self.slot
            .with(|staged| staging.accept(staged.stage.as_mut(), name, offset, data))
            .ok_or_else(|| ended_during_prepare(self.session, "the upload"))??;
        self.registry
            .metrics
            .count_tensor_bytes(TensorSourceKind::Network, data.len() as u64);
        Ok(())
    }

    /// Where the tensors came from.
    pub fn source(&self) -> TensorSourceKind {
        self.source
    }

    /// Verifies every tensor and moves the block to the prepared state. Returns the bytes
    /// it holds and where the Prepare spent its time.
    pub fn finish(mut self) -> Result<(u64, PrepareTimings)> {
        let staging = std::mem::replace(&mut self.staging, Staging::empty());
        let staged_times = staging.times();
        let mut timings = self.timings;
        timings.checksum = staged_times.checksum;
        timings.upload = staged_times.upload;
        timings.tensor_bytes = staged_times.bytes;
        timings.read = self
            .bytes_since
            .elapsed()
            .saturating_sub(staged_times.checksum + staged_times.upload);
        let finishing = std::time::Instant::now();
        let verified = self
            .slot
            .with(|staged| {
                staging.finish()?;
                staged.stage.finish_load()?;
                Ok(staged.reservation.bytes())
            })
            .ok_or_else(|| ended_during_prepare(self.session, "the upload"))?;
        // On failure the upload's drop frees the block.
        let bytes = verified?;
        timings.finish = finishing.elapsed();
        let deadline = Instant::now() + self.decision_timeout;
        let prepared = {
            let mut inner = self.registry.lock();
            match inner.sessions.get_mut(&self.session) {
                Some(s) => {
                    s.upload = None;
                    match self.slot.take() {
                        Some(staged) => s.participant.prepared(self.txn, staged, deadline),
                        None => Err(ended_during_prepare(self.session, "the upload")),
                    }
                }
                None => Err(ended_during_prepare(self.session, "the upload")),
            }
        };
        // Moved to the prepared state or freed: nothing is left for the drop to free.
        self.done = true;
        self.registry
            .metrics
            .count_txn(TxnOp::Prepare, prepared.is_ok());
        prepared?;
        let source = match self.source {
            TensorSourceKind::Network => "network",
            TensorSourceKind::LocalFile => "local file",
        };
        tracing::info!(session = %self.session, txn = %self.txn, bytes, tensors_from = source, "prepared");
        tracing::debug!(
            session = %self.session,
            txn = %self.txn,
            read_ms = timings.read.as_millis(),
            checksum_ms = timings.checksum.as_millis(),
            upload_ms = timings.upload.as_millis(),
            finish_ms = timings.finish.as_millis(),
            tensor_bytes = timings.tensor_bytes,
            gb_per_s = format!("{:.2}", tether_protocol::prepare_timings::gb_per_s(timings.tensor_bytes, timings.total())),
            "prepare timings"
        );
        Ok((bytes, timings))
    }
}

impl Drop for PrepareUpload {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if self.slot.free() {
            // Freed here rather than by the session's end: give its pages back now, not
            // when some other session ends.
            crate::heap::return_freed_heap();
        }
        self.registry.fail_prepare(self.session, self.txn);
    }
}

fn ended_during_prepare(session: SessionId, during: &str) -> WorkerError {
    WorkerError::Aborted(format!(
        "session {session} ended during {during}; the Prepare is aborted and its memory freed"
    ))
}
