//! The tiled prefill kernels: which one a batch takes (the tensor-core flash kernel, or
//! the CUDA-core tiled kernel it replaced), which of its tokens share their cells closely
//! enough to be grouped, and the launch with its optional split over cells.

use cudarc::driver::LaunchConfig;
use tether_gguf::GgmlType;

use super::CudaBackend;
use super::attention::{DECODE_TOKENS, Operands, SCRATCH_BYTES};
use super::attention_flash::{self, FlashKernels, FlashLayout};
use super::check::elems;
use super::kernel_files::{define, source};
use super::launch::{Arg, int};
use crate::backend::{AttnSpan, Result};

/// Query tokens one block of the tiled prefill kernel takes (`AP_TQ` in
/// attention_prefill.cu).
const PREFILL_TOKENS_PER_BLOCK: usize = define(source::ATTENTION_PREFILL, "AP_TQ");
/// Cells one tile of the tiled prefill kernels holds (`AP_TC` in attention_prefill.cu,
/// `FA_CELLS` in attention_flash.cu: the two must agree).
const PREFILL_TILE_CELLS: u64 = define(source::ATTENTION_PREFILL, "AP_TC") as u64;
const _: () = assert!(
    define(source::ATTENTION_PREFILL, "AP_TC") == define(source::ATTENTION_FLASH, "FA_CELLS")
);

/// A kernel that walks the cells of a group of query tokens once for all of them.
#[derive(Clone, Copy, Debug)]
pub(super) enum Prefill {
    /// The flash kernel on the tensor cores (attention_flash.rs), and the query tokens one
    /// of its blocks takes.
    Flash(&'static str, usize),
    /// The CUDA-core tiled kernel (attention_prefill.cu).
    Tiled(&'static str),
}

impl Prefill {
    /// Query tokens one block takes: tokens grouped for the kernel must share their cells.
    pub(super) fn tokens_per_block(self) -> usize {
        match self {
            Prefill::Flash(_, tokens) => tokens,
            Prefill::Tiled(_) => PREFILL_TOKENS_PER_BLOCK,
        }
    }
}

impl CudaBackend {
    /// A tiled prefill kernel over the queries of `spans`, from token `first` on. The flash
    /// kernel splits each block's cells over several blocks, then merges them, when its
    /// blocks alone would leave the GPU idle (a short batch after a long context).
    pub(super) fn attention_tiled(
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
            // The kernel's `u32 ring`: an int of the same four bytes.
            Arg::I32(shape.ring_cells as i32),
            Arg::Ptr(at.blocks),
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
}

/// The tiled kernel for a batch, when there is one: prefill batches (more than
/// [`DECODE_TOKENS`] queries) take the flash kernel where this device runs it for the
/// heads and cache type (and the operands are 16-byte aligned), else the CUDA-core
/// kernel over F16 caches with heads of 64, 96 or 128. Decode batches keep the
/// per-token kernel, whose cell splits fill the GPU with few tokens.
pub(super) fn prefill_kernel(at: &Operands, flash: &FlashKernels) -> Option<Prefill> {
    if at.n_tokens <= DECODE_TOKENS {
        return None;
    }
    let aligned = [at.q, at.k, at.v, at.out].iter().all(|p| p % 16 == 0);
    let flash = flash.kernel(at.cache_ty, at.shape.head_dim);
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

/// The tokens of a prefill-sized batch in runs of whole query groups of a tiled kernel
/// (`group` tokens a block), each run marked for the tiled kernel when every group in it is
/// tight: the cells between its first and last cell are at most one tile more than its
/// longest span (a prompt's tokens all start at their sequence's first cell). Groups of
/// tokens of different sequences are not, and their run is marked false.
pub(super) fn tiled_ranges(
    spans: &[AttnSpan],
    group: usize,
) -> Vec<(std::ops::Range<usize>, bool)> {
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
    use crate::backend::AttnShape;

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
    fn prefill_batches_take_the_flash_kernel_where_it_runs() {
        let at = |n_tokens, cache_ty, head_dim, q| Operands {
            q,
            k: 256,
            v: 512,
            blocks: 0,
            out: 768,
            cache_ty,
            head_bytes: 0,
            n_cells: 4096,
            n_tokens,
            shape: AttnShape {
                n_heads: 32,
                n_kv_heads: 8,
                head_dim,
                ring_cells: 0,
            },
            scale: 0.1,
            softcap: 0.0,
        };
        let name = |k: Option<Prefill>| match k {
            Some(Prefill::Flash(name, tokens)) => format!("{name} {tokens}"),
            Some(Prefill::Tiled(name)) => name.to_string(),
            None => "per-token".to_string(),
        };
        let on = FlashKernels::with_head_dims(&[64, 96, 128, 256]);
        let choose =
            |flash: &FlashKernels, n, ty, d, q| name(prefill_kernel(&at(n, ty, d, q), flash));
        assert_eq!(
            choose(&on, 512, GgmlType::F16, 128, 0),
            "flash_attention_128_f16 16"
        );
        assert_eq!(
            choose(&on, 9, GgmlType::Q4_0, 256, 0),
            "flash_attention_256_q4_0 16"
        );
        // Decode batches, heads without a flash kernel, unaligned queries.
        assert_eq!(choose(&on, 8, GgmlType::F16, 128, 0), "per-token");
        assert_eq!(choose(&on, 512, GgmlType::F16, 32, 0), "per-token");
        assert_eq!(
            choose(&on, 512, GgmlType::F16, 128, 4),
            "attention_prefill_128"
        );
        // Flash kernels off (TETHER_FLASH_ATTENTION=0, or before compute capability 8.0),
        // or heads of 256 on a GPU without the shared memory for them.
        let off = FlashKernels::with_head_dims(&[]);
        assert_eq!(
            choose(&off, 512, GgmlType::F16, 96, 0),
            "attention_prefill_96"
        );
        assert_eq!(choose(&off, 512, GgmlType::Q8_0, 128, 0), "per-token");
        let no_256 = FlashKernels::with_head_dims(&[64, 96, 128]);
        assert_eq!(choose(&no_256, 512, GgmlType::F16, 256, 0), "per-token");
    }
}
