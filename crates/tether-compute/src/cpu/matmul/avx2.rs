//! AVX2 + FMA + F16C kernels for float weights and the 32-element quants (Q4_0, Q8_0).
//!
//! Every kernel holds an [`Avx2`] token, which only `Avx2::detect` creates after the CPU
//! reported the features; that is what makes calling the `#[target_feature]` functions sound.
//! Memory is read through bounds-checked slices; raw loads only read inside them.

use std::arch::x86_64::*;

use tether_gguf::GgmlType;

use super::RowKernel;
use crate::cpu::q8::{BlockQ8, quantize_row_q8};
use crate::cpu::simd::{Avx2, hsum_ps};

/// The little-endian f16 at `b[at..at + 2]` as f32, by the F16C instruction.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    let bits = u16::from_le_bytes([b[at], b[at + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// Dot products of 32 signed 8-bit `x` with the 32 `y` of each token, as 8 i32 lanes
/// turned to f32: `|x| · sign(y, x)` keeps `maddubs` (u8 × i8) exact for `x` in -128..=127.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_i8(ax: __m256i, x: __m256i, y: __m256i) -> __m256 {
    let sy = _mm256_sign_epi8(y, x);
    let pairs = _mm256_maddubs_epi16(ax, sy);
    _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
}

/// Loads one activation block's 32 quants.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn load_q8(y: &BlockQ8) -> __m256i {
    // SAFETY: `qs` is 32 bytes, exactly one unaligned 256-bit load.
    unsafe { _mm256_loadu_si256(y.qs.as_ptr().cast()) }
}

/// Shared body of the Q4_0 (`Q8 = false`) and Q8_0 (`Q8 = true`) kernels: each weight block
/// becomes 32 signed bytes; each token adds `d_w · d_y · Σ q·y`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q8_blocks<const N: usize, const Q8: bool>(
    w: &[u8],
    xs: [&[BlockQ8]; N],
) -> [f32; N] {
    let mut acc = [_mm256_setzero_ps(); N];
    let block_bytes = if Q8 { 34 } else { 18 };
    for (b, blk) in w.chunks_exact(block_bytes).enumerate() {
        let d = f16_at(blk, 0);
        let q = if Q8 {
            unpack_q8_0(blk)
        } else {
            unpack_q4_0(blk)
        };
        let aq = _mm256_sign_epi8(q, q);
        for (a, x) in acc.iter_mut().zip(xs) {
            let y = &x[b];
            let p = dot_i8(aq, q, load_q8(y));
            *a = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), p, *a);
        }
    }
    let mut out = [0.0f32; N];
    for (o, a) in out.iter_mut().zip(acc) {
        *o = hsum_ps(a);
    }
    out
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_q4_0(blk: &[u8]) -> __m256i {
    let qs = &blk[2..18];
    // SAFETY: `qs` is 16 bytes, exactly one unaligned 128-bit load.
    let v = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    let m4 = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(v, m4);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m4);
    _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn unpack_q8_0(blk: &[u8]) -> __m256i {
    let qs = &blk[2..34];
    // SAFETY: `qs` is 32 bytes, exactly one unaligned 256-bit load.
    unsafe { _mm256_loadu_si256(qs.as_ptr().cast()) }
}

/// Q4_0 quants as unsigned nibbles `0..16` (the `-8` is applied through `BlockQ8::s`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn unpack_q4_0_unsigned(blk: &[u8]) -> __m256i {
    let qs = &blk[2..18];
    // SAFETY: `qs` is 16 bytes, exactly one unaligned 128-bit load.
    let v = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(qs.as_ptr().cast()) });
    // Both halves hold the 16 bytes; the high half shifts its nibbles down.
    let shifted = _mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0));
    _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F))
}

/// The f16 scales at the start of four blocks, as f32 lanes 0..4. A macro, not a function:
/// LLVM declined to inline the function into the hot loops.
macro_rules! scales4 {
    ($blk:expr) => {{
        let blk = $blk;
        let h = |i: usize| i16::from_le_bytes([blk[i][0], blk[i][1]]);
        _mm_cvtph_ps(_mm_set_epi16(0, 0, 0, 0, h(3), h(2), h(1), h(0)))
    }};
}
pub(super) use scales4;

/// Asks for the same blocks of the next tile's rows (`ahead` bytes further: the driver
/// lays a tile's rows back to back). Four interleaved streams of small blocks otherwise
/// leave memory bandwidth unused in decode. A macro so it surely inlines.
macro_rules! prefetch_ahead {
    ($blk:expr, $ahead:expr) => {{
        // A prefetch never faults, so an address past the matrix is harmless;
        // `wrapping_add` keeps the pointer arithmetic defined.
        _mm_prefetch::<_MM_HINT_T0>($blk[0].as_ptr().wrapping_add($ahead).cast());
        _mm_prefetch::<_MM_HINT_T0>($blk[1].as_ptr().wrapping_add($ahead).cast());
        _mm_prefetch::<_MM_HINT_T0>($blk[2].as_ptr().wrapping_add($ahead).cast());
        _mm_prefetch::<_MM_HINT_T0>($blk[3].as_ptr().wrapping_add($ahead).cast());
    }};
}
pub(super) use prefetch_ahead;

/// Folds four rows' 8-lane i32 sums into `[r0, r1, r2, r3 | r0, r1, r2, r3]` (each half
/// holds the sum of that half of the row's lanes).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn fold4_i32(p: [__m256i; 4]) -> __m256i {
    let h01 = _mm256_hadd_epi32(p[0], p[1]);
    let h23 = _mm256_hadd_epi32(p[2], p[3]);
    _mm256_hadd_epi32(h01, h23)
}

/// [`fold4`] for `maddubs` outputs small enough to add eight of them in i16: Q4_0's
/// unsigned nibbles give pairs of at most 2·15·127 = 3810, so 8 pairs stay below 2^15.
/// Returns i32 lanes, each half holding that half of every row's sum.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fold4_i16(p: [__m256i; 4]) -> __m256i {
    let h01 = _mm256_hadd_epi16(p[0], p[1]);
    let h23 = _mm256_hadd_epi16(p[2], p[3]);
    let h = _mm256_hadd_epi16(h01, h23);
    _mm256_madd_epi16(h, _mm256_set1_epi16(1))
}

/// `[r0, r1, r2, r3]` of each token's accumulator (the two halves added), transposed to
/// `[row][token]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn unfold4<const N: usize>(acc: [__m256; N]) -> [[f32; N]; 4] {
    let mut out = [[0.0f32; N]; 4];
    for (j, a) in acc.into_iter().enumerate() {
        let r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let mut lanes = [0.0f32; 4];
        // SAFETY: `lanes` holds exactly four f32.
        unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), r) };
        for (row, v) in out.iter_mut().zip(lanes) {
            row[j] = v;
        }
    }
    out
}

/// The body of a four-row kernel (decode, and prefill of types without panels): four
/// weight rows of `$bytes`-byte blocks against `N` tokens. Each block of the four rows is
/// decoded once by `$unpack`; `$rows_sum(&q, y)` gives the integer `Σ q·y` of every row
/// against one token as `[r0, r1, r2, r3 | r0, r1, r2, r3]` (each half one half of the
/// block), and one convert and one FMA then cover the four rows. A macro so that every
/// kernel level compiles it with its own features around its own integer step.
macro_rules! dot4_blocks {
    ($w:expr, $xs:expr, $bytes:expr, $unpack:path, $rows_sum:path) => {{
        let (w, xs): ([&[u8]; 4], [&[BlockQ8]; N]) = ($w, $xs);
        let mut acc = [_mm256_setzero_ps(); N];
        let ahead = 4 * w[0].len();
        let rows = w[0]
            .chunks_exact($bytes)
            .zip(w[1].chunks_exact($bytes))
            .zip(w[2].chunks_exact($bytes).zip(w[3].chunks_exact($bytes)));
        for (b, ((b0, b1), (b2, b3))) in rows.enumerate() {
            let blk = [b0, b1, b2, b3];
            prefetch_ahead!(blk, ahead);
            let dw = scales4!(blk);
            let dw8 = _mm256_set_m128(dw, dw);
            let q = [
                $unpack(blk[0]),
                $unpack(blk[1]),
                $unpack(blk[2]),
                $unpack(blk[3]),
            ];
            for (a, x) in acc.iter_mut().zip(xs) {
                let y = &x[b];
                let sums = $rows_sum(&q, y);
                let scale = _mm256_mul_ps(dw8, _mm256_set1_ps(y.d));
                *a = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums), *a);
            }
        }
        unfold4(acc)
    }};
}
pub(super) use dot4_blocks;

/// Four rows of unsigned Q4_0 nibbles against one token, folded as [`dot4_blocks`] wants.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows_sum_q4_0(q: &[__m256i; 4], y: &BlockQ8) -> __m256i {
    let yv = load_q8(y);
    let p = [
        _mm256_maddubs_epi16(q[0], yv),
        _mm256_maddubs_epi16(q[1], yv),
        _mm256_maddubs_epi16(q[2], yv),
        _mm256_maddubs_epi16(q[3], yv),
    ];
    // `Σ (q - 8)·y = Σ q·y - 8·Σ y`, exact in integers; the term goes into the low half
    // only, which unfold4 adds to the high half once.
    _mm256_sub_epi32(fold4_i16(p), q4_0_offset(y))
}

/// The `8·Σ y` a Q4_0 row sum of unsigned nibbles subtracts, in the low half only.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q4_0_offset(y: &BlockQ8) -> __m256i {
    _mm256_zextsi128_si256(_mm_set1_epi32(y.qsum8))
}

/// Four rows of signed Q8_0 quants against one token: `|q| · sign(y, q)` keeps `maddubs`
/// (u8 × i8) exact.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows_sum_q8_0(q: &[__m256i; 4], y: &BlockQ8) -> __m256i {
    let yv = load_q8(y);
    let row = |k: usize| {
        let p = _mm256_maddubs_epi16(_mm256_sign_epi8(q[k], q[k]), _mm256_sign_epi8(yv, q[k]));
        _mm256_madd_epi16(p, _mm256_set1_epi16(1))
    };
    fold4_i32([row(0), row(1), row(2), row(3)])
}

/// Four Q4_0 rows against `N` tokens: each activation block is loaded once for all rows,
/// and the four rows share one convert and one FMA per token.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot4_q4_0<const N: usize>(w: [&[u8]; 4], xs: [&[BlockQ8]; N]) -> [[f32; N]; 4] {
    dot4_blocks!(w, xs, 18, unpack_q4_0_unsigned, rows_sum_q4_0)
}

/// Four Q8_0 rows against `N` tokens (see [`dot4_q4_0`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot4_q8_0<const N: usize>(w: [&[u8]; 4], xs: [&[BlockQ8]; N]) -> [[f32; N]; 4] {
    dot4_blocks!(w, xs, 34, unpack_q8_0, rows_sum_q8_0)
}

/// Q4_0 weights against [`BlockQ8`] activations.
pub(crate) struct Q4_0Kernel(pub Avx2);

impl RowKernel for Q4_0Kernel {
    type Act = BlockQ8;
    const ACT_BLOCK: usize = 32;

    fn prepare(&self, x: &[f32], out: &mut [BlockQ8]) {
        quantize_row_q8(Some(self.0), x, out);
    }

    fn dot<const N: usize>(&self, w: &[u8], xs: [&[BlockQ8]; N]) -> [f32; N] {
        // SAFETY: `self.0` proves the CPU has the enabled features.
        unsafe { dot_q8_blocks::<N, false>(w, xs) }
    }

    fn dot4<const N: usize>(&self, w: [&[u8]; 4], xs: [&[BlockQ8]; N]) -> [[f32; N]; 4] {
        // SAFETY: `self.0` proves the CPU has the enabled features.
        unsafe { dot4_q4_0(w, xs) }
    }
}

/// Q8_0 weights against [`BlockQ8`] activations.
pub(crate) struct Q8_0Kernel(pub Avx2);

impl RowKernel for Q8_0Kernel {
    type Act = BlockQ8;
    const ACT_BLOCK: usize = 32;

    fn prepare(&self, x: &[f32], out: &mut [BlockQ8]) {
        quantize_row_q8(Some(self.0), x, out);
    }

    fn dot<const N: usize>(&self, w: &[u8], xs: [&[BlockQ8]; N]) -> [f32; N] {
        // SAFETY: `self.0` proves the CPU has the enabled features.
        unsafe { dot_q8_blocks::<N, true>(w, xs) }
    }

    fn dot4<const N: usize>(&self, w: [&[u8]; 4], xs: [&[BlockQ8]; N]) -> [[f32; N]; 4] {
        // SAFETY: `self.0` proves the CPU has the enabled features.
        unsafe { dot4_q8_0(w, xs) }
    }
}

/// F32, F16 or BF16 weights against f32 activations.
pub(crate) struct FloatKernel {
    _cpu: Avx2,
    ty: GgmlType,
}

impl FloatKernel {
    /// `ty` must be F32, F16 or BF16 (anything else is read as F32).
    pub(crate) fn new(cpu: Avx2, ty: GgmlType) -> Self {
        Self { _cpu: cpu, ty }
    }
}

/// Eight weights starting at element `i` as f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load8(ty: GgmlType, w: &[u8], i: usize) -> __m256 {
    match ty {
        GgmlType::F16 | GgmlType::BF16 => {
            let s = &w[2 * i..2 * i + 16];
            // SAFETY: `s` is 16 bytes, one unaligned 128-bit load.
            let h = unsafe { _mm_loadu_si128(s.as_ptr().cast()) };
            if ty == GgmlType::F16 {
                _mm256_cvtph_ps(h)
            } else {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            }
        }
        _ => {
            let s = &w[4 * i..4 * i + 32];
            // SAFETY: `s` is 32 bytes, one unaligned 256-bit load.
            unsafe { _mm256_loadu_ps(s.as_ptr().cast()) }
        }
    }
}

/// One weight element as f32 (for row tails shorter than 8).
fn load1(ty: GgmlType, w: &[u8], i: usize) -> f32 {
    match ty {
        GgmlType::F16 => half::f16::from_le_bytes([w[2 * i], w[2 * i + 1]]).to_f32(),
        GgmlType::BF16 => half::bf16::from_le_bytes([w[2 * i], w[2 * i + 1]]).to_f32(),
        _ => f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]]),
    }
}

/// Eight activations starting at `i`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load_x(x: &[f32], i: usize) -> __m256 {
    let s = &x[i..i + 8];
    // SAFETY: `s` is 8 f32, one unaligned 256-bit load.
    unsafe { _mm256_loadu_ps(s.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_float<const N: usize>(ty: GgmlType, w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    let cols = xs.first().map_or(0, |x| x.len());
    let mut acc0 = [_mm256_setzero_ps(); N];
    let mut acc1 = [_mm256_setzero_ps(); N];
    let mut i = 0;
    // Two accumulators per token hide the FMA latency.
    while i + 16 <= cols {
        let w0 = load8(ty, w, i);
        let w1 = load8(ty, w, i + 8);
        for j in 0..N {
            acc0[j] = _mm256_fmadd_ps(w0, load_x(xs[j], i), acc0[j]);
            acc1[j] = _mm256_fmadd_ps(w1, load_x(xs[j], i + 8), acc1[j]);
        }
        i += 16;
    }
    if i + 8 <= cols {
        let w0 = load8(ty, w, i);
        for j in 0..N {
            acc0[j] = _mm256_fmadd_ps(w0, load_x(xs[j], i), acc0[j]);
        }
        i += 8;
    }
    let mut out = [0.0f32; N];
    for j in 0..N {
        out[j] = hsum_ps(_mm256_add_ps(acc0[j], acc1[j]));
        for (k, x) in xs[j].iter().enumerate().skip(i) {
            out[j] += load1(ty, w, k) * x;
        }
    }
    out
}

impl RowKernel for FloatKernel {
    type Act = f32;
    const ACT_BLOCK: usize = 1;

    fn prepare(&self, x: &[f32], out: &mut [f32]) {
        out.copy_from_slice(x);
    }

    fn dot<const N: usize>(&self, w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
        // SAFETY: `self._cpu` proves the CPU has the enabled features.
        unsafe { dot_float(self.ty, w, xs) }
    }
}
