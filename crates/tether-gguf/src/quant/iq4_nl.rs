//! IQ4_NL: blocks of 32 elements, `{ d: f16, qs: [u8; 16] }` (18 bytes).
//!
//! A non-linear 4-bit format: each nibble indexes [`KVALUES_IQ4NL`], `x = d · table[q]`.
//! The low nibble of `qs[j]` is element `j`, the high nibble element `j + 16` (as Q4_0).

use super::f16_at;

const BLOCK: usize = 32;
const BLOCK_BYTES: usize = 18;

/// The 16 levels a 4-bit i-quant index selects (ggml's `kvalues_iq4nl`), shared by IQ4_NL
/// and IQ4_XS.
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Decode the 32 elements of one sub-block: `x = scale · table[q]`, low nibbles of the 16
/// bytes first, then high nibbles.
#[inline]
pub(crate) fn decode_iq4_nibbles(scale: f32, qs: &[u8], out: &mut [f32]) {
    for j in 0..16 {
        out[j] = scale * f32::from(KVALUES_IQ4NL[usize::from(qs[j] & 0x0F)]);
        out[j + 16] = scale * f32::from(KVALUES_IQ4NL[usize::from(qs[j] >> 4)]);
    }
}

/// Decode whole IQ4_NL blocks from `src` into `dst` (32 elements per 18-byte block).
pub fn dequantize_iq4_nl(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(BLOCK_BYTES)
        .zip(dst.chunks_exact_mut(BLOCK))
    {
        decode_iq4_nibbles(f16_at(b, 0), &b[2..18], y);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::test_util::f16_bytes;

    #[test]
    fn hand_built_block_decodes_to_formula() {
        let d = 0.375f32;
        let q: Vec<u8> = (0..32).map(|i| ((i * 5 + 2) % 16) as u8).collect();
        let mut block = f16_bytes(d).to_vec();
        for j in 0..16 {
            block.push(q[j] | (q[j + 16] << 4));
        }
        let mut out = [0.0f32; 32];
        dequantize_iq4_nl(&block, &mut out);
        for i in 0..32 {
            let want = d * f32::from(KVALUES_IQ4NL[usize::from(q[i])]);
            assert_eq!(out[i], want, "element {i}");
        }
        // Spot values straight from the table: nibble 0 is -127, nibble 15 is 113.
        let mut edge = f16_bytes(1.0).to_vec();
        edge.extend([0xF0u8; 16]);
        dequantize_iq4_nl(&edge, &mut out);
        assert_eq!(out[0], -127.0);
        assert_eq!(out[16], 113.0);
    }

    #[test]
    fn blocks_are_independent() {
        let mut two = f16_bytes(2.0).to_vec();
        two.extend([0x88u8; 16]);
        two.extend(f16_bytes(-0.5));
        two.extend([0x77u8; 16]);
        let mut out = [0.0f32; 64];
        dequantize_iq4_nl(&two, &mut out);
        assert!(out[..32].iter().all(|v| *v == 2.0), "table[8] = 1");
        assert!(out[32..].iter().all(|v| *v == 5.0), "table[7] = -10");
    }
}
