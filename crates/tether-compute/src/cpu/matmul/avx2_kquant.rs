//! AVX2 kernels for the k-quants users run most (Q4_K, Q6_K) against [`BlockQ8K`]
//! activations. Same arithmetic as the scalar kernels: integer sums per super-block, the
//! minimum (Q4_K) and bias (Q6_K) terms from the activation block sums.

use std::arch::x86_64::*;

use super::RowKernel;
use super::avx2::f16_at;
use super::scalar::unpack_q4k_scales;
use crate::cpu::q8::{BlockQ8K, quantize_row_q8k};
use crate::cpu::simd::{Avx2, hsum_ps};

/// 32 bytes of `s` starting at `at`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn load32(s: &[u8], at: usize) -> __m256i {
    let s = &s[at..at + 32];
    // SAFETY: `s` is 32 bytes, one unaligned 256-bit load.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// 32 activation quants starting at `at`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn load32_i8(s: &[i8], at: usize) -> __m256i {
    let s = &s[at..at + 32];
    // SAFETY: `s` is 32 bytes, one unaligned 256-bit load.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// Asks for the weights a little further on in this row or the next ones (the driver walks
/// rows back to back); the hardware prefetcher alone leaves decode bandwidth unused.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn prefetch(blk: &[u8]) {
    const AHEAD: usize = 2048;
    // A prefetch never faults, so an address past the matrix is harmless; `wrapping_add`
    // keeps the pointer arithmetic defined.
    _mm_prefetch::<_MM_HINT_T0>(blk.as_ptr().wrapping_add(AHEAD).cast());
    _mm_prefetch::<_MM_HINT_T0>(blk.as_ptr().wrapping_add(AHEAD + 64).cast());
    _mm_prefetch::<_MM_HINT_T0>(blk.as_ptr().wrapping_add(AHEAD + 128).cast());
}

/// `acc + madd(a, b)`: the step VNNI's `vpdpwssd` does in one instruction.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn madd_add(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
    _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
}

/// The sixteen 16-element sums of an activation block as i16 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn load_bsums(y: &BlockQ8K) -> __m256i {
    // SAFETY: `bsums` is 32 bytes, one unaligned 256-bit load.
    unsafe { _mm256_loadu_si256(y.bsums.as_ptr().cast()) }
}

/// The body of the Q4_K row kernel; `$madd_add(acc, a, b)` is `acc + madd(a, b)` (one
/// `vpdpwssd` with VNNI). A macro so that each kernel level compiles it with its own features.
macro_rules! dot_q4k_body {
    ($w:expr, $xs:expr, $madd_add:path) => {{
        let (w, xs): (&[u8], [&[BlockQ8K]; N]) = ($w, $xs);
        let mut acc = [_mm256_setzero_ps(); N];
        let m4 = _mm256_set1_epi8(0x0F);
        for (b, blk) in w.chunks_exact(144).enumerate() {
            prefetch(blk);
            let d = f16_at(blk, 0);
            let dmin = f16_at(blk, 2);
            let (sc, mn) = unpack_q4k_scales(&blk[4..16]);
            // SAFETY: `sc` is 8 bytes, one 64-bit load.
            let sc16 = _mm_cvtepu8_epi16(unsafe { _mm_loadl_epi64(sc.as_ptr().cast()) });
            let sc16 = _mm256_broadcastsi128_si256(sc16);
            // The super-block decoded once, as eight sub-blocks of 32 quants and their scales
            // spread over i16 lanes; every token then reads them back from registers or L1.
            // (Interleaving the tokens instead kept so many vectors live that the compiler
            // spilled the accumulators inside the hot loop.)
            let mut q = [_mm256_setzero_si256(); 8];
            let mut scales = [_mm256_setzero_si256(); 8];
            for g in 0..4 {
                let v = load32(blk, 16 + 32 * g);
                q[2 * g] = _mm256_and_si256(v, m4);
                q[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                // Broadcast i16 scale k (bytes 2k, 2k + 1 of `sc16`) to every lane.
                let pick = |k: usize| _mm256_set1_epi16((((2 * k + 1) << 8) | (2 * k)) as i16);
                scales[2 * g] = _mm256_shuffle_epi8(sc16, pick(2 * g));
                scales[2 * g + 1] = _mm256_shuffle_epi8(sc16, pick(2 * g + 1));
            }
            let sumi: [__m256i; N] = std::array::from_fn(|j| {
                let y = &xs[j][b];
                let mut s = _mm256_setzero_si256();
                for k in 0..8 {
                    let p = _mm256_maddubs_epi16(q[k], load32_i8(&y.qs, 32 * k));
                    s = $madd_add(s, p, scales[k]);
                }
                s
            });
            // SAFETY: `mn` is 8 bytes, one 64-bit load.
            let mins = _mm_cvtepu8_epi16(unsafe { _mm_loadl_epi64(mn.as_ptr().cast()) });
            for j in 0..N {
                let y = &xs[j][b];
                // Σ min_s · (sum of the sub-block's 32 activations): pairs of 16-sums.
                let bs = load_bsums(y);
                let pairs = _mm_hadd_epi16(
                    _mm256_castsi256_si128(bs),
                    _mm256_extracti128_si256::<1>(bs),
                );
                let m = _mm256_cvtepi32_ps(_mm256_zextsi128_si256(_mm_madd_epi16(mins, pairs)));
                let with_scales =
                    _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), _mm256_cvtepi32_ps(sumi[j]), acc[j]);
                acc[j] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * y.d), m, with_scales);
            }
        }
        let mut out = [0.0f32; N];
        for j in 0..N {
            out[j] = hsum_ps(acc[j]);
        }
        out
    }};
}
pub(super) use dot_q4k_body;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q4k<const N: usize>(w: &[u8], xs: [&[BlockQ8K]; N]) -> [f32; N] {
    dot_q4k_body!(w, xs, madd_add)
}

/// The low 2 bits of each byte of `bits`, moved to bits 4..6 (a Q6_K quant's high part).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn high2(bits: __m256i) -> __m256i {
    _mm256_slli_epi16::<4>(_mm256_and_si256(bits, _mm256_set1_epi8(3)))
}

/// `vpshufb` masks that spread i16 scale `2k` over the low 128-bit half and `2k + 1` over
/// the high half (the shuffle works within each half).
pub(super) const Q6K_SCALE_PICK: [__m256i; 4] = {
    const fn pick(k: usize) -> __m256i {
        let lo = (4 * k) as u8;
        let mut bytes = [0u8; 32];
        let mut i = 0;
        while i < 16 {
            bytes[i] = lo + (i % 2) as u8;
            bytes[16 + i] = lo + 2 + (i % 2) as u8;
            i += 1;
        }
        // SAFETY: 32 bytes and a 256-bit vector have the same size; every bit pattern is
        // a valid vector.
        unsafe { std::mem::transmute::<[u8; 32], __m256i>(bytes) }
    }
    [pick(0), pick(1), pick(2), pick(3)]
};

/// The body of the Q6_K row kernel, as [`dot_q4k_body`] is for Q4_K.
macro_rules! dot_q6k_body {
    ($w:expr, $xs:expr, $madd_add:path) => {{
        let (w, xs): (&[u8], [&[BlockQ8K]; N]) = ($w, $xs);
        let mut acc = [_mm256_setzero_ps(); N];
        let m4 = _mm256_set1_epi8(0x0F);
        for (b, blk) in w.chunks_exact(210).enumerate() {
            prefetch(blk);
            let d = f16_at(blk, 208);
            let sc = &blk[192..208];
            // SAFETY: `sc` is 16 bytes, one unaligned 128-bit load.
            let scales16 = _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(sc.as_ptr().cast()) });
            let mut sumi = [_mm256_setzero_si256(); N];
            for h in 0..2 {
                let qa = load32(blk, 64 * h);
                let qb = load32(blk, 64 * h + 32);
                let qh = load32(blk, 128 + 32 * h);
                let q = [
                    _mm256_or_si256(_mm256_and_si256(qa, m4), high2(qh)),
                    _mm256_or_si256(_mm256_and_si256(qb, m4), high2(_mm256_srli_epi16::<2>(qh))),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(qa), m4),
                        high2(_mm256_srli_epi16::<4>(qh)),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(qb), m4),
                        high2(_mm256_srli_epi16::<6>(qh)),
                    ),
                ];
                // Both halves hold scales 8h..8h + 8 as i16.
                let sc_h = if h == 0 {
                    _mm256_permute2x128_si256::<0x00>(scales16, scales16)
                } else {
                    _mm256_permute2x128_si256::<0x11>(scales16, scales16)
                };
                for (k, &qk) in q.iter().enumerate() {
                    // Lanes 0..8 hold the first 16 elements (sub-block 8h + 2k), 8..16 the next.
                    let scales = _mm256_shuffle_epi8(sc_h, Q6K_SCALE_PICK[k]);
                    for (acc_i, x) in sumi.iter_mut().zip(xs) {
                        let p = _mm256_maddubs_epi16(qk, load32_i8(&x[b].qs, 128 * h + 32 * k));
                        *acc_i = $madd_add(*acc_i, p, scales);
                    }
                }
            }
            for j in 0..N {
                let y = &xs[j][b];
                // The -32 bias, 32 · Σ scale_s · bsum_s, stays in integers as in the scalar
                // kernel: no cancellation between large float terms.
                let bias = _mm256_slli_epi32::<5>(_mm256_madd_epi16(scales16, load_bsums(y)));
                let total = _mm256_sub_epi32(sumi[j], bias);
                acc[j] =
                    _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), _mm256_cvtepi32_ps(total), acc[j]);
            }
        }
        let mut out = [0.0f32; N];
        for j in 0..N {
            out[j] = hsum_ps(acc[j]);
        }
        out
    }};
}
pub(super) use dot_q6k_body;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q6k<const N: usize>(w: &[u8], xs: [&[BlockQ8K]; N]) -> [f32; N] {
    dot_q6k_body!(w, xs, madd_add)
}

/// Q4_K weights against [`BlockQ8K`] activations.
pub(crate) struct Q4KKernel(pub Avx2);

impl RowKernel for Q4KKernel {
    type Act = BlockQ8K;
    const ACT_BLOCK: usize = 256;

    fn prepare(&self, x: &[f32], out: &mut [BlockQ8K]) {
        quantize_row_q8k(Some(self.0), x, out);
    }

    fn dot<const N: usize>(&self, w: &[u8], xs: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: `self.0` proves the CPU has the enabled features.
        unsafe { dot_q4k(w, xs) }
    }
}

/// Q6_K weights against [`BlockQ8K`] activations.
pub(crate) struct Q6KKernel(pub Avx2);

impl RowKernel for Q6KKernel {
    type Act = BlockQ8K;
    const ACT_BLOCK: usize = 256;

    fn prepare(&self, x: &[f32], out: &mut [BlockQ8K]) {
        quantize_row_q8k(Some(self.0), x, out);
    }

    fn dot<const N: usize>(&self, w: &[u8], xs: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: `self.0` proves the CPU has the enabled features.
        unsafe { dot_q6k(w, xs) }
    }
}
