//! 8-bit quantization of activation rows, so quantized weights can be multiplied with
//! integer dot products (llama.cpp's `vec_dot_q4_0_q8_0` idea).
//!
//! These blocks live only in host scratch memory, never in a file, so they use the layout
//! that is fastest to read here (an `f32` scale) rather than ggml's on-disk Q8_0/Q8_K.
//! Quants are symmetric in `-127..=127`: never -128, which the AVX2 kernels rely on
//! (`_mm256_sign_epi8` of -128 would overflow).

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

/// Quantizes `x` (a multiple of 32 long) into `out` (`x.len() / 32` blocks).
pub(crate) fn quantize_row_q8(x: &[f32], out: &mut [BlockQ8]) {
    for (xb, b) in x.chunks_exact(32).zip(out.iter_mut()) {
        b.d = quantize_symmetric(xb, &mut b.qs);
        b.qsum8 = 8 * b.qs.iter().map(|q| i32::from(*q)).sum::<i32>();
    }
}

/// Quantizes `x` (a multiple of 256 long) into `out` (`x.len() / 256` blocks).
pub(crate) fn quantize_row_q8k(x: &[f32], out: &mut [BlockQ8K]) {
    for (xb, b) in x.chunks_exact(256).zip(out.iter_mut()) {
        b.d = quantize_symmetric(xb, &mut b.qs);
        for (s, q) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            *s = q.iter().map(|v| i16::from(*v)).sum();
        }
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
        quantize_row_q8(&x, &mut blocks);
        for (xb, b) in x.chunks(32).zip(&blocks) {
            let sum: i32 = b.qs.iter().map(|q| i32::from(*q)).sum();
            assert_eq!(b.qsum8, 8 * sum);
            for (v, q) in xb.iter().zip(b.qs) {
                assert!(q != -128);
                assert!((v - b.d * f32::from(q)).abs() <= b.d * 0.5 + 1e-6);
            }
        }
    }

    #[test]
    fn q8k_sums_match_quants_and_zero_rows_stay_zero() {
        let mut rng = Rng::new(4);
        let mut x = random_f32(&mut rng, 512, 2.0);
        x[256..].iter_mut().for_each(|v| *v = 0.0);
        let mut blocks = vec![BlockQ8K::default(); 2];
        quantize_row_q8k(&x, &mut blocks);
        for (s, q) in blocks[0].bsums.iter().zip(blocks[0].qs.chunks(16)) {
            assert_eq!(i32::from(*s), q.iter().map(|v| i32::from(*v)).sum::<i32>());
        }
        assert_eq!(blocks[1].d, 0.0);
        assert!(blocks[1].qs.iter().all(|q| *q == 0));
        let max_q = blocks[0].qs.iter().map(|q| q.unsigned_abs()).max().unwrap();
        assert_eq!(max_q, 127);
    }
}
