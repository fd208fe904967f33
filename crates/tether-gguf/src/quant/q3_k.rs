//! Q3_K: super-blocks of 256, `{ hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: f16 }`
//! (110 bytes).
//!
//! Sixteen sub-blocks of 16 with 6-bit scales biased by 32: scale `s` has low 4 bits from
//! `scales[s % 8]` (low nibble for `s < 8`, high nibble otherwise) and high 2 bits from
//! `scales[8 + s % 4]` at bits `2·(s / 4)`. Each element has 2 low bits packed as in Q2_K
//! and a high bit in `hmask`: element `128h + 32j + k` uses bit `4h + j` of `hmask[k]`;
//! when that bit is clear the value is lowered by 4. `x = d·(scale - 32) · q`.

use super::f16_at;
use crate::types::QK_K;

/// The sixteen 6-bit scales, unbiased to `-32..32`.
fn unpack_scales(packed: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (s, o) in out.iter_mut().enumerate() {
        let low = if s < 8 {
            packed[s] & 0x0F
        } else {
            packed[s - 8] >> 4
        };
        let high = (packed[8 + s % 4] >> (2 * (s / 4))) & 3;
        *o = (low | (high << 4)) as i8 - 32;
    }
    out
}

/// Decode whole Q3_K super-blocks from `src` into `dst` (256 elements per 110 bytes).
pub fn dequantize_q3_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(110).zip(dst.chunks_exact_mut(QK_K)) {
        let hmask = &b[0..32];
        let scales = unpack_scales(&b[96..108]);
        let d = f16_at(b, 108);
        for half in 0..2 {
            let q = &b[32 + 32 * half..32 + 32 * half + 32];
            for j in 0..4 {
                let shift = 2 * j;
                let mask = 1u8 << (4 * half + j);
                for part in 0..2 {
                    let dl = d * f32::from(scales[8 * half + 2 * j + part]);
                    let out = &mut y[128 * half + 32 * j + 16 * part..][..16];
                    for (l, o) in out.iter_mut().enumerate() {
                        let k = 16 * part + l;
                        let low = ((q[k] >> shift) & 3) as i8;
                        let v = if hmask[k] & mask != 0 { low } else { low - 4 };
                        *o = dl * f32::from(v);
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
        let d = 0.375f32;
        let mut rng = Rng(33);
        let scale6: Vec<u8> = (0..16).map(|_| rng.below(64) as u8).collect();
        // Signed 3-bit values -4..=3, stored as low 2 bits + "high bit set means no -4".
        let v: Vec<i32> = (0..256).map(|_| rng.below(8) as i32 - 4).collect();
        let mut hmask = [0u8; 32];
        let mut qs = [0u8; 64];
        for (i, &val) in v.iter().enumerate() {
            let (half, r) = (i / 128, i % 128);
            let (j, k) = (r / 32, r % 32);
            let stored = (val + 4) as u8; // 0..8: bit 2 set means val >= 0
            qs[32 * half + k] |= (stored & 3) << (2 * j);
            if stored & 4 != 0 {
                hmask[k] |= 1 << (4 * half + j);
            }
        }
        let mut scales = [0u8; 12];
        for (s, &sv) in scale6.iter().enumerate() {
            if s < 8 {
                scales[s] |= sv & 0x0F;
            } else {
                scales[s - 8] |= (sv & 0x0F) << 4;
            }
            scales[8 + s % 4] |= (sv >> 4) << (2 * (s / 4));
        }
        let mut block = hmask.to_vec();
        block.extend(qs);
        block.extend(scales);
        block.extend(f16_bytes(d));
        let mut out = vec![0.0f32; 256];
        dequantize_q3_k(&block, &mut out);
        for i in 0..256 {
            let want = d * (f32::from(scale6[i / 16]) - 32.0) * v[i] as f32;
            assert_eq!(out[i], want, "element {i}");
        }
    }
}
