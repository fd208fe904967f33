//! `tether worker`: serve one device's memory to coordinators, session by session.

use crate::cmd::tls_args::ServeTlsArgs;
use crate::ctl::units::{parse_bytes, parse_duration};
use crate::device::single_gpu;
use crate::signals::first_signal;
use anyhow::Context;
use clap::Args;
use std::sync::Arc;
use std::time::Duration;
use tether_compute::{Backend, CpuBackend, CudaBackend, CudaTuning};
use tether_worker::metrics_http::serve_metrics;
use tether_worker::model_stage::ModelStageFactory;
use tether_worker::registry::{RegistryConfig, SessionRegistry};
use tether_worker::server::{DEFAULT_MAX_MESSAGE_BYTES, ServerOptions, serve};
use tether_worker::stage::StageFactory;
use tether_worker::{BearerToken, ModelDirs};

/// Memory left to the device's other users when `--max-memory` is not given: 10% of the
/// device, at most 1 GiB.
const RESERVE_MAX: u64 = 1 << 30;

/// Arguments of `tether worker`.
#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// Address to listen on (port 0 picks a free port; the address is printed).
    #[arg(long, default_value = "127.0.0.1:50061")]
    pub listen: String,
    /// Device to serve: `cpu`, or `cuda:N` (GPU N through the cuda backend).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Compute threads for the cpu device (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Most bytes all sessions may hold (e.g. 8G); default: the device's free memory minus
    /// a reserve.
    #[arg(long, value_parser = parse_bytes)]
    pub max_memory: Option<u64>,
    /// How long shutdown waits for in-flight work after ending every session.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
    /// How long a prepared load waits for Commit or Abort before the worker aborts it.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub prepare_timeout: Duration,
    /// HTTP/2 keepalive ping interval.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub keepalive: Duration,
    /// Largest gRPC message accepted.
    #[arg(long, default_value_t = DEFAULT_MAX_MESSAGE_BYTES as u64, value_parser = parse_bytes)]
    pub max_message_bytes: u64,
    /// Shortest lease TTL granted to a client.
    #[arg(long, default_value = "100ms", value_parser = parse_duration)]
    pub min_ttl: Duration,
    /// How often expired leases and undecided transactions are looked for.
    #[arg(long, default_value = "100ms", value_parser = parse_duration)]
    pub reap_period: Duration,
    /// Most live sessions in all; more are refused with RESOURCE_EXHAUSTED (default: only
    /// memory limits them).
    #[arg(long)]
    pub max_sessions: Option<usize>,
    /// Most live sessions of one client name (coordinators name themselves in Hello).
    #[arg(long)]
    pub max_sessions_per_client: Option<usize>,
    /// Most bytes one session may hold (e.g. 4G); a Prepare asking for more is refused with
    /// RESOURCE_EXHAUSTED before anything is allocated (default: only --max-memory).
    #[arg(long, value_parser = parse_bytes)]
    pub max_session_memory: Option<u64>,
    /// Log a warning when memory no session accounts for (`unaccounted_bytes` in
    /// `tetherctl status`) stays above this for --leak-window (0 turns it off).
    #[arg(long, default_value = "256M", value_parser = parse_bytes)]
    pub leak_warn: u64,
    /// How long unaccounted memory must stay above --leak-warn before the warning.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub leak_window: Duration,
    /// Serve Prometheus metrics at http://ADDR/metrics (off unless given; port 0 picks a
    /// free port, and the address is printed).
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<String>,
    /// Require this token on admin calls (tetherctl). Without it, admin calls require
    /// --token when that is set.
    #[arg(long, env = "TETHER_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Require `authorization: Bearer TOKEN` on every session call (Hello, Attach, Prepare,
    /// Commit, Forward, ...): coordinators pass it with --worker-token. Also guards admin
    /// calls when --admin-token is not given. Health checks stay open. Sent in clear
    /// unless the worker serves TLS (--tls-cert).
    #[arg(long, env = "TETHER_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// A directory whose model files this worker may read itself when a coordinator runs
    /// with --model-path-on-workers (repeatable). Nothing outside these trees is read:
    /// symlinks and `..` are resolved first. Without it, every load streams its tensors.
    #[arg(long = "model-dir", value_name = "DIR")]
    pub model_dirs: Vec<std::path::PathBuf>,
    /// Port of the data links on the --listen address (0 picks a free one; coordinators
    /// learn it in Hello): forward passes over a framed socket per session, with fewer
    /// thread hand-offs than gRPC. Never served with TLS, which they would bypass.
    #[arg(long, default_value_t = 0)]
    pub data_port: u16,
    /// Serve no data links: every forward pass goes over gRPC.
    #[arg(long)]
    pub no_data_links: bool,
    /// How long a data link's thread spins for its next request before it sleeps
    /// (default: 10ms on a GPU, 0 on the cpu device, whose compute needs every core).
    #[arg(long, value_parser = parse_duration)]
    pub data_spin: Option<Duration>,
    /// How long a new data-link connection has to send its whole hello before it is closed.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub data_hello_timeout: Duration,
    /// Most data-link connections waiting for their hello at once; a new one beyond it
    /// closes the one that has waited longest.
    #[arg(long, default_value_t = tether_worker::link::DEFAULT_MAX_UNAUTHENTICATED)]
    pub data_max_unauthenticated: usize,
    /// How long a new gRPC connection has to begin its handshake before it is closed.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub handshake_timeout: Duration,
    /// Most gRPC connections open at once; a new one beyond it is closed at once.
    #[arg(long, default_value_t = tether_worker::server::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    #[command(flatten)]
    pub tls: ServeTlsArgs,
}

/// Runs a worker until SIGTERM/SIGINT; a second signal exits at once.
pub fn run(args: WorkerArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tether-worker")
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(serve_device(args))
}

async fn serve_device(args: WorkerArgs) -> anyhow::Result<()> {
    // A worker serves one device: `auto` and `cuda` take the first GPU.
    match single_gpu(&args.device)? {
        None => {
            let backend = CpuBackend::new(args.threads).context("starting the cpu backend")?;
            tracing::info!(isa = %backend.isa(), threads = backend.threads(), "cpu kernels");
            serve_on(args, Arc::new(backend)).await
        }
        Some(n) => {
            let backend = CudaBackend::with_tuning(n, &CudaTuning::from_env())
                .with_context(|| format!("starting the cuda backend on GPU {n}"))?;
            serve_on(args, Arc::new(backend)).await
        }
    }
}

async fn serve_on<B: Backend>(args: WorkerArgs, backend: Arc<B>) -> anyhow::Result<()> {
    let factory: Arc<dyn StageFactory> = Arc::new(ModelStageFactory::new(backend));
    let max_memory = match args.max_memory {
        Some(bytes) => bytes,
        None => {
            let (total, free) = factory.memory_info().context("reading device memory")?;
            free.saturating_sub((total / 10).min(RESERVE_MAX))
        }
    };
    let config = RegistryConfig {
        decision_timeout: args.prepare_timeout,
        min_ttl: args.min_ttl,
        max_sessions: args.max_sessions,
        max_sessions_per_client: args.max_sessions_per_client,
        max_session_bytes: args.max_session_memory,
        model_dirs: ModelDirs::new(&args.model_dirs).map_err(anyhow::Error::msg)?,
        ..RegistryConfig::default()
    };
    let token = BearerToken::parse(args.token.as_deref()).context("--token")?;
    let tls = args.tls.server_tls()?;
    let registry = Arc::new(SessionRegistry::new(
        Arc::clone(&factory),
        max_memory,
        config,
    ));
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    let options = ServerOptions {
        max_message_bytes: usize::try_from(args.max_message_bytes).unwrap_or(usize::MAX),
        keepalive_interval: args.keepalive,
        keepalive_timeout: args.keepalive.min(Duration::from_secs(20)),
        reap_period: args.reap_period,
        shutdown_grace: args.shutdown_grace,
        admin_token: args.admin_token.clone(),
        token: token.clone(),
        tls: tls.clone(),
        data_links: !args.no_data_links,
        data_port: args.data_port,
        data_spin: args.data_spin,
        data_hello_within: args.data_hello_timeout,
        data_max_unauthenticated: args.data_max_unauthenticated,
        handshake_timeout: args.handshake_timeout,
        max_connections: args.max_connections,
    };
    let (metrics_stop, metrics_stopped) = tokio::sync::oneshot::channel::<()>();
    let metrics = match &args.metrics_listen {
        Some(listen) => {
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("binding the metrics address {listen}"))?;
            let metrics_addr = listener
                .local_addr()
                .context("reading the bound metrics address")?;
            // Printed before the listening line, which scripts wait for.
            println!("tether worker metrics on http://{metrics_addr}/metrics");
            Some(tokio::spawn(serve_metrics(
                listener,
                Arc::clone(&registry),
                async {
                    // Resolves on the send below, or when the sender is dropped.
                    let _ = metrics_stopped.await;
                },
            )))
        }
        None => None,
    };
    let leak_watch = (args.leak_warn > 0).then(|| {
        tokio::spawn(tether_worker::leak_watch::watch(
            Arc::clone(&registry),
            args.leak_warn,
            args.leak_window,
        ))
    });
    let mutual_tls = tls
        .as_ref()
        .is_some_and(|t| t.requires_client_certificate());
    if token.is_none() && !mutual_tls && !addr.ip().is_loopback() {
        tracing::warn!(
            %addr,
            "no --token and no --tls-ca: anyone who can reach this address can open sessions on this device"
        );
    }
    if token.is_some() && tls.is_none() && !addr.ip().is_loopback() {
        tracing::warn!(
            %addr,
            "--token without --tls-cert: the token crosses the network in clear"
        );
    }
    let transport = match &tls {
        None => "plaintext",
        Some(t) if t.requires_client_certificate() => "mutual TLS",
        Some(_) => "TLS",
    };
    tracing::info!(%addr, device = %factory.device_name(), max_memory, transport, "worker listening");
    let model_dirs = &registry.config().model_dirs;
    if !model_dirs.is_empty() {
        let dirs: Vec<String> = model_dirs.dirs().map(|d| d.display().to_string()).collect();
        tracing::info!(
            "coordinators may ask this worker to read model files under {}",
            dirs.join(", ")
        );
    }
    // Scripts and tests read this line to learn the port.
    println!(
        "tether worker listening on {addr} (device {}, max memory {max_memory} bytes, {transport})",
        factory.device_name()
    );
    let served = serve(listener, registry, options, first_signal()).await;
    if let Some(task) = leak_watch {
        task.abort();
    }
    let _ = metrics_stop.send(());
    if let Some(task) = metrics {
        let _ = task.await;
    }
    let report = served?;
    tracing::info!(
        sessions_ended = report.sessions_ended,
        in_grace = report.finished_in_grace,
        "worker stopped"
    );
    Ok(())
}
