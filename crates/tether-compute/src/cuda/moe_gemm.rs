//! Mixture-of-experts prefill on the GEMM's tile kernel (kernels/moe_gemm.cu): the picks
//! grouped by expert (`moe_group`), their inputs gathered as f16 rows, then one launch for
//! gate and up (SiLU and the product fused), a pass that scales the activations into f16,
//! and one launch for down, each product over (row tile, item), an item being up to 32 or
//! 64 picks of one expert whose weights the tiles decode from their blocks. The 8-bit item kernels (moe_int8.rs) read an expert's weights once
//! per 8 or 32 of its picks and its inputs once per 16 weight rows; on an H100, a
//! `qwen3-30b-a3b` Q4_K prompt of 512 tokens spent 59 of its 77 ms in them.

use cudarc::driver::LaunchConfig;
use tether_gguf::GgmlType;

use super::check::{row_bytes, shape_err};
use super::gemm::{THREADS, TILE_K};
use super::kernel_files::{define, source};
use super::launch::{Arg, grid_for, int};
use super::moe::MAX_GRID_Y;
use super::moe_int8::item_grid;
use super::{CudaBackend, CudaBuffer};
use crate::backend::{DeviceBuffer, Result};
use crate::moe::{ExpertBytes, MoeFfn, MoeScratch};

const OP: &str = "moe_ffn";
/// Batches of at least this many tokens take the tile kernels (unless tuned otherwise).
/// On an H100 (`qwen3-30b-a3b` Q4_K), prompts of 16 / 32 / 48 / 64 tokens ran at 1,179 /
/// 2,122 / 2,802 / 3,475 t/s this way against 1,123 / 1,903 / 2,336 / 2,745 on the 8-bit
/// item kernels, which keep batches of 9-15 tokens.
pub(super) const MOE_TILE_MIN_TOKENS: usize = 16;
/// Output rows of one gate/up block (64 of gate beside the same 64 of up) and of one down
/// block (`GEMM_M`), and the threads of both.
const SWIGLU_ROWS: usize = 64;
const DOWN_ROWS: usize = 128;
const TILE_THREADS: u32 = 128;
/// Threads of `moe_act_f16` (one block a pick).
const ACT_THREADS: u32 = define(source::GEMM_WITH_MOE, "MOE_ACT_THREADS") as u32;

/// The stem of the moe_gemm.cu entries for experts of `ty` as `buf` stores them, and the
/// alignment their rows need: the types gemm.cu's tiles decode (packed Q4_0 / Q8_0 / Q6_K
/// / IQ4_XS, Q4_K and Q5_K as GGUF stores them, read 16 bytes at a time), and Q6_K rows
/// that do not pack (768-wide experts of llama.cpp's Q4_K_M mixes), whose 210-byte blocks
/// the tiles read 2-byte aligned.
fn stem(buf: &CudaBuffer, ty: GgmlType) -> Option<(&'static str, usize)> {
    match (ty, buf.packed) {
        (GgmlType::Q4_0, true) => Some(("q4_0p", 16)),
        (GgmlType::Q8_0, true) => Some(("q8_0p", 16)),
        (GgmlType::Q4K, false) => Some(("q4_k", 16)),
        (GgmlType::Q5K, false) => Some(("q5_k", 16)),
        (GgmlType::Q6K, true) => Some(("q6_kp", 16)),
        (GgmlType::Q6K, false) => Some(("q6_k", 2)),
        (GgmlType::IQ4XS, true) => Some(("iq4_xsp", 16)),
        _ => None,
    }
}

/// Tokens an item takes: 64 once the experts average 16 picks, else 32. On an H100
/// (`qwen3-30b-a3b` Q4_K, 128 experts, 8 a token), prompts of 256 and 512 tokens ran at
/// 8,823 / 14,120 t/s with 64 against 8,677 / 13,232 with 32, prompts of 64 and 128 at
/// 3,280 / 5,210 against 3,506 / 5,539.
fn item_tokens(picks: usize, n_expert: usize) -> usize {
    if picks >= 16 * n_expert { 64 } else { 32 }
}

/// Where the tile path keeps its scratch: the f16 inputs at the start of the row scratch,
/// which down's f32 outputs overwrite once gate/up have read them; the f32 activations in
/// the gate scratch; each pick's row, the item list, the activations' scaled f16 copy and
/// their scales in the up scratch. Offsets in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TileLayout {
    items: usize,
    act16: usize,
    scales: usize,
    /// Most items `moe_group` can write.
    max_items: usize,
}

impl TileLayout {
    /// The layout for `picks` picks over `n_expert` experts, `e` and `ff` wide, in items of
    /// `tile`, or `None` when it does not fit the scratch or one launch.
    fn new(
        picks: usize,
        n_expert: usize,
        (e, ff): (usize, usize),
        (rows_bytes, gate_bytes, up_bytes): (usize, usize, usize),
        tile: usize,
    ) -> Option<Self> {
        let max_items = picks.div_ceil(tile) + n_expert.min(picks);
        let align = |b: usize| b.checked_next_multiple_of(16);
        let items = align(picks.checked_mul(4)?)?;
        let act16 = align(items.checked_add(max_items.checked_mul(12)?.checked_add(4)?)?)?;
        let scales = align(act16.checked_add(picks.checked_mul(ff)?.checked_mul(2)?)?)?;
        let end = scales.checked_add(picks.checked_mul(4)?)?;
        let fits = picks.checked_mul(e)?.checked_mul(2)? <= rows_bytes
            && picks.checked_mul(ff)?.checked_mul(4)? <= gate_bytes
            && end <= up_bytes
            && max_items <= MAX_GRID_Y;
        fits.then_some(Self {
            items,
            act16,
            scales,
            max_items,
        })
    }
}

impl CudaBackend {
    /// Runs `ffn` on the tile kernels when its batch, expert types and widths take them;
    /// returns false, having run nothing, when they do not.
    pub(super) fn moe_ffn_tiles(
        &self,
        ffn: &MoeFfn<'_, CudaBuffer>,
        one: ExpertBytes,
        acc: &mut CudaBuffer,
        scratch: &mut MoeScratch<'_, CudaBuffer>,
    ) -> Result<bool> {
        let (e, ff, k) = (ffn.n_embd, ffn.n_ff, ffn.routing.n_used);
        if !self.mmq_capable || !self.fused_gemm || ffn.n_tokens < self.moe_tile_min_tokens {
            return Ok(false);
        }
        let gate_up = stem(ffn.gate.buf, ffn.gate.ty)
            .filter(|&s| ffn.up.ty == ffn.gate.ty && stem(ffn.up.buf, ffn.up.ty) == Some(s));
        let (Some((gate_up, gu_align)), Some((down, d_align))) =
            (gate_up, stem(ffn.down.buf, ffn.down.ty))
        else {
            return Ok(false);
        };
        let (rb_gate, rb_down) = (
            row_bytes(OP, ffn.gate.ty, e)?,
            row_bytes(OP, ffn.down.ty, ff)?,
        );
        // Every expert's rows start as aligned as the tiles read them; K goes in steps of
        // TILE_K.
        let aligned = rb_gate.is_multiple_of(gu_align)
            && rb_down.is_multiple_of(d_align)
            && e.is_multiple_of(TILE_K)
            && ff.is_multiple_of(TILE_K);
        let picks = ffn.n_tokens * k;
        let tile = item_tokens(picks, ffn.routing.n_expert);
        let sizes = (
            scratch.rows.bytes(),
            scratch.gate.bytes(),
            scratch.up.bytes(),
        );
        let layout = TileLayout::new(picks, ffn.routing.n_expert, (e, ff), sizes, tile);
        let Some(layout) = layout.filter(|_| aligned) else {
            return Ok(false);
        };
        let rows = self.addr(OP, "row scratch", scratch.rows)?;
        let act = self.addr(OP, "gate scratch", scratch.gate)?;
        let row_of = self.addr(OP, "up scratch", scratch.up)?;
        let it = self.items(ffn, row_of + layout.items as u64, tile, layout.max_items)?;
        self.moe_group_launch(&it, picks, tile, row_of)?;
        let (e_arg, ff_arg) = (int(OP, "embedding width", e)?, int(OP, "expert width", ff)?);
        self.run(
            "moe_gather_f16",
            grid_for(picks * e / 8, THREADS),
            &[
                Arg::Ptr(self.addr(OP, "input", ffn.x)?),
                Arg::Ptr(row_of),
                int(OP, "pick count", picks)?,
                it.k,
                e_arg,
                Arg::Ptr(rows),
            ],
        )?;
        self.run(
            &format!("moeg_swiglu_{gate_up}_n{tile}"),
            item_grid(ff, SWIGLU_ROWS, layout.max_items, TILE_THREADS)?,
            &[
                Arg::Ptr(self.addr(OP, "gate experts", ffn.gate.buf)?),
                Arg::Ptr(self.addr(OP, "up experts", ffn.up.buf)?),
                Arg::U64(one.gate as u64),
                Arg::U64(rb_gate as u64),
                Arg::Ptr(it.list),
                it.n_expert,
                ff_arg,
                e_arg,
                Arg::Ptr(rows),
                Arg::Ptr(act),
            ],
        )?;
        let (act16, scales) = (row_of + layout.act16 as u64, row_of + layout.scales as u64);
        let act_cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(picks).map_err(|_| shape_err(OP, format!("{picks} picks")))?,
                1,
                1,
            ),
            block_dim: (ACT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        self.run(
            "moe_act_f16",
            act_cfg,
            &[Arg::Ptr(act), ff_arg, Arg::Ptr(act16), Arg::Ptr(scales)],
        )?;
        // The gathered inputs are read: down's outputs take the row scratch.
        self.run(
            &format!("moeg_down_{down}_n{tile}"),
            item_grid(e, DOWN_ROWS, layout.max_items, TILE_THREADS)?,
            &[
                Arg::Ptr(self.addr(OP, "down experts", ffn.down.buf)?),
                Arg::U64(one.down as u64),
                Arg::U64(rb_down as u64),
                Arg::Ptr(it.list),
                it.n_expert,
                e_arg,
                ff_arg,
                Arg::Ptr(act16),
                Arg::Ptr(scales),
                Arg::Ptr(rows),
            ],
        )?;
        self.moe_sum_launch(ffn, &it, rows, row_of, acc)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tile_scratch_fits_the_planned_buffers() {
        // qwen3-30b-a3b: 512 tokens, 8 of 128 experts, 2048 wide, experts 768 wide; the
        // plan gives the row scratch [picks][e] f32, gate and up [picks][ff] f32.
        let (picks, e, ff) = (512 * 8, 2048, 768);
        let sizes = (picks * e * 4, picks * ff * 4, picks * ff * 4);
        let tile = item_tokens(picks, 128);
        assert_eq!(tile, 64);
        let l = TileLayout::new(picks, 128, (e, ff), sizes, tile).expect("fits");
        assert_eq!(l.max_items, 64 + 128);
        assert!(l.items >= picks * 4 && l.items.is_multiple_of(16));
        assert!(l.act16 >= l.items + 4 + 12 * l.max_items && l.act16.is_multiple_of(16));
        assert!(l.scales >= l.act16 + picks * ff * 2 && l.scales.is_multiple_of(16));
        assert!(l.scales + picks * 4 <= picks * ff * 4);
        // 64 tokens average 4 picks an expert: items of 32.
        assert_eq!(item_tokens(64 * 8, 128), 32);
        // Mixtral's 8 experts of 2 picks a token average 128 picks: items of 64.
        assert_eq!(item_tokens(512 * 2, 8), 64);
        // Experts one value wide: the rows and items outgrow the up scratch.
        assert!(TileLayout::new(64, 8, (256, 1), (64 * 1024, 64 * 4, 64 * 4), 32).is_none());
        // Too many items for one launch.
        let huge = (usize::MAX, usize::MAX, usize::MAX);
        assert!(TileLayout::new(MAX_GRID_Y * 32, 8, (256, 256), huge, 32).is_none());
    }
}
