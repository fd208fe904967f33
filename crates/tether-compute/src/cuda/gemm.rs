//! Prefill matmul on tensor cores (kernels/gemm.cu): the tokens are converted to f16 and one
//! GEMM multiplies them with the weights. Packed Q4_0 / Q8_0 / Q6_K / IQ4_XS and Q4_K / Q5_K
//! weights are decoded inside the GEMM's tiles; other types' rows are decoded to f16 in a
//! workspace chunk first.
//!
//! The workspace is allocated once with the backend, so serving never allocates device
//! memory here; a matmul larger than it runs in chunks of rows and of tokens. Chunks too
//! small to fill the GPU split K across blocks, summed in a fixed order (deterministic).

use std::sync::{Arc, MutexGuard};

use cudarc::driver::LaunchConfig;
use tether_gguf::GgmlType;

use super::check::{row_bytes, shape_err};
use super::device::Device;
use super::kernel_files::{define, source};
use super::launch::{Arg, grid_for, int};
use super::matvec::MatmulArgs;
use super::{CudaBackend, CudaBuffer};
use crate::backend::{DeviceBuffer, Result};

/// Batches of at least this many tokens over weights the GEMM reads through its f16
/// workspace take the GEMM path; smaller ones the matvec
/// kernels (launches of 8 tokens each), which need no decoding pass. On an H100, llama3-8b
/// Q4_0, a decode step of 8 tokens takes 6.8 ms through the matvec kernels and one of 16
/// to 64 tokens 21.8-23.7 ms through the GEMM, whose decoding of every weight matrix to f16
/// is most of its cost at these sizes (`tether bench --parallel`): two matvec launches
/// (13.6 ms) beat it, four do not.
pub const GEMM_MIN_TOKENS: usize = 17;
/// The same for packed Q4_0 and Q8_0 weights on devices whose tensor cores take their
/// products (matvec_mma.cu, launches of up to 32 tokens). On an H100, llama3-8b decode
/// steps of 48 tokens ran at 2,149 / 2,178 t/s (Q4_0 / Q8_0) that way against the GEMM's
/// 2,084 / 2,052, and steps of 64 at 2,185 / 2,433 against 2,671 / 2,629.
pub const GEMM_MIN_TOKENS_MMA: usize = 49;
/// Batches of at least this many tokens over weights the GEMM decodes in its tiles take
/// it, in tiles of 32 or 64 tokens up to 64. On an H100, llama3-8b Q4_K_M, `tether bench
/// --parallel 9,12,16 -p 128 -n 128` ran at 1,095 / 1,436 / 1,952 t/s this way against
/// 723 / 890 / 1,094 by the routes before (matvec launches of 8, the products from the
/// blocks).
pub const GEMM_DECODING_MIN_TOKENS: usize = 9;
/// The same for packed Q4_0 and Q8_0 on devices whose tensor cores take their matvecs:
/// those won at 9 and 12 tokens (Q4_0: 1,314 / 1,502 t/s against 1,150 / 1,434), the GEMM
/// at 16 (2,015 against 1,818).
pub const GEMM_DECODING_MIN_TOKENS_MMA: usize = 16;

/// f16 values of the decoded-weight chunk (64 MiB).
const W16_ELEMS: usize = 32 << 20;
/// f16 values of the converted-token chunk (16 MiB).
pub(super) const X16_ELEMS: usize = 8 << 20;
/// f32 split-K partial sums (32 MiB): 4 splits of 512 tokens x 4096 rows.
pub(super) const PARTIAL_ELEMS: usize = 8 << 20;
/// Most K splits of one chunk, and the fewest K tiles a split keeps (fewer and the
/// pipeline fill and the partial write dominate).
const MAX_SPLITS: usize = 16;
const MIN_SPLIT_K_TILES: usize = 8;
/// Blocks of the tile kernel resident per multiprocessor (its launch bounds); split K
/// until this many are busy. Measured best: 1 leaves small grids idle, 4 pays more for
/// partial sums than it gains.
pub(super) const BLOCKS_PER_SM: usize = 2;
/// Tile sizes of the tile kernels (`GEMM_M`, `GEMM_N`, `GEMM_K` in gemm.cu).
pub(super) const TILE_M: usize = define(source::GEMM, "GEMM_M");
pub(super) const TILE_N: usize = define(source::GEMM, "GEMM_N");
pub(super) const TILE_K: usize = define(source::GEMM, "GEMM_K");
/// Most row tiles of one launch (grid y).
pub(super) const MAX_GRID_Y: usize = 65_535;
/// Threads per block of the element-wise gemm.cu kernels.
pub(super) const THREADS: u32 = 256;

/// Blocks per multiprocessor of the decoding kernels' narrow variants
/// (`GEMM_NARROW_BLOCKS`).
const NARROW_BLOCKS_PER_SM: usize = define(source::GEMM, "GEMM_NARROW_BLOCKS");

/// One instantiation of gemm.cu's `gemm_block`: its entry point, threads per block,
/// whether it decodes the weight's blocks itself (else it reads the f16 workspace), tokens
/// a tile, blocks resident per multiprocessor (its launch bounds), and whether it takes
/// up to three weights (`GROUPED`: the narrow variants, whose launches add four arguments).
#[derive(Clone, Copy, Debug)]
pub(super) struct TileKernel {
    pub name: &'static str,
    pub threads: u32,
    decodes: bool,
    pub tile_n: usize,
    pub blocks_per_sm: usize,
    pub grouped: bool,
}

/// 8 warps of 64 x 32 outputs: the same sums as `WARPS_64X64`, bit for bit, so the tests
/// check one against the other.
#[cfg(test)]
const WARPS_64X32: TileKernel = TileKernel {
    name: "gemm_f16",
    threads: 256,
    decodes: false,
    tile_n: TILE_N,
    blocks_per_sm: BLOCKS_PER_SM,
    grouped: false,
};
/// 4 warps of 64 x 64 outputs: half the shared-memory reads per mma, more registers.
const WARPS_64X64: TileKernel = TileKernel {
    name: "gemm_f16_wide",
    threads: 128,
    decodes: false,
    tile_n: TILE_N,
    blocks_per_sm: BLOCKS_PER_SM,
    grouped: false,
};

/// The gemm.cu kernels that decode the blocks of `a`'s weight in their tiles, if any, as
/// (32-, 64-, 128-token tiles): packed Q4_0 / Q8_0 / Q6_K / IQ4_XS, Q4_K and Q5_K, whose
/// quants they read 16 bytes at a time (so the rows must start 16-byte aligned), in one
/// launch (so the row tiles must fit grid y). Other types are decoded to the f16 workspace
/// first. On an H100, llama3-8b pp512 (`tether bench`) ran at 13,511-13,620 t/s this way
/// against 11,272 through the workspace for Q4_0, 12,432-12,481 against 11,157 for Q4_K_M
/// and 11,579-11,596 against 10,656 for Q6_K.
pub(super) fn decoding_kernel(a: &MatmulArgs) -> Option<[&'static str; 3]> {
    let names = match (a.ty, a.packed) {
        (GgmlType::Q4_0, true) => ["gemmq_q4_0p_n32", "gemmq_q4_0p_n64", "gemmq_q4_0p"],
        (GgmlType::Q8_0, true) => ["gemmq_q8_0p_n32", "gemmq_q8_0p_n64", "gemmq_q8_0p"],
        (GgmlType::Q4K, false) => ["gemmq_q4_k_n32", "gemmq_q4_k_n64", "gemmq_q4_k"],
        (GgmlType::Q5K, false) => ["gemmq_q5_k_n32", "gemmq_q5_k_n64", "gemmq_q5_k"],
        (GgmlType::Q6K, true) => ["gemmq_q6_kp_n32", "gemmq_q6_kp_n64", "gemmq_q6_kp"],
        (GgmlType::IQ4XS, true) => ["gemmq_iq4_xsp_n32", "gemmq_iq4_xsp_n64", "gemmq_iq4_xsp"],
        _ => return None,
    };
    let aligned = a.w.is_multiple_of(16)
        && a.ty
            .bytes_for(a.cols as u64)
            .is_some_and(|rb| rb.is_multiple_of(16));
    let fits = a.cols.is_multiple_of(TILE_K) && a.rows.div_ceil(TILE_M) <= MAX_GRID_Y;
    (aligned && fits).then_some(names)
}

/// Of gemm.cu's `gemmq_*` kernels `names` (from [`decoding_kernel`]), the one for `n_tokens`:
/// the narrowest token tile that holds them, or the 128-token one (`WARPS_64X64`'s tiles).
pub(super) fn decoding(names: [&'static str; 3], n_tokens: usize) -> TileKernel {
    let (name, tile_n, blocks_per_sm) = match n_tokens {
        0..=32 => (names[0], 32, NARROW_BLOCKS_PER_SM),
        33..=64 => (names[1], 64, NARROW_BLOCKS_PER_SM),
        _ => (names[2], TILE_N, BLOCKS_PER_SM),
    };
    TileKernel {
        name,
        threads: WARPS_64X64.threads,
        decodes: true,
        tile_n,
        blocks_per_sm,
        grouped: tile_n < TILE_N,
    }
}

/// The tile kernel `matmul` uses: on an H100 (`gpu_bench_tile_kernels`, Q8_0, 512 tokens)
/// 8B-shape matmuls took 1.12 ms a layer with it against 1.21 ms with `WARPS_64X32`.
const TILE_KERNEL: TileKernel = WARPS_64X64;

const OP: &str = "matmul";

/// The workspaces of the GEMM path (f16 operands, f32 split-K partials), owned by the
/// backend.
pub(super) struct GemmWorkspace {
    w16: CudaBuffer,
    x16: CudaBuffer,
    partials: CudaBuffer,
}

impl GemmWorkspace {
    pub(super) fn new(device: &Arc<Device>) -> Result<Self> {
        Ok(Self {
            w16: device.alloc(W16_ELEMS * 2)?,
            x16: device.alloc(X16_ELEMS * 2)?,
            partials: device.alloc(PARTIAL_ELEMS * 4)?,
        })
    }

    pub(super) fn bytes(&self) -> usize {
        self.w16.bytes() + self.x16.bytes() + self.partials.bytes()
    }

    /// The workspace's (f16 token chunk, f16 weight chunk, split-K partials) addresses, for
    /// the products that share it: [`X16_ELEMS`] tokens ([`MMQ_XQ_BYTES`] bytes), the
    /// weight chunk (mmq.rs keeps its tokens' scales in a quarter of it; the grouped
    /// products of gemm_grouped.rs decode in their tiles and leave it), [`PARTIAL_ELEMS`]
    /// partials.
    pub(super) fn areas(&self) -> (u64, u64, u64) {
        (self.x16.ptr(), self.w16.ptr(), self.partials.ptr())
    }
}

/// Bytes of tokens the products of mmq.rs convert to f16 into the f16 token chunk.
pub(super) const MMQ_XQ_BYTES: usize = X16_ELEMS * 2;
// Their scales take a quarter of that in the (larger) f16 weight chunk.
const _: () = assert!(MMQ_XQ_BYTES / 4 <= W16_ELEMS * 2);

/// Workspace row length: `cols` rounded up to the GEMM's K step, so the kernel has no K
/// tail and every workspace row is 64-byte aligned.
pub(super) fn padded_cols(cols: usize) -> Result<usize> {
    cols.checked_next_multiple_of(TILE_K)
        .ok_or_else(|| shape_err(OP, format!("{cols} columns overflow")))
}

/// Weight rows decoded per chunk: as many whole 128-row tiles as the workspace holds (or
/// fewer rows when a single tile does not fit), so only the last chunk has an edge tile.
fn rows_per_chunk(kp: usize) -> usize {
    let fit = W16_ELEMS / kp;
    if fit >= TILE_M {
        fit / TILE_M * TILE_M
    } else {
        fit
    }
}

/// K splits for a chunk of `tiles` output tiles over `k_tiles` K tiles, each split's
/// partial `partial_elems` f32: enough splits to fill the GPU's `slots` resident blocks
/// when the tiles alone do not, within the partials workspace. Returns (splits, K tiles
/// per split), every split non-empty.
pub(super) fn split_k(
    tiles: usize,
    k_tiles: usize,
    partial_elems: usize,
    slots: usize,
) -> (usize, usize) {
    let wanted = slots / tiles.max(1);
    let splits = wanted
        .min(MAX_SPLITS)
        .min(k_tiles / MIN_SPLIT_K_TILES)
        .min(PARTIAL_ELEMS / partial_elems.max(1))
        .max(1);
    let per_split = k_tiles.div_ceil(splits);
    (k_tiles.div_ceil(per_split), per_split)
}

impl CudaBackend {
    pub(super) fn lock_gemm(&self) -> MutexGuard<'_, GemmWorkspace> {
        // The workspace holds no state between calls, so a poisoned lock is still usable.
        self.gemm_ws.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The matmul of `a` on tensor cores; the caller has checked the buffers' sizes and
    /// that no dimension is zero. Weights of the types gemm.cu decodes in its tiles skip
    /// the f16 workspace unless tuned off: decoding to it took 20% of llama3-8b pp512's
    /// kernel time (ncu, H200).
    pub(super) fn gemm(&self, a: &MatmulArgs) -> Result<()> {
        let tile = decoding_kernel(a)
            .filter(|_| self.fused_gemm)
            .map_or(TILE_KERNEL, |names| decoding(names, a.n_tokens));
        self.gemm_with(a, tile, tile.blocks_per_sm)
    }

    /// This backend with the GEMM decoding the weight types it can in its tiles and taking
    /// their batches from its smallest size on (`on`, the default unless tuned off), or
    /// neither (every type through the f16 workspace, batches of up to 64 tokens to the
    /// products from the blocks), whatever it was tuned with: tests of each path.
    pub fn with_fused_gemm(mut self, on: bool) -> Self {
        self.fused_gemm = on;
        self
    }

    /// Whether [`Self::gemm`] decodes `a`'s weight in its tiles (no workspace pass).
    pub(super) fn gemm_decodes(&self, a: &MatmulArgs) -> bool {
        self.fused_gemm && decoding_kernel(a).is_some()
    }

    /// Tokens `x` (`nt` rows of `cols` f32) into the f16 token chunk `x16` as the tile
    /// kernels read it: rows of `kp` values, the padding zeroed (the second argument is
    /// `cols` and `kp` as kernel arguments).
    pub(super) fn tokens_to_f16(
        &self,
        x: u64,
        (cols_arg, kp_arg): (Arg, Arg),
        nt: usize,
        kp: usize,
        x16: u64,
    ) -> Result<()> {
        let args = [
            Arg::Ptr(x),
            cols_arg,
            kp_arg,
            int(OP, "token count", nt)?,
            Arg::Ptr(x16),
        ];
        self.run("gemm_x_f16", grid_for(nt * kp / 8, THREADS), &args)
    }

    /// The GEMM with tile kernel `tile`, splitting K until `blocks_per_sm` blocks per
    /// multiprocessor are busy.
    fn gemm_with(&self, a: &MatmulArgs, tile: TileKernel, blocks_per_sm: usize) -> Result<()> {
        let rb = row_bytes(OP, a.ty, a.cols)?;
        let kp = padded_cols(a.cols)?;
        // A decoding kernel reads the weight in place: all its rows in one launch.
        let row_chunk = if tile.decodes {
            a.rows
        } else {
            rows_per_chunk(kp)
        };
        let token_chunk = X16_ELEMS / kp;
        if row_chunk == 0 || token_chunk == 0 {
            return Err(shape_err(
                OP,
                format!(
                    "{} columns do not fit the GEMM workspace of {W16_ELEMS} f16 weights \
                     and {X16_ELEMS} f16 inputs",
                    a.cols
                ),
            ));
        }
        // Every index the kernels compute in 32 bits: columns, rows (the output stride)
        // and tokens; bigger products are 64-bit there.
        let (cols_arg, kp_arg) = (int(OP, "cols", a.cols)?, int(OP, "padded cols", kp)?);
        let ldo = int(OP, "rows", a.rows)?;
        let _ = int(OP, "token count", a.n_tokens)?;
        let ty = Arg::I32(if a.packed {
            super::packed::packed_type_id(a.ty)
        } else {
            a.ty.id() as i32
        });

        // Held while enqueuing: the one stream orders the kernels of successive calls, so
        // the next call may reuse the workspace as soon as this one has enqueued.
        let ws = self.lock_gemm();
        let (x16, w16, partials) = ws.areas();
        for t0 in (0..a.n_tokens).step_by(token_chunk) {
            let nt = (a.n_tokens - t0).min(token_chunk);
            let x = a.x + (t0 * a.cols * 4) as u64;
            self.tokens_to_f16(x, (cols_arg, kp_arg), nt, kp, x16)?;
            for r0 in (0..a.rows).step_by(row_chunk) {
                let nr = (a.rows - r0).min(row_chunk);
                let rows_at = a.w + (r0 * rb) as u64;
                let (wa, wa_row_bytes) = if tile.decodes {
                    (rows_at, rb)
                } else {
                    let args = [
                        Arg::Ptr(rows_at),
                        ty,
                        Arg::U64(rb as u64),
                        cols_arg,
                        kp_arg,
                        Arg::I32(nr as i32),
                        Arg::Ptr(w16),
                    ];
                    self.run("gemm_dequant_f16", grid_for(nr * kp / 8, THREADS), &args)?;
                    (w16, kp * 2)
                };
                let (m_tiles, n_tiles) = (nr.div_ceil(TILE_M), nt.div_ceil(tile.tile_n));
                let (splits, k_tiles) = split_k(
                    m_tiles * n_tiles,
                    kp / TILE_K,
                    nt * nr,
                    blocks_per_sm * self.sm_count,
                );
                let out = a.out + ((t0 * a.rows + r0) * 4) as u64;
                // One split writes the result itself; more write partials [split][nt][nr].
                let (dst, dst_ld, stride) = if splits == 1 {
                    (out, ldo, 0)
                } else {
                    (partials, Arg::I32(nr as i32), (nt * nr) as u64)
                };
                // Token tiles on x: consecutive blocks share a weight tile (see gemm.cu).
                let cfg = LaunchConfig {
                    grid_dim: (n_tiles as u32, m_tiles as u32, splits as u32),
                    block_dim: (tile.threads, 1, 1),
                    shared_mem_bytes: 0,
                };
                let accumulate = Arg::I32(i32::from(a.accumulate));
                let mut args = vec![
                    Arg::Ptr(wa),
                    Arg::U64(wa_row_bytes as u64),
                    Arg::Ptr(x16),
                    Arg::I32(nr as i32),
                    Arg::I32(nt as i32),
                    kp_arg,
                    Arg::I32(k_tiles as i32),
                    Arg::Ptr(dst),
                    dst_ld,
                    Arg::U64(stride),
                    // Partials are written whole; their sum is what gets added.
                    if splits == 1 { accumulate } else { Arg::I32(0) },
                ];
                if tile.grouped {
                    // One weight: every row tile is `wa`'s.
                    let rows = Arg::I32(nr as i32);
                    args.extend([Arg::Ptr(wa), Arg::Ptr(wa), rows, rows]);
                }
                self.run(tile.name, cfg, &args)?;
                if splits > 1 {
                    let args = [
                        Arg::Ptr(partials),
                        Arg::I32(splits as i32),
                        Arg::U64(stride),
                        Arg::I32(nr as i32),
                        Arg::I32(nt as i32),
                        Arg::Ptr(out),
                        ldo,
                        accumulate,
                    ];
                    self.run("gemm_reduce", grid_for(nt * nr, THREADS), &args)?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_whole_tiles_and_fit_the_workspace() {
        let kp = padded_cols(4096).unwrap();
        assert_eq!(kp, 4096);
        let rows = rows_per_chunk(kp);
        assert_eq!(rows % TILE_M, 0);
        assert!(rows * kp <= W16_ELEMS);
        assert_eq!(padded_cols(100).unwrap(), 128);
        // A row too long for 128 rows still gets a chunk of fewer rows.
        let huge = W16_ELEMS / 4;
        assert_eq!(rows_per_chunk(huge), 4);
        assert_eq!(rows_per_chunk(W16_ELEMS + TILE_K), 0);
    }

    #[test]
    fn splits_fill_the_gpu_and_cover_k_exactly() {
        // 4096 rows x 512 tokens = 128 tiles on 132 SMs: two splits of 64 K tiles.
        assert_eq!(split_k(128, 128, 512 * 4096, 264), (2, 64));
        // A full wave already: no split.
        assert_eq!(split_k(256, 128, 512 * 8192, 264), (1, 128));
        // Few tiles: capped by MAX_SPLITS, then by K (8 tiles each at least).
        assert_eq!(split_k(1, 1024, 128, 264), (16, 64));
        assert_eq!(split_k(8, 24, 128, 264), (3, 8));
        assert_eq!(split_k(8, 4, 128, 264), (1, 4));
        // Partials that would overflow their workspace limit the splits.
        assert_eq!(split_k(8, 1024, PARTIAL_ELEMS / 3, 264), (3, 342));
        for tiles in 1..300 {
            for k in [1, 7, 8, 9, 100, 129, 448] {
                let (s, per) = split_k(tiles, k, 4096, 264);
                assert!((1..=MAX_SPLITS).contains(&s) && per * s >= k && per * (s - 1) < k);
            }
        }
    }

    fn args(ty: GgmlType, packed: bool, w: u64, rows: usize, cols: usize) -> MatmulArgs {
        MatmulArgs {
            w,
            ty,
            packed,
            rows,
            cols,
            x: 0,
            n_tokens: 512,
            out: 0,
            accumulate: false,
        }
    }

    #[test]
    fn the_tiles_decode_aligned_rows_of_their_six_types_only() {
        let kernel = |ty, packed| decoding_kernel(&args(ty, packed, 256, 4096, 4096)).map(|n| n[2]);
        assert_eq!(kernel(GgmlType::Q4_0, true), Some("gemmq_q4_0p"));
        assert_eq!(kernel(GgmlType::Q8_0, true), Some("gemmq_q8_0p"));
        assert_eq!(kernel(GgmlType::Q6K, true), Some("gemmq_q6_kp"));
        assert_eq!(kernel(GgmlType::IQ4XS, true), Some("gemmq_iq4_xsp"));
        assert_eq!(kernel(GgmlType::Q4K, false), Some("gemmq_q4_k"));
        assert_eq!(kernel(GgmlType::Q5K, false), Some("gemmq_q5_k"));
        // GGUF's 18 / 34 / 210 / 136-byte blocks, and types with no decoder in the tiles.
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q8_0,
            GgmlType::Q6K,
            GgmlType::IQ4XS,
        ] {
            assert_eq!(kernel(ty, false), None, "{ty} in GGUF's layout");
        }
        for ty in [GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q3K, GgmlType::F16] {
            assert_eq!(kernel(ty, false), None, "{ty}");
        }
        // A weight not 16-byte aligned, or whose rows are not, takes the workspace: its
        // 16-byte loads would fault.
        assert_eq!(
            decoding_kernel(&args(GgmlType::Q4K, false, 264, 4096, 4096)),
            None
        );
        let odd_rows = args(GgmlType::Q4_0, true, 256, 4096, 256 * 3 + 32);
        assert_eq!(decoding_kernel(&odd_rows), None, "row bytes 450");
        // More row tiles than one launch's grid y.
        let tall = args(GgmlType::Q4K, false, 256, TILE_M * MAX_GRID_Y + 1, 256);
        assert_eq!(decoding_kernel(&tall), None);
    }

    #[test]
    fn batches_take_the_narrowest_token_tile_that_holds_them() {
        let names = decoding_kernel(&args(GgmlType::Q4_0, true, 256, 4096, 4096)).unwrap();
        assert_eq!(names, ["gemmq_q4_0p_n32", "gemmq_q4_0p_n64", "gemmq_q4_0p"]);
        for (n, name, tile_n) in [
            (17, "gemmq_q4_0p_n32", 32),
            (32, "gemmq_q4_0p_n32", 32),
            (33, "gemmq_q4_0p_n64", 64),
            (64, "gemmq_q4_0p_n64", 64),
            (65, "gemmq_q4_0p", TILE_N),
            (512, "gemmq_q4_0p", TILE_N),
        ] {
            let tile = decoding(names, n);
            assert_eq!((tile.name, tile.tile_n), (name, tile_n), "{n} tokens");
            assert!(tile.decodes && tile.threads as usize == TILE_M);
        }
        assert_eq!(decoding(names, 32).blocks_per_sm, NARROW_BLOCKS_PER_SM);
        assert_eq!(decoding(names, 512).blocks_per_sm, BLOCKS_PER_SM);
    }

    #[test]
    fn grid_dimensions_fit_the_launch_limits() {
        // The smallest padded row gives the most tiles per chunk; both stay under the
        // 65 535 blocks of grid y and far under grid x's limit.
        let rows = rows_per_chunk(TILE_K);
        assert!(rows.div_ceil(TILE_M) <= 65_535);
        assert!((X16_ELEMS / TILE_K).div_ceil(TILE_N) < u32::MAX as usize);
    }
}

/// The two tile kernels on a GPU: same bits (each output is the same chain of mma ops, in
/// the same order), and their speed on llama3-8b shapes. Ignored without a GPU.
#[cfg(test)]
mod gpu_tests {
    use std::time::Instant;

    use tether_gguf::GgmlType;

    use super::*;
    use crate::backend::Backend;

    fn gpu() -> CudaBackend {
        CudaBackend::with_tuning(0, &crate::cuda::CudaTuning::from_env())
            .unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}"))
    }

    /// Deterministic bytes: Q8_0 blocks get a 0.01 f16 scale, F32 values lie in [-1, 1).
    fn weights(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        if ty == GgmlType::F32 {
            return (0..rows * cols)
                .flat_map(|_| ((next() >> 40) as f32 / (1 << 23) as f32 - 1.0).to_le_bytes())
                .collect();
        }
        let mut w: Vec<u8> = (0..rows * cols / 32 * 34).map(|_| next() as u8).collect();
        for b in w.chunks_exact_mut(34) {
            b[..2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        }
        w
    }

    struct Case {
        w: CudaBuffer,
        x: CudaBuffer,
        out: CudaBuffer,
        args: MatmulArgs,
    }

    fn case(g: &CudaBackend, ty: GgmlType, rows: usize, cols: usize, n: usize) -> Case {
        let wb = weights(ty, rows, cols, (rows * 31 + cols * 7 + n) as u64);
        let xb = weights(GgmlType::F32, n, cols, 5);
        let mut w = g.alloc(wb.len()).unwrap();
        g.upload(&mut w, 0, &wb).unwrap();
        let mut x = g.alloc(xb.len()).unwrap();
        g.upload(&mut x, 0, &xb).unwrap();
        let out = g.alloc(n * rows * 4).unwrap();
        let args = MatmulArgs {
            w: w.ptr(),
            ty,
            packed: false,
            rows,
            cols,
            x: x.ptr(),
            n_tokens: n,
            out: out.ptr(),
            accumulate: false,
        };
        Case { w, x, out, args }
    }

    fn output(g: &CudaBackend, c: &Case) -> Vec<u32> {
        let mut bytes = vec![0u8; c.out.bytes()];
        g.download(&c.out, 0, &mut bytes).unwrap();
        bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_tile_kernels_agree_bit_for_bit() {
        let g = gpu();
        let shapes = [
            (GgmlType::Q8_0, 1, 256, 16),
            (GgmlType::Q8_0, 100, 256, 33),
            (GgmlType::Q8_0, 4096 + 17, 4096, 33),
            (GgmlType::Q8_0, 4096 + 17, 256, 512),
            (GgmlType::Q8_0, 4096, 4096, 512),
            (GgmlType::Q8_0, 1024, 4096, 200),
            (GgmlType::Q8_0, 600, 65_536, 140),
            (GgmlType::F32, 100, 100, 33),
            (GgmlType::F32, 4096 + 17, 100, 16),
        ];
        for (ty, rows, cols, n) in shapes {
            let c = case(&g, ty, rows, cols, n);
            g.gemm_with(&c.args, WARPS_64X32, BLOCKS_PER_SM).unwrap();
            let narrow = output(&g, &c);
            g.gemm_with(&c.args, WARPS_64X64, BLOCKS_PER_SM).unwrap();
            let wide = output(&g, &c);
            let differ = narrow.iter().zip(&wide).filter(|(a, b)| a != b).count();
            eprintln!("{ty} {rows}x{cols} n={n}: {differ} outputs differ");
            assert_eq!(differ, 0, "{ty} {rows}x{cols} n={n}");
            assert!(
                narrow.iter().any(|&v| v != 0),
                "{ty} {rows}x{cols}: all zero"
            );
            drop((c.w, c.x));
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_bench_tile_kernels() {
        let g = gpu();
        let n = 512;
        // llama3-8b: q, o; k, v; gate, up; down.
        let shapes = [
            (4096, 4096, 2.0),
            (1024, 4096, 2.0),
            (14336, 4096, 2.0),
            (4096, 14336, 1.0),
        ];
        for (tile, wave) in [
            (WARPS_64X32, 1),
            (WARPS_64X32, 2),
            (WARPS_64X32, 4),
            (WARPS_64X64, 1),
            (WARPS_64X64, 2),
            (WARPS_64X64, 4),
        ] {
            let mut layer = 0.0;
            let mut line = String::new();
            for (rows, cols, per_layer) in shapes {
                let c = case(&g, GgmlType::Q8_0, rows, cols, n);
                g.gemm_with(&c.args, tile, wave).unwrap();
                g.synchronize().unwrap();
                let iters = 20;
                let start = Instant::now();
                for _ in 0..iters {
                    g.gemm_with(&c.args, tile, wave).unwrap();
                }
                g.synchronize().unwrap();
                let secs = start.elapsed().as_secs_f64() / iters as f64;
                layer += per_layer * secs;
                line += &format!(" {rows}x{cols} {:.1}us", secs * 1e6);
            }
            eprintln!(
                "{} wave {wave}: q8_0 n={n}{line}; 8B pp{n} (matmuls only) {:.0} tokens/s",
                tile.name,
                n as f64 / (32.0 * layer)
            );
        }
    }
}
