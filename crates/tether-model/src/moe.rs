//! Mixture-of-experts layers: their hyper-parameters as llama.cpp writes them into GGUF
//! metadata, and their tensors.
//!
//! Keys (`{arch}` is `general.architecture`): `{arch}.expert_count` (experts per layer),
//! `{arch}.expert_used_count` (experts per token), `{arch}.expert_feed_forward_length`
//! (each expert's hidden width; Mixtral files give it as `feed_forward_length`) and
//! `{arch}.expert_weights_norm` (whether the chosen experts' weights are renormalized to
//! sum to 1; llama.cpp renormalizes for qwen3moe and for Mixtral whatever the key says,
//! and no converter writes it for them, so tether defaults to true and honours the key
//! when present).

use tether_compute::moe::{MAX_EXPERTS, MAX_EXPERTS_USED, MoeRouting};

use crate::arch::{Arch, TensorRole, TensorSpec, layer_tensor, spec};
use crate::error::ModelError;

/// Router: `[n_embd, n_expert]`, one score per expert.
pub const ROUTER: &str = "ffn_gate_inp.weight";
/// Stacked gate matrices: `[n_embd, n_ff_exp, n_expert]`.
pub const GATE_EXPS: &str = "ffn_gate_exps.weight";
/// Stacked up matrices: `[n_embd, n_ff_exp, n_expert]`.
pub const UP_EXPS: &str = "ffn_up_exps.weight";
/// Stacked down matrices: `[n_ff_exp, n_embd, n_expert]`.
pub const DOWN_EXPS: &str = "ffn_down_exps.weight";

/// The mixture-of-experts shape of a model's feed-forward layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    /// Experts per layer (`expert_count`).
    pub n_expert: usize,
    /// Experts each token uses (`expert_used_count`).
    pub n_used: usize,
    /// Hidden width of each expert.
    pub n_ff_exp: usize,
    /// Whether the chosen experts' weights are divided by their sum.
    pub norm_weights: bool,
}

impl MoeConfig {
    /// The routing the backend ops take.
    pub fn routing(&self) -> MoeRouting {
        MoeRouting {
            n_expert: self.n_expert,
            n_used: self.n_used,
            norm_weights: self.norm_weights,
        }
    }
}

/// The metadata values a MoE configuration is read from (`None`: key absent).
pub(crate) struct MoeKeys {
    pub expert_count: Option<usize>,
    pub expert_used_count: Option<usize>,
    pub expert_feed_forward_length: Option<usize>,
    pub feed_forward_length: usize,
    pub expert_weights_norm: Option<bool>,
}

/// The MoE configuration of an `arch` file with `keys`, `None` for a dense model, or an
/// error naming the key that is wrong.
pub(crate) fn read(arch: Arch, keys: MoeKeys) -> Result<Option<MoeConfig>, ModelError> {
    let key = |k: &str| format!("{}.{k}", arch.name());
    let bad = |k: &str, problem: String| ModelError::Metadata {
        arch: arch.name().into(),
        key: key(k),
        problem,
    };
    let n_expert = match keys.expert_count {
        None | Some(0) if arch.always_moe() => {
            return Err(bad(
                "expert_count",
                format!(
                    "is {}; a {} model has experts in every layer",
                    keys.expert_count
                        .map_or("missing".into(), |n| n.to_string()),
                    arch.name()
                ),
            ));
        }
        None | Some(0) => return Ok(None),
        Some(n) if n > MAX_EXPERTS => {
            return Err(bad(
                "expert_count",
                format!("is {n}; at most {MAX_EXPERTS} experts a layer are supported"),
            ));
        }
        Some(n) => n,
    };
    let n_used = keys
        .expert_used_count
        .ok_or_else(|| bad("expert_used_count", "is missing".into()))?;
    if n_used == 0 || n_used > n_expert || n_used > MAX_EXPERTS_USED {
        return Err(bad(
            "expert_used_count",
            format!(
                "is {n_used}; it must be 1 to expert_count ({n_expert}) and at most \
                 {MAX_EXPERTS_USED}"
            ),
        ));
    }
    let n_ff_exp = keys
        .expert_feed_forward_length
        .unwrap_or(keys.feed_forward_length);
    if n_ff_exp == 0 {
        return Err(bad(
            "expert_feed_forward_length",
            "is 0 (or absent with feed_forward_length 0); experts need a hidden width".into(),
        ));
    }
    Ok(Some(MoeConfig {
        n_expert,
        n_used,
        n_ff_exp,
        norm_weights: keys.expert_weights_norm.unwrap_or(true),
    }))
}

/// The feed-forward tensors of MoE layer `layer` of a model `n_embd` wide.
pub(crate) fn expert_tensors(n_embd: usize, moe: &MoeConfig, layer: usize) -> Vec<TensorSpec> {
    let (e, ff, n) = (n_embd, moe.n_ff_exp, moe.n_expert);
    let name = |s: &str| layer_tensor(layer, s);
    vec![
        spec(name(ROUTER), &[e, n], TensorRole::Matrix),
        spec(name(GATE_EXPS), &[e, ff, n], TensorRole::Matrix),
        spec(name(UP_EXPS), &[e, ff, n], TensorRole::Matrix),
        spec(name(DOWN_EXPS), &[ff, e, n], TensorRole::Matrix),
    ]
}
