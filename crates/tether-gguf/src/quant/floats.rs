//! Plain float element types: F32, F16 and BF16 (all little-endian).

/// Decode little-endian `f32` values.
pub fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(4).zip(dst.iter_mut()) {
        *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// Decode little-endian IEEE half-precision values.
pub fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *y = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

/// Decode little-endian bfloat16 values (the top 16 bits of an `f32`).
pub fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *y = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_decode_known_bit_patterns() {
        let mut out = [0.0f32; 3];
        let src: Vec<u8> = [1.5f32, -0.0, 1e-30]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        dequantize_f32(&src, &mut out);
        assert_eq!(out, [1.5, -0.0, 1e-30]);

        // f16: 0x3C00 = 1.0, 0xC000 = -2.0, 0x3555 ≈ 0.33325195
        let mut out = [0.0f32; 3];
        dequantize_f16(&[0x00, 0x3C, 0x00, 0xC0, 0x55, 0x35], &mut out);
        assert_eq!(out, [1.0, -2.0, 0.333_251_95]);

        // bf16: 0x3F80 = 1.0, 0xC040 = -3.0, 0x4049 = 3.140625
        let mut out = [0.0f32; 3];
        dequantize_bf16(&[0x80, 0x3F, 0x40, 0xC0, 0x49, 0x40], &mut out);
        assert_eq!(out, [1.0, -3.0, 3.140_625]);
    }
}
