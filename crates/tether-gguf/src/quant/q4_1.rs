//! Q4_1: blocks of 32 elements, `{ d: f16, m: f16, qs: [u8; 16] }` (20 bytes).
//!
//! `x = q · d + m`; low nibbles are elements 0..16, high nibbles 16..32.

use super::f16_at;

/// Decode whole Q4_1 blocks from `src` into `dst` (32 elements per 20-byte block).
pub fn dequantize_q4_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(20).zip(dst.chunks_exact_mut(32)) {
        let d = f16_at(b, 0);
        let m = f16_at(b, 2);
        let qs = &b[4..20];
        for j in 0..16 {
            y[j] = f32::from(qs[j] & 0x0F) * d + m;
            y[j + 16] = f32::from(qs[j] >> 4) * d + m;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::test_util::f16_bytes;

    #[test]
    fn hand_built_block_decodes_to_formula() {
        let (d, m) = (0.5f32, -3.25f32);
        let q: Vec<u8> = (0..32).map(|i| ((i * 5 + 1) % 16) as u8).collect();
        let mut block = f16_bytes(d).to_vec();
        block.extend(f16_bytes(m));
        for j in 0..16 {
            block.push(q[j] | (q[j + 16] << 4));
        }
        let mut out = [0.0f32; 32];
        dequantize_q4_1(&block, &mut out);
        for i in 0..32 {
            assert_eq!(out[i], f32::from(q[i]) * d + m, "element {i}");
        }
    }
}
