//! Prepare from the worker's own copy of the model, on the real model stage and real files:
//! a faithful copy is read (and counted as read locally; no chunk is taken after it), and a
//! copy that differs in size, header or one tensor byte is refused with the check that
//! failed, leaving the session's bytes where they were so that a streamed Prepare can
//! follow.

use crate::load::PrepareBegin;
use crate::metrics::TensorSourceKind;
use crate::model_dir::ModelDirs;
use crate::model_stage::ModelStageFactory;
use crate::registry::{RegistryConfig, SessionRegistry};
use crate::staging::TensorDigest;
use crate::testing::TempDir;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tether_compute::CpuBackend;
use tether_gguf::{GgmlType, GgufFile};
use tether_model::{ModelConfig, StageSpec, SynthShape, synthesize};
use tether_protocol::BlockSpec;
use tether_protocol::Lease;
use tether_protocol::TxnId;
use tether_protocol::WorkerError;
use tether_protocol::{FileIdentity, ForwardCall, ForwardInput, ForwardOutput, Rows, TokenPos};

/// The coordinator's model in `dir/coordinator/tiny.gguf` and the worker's directory
/// `dir/models`.
struct Files {
    dir: TempDir,
    model: std::path::PathBuf,
}

impl Files {
    fn new() -> Files {
        let dir = TempDir::new();
        std::fs::create_dir_all(dir.0.join("coordinator")).unwrap();
        std::fs::create_dir_all(dir.0.join("models")).unwrap();
        let model = dir.0.join("coordinator/tiny.gguf");
        synthesize(&model, SynthShape::Tiny, GgmlType::F32, 5).unwrap();
        Files { dir, model }
    }

    fn models(&self) -> std::path::PathBuf {
        self.dir.0.join("models")
    }

    /// Copies the model into the worker's directory as `name`, changed by `edit`.
    fn copy(&self, name: &str, edit: impl FnOnce(&mut Vec<u8>, &GgufFile)) {
        let mut bytes = std::fs::read(&self.model).unwrap();
        let file = GgufFile::open(&self.model).unwrap();
        edit(&mut bytes, &file);
        std::fs::write(self.models().join(name), bytes).unwrap();
    }
}

fn spec(n_layer: usize) -> BlockSpec {
    BlockSpec {
        first_layer: 0,
        last_layer: n_layer,
        has_embed: true,
        has_head: true,
        ctx_per_seq: 8,
        n_seq: 1,
        cached_seqs: 0,
        ubatch: 4,
        cache_k: GgmlType::F16,
        cache_v: GgmlType::F16,
    }
}

/// A Prepare of the whole model with the coordinator's digests, reading `local_path`.
fn begin(model: &Path, session: crate::SessionId, local_path: Option<&str>) -> (PrepareBegin, u64) {
    let file = GgufFile::open(model).unwrap();
    let cfg = ModelConfig::from_gguf(&file).unwrap();
    let block = spec(cfg.n_layer);
    let model_spec = StageSpec {
        first_layer: block.first_layer,
        last_layer: block.last_layer,
        has_embed: true,
        has_head: true,
        ctx_per_seq: block.ctx_per_seq,
        n_seq: block.n_seq,
        cached_seqs: 0,
        ubatch: block.ubatch,
        cache_k: block.cache_k,
        cache_v: block.cache_v,
    };
    let slots = tether_model::required_tensors(&cfg, &model_spec, file.tensors()).unwrap();
    let tensors: Vec<TensorDigest> = slots
        .iter()
        .map(|s| {
            let data = file.tensor_data(file.tensor(&s.name).unwrap());
            TensorDigest {
                name: s.name.clone(),
                bytes: data.len() as u64,
                crc32: crc32fast::hash(data),
            }
        })
        .collect();
    let tensor_bytes = tensors.iter().map(|t| t.bytes).sum();
    let bytes = std::fs::read(model).unwrap();
    let begin = PrepareBegin {
        session,
        txn: TxnId::new_random(),
        gguf_header: bytes[..file.data_offset() as usize].to_vec(),
        gguf_file_bytes: bytes.len() as u64,
        spec: block,
        tensors,
        decision_timeout: None,
        local_path: local_path.map(str::to_string),
        same_file: None,
    };
    (begin, tensor_bytes)
}

fn registry(models: &Path) -> Arc<SessionRegistry> {
    let backend = Arc::new(CpuBackend::new(Some(1)).unwrap());
    let config = RegistryConfig {
        model_dirs: ModelDirs::new(&[models.to_path_buf()]).unwrap(),
        ..RegistryConfig::default()
    };
    Arc::new(SessionRegistry::new(
        Arc::new(ModelStageFactory::new(backend)),
        1 << 30,
        config,
    ))
}

fn open(reg: &SessionRegistry) -> crate::SessionId {
    let lease = Lease {
        heartbeat_interval: Duration::from_secs(1),
        ttl: Duration::from_secs(30),
    };
    reg.open("local-model-test", lease).unwrap().id
}

/// The refusal of a Prepare in a new session reading `local_path`, after checking it left
/// nothing behind; and the session.
async fn refused(
    reg: &Arc<SessionRegistry>,
    model: &Path,
    local_path: &str,
) -> (crate::SessionId, String) {
    let session = open(reg);
    let (b, _) = begin(model, session, Some(local_path));
    (session, refusal(reg, b).await)
}

/// The refusal of Prepare `b` (reading a local file), after checking it left nothing
/// behind.
async fn refusal(reg: &Arc<SessionRegistry>, b: PrepareBegin) -> String {
    let path = b.local_path.clone().unwrap_or_default();
    let message = match reg.begin_prepare(b).await {
        Ok(_) => panic!("{path} was read"),
        Err(WorkerError::LocalFile(m)) => m,
        Err(other) => panic!("{path}: not a local-file refusal: {other:?}"),
    };
    assert_eq!(reg.status().session_bytes, 0, "{message}");
    assert!(reg.sessions().iter().all(|s| s.bytes == 0), "{message}");
    message
}

/// A Prepare reading `local_path` as the very file `identity` names: no CRC-32s sent.
fn same_file_begin(
    model: &Path,
    session: crate::SessionId,
    local_path: &str,
    identity: FileIdentity,
) -> PrepareBegin {
    let (mut b, _) = begin(model, session, Some(local_path));
    b.tensors.iter_mut().for_each(|t| t.crc32 = 0);
    b.same_file = Some(identity);
    b
}

fn identity(path: &Path) -> FileIdentity {
    FileIdentity::of(&std::fs::File::open(path).unwrap()).expect("a file identity on Linux")
}

/// Prepares and commits the whole model in `session` from streamed chunks.
async fn load_streamed(reg: &Arc<SessionRegistry>, model: &Path, session: crate::SessionId) {
    let (b, _) = begin(model, session, None);
    let txn = b.txn;
    let file = GgufFile::open(model).unwrap();
    let names: Vec<String> = b.tensors.iter().map(|t| t.name.clone()).collect();
    let mut upload = reg.begin_prepare(b).await.unwrap();
    for name in &names {
        upload
            .accept(name, 0, file.tensor_data(file.tensor(name).unwrap()))
            .unwrap();
    }
    upload.finish().unwrap();
    reg.commit(session, txn).unwrap();
}

/// The logits of the last of three prompt tokens.
async fn logits(reg: &Arc<SessionRegistry>, session: crate::SessionId) -> Vec<f32> {
    let call = ForwardCall {
        tokens: (0..3).map(|pos| TokenPos { seq: 0, pos }).collect(),
        input: ForwardInput::TokenIds(vec![1, 5, 9]),
        logits_rows: vec![2],
        rows: Rows::Logits,
        targets: Vec::new(),
    };
    match reg.forward(session, call).await.unwrap() {
        ForwardOutput::Logits(l) => l,
        other => panic!("not logits: {other:?}"),
    }
}

#[tokio::test]
async fn a_faithful_copy_is_read_locally_and_prepares() {
    let files = Files::new();
    files.copy("tiny.gguf", |_, _| {});
    let reg = registry(&files.models());
    let session = open(&reg);
    let (b, tensor_bytes) = begin(&files.model, session, Some("tiny.gguf"));
    let txn = b.txn;
    let mut upload = reg.begin_prepare(b).await.unwrap();
    assert_eq!(upload.source(), TensorSourceKind::LocalFile);
    let err = upload.accept("token_embd.weight", 0, &[0; 4]).unwrap_err();
    assert!(err.to_string().contains("without chunks"), "{err}");
    let (reserved, _) = upload.finish().unwrap();
    assert!(reserved > tensor_bytes, "{reserved} <= {tensor_bytes}");
    reg.commit(session, txn).unwrap();
    assert_eq!(
        reg.metrics.tensor_bytes(TensorSourceKind::LocalFile),
        tensor_bytes
    );
    assert_eq!(reg.metrics.tensor_bytes(TensorSourceKind::Network), 0);
    assert_eq!(reg.metrics.local_refused(), 0);
    let text = reg.prometheus_text();
    assert!(
        text.contains(&format!(
            "tether_tensor_bytes_total{{source=\"local_file\"}} {tensor_bytes}\n"
        )),
        "{text}"
    );
}

#[tokio::test]
async fn one_flipped_tensor_byte_fails_the_checksum_and_a_streamed_prepare_follows() {
    let files = Files::new();
    let flipped = "blk.1.ffn_down.weight";
    files.copy("tiny.gguf", |bytes, file| {
        let t = file.tensor(flipped).unwrap();
        bytes[(t.offset + t.bytes / 2) as usize] ^= 0x40;
    });
    let reg = registry(&files.models());
    let (session, m) = refused(&reg, &files.model, "tiny.gguf").await;
    assert!(m.contains("checksum check failed"), "{m}");
    assert!(m.contains(flipped), "{m}");
    assert_eq!(reg.metrics.local_refused(), 1);

    // The session is free for a streamed Prepare under a fresh transaction id.
    let (b, tensor_bytes) = begin(&files.model, session, None);
    let txn = b.txn;
    let file = GgufFile::open(&files.model).unwrap();
    let names: Vec<String> = b.tensors.iter().map(|t| t.name.clone()).collect();
    let mut upload = reg.begin_prepare(b).await.unwrap();
    for name in &names {
        upload
            .accept(name, 0, file.tensor_data(file.tensor(name).unwrap()))
            .unwrap();
    }
    assert!(upload.finish().unwrap().0 > 0);
    reg.commit(session, txn).unwrap();
    assert_eq!(
        reg.metrics.tensor_bytes(TensorSourceKind::Network),
        tensor_bytes
    );
}

#[tokio::test]
async fn a_copy_of_another_size_or_header_is_refused_before_anything_is_reserved() {
    let files = Files::new();
    files.copy("longer.gguf", |bytes, _| bytes.push(0));
    files.copy("header.gguf", |bytes, file| {
        // The last byte before the tensor data: alignment padding or the last tensor
        // record; either way the header differs.
        bytes[file.data_offset() as usize - 1] ^= 0x01;
    });
    let reg = registry(&files.models());
    let (_, m) = refused(&reg, &files.model, "longer.gguf").await;
    assert!(m.contains("size check failed"), "{m}");
    let (_, m) = refused(&reg, &files.model, "header.gguf").await;
    assert!(m.contains("header check failed"), "{m}");
    assert_eq!(reg.metrics.tensor_bytes(TensorSourceKind::LocalFile), 0);
    assert_eq!(reg.metrics.local_refused(), 2);
}

#[tokio::test]
async fn a_path_outside_the_model_dir_is_refused_though_the_file_is_right() {
    let files = Files::new();
    let reg = registry(&files.models());
    let (_, m) = refused(&reg, &files.model, files.model.to_str().unwrap()).await;
    assert!(m.contains("outside"), "{m}");
    let (_, m) = refused(&reg, &files.model, "../coordinator/tiny.gguf").await;
    assert!(m.contains("outside"), "{m}");
}

#[tokio::test]
async fn a_worker_without_model_dir_refuses_local_reads() {
    let files = Files::new();
    let backend = Arc::new(CpuBackend::new(Some(1)).unwrap());
    let reg = Arc::new(SessionRegistry::new(
        Arc::new(ModelStageFactory::new(backend)),
        1 << 30,
        RegistryConfig::default(),
    ));
    let (_, m) = refused(&reg, &files.model, files.model.to_str().unwrap()).await;
    assert!(m.contains("without --model-dir"), "{m}");
}

#[tokio::test]
async fn the_coordinators_own_file_is_read_without_checksums_to_the_same_logits() {
    let files = Files::new();
    // The worker's directory is the coordinator's: it reads the very file mapped there.
    let reg = registry(files.model.parent().unwrap());
    let own = open(&reg);
    let b = same_file_begin(&files.model, own, "tiny.gguf", identity(&files.model));
    let txn = b.txn;
    let upload = reg.begin_prepare(b).await.unwrap();
    assert_eq!(upload.source(), TensorSourceKind::LocalFile);
    let (_, timings) = upload.finish().unwrap();
    assert_eq!(timings.checksum, Duration::ZERO, "{timings:?}");
    assert!(timings.tensor_bytes > 0, "{timings:?}");
    reg.commit(own, txn).unwrap();
    let streamed = open(&reg);
    load_streamed(&reg, &files.model, streamed).await;
    let (a, b) = (logits(&reg, own).await, logits(&reg, streamed).await);
    assert!(!a.is_empty());
    assert_eq!(a, b, "the worker's own read must load the same weights");
    assert_eq!(reg.metrics.local_refused(), 0);
}

#[tokio::test]
async fn another_file_or_a_changed_one_fails_the_identity_check() {
    let files = Files::new();
    // Byte for byte the coordinator's file, but another file: it needs CRC-32s.
    files.copy("tiny.gguf", |_, _| {});
    let reg = registry(&files.models());
    let b = same_file_begin(
        &files.model,
        open(&reg),
        "tiny.gguf",
        identity(&files.model),
    );
    let m = refusal(&reg, b).await;
    assert!(m.contains("identity check failed"), "{m}");
    assert!(m.contains("another file"), "{m}");

    // The worker's own file, changed after the coordinator took its identity.
    let copy = files.models().join("tiny.gguf");
    let before = identity(&copy);
    let file = std::fs::OpenOptions::new().write(true).open(&copy).unwrap();
    file.set_modified(std::time::SystemTime::now() + Duration::from_secs(5))
        .unwrap();
    drop(file);
    let b = same_file_begin(&files.model, open(&reg), "tiny.gguf", before);
    let m = refusal(&reg, b).await;
    assert!(m.contains("changed"), "{m}");
    assert_eq!(reg.metrics.tensor_bytes(TensorSourceKind::LocalFile), 0);
}

#[tokio::test]
async fn status_follows_the_sessions_kv_blocks() {
    let files = Files::new();
    files.copy("tiny.gguf", |_, _| {});
    let reg = registry(&files.models());
    let session = open(&reg);
    let (b, _) = begin(&files.model, session, Some("tiny.gguf"));
    let txn = b.txn;
    let upload = reg.begin_prepare(b).await.unwrap();
    upload.finish().unwrap();
    let pool = |reg: &SessionRegistry| {
        let s = &reg.sessions()[0];
        (s.kv_blocks, s.kv_blocks_free)
    };
    assert_eq!(pool(&reg), (0, 0), "nothing committed");
    reg.commit(session, txn).unwrap();
    // One sequence of 8 cells: one block of 32.
    assert_eq!(pool(&reg), (1, 1));
    logits(&reg, session).await;
    assert_eq!(pool(&reg), (1, 0));
    let text = reg.prometheus_text();
    let series = format!("tether_session_kv_blocks{{session=\"{session}\",state=\"free\"}} 0\n");
    assert!(text.contains(&series), "{text}");
    reg.kv_clear(session, 0).await.unwrap();
    assert_eq!(pool(&reg), (1, 1));
}
