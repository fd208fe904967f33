//! Products of batches too large for the decode kernels and too small for the f16 GEMM to
//! pay for its decoding pass (kernels/mmq.cu): the weights are multiplied straight from
//! their quantized blocks on the int8 tensor cores, against activations quantized once to
//! 8 bits per 32 values.
//!
//! The activations, their scales and split-K partial sums live in the GEMM's workspace
//! (gemm.rs), which the two paths never use at once, so this path allocates nothing.

use cudarc::driver::LaunchConfig;
use tether_gguf::GgmlType;

use super::CudaBackend;
use super::check::{row_bytes, shape_err};
use super::gemm::{MMQ_XQ_BYTES, PARTIAL_ELEMS, THREADS, TILE_K, split_k};
use super::kernel_files::{define, source};
use super::launch::{Arg, grid_for, int};
use super::matvec::{MatmulArgs, XQ_MAX_COLS};
use crate::backend::Result;

/// Tile of one block (`MMQ_ROWS` x `MMQ_TOKENS` in mmq.cu), its threads, and the columns it
/// takes per pass (`MMQ_K`).
const TILE_ROWS: usize = define(source::MMQ, "MMQ_ROWS");
const TILE_TOKENS: usize = define(source::MMQ, "MMQ_TOKENS");
const BLOCK_THREADS: u32 = define(source::MMQ, "MMQ_THREADS") as u32;
const K_CHUNK: usize = define(source::MMQ, "MMQ_K");
/// Most row tiles of one launch (grid y).
const MAX_ROW_TILES: usize = 65_535;

/// The largest batch these kernels take unless [`super::CudaTuning::mmq_max_tokens`] says
/// otherwise. On an H100 (llama3-8b's products of a layer, `cuda_mmq bench_`) they take
/// 0.55-0.62x of the time of the f16 GEMM path for Q4_K and Q6_K at 17-64 tokens, and
/// 0.47-0.82x for Q4_0 / Q8_0 at 32-64; past 64 a second token tile reads every weight
/// again and at 128 the GEMM is as fast for the K-quants. Weights the GEMM decodes in its
/// own tiles (gemm.rs: packed rows, Q4_K, Q5_K) take the GEMM from 17 tokens instead, so
/// these kernels keep their smaller batches and the rows left in GGUF's layout.
pub(crate) const MMQ_MAX_TOKENS: usize = 64;
/// Below this the decode kernels (launches of 8 tokens reading each weight once) win for
/// Q5_K and IQ4_XS, not measured at fewer tokens.
pub(crate) const MMQ_MIN_TOKENS: usize = 17;
/// Q6_K's decode kernels are the slowest: from 9 tokens, two launches of them, a layer's
/// products take 0.85x / 0.71x / 0.54x of their time at 9 / 12 / 16 tokens (H100).
const MMQ_MIN_TOKENS_Q6_K: usize = 9;
/// Q4_K's: at 9 and 12 tokens the products take 1.38x / 1.18x of their time, at 16 0.93x.
const MMQ_MIN_TOKENS_Q4_K: usize = 16;
/// Q4_0 and Q8_0 have faster decode kernels than the other types: below this many tokens
/// those are as fast (265 against 268 us a layer at 17 tokens on the H100).
const MMQ_MIN_TOKENS_LEGACY: usize = 32;

/// Blocks per multiprocessor K is split to fill (2, 4 and 8 measured on an H100: 2 was
/// fastest, 8 slowest, by up to 15%; more splits write more partial sums).
pub(crate) const MMQ_BLOCKS_PER_SM: usize = 2;

/// The largest batch these kernels take on a device of compute capability `cc`: `tuned`
/// ([`super::CudaTuning::mmq_max_tokens`]) or [`MMQ_MAX_TOKENS`]; 0 when they take none
/// (below 8.0 always).
pub(super) fn mmq_max_tokens(cc: (i32, i32), tuned: Option<usize>) -> usize {
    if cc.0 < 8 {
        return 0;
    }
    tuned.unwrap_or(MMQ_MAX_TOKENS)
}

/// The mmq.cu kernel for `ty` weights (`packed` as stored): Q4_0, Q8_0, Q6_K and IQ4_XS in
/// either layout, Q4_K and Q5_K as GGUF stores them (they are never packed).
fn kernel(ty: GgmlType, packed: bool) -> Option<&'static str> {
    Some(match (ty, packed) {
        (GgmlType::Q4_0, false) => "mmq_q4_0",
        (GgmlType::Q4_0, true) => "mmq_q4_0p",
        (GgmlType::Q8_0, false) => "mmq_q8_0",
        (GgmlType::Q8_0, true) => "mmq_q8_0p",
        (GgmlType::Q4K, false) => "mmq_q4_k",
        (GgmlType::Q5K, false) => "mmq_q5_k",
        (GgmlType::Q6K, false) => "mmq_q6_k",
        (GgmlType::Q6K, true) => "mmq_q6_kp",
        (GgmlType::IQ4XS, false) => "mmq_iq4_xs",
        (GgmlType::IQ4XS, true) => "mmq_iq4_xsp",
        _ => return None,
    })
}

/// The fewest tokens the kernels take for weights of type `ty`.
fn min_tokens(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q8_0 => MMQ_MIN_TOKENS_LEGACY,
        GgmlType::Q6K => MMQ_MIN_TOKENS_Q6_K,
        GgmlType::Q4K => MMQ_MIN_TOKENS_Q4_K,
        _ => MMQ_MIN_TOKENS,
    }
}

/// The kernel that takes this product, if any: a type it reads, whole 8-bit blocks of
/// activations, a row count the grid holds and from [`min_tokens`] to `max_tokens`
/// tokens.
pub(super) fn mmq_kernel(a: &MatmulArgs, max_tokens: usize) -> Option<&'static str> {
    let fits = a.cols > 0
        && a.cols.is_multiple_of(32)
        && a.cols <= XQ_MAX_COLS
        && a.rows.div_ceil(TILE_ROWS) <= MAX_ROW_TILES
        && (min_tokens(a.ty)..=max_tokens).contains(&a.n_tokens);
    if fits { kernel(a.ty, a.packed) } else { None }
}

impl CudaBackend {
    /// This backend with the tensor-core products taking batches of 9 to 32 (by type, see
    /// `min_tokens`) to `max_tokens` tokens (0: none), whatever the backend was tuned with: tests
    /// of each path, and one path against the other in one process. Devices before
    /// compute capability 8.0 never take them.
    pub fn with_mmq_max_tokens(mut self, max_tokens: usize) -> Self {
        if self.mmq_capable {
            self.mmq_max_tokens = max_tokens;
        }
        self
    }

    /// The product of `a` with `kernel` (from [`mmq_kernel`]): the tokens converted to f16
    /// once, then one launch per chunk of tokens the workspace holds, K split
    /// across blocks when the tiles alone leave the GPU idle (partials summed in a fixed
    /// order by gemm.cu's `gemm_reduce`, so results are deterministic).
    pub(super) fn mmq(&self, a: &MatmulArgs, kernel: &str) -> Result<()> {
        const OP: &str = "matmul";
        let rb = row_bytes(OP, a.ty, a.cols)?;
        let (rows_arg, cols_arg) = (int(OP, "rows", a.rows)?, int(OP, "cols", a.cols)?);
        // The tokens as f16, in the workspace's f16 token area.
        let token_chunk = MMQ_XQ_BYTES / 2 / a.cols;
        if token_chunk == 0 {
            return Err(shape_err(
                OP,
                format!("{} columns do not fit the f16 token workspace", a.cols),
            ));
        }
        let chunks = a.cols.div_ceil(K_CHUNK);
        // Held while enqueuing, as the GEMM holds it (one stream orders the calls).
        let ws = self.lock_gemm();
        let (xh, xs, partials) = ws.areas();
        for t0 in (0..a.n_tokens).step_by(token_chunk) {
            let nt = (a.n_tokens - t0).min(token_chunk);
            let args = [
                Arg::Ptr(a.x + (t0 * a.cols * 4) as u64),
                cols_arg,
                Arg::Ptr(xh),
                Arg::Ptr(xs),
            ];
            let cfg = LaunchConfig {
                grid_dim: (nt as u32, 1, 1),
                block_dim: (BLOCK_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            self.run("mmq_tokens_f16", cfg, &args)?;
            let (m_tiles, n_tiles) = (a.rows.div_ceil(TILE_ROWS), nt.div_ceil(TILE_TOKENS));
            // split_k counts K in GEMM tiles of 32 columns; a split here is whole chunks.
            let (_, per_split) = split_k(
                m_tiles * n_tiles,
                a.cols.div_ceil(TILE_K),
                nt * a.rows,
                self.mmq_blocks_per_sm * self.sm_count,
            );
            let per_split = per_split.div_ceil(K_CHUNK / TILE_K);
            let splits = chunks.div_ceil(per_split);
            let out = a.out + (t0 * a.rows * 4) as u64;
            let (dst, stride) = if splits == 1 {
                (out, 0)
            } else {
                (partials, (nt * a.rows) as u64)
            };
            debug_assert!(splits == 1 || splits * nt * a.rows <= PARTIAL_ELEMS);
            let accumulate = Arg::I32(i32::from(a.accumulate));
            let cfg = LaunchConfig {
                grid_dim: (n_tiles as u32, m_tiles as u32, splits as u32),
                block_dim: (BLOCK_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let args = [
                Arg::Ptr(a.w),
                Arg::U64(rb as u64),
                rows_arg,
                cols_arg,
                Arg::Ptr(xh),
                Arg::Ptr(xs),
                Arg::I32(nt as i32),
                Arg::I32(per_split as i32),
                Arg::Ptr(dst),
                rows_arg,
                Arg::U64(stride),
                // Partials are written whole; their sum is what gets added.
                if splits == 1 { accumulate } else { Arg::I32(0) },
            ];
            self.run(kernel, cfg, &args)?;
            if splits > 1 {
                let args = [
                    Arg::Ptr(partials),
                    Arg::I32(splits as i32),
                    Arg::U64(stride),
                    rows_arg,
                    Arg::I32(nt as i32),
                    Arg::Ptr(out),
                    rows_arg,
                    accumulate,
                ];
                self.run("gemm_reduce", grid_for(nt * a.rows, THREADS), &args)?;
            }
        }
        drop(ws);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(ty: GgmlType, packed: bool, rows: usize, cols: usize, n_tokens: usize) -> MatmulArgs {
        MatmulArgs {
            w: 0,
            ty,
            packed,
            rows,
            cols,
            x: 0,
            n_tokens,
            out: 0,
            accumulate: false,
        }
    }

    #[test]
    fn takes_its_types_and_sizes_only() {
        let q4 = |packed, cols, n| mmq_kernel(&args(GgmlType::Q4_0, packed, 4096, cols, n), 256);
        assert_eq!(q4(true, 4096, 32), Some("mmq_q4_0p"));
        assert_eq!(
            q4(true, 4096, 31),
            None,
            "Q4_0's decode kernels win below 32"
        );
        assert_eq!(q4(false, 288, 256), Some("mmq_q4_0"));
        assert_eq!(
            q4(true, 4096, 16),
            None,
            "decode batches keep the matvec kernels"
        );
        assert_eq!(q4(true, 4096, 257), None, "prefill batches keep the GEMM");
        assert_eq!(q4(false, 100, 64), None, "no whole 8-bit blocks");
        assert_eq!(q4(false, XQ_MAX_COLS + 32, 64), None);
        let k = |ty, packed| mmq_kernel(&args(ty, packed, 100, 2048, 64), 256);
        assert_eq!(k(GgmlType::Q4K, false), Some("mmq_q4_k"));
        assert_eq!(k(GgmlType::Q5K, false), Some("mmq_q5_k"));
        assert_eq!(k(GgmlType::Q6K, true), Some("mmq_q6_kp"));
        assert_eq!(k(GgmlType::IQ4XS, false), Some("mmq_iq4_xs"));
        assert_eq!(k(GgmlType::Q3K, true), None);
        assert_eq!(k(GgmlType::F16, false), None);
        let tall = args(
            GgmlType::Q8_0,
            false,
            TILE_ROWS * MAX_ROW_TILES + 1,
            256,
            64,
        );
        assert_eq!(
            mmq_kernel(&tall, 256),
            None,
            "more row tiles than grid y holds"
        );
        let wide = args(GgmlType::Q8_0, true, 4096, 4096, 512);
        assert_eq!(mmq_kernel(&wide, 512), Some("mmq_q8_0p"), "a larger bound");
        assert_eq!(
            mmq_kernel(&args(GgmlType::Q8_0, true, 64, 256, 40), 0),
            None,
            "off"
        );
        let by = |ty, n| mmq_kernel(&args(ty, false, 64, 256, n), MMQ_MAX_TOKENS);
        assert_eq!(by(GgmlType::Q6K, 9), Some("mmq_q6_k"), "Q6_K from 9 tokens");
        assert_eq!(
            by(GgmlType::Q6K, 8),
            None,
            "one launch of the decode kernels"
        );
        assert_eq!(
            by(GgmlType::Q4K, 15),
            None,
            "Q4_K's decode kernels up to 15"
        );
        assert_eq!(by(GgmlType::Q4K, 16), Some("mmq_q4_k"));
        assert_eq!(by(GgmlType::Q5K, 16), None, "the others from 17");
        assert_eq!(by(GgmlType::Q5K, 17), Some("mmq_q5_k"));
    }
}
