//! [`ModelConfig`]: the hyper-parameters of a LLaMA-family model, read from GGUF metadata.

use tether_compute::RopeParams;
use tether_gguf::GgufFile;

use crate::arch::{Arch, TOKEN_EMBD};
use crate::error::ModelError;

/// Everything the forward pass needs to know about a model's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The architecture (decides rope style and biases).
    pub arch: Arch,
    /// Width of the residual stream (`embedding_length`).
    pub n_embd: usize,
    /// Number of transformer blocks (`block_count`).
    pub n_layer: usize,
    /// Hidden width of the feed-forward network (`feed_forward_length`).
    pub n_ff: usize,
    /// Query heads (`attention.head_count`).
    pub n_head: usize,
    /// Key/value heads (`attention.head_count_kv`, default `n_head`).
    pub n_head_kv: usize,
    /// Elements per head of Q, K and V: `attention.key_length` when the file has it (Qwen3's
    /// heads are wider than `n_embd / n_head`), else `n_embd / n_head`.
    pub head_dim: usize,
    /// Epsilon of the RMS norms (`attention.layer_norm_rms_epsilon`).
    pub rms_eps: f32,
    /// Rotary embedding parameters.
    pub rope: RopeParams,
    /// Context length the model was trained for (`context_length`).
    pub n_ctx_train: usize,
    /// Vocabulary size (rows of `token_embd.weight`).
    pub n_vocab: usize,
    /// True when the file has no `output.weight` and the head reuses `token_embd.weight`.
    pub tied_output: bool,
    /// True when the file has `rope_freqs.weight` (llama3-style rope scaling factors).
    pub has_rope_freqs: bool,
}

impl ModelConfig {
    /// Width of one token's keys (or values): `n_head_kv · head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Width of one token's queries: `n_head · head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Reads the hyper-parameters of `file` and checks every tensor's shape against them.
    pub fn from_gguf(file: &GgufFile) -> Result<ModelConfig, ModelError> {
        let arch_name =
            file.get_str("general.architecture")
                .ok_or_else(|| ModelError::Metadata {
                    arch: "?".into(),
                    key: "general.architecture".into(),
                    problem: "is missing or not a string".into(),
                })?;
        let arch = Arch::from_name(arch_name)
            .ok_or_else(|| ModelError::UnsupportedArchitecture(arch_name.to_string()))?;
        let meta = Meta { file, arch };
        let n_embd = meta.usize_req("embedding_length")?;
        let n_head = meta.usize_req("attention.head_count")?;
        let head_dim = head_dim(&meta, n_embd, n_head)?;
        let n_head_kv = meta.usize_opt("attention.head_count_kv")?.unwrap_or(n_head);
        if n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
            return Err(ModelError::Config(format!(
                "head_count {n_head} is not a multiple of head_count_kv {n_head_kv}"
            )));
        }
        let n_rot = meta.usize_opt("rope.dimension_count")?.unwrap_or(head_dim);
        if n_rot > head_dim || !n_rot.is_multiple_of(2) {
            return Err(ModelError::Config(format!(
                "rope.dimension_count {n_rot} must be even and at most head_dim {head_dim}"
            )));
        }
        let freq_scale = match file.get_str(&meta.key("rope.scaling.type")) {
            None | Some("none") => 1.0,
            Some("linear") => {
                let factor = file
                    .get_f32(&meta.key("rope.scaling.factor"))
                    .unwrap_or(1.0);
                if !(factor.is_finite() && factor > 0.0) {
                    return Err(ModelError::Config(format!(
                        "rope.scaling.factor {factor} must be a positive number"
                    )));
                }
                1.0 / factor
            }
            // llama3-style scaling lives in rope_freqs.weight; yarn etc. are not implemented.
            Some("llama3") => 1.0,
            Some(other) => {
                return Err(ModelError::Config(format!(
                    "rope.scaling.type '{other}' is not supported (only none, linear)"
                )));
            }
        };
        let embd = file
            .tensor(TOKEN_EMBD)
            .ok_or_else(|| ModelError::MissingTensor(TOKEN_EMBD.into()))?;
        let n_vocab = match embd.dims.as_slice() {
            [_, v] => usize::try_from(*v).map_err(|_| {
                ModelError::Config(format!("vocabulary of {v} tokens is too large"))
            })?,
            other => {
                return Err(ModelError::TensorShape {
                    name: TOKEN_EMBD.into(),
                    expected: vec![n_embd as u64, 0],
                    actual: other.to_vec(),
                });
            }
        };
        let cfg = ModelConfig {
            arch,
            n_embd,
            n_layer: meta.usize_req("block_count")?,
            n_ff: meta.usize_req("feed_forward_length")?,
            n_head,
            n_head_kv,
            head_dim,
            rms_eps: meta.f32_req("attention.layer_norm_rms_epsilon")?,
            rope: RopeParams {
                n_rot,
                freq_base: file.get_f32(&meta.key("rope.freq_base")).unwrap_or(10000.0),
                freq_scale,
                neox: arch.rope_neox(),
            },
            n_ctx_train: meta.usize_opt("context_length")?.unwrap_or(4096),
            n_vocab,
            tied_output: file.tensor(crate::arch::OUTPUT).is_none(),
            has_rope_freqs: file.tensor(crate::arch::ROPE_FREQS).is_some(),
        };
        // Every block has tensors of its own: a block count beyond the tensor count is a
        // corrupt header, and checking lists of expected tensors for it would be sized by
        // that one number.
        if cfg.n_layer > file.tensors().len() {
            return Err(meta.err(
                "block_count",
                &format!(
                    "is {} but the file has only {} tensors",
                    cfg.n_layer,
                    file.tensors().len()
                ),
            ));
        }
        crate::arch::validate_tensors(&cfg, file.tensors())?;
        Ok(cfg)
    }
}

/// The widest head a file may declare (real models use up to 256).
const MAX_HEAD_DIM: usize = 4096;

/// Elements per head: `attention.key_length`, which must equal `attention.value_length`
/// (the attention reads one head width), or `n_embd / n_head` when the file gives neither.
fn head_dim(meta: &Meta<'_>, n_embd: usize, n_head: usize) -> Result<usize, ModelError> {
    if n_head == 0 || n_embd == 0 {
        return Err(ModelError::Config(format!(
            "embedding_length {n_embd} and head_count {n_head} must both be positive"
        )));
    }
    let key = meta.usize_opt("attention.key_length")?;
    let value = meta.usize_opt("attention.value_length")?;
    match (key, value) {
        (None, None) if n_embd.is_multiple_of(n_head) => Ok(n_embd / n_head),
        (None, None) => Err(ModelError::Config(format!(
            "embedding_length {n_embd} is not a multiple of head_count {n_head} and the file \
             gives no attention.key_length"
        ))),
        (Some(k), v) if v.is_none_or(|v| v == k) => {
            // Bounded so that every width derived from it (`n_head · head_dim`) fits.
            if k == 0 || !k.is_multiple_of(2) || k > MAX_HEAD_DIM {
                return Err(meta.err(
                    "attention.key_length",
                    &format!("is {k}; it must be even, positive and at most {MAX_HEAD_DIM}"),
                ));
            }
            if n_head.checked_mul(k).is_none_or(|q| q > u32::MAX as usize) {
                return Err(ModelError::Config(format!(
                    "head_count {n_head} heads of {k} elements are too wide a query"
                )));
            }
            Ok(k)
        }
        (k, v) => Err(ModelError::Config(format!(
            "attention.key_length {k:?} and attention.value_length {v:?} differ: heads whose \
             keys and values have different widths are not supported"
        ))),
    }
}

/// Reads `{arch}.*` keys with errors that name the key.
struct Meta<'a> {
    file: &'a GgufFile,
    arch: Arch,
}

impl Meta<'_> {
    fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch.name())
    }

    fn err(&self, suffix: &str, problem: &str) -> ModelError {
        ModelError::Metadata {
            arch: self.arch.name().into(),
            key: self.key(suffix),
            problem: problem.into(),
        }
    }

    fn usize_opt(&self, suffix: &str) -> Result<Option<usize>, ModelError> {
        let key = self.key(suffix);
        match self.file.get(&key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| self.err(suffix, "is not a non-negative integer")),
        }
    }

    fn usize_req(&self, suffix: &str) -> Result<usize, ModelError> {
        self.usize_opt(suffix)?
            .ok_or_else(|| self.err(suffix, "is missing"))
    }

    fn f32_req(&self, suffix: &str) -> Result<f32, ModelError> {
        self.file
            .get_f32(&self.key(suffix))
            .ok_or_else(|| self.err(suffix, "is missing or not a number"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_gguf::{GgmlType, GgufWriter, MetaValue};

    /// A header-only llama/qwen2 file with `extra` metadata and a 8×32 embedding.
    fn file(arch: &str, extra: &[(&str, MetaValue)]) -> GgufFile {
        file_with_blocks(arch, 0, extra)
    }

    fn file_with_blocks(arch: &str, blocks: u32, extra: &[(&str, MetaValue)]) -> GgufFile {
        let mut w = GgufWriter::new();
        w.add_metadata("general.architecture", MetaValue::String(arch.into()));
        for (k, v) in [
            ("embedding_length", MetaValue::U32(8)),
            ("block_count", MetaValue::U32(blocks)),
            ("feed_forward_length", MetaValue::U32(16)),
            ("attention.head_count", MetaValue::U32(2)),
            ("attention.layer_norm_rms_epsilon", MetaValue::F32(1e-6)),
        ] {
            w.add_metadata(format!("{arch}.{k}"), v);
        }
        for (k, v) in extra {
            w.add_metadata(format!("{arch}.{k}"), v.clone());
        }
        w.add_tensor(TOKEN_EMBD, GgmlType::F32, &[8, 32], vec![0; 8 * 32 * 4])
            .unwrap();
        w.add_tensor("output_norm.weight", GgmlType::F32, &[8], vec![0; 32])
            .unwrap();
        let mut bytes = Vec::new();
        w.write_to(&mut bytes, "test").unwrap();
        GgufFile::from_bytes("test", bytes).unwrap()
    }

    #[test]
    fn defaults_and_derived_values() {
        let cfg = ModelConfig::from_gguf(&file("llama", &[])).unwrap();
        assert_eq!((cfg.head_dim, cfg.n_head_kv, cfg.n_vocab), (4, 2, 32));
        assert_eq!(cfg.rope.n_rot, 4);
        assert_eq!(cfg.rope.freq_base, 10000.0);
        assert!(cfg.tied_output && !cfg.rope.neox);
        let cfg = ModelConfig::from_gguf(&file(
            "qwen2",
            &[
                ("rope.scaling.type", MetaValue::String("linear".into())),
                ("rope.scaling.factor", MetaValue::F32(4.0)),
                ("attention.head_count_kv", MetaValue::U32(1)),
            ],
        ))
        .unwrap();
        assert_eq!(cfg.rope.freq_scale, 0.25);
        assert!(cfg.rope.neox);
        assert_eq!(cfg.kv_dim(), 4);
    }

    #[test]
    fn key_length_sets_head_dim_apart_from_the_embedding() {
        let cfg = ModelConfig::from_gguf(&file(
            "qwen3",
            &[
                ("attention.key_length", MetaValue::U32(16)),
                ("attention.value_length", MetaValue::U32(16)),
                ("attention.head_count_kv", MetaValue::U32(1)),
            ],
        ))
        .unwrap();
        assert_eq!((cfg.head_dim, cfg.q_dim(), cfg.kv_dim()), (16, 32, 16));
        assert_eq!(cfg.rope.n_rot, 16);
        assert!(cfg.rope.neox);
        let err = ModelConfig::from_gguf(&file(
            "qwen3",
            &[
                ("attention.key_length", MetaValue::U32(16)),
                ("attention.value_length", MetaValue::U32(8)),
            ],
        ))
        .unwrap_err();
        assert!(err.to_string().contains("value_length"), "{err}");
    }

    #[test]
    fn a_block_count_beyond_the_tensors_is_refused_before_listing_them() {
        // Found by fuzzing: a mutated count made the tensor check list 5 GB of specs.
        let err = ModelConfig::from_gguf(&file_with_blocks("llama", u32::MAX, &[])).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("block_count") && msg.contains("only 2 tensors"),
            "{msg}"
        );
    }

    #[test]
    fn errors_name_what_is_wrong() {
        let err = ModelConfig::from_gguf(&file("gemma", &[])).unwrap_err();
        assert!(err.to_string().contains("'gemma'"), "{err}");
        let err = ModelConfig::from_gguf(&file(
            "llama",
            &[("attention.head_count_kv", MetaValue::U32(3))],
        ))
        .unwrap_err();
        assert!(err.to_string().contains("head_count_kv 3"), "{err}");
        let err = ModelConfig::from_gguf(&file(
            "llama",
            &[("embedding_length", MetaValue::String("x".into()))],
        ))
        .unwrap_err();
        assert!(err.to_string().contains("llama.embedding_length"), "{err}");
    }
}
