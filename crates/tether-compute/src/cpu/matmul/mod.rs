//! Matrix multiplication straight from quantized weight blocks.
//!
//! The activation rows are quantized once to 8-bit blocks (or kept as f32 for float
//! weights and the generic path); each task then takes a chunk of weight rows and walks the
//! tokens in groups of [`TOKEN_GROUP`], so a weight block is decoded once per group and the
//! chunk's rows stay in cache while every token passes over them.

mod generic;

pub(crate) use generic::dot_f32;
mod scalar;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_kquant;
#[cfg(target_arch = "x86_64")]
mod avx2_panel;
#[cfg(target_arch = "x86_64")]
mod avx2_panel_q4k;
#[cfg(target_arch = "x86_64")]
mod avx2_panel_q6k;
#[cfg(target_arch = "x86_64")]
mod avx2_q5;
#[cfg(target_arch = "x86_64")]
mod packed;
#[cfg(target_arch = "x86_64")]
mod vnni;

#[cfg(target_arch = "x86_64")]
pub(crate) use packed::{pack_q4_0, packable, unpack_row};

use rayon::prelude::*;
use tether_gguf::GgmlType;

use crate::cpu::isa::CpuIsa;
#[cfg(target_arch = "x86_64")]
use crate::cpu::simd::Avx2;

/// Tokens multiplied against one decoded weight row at a time.
const TOKEN_GROUP: usize = 4;

/// The dot product of one weight row with up to [`TOKEN_GROUP`] activation rows.
pub(crate) trait RowKernel: Sync {
    /// One block of the prepared activation row.
    type Act: Copy + Default + Send + Sync;
    /// Activations per [`Self::Act`] block.
    const ACT_BLOCK: usize;
    /// Converts one activation row (`cols` values) into `cols / ACT_BLOCK` blocks.
    fn prepare(&self, x: &[f32], out: &mut [Self::Act]);
    /// `out[j] = Σ w · xs[j]` for one weight row `w` (whole blocks of the weight type).
    fn dot<const N: usize>(&self, w: &[u8], xs: [&[Self::Act]; N]) -> [f32; N];
    /// `out[i][j] = Σ w[i] · xs[j]` for four weight rows at once; kernels that gain from
    /// sharing each activation load across rows override it.
    fn dot4<const N: usize>(&self, w: [&[u8]; 4], xs: [&[Self::Act]; N]) -> [[f32; N]; 4] {
        w.map(|r| self.dot(r, xs))
    }
}

/// `out[t][r] = Σ_c w[r][c] · x[t][c]` with the kernels of `isa` (see [`level_for`]); the
/// caller has checked every size (`w` holds `s.rows` rows of `s.cols` elements of `ty`,
/// `s.cols` is whole blocks, `x` holds `s.n_tokens · s.cols` values and `out`
/// `s.n_tokens · s.rows`). Returns the level whose kernels ran.
pub(crate) fn matmul(
    isa: CpuIsa,
    ty: GgmlType,
    w: &[u8],
    s: Shape,
    x: &[f32],
    out: &mut [f32],
) -> CpuIsa {
    let level = level_for(isa, ty);
    #[cfg(target_arch = "x86_64")]
    match level {
        CpuIsa::Avx512Vnni => {
            if let Some(t) = isa.avx512_vnni() {
                vnni::avx512::matmul(t, ty, w, s, x, out);
                return level;
            }
        }
        CpuIsa::AvxVnni => {
            if let Some(t) = isa.avx_vnni() {
                vnni::avx::matmul(t, ty, w, s, x, out);
                return level;
            }
        }
        CpuIsa::Avx2 => {
            if let Some(cpu) = isa.avx2() {
                avx2_matmul(cpu, ty, w, s, x, out);
                return level;
            }
        }
        CpuIsa::Scalar => {}
    }
    scalar_matmul(ty, w, s, x, out);
    CpuIsa::Scalar
}

/// [`matmul`] for Q4_0 weights packed by `finish_weight` (`w` is the whole buffer, of
/// which the first `s.rows` rows are multiplied). Returns the level whose kernels ran.
#[cfg(target_arch = "x86_64")]
pub(crate) fn matmul_packed(isa: CpuIsa, w: &[u8], s: Shape, x: &[f32], out: &mut [f32]) -> CpuIsa {
    let Shape { rows, cols, .. } = s;
    let level = level_for(isa, GgmlType::Q4_0);
    match level {
        CpuIsa::Avx512Vnni => {
            if let Some(t) = isa.avx512_vnni() {
                packed::matmul(&vnni::avx512::Q4_0Packed(t), w, s, x, out);
                return level;
            }
        }
        CpuIsa::AvxVnni => {
            if let Some(t) = isa.avx_vnni() {
                packed::matmul(&vnni::avx::Q4_0Packed(t), w, s, x, out);
                return level;
            }
        }
        CpuIsa::Avx2 => {
            if let Some(cpu) = isa.avx2() {
                packed::matmul(&packed::Avx2Packed(cpu), w, s, x, out);
                return level;
            }
        }
        CpuIsa::Scalar => {}
    }
    // Only a backend with AVX2 packs; should a packed matrix meet the portable kernels,
    // they read it in the file's layout.
    let row_bytes = cols / 32 * 18;
    let mut plain = vec![0u8; rows * row_bytes];
    for (r, dst) in plain.chunks_exact_mut(row_bytes).enumerate() {
        unpack_row(w, row_bytes, r, dst);
    }
    scalar_matmul(GgmlType::Q4_0, &plain, s, x, out);
    CpuIsa::Scalar
}

/// The kernel level [`matmul`] runs `ty` at under `isa`: `isa` itself where it has kernels
/// for `ty`, otherwise the highest level below it that has (every level has AVX2's).
pub(crate) fn level_for(isa: CpuIsa, ty: GgmlType) -> CpuIsa {
    use GgmlType as T;
    let vnni = matches!(ty, T::Q4_0 | T::Q8_0 | T::Q4K | T::Q6K);
    let avx2 = vnni || matches!(ty, T::F32 | T::F16 | T::BF16 | T::Q5_0 | T::Q5K);
    match isa {
        CpuIsa::Scalar => CpuIsa::Scalar,
        CpuIsa::Avx512Vnni | CpuIsa::AvxVnni if vnni => isa,
        _ if avx2 => CpuIsa::Avx2,
        _ => CpuIsa::Scalar,
    }
}

/// The AVX2 kernels; types without one go to the portable ones.
#[cfg(target_arch = "x86_64")]
fn avx2_matmul(cpu: Avx2, ty: GgmlType, w: &[u8], s: Shape, x: &[f32], out: &mut [f32]) {
    let panels = s.n_tokens >= avx2_panel::MIN_TOKENS;
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            run(&avx2::FloatKernel::new(cpu, ty), w, s, x, out)
        }
        GgmlType::Q4_0 if panels => avx2_panel::matmul(&avx2_panel::Q4_0Panels(cpu), w, s, x, out),
        GgmlType::Q4_0 => run(&avx2::Q4_0Kernel(cpu), w, s, x, out),
        GgmlType::Q8_0 => run(&avx2::Q8_0Kernel(cpu), w, s, x, out),
        GgmlType::Q4K if panels => {
            avx2_panel::matmul(&avx2_panel_q4k::Q4KPanels(cpu), w, s, x, out)
        }
        GgmlType::Q4K => run(&avx2_kquant::Q4KKernel(cpu), w, s, x, out),
        GgmlType::Q6K if panels => {
            avx2_panel::matmul(&avx2_panel_q6k::Q6KPanels(cpu), w, s, x, out)
        }
        GgmlType::Q6K => run(&avx2_kquant::Q6KKernel(cpu), w, s, x, out),
        GgmlType::Q5_0 => run(&avx2_q5::Q5_0Kernel(cpu), w, s, x, out),
        GgmlType::Q5K => run(&avx2_q5::Q5KKernel(cpu), w, s, x, out),
        _ => scalar_matmul(ty, w, s, x, out),
    }
}

/// The portable kernels.
fn scalar_matmul(ty: GgmlType, w: &[u8], s: Shape, x: &[f32], out: &mut [f32]) {
    match ty {
        GgmlType::Q4_0 => run(&scalar::Q4_0Kernel, w, s, x, out),
        GgmlType::Q8_0 => run(&scalar::Q8_0Kernel, w, s, x, out),
        GgmlType::Q4K => run(&scalar::Q4KKernel, w, s, x, out),
        GgmlType::Q6K => run(&scalar::Q6KKernel, w, s, x, out),
        _ => run(&generic::GenericKernel::new(ty), w, s, x, out),
    }
}

/// The sizes of one product: `rows` outputs of `cols` inputs, for `n_tokens` tokens.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) n_tokens: usize,
}

/// A raw pointer to the output that tasks write disjoint elements of.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint indices (each owns a row range), and the pointee outlives
// the parallel section, which joins before `run` returns.
unsafe impl Send for OutPtr {}
// SAFETY: see `Send`.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// # Safety
    /// `i` is inside the output, and no other task writes it.
    unsafe fn write(&self, i: usize, v: f32) {
        // SAFETY: guaranteed by the caller.
        unsafe { *self.0.add(i) = v };
    }
}

fn run<K: RowKernel>(k: &K, w: &[u8], s: Shape, x: &[f32], out: &mut [f32]) {
    if s.rows == 0 || s.cols == 0 || s.n_tokens == 0 {
        out.iter_mut()
            .take(s.rows * s.n_tokens)
            .for_each(|v| *v = 0.0);
        return;
    }
    let acts_per_row = s.cols / K::ACT_BLOCK;
    let mut acts = vec![K::Act::default(); acts_per_row * s.n_tokens];
    acts.par_chunks_mut(acts_per_row)
        .zip(x.par_chunks(s.cols))
        .for_each(|(a, xr)| k.prepare(xr, a));
    let threads = rayon::current_num_threads().max(1);
    // Enough chunks to balance the threads, each a whole number of row tiles.
    let chunk_rows = s
        .rows
        .div_ceil(threads * 8)
        .clamp(1, 64)
        .next_multiple_of(ROW_TILE);
    let n_chunks = s.rows.div_ceil(chunk_rows);
    assert!(
        out.len() >= s.rows * s.n_tokens,
        "matmul output checked by the caller"
    );
    let tiles = Tiles {
        w,
        row_bytes: w.len() / s.rows,
        acts: &acts,
        acts_per_row,
        s,
        out: OutPtr(out.as_mut_ptr()),
    };
    (0..n_chunks).into_par_iter().for_each(|c| {
        let r0 = c * chunk_rows;
        let r1 = (r0 + chunk_rows).min(s.rows);
        let mut t0 = 0;
        while t0 < s.n_tokens {
            let n = (s.n_tokens - t0).min(TOKEN_GROUP);
            match n {
                4 => tiles.rows::<K, 4>(k, t0, r0, r1),
                3 => tiles.rows::<K, 3>(k, t0, r0, r1),
                2 => tiles.rows::<K, 2>(k, t0, r0, r1),
                _ => tiles.rows::<K, 1>(k, t0, r0, r1),
            }
            t0 += n;
        }
    });
}

/// Rows per [`RowKernel::dot4`] call.
const ROW_TILE: usize = 4;

/// What every task of one matmul shares.
struct Tiles<'a, A> {
    w: &'a [u8],
    row_bytes: usize,
    acts: &'a [A],
    acts_per_row: usize,
    s: Shape,
    out: OutPtr,
}

impl<A> Tiles<'_, A> {
    fn act_row(&self, t: usize) -> &[A] {
        &self.acts[t * self.acts_per_row..(t + 1) * self.acts_per_row]
    }

    fn w_row(&self, r: usize) -> &[u8] {
        &self.w[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    fn write(&self, t: usize, r: usize, v: f32) {
        assert!(t < self.s.n_tokens && r < self.s.rows);
        // SAFETY: `t < n_tokens` and `r < rows`, so the index is inside `out` (checked in
        // `run`); row `r` belongs to the calling task's chunk alone.
        unsafe { self.out.write(t * self.s.rows + r, v) };
    }

    /// Rows `r0..r1` against tokens `t0..t0 + N`.
    fn rows<K: RowKernel<Act = A>, const N: usize>(&self, k: &K, t0: usize, r0: usize, r1: usize) {
        let xs: [&[A]; N] = std::array::from_fn(|j| self.act_row(t0 + j));
        let mut r = r0;
        while r + ROW_TILE <= r1 {
            let ws: [&[u8]; ROW_TILE] = std::array::from_fn(|i| self.w_row(r + i));
            for (i, vals) in k.dot4(ws, xs).into_iter().enumerate() {
                for (j, v) in vals.into_iter().enumerate() {
                    self.write(t0 + j, r + i, v);
                }
            }
            r += ROW_TILE;
        }
        for r in r..r1 {
            for (j, v) in k.dot(self.w_row(r), xs).into_iter().enumerate() {
                self.write(t0 + j, r, v);
            }
        }
    }
}

#[cfg(test)]
mod bench;
#[cfg(test)]
mod level_tests;
#[cfg(all(test, target_arch = "x86_64"))]
mod packed_tests;
#[cfg(test)]
mod tests;
