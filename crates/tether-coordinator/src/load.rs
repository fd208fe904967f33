//! Two-phase load of a [`Plan`]: a session on every worker, Prepare on all at once (tensor
//! bytes streamed from the coordinator's mmap, or read by each worker from its own copy of
//! the file with `--model-path-on-workers`), then Commit on all when every worker voted
//! yes, or Abort on all and close every session. A half-loaded model never serves.

mod prepare;

use crate::load_report::{LoadReport, WorkerLoad};
use crate::model_file::{MappedSource, ModelFile};
use crate::placement::{Assignment, Plan};
use crate::progress::LoadProgress;
use futures::future::join_all;
use prepare::{PrepareJob, prepare_worker};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tether_client::DataLink;
use tether_client::{AttachOptions, LoadRequest, Prepared, Session, TensorSource, WorkerClient};
use tether_protocol::{BlockSpec, EndReason, Lease, SessionId, TxnId};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// How sessions are opened and blocks loaded.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Who is attaching, for the workers' logs.
    pub client_name: String,
    /// The lease asked for.
    pub lease: Lease,
    /// How long a prepared block waits for Commit/Abort before the worker aborts it.
    pub decision_timeout: Duration,
    /// Bytes per tensor chunk message.
    pub chunk_bytes: usize,
    /// Test hook: wait this long after every worker voted yes and before Commit, so tests
    /// can kill the coordinator between the two phases. `None` outside tests.
    pub pause_before_commit: Option<Duration>,
    /// Where to report the bytes streamed to each worker (progress bars).
    pub progress: Option<Arc<LoadProgress>>,
    /// The model's path as the workers see it (`--model-path-on-workers`): each worker is
    /// asked to read its tensors from there; one that refuses gets them streamed. `None`:
    /// stream to every worker.
    pub model_path_on_workers: Option<String>,
    /// Run forward passes over each worker's data link where it serves one (see
    /// `tether_protocol::link`); `false` keeps them on gRPC.
    pub data_links: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            client_name: format!("tether-coordinator:{}", std::process::id()),
            lease: Lease {
                heartbeat_interval: Duration::from_secs(1),
                ttl: Duration::from_secs(10),
            },
            decision_timeout: Duration::from_secs(60),
            chunk_bytes: tether_client::DEFAULT_CHUNK_BYTES,
            pause_before_commit: None,
            progress: None,
            model_path_on_workers: None,
            data_links: true,
        }
    }
}

/// Why a load failed; nothing stays loaded on any worker afterwards.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The plan names a worker no client was given for.
    #[error("the plan names worker {0} but no connection to it was given")]
    NoClient(String),
    /// A session could not be opened.
    #[error("opening a session on worker {addr} failed: {detail}; no worker keeps anything loaded")]
    Attach {
        /// The worker.
        addr: String,
        /// Its error.
        detail: String,
    },
    /// A worker voted no in Prepare; every worker aborted.
    #[error(
        "worker {addr} refused layers {first}..{last}: {detail}; the load was aborted on every worker and nothing stays loaded"
    )]
    Refused {
        /// The worker.
        addr: String,
        /// First layer of its block.
        first: usize,
        /// One past its last layer.
        last: usize,
        /// Its error.
        detail: String,
        /// Whether it refused for lack of memory (its admission said no).
        out_of_memory: bool,
    },
    /// Commit failed on a worker after every worker prepared; every session was closed.
    #[error(
        "commit on worker {addr} failed: {detail}; every session was closed so nothing stays loaded"
    )]
    Commit {
        /// The worker.
        addr: String,
        /// Its error.
        detail: String,
    },
}

/// How a worker got its block's tensor bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BytesVia {
    /// Streamed from the coordinator's copy in the Prepare stream.
    Stream,
    /// Read by the worker from its own copy (`--model-path-on-workers`).
    WorkerFile,
}

impl std::fmt::Display for BytesVia {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Stream => "streamed from the coordinator",
            Self::WorkerFile => "read from the worker's own copy",
        })
    }
}

/// A block committed on one worker.
#[derive(Clone)]
pub struct LoadedStage {
    /// The connection.
    pub client: WorkerClient,
    /// The session holding the block.
    pub session: SessionId,
    /// The block.
    pub spec: BlockSpec,
    /// Bytes the worker reserved for it.
    pub reserved: u64,
    /// How its tensor bytes got there.
    pub via: BytesVia,
    /// Its data link, when the worker serves one and the load asked for links.
    pub link: Option<Arc<DataLink>>,
    /// The slots it hands hidden states to the next stage's GPU in, when the two can
    /// (set after the load by `handoff_probe::probe`).
    pub handoff: Option<Arc<crate::handoff::Handoff>>,
}

fn block_bytes(model: &ModelFile, a: &Assignment) -> u64 {
    a.tensors
        .iter()
        .filter_map(|t| model.gguf().tensor(t))
        .map(|t| t.bytes)
        .sum()
}

/// Why a loaded model's sessions ended, as the session watcher saw it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SessionLoss {
    /// A worker ended its session: it crashed, shut down, reaped or killed it.
    #[error("worker {worker} ended its session ({reason})")]
    Ended {
        /// The worker's address.
        worker: String,
        /// Why the worker ended it.
        reason: EndReason,
    },
    /// The watcher itself is gone (the model was dropped meanwhile).
    #[error("the session watcher stopped")]
    WatcherStopped,
}

/// A model committed on every worker of a plan. Its sessions are watched: when any ends,
/// the others are closed and [`LoadedModel::lost`] resolves. Dropping it closes them all.
pub struct LoadedModel {
    /// The blocks, in layer order.
    pub stages: Vec<LoadedStage>,
    lost: watch::Receiver<Option<SessionLoss>>,
    close: Option<oneshot::Sender<()>>,
    guard: Option<JoinHandle<()>>,
    close_wait: Duration,
}

impl LoadedModel {
    /// Resolves with the reason once any session has ended (all others are then closed).
    pub async fn lost(&mut self) -> SessionLoss {
        match self.lost.wait_for(Option::is_some).await {
            Ok(reason) => reason.clone().unwrap_or(SessionLoss::WatcherStopped),
            Err(_) => SessionLoss::WatcherStopped,
        }
    }

    /// Why a session ended, if one has.
    pub fn lost_reason(&self) -> Option<SessionLoss> {
        self.lost.borrow().clone()
    }

    /// Closes every session and waits until the workers confirm (or the lease passes).
    pub async fn close(mut self) {
        if let Some(close) = self.close.take() {
            let _ = close.send(());
        }
        if let Some(guard) = self.guard.take() {
            let _ = tokio::time::timeout(self.close_wait, guard).await;
        }
    }
}

impl Drop for LoadedModel {
    fn drop(&mut self) {
        // Dropping `close` tells the watcher to close every session; it owns them.
        drop(self.close.take());
    }
}

/// Watches `sessions`; on the first end, or on `close`, closes them all.
async fn watch_sessions(
    mut sessions: Vec<(String, Session)>,
    links: Vec<Arc<DataLink>>,
    lost: watch::Sender<Option<SessionLoss>>,
    close: oneshot::Receiver<()>,
    close_wait: Duration,
) {
    if !sessions.is_empty() {
        let ends = futures::future::select_all(sessions.iter_mut().map(|(addr, s)| {
            Box::pin(async move {
                let end = s.ended().await;
                (addr.clone(), end)
            })
        }));
        tokio::select! {
            ((addr, end), _, _) = ends => {
                let reason = SessionLoss::Ended { worker: addr, reason: end.reason };
                tracing::warn!("{reason}; closing the sessions on the other workers");
                let _ = lost.send(Some(reason));
            }
            _ = close => {}
        }
    }
    // A forward blocked on a link to a lost worker returns now instead of waiting on TCP.
    for link in &links {
        link.shut();
    }
    close_sessions(sessions, close_wait).await;
}

/// Opens a data link to `session` on `client`'s worker; `None` (forward passes stay on
/// gRPC) when it serves none or the link fails, which costs speed, not correctness.
async fn open_link(client: &WorkerClient, session: SessionId) -> Option<Arc<DataLink>> {
    match client.open_data_link(session).await {
        Ok(link) => link.map(Arc::new),
        Err(e) => {
            tracing::warn!(worker = %client.addr(), "no data link, forward passes use gRPC: {e}");
            None
        }
    }
}

async fn close_sessions(sessions: Vec<(String, Session)>, wait: Duration) {
    join_all(sessions.into_iter().map(|(addr, s)| async move {
        if tokio::time::timeout(wait, s.close()).await.is_err() {
            tracing::warn!(worker = %addr, "closing the session timed out; the lease will free it");
        }
    }))
    .await;
}

/// Loads `plan` over `clients` (one per worker of the plan) by two-phase commit.
pub async fn load_plan(
    model: &Arc<ModelFile>,
    plan: &Plan,
    clients: &[WorkerClient],
    options: &LoadOptions,
) -> Result<LoadedModel, LoadError> {
    let started = Instant::now();
    let mut report = LoadReport::default();
    let close_wait = options.lease.ttl + Duration::from_secs(1);
    let mut picked = Vec::with_capacity(plan.assignments.len());
    for a in &plan.assignments {
        let client = clients
            .iter()
            .find(|c| c.addr() == a.addr)
            .ok_or_else(|| LoadError::NoClient(a.addr.clone()))?;
        picked.push((client.clone(), a));
    }

    let attach = AttachOptions {
        client_name: options.client_name.clone(),
        lease: options.lease,
        heartbeat: true,
    };
    let opened = join_all(picked.iter().map(|(c, _)| c.attach(attach.clone()))).await;
    let mut sessions = Vec::with_capacity(opened.len());
    let mut attach_error = None;
    for ((client, _), result) in picked.iter().zip(opened) {
        match result {
            Ok(s) => sessions.push((client.addr().to_string(), s)),
            Err(e) => {
                attach_error.get_or_insert(LoadError::Attach {
                    addr: client.addr().to_string(),
                    detail: e.to_string(),
                });
            }
        }
    }
    if let Some(e) = attach_error {
        close_sessions(sessions, close_wait).await;
        return Err(e);
    }
    report.attach = started.elapsed();
    let preparing = Instant::now();

    let txn = TxnId::new_random();
    let source: Arc<dyn TensorSource> = Arc::new(MappedSource(Arc::clone(model)));
    let totals: Vec<u64> = picked.iter().map(|(_, a)| block_bytes(model, a)).collect();
    let counters = options.progress.as_ref().map_or_else(
        || picked.iter().map(|_| Arc::default()).collect(),
        |p| {
            p.begin(
                picked
                    .iter()
                    .zip(&totals)
                    .map(|((client, _), &bytes)| (client.addr().to_string(), bytes)),
            )
        },
    );
    let votes = join_all(picked.iter().zip(&sessions).zip(counters).zip(&totals).map(
        |((((client, a), (_, s)), sent), &total)| {
            prepare_worker(PrepareJob {
                client,
                session: s.id(),
                request: LoadRequest {
                    txn,
                    gguf_header: model.header().to_vec(),
                    gguf_file_bytes: model.file_bytes(),
                    spec: a.spec,
                    tensors: a.tensors.clone(),
                    decision_timeout: Some(options.decision_timeout),
                    chunk_bytes: options.chunk_bytes,
                    local_path: None,
                    same_file: None,
                },
                source: Arc::clone(&source),
                sent,
                total,
                path_on_workers: options.model_path_on_workers.as_deref(),
                same_file: model.identity(),
                progress: options.progress.as_deref(),
            })
        },
    ))
    .await;
    report.prepare = preparing.elapsed();

    let refusal = picked.iter().zip(&votes).find_map(|((client, a), v)| {
        v.result.as_ref().err().map(|e| LoadError::Refused {
            addr: client.addr().to_string(),
            first: a.spec.first_layer,
            last: a.spec.last_layer,
            detail: e.to_string(),
            out_of_memory: e.kind() == tether_client::ErrorKind::ResourceExhausted,
        })
    });
    if let Some(refusal) = refusal {
        tracing::warn!("{refusal}");
        join_all(
            picked
                .iter()
                .zip(&sessions)
                .zip(&votes)
                .map(|(((c, _), (_, s)), v)| c.abort(s.id(), v.txn)),
        )
        .await;
        close_sessions(sessions, close_wait).await;
        return Err(refusal);
    }

    if let Some(pause) = options.pause_before_commit {
        tracing::warn!(
            ?pause,
            "debug hook: every worker prepared; pausing before Commit"
        );
        tokio::time::sleep(pause).await;
    }
    let committing = Instant::now();
    let committed = join_all(
        picked
            .iter()
            .zip(&sessions)
            .zip(&votes)
            .map(|(((c, _), (_, s)), v)| c.commit(s.id(), v.txn)),
    )
    .await;
    if let Some((client, e)) = picked
        .iter()
        .zip(committed)
        .find_map(|((c, _), r)| r.err().map(|e| (c, e)))
    {
        close_sessions(sessions, close_wait).await;
        return Err(LoadError::Commit {
            addr: client.addr().to_string(),
            detail: e.to_string(),
        });
    }

    report.commit = committing.elapsed();
    let linking = Instant::now();
    let links: Vec<Option<Arc<DataLink>>> = if options.data_links {
        join_all(
            picked
                .iter()
                .zip(&sessions)
                .map(|((client, _), (_, s))| open_link(client, s.id())),
        )
        .await
    } else {
        vec![None; picked.len()]
    };
    report.links = linking.elapsed();
    let stages: Vec<LoadedStage> = picked
        .iter()
        .zip(&sessions)
        .zip(&votes)
        .zip(links)
        .map(|((((client, a), (_, s)), v), link)| {
            let (prepared, via) = v
                .result
                .as_ref()
                .map_or((Prepared::default(), BytesVia::Stream), |r| *r);
            LoadedStage {
                client: client.clone(),
                session: s.id(),
                spec: a.spec,
                reserved: prepared.reserved,
                via,
                link,
                handoff: None,
            }
        })
        .collect();
    report.workers = picked
        .iter()
        .zip(&votes)
        .zip(&totals)
        .map(|(((client, _), v), &tensor_bytes)| {
            let (prepared, via) = v
                .result
                .as_ref()
                .map_or((Prepared::default(), BytesVia::Stream), |r| *r);
            WorkerLoad {
                addr: client.addr().to_string(),
                via,
                tensor_bytes,
                prepared,
                refused_local: v.refused_local,
            }
        })
        .collect();
    report.total = started.elapsed();
    report.log();
    if let Some(progress) = &options.progress {
        progress.set_report(report);
    }
    let shut_links: Vec<Arc<DataLink>> = stages.iter().filter_map(|st| st.link.clone()).collect();
    tracing::info!(
        "forward passes go over data links to {} of {} workers, over gRPC to the rest",
        shut_links.len(),
        stages.len()
    );
    let (lost_tx, lost) = watch::channel(None);
    let (close_tx, close_rx) = oneshot::channel();
    let guard = tokio::spawn(watch_sessions(
        sessions, shut_links, lost_tx, close_rx, close_wait,
    ));
    Ok(LoadedModel {
        stages,
        lost,
        close: Some(close_tx),
        guard: Some(guard),
        close_wait,
    })
}
