//! The path for every weight type without a dedicated kernel: decode one block at a time
//! onto the stack with the reference dequantizer and take f32 dot products.

use tether_gguf::{GgmlType, dequantize};

use super::RowKernel;

/// Elements decoded per step for the float types, whose "blocks" are single values.
const FLOAT_STEP: usize = 64;

/// Any weight type, through [`tether_gguf::dequantize`] with f32 activations.
pub(crate) struct GenericKernel {
    ty: GgmlType,
    step_elems: usize,
    step_bytes: usize,
}

impl GenericKernel {
    pub(crate) fn new(ty: GgmlType) -> Self {
        let step_elems = ty.block_elems().max(FLOAT_STEP);
        Self {
            ty,
            step_elems,
            step_bytes: step_elems / ty.block_elems() * ty.block_bytes(),
        }
    }
}

impl RowKernel for GenericKernel {
    type Act = f32;
    const ACT_BLOCK: usize = 1;

    fn prepare(&self, x: &[f32], out: &mut [f32]) {
        out.copy_from_slice(x);
    }

    fn dot<const N: usize>(&self, w: &[u8], xs: [&[f32]; N]) -> [f32; N] {
        let mut buf = [0.0f32; 256];
        let mut acc = [0.0f32; N];
        let bb = self.ty.block_bytes();
        let be = self.ty.block_elems();
        for (step, wb) in w.chunks(self.step_bytes).enumerate() {
            let n = wb.len() / bb * be;
            let vals = &mut buf[..n];
            if dequantize(self.ty, wb, vals).is_err() {
                // Sizes were checked before the op; poison the result rather than panic.
                vals.fill(f32::NAN);
            }
            let base = step * self.step_elems;
            for (a, x) in acc.iter_mut().zip(xs) {
                *a += dot_f32(vals, &x[base..base + n]);
            }
        }
        acc
    }
}

/// A plain f32 dot product with four partial sums (lets the compiler vectorise it).
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut sums = [0.0f32; 4];
    let mut ca = a.chunks_exact(4);
    let mut cb = b.chunks_exact(4);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..4 {
            sums[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    sums[0] + sums[1] + sums[2] + sums[3] + tail
}
