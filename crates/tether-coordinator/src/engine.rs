//! [`Coordinator`]: the generation engine over workers. It connects to the workers, places
//! the model, loads it by two-phase commit, and hands it to the scheduler task, which serves
//! [`Generation`] requests with continuous batching.

use crate::api::{
    ContextShift, EngineStats, GenError, GenEvents, GenRequest, Generation, Health, ModelChange,
    ModelInfo,
};
use crate::discovery::{WorkerDns, resolve, watch_dns, worker_list};
use crate::lifecycle::ChangeState;
use crate::load::{LoadError, LoadOptions, LoadedModel, load_plan};
use crate::loss::Loss;
use crate::model_file::ModelFile;
use crate::placement::{PlacementError, Plan, ServeShape, WorkerCapacity, place};
use crate::scheduler::replace::Replace;
use crate::scheduler::{Admitted, Choice, Inbox, Scheduler, Shared};
use futures::future::join_all;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tether_client::{ClientOptions, WorkerClient};
use tether_gguf::GgmlType;
use tether_model::kv_ring;
use tether_model::tokenizer::Tokenizer;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How the coordinator serves.
#[derive(Clone, Debug)]
pub struct CoordinatorConfig {
    /// The model's id in the API.
    pub model_id: String,
    /// Worker addresses, in layer order.
    pub workers: Vec<String>,
    /// A DNS name whose addresses are more workers (after `workers`), resolved again
    /// periodically; a change of its addresses unloads the model and loads it again.
    pub worker_dns: Option<WorkerDns>,
    /// Relative share of the model per worker (`--split 3,1`); `None` = by free memory.
    pub split: Option<Vec<f64>>,
    /// KV cells per sequence.
    pub ctx_per_seq: usize,
    /// Sequences served at once (`--parallel`).
    pub parallel: usize,
    /// Most tokens in one forward pass.
    pub ubatch: usize,
    /// Element type of the K cache on every worker (F16, Q8_0 or Q4_0; `--cache-type-k`).
    pub cache_k: GgmlType,
    /// Element type of the V cache on every worker (`--cache-type-v`).
    pub cache_v: GgmlType,
    /// Requests that may wait for a slot before `submit` answers Busy.
    pub queue_depth: usize,
    /// Sessions and loading.
    pub load: LoadOptions,
    /// Connections to workers.
    pub client: ClientOptions,
    /// How often a lost model is loaded again.
    pub retry_every: Duration,
    /// Whether a generation that fills its context drops old tokens and goes on.
    pub context_shift: Option<ContextShift>,
    /// Whether a request reuses the KV cells of an earlier one that shares the start of its
    /// prompt (`--no-prefix-cache` turns it off).
    pub prefix_cache: bool,
    /// Sequences beyond `parallel` that keep earlier requests' cells for the prefix cache,
    /// in the same paged KV pool (`--cached-prefixes`); `None`: [`DEFAULT_CACHED_PER_SLOT`]
    /// per sequence slot, or none where the prefix cache is off or the model's
    /// sliding-window layers keep a ring.
    pub cached_prefixes: Option<usize>,
    /// How long requests running on a model being replaced or unloaded may go on before
    /// they are ended with an error.
    pub retire_grace: Duration,
    /// Lanes of sequences that go through the workers on their own (`--pipeline-lanes`);
    /// `None`: one per worker, so each worker is busy with one lane while the others run.
    pub pipeline_lanes: Option<usize>,
    /// Fewest prompt tokens in one forward pass when a prompt is cut into chunks so that
    /// several workers overlap (`--prefill-chunk`).
    pub prefill_chunk: usize,
}

/// Cached-prefix sequences per sequence slot by default (see
/// [`CoordinatorConfig::cached_prefixes`]): each costs the workers a block table of 4 bytes
/// a block, no cells.
pub const DEFAULT_CACHED_PER_SLOT: usize = 3;

/// Fewest prompt tokens a chunk takes when a prompt is cut for several workers: a whole
/// micro-batch of the default `--ubatch`, so prompts are not cut unless asked. Chunks of 64
/// tokens over two H200s gave 0.39x of one GPU's pp512: a product over 64 rows runs at a
/// fraction of its speed over 512, more than the overlap wins back.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// The cached-prefix sequences `config` asks for (see
/// [`CoordinatorConfig::cached_prefixes`]); asking for some where they cannot be is an
/// error.
fn cached_sequences(
    config: &CoordinatorConfig,
    model: &ModelFile,
) -> Result<usize, CoordinatorError> {
    let ring = kv_ring(model.config(), config.ctx_per_seq, config.ubatch).is_some();
    cached_prefix_slots(
        config.cached_prefixes,
        config.prefix_cache,
        config.parallel,
        ring,
    )
    .map_err(CoordinatorError::Config)
}

/// The cached-prefix sequences of a server of `parallel` slots that asks for `requested`
/// (`None`: the default), with the prefix cache on or off, for a model whose
/// sliding-window layers keep a `ring` or not: what `serve` gives the workers, and what
/// `tether plan` counts.
pub fn cached_prefix_slots(
    requested: Option<usize>,
    prefix_cache: bool,
    parallel: usize,
    ring: bool,
) -> Result<usize, String> {
    match requested {
        None if prefix_cache && !ring => Ok(DEFAULT_CACHED_PER_SLOT * parallel),
        None | Some(0) => Ok(0),
        Some(n) if !prefix_cache => Err(format!(
            "{n} cached prefixes were asked for with the prefix cache off"
        )),
        Some(n) if ring => Err(format!(
            "{n} cached prefixes were asked for, but this model's sliding-window layers keep \
             a ring of cells per sequence outside the shared KV pool; ask for none"
        )),
        Some(n) => Ok(n),
    }
}

impl CoordinatorConfig {
    /// Defaults for `model` over `workers`: the model's training context (at most 4096),
    /// 4 sequences, micro-batches of 512, an f16 KV cache, a queue of 64, a retry every 3 s,
    /// a lane per worker and prompt chunks of at least [`DEFAULT_PREFILL_CHUNK`] tokens.
    pub fn new(model: &ModelFile, workers: Vec<String>) -> Self {
        let model_id = model
            .path()
            .file_stem()
            .map_or_else(|| "model".to_string(), |s| s.to_string_lossy().into_owned());
        Self {
            model_id,
            workers,
            worker_dns: None,
            split: None,
            ctx_per_seq: model.config().default_context(),
            parallel: 4,
            ubatch: 512,
            cache_k: GgmlType::F16,
            cache_v: GgmlType::F16,
            queue_depth: 64,
            load: LoadOptions::default(),
            client: ClientOptions::default(),
            retry_every: Duration::from_secs(3),
            context_shift: None,
            prefix_cache: true,
            cached_prefixes: None,
            retire_grace: Duration::from_secs(60),
            pipeline_lanes: None,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
        }
    }
}

/// Why the coordinator could not start serving.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    /// A setting is out of range.
    #[error("invalid coordinator setting: {0}")]
    Config(String),
    /// A worker could not be reached.
    #[error("{0}")]
    Connect(String),
    /// No plan fits the workers.
    #[error(transparent)]
    Placement(#[from] PlacementError),
    /// The two-phase load failed (nothing stays loaded).
    #[error(transparent)]
    Load(#[from] LoadError),
}

/// What connecting and loading need, kept by the scheduler for loading again (and copied
/// by the front for loading another model).
#[derive(Clone)]
pub(crate) struct Setup {
    /// The latest worker list; a load marks the list it used as seen.
    pub workers: watch::Receiver<Vec<String>>,
    pub split: Option<Vec<f64>>,
    pub shape: ServeShape,
    pub load: LoadOptions,
    pub client: ClientOptions,
    pub context_shift: Option<ContextShift>,
    pub prefix_cache: bool,
    /// Lanes; `None`: one per worker.
    pub lanes: Option<usize>,
    /// Fewest prompt tokens in a chunk cut for several workers.
    pub prefill_chunk: usize,
}

impl Setup {
    /// Connects to the workers, places the model and loads it. With `require_all`, every
    /// worker must answer; otherwise the ones that answer are used.
    pub async fn connect_and_load(
        &mut self,
        model: &Arc<ModelFile>,
        require_all: bool,
    ) -> Result<(LoadedModel, Plan), CoordinatorError> {
        let workers = self.workers.borrow_and_update().clone();
        if workers.is_empty() {
            return Err(CoordinatorError::Connect(
                "no worker to load on: the --worker-dns name has resolved to no address yet"
                    .to_string(),
            ));
        }
        let answers = join_all(
            workers
                .iter()
                .map(|addr| WorkerClient::connect(addr, &self.client)),
        )
        .await;
        let mut clients = Vec::new();
        let mut split = Vec::new();
        let mut failures = Vec::new();
        for (i, answer) in answers.into_iter().enumerate() {
            match answer {
                Ok(c) => {
                    clients.push(c);
                    if let Some(s) = &self.split {
                        split.push(s.get(i).copied().unwrap_or(0.0));
                    }
                }
                Err(e) => failures.push(e.to_string()),
            }
        }
        if clients.is_empty() || (require_all && !failures.is_empty()) {
            return Err(CoordinatorError::Connect(failures.join("; ")));
        }
        let capacity: Vec<WorkerCapacity> = clients
            .iter()
            .map(|c| WorkerCapacity {
                addr: c.addr().to_string(),
                free_bytes: c.info().free_bytes,
            })
            .collect();
        let split = self.split.as_ref().map(|_| split.as_slice());
        let plan = place(
            model.config(),
            model.gguf().tensors(),
            self.shape,
            &capacity,
            split,
        )?;
        let mut loaded = load_plan(model, &plan, &clients, &self.load).await?;
        crate::handoff_probe::probe(&mut loaded.stages).await;
        Ok((loaded, plan))
    }

    /// Resolves, with the new list, once the worker list differs from the one last loaded
    /// over; never when the list is fixed.
    pub async fn workers_changed(&mut self) -> Vec<String> {
        if self.workers.changed().await.is_err() {
            return std::future::pending().await;
        }
        self.workers.borrow().clone()
    }
}

/// The model requests are checked against and admitted for.
pub(crate) struct Served {
    pub info: ModelInfo,
    pub tokenizer: Arc<Tokenizer>,
    pub file: Arc<ModelFile>,
    /// Bumped by every load and unload through the admin API.
    pub epoch: u64,
    /// False after an unload, until a load.
    pub loaded: bool,
}

/// The generation engine over workers.
pub struct Coordinator {
    pub(crate) served: RwLock<Served>,
    context_shift: Option<ContextShift>,
    prefix_cache: bool,
    pub(crate) shared: Arc<Shared>,
    submit: mpsc::Sender<Admitted>,
    /// Model replacements for the scheduler.
    pub(crate) control: mpsc::Sender<Replace>,
    pub(crate) stop: CancellationToken,
    workers: watch::Receiver<Vec<String>>,
    /// How the workers are reached (token, TLS), for the admin view's own connections.
    client: ClientOptions,
    /// How to load another model (admin API).
    pub(crate) setup: Setup,
    /// Whether a load needs every worker (a fixed list) or takes those that answer.
    pub(crate) require_all: bool,
    /// Held while a model is loaded or unloaded through the admin API: one at a time.
    pub(crate) changing: tokio::sync::Mutex<()>,
    /// The change under way, for `/health`.
    pub(crate) change: Mutex<Option<ChangeState>>,
    /// The scheduler and, with `worker_dns`, the resolver.
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Coordinator {
    /// Connects to every worker, places and loads the model, and starts serving. Fails when
    /// any worker cannot be reached or refuses its part; nothing then stays loaded. With
    /// `worker_dns`, the workers that answer are used, and a failed load does not fail the
    /// start: the coordinator reports unavailable and loads again every `retry_every`.
    pub async fn start(
        model: Arc<ModelFile>,
        config: CoordinatorConfig,
    ) -> Result<Coordinator, CoordinatorError> {
        let bad = |why: &str| Err(CoordinatorError::Config(why.to_string()));
        if config.workers.is_empty() && config.worker_dns.is_none() {
            return bad("no workers given");
        }
        if config.parallel == 0 || config.ubatch == 0 || config.ctx_per_seq == 0 {
            return bad("--parallel, --ubatch and --ctx must all be at least 1");
        }
        if config.queue_depth == 0 {
            return bad("the queue depth must be at least 1");
        }
        if config.pipeline_lanes == Some(0) || config.prefill_chunk == 0 {
            return bad("--pipeline-lanes and --prefill-chunk must be at least 1");
        }
        if let Some(shift) = config.context_shift
            && shift.keep + 2 > config.ctx_per_seq
        {
            return Err(CoordinatorError::Config(format!(
                "--keep {} leaves nothing to drop in a context of {}; keep at most {}",
                shift.keep,
                config.ctx_per_seq,
                config.ctx_per_seq.saturating_sub(2)
            )));
        }
        let initial = match &config.worker_dns {
            Some(dns) => worker_list(&config.workers, &resolve(dns).await.unwrap_or_default()),
            None => config.workers.clone(),
        };
        let (workers_tx, workers) = watch::channel(initial);
        let stop = CancellationToken::new();
        let mut tasks = Vec::new();
        if let Some(dns) = config.worker_dns.clone() {
            let fixed = config.workers.clone();
            tasks.push(tokio::spawn(watch_dns(
                dns,
                fixed,
                workers_tx,
                stop.clone(),
            )));
        }
        Self::start_over(model, config, workers, stop, tasks).await
    }

    /// Loads over the worker list `workers` publishes and starts serving; the model is
    /// loaded again whenever that list changes. `tasks` (stopped by `stop`) are awaited on
    /// shutdown.
    pub(crate) async fn start_over(
        model: Arc<ModelFile>,
        config: CoordinatorConfig,
        workers: watch::Receiver<Vec<String>>,
        stop: CancellationToken,
        mut tasks: Vec<JoinHandle<()>>,
    ) -> Result<Coordinator, CoordinatorError> {
        let cached_seqs = cached_sequences(&config, &model)?;
        let mut setup = Setup {
            workers: workers.clone(),
            split: config.split.clone(),
            shape: ServeShape {
                ctx_per_seq: config.ctx_per_seq,
                n_seq: config.parallel,
                cached_seqs,
                ubatch: config.ubatch,
                cache_k: config.cache_k,
                cache_v: config.cache_v,
            },
            load: config.load.clone(),
            client: config.client.clone(),
            context_shift: config.context_shift,
            prefix_cache: config.prefix_cache,
            lanes: config.pipeline_lanes,
            prefill_chunk: config.prefill_chunk,
        };
        let first = match setup
            .connect_and_load(&model, config.worker_dns.is_none())
            .await
        {
            Ok((loaded, plan)) => {
                tracing::info!("model {} loaded:\n{plan}", config.model_id);
                Ok((loaded, plan))
            }
            Err(e) if config.worker_dns.is_some() => {
                tracing::warn!("loading over the resolved workers failed: {e}; retrying");
                Err(Loss::Load(e))
            }
            Err(e) => {
                stop.cancel();
                return Err(e);
            }
        };
        let (first, shared) = match first {
            Ok((loaded, plan)) => (Ok(loaded), Shared::new(Some(plan), Health::Ready)),
            Err(why) => {
                let health = Health::Unavailable(format!(
                    "{why}; retrying every {} s",
                    config.retry_every.as_secs_f64()
                ));
                (Err(why), Shared::new(None, health))
            }
        };
        let shared = Arc::new(shared);
        let (submit, requests) = mpsc::channel(config.queue_depth);
        let (control, replacements) = mpsc::channel(1);
        let front_setup = setup.clone();
        let scheduler = Scheduler::new(
            Arc::clone(&shared),
            Inbox {
                requests,
                control: replacements,
            },
            stop.clone(),
            Arc::clone(&model),
            setup,
            config.retry_every,
            config.retire_grace,
        );
        tasks.push(tokio::spawn(scheduler.run(first)));
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(Coordinator {
            served: RwLock::new(Served {
                info: ModelInfo {
                    id: config.model_id,
                    ctx_per_seq: config.ctx_per_seq,
                    n_embd: model.config().n_embd,
                    created,
                    chat_template: model.chat_template(),
                    pooling: model.pooling(),
                },
                tokenizer: model.tokenizer(),
                file: model,
                epoch: 0,
                loaded: true,
            }),
            context_shift: config.context_shift,
            prefix_cache: config.prefix_cache,
            shared,
            submit,
            control,
            stop,
            workers,
            client: config.client,
            setup: front_setup,
            require_all: config.worker_dns.is_none(),
            changing: tokio::sync::Mutex::new(()),
            change: Mutex::new(None),
            tasks: Mutex::new(tasks),
        })
    }

    /// The placement in force (`None` while no model is loaded).
    pub fn plan(&self) -> Option<Plan> {
        self.shared.plan()
    }

    /// The worker list in force now, in layer order (with `worker_dns`, as last resolved).
    pub fn workers(&self) -> Vec<String> {
        self.workers.borrow().clone()
    }

    /// Whether requests reuse the KV cells of earlier ones that share their prompt's start.
    pub fn prefix_cache(&self) -> bool {
        self.prefix_cache
    }

    /// How this coordinator connects to its workers (token and TLS).
    pub fn client_options(&self) -> &ClientOptions {
        &self.client
    }

    /// Stops serving: running requests end with Unavailable, every session is closed.
    pub async fn shutdown(&self) {
        self.stop.cancel();
        let tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|e| e.into_inner()));
        for task in tasks {
            let _ = task.await;
        }
    }

    pub(crate) fn served(&self) -> std::sync::RwLockReadGuard<'_, Served> {
        self.served.read().unwrap_or_else(|e| e.into_inner())
    }

    fn check(req: &GenRequest, served: &Served) -> Result<(), GenError> {
        let ctx = served.info.ctx_per_seq;
        let n_vocab = served.file.config().n_vocab;
        if req.prompt.is_empty() {
            return Err(GenError::InvalidRequest(
                "the prompt has no tokens; give at least one".into(),
            ));
        }
        if req.prompt.len() > ctx {
            return Err(GenError::InvalidRequest(format!(
                "the prompt has {} tokens but the context holds {ctx}; shorten it",
                req.prompt.len()
            )));
        }
        if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(GenError::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary of {n_vocab} tokens"
            )));
        }
        Ok(())
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        // The scheduler task sees the stop and closes every session.
        self.stop.cancel();
    }
}

impl Generation for Coordinator {
    fn model(&self) -> ModelInfo {
        self.served().info.clone()
    }

    fn tokenizer(&self) -> Arc<Tokenizer> {
        Arc::clone(&self.served().tokenizer)
    }

    fn model_epoch(&self) -> u64 {
        self.served().epoch
    }

    fn model_loaded(&self) -> bool {
        self.served().loaded
    }

    fn model_change(&self) -> Option<ModelChange> {
        self.change_progress()
    }

    fn health(&self) -> Health {
        self.shared.health()
    }

    fn stats(&self) -> EngineStats {
        EngineStats {
            queued: self.submit.max_capacity() - self.submit.capacity()
                + self.shared.held.load(Ordering::Relaxed),
            running: self.shared.running.load(Ordering::Relaxed),
            generated_tokens: self.shared.generated_tokens.load(Ordering::Relaxed),
            prompt_tokens: self.shared.prompt_tokens.load(Ordering::Relaxed),
            prefix_hit_tokens: self.shared.prefix_hit_tokens.load(Ordering::Relaxed),
            prefix_evictions: self.shared.prefix_evictions.load(Ordering::Relaxed),
            kv_blocks: self.shared.kv_blocks.load(Ordering::Relaxed),
            kv_blocks_free: self.shared.kv_blocks_free.load(Ordering::Relaxed),
        }
    }

    fn parallel(&self) -> usize {
        self.setup.shape.n_seq
    }

    fn submit(&self, req: GenRequest) -> Result<GenEvents, GenError> {
        let mut events = self.submit_choices(vec![req])?;
        events
            .pop()
            .ok_or_else(|| GenError::Internal("a request of one choice got no events".into()))
    }

    fn submit_choices(&self, reqs: Vec<GenRequest>) -> Result<Vec<GenEvents>, GenError> {
        if reqs.is_empty() || reqs.len() > self.setup.shape.n_seq {
            return Err(GenError::InvalidRequest(format!(
                "a request may have 1 to {} choices (--parallel); {} were asked",
                self.setup.shape.n_seq,
                reqs.len()
            )));
        }
        // Held while the request is queued, so it joins the queue tagged with the epoch of
        // the model it was checked against: a replacement bumps the epoch under the
        // write lock.
        let served = self.served();
        if let Health::Unavailable(why) = self.shared.health() {
            return Err(GenError::Unavailable(why));
        }
        let mut choices = Vec::with_capacity(reqs.len());
        let mut receivers = Vec::with_capacity(reqs.len());
        for req in reqs {
            if req.model_epoch.is_some_and(|e| e != served.epoch) {
                return Err(GenError::Unavailable(
                    "the model was replaced while the request was being prepared; send it again"
                        .into(),
                ));
            }
            Self::check(&req, &served)?;
            // Room for every event a request can produce, so the scheduler never waits on a
            // slow reader (tokio allocates channel blocks lazily).
            let most = match self.context_shift {
                Some(_) => req.max_tokens,
                None => req.max_tokens.min(served.info.ctx_per_seq),
            };
            // Tokens, the prompt's scores, the end.
            let (events, rx) = mpsc::channel(most + 3);
            choices.push(Choice { req, events });
            receivers.push(rx);
        }
        let epoch = served.epoch;
        match self.submit.try_send(Admitted { choices, epoch }) {
            Ok(()) => Ok(receivers),
            Err(mpsc::error::TrySendError::Full(_)) => Err(GenError::Busy(format!(
                "every sequence slot is taken and {} requests are queued; retry later",
                self.submit.max_capacity()
            ))),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(GenError::Unavailable(
                "the coordinator has shut down".into(),
            )),
        }
    }
}
