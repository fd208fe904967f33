//! Prefill path on AVX2 (Q4_0 here, Q4_K in `avx2_panel_q4k`): eight weight rows at a
//! time are repacked into a panel whose vectors hold four quants of each row (one row per
//! 32-bit lane), and every token of the matmul then runs over the panel.
//!
//! With one row per lane a token's eight row sums come out of `maddubs` already in place:
//! no horizontal adds, and one convert and one FMA cover eight rows. The row-at-a-time
//! kernels spend most of their time folding lanes instead. Repacking a panel costs about
//! as much as three tokens' products, so decode keeps the [`super::avx2`] kernels.

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::{OutPtr, Shape};
use crate::cpu::q8::{BlockQ8, quantize_row_q8};
use crate::cpu::simd::Avx2;

/// Weight rows in one panel (the 32-bit lanes of a vector).
pub(crate) const PANEL_ROWS: usize = 8;
/// Tokens from which repacking pays for itself.
pub(crate) const MIN_TOKENS: usize = 8;
/// Tokens sharing one pass over a panel (each holds one accumulator).
const TOKEN_GROUP: usize = 4;
/// Q4_0 block: f16 scale and 16 bytes of nibbles.
const BLOCK_BYTES: usize = 18;
/// Vectors per packed block: eight of quants, then the eight row scales as f32.
pub(super) const PACKED_BLOCK: usize = 9;

/// Q4_0 quants of one block as unsigned bytes `0..16`, element `i` in byte `i` (the `-8`
/// is applied through [`BlockQ8::qsum8`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_unsigned(blk: &[u8]) -> __m256i {
    let qs = &blk[2..18];
    // SAFETY: `qs` is 16 bytes, exactly one unaligned 128-bit load.
    let v = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    let m4 = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(v, m4);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m4);
    _mm256_set_m128i(hi, lo)
}

/// A weight type on the panel path.
pub(crate) trait PanelFormat: Sync {
    /// One block of the prepared activation row.
    type Act: Copy + Default + Send + Sync;
    /// Activations per [`Self::Act`] block.
    const ACT_BLOCK: usize;
    /// Converts one activation row (`cols` values) into `cols / ACT_BLOCK` blocks.
    fn prepare(&self, x: &[f32], out: &mut [Self::Act]);
    /// Repacks rows `r0..r0 + 8` of `w` (`rows` rows of `row_bytes`) into `panel`; rows
    /// past `rows` pack as zeros.
    fn pack(&self, w: &[u8], row_bytes: usize, rows: usize, r0: usize, panel: &mut Vec<__m256i>);
    /// Lane `r` of result `j`: row `r` of the panel · token `xs[j]`.
    fn dot<const N: usize>(&self, panel: &[__m256i], xs: [&[Self::Act]; N]) -> [__m256; N];
}

/// The four activation quants `at..at + 4` in every 32-bit lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn broadcast4(qs: &[i8], at: usize) -> __m256i {
    let q = &qs[at..at + 4];
    _mm256_set1_epi32(i32::from_le_bytes([
        q[0] as u8, q[1] as u8, q[2] as u8, q[3] as u8,
    ]))
}

/// Transposes eight rows of eight 32-bit lanes: lane `r` of output `k` is lane `k` of row
/// `r`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn transpose8(r: [__m256i; 8]) -> [__m256i; 8] {
    let t0 = _mm256_unpacklo_epi32(r[0], r[1]);
    let t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    let t2 = _mm256_unpacklo_epi32(r[2], r[3]);
    let t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    let t4 = _mm256_unpacklo_epi32(r[4], r[5]);
    let t5 = _mm256_unpackhi_epi32(r[4], r[5]);
    let t6 = _mm256_unpacklo_epi32(r[6], r[7]);
    let t7 = _mm256_unpackhi_epi32(r[6], r[7]);
    // Lanes k and k + 4 of rows 0..4 (u0..u4) and rows 4..8 (u4..u8).
    let u0 = _mm256_unpacklo_epi64(t0, t2);
    let u1 = _mm256_unpackhi_epi64(t0, t2);
    let u2 = _mm256_unpacklo_epi64(t1, t3);
    let u3 = _mm256_unpackhi_epi64(t1, t3);
    let u4 = _mm256_unpacklo_epi64(t4, t6);
    let u5 = _mm256_unpackhi_epi64(t4, t6);
    let u6 = _mm256_unpacklo_epi64(t5, t7);
    let u7 = _mm256_unpackhi_epi64(t5, t7);
    [
        _mm256_permute2x128_si256::<0x20>(u0, u4),
        _mm256_permute2x128_si256::<0x20>(u1, u5),
        _mm256_permute2x128_si256::<0x20>(u2, u6),
        _mm256_permute2x128_si256::<0x20>(u3, u7),
        _mm256_permute2x128_si256::<0x31>(u0, u4),
        _mm256_permute2x128_si256::<0x31>(u1, u5),
        _mm256_permute2x128_si256::<0x31>(u2, u6),
        _mm256_permute2x128_si256::<0x31>(u3, u7),
    ]
}

/// Repacks rows `r0..r0 + 8` of `w` (rows past `rows` read as zero blocks, which add
/// nothing) into `panel`: per block, [`PACKED_BLOCK`] vectors.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn pack(w: &[u8], row_bytes: usize, rows: usize, r0: usize, panel: &mut Vec<__m256i>) {
    let n_blocks = row_bytes / BLOCK_BYTES;
    // Rows past the matrix stay empty and pack as zero quants with scale 0. (Plain loops:
    // closures here were not inlined and took a third of the packing time.)
    let mut row = [&w[..0]; PANEL_ROWS];
    for (i, r) in (r0..rows.min(r0 + PANEL_ROWS)).enumerate() {
        row[i] = &w[r * row_bytes..(r + 1) * row_bytes];
    }
    panel.clear();
    panel.resize(n_blocks * PACKED_BLOCK, _mm256_setzero_si256());
    for (b, out) in panel.chunks_exact_mut(PACKED_BLOCK).enumerate() {
        let mut q = [_mm256_setzero_si256(); PANEL_ROWS];
        let mut h = [0i16; PANEL_ROWS];
        for i in 0..PANEL_ROWS {
            if let Some(blk) = row[i].get(b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES) {
                q[i] = unpack_unsigned(blk);
                h[i] = i16::from_le_bytes([blk[0], blk[1]]);
            }
        }
        out[..8].copy_from_slice(&transpose8(q));
        let halves = _mm_set_epi16(h[7], h[6], h[5], h[4], h[3], h[2], h[1], h[0]);
        out[8] = _mm256_castps_si256(_mm256_cvtph_ps(halves));
    }
}

/// The body of a panel product (every format, every kernel level): lane `r` of result `j`
/// is row `r` of the panel · token `xs[j]`. `$sums(pb, y)` is the integer part of one
/// packed block against one token's activation block, one row per lane; `$finish(pb, y,
/// sums, acc)` scales it into the accumulator. A macro so that each kernel level compiles
/// it with its own features around its own integer step.
macro_rules! panel_dot_body {
    ($panel:expr, $xs:expr, $packed:expr, $sums:path, $finish:path) => {{
        let mut acc = [_mm256_setzero_ps(); N];
        for (b, pb) in $panel.chunks_exact($packed).enumerate() {
            for (a, x) in acc.iter_mut().zip($xs) {
                let y = &x[b];
                *a = $finish(pb, y, $sums(pb, y), *a);
            }
        }
        acc
    }};
}
pub(super) use panel_dot_body;

/// A K-quant panel product (every kernel level) with the sub-blocks outermost inside a
/// super-block: each sub-block's eight quant vectors are loaded once for all `N` tokens.
/// With the tokens outermost (`panel_dot_body`) every product loaded its panel vector
/// and its broadcast activations, and the loads, not the products, bounded prefill.
/// `$step(pb, v, s, y, sums)` adds sub-block `s` (quants `v`) against token `y` to `sums`,
/// in the order `panel_dot_body`'s integer step would, so the sums are the same.
macro_rules! panel_dot_subs {
    ($panel:expr, $xs:expr, $packed:expr, $subs:expr, $step:ident, $finish:path) => {{
        let mut acc = [_mm256_setzero_ps(); N];
        for (b, pb) in $panel.chunks_exact($packed).enumerate() {
            let mut sums = [_mm256_setzero_si256(); N];
            for s in 0..$subs {
                let q = &pb[8 * s..8 * s + 8];
                let v = [q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7]];
                for (sum, x) in sums.iter_mut().zip($xs) {
                    *sum = $step(pb, &v, s, &x[b], *sum);
                }
            }
            for ((a, x), sum) in acc.iter_mut().zip($xs).zip(sums) {
                *a = $finish(pb, &x[b], sum, *a);
            }
        }
        acc
    }};
}
pub(super) use panel_dot_subs;

/// Each row's `Σ q·y` over one packed Q4_0 block (unsigned nibbles, before the `-8`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn block_sum(pb: &[__m256i], y: &BlockQ8) -> __m256i {
    // Eight maddubs outputs of at most 2·15·127 each add up in i16 (< 2^15).
    // Written out: as a loop LLVM neither unrolled it nor kept the sum in a register.
    let p = |k: usize| _mm256_maddubs_epi16(pb[k], broadcast4(&y.qs, 4 * k));
    let s01 = _mm256_add_epi16(p(0), p(1));
    let s23 = _mm256_add_epi16(p(2), p(3));
    let s45 = _mm256_add_epi16(p(4), p(5));
    let s67 = _mm256_add_epi16(p(6), p(7));
    let s16 = _mm256_add_epi16(_mm256_add_epi16(s01, s23), _mm256_add_epi16(s45, s67));
    _mm256_madd_epi16(s16, _mm256_set1_epi16(1))
}

/// `acc + d_w · d_y · (sums - 8·Σ y)` for one packed Q4_0 block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn finish(pb: &[__m256i], y: &BlockQ8, sums: __m256i, acc: __m256) -> __m256 {
    let dw = _mm256_castsi256_ps(pb[8]);
    let sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(y.qsum8));
    let scale = _mm256_mul_ps(dw, _mm256_set1_ps(y.d));
    _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), acc)
}

/// One packed panel against `N` tokens: lane `r` of result `j` is row `r` · token `j`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn panel_dot<const N: usize>(panel: &[__m256i], xs: [&[BlockQ8]; N]) -> [__m256; N] {
    panel_dot_body!(panel, xs, PACKED_BLOCK, block_sum, finish)
}

/// Q4_0 weights against [`BlockQ8`] activations.
pub(crate) struct Q4_0Panels(pub Avx2);

impl PanelFormat for Q4_0Panels {
    type Act = BlockQ8;
    const ACT_BLOCK: usize = 32;

    fn prepare(&self, x: &[f32], out: &mut [BlockQ8]) {
        quantize_row_q8(Some(self.0), x, out);
    }

    fn pack(&self, w: &[u8], row_bytes: usize, rows: usize, r0: usize, panel: &mut Vec<__m256i>) {
        // SAFETY: `self.0` proves the CPU has the enabled features.
        unsafe { pack(w, row_bytes, rows, r0, panel) }
    }

    fn dot<const N: usize>(&self, panel: &[__m256i], xs: [&[BlockQ8]; N]) -> [__m256; N] {
        // SAFETY: `self.0` proves the CPU has the enabled features.
        unsafe { panel_dot(panel, xs) }
    }
}

/// Writes the rows of a panel that exist (`n_rows ≤ 8` from `r0`) for tokens `t0..`.
fn store<const N: usize>(acc: [__m256; N], out: OutPtr, s: Shape, t0: usize, r0: usize) {
    let n_rows = (s.rows - r0).min(PANEL_ROWS);
    for (j, a) in acc.into_iter().enumerate() {
        // SAFETY: a 256-bit vector is eight f32; every bit pattern is a valid f32.
        let lanes = unsafe { std::mem::transmute::<__m256, [f32; PANEL_ROWS]>(a) };
        let t = t0 + j;
        assert!(t < s.n_tokens && r0 + n_rows <= s.rows);
        for (i, v) in lanes.into_iter().take(n_rows).enumerate() {
            // SAFETY: `t < n_tokens` and `r0 + i < rows`, inside `out` (checked by the
            // caller); rows `r0..r0 + 8` belong to the calling task alone.
            unsafe { out.write(t * s.rows + r0 + i, v) };
        }
    }
}

/// Eight weight rows (one per lane) ready to multiply: a packed panel, or a group of
/// packed Q4_0 rows.
pub(super) trait EightRows {
    /// One block of the prepared activation row.
    type Act;
    /// Lane `r` of result `j`: row `r` · token `xs[j]`.
    fn dot<const N: usize>(&self, xs: [&[Self::Act]; N]) -> [__m256; N];
}

/// A panel with its format.
struct Panel<'a, F>(&'a F, &'a [__m256i]);

impl<F: PanelFormat> EightRows for Panel<'_, F> {
    type Act = F::Act;

    fn dot<const N: usize>(&self, xs: [&[F::Act]; N]) -> [__m256; N] {
        self.0.dot(self.1, xs)
    }
}

/// Every token (`acts`, `per_row` blocks each) against eight rows from `r0`, in groups of
/// [`TOKEN_GROUP`].
pub(super) fn all_tokens<E: EightRows>(
    rows: &E,
    acts: &[E::Act],
    per_row: usize,
    out: OutPtr,
    s: Shape,
    r0: usize,
) {
    let row = |t: usize| &acts[t * per_row..(t + 1) * per_row];
    let mut t0 = 0;
    while t0 < s.n_tokens {
        let n = (s.n_tokens - t0).min(TOKEN_GROUP);
        match n {
            4 => {
                let xs = [row(t0), row(t0 + 1), row(t0 + 2), row(t0 + 3)];
                store(rows.dot(xs), out, s, t0, r0);
            }
            3 => store(
                rows.dot([row(t0), row(t0 + 1), row(t0 + 2)]),
                out,
                s,
                t0,
                r0,
            ),
            2 => store(rows.dot([row(t0), row(t0 + 1)]), out, s, t0, r0),
            _ => store(rows.dot([row(t0)]), out, s, t0, r0),
        }
        t0 += n;
    }
}

/// `out[t][r] = Σ_c w[r][c] · x[t][c]` for weights of `f`'s type, sizes as for
/// [`super::matmul`].
pub(crate) fn matmul<F: PanelFormat>(f: &F, w: &[u8], s: Shape, x: &[f32], out: &mut [f32]) {
    if s.rows == 0 || s.cols == 0 {
        out.iter_mut()
            .take(s.rows * s.n_tokens)
            .for_each(|v| *v = 0.0);
        return;
    }
    let per_row = s.cols / F::ACT_BLOCK;
    let mut acts = vec![F::Act::default(); per_row * s.n_tokens];
    acts.par_chunks_mut(per_row)
        .zip(x.par_chunks(s.cols))
        .for_each(|(a, xr)| f.prepare(xr, a));
    assert!(
        out.len() >= s.rows * s.n_tokens,
        "matmul output checked by the caller"
    );
    let out = OutPtr(out.as_mut_ptr());
    let row_bytes = w.len() / s.rows;
    let n_panels = s.rows.div_ceil(PANEL_ROWS);
    let threads = rayon::current_num_threads().max(1);
    // Enough chunks to balance the threads; one panel buffer per chunk.
    let per_chunk = n_panels.div_ceil(threads * 4).max(1);
    let acts = &acts;
    (0..n_panels.div_ceil(per_chunk))
        .into_par_iter()
        .for_each(|c| {
            let mut panel = Vec::new();
            for p in c * per_chunk..((c + 1) * per_chunk).min(n_panels) {
                let r0 = p * PANEL_ROWS;
                f.pack(w, row_bytes, s.rows, r0, &mut panel);
                all_tokens(&Panel(f, &panel), acts, per_row, out, s, r0);
            }
        });
}
