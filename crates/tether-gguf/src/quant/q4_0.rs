//! Q4_0: blocks of 32 elements, `{ d: f16, qs: [u8; 16] }` (18 bytes).
//!
//! `x = (q - 8) · d`; the low nibble of `qs[j]` is element `j`, the high nibble element
//! `j + 16`.

use super::f16_at;

const BLOCK: usize = 32;
const BLOCK_BYTES: usize = 18;

/// Decode whole Q4_0 blocks from `src` into `dst` (32 elements per 18-byte block).
pub fn dequantize_q4_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(BLOCK_BYTES)
        .zip(dst.chunks_exact_mut(BLOCK))
    {
        let d = f16_at(b, 0);
        let qs = &b[2..18];
        for j in 0..16 {
            let lo = i32::from(qs[j] & 0x0F) - 8;
            let hi = i32::from(qs[j] >> 4) - 8;
            y[j] = lo as f32 * d;
            y[j + 16] = hi as f32 * d;
        }
    }
}

/// Quantize `src` to Q4_0 with round-to-nearest, as ggml's reference quantizer does: the
/// element of largest magnitude maps to -8, `d = max / -8`.
///
/// # Panics
/// If `src.len()` is not a multiple of 32 or `dst.len()` is not `src.len() / 32 * 18`;
/// both are the caller's buffer sizing, never file input.
pub fn quantize_q4_0(src: &[f32], dst: &mut [u8]) {
    assert!(
        src.len().is_multiple_of(BLOCK) && dst.len() == src.len() / BLOCK * BLOCK_BYTES,
        "quantize_q4_0: {} elements into {} bytes; need a multiple of {BLOCK} elements and {BLOCK_BYTES} bytes per block",
        src.len(),
        dst.len()
    );
    for (x, b) in src
        .chunks_exact(BLOCK)
        .zip(dst.chunks_exact_mut(BLOCK_BYTES))
    {
        let mut amax = 0.0f32;
        let mut max = 0.0f32;
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b[0..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        for j in 0..16 {
            // Truncation after +8.5 is round-to-nearest of (x·id + 8); `as` saturates.
            let q0 = ((x[j] * id + 8.5) as i8).clamp(0, 15) as u8;
            let q1 = ((x[j + 16] * id + 8.5) as i8).clamp(0, 15) as u8;
            b[2 + j] = q0 | (q1 << 4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::test_util::{Rng, f16_bytes};

    #[test]
    fn hand_built_block_decodes_to_formula() {
        let d = 0.75f32;
        let q: Vec<u8> = (0..32).map(|i| ((i * 7 + 3) % 16) as u8).collect();
        let mut block = f16_bytes(d).to_vec();
        for j in 0..16 {
            block.push(q[j] | (q[j + 16] << 4));
        }
        let mut out = [0.0f32; 32];
        dequantize_q4_0(&block, &mut out);
        for i in 0..32 {
            assert_eq!(out[i], (f32::from(q[i]) - 8.0) * d, "element {i}");
        }
    }

    #[test]
    fn round_trip_error_is_within_one_step() {
        let mut rng = Rng(0x1234_5678);
        let x: Vec<f32> = (0..32 * 8)
            .map(|_| rng.below(20001) as f32 / 1000.0 - 10.0)
            .collect();
        let mut bytes = vec![0u8; 8 * BLOCK_BYTES];
        quantize_q4_0(&x, &mut bytes);
        let mut back = vec![0.0f32; x.len()];
        dequantize_q4_0(&bytes, &mut back);
        for (xb, yb) in x.chunks(32).zip(back.chunks(32)) {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            // One full step: the positive extreme clamps from +8 to +7.
            let tol = amax / 8.0 * 1.01;
            for (a, b) in xb.iter().zip(yb) {
                assert!((a - b).abs() <= tol, "{a} vs {b} (tol {tol})");
            }
        }
    }

    #[test]
    fn zero_block_quantizes_to_zero() {
        let mut bytes = [0xFFu8; BLOCK_BYTES];
        quantize_q4_0(&[0.0; 32], &mut bytes);
        let mut back = [1.0f32; 32];
        dequantize_q4_0(&bytes, &mut back);
        assert!(back.iter().all(|v| *v == 0.0));
    }
}
