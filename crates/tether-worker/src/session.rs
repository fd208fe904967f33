//! One session's lifecycle and everything it owns:
//!
//! ```text
//! open ──commit──▶ serving
//!   │                 │
//!   └──── end(reason) ┴──▶ ending (removed from the registry) ──drop──▶ freed
//! ```
//!
//! A [`Session`] owns its committed block, its prepared transactions and the block of a
//! Prepare still receiving its tensors ([`UploadSlot`]); removing it from the registry and
//! dropping it frees all of them, before the end is reported.

use crate::ledger::Reservation;
use crate::participant::Participant;
use crate::stage::ServingStage;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
#[cfg(doc)]
use tether_protocol::EndReason;
use tether_protocol::{BlockSpec, Lease, SessionEnd, SessionId};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// A built block together with the bytes reserved for it. Field order matters: the block is
/// dropped (device memory freed) before the reservation returns its bytes to the ledger.
pub struct OwnedStage {
    /// The block.
    pub stage: Box<dyn ServingStage>,
    /// Its bytes in the ledger.
    pub reservation: Reservation,
    /// Its KV pool as of its last operation, read by status without waiting for the lock.
    pub kv_pool: Arc<KvPoolGauge>,
}

impl OwnedStage {
    /// `stage` holding `reservation`.
    pub fn new(stage: Box<dyn ServingStage>, reservation: Reservation) -> Self {
        let kv_pool = Arc::new(KvPoolGauge::default());
        kv_pool.set(stage.kv_pool());
        Self {
            stage,
            reservation,
            kv_pool,
        }
    }
}

/// Blocks of a block's paged KV pool: in the pool, and free.
#[derive(Debug, Default)]
pub struct KvPoolGauge {
    blocks: AtomicU64,
    free: AtomicU64,
}

impl KvPoolGauge {
    /// Records `(blocks, free)`.
    pub fn set(&self, (blocks, free): (u64, u64)) {
        self.blocks.store(blocks, Ordering::Relaxed);
        self.free.store(free, Ordering::Relaxed);
    }

    /// `(blocks, free)` as last recorded.
    pub fn get(&self) -> (u64, u64) {
        (
            self.blocks.load(Ordering::Relaxed),
            self.free.load(Ordering::Relaxed),
        )
    }
}

/// A committed block, shared with in-flight forward passes; the last holder frees it.
pub type ServingSlot = Arc<Mutex<OwnedStage>>;

/// What the session serves.
pub(crate) enum SessionState {
    /// Attached, nothing committed.
    Open,
    /// A committed block serves forward passes.
    Serving {
        slot: ServingSlot,
        spec: BlockSpec,
        kv_pool: Arc<KvPoolGauge>,
    },
}

/// What the attach stream's task needs to follow its session.
#[derive(Clone)]
pub struct SessionTicket {
    /// The session.
    pub id: SessionId,
    /// The lease in force (after clamping).
    pub lease: Lease,
    /// Cancelled when the session ends, whoever ends it.
    pub cancel: CancellationToken,
    /// Set once, when the session ends.
    pub end: Arc<OnceLock<SessionEnd>>,
}

/// One live session, owned by the registry.
pub(crate) struct Session {
    pub id: SessionId,
    pub client_name: String,
    pub lease: Lease,
    pub opened_at: Instant,
    pub last_heartbeat: Instant,
    pub cancel: CancellationToken,
    pub end: Arc<OnceLock<SessionEnd>>,
    /// Bytes held by every reservation of this session (staged or serving).
    pub bytes: Arc<AtomicU64>,
    pub state: SessionState,
    pub participant: Participant<OwnedStage>,
    /// The block of the Prepare in progress, shared with its handler.
    pub upload: Option<UploadSlot>,
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(upload) = self.upload.take() {
            upload.free();
        }
    }
}

/// The block of a Prepare still receiving its tensors. The session owns it: ending the
/// session frees it at once, even while the Prepare's handler (which copies the chunks into
/// it) has not yet seen the end, so "0 sessions" is never reported while it still holds
/// memory.
#[derive(Clone)]
pub(crate) struct UploadSlot(Arc<Mutex<Option<OwnedStage>>>);

impl UploadSlot {
    pub fn new(staged: OwnedStage) -> Self {
        Self(Arc::new(Mutex::new(Some(staged))))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<OwnedStage>> {
        // A panic while copying a chunk leaves a block the session still frees.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Runs `work` on the block; `None` when the session ended and freed it. The block is
    /// held for the whole of `work`, so an ending session waits for one chunk at most.
    pub fn with<T>(&self, work: impl FnOnce(&mut OwnedStage) -> T) -> Option<T> {
        self.lock().as_mut().map(work)
    }

    /// Takes the block out, to move it into the prepared state.
    pub fn take(&self) -> Option<OwnedStage> {
        self.lock().take()
    }

    /// Frees the block; returns whether there was one. It is dropped while the slot is
    /// still locked, so whoever waits for the slot finds its memory already freed.
    pub fn free(&self) -> bool {
        let mut held = self.lock();
        let staged = held.take();
        let freed = staged.is_some();
        drop(staged);
        freed
    }
}

impl Session {
    pub fn new(client_name: String, lease: Lease, parent: &CancellationToken) -> Self {
        let now = Instant::now();
        Self {
            id: SessionId::new_random(),
            client_name,
            lease,
            opened_at: now,
            last_heartbeat: now,
            cancel: parent.child_token(),
            end: Arc::new(OnceLock::new()),
            bytes: Arc::new(AtomicU64::new(0)),
            state: SessionState::Open,
            participant: Participant::default(),
            upload: None,
        }
    }

    pub fn ticket(&self) -> SessionTicket {
        SessionTicket {
            id: self.id,
            lease: self.lease,
            cancel: self.cancel.clone(),
            end: Arc::clone(&self.end),
        }
    }

    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Acquire)
    }

    pub fn is_expired(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.last_heartbeat) >= self.lease.ttl
    }

    /// Blocks of the committed block's KV pool as of its last operation: `(blocks, free)`.
    pub fn kv_pool(&self) -> (u64, u64) {
        match &self.state {
            SessionState::Open => (0, 0),
            SessionState::Serving { kv_pool, .. } => kv_pool.get(),
        }
    }

    /// Layers served, for status ("3..6"), or empty.
    pub fn layers(&self) -> String {
        match &self.state {
            SessionState::Open => String::new(),
            SessionState::Serving { spec, .. } => {
                format!("{}..{}", spec.first_layer, spec.last_layer)
            }
        }
    }
}
