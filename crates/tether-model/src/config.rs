//! [`ModelConfig`]: the hyper-parameters of a LLaMA-family model, read from GGUF metadata.

use tether_compute::RopeParams;
use tether_gguf::GgufFile;

use crate::arch::{Arch, TOKEN_EMBD};
use crate::config_extras::{ArchExtras, rope_scaling};
use crate::error::ModelError;
use crate::moe::{self, MoeConfig, MoeKeys};

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
    /// Sliding-window layers' attention span in positions (`attention.sliding_window`);
    /// `None` when every layer attends to the whole context.
    pub sliding_window: Option<usize>,
    /// Rotary embedding of the sliding-window layers (Gemma 3 gives them their own base).
    pub rope_swa: RopeParams,
    /// Softmax scale of the attention scores.
    pub attn_scale: f32,
    /// Embeddings are multiplied by this (Gemma: `sqrt(n_embd)`).
    pub embed_scale: Option<f32>,
    /// Logits become `cap · tanh(logits / cap)` (`final_logit_softcapping`).
    pub final_softcap: Option<f32>,
    /// Scaled attention scores become `cap · tanh(score / cap)` (`attn_logit_softcapping`).
    pub attn_softcap: Option<f32>,
    /// The experts of every layer's feed-forward; `None` for a dense model.
    pub moe: Option<MoeConfig>,
}

/// Most context cells per sequence when none is asked for: `tether run`, `tether plan` and
/// the coordinator all cap the training context at this ([`ModelConfig::default_context`]).
pub const DEFAULT_CTX_CAP: usize = 4096;

impl ModelConfig {
    /// Context per sequence when none is asked for: the training context, at most
    /// [`DEFAULT_CTX_CAP`] (and at least 1).
    pub fn default_context(&self) -> usize {
        self.n_ctx_train.clamp(1, DEFAULT_CTX_CAP)
    }

    /// Width of one token's keys (or values): `n_head_kv · head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Width of one token's queries: `n_head · head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Whether layer `layer` attends through the sliding window rather than to the whole
    /// context.
    pub fn is_sliding(&self, layer: usize) -> bool {
        match (self.sliding_window, self.arch.traits().swa_period) {
            (Some(_), Some(period)) => layer % period != period - 1,
            _ => false,
        }
    }

    /// The rotary embedding of layer `layer`.
    pub fn layer_rope(&self, layer: usize) -> &RopeParams {
        if self.is_sliding(layer) {
            &self.rope_swa
        } else {
            &self.rope
        }
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
        let (freq_scale, yarn) = rope_scaling(&meta)?;
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
        let traits = arch.traits();
        let extras = ArchExtras::read(&meta, n_embd, n_head, head_dim)?;
        let rope = RopeParams {
            n_rot,
            freq_base: file.get_f32(&meta.key("rope.freq_base")).unwrap_or(10000.0),
            freq_scale,
            neox: arch.rope_neox(),
            yarn,
        };
        let rope_swa = match traits.swa_rope_base {
            Some(base) => RopeParams {
                freq_base: base,
                freq_scale: 1.0,
                yarn: None,
                ..rope
            },
            None => rope,
        };
        let long_rope = [
            crate::arch::ROPE_FACTORS_LONG,
            crate::arch::ROPE_FACTORS_SHORT,
        ];
        if let Some(name) = long_rope.into_iter().find(|n| file.tensor(n).is_some()) {
            return Err(ModelError::Config(format!(
                "the file has {name} (LongRoPE, Phi-3's 128k-context variants), which is not \
                 supported: use the 4k-context variant"
            )));
        }
        let n_ff = meta.usize_req("feed_forward_length")?;
        let moe = moe::read(
            arch,
            MoeKeys {
                expert_count: meta.usize_opt("expert_count")?,
                expert_used_count: meta.usize_opt("expert_used_count")?,
                expert_feed_forward_length: meta.usize_opt("expert_feed_forward_length")?,
                feed_forward_length: n_ff,
                expert_weights_norm: meta.bool_opt("expert_weights_norm")?,
            },
        )?;
        let cfg = ModelConfig {
            moe,
            sliding_window: extras.sliding_window,
            rope_swa,
            attn_scale: extras.attn_scale,
            embed_scale: extras.embed_scale,
            final_softcap: extras.final_softcap,
            attn_softcap: extras.attn_softcap,
            arch,
            n_embd,
            n_layer: meta.usize_req("block_count")?,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            rms_eps: meta.f32_req("attention.layer_norm_rms_epsilon")?,
            rope,
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
pub(crate) struct Meta<'a> {
    pub(crate) file: &'a GgufFile,
    pub(crate) arch: Arch,
}

impl Meta<'_> {
    pub(crate) fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch.name())
    }

    pub(crate) fn err(&self, suffix: &str, problem: &str) -> ModelError {
        ModelError::Metadata {
            arch: self.arch.name().into(),
            key: self.key(suffix),
            problem: problem.into(),
        }
    }

    pub(crate) fn usize_opt(&self, suffix: &str) -> Result<Option<usize>, ModelError> {
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

    fn bool_opt(&self, suffix: &str) -> Result<Option<bool>, ModelError> {
        match self.file.get(&self.key(suffix)) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(suffix, "is not a boolean")),
        }
    }

    pub(crate) fn usize_req(&self, suffix: &str) -> Result<usize, ModelError> {
        self.usize_opt(suffix)?
            .ok_or_else(|| self.err(suffix, "is missing"))
    }

    pub(crate) fn f32_req(&self, suffix: &str) -> Result<f32, ModelError> {
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

    fn gemma3_keys(window: Option<u32>) -> Vec<(&'static str, MetaValue)> {
        let mut keys = vec![
            ("attention.key_length", MetaValue::U32(16)),
            ("attention.value_length", MetaValue::U32(16)),
            ("rope.freq_base", MetaValue::F32(1e6)),
            ("rope.scaling.type", MetaValue::String("linear".into())),
            ("rope.scaling.factor", MetaValue::F32(8.0)),
        ];
        if let Some(w) = window {
            keys.push(("attention.sliding_window", MetaValue::U32(w)));
        }
        keys
    }

    #[test]
    fn gemma3_reads_windows_two_ropes_and_scales() {
        let cfg = ModelConfig::from_gguf(&file("gemma3", &gemma3_keys(Some(512)))).unwrap();
        assert_eq!(cfg.sliding_window, Some(512));
        assert_eq!((cfg.rope.freq_base, cfg.rope.freq_scale), (1e6, 0.125));
        assert_eq!(
            (cfg.rope_swa.freq_base, cfg.rope_swa.freq_scale),
            (10000.0, 1.0)
        );
        assert!(cfg.rope.neox && cfg.rope_swa.neox);
        assert_eq!(cfg.attn_scale, 0.25, "1/sqrt(key_length 16)");
        assert_eq!(cfg.embed_scale, Some(8f32.sqrt()));
        assert_eq!(cfg.final_softcap, None);
        let global: Vec<usize> = (0..14).filter(|&l| !cfg.is_sliding(l)).collect();
        assert_eq!(global, [5, 11]);
        assert_eq!(cfg.layer_rope(5).freq_base, 1e6);
        assert_eq!(cfg.layer_rope(4).freq_base, 10000.0);
        // llama has no windows and one rope.
        let cfg = ModelConfig::from_gguf(&file("llama", &[])).unwrap();
        assert!(!cfg.is_sliding(0) && cfg.sliding_window.is_none());
        assert_eq!(cfg.attn_scale, 0.5);
    }

    #[test]
    fn bad_gemma3_and_phi3_metadata_is_refused_by_name() {
        let err = ModelConfig::from_gguf(&file("gemma3", &gemma3_keys(None))).unwrap_err();
        assert!(
            err.to_string().contains("gemma3.attention.sliding_window")
                && err.to_string().contains("missing"),
            "{err}"
        );
        let err = ModelConfig::from_gguf(&file("gemma3", &gemma3_keys(Some(0)))).unwrap_err();
        assert!(err.to_string().contains("sliding_window"), "{err}");
        let mut keys = gemma3_keys(Some(4));
        keys.push(("attn_logit_softcapping", MetaValue::F32(0.0)));
        let err = ModelConfig::from_gguf(&file("gemma3", &keys)).unwrap_err();
        assert!(
            err.to_string().contains("gemma3.attn_logit_softcapping"),
            "{err}"
        );
        let mut keys = gemma3_keys(Some(4));
        keys.push(("attn_logit_softcapping", MetaValue::F32(50.0)));
        let cfg = ModelConfig::from_gguf(&file("gemma2", &keys)).unwrap();
        assert_eq!(cfg.attn_softcap, Some(50.0));
        // Gemma 2: every other layer slides, one rope for all.
        assert!(cfg.is_sliding(0) && !cfg.is_sliding(1) && cfg.is_sliding(2));
        assert_eq!(cfg.rope_swa, cfg.rope);
        let mut keys = gemma3_keys(Some(4));
        keys.push(("final_logit_softcapping", MetaValue::F32(-1.0)));
        let err = ModelConfig::from_gguf(&file("gemma3", &keys)).unwrap_err();
        assert!(err.to_string().contains("final_logit_softcapping"), "{err}");
        let mut keys = gemma3_keys(Some(4));
        keys.push(("final_logit_softcapping", MetaValue::F32(30.0)));
        let cfg = ModelConfig::from_gguf(&file("gemma3", &keys)).unwrap();
        assert_eq!(cfg.final_softcap, Some(30.0));
        // Phi-3's 128k variants carry LongRoPE factors.
        let mut w = GgufWriter::new();
        w.add_metadata("general.architecture", MetaValue::String("phi3".into()));
        for (k, v) in [
            ("embedding_length", MetaValue::U32(8)),
            ("block_count", MetaValue::U32(0)),
            ("feed_forward_length", MetaValue::U32(16)),
            ("attention.head_count", MetaValue::U32(2)),
            ("attention.layer_norm_rms_epsilon", MetaValue::F32(1e-5)),
        ] {
            w.add_metadata(format!("phi3.{k}"), v);
        }
        w.add_tensor(TOKEN_EMBD, GgmlType::F32, &[8, 32], vec![0; 8 * 32 * 4])
            .unwrap();
        w.add_tensor("rope_factors_long.weight", GgmlType::F32, &[2], vec![0; 8])
            .unwrap();
        let mut bytes = Vec::new();
        w.write_to(&mut bytes, "test").unwrap();
        let f = GgufFile::from_bytes("test", bytes).unwrap();
        let err = ModelConfig::from_gguf(&f).unwrap_err();
        assert!(err.to_string().contains("LongRoPE"), "{err}");
    }

    #[test]
    fn yarn_scaling_is_read_and_bad_values_refused() {
        let yarn = |extra: &[(&'static str, MetaValue)]| {
            let mut keys = vec![
                ("rope.scaling.type", MetaValue::String("yarn".into())),
                ("rope.scaling.factor", MetaValue::F32(4.0)),
                (
                    "rope.scaling.original_context_length",
                    MetaValue::U32(32768),
                ),
            ];
            keys.extend(extra.iter().cloned());
            ModelConfig::from_gguf(&file("qwen3", &keys))
        };
        let cfg = yarn(&[]).unwrap();
        assert_eq!(cfg.rope.freq_scale, 0.25);
        let y = cfg.rope.yarn.unwrap();
        assert_eq!(
            (y.orig_ctx, y.beta_fast, y.beta_slow, y.attn_factor),
            (32768, 32.0, 1.0, 1.0)
        );
        let cfg = yarn(&[("rope.scaling.attn_factor", MetaValue::F32(0.5))]).unwrap();
        assert_eq!(cfg.rope.yarn.unwrap().attn_factor, 0.5);
        for (key, bad) in [
            ("rope.scaling.original_context_length", MetaValue::U32(0)),
            ("rope.scaling.factor", MetaValue::F32(-2.0)),
            ("rope.scaling.yarn_beta_fast", MetaValue::F32(f32::NAN)),
        ] {
            let err = yarn(&[(key, bad)]).unwrap_err().to_string();
            assert!(err.contains(key), "{key}: {err}");
        }
        let err = ModelConfig::from_gguf(&file(
            "qwen3",
            &[("rope.scaling.type", MetaValue::String("yarn".into()))],
        ))
        .unwrap_err();
        assert!(err.to_string().contains("original_context_length"), "{err}");
        let err = ModelConfig::from_gguf(&file(
            "qwen3",
            &[("rope.scaling.type", MetaValue::String("longrope".into()))],
        ))
        .unwrap_err();
        assert!(err.to_string().contains("'longrope'"), "{err}");
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
