//! Seeded random inputs for the cpu backend's tests.

use crate::rng::SplitMix64;
use tether_gguf::GgmlType;

/// Seeded test data from [`SplitMix64`].
pub struct Rng(SplitMix64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(SplitMix64::new(seed))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        self.0.next_f64()
    }

    /// Uniform in `[-amp, amp)`.
    pub fn symmetric(&mut self, amp: f32) -> f32 {
        ((self.unit() * 2.0 - 1.0) * f64::from(amp)) as f32
    }
}

/// `n` values uniform in `[-amp, amp)`.
pub fn random_f32(rng: &mut Rng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| rng.symmetric(amp)).collect()
}

/// A random f16 scale with magnitude in `[1e-3, 1e-1]` and a random sign.
fn scale_bytes(rng: &mut Rng) -> [u8; 2] {
    let mag = 1e-3 * 100f64.powf(rng.unit());
    let signed = if rng.next_u64() & 1 == 0 { mag } else { -mag };
    half::f16::from_f64(signed).to_le_bytes()
}

/// Offsets of the f16 scale fields inside one block of `ty`.
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4NL | GgmlType::IQ4XS => {
            &[0]
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q8_1 => &[0, 2],
        GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        GgmlType::Q6K => &[208],
        _ => &[],
    }
}

/// Random bytes of `ty` for `elems` elements: random quants with sane scales, or random
/// values in `[-1, 1)` for the float types.
pub fn random_weights(rng: &mut Rng, ty: GgmlType, elems: usize) -> Vec<u8> {
    match ty {
        GgmlType::F32 => random_f32(rng, elems, 1.0)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        GgmlType::F16 => random_f32(rng, elems, 1.0)
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        GgmlType::BF16 => random_f32(rng, elems, 1.0)
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        GgmlType::Q8K => {
            let mut out = Vec::new();
            for _ in 0..elems / 256 {
                let d = (1e-3 * 100f64.powf(rng.unit())) as f32;
                out.extend(d.to_le_bytes());
                out.extend((0..256 + 32).map(|_| rng.next_u64() as u8));
            }
            out
        }
        _ => {
            let block = ty.block_bytes();
            let mut out: Vec<u8> = (0..elems / ty.block_elems() * block)
                .map(|_| rng.next_u64() as u8)
                .collect();
            for b in out.chunks_exact_mut(block) {
                for &at in scale_offsets(ty) {
                    b[at..at + 2].copy_from_slice(&scale_bytes(rng));
                }
            }
            out
        }
    }
}

/// `‖a - b‖ / ‖b‖` in f64 (0 when both are zero).
pub fn relative_error(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "compared vectors differ in length");
    let diff: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - y).powi(2))
        .sum();
    let norm: f64 = b.iter().map(|y| y * y).sum();
    if norm == 0.0 {
        diff.sqrt()
    } else {
        (diff / norm).sqrt()
    }
}
