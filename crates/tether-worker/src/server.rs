//! Running a worker: the gRPC server (worker, admin and grpc.health.v1 services) with
//! keepalive, message limits and token guards, the reaper, and the shutdown sequence (stop accepting,
//! end every session with reason `shutdown`, let in-flight work finish within the grace
//! period).

use crate::grpc::{AdminAuth, AdminService, HealthService, WorkerAuth, WorkerService};
use crate::handshake::ConnectionLimits;
use crate::link::{DataOptions, DataPlane};
use crate::reaper::run_reaper;
use crate::registry::SessionRegistry;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tether_proto::v1::admin_server::AdminServer;
use tether_proto::v1::worker_server::WorkerServer;
use tether_protocol::BearerToken;
use tether_protocol::tls::ServerTls;
use tokio::net::TcpListener;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;

pub use tether_protocol::DEFAULT_MAX_MESSAGE_BYTES;

/// How a worker serves.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Largest gRPC message accepted or sent.
    pub max_message_bytes: usize,
    /// HTTP/2 ping interval, so a dead peer whose TCP never closes is found.
    pub keepalive_interval: Duration,
    /// How long a ping may go unanswered before the connection is dropped.
    pub keepalive_timeout: Duration,
    /// How often the reaper looks for expired leases and undecided transactions.
    pub reap_period: Duration,
    /// How long shutdown waits for in-flight work.
    pub shutdown_grace: Duration,
    /// Token guarding the admin service; `None` (or empty) leaves it to `token`.
    pub admin_token: Option<String>,
    /// Token every data-plane call (Hello, Attach, Prepare, Commit, Forward, ...) must carry;
    /// also guards the admin service when `admin_token` is unset. `None` leaves both open.
    pub token: Option<BearerToken>,
    /// Serve TLS only (and with a client CA, only to clients whose certificate it signed);
    /// `None` serves plaintext.
    pub tls: Option<ServerTls>,
    /// Serve data links (forward passes over a framed socket) beside gRPC; never with TLS,
    /// whose encryption they would bypass.
    pub data_links: bool,
    /// Their port on the gRPC listener's address; 0 picks a free one.
    pub data_port: u16,
    /// How long a link spins for its next request; `None`: 10 ms on a GPU, 0 on the cpu
    /// device, whose compute needs every core.
    pub data_spin: Option<Duration>,
    /// How long a new data-link connection has to send its whole hello.
    pub data_hello_within: Duration,
    /// Most data-link connections waiting for their hello at once; a new one beyond it
    /// closes the one that has waited longest.
    pub data_max_unauthenticated: usize,
    /// How long a new gRPC connection has to send the first bytes of its handshake.
    pub handshake_timeout: Duration,
    /// Most gRPC connections open at once; a new one beyond it is closed at once.
    pub max_connections: usize,
}

/// How long a new gRPC connection has to begin its handshake, by default.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most gRPC connections open at once, by default.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            keepalive_interval: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(5),
            reap_period: Duration::from_millis(100),
            shutdown_grace: Duration::from_secs(10),
            admin_token: None,
            token: None,
            tls: None,
            data_links: true,
            data_port: 0,
            data_spin: None,
            data_hello_within: crate::link::DEFAULT_HELLO_WITHIN,
            data_max_unauthenticated: crate::link::DEFAULT_MAX_UNAUTHENTICATED,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// Why serving stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The transport failed.
    #[error("the gRPC server failed: {0}")]
    Transport(String),
    /// An option cannot be used.
    #[error("invalid worker option: {0}")]
    Config(String),
}

/// What shutdown did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Sessions ended with reason `shutdown`.
    pub sessions_ended: usize,
    /// In-flight work finished within the grace period.
    pub finished_in_grace: bool,
}

/// Starts the data links when `options` ask for them.
fn start_data_plane(
    listener: &TcpListener,
    registry: &Arc<SessionRegistry>,
    options: &ServerOptions,
) -> Result<Option<DataPlane>, ServeError> {
    if !options.data_links || options.tls.is_some() {
        return Ok(None);
    }
    let ip = listener
        .local_addr()
        .map_err(|e| ServeError::Transport(format!("the listener has no address: {e}")))?
        .ip();
    let spin = options
        .data_spin
        .unwrap_or(if registry.holds_host_memory() {
            Duration::ZERO
        } else {
            Duration::from_millis(10)
        });
    let data = DataPlane::start(
        ip,
        options.data_port,
        Arc::clone(registry),
        DataOptions {
            token: options.token.clone(),
            max_frame_bytes: options.max_message_bytes,
            spin,
            hello_within: options.data_hello_within,
            max_unauthenticated: options.data_max_unauthenticated,
        },
    )
    .map_err(|e| {
        ServeError::Config(format!(
            "cannot listen for data links on {ip}:{}: {e}",
            options.data_port
        ))
    })?;
    tracing::info!(
        port = data.port(),
        spin_us = spin.as_micros() as u64,
        "data links listening"
    );
    Ok(Some(data))
}

/// Serves `registry` on `listener` until `shutdown` resolves, then shuts down in order.
pub async fn serve(
    listener: TcpListener,
    registry: Arc<SessionRegistry>,
    options: ServerOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<ShutdownReport, ServeError> {
    let admin_token = BearerToken::parse(options.admin_token.as_deref())
        .map_err(|e| ServeError::Config(format!("--admin-token: {e}")))?
        .or_else(|| options.token.clone());
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = &options.tls {
        // Applies to the accepted sockets below too: each is handshaken before HTTP/2.
        builder = builder.tls_config(tls.tonic_config()).map_err(|e| {
            ServeError::Config(format!("TLS: {}", tether_protocol::error_chain(&e)))
        })?;
    }
    let stop = CancellationToken::new();
    let reaper = tokio::spawn(run_reaper(
        Arc::clone(&registry),
        options.reap_period,
        stop.clone(),
    ));

    let limit = options.max_message_bytes;
    let data = start_data_plane(&listener, &registry, &options)?;
    let data_port = data.as_ref().map_or(0, DataPlane::port);
    let worker = InterceptedService::new(
        WorkerServer::new(
            WorkerService::new(Arc::clone(&registry), limit).with_data_port(data_port),
        )
        .max_decoding_message_size(limit)
        .max_encoding_message_size(limit),
        WorkerAuth::new(options.token.clone()),
    );
    let admin = AdminServer::with_interceptor(
        AdminService::new(Arc::clone(&registry)),
        AdminAuth::new(admin_token),
    );
    let limits = ConnectionLimits::new(options.max_connections, options.handshake_timeout);
    let health = tonic_health::pb::health_server::HealthServer::new(HealthService::new(
        Arc::clone(&registry),
        stop.clone(),
    ));
    let server = builder
        .http2_keepalive_interval(Some(options.keepalive_interval))
        .http2_keepalive_timeout(Some(options.keepalive_timeout))
        .tcp_keepalive(Some(options.keepalive_interval))
        .tcp_nodelay(true)
        .add_service(worker)
        .add_service(admin)
        .add_service(health)
        .serve_with_incoming_shutdown(
            // The builder's tcp_nodelay only reaches sockets it accepts itself; without it
            // here, Nagle's algorithm holds each small forward reply for a delayed ACK
            // (~40 ms a decode step).
            // Each connection also takes a slot and gets its handshake deadline here.
            TcpListenerStream::new(listener).filter_map(move |conn| match conn {
                Ok(stream) => {
                    let _ = stream.set_nodelay(true);
                    limits.admit(stream).map(Ok)
                }
                Err(e) => Some(Err(e)),
            }),
            stop.clone().cancelled_owned(),
        );
    let mut server = tokio::spawn(server);

    tokio::select! {
        () = shutdown => {}
        result = &mut server => {
            stop.cancel();
            registry.shutdown();
            let _ = reaper.await;
            return match result {
                Ok(Ok(())) => Ok(ShutdownReport { sessions_ended: 0, finished_in_grace: true }),
                Ok(Err(e)) => Err(ServeError::Transport(e.to_string())),
                Err(e) => Err(ServeError::Transport(format!("server task failed: {e}"))),
            };
        }
    }

    tracing::info!(
        grace_ms = options.shutdown_grace.as_millis() as u64,
        "shutting down: no new sessions; ending every session"
    );
    drop(data);
    let sessions_ended = registry.shutdown();
    stop.cancel();
    let _ = reaper.await;
    let tracker = registry.tracker().clone();
    tracker.close();
    let drained = tokio::time::timeout(options.shutdown_grace, async {
        let _ = server.await;
        tracker.wait().await;
    })
    .await;
    let finished_in_grace = drained.is_ok();
    if finished_in_grace {
        tracing::info!(sessions_ended, "shutdown complete: every session freed");
    } else {
        tracing::warn!(
            sessions_ended,
            "shutdown grace expired; cancelling in-flight work"
        );
    }
    Ok(ShutdownReport {
        sessions_ended,
        finished_in_grace,
    })
}
