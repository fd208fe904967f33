//! AVX2 kernels for the 5-bit quants: Q5_0 (qwen2-style models fall back to it when a row
//! is not whole 256-blocks) and Q5_K (Q5_K_M files). The fifth bits are spread from their
//! bit masks to bytes, then the arithmetic is that of Q4_0 and Q4_K.

use std::arch::x86_64::*;

use super::RowKernel;
use super::avx2::{dot_i8, f16_at, load_q8};
use super::scalar::unpack_q4k_scales;
use crate::cpu::q8::{BlockQ8, BlockQ8K, quantize_row_q8, quantize_row_q8k};
use crate::cpu::simd::{Avx2, hsum_ps};

/// Bit `i` of `bits` as byte `i` (`0x10` when set, 0 otherwise), for `i < 32`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bits_to_bytes(bits: u32) -> __m256i {
    let v = _mm256_set1_epi32(bits as i32);
    // Byte i takes byte i / 8 of the word, then tests its own bit i % 8.
    let spread = _mm256_shuffle_epi8(
        v,
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    let mask = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q5_0<const N: usize>(w: &[u8], xs: [&[BlockQ8]; N]) -> [f32; N] {
    let mut acc = [_mm256_setzero_ps(); N];
    let m4 = _mm_set1_epi8(0x0F);
    for (b, blk) in w.chunks_exact(22).enumerate() {
        let d = f16_at(blk, 0);
        let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
        let qs = &blk[6..22];
        // SAFETY: `qs` is 16 bytes, one unaligned 128-bit load.
        let v = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
        let lo = _mm_and_si128(v, m4);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m4);
        let q = _mm256_or_si256(_mm256_set_m128i(hi, lo), bits_to_bytes(qh));
        let q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
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

/// 32 bytes of `s` starting at `at`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load32(s: &[u8], at: usize) -> __m256i {
    let s = &s[at..at + 32];
    // SAFETY: `s` is 32 bytes, one unaligned 256-bit load.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// 32 activation quants starting at `at`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load32_i8(s: &[i8], at: usize) -> __m256i {
    let s = &s[at..at + 32];
    // SAFETY: `s` is 32 bytes, one unaligned 256-bit load.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q5k<const N: usize>(w: &[u8], xs: [&[BlockQ8K]; N]) -> [f32; N] {
    let mut acc = [_mm256_setzero_ps(); N];
    let m4 = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    for (b, blk) in w.chunks_exact(176).enumerate() {
        let d = f16_at(blk, 0);
        let dmin = f16_at(blk, 2);
        let (sc, mn) = unpack_q4k_scales(&blk[4..16]);
        let qh = load32(blk, 16);
        let mut sumi = [_mm256_setzero_si256(); N];
        for g in 0..4 {
            let v = load32(blk, 48 + 32 * g);
            // Fifth bits: bit 2g of qh[l] for the low nibbles, bit 2g + 1 for the high.
            let h_lo = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g as i32)), one);
            let h_hi = _mm256_and_si256(
                _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g as i32 + 1)),
                one,
            );
            let lo = _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_slli_epi16::<4>(h_lo));
            let hi = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4),
                _mm256_slli_epi16::<4>(h_hi),
            );
            let s_lo = _mm256_set1_epi16(i16::from(sc[2 * g]));
            let s_hi = _mm256_set1_epi16(i16::from(sc[2 * g + 1]));
            for (s, x) in sumi.iter_mut().zip(xs) {
                let y = &x[b];
                let p_lo = _mm256_maddubs_epi16(lo, load32_i8(&y.qs, 64 * g));
                let p_hi = _mm256_maddubs_epi16(hi, load32_i8(&y.qs, 64 * g + 32));
                let p =
                    _mm256_add_epi32(_mm256_madd_epi16(p_lo, s_lo), _mm256_madd_epi16(p_hi, s_hi));
                *s = _mm256_add_epi32(*s, p);
            }
        }
        for j in 0..N {
            let y = &xs[j][b];
            let summ: i32 = (0..8)
                .map(|s| {
                    i32::from(mn[s]) * (i32::from(y.bsums[2 * s]) + i32::from(y.bsums[2 * s + 1]))
                })
                .sum();
            let with_scales =
                _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), _mm256_cvtepi32_ps(sumi[j]), acc[j]);
            let m = _mm256_zextps128_ps256(_mm_set_ss(summ as f32));
            acc[j] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * y.d), m, with_scales);
        }
    }
    let mut out = [0.0f32; N];
    for j in 0..N {
        out[j] = hsum_ps(acc[j]);
    }
    out
}

/// Q5_0 weights against [`BlockQ8`] activations.
pub(crate) struct Q5_0Kernel(pub Avx2);

impl RowKernel for Q5_0Kernel {
    type Act = BlockQ8;
    const ACT_BLOCK: usize = 32;

    fn prepare(&self, x: &[f32], out: &mut [BlockQ8]) {
        quantize_row_q8(Some(self.0), x, out);
    }

    fn dot<const N: usize>(&self, w: &[u8], xs: [&[BlockQ8]; N]) -> [f32; N] {
        // SAFETY: `self.0` proves the CPU has the enabled features.
        unsafe { dot_q5_0(w, xs) }
    }
}

/// Q5_K weights against [`BlockQ8K`] activations.
pub(crate) struct Q5KKernel(pub Avx2);

impl RowKernel for Q5KKernel {
    type Act = BlockQ8K;
    const ACT_BLOCK: usize = 256;

    fn prepare(&self, x: &[f32], out: &mut [BlockQ8K]) {
        quantize_row_q8k(Some(self.0), x, out);
    }

    fn dot<const N: usize>(&self, w: &[u8], xs: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: `self.0` proves the CPU has the enabled features.
        unsafe { dot_q5k(w, xs) }
    }
}
