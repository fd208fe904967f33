//! Architectures and llama.cpp's GGUF tensor names, with the shape each tensor must have.

use tether_gguf::{GgmlType, TensorInfo};

use crate::config::ModelConfig;
use crate::error::ModelError;

/// Token embedding table, `[n_embd, n_vocab]`.
pub const TOKEN_EMBD: &str = "token_embd.weight";
/// Final RMS norm weight, `[n_embd]`.
pub const OUTPUT_NORM: &str = "output_norm.weight";
/// Output head, `[n_embd, n_vocab]`; absent when tied to the embedding.
pub const OUTPUT: &str = "output.weight";
/// llama3 rope frequency factors, `[n_rot / 2]` (optional).
pub const ROPE_FREQS: &str = "rope_freqs.weight";
/// Phi-3's fused Q/K/V projection (per layer), `[n_embd, q_dim + 2 · kv_dim]`.
pub const ATTN_QKV: &str = "attn_qkv.weight";
/// Gemma's norm of the attention output (per layer), `[n_embd]`.
pub const POST_ATTN_NORM: &str = "post_attention_norm.weight";
/// Gemma's norm of the feed-forward output (per layer), `[n_embd]`.
pub const POST_FFW_NORM: &str = "post_ffw_norm.weight";
/// Phi-3 LongRoPE factors (128k variants), which this crate does not implement.
pub const ROPE_FACTORS_LONG: &str = "rope_factors_long.weight";
/// Phi-3 LongRoPE factors for short contexts (128k variants), not implemented either.
pub const ROPE_FACTORS_SHORT: &str = "rope_factors_short.weight";

/// A model architecture this crate runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// LLaMA 1/2/3 and look-alikes: normal rope, no biases.
    Llama,
    /// Qwen2 / Qwen2.5: NEOX rope, biases on Q, K and V.
    Qwen2,
    /// Dense Qwen3: NEOX rope, no biases, a per-head RMS norm on Q and on K before rope;
    /// heads may be wider than `n_embd / n_head`.
    Qwen3,
    /// Gemma 3 (text): scaled embeddings, GELU-gated feed-forward, norms after attention
    /// and feed-forward, Q/K norms, five sliding-window layers to one global.
    Gemma3,
    /// Gemma 2: Gemma 3's layer without Q/K norms, sliding-window layers alternating with
    /// global ones (one rope), attention and final logits soft-capped.
    Gemma2,
    /// Phi-3: LLaMA's layer with Q, K and V in one matrix and gate and up in another.
    Phi3,
    /// Qwen3-MoE: Qwen3's attention with a mixture-of-experts feed-forward in every layer.
    Qwen3Moe,
}

/// How an architecture's layer differs from LLaMA's, as data: the forward pass, the tensor
/// list and the config read these flags instead of matching on [`Arch`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ArchTraits {
    /// Rope rotates pairs `(i, i + n_rot/2)` (NEOX) rather than `(2i, 2i+1)`.
    pub rope_neox: bool,
    /// Biases on Q, K and V.
    pub qkv_bias: bool,
    /// Per-head RMS norms of Q and K (`attn_q_norm`, `attn_k_norm`) before rope.
    pub qk_norm: bool,
    /// The feed-forward gate is GELU (tanh approximation) rather than SiLU.
    pub gelu_gate: bool,
    /// RMS norms of the attention output and the feed-forward output before each residual
    /// add (`post_attention_norm`, `post_ffw_norm`).
    pub post_norms: bool,
    /// Embeddings are multiplied by `sqrt(n_embd)`.
    pub scaled_embedding: bool,
    /// Q, K and V in one matrix `attn_qkv` (rows: Q, then K, then V).
    pub fused_qkv: bool,
    /// Gate and up in one matrix `ffn_up` of `2 · n_ff` rows (gate first), no `ffn_gate`.
    pub fused_gate_up: bool,
    /// Layers come in groups of this many: the last of each attends to the whole context,
    /// the others through `attention.sliding_window`. `None`: every layer is global.
    pub swa_period: Option<usize>,
    /// Rope base of the sliding-window layers (which also take no rope scaling); `None`:
    /// the file's `rope.freq_base`.
    pub swa_rope_base: Option<f32>,
    /// Layer count of the variant whose attention scale is `1/sqrt(n_embd / n_head)`
    /// rather than `1/sqrt(head_dim)` (Gemma's 27B sets `query_pre_attn_scalar` so, and
    /// GGUF files do not record it; llama.cpp recognizes the variant the same way).
    pub embd_scaled_query_at_layers: Option<usize>,
    /// Every layer's feed-forward is a mixture of experts whatever the metadata says
    /// (`llama` files are MoE, Mixtral, only when they give `expert_count`).
    pub always_moe: bool,
}

const LLAMA_TRAITS: ArchTraits = ArchTraits {
    rope_neox: false,
    qkv_bias: false,
    qk_norm: false,
    gelu_gate: false,
    post_norms: false,
    scaled_embedding: false,
    fused_qkv: false,
    fused_gate_up: false,
    swa_period: None,
    swa_rope_base: None,
    embd_scaled_query_at_layers: None,
    always_moe: false,
};

impl Arch {
    /// The architecture called `name` in `general.architecture`.
    pub fn from_name(name: &str) -> Option<Arch> {
        match name {
            "llama" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            "gemma3" => Some(Arch::Gemma3),
            "gemma2" => Some(Arch::Gemma2),
            "phi3" => Some(Arch::Phi3),
            "qwen3moe" => Some(Arch::Qwen3Moe),
            _ => None,
        }
    }

    /// The `general.architecture` name (also the prefix of its metadata keys).
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
            Arch::Gemma2 => "gemma2",
            Arch::Phi3 => "phi3",
            Arch::Qwen3Moe => "qwen3moe",
        }
    }

    /// How its layers differ from LLaMA's.
    pub fn traits(self) -> ArchTraits {
        match self {
            Arch::Llama => LLAMA_TRAITS,
            Arch::Qwen2 => ArchTraits {
                rope_neox: true,
                qkv_bias: true,
                ..LLAMA_TRAITS
            },
            Arch::Qwen3 => ArchTraits {
                rope_neox: true,
                qk_norm: true,
                ..LLAMA_TRAITS
            },
            // HF's Gemma3 text model: local layers use rope_local_base_freq 10000;
            // (layer + 1) % 6 == 0 is global; 27B (62 layers) has query_pre_attn_scalar =
            // hidden_size / heads.
            Arch::Gemma3 => ArchTraits {
                rope_neox: true,
                qk_norm: true,
                gelu_gate: true,
                post_norms: true,
                scaled_embedding: true,
                swa_period: Some(6),
                swa_rope_base: Some(10000.0),
                embd_scaled_query_at_layers: Some(62),
                ..LLAMA_TRAITS
            },
            // HF's Gemma2: even layers slide, odd ones are global; 27B (46 layers) has
            // query_pre_attn_scalar = hidden_size / heads.
            Arch::Gemma2 => ArchTraits {
                rope_neox: true,
                gelu_gate: true,
                post_norms: true,
                scaled_embedding: true,
                swa_period: Some(2),
                embd_scaled_query_at_layers: Some(46),
                ..LLAMA_TRAITS
            },
            // llama.cpp runs phi3 with NEOX rope (as HF's Phi3 rotates halves).
            Arch::Qwen3Moe => ArchTraits {
                rope_neox: true,
                qk_norm: true,
                always_moe: true,
                ..LLAMA_TRAITS
            },
            Arch::Phi3 => ArchTraits {
                rope_neox: true,
                fused_qkv: true,
                fused_gate_up: true,
                ..LLAMA_TRAITS
            },
        }
    }

    /// Whether rope rotates pairs `(i, i + n_rot/2)` (NEOX) rather than `(2i, 2i+1)`.
    pub fn rope_neox(self) -> bool {
        self.traits().rope_neox
    }

    /// Whether every layer has biases on Q, K and V.
    pub fn has_qkv_bias(self) -> bool {
        self.traits().qkv_bias
    }

    /// Whether every layer RMS-normalizes each head of Q and of K (`attn_q_norm`,
    /// `attn_k_norm`, `[head_dim]` each) after the projections and before rope.
    pub fn has_qk_norm(self) -> bool {
        self.traits().qk_norm
    }

    /// Whether every layer's feed-forward is a mixture of experts whatever the metadata
    /// says (see [`ArchTraits::always_moe`]).
    pub fn always_moe(self) -> bool {
        self.traits().always_moe
    }
}

/// What a tensor is for, which decides the types it may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorRole {
    /// A matrix used by `matmul` or `get_rows`: any type the backend multiplies.
    Matrix,
    /// A norm weight, bias or rope factor: read as plain f32.
    Vector,
}

/// One tensor a model (or a stage of it) needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// GGUF name.
    pub name: String,
    /// Dims in ggml order (`dims[0]` contiguous).
    pub dims: Vec<u64>,
    /// What it is used for.
    pub role: TensorRole,
}

/// Name of a per-layer tensor: `blk.{layer}.{suffix}`.
pub fn layer_tensor(layer: usize, suffix: &str) -> String {
    format!("blk.{layer}.{suffix}")
}

pub(crate) fn spec(name: String, dims: &[usize], role: TensorRole) -> TensorSpec {
    TensorSpec {
        name,
        dims: dims.iter().map(|&d| d as u64).collect(),
        role,
    }
}

/// The tensors of layer `layer`, in the order the forward pass uses them.
pub fn layer_tensors(cfg: &ModelConfig, layer: usize) -> Vec<TensorSpec> {
    use TensorRole::{Matrix, Vector};
    let (e, q, kv, ff) = (cfg.n_embd, cfg.q_dim(), cfg.kv_dim(), cfg.n_ff);
    let hd = cfg.head_dim;
    let n = |s: &str| layer_tensor(layer, s);
    let traits = cfg.arch.traits();
    let mut out = vec![spec(n("attn_norm.weight"), &[e], Vector)];
    if traits.fused_qkv {
        out.push(spec(n(ATTN_QKV), &[e, q + 2 * kv], Matrix));
    } else {
        out.extend([
            spec(n("attn_q.weight"), &[e, q], Matrix),
            spec(n("attn_k.weight"), &[e, kv], Matrix),
            spec(n("attn_v.weight"), &[e, kv], Matrix),
        ]);
    }
    if cfg.arch.has_qkv_bias() {
        out.push(spec(n("attn_q.bias"), &[q], Vector));
        out.push(spec(n("attn_k.bias"), &[kv], Vector));
        out.push(spec(n("attn_v.bias"), &[kv], Vector));
    }
    if cfg.arch.has_qk_norm() {
        out.push(spec(n("attn_q_norm.weight"), &[hd], Vector));
        out.push(spec(n("attn_k_norm.weight"), &[hd], Vector));
    }
    out.push(spec(n("attn_output.weight"), &[q, e], Matrix));
    if traits.post_norms {
        out.push(spec(n(POST_ATTN_NORM), &[e], Vector));
    }
    out.push(spec(n("ffn_norm.weight"), &[e], Vector));
    if let Some(moe) = &cfg.moe {
        out.extend(crate::moe::expert_tensors(e, moe, layer));
    } else if traits.fused_gate_up {
        out.push(spec(n("ffn_up.weight"), &[e, 2 * ff], Matrix));
    } else {
        out.extend([
            spec(n("ffn_gate.weight"), &[e, ff], Matrix),
            spec(n("ffn_up.weight"), &[e, ff], Matrix),
        ]);
    }
    if cfg.moe.is_none() {
        out.push(spec(n("ffn_down.weight"), &[ff, e], Matrix));
    }
    if traits.post_norms {
        out.push(spec(n(POST_FFW_NORM), &[e], Vector));
    }
    out
}

/// The tensors a stage of layers `[first, last)` needs, with the embedding and/or head.
pub fn stage_tensors(
    cfg: &ModelConfig,
    first: usize,
    last: usize,
    has_embed: bool,
    has_head: bool,
) -> Vec<TensorSpec> {
    use TensorRole::{Matrix, Vector};
    let mut out = Vec::new();
    if has_embed || (has_head && cfg.tied_output) {
        out.push(spec(TOKEN_EMBD.into(), &[cfg.n_embd, cfg.n_vocab], Matrix));
    }
    if cfg.has_rope_freqs && last > first {
        out.push(spec(ROPE_FREQS.into(), &[cfg.rope.n_rot / 2], Vector));
    }
    for layer in first..last {
        out.extend(layer_tensors(cfg, layer));
    }
    if has_head {
        out.push(spec(OUTPUT_NORM.into(), &[cfg.n_embd], Vector));
        if !cfg.tied_output {
            out.push(spec(OUTPUT.into(), &[cfg.n_embd, cfg.n_vocab], Matrix));
        }
    }
    out
}

/// The matrices a fused file tensor of layer weights holds, as consecutive blocks of rows
/// (label, rows): Phi-3's `attn_qkv` (Q, K, V) and `ffn_up` (gate, then up, as HF's
/// `gate_up_proj` chunks it). `None` for a tensor used as it is.
pub fn fused_parts(cfg: &ModelConfig, name: &str) -> Option<Vec<(&'static str, usize)>> {
    let traits = cfg.arch.traits();
    let layer_tensor = name.starts_with("blk.");
    if layer_tensor && traits.fused_qkv && name.ends_with(&format!(".{ATTN_QKV}")) {
        let (q, kv) = (cfg.q_dim(), cfg.kv_dim());
        return Some(vec![("q", q), ("k", kv), ("v", kv)]);
    }
    if layer_tensor && traits.fused_gate_up && name.ends_with(".ffn_up.weight") {
        return Some(vec![("gate", cfg.n_ff), ("up", cfg.n_ff)]);
    }
    None
}

/// The name of part `label` of fused tensor `name` (see [`fused_parts`]).
pub fn part_name(name: &str, label: &str) -> String {
    format!("{name}#{label}")
}

/// Checks that `t` exists with the dims and a type fitting `spec`.
pub fn check_tensor<'a>(
    spec: &TensorSpec,
    tensors: &'a [TensorInfo],
) -> Result<&'a TensorInfo, ModelError> {
    let t = tensors
        .iter()
        .find(|t| t.name == spec.name)
        .ok_or_else(|| ModelError::MissingTensor(spec.name.clone()))?;
    if t.dims != spec.dims {
        return Err(ModelError::TensorShape {
            name: t.name.clone(),
            expected: spec.dims.clone(),
            actual: t.dims.clone(),
        });
    }
    match spec.role {
        TensorRole::Vector if t.ty != GgmlType::F32 => Err(ModelError::TensorType {
            name: t.name.clone(),
            ty: t.ty,
            reason: "norm weights, biases and rope factors must be f32".into(),
        }),
        TensorRole::Matrix if matches!(t.ty, GgmlType::Q8_1 | GgmlType::Q8K) => {
            Err(ModelError::TensorType {
                name: t.name.clone(),
                ty: t.ty,
                reason: "this type is only an intermediate format, not a weight type".into(),
            })
        }
        _ => Ok(t),
    }
}

/// Checks every tensor of the whole model against `cfg`.
pub fn validate_tensors(cfg: &ModelConfig, tensors: &[TensorInfo]) -> Result<(), ModelError> {
    for s in stage_tensors(cfg, 0, cfg.n_layer, true, true) {
        check_tensor(&s, tensors)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_llama_cpp() {
        assert_eq!(layer_tensor(3, "attn_q.weight"), "blk.3.attn_q.weight");
        assert_eq!(Arch::from_name("qwen2"), Some(Arch::Qwen2));
        assert_eq!(Arch::from_name("gemma"), None);
        assert_eq!(Arch::from_name("gemma3"), Some(Arch::Gemma3));
        assert_eq!(Arch::from_name("phi3"), Some(Arch::Phi3));
        assert_eq!(Arch::from_name("gemma2"), Some(Arch::Gemma2));
        let g2 = Arch::Gemma2.traits();
        assert!(g2.post_norms && !g2.qk_norm && g2.swa_rope_base.is_none());
        let g = Arch::Gemma3.traits();
        assert!(g.rope_neox && g.qk_norm && g.post_norms && g.gelu_gate && g.scaled_embedding);
        assert_eq!(g.swa_period, Some(6));
        let p = Arch::Phi3.traits();
        assert!(p.fused_qkv && p.fused_gate_up && p.rope_neox && !p.post_norms);
        assert!(Arch::Qwen2.rope_neox() && !Arch::Llama.rope_neox());
        assert_eq!(Arch::from_name("qwen3"), Some(Arch::Qwen3));
        assert_eq!(Arch::from_name("qwen3moe"), Some(Arch::Qwen3Moe));
        assert!(Arch::Qwen3Moe.has_qk_norm() && Arch::Qwen3Moe.always_moe());
        assert!(Arch::Qwen3.rope_neox() && Arch::Qwen3.has_qk_norm());
        assert!(!Arch::Qwen3.has_qkv_bias() && !Arch::Qwen2.has_qk_norm());
    }
}
