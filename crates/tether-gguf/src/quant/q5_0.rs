//! Q5_0: blocks of 32 elements, `{ d: f16, qh: u32, qs: [u8; 16] }` (22 bytes).
//!
//! Each element has a 4-bit low part (nibbles as in Q4_0) and a fifth bit: bit `i` of the
//! little-endian `qh` for element `i`. `x = (q - 16) · d`.

use super::f16_at;

/// Decode whole Q5_0 blocks from `src` into `dst` (32 elements per 22-byte block).
pub fn dequantize_q5_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(22).zip(dst.chunks_exact_mut(32)) {
        let d = f16_at(b, 0);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let qs = &b[6..22];
        for j in 0..16 {
            let h0 = ((qh >> j) & 1) << 4;
            let h1 = ((qh >> (j + 16)) & 1) << 4;
            let q0 = (u32::from(qs[j] & 0x0F) | h0) as i32 - 16;
            let q1 = (u32::from(qs[j] >> 4) | h1) as i32 - 16;
            y[j] = q0 as f32 * d;
            y[j + 16] = q1 as f32 * d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::test_util::{Rng, f16_bytes};

    #[test]
    fn hand_built_block_decodes_to_formula() {
        let d = 1.25f32;
        let mut rng = Rng(99);
        let q: Vec<u32> = (0..32).map(|_| rng.below(32)).collect();
        let mut block = f16_bytes(d).to_vec();
        let qh: u32 = (0..32).map(|i| (q[i] >> 4) << i).sum();
        block.extend(qh.to_le_bytes());
        for j in 0..16 {
            block.push(((q[j] & 15) | ((q[j + 16] & 15) << 4)) as u8);
        }
        let mut out = [0.0f32; 32];
        dequantize_q5_0(&block, &mut out);
        for i in 0..32 {
            assert_eq!(out[i], (q[i] as f32 - 16.0) * d, "element {i}");
        }
        assert!(q.iter().any(|v| *v >= 16) && q.iter().any(|v| *v < 16));
    }
}
