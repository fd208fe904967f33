//! The attention op: size checks, the choice of kernel and of how many blocks split each
//! head's cells, and the merge pass when they do.

use cudarc::driver::LaunchConfig;
use tether_gguf::GgmlType;

use super::attention_flash::{self, FlashLayout};
use super::check::{
    self, attention_shape, cache_type_supported, elems, f32s, row_bytes, shape_err, unsupported,
};
use super::launch::{Arg, int};
use super::{CudaBackend, CudaBuffer};
use crate::backend::{AttnShape, AttnSpan, DeviceBuffer, Result};

/// Batches of at most this many query tokens are sized as decode steps.
const DECODE_TOKENS: usize = 8;
/// Cells one attention block should at least get when the cells of a head are split.
const MIN_CELLS_PER_SPLIT: usize = 64;
/// Most splits made only to fill the GPU.
const MAX_SPLITS: usize = 64;
/// Most cells one attention block takes: its scores live in 4 bytes of shared memory each,
/// and 32 KiB stays under the 48 KiB a kernel gets without opting in to more.
const MAX_CHUNK: usize = 8192;
/// Bytes of the split blocks' partial results, taken once with the backend so that no
/// attention call allocates: a call whose tokens need more runs them in groups that fit.
/// Decode steps of up to 8 tokens need at most 8 MiB for 64 heads of 128 (64 splits);
/// prefill batches only split past [`MAX_CHUNK`] cells.
pub(super) const SCRATCH_BYTES: usize = 16 << 20;

/// Query tokens one block of the tiled prefill kernel takes (AP_TQ in
/// attention_prefill.cu).
const PREFILL_TOKENS_PER_BLOCK: usize = 16;
/// Cells one tile of the tiled prefill kernels holds (AP_TC in attention_prefill.cu, FA_CELLS
/// in attention_flash.cu).
const PREFILL_TILE_CELLS: u64 = 64;

/// A kernel that walks the cells of a group of query tokens once for all of them.
#[derive(Clone, Copy, Debug)]
enum Prefill {
    /// The flash kernel on the tensor cores (attention_flash.rs), and the query tokens one
    /// of its blocks takes.
    Flash(&'static str, usize),
    /// The CUDA-core tiled kernel (attention_prefill.cu).
    Tiled(&'static str),
}

impl Prefill {
    /// Query tokens one block takes: tokens grouped for the kernel must share their cells.
    fn tokens_per_block(self) -> usize {
        match self {
            Prefill::Flash(_, tokens) => tokens,
            Prefill::Tiled(_) => PREFILL_TOKENS_PER_BLOCK,
        }
    }
}

/// How many blocks share the cells of each (token, head): enough that `blocks` of them
/// fill the GPU twice over (no fewer than [`MIN_CELLS_PER_SPLIT`] cells each), and enough
/// that none takes more than [`MAX_CHUNK`] cells. Prefill batches fill the GPU by
/// themselves and get one split (no merge pass) unless their spans are very long.
fn attention_splits(blocks: usize, max_cells: usize, sm_count: usize) -> usize {
    let target = 2 * sm_count;
    let to_fill = if blocks >= target {
        1
    } else {
        target
            .div_ceil(blocks.max(1))
            .min(max_cells.div_ceil(MIN_CELLS_PER_SPLIT))
            .clamp(1, MAX_SPLITS)
    };
    to_fill.max(max_cells.div_ceil(MAX_CHUNK))
}

impl CudaBackend {
    /// [`crate::Backend::attention`] on the GPU.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_attention(
        &self,
        q: &CudaBuffer,
        k_cache: &CudaBuffer,
        v_cache: &CudaBuffer,
        cache_ty: GgmlType,
        spans: &[AttnSpan],
        shape: AttnShape,
        (scale, softcap): (f32, f32),
        out: &mut CudaBuffer,
    ) -> Result<()> {
        const OP: &str = "attention";
        attention_shape(OP, shape)?;
        if softcap != 0.0 && !(softcap.is_finite() && softcap > 0.0) {
            return Err(shape_err(
                OP,
                format!("soft-cap {softcap} must be a positive number"),
            ));
        }
        if !cache_type_supported(cache_ty) {
            return Err(unsupported(OP, cache_ty));
        }
        let head_bytes = row_bytes(OP, cache_ty, shape.head_dim)?;
        let n = elems(OP, &[spans.len(), shape.n_heads, shape.head_dim])?;
        f32s(OP, "query", q, n)?;
        f32s(OP, "output", out, n)?;
        let cell_bytes = elems(OP, &[shape.n_kv_heads, head_bytes])?;
        let n_cells = k_cache.bytes().min(v_cache.bytes()) / cell_bytes;
        check::spans(OP, spans, n_cells)?;
        let qp = self.addr(OP, "query", q)?;
        let (kp, vp) = (
            self.addr(OP, "key cache", k_cache)?,
            self.addr(OP, "value cache", v_cache)?,
        );
        let op = self.addr(OP, "output", out)?;
        if spans.is_empty() {
            return Ok(());
        }
        if spans.len() > 65_535 {
            return Err(shape_err(
                OP,
                format!("{} query tokens exceed 65535 per call", spans.len()),
            ));
        }
        let flat: Vec<u32> = spans
            .iter()
            .flat_map(|s| [s.first_cell, s.n_cells])
            .collect();
        let at = Operands {
            q: qp,
            k: kp,
            v: vp,
            out: op,
            cache_ty,
            head_bytes,
            n_cells,
            n_tokens: spans.len(),
            shape,
            scale,
            softcap,
        };
        // Held until the last launch, so no other thread recycles the spans' slot.
        let mut staging = self.lock_staging();
        let spans_at = staging.stage_u32(&flat)?;
        let Some(kernel) = self.prefill_kernel(&at) else {
            return self.attention_per_token(&at, spans, 0, spans_at);
        };
        // Query groups whose spans overlap take a tiled kernel; groups of tokens of
        // different sequences (many sequences decoding at once) would make it walk every
        // cell between their spans, and take the per-token kernel instead.
        for (range, tiled) in tiled_ranges(spans, kernel.tokens_per_block()) {
            let first = range.start;
            if !tiled {
                self.attention_per_token(&at, &spans[range], first, spans_at)?;
                continue;
            }
            self.attention_tiled(kernel, &at, &spans[range], first, spans_at)?;
        }
        Ok(())
    }

    /// The tiled kernel for a batch, when there is one: prefill batches (more than
    /// [`DECODE_TOKENS`] queries) take the flash kernel where this device runs it for the
    /// heads and cache type (and the operands are 16-byte aligned), else the CUDA-core
    /// kernel over F16 caches with heads of 64, 96 or 128. Decode batches keep the
    /// per-token kernel, whose cell splits fill the GPU with few tokens.
    fn prefill_kernel(&self, at: &Operands) -> Option<Prefill> {
        if at.n_tokens <= DECODE_TOKENS {
            return None;
        }
        let aligned = [at.q, at.k, at.v, at.out].iter().all(|p| p % 16 == 0);
        let flash = self.flash.kernel(at.cache_ty, at.shape.head_dim);
        if let (Some(name), true) = (flash, aligned) {
            let layout = FlashLayout::new(at.shape.n_heads, at.shape.n_kv_heads);
            return Some(Prefill::Flash(name, layout.tokens));
        }
        if at.cache_ty != GgmlType::F16 {
            return None;
        }
        match at.shape.head_dim {
            64 => Some(Prefill::Tiled("attention_prefill_64")),
            96 => Some(Prefill::Tiled("attention_prefill_96")),
            128 => Some(Prefill::Tiled("attention_prefill_128")),
            _ => None,
        }
    }

    /// A tiled prefill kernel over the queries of `spans`, from token `first` on. The flash
    /// kernel splits each block's cells over several blocks, then merges them, when its
    /// blocks alone would leave the GPU idle (a short batch after a long context).
    fn attention_tiled(
        &self,
        kernel: Prefill,
        at: &Operands,
        spans: &[AttnSpan],
        first: usize,
        spans_at: u64,
    ) -> Result<()> {
        const OP: &str = "attention";
        let (shape, n_tokens) = (at.shape, spans.len());
        let row = (shape.n_heads * shape.head_dim * 4) as u64;
        let first = first as u64;
        let out = at.out + first * row;
        let (name, mut cfg) = match kernel {
            Prefill::Flash(name, _) => (name, attention_flash::launch_config(shape, n_tokens)),
            Prefill::Tiled(name) => {
                let cfg = LaunchConfig {
                    grid_dim: (
                        shape.n_heads as u32,
                        n_tokens.div_ceil(PREFILL_TOKENS_PER_BLOCK) as u32,
                        1,
                    ),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                };
                (name, cfg)
            }
        };
        let mut args = vec![
            Arg::Ptr(at.q + first * row),
            Arg::Ptr(at.k),
            Arg::Ptr(at.v),
            Arg::Ptr(spans_at + first * 8),
            int(OP, "query tokens", n_tokens)?,
            int(OP, "n_heads", shape.n_heads)?,
            int(OP, "n_kv_heads", shape.n_kv_heads)?,
            Arg::F32(at.scale),
            Arg::F32(at.softcap),
            Arg::Ptr(out),
        ];
        let Prefill::Flash(..) = kernel else {
            return self.run(name, cfg, &args);
        };
        let blocks = (cfg.grid_dim.0 * cfg.grid_dim.1) as usize;
        let longest = spans.iter().map(|s| s.n_cells as usize).max().unwrap_or(0);
        let per_split = elems(OP, &[n_tokens, shape.n_heads, shape.head_dim + 2, 4])?;
        let splits =
            attention_flash::splits(blocks, longest, self.sm_count, SCRATCH_BYTES / per_split);
        if splits == 1 {
            args.push(Arg::Ptr(0));
            return self.run(name, cfg, &args);
        }
        let scratch = self.lock_scratch();
        args.push(Arg::Ptr(scratch.ptr()));
        cfg.grid_dim.2 = splits as u32;
        self.run(name, cfg, &args)?;
        let merge = LaunchConfig {
            grid_dim: (shape.n_heads as u32, n_tokens as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let merge_args = [
            Arg::Ptr(scratch.ptr()),
            Arg::I32(splits as i32),
            int(OP, "n_heads", shape.n_heads)?,
            int(OP, "head_dim", shape.head_dim)?,
            Arg::Ptr(out),
        ];
        self.run("attention_merge", merge, &merge_args)
    }

    /// The per-token kernel (each token's cells split over blocks when they are few, then
    /// merged) over `spans`, the queries from token `first` on.
    fn attention_per_token(
        &self,
        at: &Operands,
        spans: &[AttnSpan],
        first: usize,
        spans_at: u64,
    ) -> Result<()> {
        const OP: &str = "attention";
        let (shape, cache_ty) = (at.shape, at.cache_ty);
        let longest = spans.iter().map(|s| s.n_cells as usize).max().unwrap_or(1);
        // Decode-sized batches split as if their spans filled the cache, so the launch
        // shape does not change as the context grows and a recorded step can be replayed
        // (see graph.rs); each split then takes its share of the actual span.
        let max_cells = if spans.len() <= DECODE_TOKENS {
            at.n_cells.max(longest)
        } else {
            longest
        };
        let splits = attention_splits(shape.n_heads * spans.len(), max_cells, self.sm_count);
        let chunk = max_cells.div_ceil(splits);
        if splits > 65_535 {
            return Err(shape_err(
                OP,
                format!("spans of {max_cells} cells are too long"),
            ));
        }
        // Each token's heads and splits leave (head_dim outputs, max, sum) in the scratch.
        let per_token = elems(OP, &[shape.n_heads, splits, shape.head_dim + 2, 4])?;
        let group = if splits == 1 {
            spans.len()
        } else {
            SCRATCH_BYTES / per_token
        };
        if group == 0 {
            return Err(shape_err(
                OP,
                format!(
                    "spans of {max_cells} cells need {per_token} bytes of partial results \
                     per token, more than the {SCRATCH_BYTES} the backend holds"
                ),
            ));
        }
        let scratch = self.lock_scratch();
        let partial = if splits > 1 { scratch.ptr() } else { 0 };
        // Heads of 8..256 elements in whole 16-byte loads take the vectorised f16 kernel.
        let g = shape.head_dim / 8;
        let vectorised = cache_ty == GgmlType::F16
            && shape.head_dim.is_multiple_of(8)
            && g.is_power_of_two()
            && g <= 32;
        let kernel = if vectorised {
            "attention_f16v"
        } else {
            "attention"
        };
        let row = (shape.n_heads * shape.head_dim * 4) as u64;
        for start in (0..spans.len()).step_by(group) {
            // At most 65535 (checked above), so it fits a grid's y.
            let t = group.min(spans.len() - start) as u32;
            let token = (first + start) as u64;
            let cfg = LaunchConfig {
                grid_dim: (shape.n_heads as u32, t, splits as u32),
                block_dim: (128, 1, 1),
                shared_mem_bytes: (chunk * 4) as u32,
            };
            let args = [
                Arg::Ptr(at.q + token * row),
                Arg::Ptr(at.k),
                Arg::Ptr(at.v),
                Arg::I32(cache_ty.id() as i32),
                Arg::Ptr(spans_at + token * 8),
                int(OP, "n_heads", shape.n_heads)?,
                int(OP, "n_kv_heads", shape.n_kv_heads)?,
                int(OP, "head_dim", shape.head_dim)?,
                Arg::U64(at.head_bytes as u64),
                Arg::F32(at.scale),
                Arg::F32(at.softcap),
                Arg::I32(chunk as i32),
                Arg::Ptr(at.out + token * row),
                Arg::Ptr(partial),
            ];
            self.run(kernel, cfg, &args)?;
            if splits == 1 {
                continue;
            }
            let cfg = LaunchConfig {
                grid_dim: (shape.n_heads as u32, t, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let args = [
                Arg::Ptr(partial),
                Arg::I32(splits as i32),
                int(OP, "n_heads", shape.n_heads)?,
                int(OP, "head_dim", shape.head_dim)?,
                Arg::Ptr(at.out + token * row),
            ];
            // A decode batch's merged rows are also quantized for the output projection
            // (matvec.rs), which then skips its own pass over them.
            let whole = first == 0 && t as usize == at.n_tokens;
            let fused = whole
                && shape.head_dim.is_multiple_of(32)
                && self.writing_xq(
                    at.out,
                    shape.n_heads * shape.head_dim,
                    spans.len(),
                    |q, ds| {
                        let mut with_q = args.to_vec();
                        with_q.extend([Arg::Ptr(q), Arg::Ptr(ds)]);
                        self.run("attention_merge_q8", cfg, &with_q)
                    },
                )?;
            if !fused {
                self.run("attention_merge", cfg, &args)?;
            }
        }
        Ok(())
    }
}

/// What an attention call reads and writes, checked: device addresses, the cache's type,
/// bytes of one head's row, cells, the call's query tokens, the heads, the score scale and cap.
struct Operands {
    q: u64,
    k: u64,
    v: u64,
    out: u64,
    cache_ty: GgmlType,
    head_bytes: usize,
    n_cells: usize,
    /// Query tokens of the whole call.
    n_tokens: usize,
    shape: AttnShape,
    scale: f32,
    /// Gemma 2's cap on the scaled scores; 0: none.
    softcap: f32,
}

/// The tokens of a prefill-sized batch in runs of whole query groups of a tiled kernel
/// (`group` tokens a block), each run marked for the tiled kernel when every group in it is
/// tight: the cells between its first and last cell are at most one tile more than its
/// longest span (a prompt's tokens all start at their sequence's first cell). Groups of
/// tokens of different sequences are not, and their run is marked false.
fn tiled_ranges(spans: &[AttnSpan], group: usize) -> Vec<(std::ops::Range<usize>, bool)> {
    let mut runs: Vec<(std::ops::Range<usize>, bool)> = Vec::new();
    for (g, tokens) in spans.chunks(group.max(1)).enumerate() {
        let used = tokens.iter().filter(|s| s.n_cells > 0);
        let lo = used.clone().map(|s| s.first_cell as u64).min().unwrap_or(0);
        let hi = used
            .clone()
            .map(|s| s.first_cell as u64 + s.n_cells as u64)
            .max();
        let longest = used.map(|s| s.n_cells as u64).max().unwrap_or(0);
        let tight = hi.is_none_or(|hi| hi - lo <= longest + PREFILL_TILE_CELLS);
        let start = g * group.max(1);
        let range = start..start + tokens.len();
        match runs.last_mut() {
            Some((last, kind)) if *kind == tight => last.end = range.end,
            _ => runs.push((range, tight)),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(first_cell: u32, n_cells: u32) -> AttnSpan {
        AttnSpan {
            first_cell,
            n_cells,
        }
    }

    #[test]
    fn groups_of_one_prompt_are_tiled_and_groups_of_many_sequences_are_not() {
        // A 40-token prompt of the sequence at cell 512.
        let prompt: Vec<AttnSpan> = (0..40).map(|t| span(512, 100 + t)).collect();
        assert_eq!(tiled_ranges(&prompt, 16), vec![(0..40, true)]);
        // 20 sequences decoding at once, 256 cells apart: every group spans them all.
        let decode: Vec<AttnSpan> = (0..20).map(|s| span(256 * s, 130)).collect();
        assert_eq!(tiled_ranges(&decode, 16), vec![(0..20, false)]);
        // A prompt, then decode tokens of other sequences: the group they share with the
        // prompt's last tokens is loose too.
        let mixed: Vec<AttnSpan> = prompt.iter().copied().chain(decode).collect();
        assert_eq!(
            tiled_ranges(&mixed, 16),
            vec![(0..32, true), (32..60, false)]
        );
        // Two sequences a tile apart or less still share their tiles; empty spans and a
        // group of them alone do not count.
        let near: Vec<AttnSpan> = (0..16).map(|t| span(64 * (t % 2), 64 + t)).collect();
        assert_eq!(tiled_ranges(&near, 16), vec![(0..16, true)]);
        let empty = vec![span(0, 0), span(9000, 0), span(100, 5)];
        assert_eq!(tiled_ranges(&empty, 16), vec![(0..3, true)]);
    }

    #[test]
    fn decode_attention_is_split_and_prefill_is_not() {
        // 32 heads, one token, 4096 cells on 132 SMs: 9 splits of 456 cells.
        assert_eq!(attention_splits(32, 4096, 132), 9);
        // Few cells: no split smaller than 64 cells.
        assert_eq!(attention_splits(32, 100, 132), 2);
        assert_eq!(attention_splits(32, 10, 132), 1);
        // A prefill batch fills the GPU by itself.
        assert_eq!(attention_splits(32 * 64, 4096, 132), 1);
        // Never more than MAX_SPLITS to fill the GPU...
        assert_eq!(attention_splits(1, 100_000, 132), MAX_SPLITS);
        // ...but always enough that no block takes more than MAX_CHUNK cells.
        assert_eq!(attention_splits(1, 1 << 20, 4), (1 << 20) / MAX_CHUNK);
        assert_eq!(attention_splits(32 * 64, 20_000, 132), 3);
    }
}
