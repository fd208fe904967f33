//! Layer matrices of the architectures whose layers differ from LLaMA's in their tensors:
//! Phi-3's fused Q/K/V and gate/up matrices.

use tether_gguf::{GgmlType, GgufWriter};

use super::{MatrixRole, add_random};
use crate::error::ModelError;

/// Writes layer `l`'s matrices of a Phi-3 (`dims` = n_embd, q_dim, kv_dim, n_ff):
/// `attn_qkv` (`q_dim + 2 kv_dim` rows), `attn_output`, `ffn_up` (`2 n_ff` rows: gate,
/// then up) and `ffn_down`, each of the type `pick(role, layer, cols)` gives.
pub(super) fn add_fused_layer(
    w: &mut GgufWriter,
    l: usize,
    (e, q, kv, ff): (usize, usize, usize, usize),
    pick: &dyn Fn(MatrixRole, usize, usize) -> GgmlType,
    seeds: [u64; 4],
) -> Result<(), ModelError> {
    let n = |s: &str| format!("blk.{l}.{s}");
    let amp = |cols: usize| (3.0 / cols as f32).sqrt();
    let qkv_ty = pick(MatrixRole::AttnQ, l, e);
    add_random(
        w,
        n("attn_qkv.weight"),
        qkv_ty,
        &[e, q + 2 * kv],
        amp(e),
        seeds[0],
    )?;
    let out_ty = pick(MatrixRole::AttnOutput, l, q);
    add_random(
        w,
        n("attn_output.weight"),
        out_ty,
        &[q, e],
        amp(q),
        seeds[1],
    )?;
    let up_ty = pick(MatrixRole::FfnUp, l, e);
    add_random(w, n("ffn_up.weight"), up_ty, &[e, 2 * ff], amp(e), seeds[2])?;
    let down_ty = pick(MatrixRole::FfnDown, l, ff);
    add_random(
        w,
        n("ffn_down.weight"),
        down_ty,
        &[ff, e],
        amp(ff),
        seeds[3],
    )
}
