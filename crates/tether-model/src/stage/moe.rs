//! The mixture-of-experts feed-forward of a stage's layers: router matmul, routing and the
//! chosen experts' products, all on the device (the expert ids never leave it, so decode
//! steps replay as recorded).

use tether_compute::moe::{ExpertMatrix, MoeFfn, MoeScratch};
use tether_compute::{Backend, DeviceBuffer};

use super::Weight;
use crate::config::ModelConfig;
use crate::error::{ModelError, compute_in};
use crate::moe::{DOWN_EXPS, GATE_EXPS, ROUTER, UP_EXPS};
use crate::plan::ScratchSizes;

/// Indices into `Stage::weights` of one MoE layer's router and stacked experts.
pub(super) struct MoeWeights {
    router: usize,
    gate: usize,
    up: usize,
    down: usize,
}

impl MoeWeights {
    /// Looks the layer's tensors up by suffix with `index`.
    pub(super) fn find(
        index: impl Fn(&str) -> Result<usize, ModelError>,
    ) -> Result<Self, ModelError> {
        Ok(Self {
            router: index(ROUTER)?,
            gate: index(GATE_EXPS)?,
            up: index(UP_EXPS)?,
            down: index(DOWN_EXPS)?,
        })
    }
}

/// Scratch of the MoE layers, shared by them (one layer runs at a time).
pub(super) struct MoeBuffers<Buf> {
    logits: Buf,
    ids: Buf,
    weights: Buf,
    rows: Buf,
    gate: Buf,
    up: Buf,
}

impl<Buf: DeviceBuffer> MoeBuffers<Buf> {
    /// The sizes to allocate, in the order [`Self::take`] takes them.
    pub(super) fn sizes(s: &ScratchSizes) -> [u64; 6] {
        [
            s.moe_logits,
            s.moe_picks,
            s.moe_picks,
            s.moe_rows,
            s.moe_ff,
            s.moe_ff,
        ]
    }

    /// Takes the buffers allocated for [`Self::sizes`] from `next`.
    pub(super) fn take(
        next: &mut impl FnMut() -> Result<Buf, ModelError>,
    ) -> Result<Self, ModelError> {
        Ok(Self {
            logits: next()?,
            ids: next()?,
            weights: next()?,
            rows: next()?,
            gate: next()?,
            up: next()?,
        })
    }

    /// Bytes held.
    pub(super) fn bytes(&self) -> usize {
        [
            &self.logits,
            &self.ids,
            &self.weights,
            &self.rows,
            &self.gate,
            &self.up,
        ]
        .iter()
        .map(|b| b.bytes())
        .sum()
    }
}

/// Adds the MoE feed-forward of `normed` (`n` tokens) into `hidden`; `lw` indexes the
/// layer's tensors in the stage's weights `w`.
pub(super) fn moe_ffn<B: Backend>(
    be: &B,
    cfg: &ModelConfig,
    (lw, w): (&MoeWeights, &[Weight<B::Buffer>]),
    (normed, n): (&B::Buffer, usize),
    hidden: &mut B::Buffer,
    scratch: Option<&mut MoeBuffers<B::Buffer>>,
    layer_no: usize,
) -> Result<(), ModelError> {
    let ce = |op| compute_in(op, layer_no);
    let (Some(moe), Some(s)) = (cfg.moe, scratch) else {
        return Err(ModelError::FailedPrecondition(
            "MoE scratch missing from a stage with MoE layers".into(),
        ));
    };
    let router = &w[lw.router];
    be.matmul(
        router.matrix(moe.n_expert, cfg.n_embd),
        normed,
        n,
        &mut s.logits,
    )
    .map_err(ce("moe router"))?;
    let routing = moe.routing();
    be.moe_route(&s.logits, n, routing, &mut s.ids, &mut s.weights)
        .map_err(ce("moe routing"))?;
    let m = |i: usize| ExpertMatrix {
        buf: &w[i].buf,
        ty: w[i].ty,
    };
    let ffn = MoeFfn {
        gate: m(lw.gate),
        up: m(lw.up),
        down: m(lw.down),
        n_embd: cfg.n_embd,
        n_ff: moe.n_ff_exp,
        routing,
        n_tokens: n,
        x: normed,
        ids: &s.ids,
        weights: &s.weights,
    };
    let scratch = MoeScratch {
        rows: &mut s.rows,
        gate: &mut s.gate,
        up: &mut s.up,
    };
    be.moe_ffn(ffn, hidden, scratch).map_err(ce("moe experts"))
}
