//! Q5_K: super-blocks of 256,
//! `{ d: f16, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128] }` (176 bytes).
//!
//! Scales and mins as in Q4_K; 4-bit low parts as in Q4_K; the fifth bit of element
//! `32s + l` (sub-block `s`) is bit `s` of `qh[l]`. `x = d·scale · q - dmin·min`.

use super::f16_at;
use super::q4_k::scale_min_k4;
use crate::types::QK_K;

/// Decode whole Q5_K super-blocks from `src` into `dst` (256 elements per 176 bytes).
pub fn dequantize_q5_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(176).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 0);
        let dmin = f16_at(b, 2);
        let scales = &b[4..16];
        let qh = &b[16..48];
        for g in 0..4 {
            let ql = &b[48 + 32 * g..48 + 32 * g + 32];
            let (sc1, m1) = scale_min_k4(2 * g, scales);
            let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
            let (d1, min1) = (d * f32::from(sc1), dmin * f32::from(m1));
            let (d2, min2) = (d * f32::from(sc2), dmin * f32::from(m2));
            let (bit1, bit2) = (1u8 << (2 * g), 1u8 << (2 * g + 1));
            let out = &mut y[64 * g..64 * g + 64];
            for l in 0..32 {
                let h1 = if qh[l] & bit1 != 0 { 16 } else { 0 };
                let h2 = if qh[l] & bit2 != 0 { 16 } else { 0 };
                out[l] = d1 * f32::from((ql[l] & 0x0F) + h1) - min1;
                out[l + 32] = d2 * f32::from((ql[l] >> 4) + h2) - min2;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::q4_k::tests::pack_scale_min;
    use crate::quant::test_util::{Rng, f16_bytes};

    #[test]
    fn hand_built_block_decodes_to_formula() {
        let (d, dmin) = (0.125f32, 0.5f32);
        let mut rng = Rng(55);
        let sc: Vec<u8> = (0..8).map(|_| rng.below(64) as u8).collect();
        let mn: Vec<u8> = (0..8).map(|_| rng.below(64) as u8).collect();
        let q: Vec<u8> = (0..256).map(|_| rng.below(32) as u8).collect();
        let mut block = f16_bytes(d).to_vec();
        block.extend(f16_bytes(dmin));
        block.extend(pack_scale_min(&sc, &mn));
        let mut qh = [0u8; 32];
        let mut qs = [0u8; 128];
        for (i, &v) in q.iter().enumerate() {
            let (g, k) = (i / 64, i % 64);
            let low = v & 15;
            qs[32 * g + k % 32] |= if k < 32 { low } else { low << 4 };
            qh[i % 32] |= (v >> 4) << (i / 32);
        }
        block.extend(qh);
        block.extend(qs);
        let mut out = vec![0.0f32; 256];
        dequantize_q5_k(&block, &mut out);
        for i in 0..256 {
            let s = i / 32;
            let want = d * f32::from(sc[s]) * f32::from(q[i]) - dmin * f32::from(mn[s]);
            assert_eq!(out[i], want, "element {i}");
        }
    }
}
