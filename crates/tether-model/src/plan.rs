//! The memory plan of a stage: weights + KV cache + scratch, computed by formula.
//!
//! [`Stage::new`](crate::Stage::new) sizes its scratch buffers with [`scratch_sizes`], so
//! the plan and what a stage holds cannot drift apart.

use tether_compute::KV_BLOCK_CELLS;
use tether_gguf::GgmlType;

use crate::config::ModelConfig;
use crate::kv::KvRing;
use crate::stage::{StageSpec, TensorSlot};

/// What a stage will hold on its device, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagePlan {
    /// Sum of the stage's tensors.
    pub weights_bytes: u64,
    /// K and V caches of every layer of the stage (global layers: paged pools of whole
    /// blocks; sliding-window layers: their rings), and the pool's block table.
    pub kv_bytes: u64,
    /// Activation buffers for one micro-batch.
    pub scratch_bytes: u64,
    /// `weights_bytes + kv_bytes + scratch_bytes`.
    pub total_bytes: u64,
}

/// Bytes of each scratch buffer a stage allocates; zero for buffers the stage does not need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScratchSizes {
    /// Residual stream `[ubatch][n_embd]` f32 (always).
    pub hidden: u64,
    /// Normed stream / projection output `[ubatch][n_embd]` (layers or head).
    pub normed: u64,
    /// Queries, and attention output, `[ubatch][q_dim]` each (layers).
    pub q: u64,
    /// Keys and values `[ubatch][kv_dim]` each (layers).
    pub kv: u64,
    /// Feed-forward gate, up and activation `[ubatch][n_ff]` each (layers); at least
    /// `[ubatch][kv_dim]`, since the gate buffer holds the normed keys of a Qwen3 layer,
    /// and `[ubatch][n_embd]` for Gemma, whose post-norms use gate and up.
    pub ff: u64,
    /// Logits `[ubatch][n_vocab]` (head).
    pub logits: u64,
    /// MoE router scores `[ubatch][n_expert]` (MoE layers).
    pub moe_logits: u64,
    /// Chosen expert ids, and their weights, `[ubatch][n_used]` each (MoE layers).
    pub moe_picks: u64,
    /// Expert inputs and outputs `[ubatch · n_used][n_embd]` (MoE layers).
    pub moe_rows: u64,
    /// Expert gate and up products `[ubatch · n_used][n_ff_exp]` each (MoE layers).
    pub moe_ff: u64,
    /// Each of the [`HANDOFF_SLOTS`] slots a stage whose output is hidden states (layers
    /// and no head) leaves a micro-batch's output in for the next stage to copy from its
    /// device, `[ubatch][n_embd]` f32.
    pub handoff: u64,
}

/// Slots a stage hands hidden states on in: the next stage copies from one while this one
/// fills another, and the pipeline keeps one more in flight (see `StepOutput::Slot`).
pub const HANDOFF_SLOTS: usize = 3;

impl ScratchSizes {
    /// Sum over every buffer, counting the ones allocated twice (q/attn, k/v, expert
    /// ids/weights, expert gate/up), three times (gate/up/act) and once a hand-off slot.
    pub fn total(&self) -> u64 {
        self.hidden
            + self.normed
            + 2 * self.q
            + 2 * self.kv
            + 3 * self.ff
            + self.logits
            + self.moe_logits
            + 2 * self.moe_picks
            + self.moe_rows
            + 2 * self.moe_ff
            + HANDOFF_SLOTS as u64 * self.handoff
    }
}

/// Sizes of the scratch buffers of a stage of `spec`.
pub fn scratch_sizes(cfg: &ModelConfig, spec: &StageSpec) -> ScratchSizes {
    let ub = spec.ubatch as u64;
    let f32s = |n: usize| ub * n as u64 * 4;
    let layers = spec.last_layer > spec.first_layer;
    let when = |cond: bool, bytes: u64| if cond { bytes } else { 0 };
    // Gemma's post-norms use the gate and up buffers for `[ubatch][n_embd]` rows.
    let post_norm_width = if cfg.arch.traits().post_norms {
        cfg.n_embd
    } else {
        0
    };
    // A MoE model has no dense feed-forward: its gate buffer only holds normed keys.
    let dense_ff = if cfg.moe.is_some() { 0 } else { cfg.n_ff };
    // Zero for dense models and stages without layers.
    let (n_expert, n_used, ff_exp) = cfg
        .moe
        .filter(|_| layers)
        .map_or((0, 0, 0), |m| (m.n_expert, m.n_used, m.n_ff_exp));
    ScratchSizes {
        hidden: f32s(cfg.n_embd),
        normed: when(layers || spec.has_head, f32s(cfg.n_embd)),
        q: when(layers, f32s(cfg.q_dim())),
        kv: when(layers, f32s(cfg.kv_dim())),
        ff: when(
            layers,
            f32s(dense_ff.max(cfg.kv_dim()).max(post_norm_width)),
        ),
        logits: when(spec.has_head, f32s(cfg.n_vocab)),
        moe_logits: f32s(n_expert),
        moe_picks: f32s(n_used),
        moe_rows: f32s(n_used * cfg.n_embd),
        moe_ff: f32s(n_used * ff_exp),
        handoff: when(layers && !spec.has_head, f32s(cfg.n_embd)),
    }
}

/// The ring the sliding-window layers of a model keep instead of a whole context: `window +
/// ubatch` cells per sequence, enough for a micro-batch's first token to see its whole
/// window after the micro-batch is written; `None` when the model has no sliding-window
/// layers or that many cells would not be fewer than the context.
pub fn kv_ring(cfg: &ModelConfig, ctx_per_seq: usize, ubatch: usize) -> Option<KvRing> {
    let window = cfg.sliding_window?;
    let cells = window.checked_add(ubatch)?;
    if cells >= ctx_per_seq || window == 0 {
        return None;
    }
    Some(KvRing {
        cells: u32::try_from(cells).ok()?,
        chunk: u32::try_from(ubatch).ok()?,
        window: u32::try_from(window).ok()?,
    })
}

/// Cells per sequence of layer `layer`'s cache: the context in whole blocks of the paged
/// pool ([`KV_BLOCK_CELLS`]), or a sliding-window layer's ring (see [`kv_ring`]).
pub fn kv_cells_per_seq(cfg: &ModelConfig, spec: &StageSpec, layer: usize) -> usize {
    match kv_ring(cfg, spec.ctx_per_seq, spec.ubatch) {
        Some(ring) if cfg.is_sliding(layer) => ring.cells as usize,
        _ => kv_blocks_per_seq(spec.ctx_per_seq) * KV_BLOCK_CELLS as usize,
    }
}

/// Blocks of the paged pool per sequence of `ctx_per_seq` cells: the context, rounded up
/// to whole blocks.
pub fn kv_blocks_per_seq(ctx_per_seq: usize) -> usize {
    ctx_per_seq.div_ceil(KV_BLOCK_CELLS as usize)
}

/// Bytes of the block tables of a stage's paged pool: a u32 per block of every sequence,
/// cached-prefix ones included; none for a stage without layers.
pub fn kv_table_bytes(spec: &StageSpec) -> u64 {
    if spec.last_layer == spec.first_layer {
        return 0;
    }
    let n_seq = spec.n_seq + spec.cached_seqs;
    (n_seq * kv_blocks_per_seq(spec.ctx_per_seq) * 4) as u64
}

/// Bytes of layer `layer`'s K (or V) cache stored as `ty`: every cell holds `n_kv_heads`
/// rows of `head_dim` elements, in whole blocks of `ty` (Q8_0: 34 bytes per 32, Q4_0: 18
/// per 32). A `head_dim` that is not whole blocks (which [`crate::Stage::new`] refuses) is
/// rounded up.
pub fn kv_cache_bytes(cfg: &ModelConfig, spec: &StageSpec, layer: usize, ty: GgmlType) -> u64 {
    let cells = (spec.n_seq * kv_cells_per_seq(cfg, spec, layer)) as u64;
    cells * kv_cell_bytes(cfg, ty)
}

/// Bytes of one KV cell (one token's keys, or its values) of one layer in a cache of `ty`:
/// every KV head, each in whole blocks of `ty`.
pub fn kv_cell_bytes(cfg: &ModelConfig, ty: GgmlType) -> u64 {
    let blocks_per_head = cfg.head_dim.div_ceil(ty.block_elems()) as u64;
    cfg.n_head_kv as u64 * blocks_per_head * ty.block_bytes() as u64
}

/// The memory plan of a stage holding `tensors` (from
/// [`required_tensors`](crate::required_tensors)).
pub fn plan_stage(cfg: &ModelConfig, spec: &StageSpec, tensors: &[TensorSlot]) -> StagePlan {
    let weights_bytes = tensors.iter().map(|t| t.bytes).sum();
    let kv_bytes = (spec.first_layer..spec.last_layer)
        .map(|l| {
            kv_cache_bytes(cfg, spec, l, spec.cache_k) + kv_cache_bytes(cfg, spec, l, spec.cache_v)
        })
        .sum::<u64>()
        + kv_table_bytes(spec);
    let scratch_bytes = scratch_sizes(cfg, spec).total();
    StagePlan {
        weights_bytes,
        kv_bytes,
        scratch_bytes,
        total_bytes: weights_bytes + kv_bytes + scratch_bytes,
    }
}
