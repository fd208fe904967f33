//! Embedded workers: real tether workers serving gRPC on loopback inside this process, so
//! `tether run` without `--worker` and the tests exercise the same protocol as a cluster.
//!
//! The binaries start them and hand the coordinator their addresses and token; the
//! coordinator itself only ever sees workers through `tether_client`.
//!
//! [`LocalWorkers`] guard their gRPC port and data links with a token generated at start
//! and never logged, so only the coordinator given [`LocalWorkers::token`] can reach
//! them: another user of the host cannot run Forward on the live session, kill it or
//! drain it.

use crate::model_dir::ModelDirs;
use crate::model_stage::ModelStageFactory;
use crate::registry::{RegistryConfig, SessionRegistry};
use crate::server::{ServerOptions, serve};
use crate::stage::StageFactory;
use std::sync::Arc;
use tether_compute::{CpuBackend, CudaBackend, CudaTuning};
use tether_protocol::{BearerToken, SessionSummary, WorkerStatus};
use tokio::sync::oneshot;

/// Memory left to the rest of the machine when no limit is given: a tenth, at most 1 GiB.
const RESERVE_MAX: u64 = 1 << 30;

/// Threads of each embedded worker's own runtime: enough for its gRPC streams, reaper and
/// heartbeats; compute runs on the backend's threads and the blocking pool, not here.
const WORKER_RUNTIME_THREADS: usize = 2;

/// How to start embedded workers.
#[derive(Clone, Debug, Default)]
pub struct LocalOptions {
    /// Compute threads in all, split evenly between the workers (default: one per core).
    pub threads: Option<usize>,
    /// Admission limit of each worker, in bytes (default: free memory less a reserve).
    pub max_memory: Option<u64>,
    /// GPUs to serve from, one worker each (cuda backend); empty: cpu workers.
    pub gpus: Vec<usize>,
    /// The cuda backend's knobs on those GPUs (the binaries read them from the
    /// environment once: [`CudaTuning::from_env`]).
    pub cuda: CudaTuning,
    /// Directories the workers may read model files from themselves, as a worker's
    /// `--model-dir` (the coordinator names the file); empty: they read none.
    pub model_dirs: ModelDirs,
}

/// Why embedded workers could not start.
#[derive(Debug, thiserror::Error)]
#[error("starting embedded worker {index}: {detail}")]
pub struct LocalError {
    /// Which worker.
    pub index: usize,
    /// What failed.
    pub detail: String,
}

/// One embedded worker. Dropping it shuts it down (every session ends with reason
/// `shutdown`).
pub struct LocalWorker {
    addr: String,
    registry: Arc<SessionRegistry>,
    stop: Option<oneshot::Sender<()>>,
    /// Resolves when its runtime's thread has finished serving.
    task: Option<oneshot::Receiver<()>>,
}

impl LocalWorker {
    /// Starts one open worker (no token: any local process may call it) on 127.0.0.1 with
    /// the given memory limit, on GPU `gpu` (cuda backend) or else the cpu with `threads`
    /// threads. For tests; [`LocalWorkers`] start guarded ones.
    pub async fn start(
        index: usize,
        threads: Option<usize>,
        max_memory: Option<u64>,
        gpu: Option<usize>,
    ) -> Result<LocalWorker, LocalError> {
        let (cuda, dirs) = (CudaTuning::default(), ModelDirs::default());
        Self::start_guarded(index, threads, max_memory, gpu, &cuda, None, dirs).await
    }

    /// As [`LocalWorker::start`], with `cuda`'s knobs on the GPU, requiring `token` on
    /// every worker and admin call and on every data link when one is given, and reading
    /// model files within `model_dirs`.
    pub async fn start_guarded(
        index: usize,
        threads: Option<usize>,
        max_memory: Option<u64>,
        gpu: Option<usize>,
        cuda: &CudaTuning,
        token: Option<BearerToken>,
        model_dirs: ModelDirs,
    ) -> Result<LocalWorker, LocalError> {
        let err = |detail: String| LocalError { index, detail };
        let factory: Arc<dyn StageFactory> = match gpu {
            Some(n) => {
                let backend =
                    CudaBackend::with_tuning(n, cuda).map_err(|e| err(format!("GPU {n}: {e}")))?;
                Arc::new(ModelStageFactory::new(Arc::new(backend)))
            }
            None => {
                let backend = CpuBackend::new(threads).map_err(|e| err(e.to_string()))?;
                Arc::new(ModelStageFactory::new(Arc::new(backend)))
            }
        };
        let max_memory = match max_memory {
            Some(bytes) => bytes,
            None => {
                let (total, free) = factory
                    .memory_info()
                    .map_err(|e| err(format!("reading memory: {e}")))?;
                free.saturating_sub((total / 10).min(RESERVE_MAX))
            }
        };
        let registry = Arc::new(SessionRegistry::new(
            factory,
            max_memory,
            RegistryConfig {
                model_dirs,
                ..RegistryConfig::default()
            },
        ));
        let listener = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| err(format!("binding 127.0.0.1:0: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| err(format!("reading the bound address: {e}")))?
            .to_string();
        // The worker runs on a runtime of its own: heartbeats it receives and its reaper
        // must not wait behind the embedding process's request work, or a busy coordinator
        // would see its own session reaped.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(WORKER_RUNTIME_THREADS)
            .thread_name(format!("tether-worker-{index}"))
            .enable_all()
            .build()
            .map_err(|e| err(format!("starting its runtime: {e}")))?;
        let (stop, stopped) = oneshot::channel::<()>();
        let (done_tx, done) = oneshot::channel::<()>();
        let serving = Arc::clone(&registry);
        std::thread::Builder::new()
            .name(format!("tether-worker-{index}"))
            .spawn(move || {
                runtime.block_on(async move {
                    let shutdown = async {
                        let _ = stopped.await;
                    };
                    let options = ServerOptions {
                        token,
                        ..ServerOptions::default()
                    };
                    let served = match tokio::net::TcpListener::from_std(listener) {
                        Ok(listener) => serve(listener, serving, options, shutdown)
                            .await
                            .map_err(|e| e.to_string()),
                        Err(e) => Err(format!("registering its listener: {e}")),
                    };
                    if let Err(e) = served {
                        tracing::warn!("embedded worker {index} stopped: {e}");
                    }
                });
                let _ = done_tx.send(());
            })
            .map_err(|e| err(format!("starting its thread: {e}")))?;
        let task = Some(done);
        tracing::debug!(%addr, max_memory, "embedded worker {index} listening");
        Ok(LocalWorker {
            addr,
            registry,
            stop: Some(stop),
            task,
        })
    }

    /// Its address ("127.0.0.1:PORT").
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Its status, as `tetherctl status` would show it.
    pub fn status(&self) -> WorkerStatus {
        self.registry.status()
    }

    /// Every live session, as the admin service lists them.
    pub fn sessions(&self) -> Vec<SessionSummary> {
        self.registry.sessions()
    }

    /// The time its forward passes took so far, in all.
    pub fn forward_time(&self) -> std::time::Duration {
        self.registry.forward_time()
    }

    /// Shuts it down and waits until every session is freed.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for LocalWorker {
    fn drop(&mut self) {
        // The server task sees the stop and ends every session; nobody waits for it here.
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Several embedded workers sharing one secret; dropping it shuts them all down.
pub struct LocalWorkers {
    /// The workers, in the order started.
    pub workers: Vec<LocalWorker>,
    token: BearerToken,
}

impl LocalWorkers {
    /// Starts `n` workers (at least one), splitting the threads evenly between them; with
    /// `options.gpus`, worker `i` serves GPU `gpus[i % gpus.len()]`. They require a token
    /// generated here: connect with [`LocalWorkers::token`].
    pub async fn start(n: usize, options: &LocalOptions) -> Result<LocalWorkers, LocalError> {
        let n = n.max(1);
        let total = options.threads.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(usize::from)
                .unwrap_or(1)
        });
        let per_worker = (total / n).max(1);
        let token = BearerToken::generate();
        let mut workers = Vec::with_capacity(n);
        for i in 0..n {
            let gpu = (!options.gpus.is_empty()).then(|| options.gpus[i % options.gpus.len()]);
            let worker = LocalWorker::start_guarded(
                i,
                Some(per_worker),
                options.max_memory,
                gpu,
                &options.cuda,
                Some(token.clone()),
                options.model_dirs.clone(),
            )
            .await?;
            workers.push(worker);
        }
        Ok(LocalWorkers { workers, token })
    }

    /// The secret every call to them must carry (worker, admin and data-link calls alike):
    /// a client reaches them with `tether_client::ClientOptions::with_token`.
    pub fn token(&self) -> &BearerToken {
        &self.token
    }

    /// Their addresses.
    pub fn addrs(&self) -> Vec<String> {
        self.workers.iter().map(|w| w.addr.clone()).collect()
    }

    /// The time their forward passes took so far, in all.
    pub fn forward_time(&self) -> std::time::Duration {
        self.workers.iter().map(LocalWorker::forward_time).sum()
    }

    /// Shuts every worker down and waits for each.
    pub async fn shutdown(self) {
        for w in self.workers {
            w.shutdown().await;
        }
    }
}
