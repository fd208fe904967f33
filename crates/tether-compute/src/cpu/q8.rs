//! 8-bit quantization of activation rows, so quantized weights can be multiplied with
//! integer dot products (llama.cpp's `vec_dot_q4_0_q8_0` idea).
//!
//! These blocks live only in host scratch memory, never in a file, so they use the layout
//! that is fastest to read here (an `f32` scale) rather than ggml's on-disk Q8_0/Q8_K.
//! Quants are symmetric in `-127..=127`: never -128, which the AVX2 kernels rely on
//! (`_mm256_sign_epi8` of -128 would overflow).

use crate::cpu::simd::Avx2;

/// 32 activations as `x ≈ d · qs[i]`, with `qsum8 = 8 · Σ qs` (Q4_0's `q - 8` weights
/// multiply unsigned quants and subtract `qsum8` in integers).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub(crate) struct BlockQ8 {
    pub d: f32,
    pub qsum8: i32,
    pub qs: [i8; 32],
}

impl Default for BlockQ8 {
    fn default() -> Self {
        Self {
            d: 0.0,
            qsum8: 0,
            qs: [0; 32],
        }
    }
}

/// 256 activations as `x ≈ d · qs[i]`, with the sums of each 16 quants (the k-quants'
/// minimum and bias terms need them).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub(crate) struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; 256],
    pub bsums: [i16; 16],
}

impl Default for BlockQ8K {
    fn default() -> Self {
        Self {
            d: 0.0,
            qs: [0; 256],
            bsums: [0; 16],
        }
    }
}

/// Round-to-nearest quantization of `x` with `d = max|x| / 127`; returns `d`.
fn quantize_symmetric(x: &[f32], qs: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (q, &v) in qs.iter_mut().zip(x) {
        // The clamp also maps NaN (from NaN input) to 0 instead of relying on `as`.
        *q = (v * id).round().clamp(-127.0, 127.0) as i8;
    }
    d
}

/// [`quantize_symmetric`] with AVX2 when the CPU has it (the same quants, bit for bit:
/// the portable `round` is a libm call on baseline x86-64, a few percent of prefill).
/// `x.len()` is a multiple of 32.
fn quantize_block(simd: Option<Avx2>, x: &[f32], qs: &mut [i8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd.is_some() {
        // SAFETY: the token proves the CPU has the enabled features.
        return unsafe { avx2::quantize_symmetric(x, qs) };
    }
    let _ = simd;
    quantize_symmetric(x, qs)
}

/// Quantizes `x` (a multiple of 32 long) into `out` (`x.len() / 32` blocks), with AVX2
/// when `simd` is given (the kernel's level decides, so a forced level runs its own code).
pub(crate) fn quantize_row_q8(simd: Option<Avx2>, x: &[f32], out: &mut [BlockQ8]) {
    for (xb, b) in x.chunks_exact(32).zip(out.iter_mut()) {
        b.d = quantize_block(simd, xb, &mut b.qs);
        b.qsum8 = 8 * b.qs.iter().map(|q| i32::from(*q)).sum::<i32>();
    }
}

/// Quantizes `x` (a multiple of 256 long) into `out` (`x.len() / 256` blocks), with AVX2
/// when `simd` is given.
pub(crate) fn quantize_row_q8k(simd: Option<Avx2>, x: &[f32], out: &mut [BlockQ8K]) {
    for (xb, b) in x.chunks_exact(256).zip(out.iter_mut()) {
        b.d = quantize_block(simd, xb, &mut b.qs);
        for (s, q) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            *s = q.iter().map(|v| i16::from(*v)).sum();
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Eight lanes of `x` from `at`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn load8(x: &[f32], at: usize) -> __m256 {
        let s = &x[at..at + 8];
        // SAFETY: `s` is 8 f32, one unaligned 256-bit load.
        unsafe { _mm256_loadu_ps(s.as_ptr()) }
    }

    /// `v` rounded half away from zero, as `f32::round`: truncate, then step away from
    /// zero where the dropped fraction is at least one half (both steps are exact).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn round_away(v: __m256) -> __m256 {
        let sign = _mm256_set1_ps(-0.0);
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
        let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(v, t));
        let step = _mm256_or_ps(_mm256_and_ps(v, sign), _mm256_set1_ps(1.0));
        let up = _mm256_cmp_ps::<_CMP_GE_OQ>(frac, _mm256_set1_ps(0.5));
        _mm256_add_ps(t, _mm256_and_ps(up, step))
    }

    /// Eight quants of `v · id`, clamped to ±127, NaN to 0, as i32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn quants8(v: __m256, id: __m256) -> __m256i {
        let s = _mm256_mul_ps(v, id);
        let r = round_away(s);
        let r = _mm256_min_ps(
            _mm256_max_ps(r, _mm256_set1_ps(-127.0)),
            _mm256_set1_ps(127.0),
        );
        let is_number = _mm256_cmp_ps::<_CMP_ORD_Q>(s, s);
        _mm256_cvttps_epi32(_mm256_and_ps(r, is_number))
    }

    /// The portable `quantize_symmetric` on 32-element steps.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn quantize_symmetric(x: &[f32], qs: &mut [i8]) -> f32 {
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_setzero_ps();
        for at in (0..x.len()).step_by(8) {
            // `max` returns its second operand when the first is NaN, so NaN inputs are
            // skipped as `f32::max` skips them.
            m = _mm256_max_ps(_mm256_andnot_ps(sign, load8(x, at)), m);
        }
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        // Bytes come out of the two packs in the order 0-3, 8-11, 16-19, 24-27, 4-7, ...
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (at, out) in (0..x.len()).step_by(32).zip(qs.chunks_exact_mut(32)) {
            let q = |k: usize| quants8(load8(x, at + 8 * k), id);
            let lo = _mm256_packs_epi32(q(0), q(1));
            let hi = _mm256_packs_epi32(q(2), q(3));
            let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(lo, hi), order);
            // SAFETY: `out` is 32 bytes, one unaligned 256-bit store.
            unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), bytes) };
        }
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::test_util::{Rng, random_f32};

    #[test]
    fn q8_round_trip_is_within_half_a_step() {
        let mut rng = Rng::new(3);
        let x = random_f32(&mut rng, 32 * 5, 4.0);
        let mut blocks = vec![BlockQ8::default(); 5];
        quantize_row_q8(Avx2::detect(), &x, &mut blocks);
        for (xb, b) in x.chunks(32).zip(&blocks) {
            let sum: i32 = b.qs.iter().map(|q| i32::from(*q)).sum();
            assert_eq!(b.qsum8, 8 * sum);
            for (v, q) in xb.iter().zip(b.qs) {
                assert!(q != -128);
                assert!((v - b.d * f32::from(q)).abs() <= b.d * 0.5 + 1e-6);
            }
        }
    }

    /// The AVX2 quantizer against the portable one, bit for bit: random rows, rows with
    /// exact halves (d = 1, so every `k + 0.5` is a tie), and a row with NaN.
    #[test]
    fn avx2_quantizer_matches_the_portable_one() {
        let Some(cpu) = Avx2::detect() else {
            eprintln!("skipped: this CPU lacks AVX2, FMA or F16C");
            return;
        };
        let mut rng = Rng::new(6);
        let mut rows = vec![
            random_f32(&mut rng, 256, 3.0),
            random_f32(&mut rng, 64, 1e-3),
        ];
        rows.push(
            (0..256)
                .map(|i| (i % 255) as f32 - 127.0 + 0.5 * (i % 2) as f32)
                .collect(),
        );
        rows.push(
            (0..32)
                .map(|i| if i == 5 { f32::NAN } else { i as f32 - 15.5 })
                .collect(),
        );
        rows.push(vec![0.0; 32]);
        for x in rows {
            let mut want = vec![0i8; x.len()];
            let mut got = vec![0i8; x.len()];
            let d_want = quantize_symmetric(&x, &mut want);
            let d_got = quantize_block(Some(cpu), &x, &mut got);
            assert_eq!(d_got.to_bits(), d_want.to_bits());
            assert_eq!(got, want);
        }
    }

    #[test]
    fn q8k_sums_match_quants_and_zero_rows_stay_zero() {
        let mut rng = Rng::new(4);
        let mut x = random_f32(&mut rng, 512, 2.0);
        x[256..].iter_mut().for_each(|v| *v = 0.0);
        let mut blocks = vec![BlockQ8K::default(); 2];
        quantize_row_q8k(Avx2::detect(), &x, &mut blocks);
        for (s, q) in blocks[0].bsums.iter().zip(blocks[0].qs.chunks(16)) {
            assert_eq!(i32::from(*s), q.iter().map(|v| i32::from(*v)).sum::<i32>());
        }
        assert_eq!(blocks[1].d, 0.0);
        assert!(blocks[1].qs.iter().all(|q| *q == 0));
        let max_q = blocks[0].qs.iter().map(|q| q.unsigned_abs()).max().unwrap();
        assert_eq!(max_q, 127);
    }
}
