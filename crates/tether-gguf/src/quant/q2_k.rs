//! Q2_K: super-blocks of 256, `{ scales: [u8; 16], qs: [u8; 64], d: f16, dmin: f16 }`
//! (84 bytes).
//!
//! Sixteen sub-blocks of 16 elements; `scales[s]` holds the sub-block's 4-bit scale (low
//! nibble) and 4-bit min (high nibble). `x = d·scale · q - dmin·min` with 2-bit `q`. Within
//! each 128-element half, byte `k` of that half's 32 `qs` bytes holds, at bits `2j..2j+2`,
//! element `32j + k`.

use super::f16_at;
use crate::types::QK_K;

/// Decode whole Q2_K super-blocks from `src` into `dst` (256 elements per 84 bytes).
pub fn dequantize_q2_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(84).zip(dst.chunks_exact_mut(QK_K)) {
        let scales = &b[0..16];
        let d = f16_at(b, 80);
        let dmin = f16_at(b, 82);
        for half in 0..2 {
            let q = &b[16 + 32 * half..16 + 32 * half + 32];
            for j in 0..4 {
                let shift = 2 * j;
                for part in 0..2 {
                    let sc = scales[8 * half + 2 * j + part];
                    let dl = d * f32::from(sc & 0x0F);
                    let ml = dmin * f32::from(sc >> 4);
                    let out = &mut y[128 * half + 32 * j + 16 * part..][..16];
                    for (l, o) in out.iter_mut().enumerate() {
                        let v = (q[16 * part + l] >> shift) & 3;
                        *o = dl * f32::from(v) - ml;
                    }
                }
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
        let (d, dmin) = (0.5f32, 0.25f32);
        let mut rng = Rng(21);
        let sc: Vec<u8> = (0..16).map(|_| rng.below(16) as u8).collect();
        let mn: Vec<u8> = (0..16).map(|_| rng.below(16) as u8).collect();
        let q: Vec<u8> = (0..256).map(|_| rng.below(4) as u8).collect();
        let mut block: Vec<u8> = (0..16).map(|s| sc[s] | (mn[s] << 4)).collect();
        let mut qs = [0u8; 64];
        for (i, &v) in q.iter().enumerate() {
            let (half, r) = (i / 128, i % 128);
            qs[32 * half + r % 32] |= v << (2 * (r / 32));
        }
        block.extend(qs);
        block.extend(f16_bytes(d));
        block.extend(f16_bytes(dmin));
        let mut out = vec![0.0f32; 256];
        dequantize_q2_k(&block, &mut out);
        for i in 0..256 {
            let s = i / 16;
            let want = d * f32::from(sc[s]) * f32::from(q[i]) - dmin * f32::from(mn[s]);
            assert_eq!(out[i], want, "element {i}");
        }
    }
}
