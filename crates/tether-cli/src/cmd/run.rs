//! `tether run`: generate text from a prompt through the coordinator engine, over embedded
//! workers in this process (real gRPC on loopback) or over remote `--worker`s.

use crate::cmd::cache_args::CacheArgs;
use crate::cmd::context_shift::ContextShiftArgs;
use crate::cmd::local::{DEMO_LABEL, DeviceArgs, context_size, open_while_starting};
use crate::cmd::path_on_workers::PathOnWorkersArgs;
use crate::cmd::worker_link::WorkerLinkArgs;
use crate::model_source::ModelArgs;
use crate::timings::{Timeline, process_start};
use anyhow::{Context, Result, bail};
use clap::Args;
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;
use tether_coordinator::api::{FinishReason, GenEvent, GenRequest, Generation};
use tether_coordinator::{Coordinator, CoordinatorConfig};
use tether_model::SamplingParams;

/// Arguments of `tether run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
    #[command(flatten)]
    pub shift: ContextShiftArgs,
    /// The prompt.
    #[arg(long, short = 'p', default_value = "Once upon a time")]
    pub prompt: String,
    /// Most tokens to generate.
    #[arg(long = "n-predict", short = 'n', default_value_t = 64)]
    pub n_predict: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Do not add the BOS token even when the model asks for it.
    #[arg(long)]
    pub no_bos: bool,
    /// Print the generated token ids on stderr after the text.
    #[arg(long)]
    pub print_ids: bool,
    /// Embedded workers to split the model over when no --worker is given.
    #[arg(long, default_value_t = 1)]
    pub local_workers: usize,
    /// A remote worker (host:port) to place layers on, in layer order; repeat for more.
    #[arg(long = "worker")]
    pub workers: Vec<String>,
    #[command(flatten)]
    pub worker_link: WorkerLinkArgs,
    #[command(flatten)]
    pub path_on_workers: PathOnWorkersArgs,
    /// Share of the model per worker, e.g. `3,1` (default: in proportion to free memory).
    #[arg(long, value_delimiter = ',')]
    pub split: Option<Vec<f64>>,
    /// Print where the time went, from process start to the first token and the end, as a
    /// table on stderr (the load split per worker included).
    #[arg(long)]
    pub timings: bool,
}

/// Sampling flags, named as llama.cpp names them.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Top-k (0 keeps all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Top-p (1.0 keeps all).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Min-p (0 keeps all).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Repetition penalty (1.0 is off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Tokens the penalties look back over.
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Subtracted from a recent token's logit per occurrence (0 is off; -2..=2).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Subtracted from every recent token's logit (0 is off; -2..=2).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Random seed.
    #[arg(long, short = 's', default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    /// The sampler parameters, after checking the ranges.
    pub fn params(&self) -> Result<SamplingParams> {
        if !self.temp.is_finite() || !(0.0..=1.0).contains(&self.top_p) {
            bail!("--temp must be finite and --top-p within 0..=1");
        }
        if !(0.0..=1.0).contains(&self.min_p)
            || self.repeat_penalty.is_nan()
            || self.repeat_penalty <= 0.0
        {
            bail!("--min-p must be within 0..=1 and --repeat-penalty above 0");
        }
        let openai = |x: f32| (-2.0..=2.0).contains(&x);
        if !openai(self.frequency_penalty) || !openai(self.presence_penalty) {
            bail!("--frequency-penalty and --presence-penalty must be within -2..=2");
        }
        Ok(SamplingParams {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            seed: self.seed,
            ..SamplingParams::default()
        })
    }
}

/// Streams the generated text to stdout; timings go to stderr.
pub fn run(args: RunArgs) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tether-run")
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(run_async(args))
}

async fn run_async(args: RunArgs) -> Result<()> {
    let params = args.sampling.params()?;
    // Checked here so that a wrong flag fails before any worker starts.
    let remote_client = match args.workers.is_empty() {
        true => Default::default(),
        false => args.worker_link.client_options()?,
    };
    let mut timeline = Timeline::new();
    let mut since = process_start();
    let resolved = args.model.resolve()?;
    if resolved.is_demo {
        eprintln!("{DEMO_LABEL}");
    }
    args.path_on_workers
        .check_remote(!args.workers.is_empty())?;
    let embedded = args.workers.is_empty().then_some((
        args.device.device.as_str(),
        args.local_workers,
        args.device.threads,
    ));
    let (model, started) = open_while_starting(&resolved.path, embedded).await?;
    let mut own_copy = args.path_on_workers.path();
    let local = match started {
        Some(started) => {
            own_copy = started.model_path;
            since = timeline.phase(
                "open the model, start embedded workers (device, kernels) at once",
                since,
            );
            Some(started.workers)
        }
        None => {
            since = timeline.phase("open the model (GGUF header, tokenizer)", since);
            None
        }
    };
    let ctx = context_size(&args.device, model.config(), 1)?;
    let (addrs, client) = match &local {
        Some(l) => (l.addrs(), args.worker_link.embedded_options(l)),
        None => (args.workers.clone(), remote_client),
    };
    let mut config = CoordinatorConfig {
        split: args.split.clone(),
        ctx_per_seq: ctx,
        parallel: 1,
        ubatch: args.device.ubatch,
        cache_k: args.cache.k(),
        cache_v: args.cache.v(),
        queue_depth: 1,
        client,
        context_shift: args.shift.policy(),
        ..CoordinatorConfig::new(&model, addrs)
    };
    let progress = Arc::new(tether_coordinator::LoadProgress::default());
    config.load.progress = Some(Arc::clone(&progress));
    config.load.model_path_on_workers = own_copy;
    config.load.data_links = !args.worker_link.grpc_forward;
    let bars = crate::load_bars::LoadBars::start(Arc::clone(&progress));
    let loading = Instant::now();
    let loaded = Coordinator::start(model, config).await;
    bars.finish().await;
    let coordinator = loaded?;
    if let Some(report) = progress.report() {
        timeline.load(&report, since, loading.elapsed());
    }
    since = Instant::now();
    if let Some(plan) = coordinator.plan().filter(|p| p.assignments.len() > 1) {
        eprint!("{plan}");
    }
    let load_s = since.duration_since(process_start()).as_secs_f64();
    let result = generate(&args, &coordinator, params, ctx, load_s, &mut timeline).await;
    let stopping = Instant::now();
    coordinator.shutdown().await;
    if let Some(local) = local {
        local.shutdown().await;
    }
    timeline.phase("shut down (close sessions, free memory)", stopping);
    if args.timings {
        timeline.print();
    }
    result
}

async fn generate(
    args: &RunArgs,
    coordinator: &Coordinator,
    params: SamplingParams,
    ctx: usize,
    load_s: f64,
    timeline: &mut Timeline,
) -> Result<()> {
    let tokenizing = Instant::now();
    let tokenizer = coordinator.tokenizer();
    let add_bos = !args.no_bos && tokenizer.add_bos_default();
    let prompt = tokenizer.encode(&args.prompt, add_bos, false);
    if prompt.is_empty() {
        bail!("the prompt has no tokens; give a non-empty --prompt");
    }
    if prompt.len() >= ctx {
        bail!(
            "the prompt has {} tokens, the context {ctx}: raise --ctx",
            prompt.len()
        );
    }
    let gen_start = timeline.phase(
        format!("tokenize the prompt ({} tokens)", prompt.len()),
        tokenizing,
    );
    let mut out = std::io::stdout().lock();
    out.write_all(args.prompt.as_bytes())?;
    out.flush()?;
    let mut events = coordinator.submit(GenRequest {
        sampling: params,
        ..GenRequest::greedy(&prompt, args.n_predict)
    })?;
    let mut first_token: Option<f64> = None;
    let mut tokens = Vec::new();
    let finish = loop {
        match events.recv().await {
            Some(Ok(GenEvent::Token(tok))) => {
                if first_token.is_none() {
                    timeline.phase(
                        "prompt to first token (first kernel launches, graph capture)",
                        gen_start,
                    );
                    let at = process_start().elapsed();
                    timeline.part(0, "= process start to first token", at);
                }
                first_token.get_or_insert_with(|| gen_start.elapsed().as_secs_f64());
                tokens.push(tok);
                // An error writing (a closed pipe) drops `events`, which cancels the request.
                out.write_all(&tokenizer.token_to_piece(tok))?;
                out.flush()?;
            }
            Some(Ok(GenEvent::Done { finish, .. })) => break finish,
            Some(Ok(GenEvent::Scored(_) | GenEvent::Prompt(_) | GenEvent::Embedding(_))) => {
                bail!("the engine sent log-probabilities that were not asked for")
            }
            Some(Err(e)) => bail!("generation failed: {e}"),
            None => bail!("the engine stopped without finishing the request"),
        }
    };
    writeln!(out)?;
    timeline.phase(
        format!("prompt and {} generated tokens", tokens.len()),
        gen_start,
    );
    let total = gen_start.elapsed().as_secs_f64();
    let prefill = first_token.unwrap_or(total);
    let decode_n = tokens.len().saturating_sub(1);
    let why = match finish {
        FinishReason::Stop => "end of generation",
        FinishReason::Length if tokens.len() >= args.n_predict => "n-predict reached",
        FinishReason::Length => "context full",
    };
    eprintln!(
        "load {load_s:.2} s | prompt {} tokens in {:.3} s ({:.1} t/s) | generated {} tokens, {:.1} t/s | {why}",
        prompt.len(),
        prefill,
        prompt.len() as f64 / prefill.max(1e-9),
        tokens.len(),
        decode_n as f64 / (total - prefill).max(1e-9),
    );
    if args.print_ids {
        let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
        eprintln!("ids: {}", ids.join(" "));
    }
    Ok(())
}
