//! The tiny synthetic model the worker rig serves and the Prepare seeds load: its header,
//! its tensors, and Prepare streams for a layer block of it as gRPC frames.

use prost::Message;
use tether_gguf::{GgmlType, GgufFile};
use tether_model::{ModelConfig, StageSpec, SynthShape, synthesize};
use tether_proto::v1 as pb;

/// Bytes per TensorChunk, small so one seed has several chunks per tensor.
const CHUNK_BYTES: usize = 8 << 10;

/// Layers of [`SynthShape::Tiny`].
pub const TINY_LAYERS: u32 = 2;

/// The whole tiny model (Q8_0 weights) in memory.
pub struct TinyModel {
    /// The file's bytes.
    pub bytes: Vec<u8>,
    /// The parsed file.
    pub file: GgufFile,
    /// Its hyper-parameters.
    pub config: ModelConfig,
}

/// The block the rig's serving session holds: every layer, embedding and head.
pub fn serving_spec() -> pb::StageSpec {
    pb::StageSpec {
        first_layer: 0,
        last_layer: TINY_LAYERS,
        has_embed: true,
        has_head: true,
        ctx_per_seq: 32,
        n_seq: 2,
        cached_seqs: 0,
        ubatch: 8,
        cache_type_k: pb::KvCacheType::F16 as i32,
        cache_type_v: pb::KvCacheType::F16 as i32,
    }
}

/// A block of the output head alone: the smallest real load (tens of KiB), for seeds.
pub fn head_only_spec() -> pb::StageSpec {
    pb::StageSpec {
        first_layer: TINY_LAYERS,
        last_layer: TINY_LAYERS,
        has_embed: false,
        has_head: true,
        ctx_per_seq: 8,
        n_seq: 1,
        cached_seqs: 0,
        ubatch: 4,
        cache_type_k: pb::KvCacheType::F16 as i32,
        cache_type_v: pb::KvCacheType::F16 as i32,
    }
}

/// One gRPC frame (uncompressed) holding `message`.
pub fn frame(message: &impl Message) -> Vec<u8> {
    let body = message.encode_to_vec();
    let mut out = Vec::with_capacity(5 + body.len());
    out.push(0);
    out.extend((body.len() as u32).to_be_bytes());
    out.extend(body);
    out
}

impl TinyModel {
    /// Synthesizes the model (seeded, so every run has the same bytes).
    pub fn new() -> Result<TinyModel, String> {
        let path = std::env::temp_dir().join(format!(
            "tether-fuzz-tiny-{}-{:?}.gguf",
            std::process::id(),
            std::thread::current().id()
        ));
        let made = synthesize(&path, SynthShape::Tiny, GgmlType::Q8_0, 11)
            .map_err(|e| format!("synthesizing the tiny model: {e}"));
        let bytes = made.and_then(|()| {
            std::fs::read(&path).map_err(|e| format!("reading {}: {e}", path.display()))
        });
        let _ = std::fs::remove_file(&path);
        let bytes = bytes?;
        let file = GgufFile::from_bytes("tiny.gguf", bytes.clone()).map_err(|e| e.to_string())?;
        let config = ModelConfig::from_gguf(&file).map_err(|e| e.to_string())?;
        Ok(TinyModel {
            bytes,
            file,
            config,
        })
    }

    /// The bytes before the tensor data: what a coordinator sends in PrepareBegin.
    pub fn header(&self) -> &[u8] {
        self.file.header_bytes()
    }

    /// The tensors a block of `spec` loads, in the order a coordinator sends them.
    pub fn block_tensors(&self, spec: &pb::StageSpec) -> Vec<(String, &[u8])> {
        // The worker's own reading of the spec: a spec it refuses loads nothing.
        let Ok(block) = tether_protocol::grpc::spec_from_proto(Some(*spec)) else {
            return Vec::new();
        };
        let model_spec = StageSpec::from(&block);
        let slots = tether_model::required_tensors(&self.config, &model_spec, self.file.tensors())
            .unwrap_or_default();
        slots
            .into_iter()
            .filter_map(|s| {
                let info = self.file.tensor(&s.name)?;
                Some((s.name, self.file.tensor_data(info)))
            })
            .collect()
    }

    /// The Begin of a Prepare of `spec` into `session` as transaction `txn`.
    pub fn begin(&self, session: &str, txn: &str, spec: pb::StageSpec) -> pb::PrepareBegin {
        pb::PrepareBegin {
            session_id: session.into(),
            txn_id: txn.into(),
            gguf_header: self.header().to_vec(),
            stage: Some(spec),
            tensors: self
                .block_tensors(&spec)
                .into_iter()
                .map(|(name, data)| pb::TensorDigest {
                    name,
                    bytes: data.len() as u64,
                    crc32: crc32fast::hash(data),
                })
                .collect(),
            decision_timeout_ms: 0,
            gguf_file_bytes: self.bytes.len() as u64,
            // Streamed: the fuzz worker has no --model-dir, so a mutated path is refused.
            local_path: String::new(),
            same_file: None,
        }
    }

    /// The whole Prepare stream of `spec` (Begin, every chunk, End) as gRPC frames.
    pub fn prepare_frames(&self, session: &str, txn: &str, spec: pb::StageSpec) -> Vec<u8> {
        let request = |kind| pb::PrepareRequest { kind: Some(kind) };
        let mut out = frame(&request(pb::prepare_request::Kind::Begin(
            self.begin(session, txn, spec),
        )));
        for (name, data) in self.block_tensors(&spec) {
            for (i, chunk) in data.chunks(CHUNK_BYTES).enumerate() {
                out.extend(frame(&request(pb::prepare_request::Kind::Chunk(
                    pb::TensorChunk {
                        name: name.clone(),
                        offset: (i * CHUNK_BYTES) as u64,
                        data: chunk.to_vec(),
                    },
                ))));
            }
        }
        out.extend(frame(&request(pb::prepare_request::Kind::End(
            pb::PrepareEnd {},
        ))));
        out
    }
}
