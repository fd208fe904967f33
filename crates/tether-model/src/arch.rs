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
}

impl Arch {
    /// The architecture called `name` in `general.architecture`.
    pub fn from_name(name: &str) -> Option<Arch> {
        match name {
            "llama" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            _ => None,
        }
    }

    /// The `general.architecture` name (also the prefix of its metadata keys).
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }

    /// Whether rope rotates pairs `(i, i + n_rot/2)` (NEOX) rather than `(2i, 2i+1)`.
    pub fn rope_neox(self) -> bool {
        matches!(self, Arch::Qwen2 | Arch::Qwen3)
    }

    /// Whether every layer has biases on Q, K and V.
    pub fn has_qkv_bias(self) -> bool {
        matches!(self, Arch::Qwen2)
    }

    /// Whether every layer RMS-normalizes each head of Q and of K (`attn_q_norm`,
    /// `attn_k_norm`, `[head_dim]` each) after the projections and before rope.
    pub fn has_qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3)
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

fn spec(name: String, dims: &[usize], role: TensorRole) -> TensorSpec {
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
    let mut out = vec![
        spec(n("attn_norm.weight"), &[e], Vector),
        spec(n("attn_q.weight"), &[e, q], Matrix),
        spec(n("attn_k.weight"), &[e, kv], Matrix),
        spec(n("attn_v.weight"), &[e, kv], Matrix),
    ];
    if cfg.arch.has_qkv_bias() {
        out.push(spec(n("attn_q.bias"), &[q], Vector));
        out.push(spec(n("attn_k.bias"), &[kv], Vector));
        out.push(spec(n("attn_v.bias"), &[kv], Vector));
    }
    if cfg.arch.has_qk_norm() {
        out.push(spec(n("attn_q_norm.weight"), &[hd], Vector));
        out.push(spec(n("attn_k_norm.weight"), &[hd], Vector));
    }
    out.extend([
        spec(n("attn_output.weight"), &[q, e], Matrix),
        spec(n("ffn_norm.weight"), &[e], Vector),
        spec(n("ffn_gate.weight"), &[e, ff], Matrix),
        spec(n("ffn_up.weight"), &[e, ff], Matrix),
        spec(n("ffn_down.weight"), &[ff, e], Matrix),
    ]);
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
        assert!(Arch::Qwen2.rope_neox() && !Arch::Llama.rope_neox());
        assert_eq!(Arch::from_name("qwen3"), Some(Arch::Qwen3));
        assert_eq!(Arch::from_name("qwen3moe"), None);
        assert!(Arch::Qwen3.rope_neox() && Arch::Qwen3.has_qk_norm());
        assert!(!Arch::Qwen3.has_qkv_bias() && !Arch::Qwen2.has_qk_norm());
    }
}
