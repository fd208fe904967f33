//! A domain-level client of a worker, for the coordinator, `tether attach` and `tetherctl`:
//! sessions, prepare/commit, forward, KV operations, admin, health and the data link. No
//! tonic or prost type appears in its public API.

mod admin;
mod diagnose;
mod health;
mod lease_thread;
mod link;
mod load;
mod session;

pub use admin::AdminClient;
pub use health::{Health, check_health};
pub use link::{DataLink, LinkTarget, SentForward};
pub use load::{DEFAULT_CHUNK_BYTES, LoadRequest, Prepared, TensorSource};
pub use session::{AttachOptions, Session};
pub use tether_protocol::error_chain;

use diagnose::Link;
use std::fmt;
use std::time::Duration;
use tether_proto::PROTOCOL_VERSION;
use tether_proto::v1 as pb;
use tether_protocol::tls::ClientTls;
use tether_protocol::{BearerToken, SessionId, WorkerError};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

/// What kind of failure a worker reported, after gRPC's status codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// NOT_FOUND: unknown session or transaction.
    NotFound,
    /// INVALID_ARGUMENT / OUT_OF_RANGE: a malformed request.
    InvalidArgument,
    /// FAILED_PRECONDITION: not allowed in the current state (or version mismatch).
    FailedPrecondition,
    /// FAILED_PRECONDITION marked `tether-refused: local-file`: the worker would not read
    /// the model from its own copy (no `--model-dir`, outside it, missing, or a different
    /// file) and staged nothing; streaming the bytes instead can still work.
    LocalFileRefused,
    /// RESOURCE_EXHAUSTED: not enough memory, or a message over the size limit.
    ResourceExhausted,
    /// UNAVAILABLE, CANCELLED, DEADLINE_EXCEEDED: the worker cannot be reached or is leaving.
    Unavailable,
    /// UNAUTHENTICATED: the worker or admin token is missing or wrong.
    Unauthenticated,
    /// ABORTED: the transaction was aborted.
    Aborted,
    /// Anything else.
    Internal,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A failed client call: what was being done, on which worker, and what it said.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No connection could be made.
    #[error("cannot connect to worker {addr}: {detail}")]
    Connect {
        /// The worker's address.
        addr: String,
        /// The transport's message.
        detail: String,
    },
    /// The worker answered with an error.
    #[error("{op} on worker {addr} failed ({kind}): {message}")]
    Rpc {
        /// The call.
        op: &'static str,
        /// The worker's address.
        addr: String,
        /// The kind of failure.
        kind: ErrorKind,
        /// The worker's message.
        message: String,
    },
    /// A reply (or a request, checked before sending) that the protocol's own types
    /// refuse; the refusal is kept as the source, and its kind is the call's.
    #[error("{op} on worker {addr}: {source}")]
    Domain {
        /// The call.
        op: &'static str,
        /// The worker's address.
        addr: String,
        /// What the protocol's types said.
        #[source]
        source: WorkerError,
    },
    /// The worker broke the protocol or the request was refused before sending.
    #[error("{op} on worker {addr}: {detail}")]
    Protocol {
        /// The call.
        op: &'static str,
        /// The worker's address.
        addr: String,
        /// What was wrong.
        detail: String,
    },
}

impl ClientError {
    /// The kind of failure, for callers that react to it.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Connect { .. } => ErrorKind::Unavailable,
            Self::Rpc { kind, .. } => *kind,
            Self::Domain { source, .. } => domain_kind(source),
            Self::Protocol { .. } => ErrorKind::InvalidArgument,
        }
    }

    pub(crate) fn rpc(op: &'static str, addr: &str, s: &tonic::Status) -> Self {
        Self::Rpc {
            op,
            addr: addr.to_string(),
            kind: status_kind(s),
            message: s.message().to_string(),
        }
    }

    pub(crate) fn protocol(op: &'static str, addr: &str, detail: impl Into<String>) -> Self {
        Self::Protocol {
            op,
            addr: addr.to_string(),
            detail: detail.into(),
        }
    }

    pub(crate) fn domain(op: &'static str, addr: &str, e: WorkerError) -> Self {
        Self::Domain {
            op,
            addr: addr.to_string(),
            source: e,
        }
    }
}

/// The kind of a refusal by the protocol's types: what the worker's gRPC status for the
/// same error would say.
fn domain_kind(e: &WorkerError) -> ErrorKind {
    status_kind(&tether_protocol::grpc::to_status(e.clone()))
}

/// The kind of failure a worker's gRPC status says.
fn status_kind(s: &tonic::Status) -> ErrorKind {
    use tonic::Code;
    match s.code() {
        Code::NotFound => ErrorKind::NotFound,
        Code::InvalidArgument | Code::OutOfRange => ErrorKind::InvalidArgument,
        Code::FailedPrecondition if refused_local_file(s) => ErrorKind::LocalFileRefused,
        Code::FailedPrecondition => ErrorKind::FailedPrecondition,
        Code::ResourceExhausted => ErrorKind::ResourceExhausted,
        Code::Unavailable | Code::Cancelled | Code::DeadlineExceeded => ErrorKind::Unavailable,
        Code::Unauthenticated | Code::PermissionDenied => ErrorKind::Unauthenticated,
        Code::Aborted => ErrorKind::Aborted,
        _ => ErrorKind::Internal,
    }
}

/// Whether `s` carries the worker's mark of a refused local read.
fn refused_local_file(s: &tonic::Status) -> bool {
    use tether_protocol::grpc::{REFUSED_KEY, REFUSED_LOCAL_FILE};
    s.metadata()
        .get(REFUSED_KEY)
        .is_some_and(|v| v.as_bytes() == REFUSED_LOCAL_FILE.as_bytes())
}

/// Connection settings.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// How long connecting may take.
    pub connect_timeout: Duration,
    /// HTTP/2 ping interval, so a dead worker is noticed even when idle.
    pub keepalive_interval: Duration,
    /// How long a ping may go unanswered.
    pub keepalive_timeout: Duration,
    /// Largest message sent or received.
    pub max_message_bytes: usize,
    /// Sent as `authorization: Bearer TOKEN` on every data-plane call (the worker's
    /// `--token`); `None` for open workers.
    pub token: Option<BearerToken>,
    /// Speak TLS (`https://`) and check the worker's certificate, presenting a client
    /// certificate when one is set; `None` speaks plaintext.
    pub tls: Option<ClientTls>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            keepalive_interval: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(5),
            max_message_bytes: tether_protocol::DEFAULT_MAX_MESSAGE_BYTES,
            token: None,
            tls: None,
        }
    }
}

impl ClientOptions {
    /// Plaintext settings carrying `token`: what reaches workers started beside the
    /// client with a generated secret (embedded workers on loopback).
    pub fn with_token(token: BearerToken) -> Self {
        Self {
            token: Some(token),
            ..Self::default()
        }
    }
}

/// What a worker said in Hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerInfo {
    /// Its build.
    pub worker_version: String,
    /// Its device.
    pub device: String,
    /// Bytes a session may still reserve.
    pub free_bytes: u64,
    /// Largest message it accepts.
    pub max_message_bytes: u64,
    /// Its data-link port on the same host; 0 when it serves none.
    pub data_port: u16,
    /// Its process id (0 when it did not say).
    pub pid: u32,
}

/// The URI of `addr` ("host:port", or with a scheme that must agree with the TLS setting).
pub(crate) fn endpoint_uri(addr: &str, tls: bool) -> Result<String, String> {
    match (addr.split_once("://"), tls) {
        (None, false) => Ok(format!("http://{addr}")),
        (None, true) => Ok(format!("https://{addr}")),
        (Some(("http", _)), false) | (Some(("https", _)), true) => Ok(addr.to_string()),
        (Some(("http", _)), true) => Err(format!(
            "{addr} asks for plaintext but TLS is set: give host:port or https://host:port"
        )),
        (Some(("https", _)), false) => Err(format!(
            "{addr} asks for TLS but no CA is given to check the worker: pass --worker-tls-ca"
        )),
        (Some((scheme, _)), _) => Err(format!(
            "unknown scheme {scheme}:// in {addr}: give host:port"
        )),
    }
}

pub(crate) async fn connect_channel(
    addr: &str,
    options: &ClientOptions,
) -> Result<Channel, ClientError> {
    let connect_err = |detail: String| ClientError::Connect {
        addr: addr.to_string(),
        detail,
    };
    let link = Link::of(options);
    let uri = endpoint_uri(addr, options.tls.is_some()).map_err(connect_err)?;
    let mut endpoint = Endpoint::from_shared(uri).map_err(|e| connect_err(e.to_string()))?;
    if let Some(tls) = &options.tls {
        endpoint = endpoint
            .tls_config(tls.tonic_config())
            .map_err(|e| connect_err(format!("TLS settings refused: {}", error_chain(&e))))?;
    }
    endpoint
        .connect_timeout(options.connect_timeout)
        .http2_keep_alive_interval(options.keepalive_interval)
        .keep_alive_timeout(options.keepalive_timeout)
        .keep_alive_while_idle(true)
        .tcp_nodelay(true)
        .connect()
        .await
        .map_err(|e| connect_err(link.explain(&error_chain(&e))))
}

/// Puts the token, when there is one, on every outgoing call.
#[derive(Clone)]
pub(crate) struct SendToken(Option<BearerToken>);

impl Interceptor for SendToken {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(token) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", token.header_value());
        }
        Ok(request)
    }
}

/// The generated client over a channel that carries the token.
pub(crate) type WorkerRpc = pb::worker_client::WorkerClient<InterceptedService<Channel, SendToken>>;

/// Opens a connection to `addr` with `options`' token and message limits.
pub(crate) async fn connect_rpc(
    addr: &str,
    options: &ClientOptions,
) -> Result<WorkerRpc, ClientError> {
    let channel = connect_channel(addr, options).await?;
    Ok(
        pb::worker_client::WorkerClient::with_interceptor(
            channel,
            SendToken(options.token.clone()),
        )
        .max_decoding_message_size(options.max_message_bytes)
        .max_encoding_message_size(options.max_message_bytes),
    )
}

/// A connection to one worker's session and serving API.
#[derive(Clone)]
pub struct WorkerClient {
    pub(crate) addr: String,
    pub(crate) rpc: WorkerRpc,
    info: WorkerInfo,
    /// What it connected with, for the session connections opened on the lease thread.
    options: ClientOptions,
    /// Largest message this client may send: its own limit or the worker's, the smaller.
    max_send_bytes: usize,
}

impl WorkerClient {
    /// Connects to `addr` ("host:port") and checks that the worker speaks this protocol.
    pub async fn connect(addr: &str, options: &ClientOptions) -> Result<Self, ClientError> {
        let mut rpc = connect_rpc(addr, options).await?;
        let hello = rpc
            .hello(pb::HelloRequest {
                protocol_version: PROTOCOL_VERSION,
                client_version: format!("tether {}", env!("CARGO_PKG_VERSION")),
            })
            .await
            .map_err(|s| Link::of(options).call_failed("hello", addr, &s))?
            .into_inner();
        tether_protocol::grpc::check_version(hello.protocol_version)
            .map_err(|e| ClientError::domain("hello", addr, e))?;
        let info = WorkerInfo {
            worker_version: hello.worker_version,
            device: hello.device,
            free_bytes: hello.free_bytes,
            max_message_bytes: hello.max_message_bytes,
            data_port: u16::try_from(hello.data_port).unwrap_or(0),
            pid: hello.worker_pid,
        };
        let worker_limit = usize::try_from(info.max_message_bytes).unwrap_or(usize::MAX);
        Ok(Self {
            max_send_bytes: options.max_message_bytes.min(worker_limit),
            addr: addr.to_string(),
            rpc,
            info,
            options: options.clone(),
        })
    }

    /// Opens a data link to `session` (see [`tether_protocol::link`]); `None` when the worker serves
    /// none, or when this client speaks TLS, which a link would bypass.
    pub async fn open_data_link(
        &self,
        session: SessionId,
    ) -> Result<Option<DataLink>, ClientError> {
        if self.options.tls.is_some() || self.info.data_port == 0 {
            return Ok(None);
        }
        let host = data_host(&self.addr);
        let at = tokio::net::lookup_host((host, self.info.data_port))
            .await
            .map_err(|e| ClientError::Connect {
                addr: self.addr.clone(),
                detail: format!("resolving {host} for its data link: {e}"),
            })?
            .next()
            .ok_or_else(|| ClientError::Connect {
                addr: self.addr.clone(),
                detail: format!("{host} resolves to no address"),
            })?;
        let to = LinkTarget {
            worker: self.addr.clone(),
            at,
            pid: self.info.pid,
            max_frame_bytes: usize::try_from(self.info.max_message_bytes).unwrap_or(usize::MAX),
            connect_timeout: self.options.connect_timeout,
        };
        let token = self.options.token.clone();
        tokio::task::spawn_blocking(move || DataLink::open(&to, session, token.as_ref()))
            .await
            .map_err(|e| ClientError::protocol("data link", &self.addr, e.to_string()))?
            .map(Some)
    }

    /// The worker's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// What the worker said when connecting.
    pub fn info(&self) -> &WorkerInfo {
        &self.info
    }
}

/// The host part of a worker address ("host:port", "[v6]:port", with or without a scheme).
fn data_host(addr: &str) -> &str {
    let bare = addr.split_once("://").map_or(addr, |(_, rest)| rest);
    let bare = bare.split('/').next().unwrap_or(bare);
    let host = bare.rsplit_once(':').map_or(bare, |(host, _)| host);
    host.trim_start_matches('[').trim_end_matches(']')
}

#[cfg(test)]
mod tests {
    use super::{ClientError, ErrorKind, WorkerError, data_host, endpoint_uri};
    use std::error::Error;

    #[test]
    fn a_domain_refusal_keeps_its_error_and_the_kind_its_status_would_have() {
        let e = ClientError::domain("forward", "w:1", WorkerError::NotFound("session 7".into()));
        assert_eq!(e.kind(), ErrorKind::NotFound);
        assert_eq!(e.to_string(), "forward on worker w:1: session 7");
        let source = e.source().and_then(|s| s.downcast_ref::<WorkerError>());
        assert_eq!(source, Some(&WorkerError::NotFound("session 7".into())));
        let local = ClientError::domain("prepare", "w:1", WorkerError::LocalFile("no".into()));
        assert_eq!(local.kind(), ErrorKind::LocalFileRefused);
        let bad = ClientError::domain("hello", "w:1", WorkerError::InvalidArgument("x".into()));
        assert_eq!(bad.kind(), ErrorKind::InvalidArgument);
    }

    #[test]
    fn the_data_link_host_is_the_grpc_host() {
        assert_eq!(data_host("10.0.0.2:50061"), "10.0.0.2");
        assert_eq!(data_host("http://gpu-3.lan:50061"), "gpu-3.lan");
        assert_eq!(data_host("[::1]:50061"), "::1");
        assert_eq!(data_host("http://[fe80::2]:7/"), "fe80::2");
    }

    #[test]
    fn the_scheme_follows_the_tls_setting() {
        assert_eq!(
            endpoint_uri("10.0.0.2:50061", false).as_deref(),
            Ok("http://10.0.0.2:50061")
        );
        assert_eq!(
            endpoint_uri("[::1]:50061", true).as_deref(),
            Ok("https://[::1]:50061")
        );
        assert_eq!(
            endpoint_uri("https://w:1", true).as_deref(),
            Ok("https://w:1")
        );
        let plain = endpoint_uri("http://w:1", true).expect_err("plaintext URI with TLS set");
        assert!(plain.contains("https://"), "{plain}");
        let tls = endpoint_uri("https://w:1", false).expect_err("TLS URI without a CA");
        assert!(tls.contains("--worker-tls-ca"), "{tls}");
        assert!(endpoint_uri("grpc://w:1", false).is_err());
    }
}
