//! Q8_1: blocks of 32 elements, `{ d: f16, s: f16, qs: [i8; 32] }` (36 bytes); `x = q · d`.
//!
//! `s` caches `d · Σq` for dot products and plays no part in the values.

use super::f16_at;

/// Decode whole Q8_1 blocks from `src` into `dst` (32 elements per 36-byte block).
pub fn dequantize_q8_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(36).zip(dst.chunks_exact_mut(32)) {
        let d = f16_at(b, 0);
        for (yj, &q) in y.iter_mut().zip(&b[4..36]) {
            *yj = f32::from(q as i8) * d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::test_util::f16_bytes;

    #[test]
    fn hand_built_block_decodes_to_formula() {
        let d = 2.0f32;
        let q: Vec<i8> = (0..32).map(|i| (i * 3 - 40) as i8).collect();
        let mut block = f16_bytes(d).to_vec();
        block.extend(f16_bytes(12344.0)); // s is ignored
        block.extend(q.iter().map(|v| *v as u8));
        let mut out = [0.0f32; 32];
        dequantize_q8_1(&block, &mut out);
        for i in 0..32 {
            assert_eq!(out[i], f32::from(q[i]) * d, "element {i}");
        }
    }
}
