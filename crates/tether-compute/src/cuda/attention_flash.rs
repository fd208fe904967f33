//! The flash-attention prefill kernel on the tensor cores (kernels/attention_flash.cu): which
//! head sizes and cache types it serves on this device, and its launch.

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, LaunchConfig};
use tether_gguf::GgmlType;

use super::compile::Kernels;
use super::device::driver_err;
use super::kernel_files::{define, source};
use crate::backend::{AttnShape, Result};

/// Warps of one block (`FA_WARPS` in attention_flash.cu).
const WARPS: usize = define(source::ATTENTION_FLASH, "FA_WARPS");
/// Query rows (token, head pairs) one block takes (`FA_ROWS`: 16 a warp).
const ROWS_PER_BLOCK: usize = WARPS * 16;
/// Cells of one K/V tile (`FA_CELLS`).
const TILE_CELLS: usize = define(source::ATTENTION_FLASH, "FA_CELLS");
/// Threads of one block (`FA_THREADS`).
const THREADS: u32 = (WARPS * 32) as u32;
/// Head sizes the kernel is instantiated for.
const HEAD_DIMS: [usize; 4] = [64, 96, 128, 256];

/// Bytes of dynamic shared memory a block of heads of `head_dim` takes: the query tile and
/// two K and two V tiles (double buffered), rows padded by 8 halves.
fn shared_bytes(head_dim: usize) -> usize {
    (ROWS_PER_BLOCK + 4 * TILE_CELLS) * (head_dim + 8) * 2
}

/// The entry point for heads of `head_dim` over a cache of `ty`.
fn entry(head_dim: usize, ty: GgmlType) -> Option<&'static str> {
    Some(match (head_dim, ty) {
        (64, GgmlType::F16) => "flash_attention_64_f16",
        (64, GgmlType::Q8_0) => "flash_attention_64_q8_0",
        (64, GgmlType::Q4_0) => "flash_attention_64_q4_0",
        (96, GgmlType::F16) => "flash_attention_96_f16",
        (96, GgmlType::Q8_0) => "flash_attention_96_q8_0",
        (96, GgmlType::Q4_0) => "flash_attention_96_q4_0",
        (128, GgmlType::F16) => "flash_attention_128_f16",
        (128, GgmlType::Q8_0) => "flash_attention_128_q8_0",
        (128, GgmlType::Q4_0) => "flash_attention_128_q4_0",
        (256, GgmlType::F16) => "flash_attention_256_f16",
        (256, GgmlType::Q8_0) => "flash_attention_256_q8_0",
        (256, GgmlType::Q4_0) => "flash_attention_256_q4_0",
        _ => return None,
    })
}

/// Every entry point of attention_flash.cu.
pub(super) const ENTRIES: &[&str] = &[
    "flash_attention_64_f16",
    "flash_attention_64_q8_0",
    "flash_attention_64_q4_0",
    "flash_attention_96_f16",
    "flash_attention_96_q8_0",
    "flash_attention_96_q4_0",
    "flash_attention_128_f16",
    "flash_attention_128_q8_0",
    "flash_attention_128_q4_0",
    "flash_attention_256_f16",
    "flash_attention_256_q8_0",
    "flash_attention_256_q4_0",
];

/// How a batch's query rows fall into blocks: `heads` heads of one KV head's group share a
/// block (`head_blocks` blocks cover the group), for `tokens` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct FlashLayout {
    pub(super) heads: usize,
    pub(super) head_blocks: usize,
    pub(super) tokens: usize,
}

impl FlashLayout {
    /// The layout for `n_heads` query heads over `n_kv_heads` KV heads (a divisor of it).
    pub(super) fn new(n_heads: usize, n_kv_heads: usize) -> Self {
        let group = (n_heads / n_kv_heads.max(1)).max(1);
        let heads = group.min(ROWS_PER_BLOCK);
        Self {
            heads,
            head_blocks: group.div_ceil(heads),
            tokens: ROWS_PER_BLOCK / heads,
        }
    }
}

/// The head sizes whose flash kernel this device can run (tensor-core mma.sync and
/// cp.async need compute capability 8.0; each size needs its shared memory), with the
/// kernels' shared-memory limit raised to what they take.
#[derive(Clone, Debug, Default)]
pub(super) struct FlashKernels {
    head_dims: Vec<usize>,
}

impl FlashKernels {
    /// Enables the kernels `ctx`'s device can run.
    pub(super) fn enable(ctx: &CudaContext, cc: (i32, i32), kernels: &Kernels) -> Result<Self> {
        if cc.0 < 8 {
            return Ok(Self::default());
        }
        let limit = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(|e| driver_err("reading the device's shared memory per block", e))?;
        let limit = usize::try_from(limit).unwrap_or(0);
        let mut head_dims = Vec::new();
        for d in HEAD_DIMS {
            let bytes = shared_bytes(d);
            if bytes > limit {
                continue;
            }
            // A size whose limit the driver will not raise keeps the kernels it had.
            let raised = [GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0]
                .iter()
                .filter_map(|&ty| entry(d, ty))
                .try_fold(true, |ok, name| {
                    let set = kernels.get(name)?.function.set_attribute(
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        bytes as i32,
                    );
                    Ok::<_, crate::ComputeError>(ok && set.is_ok())
                })?;
            if raised {
                head_dims.push(d);
            }
        }
        Ok(Self { head_dims })
    }

    /// Kernels for `head_dims`, as if the device ran them (for tests of the selection).
    #[cfg(test)]
    pub(super) fn with_head_dims(head_dims: &[usize]) -> Self {
        Self {
            head_dims: head_dims.to_vec(),
        }
    }

    /// The head sizes the kernel runs for.
    pub(super) fn head_dims(&self) -> &[usize] {
        &self.head_dims
    }

    /// The flash kernel for a batch over a cache of `ty` with heads of `head_dim`, when
    /// this device runs one.
    pub(super) fn kernel(&self, ty: GgmlType, head_dim: usize) -> Option<&'static str> {
        if !self.head_dims.contains(&head_dim) {
            return None;
        }
        entry(head_dim, ty)
    }
}

/// The launch of the flash kernel for `n_tokens` queries of `shape` (see
/// attention_flash.cu); its arguments are those of the CUDA-core tiled kernel.
pub(super) fn launch_config(shape: AttnShape, n_tokens: usize) -> LaunchConfig {
    let layout = FlashLayout::new(shape.n_heads, shape.n_kv_heads);
    LaunchConfig {
        grid_dim: (
            (shape.n_kv_heads * layout.head_blocks) as u32,
            n_tokens.div_ceil(layout.tokens) as u32,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared_bytes(shape.head_dim) as u32,
    }
}

/// Cells one block should at least walk when the flash kernel splits its cells.
const MIN_CELLS_PER_SPLIT: usize = 512;
/// Most splits of the flash kernel's cells.
const MAX_SPLITS: usize = 32;

/// How many blocks share the cells of each flash block: one when its `blocks` fill the GPU
/// (`sm_count` multiprocessors), else enough to fill it twice over, each walking at least
/// [`MIN_CELLS_PER_SPLIT`] of the `longest` span's cells, and no more than the scratch holds
/// (`scratch_splits`).
pub(super) fn splits(
    blocks: usize,
    longest: usize,
    sm_count: usize,
    scratch_splits: usize,
) -> usize {
    if blocks >= sm_count {
        return 1;
    }
    (2 * sm_count)
        .div_ceil(blocks.max(1))
        .min(longest / MIN_CELLS_PER_SPLIT)
        .min(MAX_SPLITS)
        .min(scratch_splits)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_takes_the_heads_of_one_kv_head() {
        // LLaMA 3 8B (32 / 8): 4 heads of 16 tokens.
        let l = FlashLayout::new(32, 8);
        assert_eq!((l.heads, l.head_blocks, l.tokens), (4, 1, 16));
        // No grouping: 64 tokens of one head.
        assert_eq!(FlashLayout::new(16, 16).tokens, 64);
        // Groups that do not divide the rows leave padding: 3 heads of 21 tokens.
        let l = FlashLayout::new(6, 2);
        assert_eq!((l.heads, l.tokens), (3, 21));
        // A group larger than a block is split over blocks of one token.
        let l = FlashLayout::new(128, 1);
        assert_eq!((l.heads, l.head_blocks, l.tokens), (64, 2, 1));
    }

    #[test]
    fn only_batches_that_leave_the_gpu_idle_are_split() {
        // A 512-token chunk of LLaMA 3 8B: 8 KV heads x 32 blocks of 16 tokens.
        assert_eq!(splits(256, 16_384, 132, 100), 1);
        // 20 tokens after 16k cells: 8 x 2 blocks, 17 splits of ~1000 cells.
        assert_eq!(splits(16, 16_400, 132, 100), 17);
        // Short spans are not split below 512 cells a block...
        assert_eq!(splits(16, 1500, 132, 100), 2);
        assert_eq!(splits(16, 300, 132, 100), 1);
        // ...nor past the cap or what the scratch holds.
        assert_eq!(splits(1, 1 << 20, 132, 100), MAX_SPLITS);
        assert_eq!(splits(16, 16_400, 132, 3), 3);
    }

    #[test]
    fn every_head_size_and_cache_type_has_an_entry() {
        for d in HEAD_DIMS {
            for ty in [GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0] {
                let name = entry(d, ty).expect("an entry");
                assert!(ENTRIES.contains(&name), "{name} is not loaded");
            }
        }
        assert_eq!(entry(32, GgmlType::F16), None);
        assert_eq!(entry(128, GgmlType::Q4K), None);
        // The largest heads fit an H100's 227 KiB, not the 48 KiB without opting in.
        assert!(shared_bytes(256) <= 227 * 1024 && shared_bytes(256) > 48 * 1024);
    }
}
