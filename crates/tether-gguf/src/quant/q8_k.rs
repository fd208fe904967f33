//! Q8_K: super-blocks of 256, `{ d: f32, qs: [i8; 256], bsums: [i16; 16] }` (292 bytes).
//!
//! `x = q · d`; `bsums` cache sums of 16 quants for dot products.

/// Decode whole Q8_K super-blocks from `src` into `dst` (256 elements per 292 bytes).
pub fn dequantize_q8_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(292).zip(dst.chunks_exact_mut(256)) {
        let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        for (yj, &q) in y.iter_mut().zip(&b[4..260]) {
            *yj = f32::from(q as i8) * d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_built_block_decodes_to_formula() {
        let d = 0.1f32; // f32 scale: need not be an f16 value
        let q: Vec<i8> = (0..256i32).map(|i| (i - 128) as i8).collect();
        let mut block = d.to_le_bytes().to_vec();
        block.extend(q.iter().map(|v| *v as u8));
        block.extend([0u8; 32]);
        let mut out = vec![0.0f32; 256];
        dequantize_q8_k(&block, &mut out);
        for i in 0..256 {
            assert_eq!(out[i], f32::from(q[i]) * d, "element {i}");
        }
    }
}
