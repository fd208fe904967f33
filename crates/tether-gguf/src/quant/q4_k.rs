//! Q4_K: super-blocks of 256, `{ d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128] }`
//! (144 bytes).
//!
//! Eight sub-blocks of 32, each with a 6-bit scale and 6-bit min packed in `scales` (see
//! [`scale_min_k4`]). `x = d·scale · q - dmin·min` with 4-bit `q`: each 64-element group
//! uses 32 bytes of `qs`, low nibbles for its first 32 elements, high nibbles for the next 32.

use super::f16_at;
use crate::types::QK_K;

/// The 6-bit (scale, min) of sub-block `j` (0..8) from the 12 packed bytes shared by Q4_K and
/// Q5_K: sub-blocks 0..4 keep theirs in the low 6 bits of bytes `j` and `j + 4`; sub-blocks
/// 4..8 take low 4 bits from byte `j + 4`'s nibbles and high 2 bits from the top bits of
/// bytes `j - 4` (scale) and `j` (min).
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        let sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        let m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        (sc, m)
    }
}

/// Decode whole Q4_K super-blocks from `src` into `dst` (256 elements per 144 bytes).
pub fn dequantize_q4_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(144).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_at(b, 0);
        let dmin = f16_at(b, 2);
        let scales = &b[4..16];
        for g in 0..4 {
            let q = &b[16 + 32 * g..16 + 32 * g + 32];
            let (sc1, m1) = scale_min_k4(2 * g, scales);
            let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
            let (d1, min1) = (d * f32::from(sc1), dmin * f32::from(m1));
            let (d2, min2) = (d * f32::from(sc2), dmin * f32::from(m2));
            let out = &mut y[64 * g..64 * g + 64];
            for l in 0..32 {
                out[l] = d1 * f32::from(q[l] & 0x0F) - min1;
                out[l + 32] = d2 * f32::from(q[l] >> 4) - min2;
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::quant::test_util::{Rng, f16_bytes};

    /// Pack eight 6-bit (scale, min) pairs the way Q4_K/Q5_K store them.
    pub fn pack_scale_min(sc: &[u8], mn: &[u8]) -> [u8; 12] {
        let mut p = [0u8; 12];
        for j in 0..8 {
            if j < 4 {
                p[j] |= sc[j] & 63;
                p[j + 4] |= mn[j] & 63;
            } else {
                p[j + 4] |= (sc[j] & 15) | ((mn[j] & 15) << 4);
                p[j - 4] |= (sc[j] >> 4) << 6;
                p[j] |= (mn[j] >> 4) << 6;
            }
        }
        p
    }

    #[test]
    fn scale_min_unpacks_what_was_packed() {
        let sc = [63, 0, 17, 42, 63, 1, 33, 48];
        let mn = [5, 63, 0, 21, 62, 63, 16, 31];
        let p = pack_scale_min(&sc, &mn);
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &p), (sc[j], mn[j]), "sub-block {j}");
        }
    }

    #[test]
    fn hand_built_block_decodes_to_formula() {
        let (d, dmin) = (0.0625f32, 0.125f32);
        let mut rng = Rng(44);
        let sc: Vec<u8> = (0..8).map(|_| rng.below(64) as u8).collect();
        let mn: Vec<u8> = (0..8).map(|_| rng.below(64) as u8).collect();
        let q: Vec<u8> = (0..256).map(|_| rng.below(16) as u8).collect();
        let mut block = f16_bytes(d).to_vec();
        block.extend(f16_bytes(dmin));
        block.extend(pack_scale_min(&sc, &mn));
        let mut qs = [0u8; 128];
        for (i, &v) in q.iter().enumerate() {
            let (g, k) = (i / 64, i % 64);
            qs[32 * g + k % 32] |= if k < 32 { v } else { v << 4 };
        }
        block.extend(qs);
        let mut out = vec![0.0f32; 256];
        dequantize_q4_k(&block, &mut out);
        for i in 0..256 {
            let s = i / 32;
            let want = d * f32::from(sc[s]) * f32::from(q[i]) - dmin * f32::from(mn[s]);
            assert_eq!(out[i], want, "element {i}");
        }
    }
}
