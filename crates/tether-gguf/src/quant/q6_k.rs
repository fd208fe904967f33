//! Q6_K: super-blocks of 256, `{ ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16 }`
//! (210 bytes).
//!
//! Sixteen sub-blocks of 16 with signed 8-bit scales; 6-bit quants biased by 32. Within each
//! 128-element half `h` and quarter `t` (32 elements, index `l`): the low 4 bits are in
//! `ql[64h + l + 32·(t % 2)]` (low nibble for `t < 2`, high for `t >= 2`) and the high 2 bits
//! at bits `2t..2t+2` of `qh[32h + l]`. `x = d·scale · (q - 32)`.

use super::f16_at;
use crate::types::QK_K;

/// Decode whole Q6_K super-blocks from `src` into `dst` (256 elements per 210 bytes).
pub fn dequantize_q6_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(210).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 208);
        for half in 0..2 {
            let ql = &b[64 * half..64 * half + 64];
            let qh = &b[128 + 32 * half..128 + 32 * half + 32];
            let sc = &b[192 + 8 * half..192 + 8 * half + 8];
            let out = &mut y[128 * half..128 * half + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i8 - 32;
                let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                let scale = |k: usize| d * f32::from(sc[k] as i8);
                out[l] = scale(is) * f32::from(q1);
                out[l + 32] = scale(is + 2) * f32::from(q2);
                out[l + 64] = scale(is + 4) * f32::from(q3);
                out[l + 96] = scale(is + 6) * f32::from(q4);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::test_util::{Rng, f16_bytes};

    #[test]
    fn hand_built_block_decodes_to_formula() {
        let d = 0.03125f32;
        let mut rng = Rng(66);
        let scales: Vec<i8> = (0..16)
            .map(|_| (rng.below(256) as i32 - 128) as i8)
            .collect();
        let q: Vec<u8> = (0..256).map(|_| rng.below(64) as u8).collect();
        let mut ql = [0u8; 128];
        let mut qh = [0u8; 64];
        for (i, &v) in q.iter().enumerate() {
            let (h, r) = (i / 128, i % 128);
            let (t, l) = (r / 32, r % 32);
            let low = v & 15;
            ql[64 * h + l + 32 * (t % 2)] |= if t < 2 { low } else { low << 4 };
            qh[32 * h + l] |= (v >> 4) << (2 * t);
        }
        let mut block = ql.to_vec();
        block.extend(qh);
        block.extend(scales.iter().map(|s| *s as u8));
        block.extend(f16_bytes(d));
        let mut out = vec![0.0f32; 256];
        dequantize_q6_k(&block, &mut out);
        for i in 0..256 {
            let want = d * f32::from(scales[i / 16]) * (f32::from(q[i]) - 32.0);
            assert_eq!(out[i], want, "element {i}");
        }
    }
}
