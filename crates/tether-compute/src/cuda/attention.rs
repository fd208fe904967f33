//! The attention op: size checks, the per-token kernel with how many blocks split each
//! head's cells and the merge pass when they do; prefill batches' tiled kernels are in
//! attention_tiled.rs.

use cudarc::driver::LaunchConfig;
use tether_gguf::GgmlType;

use super::attention_tiled::{prefill_kernel, tiled_ranges};
use super::check::{
    self, attention_shape, cache_type_supported, elems, f32s, row_bytes, shape_err, unsupported,
};
use super::kernel_files::{define, source};
use super::launch::{Arg, int};
use super::{CudaBackend, CudaBuffer};
use crate::backend::{AttnShape, AttnSpan, DeviceBuffer, KvCache, Result, Scores};

const _: () =
    assert!(define(source::COMMON, "KV_BLOCK_CELLS") == crate::backend::KV_BLOCK_CELLS as usize);

/// Batches of at most this many query tokens are sized as decode steps.
pub(super) const DECODE_TOKENS: usize = 8;
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
    pub(super) fn run_attention(
        &self,
        q: &CudaBuffer,
        cache: KvCache<'_, CudaBuffer>,
        spans: &[AttnSpan],
        shape: AttnShape,
        Scores { scale, softcap }: Scores,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        const OP: &str = "attention";
        let KvCache {
            k: k_cache,
            v: v_cache,
            ty: cache_ty,
            blocks,
        } = cache;
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
        // The table's entries are the stage's own bookkeeping and are not read back here.
        let table_bytes = blocks.map(|b| b.bytes());
        let virtual_cells = check::paged_cells(OP, table_bytes, n_cells, shape.ring_cells)?;
        check::spans(OP, spans, virtual_cells, shape.ring_cells)?;
        let blocks = match blocks {
            Some(b) => self.addr(OP, "block table", b)?,
            None => 0,
        };
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
            blocks,
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
        let Some(kernel) = prefill_kernel(&at, &self.flash) else {
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
                // The kernel's `u32 ring`: an int of the same four bytes.
                Arg::I32(shape.ring_cells as i32),
                Arg::Ptr(at.blocks),
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
pub(super) struct Operands {
    pub(super) q: u64,
    pub(super) k: u64,
    pub(super) v: u64,
    /// The block table of a paged cache; 0: none.
    pub(super) blocks: u64,
    pub(super) out: u64,
    pub(super) cache_ty: GgmlType,
    pub(super) head_bytes: usize,
    pub(super) n_cells: usize,
    /// Query tokens of the whole call.
    pub(super) n_tokens: usize,
    pub(super) shape: AttnShape,
    pub(super) scale: f32,
    /// Gemma 2's cap on the scaled scores; 0: none.
    pub(super) softcap: f32,
}

#[cfg(test)]
mod tests {
    use super::*;

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
