//! Mixture-of-experts feed-forward: the arguments of [`Backend::moe_route`] and
//! [`Backend::moe_ffn`], their size checks, and the routing rule on the host.
//!
//! A MoE layer replaces the one feed-forward network by `n_expert` of them, stacked in
//! three tensors (`ffn_gate_exps`, `ffn_up_exps`: `n_expert` matrices of `[n_ff][n_embd]`;
//! `ffn_down_exps`: `n_expert` of `[n_embd][n_ff]`, one after another). A router (a plain
//! matmul) scores the experts for each token; [`Backend::moe_route`] keeps the `n_used`
//! best and their weights in device buffers, and [`Backend::moe_ffn`] runs only those
//! experts, reading the ids on the device, so a recorded decode step needs no host round trip.
//!
//! [`Backend::moe_route`]: crate::Backend::moe_route
//! [`Backend::moe_ffn`]: crate::Backend::moe_ffn

use tether_gguf::GgmlType;

use crate::backend::{DeviceBuffer, Result};
use crate::shape_check::{need, shape_err};

/// Most experts a layer may have (Qwen3-Next has 512); the cuda router keeps one score
/// per expert in shared memory.
pub const MAX_EXPERTS: usize = 1024;
/// Most experts a token may use (Qwen3-MoE uses 8, DeepSeek-V3 8, Mixtral 2).
pub const MAX_EXPERTS_USED: usize = 32;

/// How a layer chooses its experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeRouting {
    /// Experts in the layer.
    pub n_expert: usize,
    /// Experts each token uses (`k` of top-k).
    pub n_used: usize,
    /// Whether the chosen experts' probabilities are divided by their sum (Qwen3-MoE's
    /// `norm_topk_prob`; Mixtral's softmax over the top-k logits is the same thing).
    pub norm_weights: bool,
}

impl MoeRouting {
    /// Checks the counts against [`MAX_EXPERTS`] and [`MAX_EXPERTS_USED`].
    pub fn check(&self, op: &'static str) -> Result<()> {
        let (n, k) = (self.n_expert, self.n_used);
        if n == 0 || n > MAX_EXPERTS || k == 0 || k > n || k > MAX_EXPERTS_USED {
            return Err(shape_err(
                op,
                format!(
                    "{k} of {n} experts: a layer has 1 to {MAX_EXPERTS} experts and a token \
                     uses 1 to {MAX_EXPERTS_USED} of them"
                ),
            ));
        }
        Ok(())
    }
}

/// One stacked expert tensor: `n_expert` matrices of the same shape and type, one after
/// another.
#[derive(Clone, Copy, Debug)]
pub struct ExpertMatrix<'a, B> {
    /// The whole tensor.
    pub buf: &'a B,
    /// Element type of every matrix.
    pub ty: GgmlType,
}

/// The inputs of one MoE feed-forward over `n_tokens` tokens.
#[derive(Clone, Copy, Debug)]
pub struct MoeFfn<'a, B> {
    /// Gate matrices, `n_expert × [n_ff][n_embd]`.
    pub gate: ExpertMatrix<'a, B>,
    /// Up matrices, `n_expert × [n_ff][n_embd]`.
    pub up: ExpertMatrix<'a, B>,
    /// Down matrices, `n_expert × [n_embd][n_ff]`.
    pub down: ExpertMatrix<'a, B>,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Hidden width of each expert.
    pub n_ff: usize,
    /// Expert counts.
    pub routing: MoeRouting,
    /// Tokens in the batch.
    pub n_tokens: usize,
    /// Normed input, `[n_tokens][n_embd]` f32.
    pub x: &'a B,
    /// Chosen experts, `[n_tokens][n_used]` u32, as [`crate::Backend::moe_route`] wrote them.
    pub ids: &'a B,
    /// Their weights, `[n_tokens][n_used]` f32.
    pub weights: &'a B,
}

/// Scratch of [`crate::Backend::moe_ffn`], each buffer for `n_tokens · n_used` rows; a
/// backend that fuses steps may leave some untouched.
#[derive(Debug)]
pub struct MoeScratch<'a, B> {
    /// `[n_tokens · n_used][n_embd]` f32: gathered inputs, then expert outputs.
    pub rows: &'a mut B,
    /// `[n_tokens · n_used][n_ff]` f32: gate products, then activations.
    pub gate: &'a mut B,
    /// `[n_tokens · n_used][n_ff]` f32: up products.
    pub up: &'a mut B,
}

/// Bytes of one expert's matrix in each stacked tensor: `(gate, up, down)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertBytes {
    /// Bytes of one expert's gate matrix.
    pub gate: usize,
    /// Bytes of one expert's up matrix.
    pub up: usize,
    /// Bytes of one expert's down matrix.
    pub down: usize,
}

fn row_bytes(op: &'static str, ty: GgmlType, cols: usize) -> Result<usize> {
    ty.bytes_for(cols as u64)
        .filter(|_| cols.is_multiple_of(ty.block_elems()))
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| shape_err(op, format!("{cols} columns are not whole {ty} blocks")))
}

impl<B: DeviceBuffer> MoeFfn<'_, B> {
    /// Checks every size against the buffers (weights holding `n_expert` matrices, inputs
    /// and outputs their rows) and returns the bytes of one expert's matrices.
    pub fn check(&self, op: &'static str, acc: &B) -> Result<ExpertBytes> {
        self.routing.check(op)?;
        let (e, ff, n) = (self.n_embd, self.n_ff, self.routing.n_expert);
        let one = (
            row_bytes(op, self.gate.ty, e)?.checked_mul(ff),
            row_bytes(op, self.up.ty, e)?.checked_mul(ff),
            row_bytes(op, self.down.ty, ff)?.checked_mul(e),
        );
        let (Some(gate), Some(up), Some(down)) = one else {
            return Err(shape_err(op, format!("experts of {ff}×{e} are too large")));
        };
        need(
            op,
            "gate experts",
            self.gate.buf.bytes(),
            gate.checked_mul(n),
        )?;
        need(op, "up experts", self.up.buf.bytes(), up.checked_mul(n))?;
        need(
            op,
            "down experts",
            self.down.buf.bytes(),
            down.checked_mul(n),
        )?;
        let tokens_e = self.n_tokens.checked_mul(e).and_then(|v| v.checked_mul(4));
        need(op, "input", self.x.bytes(), tokens_e)?;
        need(op, "accumulator", acc.bytes(), tokens_e)?;
        let picks = self.n_tokens.checked_mul(self.routing.n_used);
        let pick_bytes = picks.and_then(|v| v.checked_mul(4));
        need(op, "expert ids", self.ids.bytes(), pick_bytes)?;
        need(op, "expert weights", self.weights.bytes(), pick_bytes)?;
        Ok(ExpertBytes { gate, up, down })
    }
}

impl<B: DeviceBuffer> MoeScratch<'_, B> {
    /// Checks that each scratch buffer holds `n_tokens · n_used` rows.
    pub fn check(&self, op: &'static str, ffn: &MoeFfn<'_, B>) -> Result<()> {
        let rows = ffn.n_tokens.checked_mul(ffn.routing.n_used);
        let bytes = |w: usize| rows.and_then(|r| r.checked_mul(w)?.checked_mul(4));
        need(op, "row scratch", self.rows.bytes(), bytes(ffn.n_embd))?;
        need(op, "gate scratch", self.gate.bytes(), bytes(ffn.n_ff))?;
        need(op, "up scratch", self.up.bytes(), bytes(ffn.n_ff))
    }
}

/// Checks the buffers of [`crate::Backend::moe_route`]: `logits` holds `n_tokens` rows of
/// `n_expert`, `ids` and `weights` `n_tokens` rows of `n_used`.
pub fn check_route<B: DeviceBuffer>(
    op: &'static str,
    logits: &B,
    n_tokens: usize,
    routing: MoeRouting,
    ids: &B,
    weights: &B,
) -> Result<()> {
    routing.check(op)?;
    let bytes = |w: usize| n_tokens.checked_mul(w).and_then(|v| v.checked_mul(4));
    need(op, "router logits", logits.bytes(), bytes(routing.n_expert))?;
    need(op, "expert ids", ids.bytes(), bytes(routing.n_used))?;
    need(op, "expert weights", weights.bytes(), bytes(routing.n_used))
}

/// The routing rule for one token: the softmax of `logits` (one per expert), the
/// `ids.len()` most probable experts (the lower id first among equals), in order of
/// probability, and their probabilities in `weights`, divided by their sum when
/// `norm_weights`. Every backend computes this.
pub fn route_token(logits: &[f32], norm_weights: bool, ids: &mut [u32], weights: &mut [f32]) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
    let mut taken = vec![false; logits.len()];
    for (id, w) in ids.iter_mut().zip(weights.iter_mut()) {
        let mut best: Option<usize> = None;
        for (e, &l) in logits.iter().enumerate() {
            // NaN never wins, so a row of NaN picks the first free experts.
            if !taken[e] && best.is_none_or(|b| l > logits[b]) {
                best = Some(e);
            }
        }
        let b = best.unwrap_or(0);
        if let Some(t) = taken.get_mut(b) {
            *t = true;
        }
        *id = b as u32;
        *w = logits.get(b).map_or(0.0, |&l| (l - max).exp() / sum);
    }
    if norm_weights {
        let total: f32 = weights.iter().sum();
        if total > 0.0 {
            weights.iter_mut().for_each(|w| *w /= total);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_keeps_the_best_experts_and_normalizes() {
        let logits = [0.5f32, 2.0, -1.0, 2.0, 1.0];
        let (mut ids, mut w) = ([0u32; 3], [0f32; 3]);
        route_token(&logits, false, &mut ids, &mut w);
        assert_eq!(ids, [1, 3, 4], "ties go to the lower id");
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        for (i, &id) in ids.iter().enumerate() {
            assert!((w[i] - logits[id as usize].exp() / z).abs() < 1e-6);
        }
        route_token(&logits, true, &mut ids, &mut w);
        assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        // Normalized softmax over the chosen equals a softmax over their logits alone.
        let zk: f32 = ids.iter().map(|&i| logits[i as usize].exp()).sum();
        assert!((w[2] - 1f32.exp() / zk).abs() < 1e-6);
    }

    #[test]
    fn counts_out_of_range_are_refused() {
        let r = |n_expert, n_used| MoeRouting {
            n_expert,
            n_used,
            norm_weights: true,
        };
        assert!(r(8, 2).check("t").is_ok());
        assert!(r(8, 9).check("t").is_err());
        assert!(r(0, 0).check("t").is_err());
        assert!(r(MAX_EXPERTS + 1, 2).check("t").is_err());
        assert!(r(128, MAX_EXPERTS_USED + 1).check("t").is_err());
    }
}
