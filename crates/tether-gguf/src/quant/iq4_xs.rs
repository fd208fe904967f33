//! IQ4_XS: super-blocks of 256, `{ d: f16, scales_h: u16, scales_l: [u8; 4], qs: [u8; 128] }`
//! (136 bytes).
//!
//! Eight sub-blocks of 32 with a 6-bit scale `ls`: its low 4 bits are nibble `j % 2` of
//! `scales_l[j / 2]`, its high 2 bits are bits `2j..2j+2` of `scales_h`. Sub-block `j` uses
//! 16 bytes of `qs` decoded as IQ4_NL with scale `d · (ls - 32)`.

use super::f16_at;
use super::iq4_nl::decode_iq4_nibbles;
use crate::types::QK_K;

const BLOCK_BYTES: usize = 136;

/// The 6-bit scale of sub-block `j` (0..8), before the `- 32` offset.
fn sub_block_scale(j: usize, scales_h: u16, scales_l: &[u8]) -> i32 {
    let low = (scales_l[j / 2] >> (4 * (j % 2))) & 0x0F;
    let high = (scales_h >> (2 * j)) & 3;
    i32::from(low) | (i32::from(high) << 4)
}

/// Decode whole IQ4_XS super-blocks from `src` into `dst` (256 elements per 136 bytes).
pub fn dequantize_iq4_xs(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(BLOCK_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_at(b, 0);
        let scales_h = u16::from_le_bytes([b[2], b[3]]);
        let scales_l = &b[4..8];
        for j in 0..8 {
            // ggml computes the sub-block scale in f32 before multiplying by the level.
            let dl = d * (sub_block_scale(j, scales_h, scales_l) - 32) as f32;
            let qs = &b[8 + 16 * j..8 + 16 * j + 16];
            decode_iq4_nibbles(dl, qs, &mut y[32 * j..32 * j + 32]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::iq4_nl::KVALUES_IQ4NL;
    use crate::quant::test_util::{Rng, f16_bytes};

    /// Pack eight 6-bit scales into (`scales_h`, `scales_l`).
    fn pack_scales(ls: &[u8; 8]) -> (u16, [u8; 4]) {
        let mut h = 0u16;
        let mut l = [0u8; 4];
        for j in 0..8 {
            l[j / 2] |= (ls[j] & 0x0F) << (4 * (j % 2));
            h |= u16::from(ls[j] >> 4) << (2 * j);
        }
        (h, l)
    }

    #[test]
    fn scales_unpack_what_was_packed() {
        let ls = [0, 63, 32, 17, 48, 1, 31, 33];
        let (h, l) = pack_scales(&ls);
        for (j, &want) in ls.iter().enumerate() {
            assert_eq!(sub_block_scale(j, h, &l), i32::from(want), "sub-block {j}");
        }
    }

    #[test]
    fn hand_built_block_decodes_to_formula() {
        let d = 0.0625f32;
        let mut rng = Rng(2024);
        let mut ls = [0u8; 8];
        for s in &mut ls {
            *s = rng.below(64) as u8;
        }
        let q: Vec<u8> = (0..256).map(|_| rng.below(16) as u8).collect();
        let (h, l) = pack_scales(&ls);
        let mut block = f16_bytes(d).to_vec();
        block.extend(h.to_le_bytes());
        block.extend(l);
        let mut qs = [0u8; 128];
        for (i, &v) in q.iter().enumerate() {
            let (s, k) = (i / 32, i % 32);
            qs[16 * s + k % 16] |= if k < 16 { v } else { v << 4 };
        }
        block.extend(qs);
        assert_eq!(block.len(), BLOCK_BYTES);
        let mut out = vec![0.0f32; 256];
        dequantize_iq4_xs(&block, &mut out);
        for i in 0..256 {
            let dl = d * (f32::from(ls[i / 32]) - 32.0);
            let want = dl * f32::from(KVALUES_IQ4NL[usize::from(q[i])]);
            assert_eq!(out[i], want, "element {i}");
        }
    }

    #[test]
    fn scale_32_is_zero_and_scale_0_is_minus_32() {
        let mut ls = [32u8; 8];
        ls[1] = 0;
        let (h, l) = pack_scales(&ls);
        let mut block = f16_bytes(1.0).to_vec();
        block.extend(h.to_le_bytes());
        block.extend(l);
        block.extend([0x88u8; 128]); // table[8] = 1
        let mut out = vec![1.0f32; 256];
        dequantize_iq4_xs(&block, &mut out);
        assert!(out[..32].iter().all(|v| *v == 0.0));
        assert!(out[32..64].iter().all(|v| *v == -32.0));
        assert!(out[64..].iter().all(|v| *v == 0.0));
    }
}
