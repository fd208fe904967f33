//! Q8_0: blocks of 32 elements, `{ d: f16, qs: [i8; 32] }` (34 bytes); `x = q · d`.

use super::f16_at;

const BLOCK: usize = 32;
const BLOCK_BYTES: usize = 34;

/// Decode whole Q8_0 blocks from `src` into `dst` (32 elements per 34-byte block).
pub fn dequantize_q8_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(BLOCK_BYTES)
        .zip(dst.chunks_exact_mut(BLOCK))
    {
        let d = f16_at(b, 0);
        for (yj, &q) in y.iter_mut().zip(&b[2..34]) {
            *yj = f32::from(q as i8) * d;
        }
    }
}

/// Quantize `src` to Q8_0 with round-to-nearest, as ggml's reference quantizer does:
/// `d = max|x| / 127`, `q = round(x / d)`.
///
/// # Panics
/// If `src.len()` is not a multiple of 32 or `dst.len()` is not `src.len() / 32 * 34`;
/// both are the caller's buffer sizing, never file input.
pub fn quantize_q8_0(src: &[f32], dst: &mut [u8]) {
    assert!(
        src.len().is_multiple_of(BLOCK) && dst.len() == src.len() / BLOCK * BLOCK_BYTES,
        "quantize_q8_0: {} elements into {} bytes; need a multiple of {BLOCK} elements and {BLOCK_BYTES} bytes per block",
        src.len(),
        dst.len()
    );
    for (x, b) in src
        .chunks_exact(BLOCK)
        .zip(dst.chunks_exact_mut(BLOCK_BYTES))
    {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b[0..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        for (q, &v) in b[2..].iter_mut().zip(x) {
            *q = ((v * id).round() as i8) as u8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::test_util::{Rng, f16_bytes};

    #[test]
    fn hand_built_block_decodes_to_formula() {
        let d = 0.125f32;
        let q: Vec<i8> = (0..32).map(|i| (i * 9 - 128) as i8).collect();
        let mut block = f16_bytes(d).to_vec();
        block.extend(q.iter().map(|v| *v as u8));
        let mut out = [0.0f32; 32];
        dequantize_q8_0(&block, &mut out);
        for i in 0..32 {
            assert_eq!(out[i], f32::from(q[i]) * d, "element {i}");
        }
    }

    #[test]
    fn quantizer_rounds_to_nearest_with_max_at_127() {
        let mut x = [0.0f32; 32];
        x[0] = 127.0;
        x[1] = -63.5; // a tie: rounds away from zero
        x[2] = 10.4;
        x[3] = -0.6;
        let mut bytes = [0u8; 34];
        quantize_q8_0(&x, &mut bytes);
        assert_eq!(f16_at(&bytes, 0), 1.0);
        assert_eq!(bytes[2] as i8, 127);
        assert_eq!(bytes[3] as i8, -64);
        assert_eq!(bytes[4] as i8, 10);
        assert_eq!(bytes[5] as i8, -1);
        assert_eq!(bytes[6] as i8, 0);
    }

    #[test]
    fn round_trip_error_is_within_half_a_step() {
        let mut rng = Rng(0xDEAD_BEEF);
        let x: Vec<f32> = (0..32 * 16)
            .map(|_| rng.below(2_000_001) as f32 / 100_000.0 - 10.0)
            .collect();
        let mut bytes = vec![0u8; 16 * BLOCK_BYTES];
        quantize_q8_0(&x, &mut bytes);
        let mut back = vec![0.0f32; x.len()];
        dequantize_q8_0(&bytes, &mut back);
        for (xb, yb) in x.chunks(32).zip(back.chunks(32)) {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            // Half a step, plus the f16 rounding of d (relative 2^-11) times |q| <= 127.
            let tol = amax / 127.0 * 0.5 + amax * 2f32.powi(-11);
            for (a, b) in xb.iter().zip(yb) {
                assert!((a - b).abs() <= tol, "{a} vs {b} (tol {tol})");
            }
        }
    }
}
