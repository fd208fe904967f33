//! What `run`, `eval` and `bench` share: the device, the model file, the context size and
//! a loaded single-process generator (`eval` and `bench`; `run` goes through the
//! coordinator).

use crate::cmd::cache_args::CacheArgs;
use crate::device::{gpus_named, single_gpu};
use crate::model_source::{ModelArgs, ResolvedModel};
use anyhow::{Context, Result, bail};
use clap::Args;
use std::path::Path;
use std::sync::Arc;
use tether_compute::{Backend, CpuBackend, CudaBackend, CudaTuning};
use tether_coordinator::ModelFile;
use tether_gguf::GgufFile;
use tether_model::{Generator, ModelConfig, Stage, StageSpec, load_stage_from_file};
use tether_worker::ModelDirs;
use tether_worker::embedded::{LocalOptions, LocalWorkers};

/// Where and how a model runs in this process.
#[derive(Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Device to run on: `auto` (GPU 0, or every GPU for embedded workers, when the
    /// machine has a CUDA GPU; else the cpu), `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Compute threads for the cpu device (default: one per core).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Context size in tokens (default: the model's training context, at most 4096).
    #[arg(long, short = 'c')]
    pub ctx: Option<usize>,
    /// Tokens per forward micro-batch during prompt processing.
    #[arg(long, short = 'u', default_value_t = 512)]
    pub ubatch: usize,
}

/// A model file opened and loaded on a device.
pub struct Loaded<B: Backend> {
    pub model: ResolvedModel,
    pub file: GgufFile,
    pub generator: Generator<B>,
    pub ctx: usize,
}

/// The backend `--device` names, started.
pub enum AnyBackend {
    Cpu(Arc<CpuBackend>),
    Cuda(Arc<CudaBackend>),
}

/// Starts the backend `--device` names.
pub fn open_backend(dev: &DeviceArgs) -> Result<AnyBackend> {
    Ok(match single_gpu(&dev.device)? {
        None => AnyBackend::Cpu(Arc::new(
            CpuBackend::new(dev.threads).context("starting the cpu backend")?,
        )),
        Some(n) => AnyBackend::Cuda(Arc::new(
            CudaBackend::with_tuning(n, &CudaTuning::from_env())
                .with_context(|| format!("starting the cuda backend on GPU {n}"))?,
        )),
    })
}

/// Opens the model and loads every layer of it into one stage on `backend`, with the KV
/// cache types of `cache`.
pub fn load<B: Backend>(
    backend: Arc<B>,
    model: &ModelArgs,
    dev: &DeviceArgs,
    cache: CacheArgs,
    min_ctx: usize,
) -> Result<Loaded<B>> {
    let (model, file, stage, ctx) = load_stage(backend, model, dev, cache, min_ctx, 1)?;
    let generator =
        Generator::new(stage).with_context(|| format!("loading {}", model.path.display()))?;
    Ok(Loaded {
        model,
        file,
        generator,
        ctx,
    })
}

/// Opens the model and loads every layer, the embedding and the head into one stage with
/// `n_seq` sequences of cells; returns it with the context size per sequence.
pub fn load_stage<B: Backend>(
    backend: Arc<B>,
    model: &ModelArgs,
    dev: &DeviceArgs,
    cache: CacheArgs,
    min_ctx: usize,
    n_seq: usize,
) -> Result<(ResolvedModel, GgufFile, Stage<B>, usize)> {
    let model = model.resolve()?;
    let file =
        GgufFile::open(&model.path).with_context(|| format!("reading {}", model.path.display()))?;
    let cfg = tether_model::ModelConfig::from_gguf(&file)
        .with_context(|| format!("reading the hyper-parameters of {}", model.path.display()))?;
    let ctx = context_size(dev, &cfg, min_ctx)?;
    let spec = StageSpec::whole_model(cfg.n_layer, ctx, n_seq, dev.ubatch, cache.k(), cache.v());
    let stage = load_stage_from_file(backend, &file, spec)
        .with_context(|| format!("loading {}", model.path.display()))?;
    Ok((model, file, stage, ctx))
}

/// The context size a command uses: `--ctx`, else the model's training context capped at
/// 4096 and raised to `min_ctx`; also checks `--ubatch`.
pub fn context_size(dev: &DeviceArgs, cfg: &ModelConfig, min_ctx: usize) -> Result<usize> {
    let ctx = dev
        .ctx
        .unwrap_or_else(|| cfg.default_context().max(min_ctx));
    if ctx < min_ctx {
        bail!("--ctx {ctx} is smaller than the {min_ctx} tokens this command needs");
    }
    if dev.ubatch == 0 {
        bail!("--ubatch must be at least 1");
    }
    Ok(ctx)
}

/// Embedded workers started for one model file, and that file's path as they read it.
pub struct StartedLocal {
    /// The workers.
    pub workers: LocalWorkers,
    /// The model's path for the load's `model_path_on_workers`: the workers read their
    /// tensors from their own map of it instead of receiving them over loopback gRPC.
    /// `None` when its directory could not be allowed (the bytes are then streamed).
    pub model_path: Option<String>,
}

/// Opens the model file while the embedded workers start (when `embedded` gives their
/// device, count and threads): a GPU's context and kernels take longer than the header and
/// tokenizer, and neither needs the other. A model that does not open is the error shown
/// first.
pub async fn open_while_starting(
    path: &Path,
    embedded: Option<(&str, usize, Option<usize>)>,
) -> Result<(Arc<ModelFile>, Option<StartedLocal>)> {
    let owned = path.to_path_buf();
    let open = tokio::task::spawn_blocking(move || ModelFile::open(&owned));
    let started = match embedded {
        Some((device, count, threads)) => {
            Some(start_local_workers(device, count, threads, path).await)
        }
        None => None,
    };
    let model = open.await.context("opening the model file")??;
    Ok((model, started.transpose()?))
}

/// Starts the embedded workers of `run` and `serve`: one per GPU `device` names (`auto`:
/// every GPU the machine has), else `count` cpu workers sharing `threads`. They may read
/// `model` themselves (its directory is their model directory).
pub async fn start_local_workers(
    device: &str,
    count: usize,
    threads: Option<usize>,
    model: &Path,
) -> Result<StartedLocal> {
    let gpus = gpus_named(device)?;
    if count == 0 {
        bail!("--local-workers must be at least 1");
    }
    // One worker per GPU unless more were asked for.
    let n = count.max(gpus.len());
    let readable = model.canonicalize().ok().and_then(|file| {
        let dir = file.parent()?.to_path_buf();
        let dirs = ModelDirs::new(&[dir]).ok()?;
        Some((file.to_str()?.to_string(), dirs))
    });
    if readable.is_none() {
        tracing::warn!(model = %model.display(), "the embedded workers cannot read the model themselves; its tensors are streamed to them");
    }
    let (model_path, model_dirs) = readable.unzip();
    let options = LocalOptions {
        threads,
        max_memory: None,
        gpus,
        cuda: CudaTuning::from_env(),
        model_dirs: model_dirs.unwrap_or_default(),
    };
    Ok(StartedLocal {
        workers: LocalWorkers::start(n, &options).await?,
        model_path,
    })
}

/// The line every command prints before using the synthetic demo model.
pub const DEMO_LABEL: &str = "DEMO MODEL: synthetic random weights (give --model FILE.gguf or --hf OWNER/REPO/FILE.gguf for a real one); its text is gibberish by design";
