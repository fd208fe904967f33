//! Mixture-of-experts products with 8-bit activations and integer dot products: the dense
//! decode kernels' row code (matvec_kquant.cu, matvec_packed.cu) run over the chosen
//! experts through common.cuh's `moe_swiglu` / `moe_down`, then `moe_sum` (moe.cu) adds
//! each token's experts, weighted, in the router's order.
//!
//! Decode (at most [`MV_MAX_TOKENS`] tokens) takes one work item a pick: the tokens'
//! 8-bit copy sits in the backend's quantized-activation buffer, the activations' copy in
//! its other slot, so nothing waits on the host and a recorded step replays. Prefill
//! groups the picks by expert on the device (`moe_group`), gathers their 8-bit inputs in
//! that order (`moe_gather_q8`) and runs items of up to [`TILE`] rows of one expert, so an
//! expert's weights are read once per tile instead of once per token; its scratch lives in
//! the MoE scratch the memory plan already counts (see [`GroupedLayout`]). Q4_K experts
//! on devices with int8 tensor cores take items of up to [`MMA_TILE`] rows on them instead
//! (matvec_mma.cu), the activations quantized for down in a pass of their own. Batches the
//! GEMM's tile kernels take (moe_gemm.rs, from 16 tokens) do not come here.

use cudarc::driver::LaunchConfig;
use tether_gguf::GgmlType;

use super::kernel_files::{define, source};
use super::launch::{Arg, grid_for, int};
use super::matvec::{MV_MAX_TOKENS, XQ_MAX_COLS, XQ_SCALES_AT, kquant_int8, stem};
use super::moe::MAX_GRID_Y;
use super::packed::packed_stem;
use super::{CudaBackend, CudaBuffer};
use crate::backend::{DeviceBuffer, Result};
use crate::moe::{ExpertBytes, MoeFfn, MoeScratch};

const OP: &str = "moe_ffn";
/// Rows one warp of the expert kernels takes (the `R` their `MOE_ENTRIES` are given:
/// `KQ_R` and `PK_R`, which agree).
const ROWS_PER_WARP: usize = define(source::MATVEC_KQUANT, "KQ_R");
const _: () = assert!(ROWS_PER_WARP == define(source::MATVEC_PACKED, "PK_R"));
/// Rows of one gate/up block and its threads (`PK_SW_ROWS`, [`ROWS_PER_WARP`] a warp).
const SW_ROWS: usize = define(source::COMMON, "PK_SW_ROWS");
const SW_THREADS: u32 = (32 * SW_ROWS / ROWS_PER_WARP) as u32;
/// Rows of one down block and its threads (`PK_MV_WARPS` warps of [`ROWS_PER_WARP`] rows).
const DOWN_WARPS: usize = define(source::COMMON, "PK_MV_WARPS");
const DOWN_ROWS: usize = DOWN_WARPS * ROWS_PER_WARP;
const DOWN_THREADS: u32 = (32 * DOWN_WARPS) as u32;
/// Most rows of one prefill work item (the NT of the `_8` entries).
const TILE: usize = 8;
/// The same for the tensor-core entries (matvec_mma.cu's `moemma_*_32`: `MKQ_TILES` tiles
/// of 8), their rows a block (16) and threads (`MKQ_WARPS` warps).
const MMA_TILE: usize = define(source::MATVEC_MMA, "MKQ_TILES") * 8;
const MMA_ROWS: usize = 16;
const MMA_THREADS: u32 = (32 * define(source::MATVEC_MMA, "MKQ_WARPS")) as u32;
/// The experts' (gate/up, down) family the tensor-core entries take: Q4_K as GGUF stores it.
const MMA_FAMILY: (&str, &str) = ("moek", "q4_k");
/// Threads of `moe_group` (`MOE_GROUP_THREADS` in moe.cu) and of the element-wise MoE
/// kernels.
const GROUP_THREADS: u32 = define(source::MOE, "MOE_GROUP_THREADS") as u32;
const THREADS: u32 = 256;

/// The kernels that take expert products of `ty` as `buf` stores it, rows `cols` wide:
/// (name prefix, type stem) of `{prefix}_swiglu_{stem}_{nt}` / `{prefix}_down_{stem}_{nt}`.
fn family(buf: &CudaBuffer, ty: GgmlType, cols: usize) -> Option<(&'static str, &'static str)> {
    if kquant_int8(ty, buf.packed, cols) {
        return stem(ty).map(|s| ("moek", s));
    }
    // Q6_K rows that do not pack (768-wide down experts of llama.cpp's mixes) keep GGUF's
    // 2-byte aligned blocks, which only the expert kernels read with 8-bit activations.
    let whole_blocks = cols > 0 && cols.is_multiple_of(256) && cols <= XQ_MAX_COLS;
    if ty == GgmlType::Q6K && !buf.packed && whole_blocks {
        return Some(("moek", "q6_k_gguf"));
    }
    // Packed Q4_0 / Q8_0 rows are whole 256-value groups within the 8-bit rows' width.
    buf.packed
        .then(|| packed_stem(ty))
        .flatten()
        .map(|s| ("moep", s))
}

/// The family gate and up share (one launch takes both), if they do.
fn gate_up_family(ffn: &MoeFfn<'_, CudaBuffer>) -> Option<(&'static str, &'static str)> {
    let e = ffn.n_embd;
    let g = family(ffn.gate.buf, ffn.gate.ty, e)?;
    (ffn.gate.ty == ffn.up.ty && Some(g) == family(ffn.up.buf, ffn.up.ty, e)).then_some(g)
}

/// Where the prefill path keeps its scratch: the gathered 8-bit inputs (values, then their
/// scales) in the row scratch, which the down products overwrite once gate/up have read
/// them; the activations' 8-bit copy, each pick's sorted row and the item list in the up
/// scratch, which the fused gate/up kernel leaves unused. Offsets in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GroupedLayout {
    x_scales: usize,
    act_scales: usize,
    row_of: usize,
    items: usize,
    /// Most items `moe_group` can write.
    max_items: usize,
}

impl GroupedLayout {
    /// The layout for `picks` picks over `n_expert` experts, `e` and `ff` wide, or `None`
    /// when it does not fit `rows_bytes` / `up_bytes` or one launch.
    fn new(
        picks: usize,
        n_expert: usize,
        (e, ff): (usize, usize),
        rows_bytes: usize,
        up_bytes: usize,
        tile: usize,
    ) -> Option<Self> {
        // An expert of c picks has ceil(c / tile) items; at most `picks` experts have any.
        let max_items = picks.div_ceil(tile) + n_expert.min(picks);
        let align = |b: usize| b.checked_next_multiple_of(16);
        let x_values = picks.checked_mul(e)?;
        let x_end = x_values.checked_add(x_values / 4)?;
        let act_values = picks.checked_mul(ff)?;
        let row_of = align(act_values.checked_add(act_values / 4)?)?;
        let items = align(row_of.checked_add(picks.checked_mul(4)?)?)?;
        let end = items.checked_add(max_items.checked_mul(12)?.checked_add(4)?)?;
        let fits = x_end <= rows_bytes && end <= up_bytes && max_items <= MAX_GRID_Y;
        fits.then_some(Self {
            x_scales: x_values,
            act_scales: act_values,
            row_of,
            items,
            max_items,
        })
    }
}

/// `rows` rows in blocks of `per_block` along x, `items` items along y.
pub(super) fn item_grid(
    rows: usize,
    per_block: usize,
    items: usize,
    threads: u32,
) -> Result<LaunchConfig> {
    let blocks = u32::try_from(rows.div_ceil(per_block))
        .map_err(|_| super::check::shape_err(OP, format!("{rows} rows in one launch")))?;
    Ok(LaunchConfig {
        grid_dim: (blocks, items as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The work items of the product launches: the arguments both kernels take after their
/// weights (ids, item list, expert count, experts used), the rows an item takes (the
/// entries' NT) and how many items a launch covers.
pub(super) struct Items {
    ids: u64,
    pub(super) list: u64,
    pub(super) n_expert: Arg,
    pub(super) k: Arg,
    nt: usize,
    count: usize,
    /// Whether the items go to the tensor-core entries (their own launch shape).
    mma: bool,
}

impl CudaBackend {
    /// Runs `ffn` with 8-bit activations when its expert types and widths take it;
    /// returns false, having run nothing, when they do not (the f32 kernels then do).
    pub(super) fn moe_ffn_int8(
        &self,
        ffn: &MoeFfn<'_, CudaBuffer>,
        one: ExpertBytes,
        acc: &mut CudaBuffer,
        scratch: &mut MoeScratch<'_, CudaBuffer>,
    ) -> Result<bool> {
        let Some(gate_up) = gate_up_family(ffn) else {
            return Ok(false);
        };
        let down = family(ffn.down.buf, ffn.down.ty, ffn.n_ff);
        if ffn.n_tokens <= MV_MAX_TOKENS {
            self.moe_decode_int8(ffn, one, acc, scratch, gate_up, down)?;
            return Ok(true);
        }
        let Some(down) = down else {
            return Ok(false);
        };
        let picks = ffn.n_tokens * ffn.routing.n_used;
        let tile = if self.moe_on_mma(gate_up, down) {
            MMA_TILE
        } else {
            TILE
        };
        let Some(layout) = GroupedLayout::new(
            picks,
            ffn.routing.n_expert,
            (ffn.n_embd, ffn.n_ff),
            scratch.rows.bytes(),
            scratch.up.bytes(),
            tile,
        ) else {
            return Ok(false);
        };
        self.moe_grouped_int8(ffn, one, acc, scratch, (gate_up, down), (layout, tile))?;
        Ok(true)
    }

    /// One item a pick (`list` 0), or items of up to `nt` rows from the list at `list`,
    /// `count` at most, on the tensor cores when `nt` is [`MMA_TILE`].
    pub(super) fn items(
        &self,
        ffn: &MoeFfn<'_, CudaBuffer>,
        list: u64,
        nt: usize,
        count: usize,
    ) -> Result<Items> {
        Ok(Items {
            ids: self.addr(OP, "expert ids", ffn.ids)?,
            list,
            n_expert: int(OP, "expert count", ffn.routing.n_expert)?,
            k: int(OP, "experts used", ffn.routing.n_used)?,
            nt,
            count,
            mma: nt == MMA_TILE,
        })
    }

    /// Whether grouped items of these families take the tensor-core entries.
    fn moe_on_mma(&self, gate_up: (&str, &str), down: (&str, &str)) -> bool {
        self.mma_min_tokens <= MMA_TILE && gate_up == MMA_FAMILY && down == MMA_FAMILY
    }

    /// `{prefix}_swiglu_{stem}_{nt}` over the items: activations into `act` (f32) and,
    /// with `act_q`, their 8-bit copy.
    fn moe_swiglu_launch(
        &self,
        ffn: &MoeFfn<'_, CudaBuffer>,
        one: ExpertBytes,
        (prefix, stem): (&str, &str),
        it: &Items,
        (xq, xds): (u64, u64),
        (act, act_q): (u64, Option<(u64, u64)>),
    ) -> Result<()> {
        let (aq, ads) = act_q.unwrap_or((0, 0));
        let args = [
            Arg::Ptr(self.addr(OP, "gate experts", ffn.gate.buf)?),
            Arg::Ptr(self.addr(OP, "up experts", ffn.up.buf)?),
            Arg::U64(one.gate as u64),
            Arg::Ptr(it.ids),
            Arg::Ptr(it.list),
            it.n_expert,
            it.k,
            int(OP, "expert width", ffn.n_ff)?,
            int(OP, "embedding width", ffn.n_embd)?,
            Arg::Ptr(xq),
            Arg::Ptr(xds),
            Arg::Ptr(act),
            Arg::Ptr(aq),
            Arg::Ptr(ads),
        ];
        let (prefix, cfg) = if it.mma {
            (
                "moemma",
                item_grid(ffn.n_ff, MMA_ROWS, it.count, MMA_THREADS)?,
            )
        } else {
            (prefix, item_grid(ffn.n_ff, SW_ROWS, it.count, SW_THREADS)?)
        };
        self.run(&format!("{prefix}_swiglu_{stem}_{}", it.nt), cfg, &args)
    }

    /// `{prefix}_down_{stem}_{nt}` over the items: each item's rows of `out`
    /// (`[rows][n_embd]` f32) from the activations' 8-bit copy.
    fn moe_down_launch(
        &self,
        ffn: &MoeFfn<'_, CudaBuffer>,
        one: ExpertBytes,
        (prefix, stem): (&str, &str),
        it: &Items,
        (aq, ads): (u64, u64),
        out: u64,
    ) -> Result<()> {
        let args = [
            Arg::Ptr(self.addr(OP, "down experts", ffn.down.buf)?),
            Arg::U64(one.down as u64),
            Arg::Ptr(it.ids),
            Arg::Ptr(it.list),
            it.n_expert,
            it.k,
            int(OP, "embedding width", ffn.n_embd)?,
            int(OP, "expert width", ffn.n_ff)?,
            Arg::Ptr(aq),
            Arg::Ptr(ads),
            Arg::Ptr(out),
        ];
        let (prefix, cfg) = if it.mma {
            (
                "moemma",
                item_grid(ffn.n_embd, MMA_ROWS, it.count, MMA_THREADS)?,
            )
        } else {
            (
                prefix,
                item_grid(ffn.n_embd, DOWN_ROWS, it.count, DOWN_THREADS)?,
            )
        };
        self.run(&format!("{prefix}_down_{stem}_{}", it.nt), cfg, &args)
    }

    /// `moe_group`: the picks sorted by expert, each pick's row into `row_of` (`[picks]`
    /// i32) and the items of up to `tile` rows into the item list.
    pub(super) fn moe_group_launch(
        &self,
        it: &Items,
        picks: usize,
        tile: usize,
        row_of: u64,
    ) -> Result<()> {
        let group = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (GROUP_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        self.run(
            "moe_group",
            group,
            &[
                Arg::Ptr(it.ids),
                int(OP, "pick count", picks)?,
                it.n_expert,
                int(OP, "tile rows", tile)?,
                Arg::Ptr(row_of),
                Arg::Ptr(it.list),
            ],
        )
    }

    /// `moe_sum`: each token's rows of `out` (pick p's at row p, or at `row_of[p]`),
    /// weighted, added into `acc`.
    pub(super) fn moe_sum_launch(
        &self,
        ffn: &MoeFfn<'_, CudaBuffer>,
        it: &Items,
        out: u64,
        row_of: u64,
        acc: &CudaBuffer,
    ) -> Result<()> {
        let args = [
            Arg::Ptr(out),
            Arg::Ptr(it.ids),
            Arg::Ptr(row_of),
            Arg::Ptr(self.addr(OP, "expert weights", ffn.weights)?),
            it.n_expert,
            int(OP, "embedding width", ffn.n_embd)?,
            it.k,
            int(OP, "token count", ffn.n_tokens)?,
            Arg::Ptr(self.addr(OP, "accumulator", acc)?),
        ];
        self.run(
            "moe_sum",
            grid_for(ffn.n_tokens * ffn.n_embd, THREADS),
            &args,
        )
    }

    /// Decode: one item a pick, inputs from the quantized-activation buffer. Down runs on
    /// the f32 kernel when its type or the activations' copy do not fit the 8-bit path.
    fn moe_decode_int8(
        &self,
        ffn: &MoeFfn<'_, CudaBuffer>,
        one: ExpertBytes,
        acc: &mut CudaBuffer,
        scratch: &mut MoeScratch<'_, CudaBuffer>,
        gate_up: (&'static str, &'static str),
        down: Option<(&'static str, &'static str)>,
    ) -> Result<()> {
        let (e, ff, n) = (ffn.n_embd, ffn.n_ff, ffn.n_tokens);
        let picks = n * ffn.routing.n_used;
        let down = down.filter(|_| ff.is_multiple_of(32) && picks * ff <= XQ_SCALES_AT);
        let x = self.addr(OP, "input", ffn.x)?;
        let act = self.addr(OP, "gate scratch", scratch.gate)?;
        let out = self.addr(OP, "row scratch", scratch.rows)?;
        let it = self.items(ffn, 0, 1, picks)?;
        let act_copy = down.map(|_| (act, ff, picks));
        self.with_xq_in_out(x, e, n, act_copy, |xin, act_q| {
            self.moe_swiglu_launch(ffn, one, gate_up, &it, xin, (act, act_q))?;
            match (down, act_q) {
                (Some(family), Some(aq)) => {
                    self.moe_down_launch(ffn, one, family, &it, aq, out)?;
                    self.moe_sum_launch(ffn, &it, out, 0, acc)
                }
                _ => {
                    let acc = self.addr(OP, "accumulator", acc)?;
                    self.moe_down_f32(ffn, one, act, acc, 0, n)
                }
            }
        })
    }

    /// Prefill: picks grouped by expert on the device, items of up to `tile` rows.
    fn moe_grouped_int8(
        &self,
        ffn: &MoeFfn<'_, CudaBuffer>,
        one: ExpertBytes,
        acc: &mut CudaBuffer,
        scratch: &mut MoeScratch<'_, CudaBuffer>,
        (gate_up, down): ((&'static str, &'static str), (&'static str, &'static str)),
        (layout, tile): (GroupedLayout, usize),
    ) -> Result<()> {
        let (e, ff, k) = (ffn.n_embd, ffn.n_ff, ffn.routing.n_used);
        let picks = ffn.n_tokens * k;
        let rows = self.addr(OP, "row scratch", scratch.rows)?;
        let act = self.addr(OP, "gate scratch", scratch.gate)?;
        let up = self.addr(OP, "up scratch", scratch.up)?;
        let row_of = up + layout.row_of as u64;
        let it = self.items(ffn, up + layout.items as u64, tile, layout.max_items)?;
        let picks_arg = int(OP, "pick count", picks)?;
        self.moe_group_launch(&it, picks, tile, row_of)?;
        let x = (rows, rows + layout.x_scales as u64);
        let warps = picks * (e / 32);
        let gather = LaunchConfig {
            grid_dim: (
                u32::try_from(warps.div_ceil(THREADS as usize / 32))
                    .map_err(|_| super::check::shape_err(OP, format!("{picks} picks")))?,
                1,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        self.run(
            "moe_gather_q8",
            gather,
            &[
                Arg::Ptr(self.addr(OP, "input", ffn.x)?),
                Arg::Ptr(row_of),
                picks_arg,
                it.k,
                int(OP, "embedding width", e)?,
                Arg::Ptr(x.0),
                Arg::Ptr(x.1),
            ],
        )?;
        let act_q = (up, up + layout.act_scales as u64);
        self.moe_swiglu_launch(ffn, one, gate_up, &it, x, (act, Some(act_q)))?;
        if it.mma {
            // The tensor-core gate/up writes f32 only.
            self.wrote();
            self.quantize_q8(act, ff, picks, act_q.0, act_q.1)?;
        }
        // The gathered inputs are read: the down products take the row scratch.
        self.moe_down_launch(ffn, one, down, &it, act_q, rows)?;
        self.moe_sum_launch(ffn, &it, rows, row_of, acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grouped_scratch_fits_the_planned_buffers() {
        // qwen3-30b-a3b: 512 tokens, 8 of 128 experts, 2048 wide, experts 768 wide; the
        // plan gives the row scratch [picks][e] f32 and the up scratch [picks][ff] f32.
        let (picks, e, ff) = (512 * 8, 2048, 768);
        let (rows, up) = (picks * e * 4, picks * ff * 4);
        let l = GroupedLayout::new(picks, 128, (e, ff), rows, up, TILE).expect("fits");
        assert_eq!(l.max_items, 512 + 128);
        assert_eq!(l.x_scales, picks * e);
        assert!(l.row_of >= picks * ff * 5 / 4 && l.row_of.is_multiple_of(16));
        assert!(l.items >= l.row_of + picks * 4 && l.items.is_multiple_of(16));
        assert!(l.items + 4 + 12 * l.max_items <= picks * ff * 4);
        // Experts one value wide: the sorted rows and items outgrow their up scratch.
        assert!(GroupedLayout::new(64, 8, (256, 1), 64 * 256 * 4, 64 * 4, TILE).is_none());
        let mma = GroupedLayout::new(picks, 128, (e, ff), rows, up, MMA_TILE);
        assert_eq!(mma.map(|l| l.max_items), Some(128 + 128));
        // Too many items for one launch.
        let huge = usize::MAX;
        assert!(GroupedLayout::new(MAX_GRID_Y * TILE, 8, (256, 256), huge, huge, TILE).is_none());
    }
}
