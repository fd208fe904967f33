//! Helpers shared by the GPU test binaries: deterministic random data in every weight
//! type, the two backends, and buffer transfers.
#![allow(dead_code)] // each test binary uses its own subset

pub mod fused;

use tether_compute::rng::SplitMix64;
use tether_compute::{Backend, CpuBackend, CudaBackend, CudaTuning};
use tether_gguf::GgmlType;

/// Every weight type: the cpu backend serves all of them, so the cuda backend must too.
pub const WEIGHT_TYPES: [GgmlType; GgmlType::ALL.len()] = GgmlType::ALL;

/// Deterministic test data: [`SplitMix64`] with its state in the open.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        SplitMix64::step(&mut self.0)
    }

    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn f32s(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n)
            .map(|_| ((self.unit() * 2.0 - 1.0) * f64::from(amp)) as f32)
            .collect()
    }
}

/// Offsets of the f16 scales inside one block of `ty` (random bytes there would give
/// infinities and NaNs).
pub fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4NL => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q8_1 => &[0, 2],
        GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        GgmlType::Q6K => &[208],
        GgmlType::IQ4XS => &[0],
        _ => &[],
    }
}

/// Random weights of `ty`: random quants with sane scales, or values in [-1, 1).
pub fn random_weights(rng: &mut Rng, ty: GgmlType, elems: usize) -> Vec<u8> {
    let floats = rng.f32s(elems, 1.0);
    match ty {
        GgmlType::F32 => floats.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => floats
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        GgmlType::BF16 => floats
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        _ => {
            let block = ty.block_bytes();
            let mut out: Vec<u8> = (0..elems / ty.block_elems() * block)
                .map(|_| rng.next_u64() as u8)
                .collect();
            for b in out.chunks_exact_mut(block) {
                if ty == GgmlType::Q8K {
                    // Q8_K's scale is an f32.
                    let d = (1e-3 * 100f64.powf(rng.unit())) as f32;
                    b[..4].copy_from_slice(&d.to_le_bytes());
                }
                for &at in scale_offsets(ty) {
                    let mag = 1e-3 * 100f64.powf(rng.unit());
                    let s = if rng.next_u64() & 1 == 0 { mag } else { -mag };
                    b[at..at + 2].copy_from_slice(&half::f16::from_f64(s).to_le_bytes());
                }
            }
            out
        }
    }
}

pub fn gpu() -> CudaBackend {
    CudaBackend::with_tuning(0, &CudaTuning::from_env())
        .unwrap_or_else(|e| panic!("these tests need a CUDA GPU: {e}"))
}

pub fn cpu() -> CpuBackend {
    CpuBackend::new(None).unwrap()
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Uploads `bytes` to a new buffer of `be`.
pub fn put<B: Backend>(be: &B, bytes: &[u8]) -> B::Buffer {
    let mut b = be.alloc(bytes.len()).unwrap();
    be.upload(&mut b, 0, bytes).unwrap();
    b
}

/// The first `n` f32 of `buf`.
pub fn get<B: Backend>(be: &B, buf: &B::Buffer, n: usize) -> Vec<f32> {
    let mut bytes = vec![0u8; n * 4];
    be.download(buf, 0, &mut bytes).unwrap();
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
