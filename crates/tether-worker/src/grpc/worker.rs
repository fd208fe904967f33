//! The `tether.v1.Worker` service: converts each request to domain types, calls the
//! registry, converts back.

use super::attach::{EVENT_QUEUE, pump_session};
use crate::load::PrepareBegin;
use crate::registry::SessionRegistry;
use crate::staging::TensorDigest;
use std::sync::Arc;
use std::time::Duration;
use tether_proto::PROTOCOL_VERSION;
use tether_proto::v1 as pb;
use tether_protocol::Lease;
use tether_protocol::Outcome;
use tether_protocol::WorkerError;
use tether_protocol::forward::grpc::{output_to_proto, request_from_proto};
use tether_protocol::grpc::{
    check_version, identity_from_proto, spec_from_proto, timings_to_proto, to_status,
};
use tether_protocol::{SessionId, TxnId};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// How long a new Attach stream may take to send its Open message.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a Prepare stream may take to send its Begin.
const BEGIN_TIMEOUT: Duration = Duration::from_secs(10);

/// The worker service over a registry.
pub struct WorkerService {
    registry: Arc<SessionRegistry>,
    max_message_bytes: usize,
    data_port: u16,
}

impl WorkerService {
    /// A service answering from `registry`, advertising `max_message_bytes` in Hello.
    pub fn new(registry: Arc<SessionRegistry>, max_message_bytes: usize) -> Self {
        Self {
            registry,
            max_message_bytes,
            data_port: 0,
        }
    }

    /// Advertises a data-link port in Hello (0: none).
    pub fn with_data_port(mut self, port: u16) -> Self {
        self.data_port = port;
        self
    }
}

fn invalid(e: WorkerError) -> Status {
    to_status(e)
}

fn decision_reply(outcome: Outcome) -> pb::DecisionReply {
    let state = match outcome {
        Outcome::Committed => pb::TxnState::Committed,
        Outcome::Aborted(_) => pb::TxnState::Aborted,
    };
    pb::DecisionReply {
        state: state as i32,
    }
}

fn decision_ids(d: &pb::Decision) -> Result<(SessionId, TxnId), Status> {
    Ok((
        SessionId::parse(&d.session_id).map_err(invalid)?,
        TxnId::parse(&d.txn_id).map_err(invalid)?,
    ))
}

#[tonic::async_trait]
impl pb::worker_server::Worker for WorkerService {
    async fn hello(
        &self,
        request: Request<pb::HelloRequest>,
    ) -> Result<Response<pb::HelloReply>, Status> {
        let req = request.into_inner();
        check_version(req.protocol_version).map_err(to_status)?;
        Ok(Response::new(pb::HelloReply {
            protocol_version: PROTOCOL_VERSION,
            worker_version: self.registry.config().worker_version.clone(),
            device: self.registry.device_name(),
            free_bytes: self.registry.available_bytes(),
            max_message_bytes: self.max_message_bytes as u64,
            data_port: u32::from(self.data_port),
            worker_pid: std::process::id(),
        }))
    }

    type AttachStream = ReceiverStream<Result<pb::AttachEvent, Status>>;

    async fn attach(
        &self,
        request: Request<Streaming<pb::AttachRequest>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let mut inbound = request.into_inner();
        let first = tokio::time::timeout(OPEN_TIMEOUT, inbound.message())
            .await
            .map_err(|_| Status::deadline_exceeded("attach: no Open message within 10 s"))??;
        let Some(pb::AttachRequest {
            kind: Some(pb::attach_request::Kind::Open(open)),
        }) = first
        else {
            return Err(Status::invalid_argument(
                "attach: the first message must be Open",
            ));
        };
        check_version(open.protocol_version).map_err(to_status)?;
        let asked = Lease {
            heartbeat_interval: Duration::from_millis(open.heartbeat_interval_ms.into()),
            ttl: Duration::from_millis(open.ttl_ms.into()),
        };
        let ticket = self
            .registry
            .open(&open.client_name, asked)
            .map_err(to_status)?;
        let (tx, rx) = mpsc::channel(EVENT_QUEUE);
        let opened = pb::attach_event::Kind::Opened(pb::Opened {
            session_id: ticket.id.to_string(),
            heartbeat_interval_ms: ticket.lease.heartbeat_interval.as_millis() as u32,
            ttl_ms: ticket.lease.ttl.as_millis() as u32,
            protocol_version: PROTOCOL_VERSION,
        });
        // The queue is empty, so this cannot fail for lack of room.
        let _ = tx.try_send(Ok(pb::AttachEvent { kind: Some(opened) }));
        let registry = Arc::clone(&self.registry);
        self.registry
            .tracker()
            .spawn(pump_session(registry, ticket, inbound, tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn prepare(
        &self,
        request: Request<Streaming<pb::PrepareRequest>>,
    ) -> Result<Response<pb::PrepareReply>, Status> {
        let mut inbound = request.into_inner();
        // A stream that never sends Begin must not hold a connection's stream for ever.
        let first = tokio::time::timeout(BEGIN_TIMEOUT, inbound.message())
            .await
            .map_err(|_| {
                Status::deadline_exceeded(format!(
                    "prepare: no Begin message within {BEGIN_TIMEOUT:?}; the stream is closed"
                ))
            })??;
        let Some(pb::PrepareRequest {
            kind: Some(pb::prepare_request::Kind::Begin(begin)),
        }) = first
        else {
            return Err(Status::invalid_argument(
                "prepare: the first message must be Begin",
            ));
        };
        let begin = PrepareBegin {
            session: SessionId::parse(&begin.session_id).map_err(invalid)?,
            txn: TxnId::parse(&begin.txn_id).map_err(invalid)?,
            spec: spec_from_proto(begin.stage).map_err(invalid)?,
            tensors: begin
                .tensors
                .into_iter()
                .map(|t| TensorDigest {
                    name: t.name,
                    bytes: t.bytes,
                    crc32: t.crc32,
                })
                .collect(),
            decision_timeout: (begin.decision_timeout_ms > 0)
                .then(|| Duration::from_millis(begin.decision_timeout_ms.into())),
            gguf_header: begin.gguf_header,
            gguf_file_bytes: begin.gguf_file_bytes,
            local_path: (!begin.local_path.is_empty()).then_some(begin.local_path),
            same_file: begin.same_file.map(identity_from_proto),
        };
        let (session, txn) = (begin.session, begin.txn);
        let mut upload = self
            .registry
            .begin_prepare(begin)
            .await
            .map_err(to_status)?;
        loop {
            let message = tokio::select! {
                () = upload.session_ended() => {
                    return Err(Status::aborted(format!(
                        "prepare {txn}: session {session} ended during the upload; its memory is freed"
                    )));
                }
                m = inbound.message() => m,
            };
            match message {
                Ok(Some(pb::PrepareRequest {
                    kind: Some(pb::prepare_request::Kind::Chunk(c)),
                })) => {
                    upload
                        .accept(&c.name, c.offset, &c.data)
                        .map_err(to_status)?;
                }
                Ok(Some(pb::PrepareRequest {
                    kind: Some(pb::prepare_request::Kind::End(_)),
                })) => break,
                Ok(Some(_)) => {
                    return Err(Status::invalid_argument(
                        "prepare: only chunks and End may follow Begin",
                    ));
                }
                Ok(None) => {
                    return Err(Status::invalid_argument(
                        "prepare: the upload stream ended without End; the transaction is aborted",
                    ));
                }
                Err(status) => return Err(status),
            }
        }
        let (reserved_bytes, timings) = upload.finish().map_err(to_status)?;
        Ok(Response::new(pb::PrepareReply {
            txn_id: txn.to_string(),
            reserved_bytes,
            timings: Some(timings_to_proto(&timings)),
        }))
    }

    async fn commit(
        &self,
        request: Request<pb::Decision>,
    ) -> Result<Response<pb::DecisionReply>, Status> {
        let (session, txn) = decision_ids(request.get_ref())?;
        let outcome = self.registry.commit(session, txn).map_err(to_status)?;
        Ok(Response::new(decision_reply(outcome)))
    }

    async fn abort(
        &self,
        request: Request<pb::Decision>,
    ) -> Result<Response<pb::DecisionReply>, Status> {
        let (session, txn) = decision_ids(request.get_ref())?;
        let outcome = self.registry.abort(session, txn).map_err(to_status)?;
        Ok(Response::new(decision_reply(outcome)))
    }

    async fn forward(
        &self,
        request: Request<pb::ForwardRequest>,
    ) -> Result<Response<pb::ForwardReply>, Status> {
        let (session, call) = request_from_proto(request.into_inner()).map_err(to_status)?;
        let output = self
            .registry
            .forward(session, call)
            .await
            .map_err(to_status)?;
        Ok(Response::new(output_to_proto(output)))
    }

    async fn kv_clear(
        &self,
        request: Request<pb::KvClearRequest>,
    ) -> Result<Response<pb::KvReply>, Status> {
        let req = request.into_inner();
        let session = SessionId::parse(&req.session_id).map_err(invalid)?;
        self.registry
            .kv_clear(session, req.seq)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::KvReply {}))
    }

    async fn kv_truncate(
        &self,
        request: Request<pb::KvTruncateRequest>,
    ) -> Result<Response<pb::KvReply>, Status> {
        let req = request.into_inner();
        let session = SessionId::parse(&req.session_id).map_err(invalid)?;
        self.registry
            .kv_truncate(session, req.seq, req.length)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::KvReply {}))
    }

    async fn kv_copy(
        &self,
        request: Request<pb::KvCopyRequest>,
    ) -> Result<Response<pb::KvReply>, Status> {
        let req = request.into_inner();
        let session = SessionId::parse(&req.session_id).map_err(invalid)?;
        self.registry
            .kv_copy(session, req.src_seq, req.dst_seq, req.length)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::KvReply {}))
    }
}
