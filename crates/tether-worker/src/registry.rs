//! The session registry: every live session of the worker, keyed by id. Opening, heartbeats,
//! ending (close, disconnect, reap, kill, shutdown), drain and status live here; loading and
//! serving are in [`crate::load`] and [`crate::serve`].

use crate::ledger::MemoryLedger;
use crate::metrics::WorkerMetrics;
use crate::model_dir::ModelDirs;
use crate::session::{Session, SessionTicket};
use crate::stage::StageFactory;
use crate::status::{Counters, process_rss_bytes};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tether_protocol::SessionId;
use tether_protocol::{EndReason, Lease, SessionEnd};
use tether_protocol::{MemorySource, SessionSummary, WorkerStatus};
use tether_protocol::{Result, WorkerError};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Limits and defaults of a registry.
#[derive(Clone, Debug)]
pub struct RegistryConfig {
    /// Lease used when the client asks for 0.
    pub default_lease: Lease,
    /// Shortest TTL granted.
    pub min_ttl: Duration,
    /// Longest TTL granted.
    pub max_ttl: Duration,
    /// How long a prepared transaction waits for a decision when the client names none.
    pub decision_timeout: Duration,
    /// Longest decision timeout granted.
    pub max_decision_timeout: Duration,
    /// The worker's build, for Hello and status.
    pub worker_version: String,
    /// Most live sessions in all (`None`: no limit but memory).
    pub max_sessions: Option<usize>,
    /// Most live sessions of one client name (`None`: no limit).
    pub max_sessions_per_client: Option<usize>,
    /// Most bytes one session may hold (`None`: no limit but memory).
    pub max_session_bytes: Option<u64>,
    /// Directories the worker reads its own copies of model files from (`--model-dir`);
    /// empty: every Prepare must send its tensors.
    pub model_dirs: ModelDirs,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            default_lease: Lease {
                heartbeat_interval: Duration::from_secs(1),
                ttl: Duration::from_secs(10),
            },
            min_ttl: Duration::from_millis(100),
            max_ttl: Duration::from_secs(600),
            decision_timeout: Duration::from_secs(30),
            max_decision_timeout: Duration::from_secs(600),
            worker_version: format!("tether {}", env!("CARGO_PKG_VERSION")),
            max_sessions: None,
            max_sessions_per_client: None,
            max_session_bytes: None,
            model_dirs: ModelDirs::default(),
        }
    }
}

pub(crate) struct Inner {
    pub sessions: HashMap<SessionId, Session>,
    /// Byte counters of ended sessions that something else still held bytes of when they
    /// ended (a block being built for a Prepare, a forward pass in flight): they count as
    /// sessions until those bytes are freed, so "0 sessions" never comes with bytes held.
    pub ending: Vec<Arc<AtomicU64>>,
    pub draining: bool,
    pub closed: bool,
}

impl Inner {
    /// Takes session `id` out of the live ones and counts it in `ending` until its bytes
    /// are freed, in the same critical section, so no status sees it in neither list while
    /// its blocks are still being dropped.
    fn take(&mut self, id: &SessionId) -> Option<Session> {
        let session = self.sessions.remove(id)?;
        self.ending.retain(|b| b.load(Ordering::Acquire) > 0);
        self.ending.push(Arc::clone(&session.bytes));
        Some(session)
    }
}

/// Every live session of one worker, the memory ledger they reserve from, and the factory
/// that builds their layer blocks.
pub struct SessionRegistry {
    pub(crate) inner: Mutex<Inner>,
    pub(crate) ledger: Arc<MemoryLedger>,
    pub(crate) factory: Arc<dyn StageFactory>,
    pub(crate) counters: Counters,
    pub(crate) config: RegistryConfig,
    /// Parent of every session's token; cancelled at shutdown.
    root: CancellationToken,
    /// Blocking work (builds, forward passes) that shutdown waits for.
    pub(crate) tracker: TaskTracker,
    started: Instant,
    baseline_used: u64,
    /// This process's device bytes when the registry was made, where the device counts
    /// them per process (NVML).
    baseline_process: Option<u64>,
    /// Resident memory of the process when the registry was made, before any session.
    baseline_rss: u64,
    /// `true` while new sessions are admitted; the health service watches it.
    accepting: tokio::sync::watch::Sender<bool>,
    pub(crate) metrics: WorkerMetrics,
}

impl SessionRegistry {
    /// A registry admitting `max_memory` bytes of session memory on `factory`'s device.
    pub fn new(factory: Arc<dyn StageFactory>, max_memory: u64, config: RegistryConfig) -> Self {
        let baseline_process = factory.process_device_bytes();
        let baseline_used = factory
            .memory_info()
            .map_or(0, |(total, free)| total - free.min(total));
        Self {
            inner: Mutex::new(Inner {
                sessions: HashMap::new(),
                ending: Vec::new(),
                draining: false,
                closed: false,
            }),
            ledger: Arc::new(
                MemoryLedger::new(max_memory).with_session_limit(config.max_session_bytes),
            ),
            factory,
            counters: Counters::default(),
            config,
            root: CancellationToken::new(),
            tracker: TaskTracker::new(),
            started: Instant::now(),
            baseline_used,
            baseline_process,
            baseline_rss: process_rss_bytes(),
            accepting: tokio::sync::watch::Sender::new(true),
            metrics: WorkerMetrics::default(),
        }
    }

    /// The registry's limits.
    pub fn config(&self) -> &RegistryConfig {
        &self.config
    }

    /// The device's name.
    pub fn device_name(&self) -> String {
        self.factory.device_name()
    }

    /// Whether the device's memory is this process's host memory (the cpu device).
    pub fn holds_host_memory(&self) -> bool {
        self.factory.holds_host_memory()
    }

    /// The time every forward pass so far took on the device, in all.
    pub fn forward_time(&self) -> Duration {
        self.metrics.forward_total()
    }

    /// Bytes a new reservation may still take.
    pub fn available_bytes(&self) -> u64 {
        self.ledger.available()
    }

    /// Tracks the worker's blocking work; shutdown waits on it.
    pub fn tracker(&self) -> &TaskTracker {
        &self.tracker
    }

    /// Whether `session` is live.
    pub(crate) fn holds(&self, session: SessionId) -> bool {
        self.lock().sessions.contains_key(&session)
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data behind; keep serving.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Opens a session for `client_name` with the lease asked for (clamped to the limits;
    /// refused when its heartbeat interval is under [`min_heartbeat_interval`]).
    pub fn open(&self, client_name: &str, asked: Lease) -> Result<SessionTicket> {
        let lease = self.clamp_lease(asked)?;
        let mut inner = self.lock();
        if inner.closed {
            return Err(WorkerError::Unavailable(
                "the worker is shutting down; attach to another worker".into(),
            ));
        }
        if inner.draining {
            return Err(WorkerError::Unavailable(
                "the worker is draining and accepts no new sessions; attach to another worker"
                    .into(),
            ));
        }
        let name: String = client_name.chars().take(256).collect();
        self.check_session_limits(&inner, &name)?;
        let session = Session::new(name.clone(), lease, &self.root);
        let ticket = session.ticket();
        inner.sessions.insert(session.id, session);
        drop(inner);
        self.counters.opened.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            session = %ticket.id,
            client = %name,
            heartbeat_ms = lease.heartbeat_interval.as_millis() as u64,
            ttl_ms = lease.ttl.as_millis() as u64,
            "session opened"
        );
        Ok(ticket)
    }

    /// Refuses a new session beyond `--max-sessions` or `--max-sessions-per-client`, so one
    /// client (or a crowd) cannot hold every slot while memory is still free.
    fn check_session_limits(&self, inner: &Inner, client: &str) -> Result<()> {
        let live = inner.sessions.len();
        if let Some(max) = self.config.max_sessions
            && live >= max
        {
            return Err(WorkerError::OverLimit(format!(
                "this worker already has {live} sessions (--max-sessions {max}); end one or attach to another worker"
            )));
        }
        if let Some(max) = self.config.max_sessions_per_client {
            let mine = inner
                .sessions
                .values()
                .filter(|s| s.client_name == client)
                .count();
            if mine >= max {
                return Err(WorkerError::OverLimit(format!(
                    "client {client:?} already has {mine} sessions on this worker (--max-sessions-per-client {max}); end one first"
                )));
            }
        }
        Ok(())
    }

    fn clamp_lease(&self, asked: Lease) -> Result<Lease> {
        let c = &self.config;
        let ttl = if asked.ttl.is_zero() {
            c.default_lease.ttl
        } else {
            asked.ttl
        };
        let ttl = ttl.clamp(c.min_ttl, c.max_ttl);
        let interval = if asked.heartbeat_interval.is_zero() {
            c.default_lease.heartbeat_interval
        } else {
            asked.heartbeat_interval
        };
        let floor = min_heartbeat_interval(ttl);
        if interval < floor {
            return Err(WorkerError::InvalidArgument(format!(
                "heartbeat interval {interval:?} is too short for a lease of {ttl:?}: give at \
                 least {floor:?} (TTL/60, and at least 50ms); heartbeats that often only cost \
                 the worker CPU"
            )));
        }
        // A heartbeat slower than the TTL would reap a healthy client.
        let interval = interval.min(ttl / 2);
        Ok(Lease {
            heartbeat_interval: interval,
            ttl,
        })
    }

    /// Records a client heartbeat, renewing the lease.
    pub fn heartbeat(&self, id: SessionId) -> Result<()> {
        let mut inner = self.lock();
        let session = inner
            .sessions
            .get_mut(&id)
            .ok_or_else(|| unknown_session(id))?;
        session.last_heartbeat = Instant::now();
        Ok(())
    }

    /// Ends a session: removes it, cancels its token, frees everything it owns and logs the
    /// reason. Returns `None` when it had ended already.
    pub fn end(&self, id: SessionId, reason: EndReason) -> Option<SessionEnd> {
        let session = self.lock().take(&id)?;
        Some(self.finish(session, reason))
    }

    fn finish(&self, session: Session, reason: EndReason) -> SessionEnd {
        let bytes_freed = session.bytes();
        let end = SessionEnd {
            reason,
            bytes_freed,
        };
        let _ = session.end.set(end);
        session.cancel.cancel();
        let counter = match reason {
            EndReason::Closed => &self.counters.closed,
            EndReason::Disconnected => &self.counters.disconnected,
            EndReason::Reaped => &self.counters.reaped,
            EndReason::Killed => &self.counters.killed,
            EndReason::Shutdown => &self.counters.shutdown,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let (id, client) = (session.id, session.client_name.clone());
        let lived_ms = session.opened_at.elapsed().as_millis() as u64;
        let bytes = Arc::clone(&session.bytes);
        // Frees the committed block, prepared transactions and the block of a Prepare in
        // progress (waiting for the chunk being copied into it).
        drop(session);
        crate::heap::return_freed_heap();
        // `Inner::take` already counts the session in `ending` while this is above 0.
        let still_held = bytes.load(Ordering::Acquire);
        tracing::info!(
            session = %id,
            client = %client,
            reason = %reason,
            bytes_freed,
            still_held,
            lived_ms,
            "session ended"
        );
        end
    }

    /// Ends a session on an operator's request.
    pub fn kill(&self, id: SessionId) -> Result<SessionEnd> {
        self.end(id, EndReason::Killed)
            .ok_or_else(|| unknown_session(id))
    }

    /// Refuses new sessions from now on; returns how many are live.
    pub fn drain(&self) -> usize {
        let mut inner = self.lock();
        inner.draining = true;
        self.accepting.send_replace(false);
        tracing::info!(
            live = inner.sessions.len(),
            "draining: new sessions are refused"
        );
        inner.sessions.len()
    }

    /// Takes new sessions again after [`SessionRegistry::drain`]; returns whether it was
    /// draining. Refused once shutdown has begun: that is one-way.
    pub fn undrain(&self) -> Result<bool> {
        let mut inner = self.lock();
        if inner.closed {
            return Err(WorkerError::Unavailable(
                "the worker is shutting down; it takes no sessions again".into(),
            ));
        }
        let was_draining = std::mem::replace(&mut inner.draining, false);
        self.accepting.send_replace(true);
        tracing::info!(was_draining, "undrained: new sessions are taken again");
        Ok(was_draining)
    }

    /// Refuses new sessions and ends every live one with reason `shutdown`.
    pub fn shutdown(&self) -> usize {
        let sessions: Vec<Session> = {
            let mut inner = self.lock();
            inner.closed = true;
            self.accepting.send_replace(false);
            let ids: Vec<SessionId> = inner.sessions.keys().copied().collect();
            ids.iter().filter_map(|id| inner.take(id)).collect()
        };
        let n = sessions.len();
        for session in sessions {
            self.finish(session, EndReason::Shutdown);
        }
        self.root.cancel();
        n
    }

    /// Ends sessions whose lease expired and aborts prepared transactions past their
    /// decision deadline. Returns the number of sessions reaped.
    pub fn reap_expired(&self, now: Instant) -> usize {
        let (expired, aborted) = {
            let mut inner = self.lock();
            let ids: Vec<SessionId> = inner
                .sessions
                .values()
                .filter(|s| s.is_expired(now))
                .map(|s| s.id)
                .collect();
            let expired: Vec<Session> = ids.iter().filter_map(|id| inner.take(id)).collect();
            let mut aborted = Vec::new();
            for s in inner.sessions.values_mut() {
                let timed_out = &self.counters.txn_timed_out;
                let expired = s.participant.expire(now, |_| {
                    timed_out.fetch_add(1, Ordering::Relaxed);
                });
                for txn in expired {
                    aborted.push((s.id, txn));
                }
            }
            (expired, aborted)
        };
        for (session, txn) in aborted {
            tracing::info!(session = %session, txn = %txn, "prepared transaction aborted: no decision within its timeout");
        }
        let n = expired.len();
        for session in expired {
            self.finish(session, EndReason::Reaped);
        }
        n
    }

    /// Whether new sessions are admitted now (not draining, not shutting down), and every
    /// change from here on.
    pub fn accepting(&self) -> tokio::sync::watch::Receiver<bool> {
        self.accepting.subscribe()
    }

    /// Memory held beyond the idle baseline and the sessions' bytes, and where the figure
    /// comes from. Each source counts only this process where it can, so another process
    /// on the same device (a second worker) does not show here: on a device whose memory
    /// is host memory (cpu) the worker's resident set; on a GPU the driver's per-process
    /// count (NVML) when it lists this process, else the device's used bytes.
    fn unaccounted_bytes(
        &self,
        device_used: u64,
        process_used: Option<u64>,
        rss: u64,
        session_bytes: u64,
    ) -> (u64, MemorySource) {
        let over = |now: u64, base: u64| now.saturating_sub(base.saturating_add(session_bytes));
        if self.factory.holds_host_memory() {
            return (over(rss, self.baseline_rss), MemorySource::ProcessRss);
        }
        match (process_used, self.baseline_process) {
            (Some(now), Some(base)) => (over(now, base), MemorySource::DriverPerProcess),
            _ => (
                over(device_used, self.baseline_used),
                MemorySource::DeviceUsed,
            ),
        }
    }

    /// The worker's state for `tetherctl status`.
    pub fn status(&self) -> WorkerStatus {
        // Sessions before bytes: an ending session's bytes may go to 0 in between, never
        // the other way round.
        let (sessions, draining) = {
            let mut inner = self.lock();
            inner
                .ending
                .retain(|bytes| bytes.load(Ordering::Acquire) > 0);
            let sessions = inner.sessions.len() + inner.ending.len();
            (sessions as u32, inner.draining || inner.closed)
        };
        let (total, free) = self.factory.memory_info().unwrap_or((0, 0));
        let used = total.saturating_sub(free);
        let session_bytes = self.ledger.reserved();
        let rss = process_rss_bytes();
        let process_used = self.factory.process_device_bytes();
        let (unaccounted, source) = self.unaccounted_bytes(used, process_used, rss, session_bytes);
        WorkerStatus {
            worker_version: self.config.worker_version.clone(),
            device: self.factory.device_name(),
            device_total_bytes: total,
            device_free_bytes: free,
            baseline_used_bytes: self.baseline_used,
            max_memory_bytes: self.ledger.limit(),
            sessions,
            session_bytes,
            unaccounted_bytes: unaccounted,
            memory_source: source,
            process_device_bytes: process_used.unwrap_or(0),
            baseline_process_device_bytes: self.baseline_process.unwrap_or(0),
            counters: self.counters.snapshot(),
            draining,
            uptime_s: self.started.elapsed().as_secs(),
            process_rss_bytes: rss,
            baseline_rss_bytes: self.baseline_rss,
        }
    }

    /// Every live session, oldest first.
    pub fn sessions(&self) -> Vec<SessionSummary> {
        let now = Instant::now();
        let inner = self.lock();
        let mut list: Vec<(Instant, SessionSummary)> = inner
            .sessions
            .values()
            .map(|s| {
                let (kv_blocks, kv_blocks_free) = s.kv_pool();
                let summary = SessionSummary {
                    session_id: s.id.to_string(),
                    client_name: s.client_name.clone(),
                    bytes: s.bytes(),
                    layers: s.layers(),
                    ttl_ms: s.lease.ttl.as_millis() as u32,
                    last_heartbeat_ms_ago: now
                        .saturating_duration_since(s.last_heartbeat)
                        .as_millis() as u64,
                    age_ms: now.saturating_duration_since(s.opened_at).as_millis() as u64,
                    prepared_txns: s.participant.prepared_count() as u32,
                    kv_blocks,
                    kv_blocks_free,
                };
                (s.opened_at, summary)
            })
            .collect();
        list.sort_by_key(|(t, _)| *t);
        list.into_iter().map(|(_, s)| s).collect()
    }
}

pub(crate) fn unknown_session(id: SessionId) -> WorkerError {
    WorkerError::NotFound(format!(
        "session {id} is unknown to this worker (it ended or never existed); attach again"
    ))
}

/// The shortest heartbeat interval granted for a lease of `ttl`: a sixtieth of it and at
/// least 50 ms, so that 300 sessions of 10 ms heartbeats cannot take a fifth of a core; for
/// leases under 150 ms a third of the TTL, which coordinators ask for.
pub fn min_heartbeat_interval(ttl: Duration) -> Duration {
    (ttl / 60).max(Duration::from_millis(50).min(ttl / 3))
}
