//! One real worker in-process for the worker targets: a `SessionRegistry` on the cpu
//! backend with a small memory limit, the real `Worker` and `Admin` services over it, and
//! one session serving a committed tiny model, which Forward and KV requests address.
//!
//! Requests name sessions by [`SESSION_PLACEHOLDER`]; the rig swaps in a live session id
//! right after decoding, since the worker picks ids at random and no fixed input could
//! reach a session otherwise.

use crate::Finding;
use crate::model::TinyModel;
use bytes::Bytes;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tether_compute::CpuBackend;
use tether_proto::v1 as pb;
use tether_worker::grpc::{AdminService, WorkerService};
use tether_worker::model_stage::ModelStageFactory;
use tether_worker::server::DEFAULT_MAX_MESSAGE_BYTES;
use tether_worker::{EndReason, Lease, RegistryConfig, SessionId, SessionRegistry, TxnId};
use tonic::codec::{BufferSettings, DecodeBuf, Decoder, Streaming};
use tonic::{Code, Status};
use tonic_prost::ProstDecoder;

/// The session id inputs use; replaced by a live session's id after decoding.
pub const SESSION_PLACEHOLDER: &str = "fuzz-session";

/// The transaction the rig prepares before each Commit/Abort input.
pub const PREPARED_TXN: &str = "6f7a7a00-0000-4000-8000-000000000001";

/// Session memory the rig's worker admits: the tiny model and a little more, so plans from
/// hostile headers are refused by the ledger rather than allocated.
pub const MEMORY_LIMIT: u64 = 48 << 20;

/// How long one request may take before the rig calls it a hang.
const HANG: Duration = Duration::from_secs(30);

/// The in-process worker.
pub struct Rig {
    runtime: tokio::runtime::Runtime,
    /// The registry every request goes to.
    pub registry: Arc<SessionRegistry>,
    worker: WorkerService,
    admin: AdminService,
    /// The model the serving session holds and seeds load.
    pub model: TinyModel,
    serving: SessionId,
    /// One request at a time: a fuzz input owns the worker while it runs.
    turn: Mutex<()>,
}

static RIG: OnceLock<Rig> = OnceLock::new();

impl Rig {
    /// The process's rig, built on first use.
    pub fn get() -> &'static Rig {
        RIG.get_or_init(|| match Rig::new() {
            Ok(rig) => rig,
            // Without the rig no worker target can run; this is a broken build, not input.
            Err(e) => panic!("building the fuzz worker rig: {e}"),
        })
    }

    fn new() -> Result<Rig, String> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("tokio runtime: {e}"))?;
        let backend = CpuBackend::new(Some(1)).map_err(|e| format!("cpu backend: {e}"))?;
        let factory = Arc::new(ModelStageFactory::new(Arc::new(backend)));
        let registry = Arc::new(SessionRegistry::new(
            factory,
            MEMORY_LIMIT,
            RegistryConfig::default(),
        ));
        let worker = WorkerService::new(Arc::clone(&registry), DEFAULT_MAX_MESSAGE_BYTES);
        let admin = AdminService::new(Arc::clone(&registry));
        let model = TinyModel::new()?;
        let serving = registry
            .open("fuzz-serving", default_lease())
            .map_err(|e| e.to_string())?
            .id;
        let rig = Rig {
            runtime,
            registry,
            worker,
            admin,
            model,
            serving,
            turn: Mutex::new(()),
        };
        let frames = rig.model.prepare_frames(
            SESSION_PLACEHOLDER,
            PREPARED_TXN,
            crate::model::serving_spec(),
        );
        rig.load(serving, &frames)
            .map_err(|f| format!("loading the serving session: {f}"))?;
        Ok(rig)
    }

    /// Runs `f` on the rig's runtime, one input at a time, failing on a hang.
    pub fn run<T>(
        &self,
        what: &str,
        f: impl std::future::Future<Output = T>,
    ) -> Result<T, Finding> {
        let _turn = self.turn.lock().unwrap_or_else(|p| p.into_inner());
        self.runtime
            .block_on(async { tokio::time::timeout(HANG, f).await })
            .map_err(|_| Finding(format!("{what}: no answer within {HANG:?}")))
    }

    /// The worker service.
    pub fn worker(&self) -> &WorkerService {
        &self.worker
    }

    /// The admin service.
    pub fn admin(&self) -> &AdminService {
        &self.admin
    }

    /// The session serving the tiny model.
    pub fn serving(&self) -> SessionId {
        self.serving
    }

    /// A new session with nothing loaded, for inputs that change or end a session.
    pub fn fresh_session(&self) -> Result<SessionId, Finding> {
        self.registry
            .open("fuzz-fresh", default_lease())
            .map(|t| t.id)
            .map_err(|e| Finding(format!("opening a fresh session: {e}")))
    }

    /// Ends `session` if it still lives.
    pub fn end(&self, session: SessionId) {
        let _ = self.registry.end(session, EndReason::Closed);
    }

    /// Prepares and commits `frames` (a Prepare stream) into `session`.
    fn load(&self, session: SessionId, frames: &[u8]) -> Result<(), Finding> {
        let reply = self.run("load", async {
            use pb::worker_server::Worker;
            self.worker
                .prepare(tonic::Request::new(prepare_stream(frames, session)))
                .await
        })?;
        let reply = reply.map_err(|s| Finding(format!("prepare: {s}")))?;
        let txn = TxnId::parse(&reply.get_ref().txn_id).map_err(|e| Finding(e.to_string()))?;
        self.registry
            .commit(session, txn)
            .map_err(|e| Finding(format!("commit: {e}")))?;
        Ok(())
    }

    /// Prepares [`PREPARED_TXN`] (the tiny model's head) in `session`, for Decision inputs.
    pub fn prepare_txn(&self, session: SessionId) -> Result<(), Finding> {
        let frames = self.model.prepare_frames(
            SESSION_PLACEHOLDER,
            PREPARED_TXN,
            crate::model::head_only_spec(),
        );
        let reply = self.run("prepare for a decision", async {
            use pb::worker_server::Worker;
            self.worker
                .prepare(tonic::Request::new(prepare_stream(&frames, session)))
                .await
        })?;
        reply
            .map(|_| ())
            .map_err(|s| Finding(format!("preparing the decision's transaction: {s}")))
    }
}

fn default_lease() -> Lease {
    Lease {
        heartbeat_interval: Duration::from_secs(10),
        ttl: Duration::from_secs(600),
    }
}

/// Replaces [`SESSION_PLACEHOLDER`] by `session`.
pub fn substitute(id: &mut String, session: SessionId) {
    if id == SESSION_PLACEHOLDER {
        *id = session.to_string();
    }
}

/// A prost decoder that fixes up each message right after decoding.
struct Fixing<T, F> {
    inner: ProstDecoder<T>,
    fix: F,
}

impl<T, F> Decoder for Fixing<T, F>
where
    T: prost::Message + Default,
    F: FnMut(&mut T),
{
    type Item = T;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<T>, Status> {
        let mut message = self.inner.decode(src)?;
        if let Some(m) = &mut message {
            (self.fix)(m);
        }
        Ok(message)
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.inner.buffer_settings()
    }
}

/// A request stream reading gRPC frames from `frames`, as tonic reads a client's body,
/// with the worker's message size limit.
fn stream_of<T, F>(frames: &[u8], fix: F) -> Streaming<T>
where
    T: prost::Message + Default + Send + 'static,
    F: FnMut(&mut T) + Send + 'static,
{
    let body = http_body_util::Full::new(Bytes::copy_from_slice(frames));
    let decoder = Fixing {
        inner: ProstDecoder::<T>::default(),
        fix,
    };
    Streaming::new_request(decoder, body, None, Some(DEFAULT_MAX_MESSAGE_BYTES))
}

/// A Prepare stream whose Begin names `session`.
pub fn prepare_stream(frames: &[u8], session: SessionId) -> Streaming<pb::PrepareRequest> {
    stream_of(frames, move |m: &mut pb::PrepareRequest| {
        if let Some(pb::prepare_request::Kind::Begin(b)) = &mut m.kind {
            substitute(&mut b.session_id, session);
        }
    })
}

/// An Attach stream.
pub fn attach_stream(frames: &[u8]) -> Streaming<pb::AttachRequest> {
    stream_of(frames, |_: &mut pb::AttachRequest| {})
}

/// A status the worker may answer hostile input with; INTERNAL that names a panic is a
/// bug (a blocking task panicked and the registry turned it into a status).
pub fn check_status(what: &str, status: &Status) -> Result<(), Finding> {
    if status.code() == Code::Internal && status.message().contains("panicked") {
        return Err(Finding(format!("{what}: {status}")));
    }
    if status.code() == Code::Unknown {
        return Err(Finding(format!(
            "{what}: a status without a code: {status}"
        )));
    }
    Ok(())
}
