//! Dequantization of the ggml block formats to `f32`, and the two reference quantizers
//! (Q8_0, Q4_0) that the KV cache and the tests need.
//!
//! Each family lives in its own file and follows the block layouts of the GGUF/ggml public
//! format: little-endian, `f16` scales, blocks of 32 elements (legacy quants, IQ4_NL) or
//! super-blocks of [`QK_K`](crate::QK_K) = 256 elements (k-quants, IQ4_XS). The arithmetic is done in `f32` in the
//! same order as the reference formulas so results match bit for bit.

mod floats;
mod iq4_nl;
mod iq4_xs;
mod q2_k;
mod q3_k;
mod q4_0;
mod q4_1;
mod q4_k;
mod q5_0;
mod q5_1;
mod q5_k;
mod q6_k;
mod q8_0;
mod q8_1;
mod q8_k;

pub use floats::{dequantize_bf16, dequantize_f16, dequantize_f32};
pub use iq4_nl::{KVALUES_IQ4NL, dequantize_iq4_nl};
pub use iq4_xs::dequantize_iq4_xs;
pub use q2_k::dequantize_q2_k;
pub use q3_k::dequantize_q3_k;
pub use q4_0::{dequantize_q4_0, quantize_q4_0};
pub use q4_1::dequantize_q4_1;
pub use q4_k::dequantize_q4_k;
pub use q5_0::dequantize_q5_0;
pub use q5_1::dequantize_q5_1;
pub use q5_k::dequantize_q5_k;
pub use q6_k::dequantize_q6_k;
pub use q8_0::{dequantize_q8_0, quantize_q8_0};
pub use q8_1::dequantize_q8_1;
pub use q8_k::dequantize_q8_k;

use crate::types::GgmlType;

/// Why a buffer could not be dequantized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// The element count is not a whole number of the type's blocks.
    #[error(
        "cannot dequantize {elems} elements of {ty}: not a whole number of {block}-element blocks; \
         the tensor's first dimension must be a multiple of the block size"
    )]
    NotWholeBlocks {
        /// The block type.
        ty: GgmlType,
        /// Requested element count.
        elems: usize,
        /// Elements per block of `ty`.
        block: usize,
    },
    /// The source buffer does not hold exactly the bytes the element count needs.
    #[error(
        "cannot dequantize {elems} elements of {ty}: source holds {got} bytes but {want} are needed; \
         the tensor data is truncated or its type/shape is wrong"
    )]
    SizeMismatch {
        /// The block type.
        ty: GgmlType,
        /// Requested element count.
        elems: usize,
        /// Bytes supplied.
        got: usize,
        /// Bytes the element count needs.
        want: u64,
    },
    /// This type has no dequantizer here.
    #[error("dequantizing {ty} is not supported")]
    Unsupported {
        /// The block type.
        ty: GgmlType,
    },
}

/// Decode `dst.len()` elements of type `ty` from `src` into `dst`.
///
/// `src` must hold exactly `ty.bytes_for(dst.len())` bytes.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    let elems = dst.len();
    let want = ty
        .bytes_for(elems as u64)
        .ok_or(QuantError::NotWholeBlocks {
            ty,
            elems,
            block: ty.block_elems(),
        })?;
    if src.len() as u64 != want {
        return Err(QuantError::SizeMismatch {
            ty,
            elems,
            got: src.len(),
            want,
        });
    }
    match ty {
        GgmlType::F32 => dequantize_f32(src, dst),
        GgmlType::F16 => dequantize_f16(src, dst),
        GgmlType::BF16 => dequantize_bf16(src, dst),
        GgmlType::Q4_0 => dequantize_q4_0(src, dst),
        GgmlType::Q4_1 => dequantize_q4_1(src, dst),
        GgmlType::Q5_0 => dequantize_q5_0(src, dst),
        GgmlType::Q5_1 => dequantize_q5_1(src, dst),
        GgmlType::Q8_0 => dequantize_q8_0(src, dst),
        GgmlType::Q8_1 => dequantize_q8_1(src, dst),
        GgmlType::Q2K => dequantize_q2_k(src, dst),
        GgmlType::Q3K => dequantize_q3_k(src, dst),
        GgmlType::Q4K => dequantize_q4_k(src, dst),
        GgmlType::Q5K => dequantize_q5_k(src, dst),
        GgmlType::Q6K => dequantize_q6_k(src, dst),
        GgmlType::Q8K => dequantize_q8_k(src, dst),
        GgmlType::IQ4NL => dequantize_iq4_nl(src, dst),
        GgmlType::IQ4XS => dequantize_iq4_xs(src, dst),
    }
    Ok(())
}

/// Read the little-endian `f16` at `at` as `f32`.
#[inline]
pub(crate) fn f16_at(bytes: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

#[cfg(test)]
pub(crate) mod test_util {
    /// Little-endian bytes of `x` rounded to `f16`; tests pick values exactly representable.
    pub fn f16_bytes(x: f32) -> [u8; 2] {
        let h = half::f16::from_f32(x);
        assert_eq!(h.to_f32(), x, "test scale {x} must be exact in f16");
        h.to_le_bytes()
    }

    /// A deterministic pseudo-random sequence (xorshift) for filling test blocks.
    pub struct Rng(pub u64);
    impl Rng {
        pub fn next_u32(&mut self) -> u32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 32) as u32
        }
        pub fn below(&mut self, n: u32) -> u32 {
            self.next_u32() % n
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrong_sizes_are_errors_not_panics() {
        let mut dst = vec![0.0; 33];
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0; 18], &mut dst),
            Err(QuantError::NotWholeBlocks { .. })
        ));
        let mut dst = vec![0.0; 64];
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0; 35], &mut dst),
            Err(QuantError::SizeMismatch { want: 36, .. })
        ));
        let mut dst = vec![0.0; 256];
        for ty in GgmlType::ALL {
            if let Some(n) = ty.bytes_for(256) {
                let src = vec![0u8; n as usize];
                dequantize(ty, &src, &mut dst).unwrap();
                assert!(
                    dst.iter().all(|x| *x == 0.0),
                    "{ty}: zero bytes decode to zero"
                );
            }
        }
    }
}
