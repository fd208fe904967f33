//! Random tensor data of any GGUF type with sane magnitudes, generated block by block
//! without a quantizer: random bytes everywhere, then the scale fields set so every
//! decoded value stays within about `±amp`.

use tether_gguf::GgmlType;

/// xorshift64*: fast enough to fill gigabytes in seconds.
pub(crate) struct FastRng(u64);

impl FastRng {
    pub(crate) fn new(seed: u64) -> Self {
        // Zero is a fixed point of xorshift.
        Self(seed ^ 0x2545_F491_4F6C_DD1D | 1)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `[-1, 1)`.
    pub(crate) fn signed_unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    pub(crate) fn fill(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next_u64().to_le_bytes();
        rest.copy_from_slice(&last[..rest.len()]);
    }
}

fn put_f16(block: &mut [u8], at: usize, x: f32) {
    block[at..at + 2].copy_from_slice(&half::f16::from_f32(x).to_le_bytes());
}

/// `(offset, value)` of each f16 scale field in a block of `ty`, for values within `±amp`.
fn scale_fields(ty: GgmlType, amp: f32) -> Vec<(usize, f32)> {
    match ty {
        // q in [-8, 8) · d
        GgmlType::Q4_0 => vec![(0, amp / 8.0)],
        // q in [0, 16) · d + m, m centring the mean q (7.5) on zero
        GgmlType::Q4_1 => vec![(0, amp / 8.0), (2, -amp * 7.5 / 8.0)],
        GgmlType::Q5_0 => vec![(0, amp / 16.0)],
        GgmlType::Q5_1 => vec![(0, amp / 16.0), (2, -amp * 15.5 / 16.0)],
        GgmlType::Q8_0 => vec![(0, amp / 127.0)],
        // d·(sc & 15)·q - dmin·(sc >> 4), q in 0..4; both terms average amp/4
        GgmlType::Q2K => vec![(80, amp / 45.0), (82, amp / 30.0)],
        // d·(sc - 32)·(q - 4)
        GgmlType::Q3K => vec![(108, amp / 128.0)],
        // d·sc·q - dmin·m, sc and m 6-bit, q 4-bit; both terms average amp/2
        GgmlType::Q4K => vec![(0, amp / (63.0 * 15.0) * 2.0), (2, amp / 63.0)],
        GgmlType::Q5K => vec![(0, amp / (63.0 * 31.0) * 2.0), (2, amp / 63.0)],
        // d·scale·(q - 32), scale i8
        GgmlType::Q6K => vec![(208, amp / (127.0 * 32.0))],
        // d·table[q], table in [-127, 113]
        GgmlType::IQ4NL => vec![(0, amp / 127.0)],
        // d·(ls - 32)·table[q], ls 6-bit from the random scale bytes
        GgmlType::IQ4XS => vec![(0, amp / (127.0 * 32.0))],
        _ => Vec::new(),
    }
}

/// Fills `out` (whole blocks of `ty`) with random data decoding to values in about `±amp`.
pub(crate) fn fill_random(ty: GgmlType, amp: f32, rng: &mut FastRng, out: &mut [u8]) {
    match ty {
        GgmlType::F32 => {
            for c in out.chunks_exact_mut(4) {
                c.copy_from_slice(&(rng.signed_unit() * amp).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in out.chunks_exact_mut(2) {
                put_f16(c, 0, rng.signed_unit() * amp);
            }
        }
        GgmlType::BF16 => {
            for c in out.chunks_exact_mut(2) {
                c.copy_from_slice(&half::bf16::from_f32(rng.signed_unit() * amp).to_le_bytes());
            }
        }
        _ => {
            rng.fill(out);
            let fields = scale_fields(ty, amp);
            for block in out.chunks_exact_mut(ty.block_bytes()) {
                for &(at, value) in &fields {
                    put_f16(block, at, value);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_decodes_within_its_amplitude_and_is_not_constant() {
        let types = GgmlType::WEIGHTS;
        let mut rng = FastRng::new(3);
        for ty in types {
            let n = 1024;
            let mut raw = vec![0u8; ty.bytes_for(n as u64).unwrap() as usize];
            fill_random(ty, 0.5, &mut rng, &mut raw);
            let mut vals = vec![0.0f32; n];
            tether_gguf::dequantize(ty, &raw, &mut vals).unwrap();
            let max = vals.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let mean_sq = vals.iter().map(|v| v * v).sum::<f32>() / n as f32;
            assert!(max <= 1.1, "{ty}: max {max}");
            assert!(mean_sq > 0.001, "{ty}: mean square {mean_sq}");
        }
    }
}
