//! Loading and serving through a worker: Prepare (streamed, checksummed), Commit, Abort,
//! Forward and KV operations.

use crate::{ClientError, ErrorKind, WorkerClient};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tether_proto::v1 as pb;
use tether_protocol::forward::grpc::{output_from_proto, request_to_proto};
use tether_protocol::grpc::{identity_to_proto, spec_to_proto, timings_from_proto};
use tether_protocol::{
    AbortCause, BlockSpec, FileIdentity, ForwardInput, ForwardOutput, MAX_TOP_K, Outcome,
    PrepareTimings, Rows, SessionId, TokenPos, TxnId, WorkerError,
};

/// Where a client reads tensor bytes from (an mmap of the GGUF file, or memory).
pub trait TensorSource: Send + Sync + 'static {
    /// The bytes of tensor `name`, or `None` when the source lacks it.
    fn tensor_bytes(&self, name: &str) -> Option<&[u8]>;

    /// The CRC-32 (IEEE) of tensor `name`'s bytes. Sources used for many loads may keep
    /// it, so that a reload or a second attempt does not read every tensor again.
    fn crc32(&self, name: &str) -> Option<u32> {
        self.tensor_bytes(name).map(crc32fast::hash)
    }
}

/// A layer block to load.
#[derive(Clone, Debug)]
pub struct LoadRequest {
    /// The transaction id, the same on every worker of one load.
    pub txn: TxnId,
    /// The model file's bytes before its tensor data.
    pub gguf_header: Vec<u8>,
    /// Length of the whole model file.
    pub gguf_file_bytes: u64,
    /// The block.
    pub spec: BlockSpec,
    /// Names of the tensors the block needs, in the order to send them.
    pub tensors: Vec<String>,
    /// How long the worker waits for Commit/Abort; `None` = its default.
    pub decision_timeout: Option<Duration>,
    /// Bytes per chunk message.
    pub chunk_bytes: usize,
    /// The worker's own copy of the model (as the worker sees it) to read the tensors from
    /// instead of receiving chunks; `None`: stream them. A worker that will not read it
    /// answers [`crate::ErrorKind::LocalFileRefused`], having staged nothing.
    pub local_path: Option<String>,
    /// With `local_path`: the identity of the source's file. The worker then reads it
    /// without checksums if its file is that very file (and refuses otherwise), and this
    /// client computes none: no pass over the tensor bytes here.
    pub same_file: Option<FileIdentity>,
}

/// A worker's yes vote in Prepare, with where the time went.
#[derive(Clone, Copy, Debug, Default)]
pub struct Prepared {
    /// Bytes the worker reserved for the block.
    pub reserved: u64,
    /// The worker's own split of its Prepare (zero from workers that do not report it).
    pub worker: PrepareTimings,
    /// Time this client spent computing the tensors' CRC-32s before sending Begin.
    pub digests: Duration,
    /// The whole call, from the first digest to the reply.
    pub wall: Duration,
}

/// Default chunk size: large enough to stream fast, far below the message limit.
pub const DEFAULT_CHUNK_BYTES: usize = 4 << 20;

struct Chunks {
    source: Arc<dyn TensorSource>,
    sent: Arc<AtomicU64>,
    names: Vec<String>,
    tensor: usize,
    offset: usize,
    chunk: usize,
}

impl Iterator for Chunks {
    type Item = pb::PrepareRequest;

    fn next(&mut self) -> Option<pb::PrepareRequest> {
        loop {
            let name = self.names.get(self.tensor)?;
            let data = self.source.tensor_bytes(name).unwrap_or(&[]);
            if self.offset >= data.len() {
                self.tensor += 1;
                self.offset = 0;
                continue;
            }
            let end = (self.offset + self.chunk).min(data.len());
            let chunk = pb::TensorChunk {
                name: name.clone(),
                offset: self.offset as u64,
                data: data[self.offset..end].to_vec(),
            };
            self.sent
                .fetch_add((end - self.offset) as u64, Ordering::Relaxed);
            self.offset = end;
            return Some(pb::PrepareRequest {
                kind: Some(pb::prepare_request::Kind::Chunk(chunk)),
            });
        }
    }
}

impl WorkerClient {
    /// Phase one: uploads the block's tensors with their sizes and CRC-32s; returns the bytes
    /// the worker reserved. A refusal (e.g. not enough memory) is an error of kind
    /// `ResourceExhausted` and leaves nothing staged.
    pub async fn prepare(
        &self,
        session: SessionId,
        load: LoadRequest,
        source: Arc<dyn TensorSource>,
    ) -> Result<u64, ClientError> {
        self.prepare_with_progress(session, load, source, Arc::default())
            .await
    }

    /// [`Self::prepare`], adding the tensor bytes handed to the stream to `sent` as they
    /// go, for progress bars. With `load.local_path` no tensor bytes are sent (the CRC-32s
    /// still are, so the worker can check its copy against the source's).
    pub async fn prepare_with_progress(
        &self,
        session: SessionId,
        load: LoadRequest,
        source: Arc<dyn TensorSource>,
        sent: Arc<AtomicU64>,
    ) -> Result<u64, ClientError> {
        self.prepare_timed(session, load, source, sent)
            .await
            .map(|p| p.reserved)
    }

    /// [`Self::prepare_with_progress`], returning where the time went as well.
    pub async fn prepare_timed(
        &self,
        session: SessionId,
        load: LoadRequest,
        source: Arc<dyn TensorSource>,
        sent: Arc<AtomicU64>,
    ) -> Result<Prepared, ClientError> {
        let started = Instant::now();
        let same_file = load
            .same_file
            .as_ref()
            .filter(|_| load.local_path.is_some());
        let mut digests = Vec::with_capacity(load.tensors.len());
        for name in &load.tensors {
            let missing = || {
                ClientError::protocol(
                    "prepare",
                    &self.addr,
                    format!("the tensor source has no tensor {name:?}"),
                )
            };
            let data = source.tensor_bytes(name).ok_or_else(missing)?;
            digests.push(pb::TensorDigest {
                name: name.clone(),
                bytes: data.len() as u64,
                crc32: match same_file {
                    Some(_) => 0,
                    None => source.crc32(name).ok_or_else(missing)?,
                },
            });
        }
        let digests_took = started.elapsed();
        let begin = pb::PrepareBegin {
            session_id: session.to_string(),
            txn_id: load.txn.to_string(),
            gguf_header: load.gguf_header,
            gguf_file_bytes: load.gguf_file_bytes,
            stage: Some(spec_to_proto(&load.spec)),
            tensors: digests,
            decision_timeout_ms: load
                .decision_timeout
                .map_or(0, |d| u32::try_from(d.as_millis()).unwrap_or(u32::MAX)),
            local_path: load.local_path.clone().unwrap_or_default(),
            same_file: same_file.map(identity_to_proto),
        };
        // Over the limit, h2 would only say "protocol error"; say which limit instead.
        let begin_bytes = prost::Message::encoded_len(&begin);
        if begin_bytes > self.max_send_bytes {
            return Err(ClientError::Rpc {
                op: "prepare",
                addr: self.addr.clone(),
                kind: ErrorKind::ResourceExhausted,
                message: format!(
                    "the GGUF header and tensor list take {begin_bytes} bytes, over the gRPC \
                     message limit of {} bytes (the smaller of this client's and the worker's \
                     --max-message-bytes); raise both, or use a file with less metadata",
                    self.max_send_bytes
                ),
            });
        }
        let names = if load.local_path.is_some() {
            Vec::new()
        } else {
            load.tensors
        };
        let chunks = Chunks {
            source,
            sent,
            names,
            tensor: 0,
            offset: 0,
            chunk: load.chunk_bytes.max(1),
        };
        let messages = std::iter::once(pb::PrepareRequest {
            kind: Some(pb::prepare_request::Kind::Begin(begin)),
        })
        .chain(chunks)
        .chain(std::iter::once(pb::PrepareRequest {
            kind: Some(pb::prepare_request::Kind::End(pb::PrepareEnd {})),
        }));
        let reply = self
            .rpc
            .clone()
            .prepare(futures::stream::iter(messages))
            .await
            .map_err(|s| ClientError::rpc("prepare", &self.addr, &s))?
            .into_inner();
        Ok(Prepared {
            reserved: reply.reserved_bytes,
            worker: reply
                .timings
                .as_ref()
                .map(timings_from_proto)
                .unwrap_or_default(),
            digests: digests_took,
            wall: started.elapsed(),
        })
    }

    async fn decide(
        &self,
        op: &'static str,
        session: SessionId,
        txn: TxnId,
    ) -> Result<Outcome, ClientError> {
        let d = pb::Decision {
            session_id: session.to_string(),
            txn_id: txn.to_string(),
        };
        let mut rpc = self.rpc.clone();
        let reply = if op == "commit" {
            rpc.commit(d).await
        } else {
            rpc.abort(d).await
        };
        let reply = reply
            .map_err(|s| ClientError::rpc(op, &self.addr, &s))?
            .into_inner();
        match pb::TxnState::try_from(reply.state) {
            Ok(pb::TxnState::Committed) => Ok(Outcome::Committed),
            Ok(pb::TxnState::Aborted) => Ok(Outcome::Aborted(AbortCause::Requested)),
            _ => Err(ClientError::protocol(
                op,
                &self.addr,
                format!("unknown transaction state {}", reply.state),
            )),
        }
    }

    /// Phase two: serve the prepared block. Idempotent.
    pub async fn commit(&self, session: SessionId, txn: TxnId) -> Result<Outcome, ClientError> {
        self.decide("commit", session, txn).await
    }

    /// Phase two: free the prepared block. Idempotent.
    pub async fn abort(&self, session: SessionId, txn: TxnId) -> Result<Outcome, ClientError> {
        self.decide("abort", session, txn).await
    }

    /// Runs the session's block over a batch; `rows` says what comes back for the logits
    /// rows (every logit, the arg-max tokens, or the top candidates).
    pub async fn forward(
        &self,
        session: SessionId,
        tokens: &[TokenPos],
        input: &ForwardInput,
        logits_rows: &[u32],
        rows: Rows,
    ) -> Result<ForwardOutput, ClientError> {
        self.forward_scored(session, tokens, input, logits_rows, rows, &[])
            .await
    }

    /// [`WorkerClient::forward`] with the token ids whose logits [`Rows::LogProbs`] rows
    /// return (empty, or one a logits row).
    pub async fn forward_scored(
        &self,
        session: SessionId,
        tokens: &[TokenPos],
        input: &ForwardInput,
        logits_rows: &[u32],
        rows: Rows,
        targets: &[u32],
    ) -> Result<ForwardOutput, ClientError> {
        // gRPC carries "no top-k" as 0, so a zero k would reach the worker as a request for
        // every logit: such a request is refused here, as the worker refuses it on a link.
        if let Rows::Top(k) = rows
            && (k == 0 || k > MAX_TOP_K)
        {
            return Err(ClientError::domain(
                "forward",
                &self.addr,
                WorkerError::InvalidArgument(format!(
                    "forward: top_k {k} is outside 1..={MAX_TOP_K}"
                )),
            ));
        }
        if matches!(rows, Rows::HandOff(_)) || matches!(input, ForwardInput::Lent(_)) {
            return Err(ClientError::domain(
                "forward",
                &self.addr,
                WorkerError::InvalidArgument(
                    "forward: hidden states are handed over device to device only on a data \
                     link"
                        .into(),
                ),
            ));
        }
        let req = request_to_proto(session, tokens, input, logits_rows, rows, targets);
        let reply = self
            .rpc
            .clone()
            .forward(req)
            .await
            .map_err(|s| ClientError::rpc("forward", &self.addr, &s))?;
        output_from_proto(reply.into_inner(), logits_rows.len(), rows)
            .map_err(|e| ClientError::domain("forward", &self.addr, e))
    }

    /// Forgets every KV cell of `seq`.
    pub async fn kv_clear(&self, session: SessionId, seq: u32) -> Result<(), ClientError> {
        let req = pb::KvClearRequest {
            session_id: session.to_string(),
            seq,
        };
        self.rpc
            .clone()
            .kv_clear(req)
            .await
            .map_err(|s| ClientError::rpc("kv clear", &self.addr, &s))?;
        Ok(())
    }

    /// Keeps the first `length` positions of `seq`.
    pub async fn kv_truncate(
        &self,
        session: SessionId,
        seq: u32,
        length: u32,
    ) -> Result<(), ClientError> {
        let req = pb::KvTruncateRequest {
            session_id: session.to_string(),
            seq,
            length,
        };
        self.rpc
            .clone()
            .kv_truncate(req)
            .await
            .map_err(|s| ClientError::rpc("kv truncate", &self.addr, &s))?;
        Ok(())
    }

    /// Makes `dst` hold the first `length` positions of `src` (copied on the worker's
    /// device; `src` keeps them).
    pub async fn kv_copy(
        &self,
        session: SessionId,
        src: u32,
        dst: u32,
        length: u32,
    ) -> Result<(), ClientError> {
        let req = pb::KvCopyRequest {
            session_id: session.to_string(),
            src_seq: src,
            dst_seq: dst,
            length,
        };
        self.rpc
            .clone()
            .kv_copy(req)
            .await
            .map_err(|s| ClientError::rpc("kv copy", &self.addr, &s))?;
        Ok(())
    }
}
