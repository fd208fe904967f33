//! `tether serve`: the OpenAI-compatible HTTP API over the coordinator, with the model's
//! layers on remote `--worker`s or on embedded workers in this process.

use crate::cmd::cache_args::CacheArgs;
use crate::cmd::conn_args::ConnArgs;
use crate::cmd::context_shift::ContextShiftArgs;
use crate::cmd::local::{DEMO_LABEL, open_while_starting};
use crate::cmd::path_on_workers::PathOnWorkersArgs;
use crate::cmd::tls_args::ServeTlsArgs;
use crate::cmd::worker_link::WorkerLinkArgs;
use crate::ctl::units::parse_duration;
use crate::model_source::ModelArgs;
use crate::signals::first_signal;
use crate::timings::{Timeline, process_start};
use anyhow::{Context, Result, bail};
use clap::Args;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tether_coordinator::http::admin::admin_router;
use tether_coordinator::http::loading::ServingGate;
use tether_coordinator::http::template::TemplateBudget;
use tether_coordinator::http::{HttpOptions, default_max_heavy_requests, router, serve, serve_tls};
use tether_coordinator::load::LoadOptions;
use tether_coordinator::{Coordinator, CoordinatorConfig, WorkerDns};
use tether_protocol::Lease;
use tether_worker::embedded::LocalWorkers;

/// Arguments of `tether serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// A worker (host:port) to place layers on, in layer order; repeat for more. Without
    /// any (and no --worker-dns), embedded workers run in this process.
    #[arg(long = "worker")]
    pub workers: Vec<String>,
    /// A DNS name (host:port), e.g. a Kubernetes headless Service, whose addresses are
    /// workers (after any --worker, sorted). It is resolved again every --dns-refresh; when
    /// its addresses change the model is unloaded and loaded again over them.
    #[arg(long, value_name = "HOST:PORT")]
    pub worker_dns: Option<String>,
    /// How often --worker-dns is resolved again.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub dns_refresh: Duration,
    /// Embedded workers to split the model over when no --worker or --worker-dns is given.
    #[arg(long, default_value_t = 1)]
    pub local_workers: usize,
    /// Device of the embedded workers: `auto` (one worker per CUDA GPU when the machine has
    /// any, else the cpu), `cpu`, `cuda` (every GPU) or `cuda:N`.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Compute threads of the embedded workers, in all (default: one per core).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// HTTP address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Sequences generated at once (each has its own KV cells).
    #[arg(long, default_value_t = 4)]
    pub parallel: usize,
    /// KV cells per sequence (default: the model's training context, at most 4096).
    #[arg(long, short = 'c')]
    pub ctx: Option<usize>,
    /// Most tokens in one forward pass (prompt micro-batch).
    #[arg(long, short = 'u', default_value_t = 512)]
    pub ubatch: usize,
    /// Lanes of sequences that go through the workers on their own, so that while one
    /// lane's step runs on one worker another's runs on the next (default: one per worker).
    #[arg(long)]
    pub pipeline_lanes: Option<usize>,
    /// Fewest prompt tokens in one forward pass when a prompt is cut into chunks so that
    /// several workers overlap.
    #[arg(long, default_value_t = tether_coordinator::engine::DEFAULT_PREFILL_CHUNK)]
    pub prefill_chunk: usize,
    /// Share of the model per worker, e.g. `3,1` (default: in proportion to free memory).
    #[arg(long, value_delimiter = ',')]
    pub split: Option<Vec<f64>>,
    /// Requests that may wait for a free sequence before new ones get HTTP 429.
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// Require `Authorization: Bearer KEY` on /v1/* requests.
    #[arg(long, env = "TETHER_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Admin token the workers require (their --admin-token), for /v1/admin/*; default:
    /// --worker-token.
    #[arg(long, env = "TETHER_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    #[command(flatten)]
    pub worker_link: WorkerLinkArgs,
    /// The model's id in the API (default: the file name without `.gguf`).
    #[arg(long)]
    pub model_id: Option<String>,
    /// How long one request may take before it fails with 504.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    pub request_timeout: Duration,
    /// Largest `max_tokens` a request may ask for.
    #[arg(long, default_value_t = 4096)]
    pub max_tokens_limit: usize,
    /// Most prompt tokens a request may send (default: the context); longer prompts get
    /// HTTP 400 `context_length_exceeded`.
    #[arg(long)]
    pub max_prompt_tokens: Option<usize>,
    /// Template instructions one rendering of the chat template may execute; a template
    /// that needs more (a runaway loop) fails its request with HTTP 500.
    #[arg(long, default_value_t = TemplateBudget::default().fuel)]
    pub template_fuel: u64,
    /// Largest prompt the chat template may render, in bytes; more fails the request.
    #[arg(long, default_value_t = TemplateBudget::default().max_output_bytes)]
    pub template_max_output: usize,
    /// Requests prepared at once off the async runtime when their preparation is heavy (a
    /// body of 16 KiB or more, or a chat template to render), each on a thread 10 nice
    /// steps below the server's so that heartbeats and /health stay prompt; more get HTTP
    /// 429 at once.
    #[arg(long, default_value_t = default_max_heavy_requests())]
    pub max_heavy_requests: usize,
    /// How `/v1/embeddings` pools a prompt's hidden states: mean, cls or last. Default:
    /// the model file's pooling type, else the last token's.
    #[arg(long, value_name = "POOLING")]
    pub pooling: Option<tether_coordinator::api::Pooling>,
    /// Lease of the worker sessions: a worker frees a session that has not heard a
    /// heartbeat for this long (heartbeats go every third of it).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub lease_ttl: Duration,
    /// After SIGTERM/SIGINT, how long running requests may go on before they are cut and
    /// every worker session is closed.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
    /// Prefill every prompt whole: do not reuse the KV cells of an earlier request that
    /// shares the start of the prompt (prefix caching is on by default).
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// Sequences beyond --parallel that keep earlier requests' prompts (and replies) for
    /// the prefix cache, in the same paged KV pool: a conversation's cells stay until the
    /// pool needs its blocks, least recently used first [default: 3 x --parallel; none
    /// with --no-prefix-cache or on models whose sliding-window layers keep a ring]
    #[arg(long, value_name = "N")]
    pub cached_prefixes: Option<usize>,
    #[command(flatten)]
    pub conn: ConnArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
    #[command(flatten)]
    pub shift: ContextShiftArgs,
    /// HTTPS for the API (--tls-cert/--tls-key; with --tls-ca, clients must present a
    /// certificate of that CA).
    #[command(flatten)]
    pub tls: ServeTlsArgs,
    #[command(flatten)]
    pub path_on_workers: PathOnWorkersArgs,
    /// Print where the time went from process start until the model served, as a table on
    /// stderr (the load split per worker included).
    #[arg(long)]
    pub timings: bool,
    /// Test hook: sleep this long between Prepare and Commit of the model load.
    #[arg(long, hide = true, value_parser = parse_duration)]
    pub debug_pause_before_commit: Option<Duration>,
}

/// Serves until SIGTERM/SIGINT, then closes every worker session and exits 0.
pub fn run(args: ServeArgs) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tether-serve")
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(serve_model(args))
}

async fn serve_model(args: ServeArgs) -> Result<()> {
    if args.parallel == 0 || args.ubatch == 0 {
        bail!("--parallel and --ubatch must be at least 1");
    }
    // A heartbeat must fit in a lease; below 3 ms the interval would round to zero.
    if args.lease_ttl < Duration::from_millis(3) {
        bail!(
            "--lease-ttl {:?} is too short: give at least 3ms (e.g. 1s)",
            args.lease_ttl
        );
    }
    if let Some(name) = &args.worker_dns {
        let port = name.rsplit_once(':').map(|(_, p)| p.parse::<u16>());
        if !matches!(port, Some(Ok(_))) {
            bail!("--worker-dns {name:?} needs a port: give HOST:PORT, e.g. tether-workers:50061");
        }
    }
    if args.dns_refresh.is_zero() {
        bail!("--dns-refresh must be more than 0 (e.g. 10s)");
    }
    // Checked before the model loads, so a wrong file fails in a second, not after a load.
    let https = match args.tls.server_tls()? {
        Some(tls) => Some(
            tls.rustls_config()
                .context("the HTTPS settings (--tls-cert/--tls-key/--tls-ca)")?,
        ),
        None => None,
    };
    let embedded = args.workers.is_empty() && args.worker_dns.is_none();
    // Checked here so that a wrong flag fails before any worker starts.
    let remote_client = match embedded {
        true => Default::default(),
        false => args.worker_link.client_options()?,
    };
    args.path_on_workers.check_remote(!embedded)?;
    // Bound before anything loads: a busy port fails in a moment, not after a load, and
    // /health answers "loading" with the progress meanwhile.
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    let scheme = if https.is_some() { "https" } else { "http" };
    println!(
        "tether serve bound {scheme}://{addr}; loading the model (GET /health answers 503 until it serves)"
    );
    let progress = Arc::new(tether_coordinator::LoadProgress::default());
    let gate = ServingGate::new(Arc::clone(&progress));
    let (signalled_tx, mut signalled) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        first_signal().await;
        let _ = signalled_tx.send(());
    };
    let limits = args.conn.limits();
    let mut server = match https {
        Some(config) => tokio::spawn(serve_tls(listener, config, gate.router(), limits, shutdown)),
        None => tokio::spawn(serve(listener, gate.router(), limits, shutdown)),
    };
    let mut timeline = Timeline::new();
    let loaded = tokio::select! {
        loaded = load(&args, embedded, remote_client, Arc::clone(&progress), &mut timeline) => loaded,
        _ = &mut signalled => {
            tracing::info!("signal received while loading: the load is cancelled");
            return finish_server(server.await);
        }
        done = &mut server => {
            // The listener failed before the model loaded.
            return finish_server(done);
        }
    };
    let (coordinator, local) = match loaded {
        Ok(loaded) => loaded,
        Err(e) => {
            server.abort();
            return Err(e);
        }
    };
    let mut opts = HttpOptions {
        api_key: args.api_key.clone(),
        request_timeout: args.request_timeout,
        max_tokens_limit: args.max_tokens_limit,
        max_prompt_tokens: args.max_prompt_tokens,
        model_id: args.model_id.clone(),
        template_budget: TemplateBudget {
            fuel: args.template_fuel,
            max_output_bytes: args.template_max_output,
            ..TemplateBudget::default()
        },
        max_heavy_requests: args.max_heavy_requests,
        pooling: args.pooling,
        ..HttpOptions::default()
    };
    args.conn.apply(&mut opts);
    let app = router(coordinator.clone(), opts).merge(admin_router(
        coordinator.clone(),
        args.api_key.clone(),
        // A worker without --admin-token takes its --token on admin calls; embedded
        // workers take the secret they were started with on both.
        match &local {
            Some(l) => Some(l.token().expose().to_string()),
            None => args
                .admin_token
                .clone()
                .filter(|t| !t.is_empty())
                .or_else(|| args.worker_link.worker_token.clone()),
        },
    ));
    gate.open(app);
    if args.timings {
        timeline.part(0, "= process start to serving", process_start().elapsed());
        timeline.print();
    }
    // Scripts and tests read this line to learn that the model serves, and the port.
    println!("tether serve listening on {scheme}://{addr}");
    let served = tokio::select! {
        done = &mut server => done,
        _ = signalled => match tokio::time::timeout(args.shutdown_grace, &mut server).await {
            Ok(done) => done,
            Err(_) => {
                tracing::warn!(
                    grace = ?args.shutdown_grace,
                    "requests still running after the shutdown grace: cutting them"
                );
                // Ends every running request (their streams close), so the server finishes.
                coordinator.shutdown().await;
                server.await
            }
        },
    };
    let served = served.context("the HTTP server task failed")?;
    coordinator.shutdown().await;
    if let Some(local) = local {
        local.shutdown().await;
    }
    served.context("serving HTTP")?;
    tracing::info!("coordinator stopped; every worker session is closed");
    Ok(())
}

/// The outcome of the HTTP server task when it ended before the model served.
fn finish_server(
    done: std::result::Result<std::io::Result<()>, tokio::task::JoinError>,
) -> Result<()> {
    done.context("the HTTP server task failed")?
        .context("serving HTTP")
}

/// Opens the model, starts the embedded workers when there are no remote ones, and loads
/// the model over the workers, reporting the bytes to `progress`.
async fn load(
    args: &ServeArgs,
    embedded: bool,
    remote_client: tether_client::ClientOptions,
    progress: Arc<tether_coordinator::LoadProgress>,
    timeline: &mut Timeline,
) -> Result<(Arc<Coordinator>, Option<LocalWorkers>)> {
    let since = Instant::now();
    let resolved = args.model.resolve()?;
    if resolved.is_demo {
        eprintln!("{DEMO_LABEL}");
    }
    let started = embedded.then_some((args.device.as_str(), args.local_workers, args.threads));
    let (model, started) = open_while_starting(&resolved.path, started).await?;
    let mut own_copy = args.path_on_workers.path();
    let local = match started {
        Some(started) => {
            own_copy = started.model_path;
            timeline.phase(
                "open the model, start embedded workers (device, kernels) at once",
                since,
            );
            Some(started.workers)
        }
        None => {
            timeline.phase("open the model (GGUF header, tokenizer)", since);
            None
        }
    };
    let (addrs, client) = match &local {
        Some(l) => (l.addrs(), args.worker_link.embedded_options(l)),
        None => (args.workers.clone(), remote_client),
    };
    let defaults = CoordinatorConfig::new(&model, addrs.clone());
    let mut config = CoordinatorConfig {
        cache_k: args.cache.k(),
        cache_v: args.cache.v(),
        split: args.split.clone(),
        ctx_per_seq: args.ctx.unwrap_or(defaults.ctx_per_seq),
        parallel: args.parallel,
        ubatch: args.ubatch,
        queue_depth: args.queue,
        pipeline_lanes: args.pipeline_lanes,
        prefill_chunk: args.prefill_chunk,
        context_shift: args.shift.policy(),
        prefix_cache: !args.no_prefix_cache,
        cached_prefixes: args.cached_prefixes,
        model_id: args.model_id.clone().unwrap_or(defaults.model_id.clone()),
        load: LoadOptions {
            lease: Lease {
                heartbeat_interval: args.lease_ttl / 3,
                ttl: args.lease_ttl,
            },
            pause_before_commit: args.debug_pause_before_commit,
            model_path_on_workers: own_copy,
            data_links: !args.worker_link.grpc_forward,
            ..defaults.load.clone()
        },
        client,
        worker_dns: args.worker_dns.clone().map(|name| WorkerDns {
            name,
            refresh: args.dns_refresh,
        }),
        ..defaults
    };
    // The engine logs the placement it loaded.
    config.load.progress = Some(Arc::clone(&progress));
    let bars = crate::load_bars::LoadBars::start(Arc::clone(&progress));
    let loaded = Coordinator::start(model, config).await;
    bars.finish().await;
    if let Some(report) = progress.report() {
        timeline.load(&report, since, since.elapsed());
    }
    match loaded {
        Ok(coordinator) => Ok((Arc::new(coordinator), local)),
        Err(e) => {
            if let Some(local) = local {
                local.shutdown().await;
            }
            Err(e.into())
        }
    }
}
