//! Q4_0 weights rewritten in place once loaded ([`crate::Backend::finish_weight`]) so that
//! decode reads them the way prefill's panels do: eight rows at a time, one row per 32-bit
//! lane, with no horizontal sums and one convert and one FMA for the eight rows.
//!
//! Each group of eight whole rows keeps its bytes (so the memory plan is unchanged) but
//! stores them block by block: for block `b`, the eight rows' f16 scales (16 bytes), then
//! for `k` in 0..4 the four quant bytes `4k..4k + 4` of each row in turn (128 bytes). One
//! 32-byte load then holds, in its low nibbles, quants `4k..4k + 4` of every row and, in
//! its high nibbles, quants `16 + 4k..`: two panel vectors after a mask and a shift. Rows
//! past the last whole group stay as they were.

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::avx2::dot_q8_blocks;
use super::avx2_panel::{EightRows, PANEL_ROWS, all_tokens, block_sum, finish};
use super::{OutPtr, Shape};
use crate::cpu::q8::{BlockQ8, quantize_row_q8};
use crate::cpu::simd::Avx2;

/// Q4_0 block: f16 scale and 16 bytes of nibbles.
const BLOCK_BYTES: usize = 18;
/// One block column of a packed group.
const GROUP_BLOCK: usize = PANEL_ROWS * BLOCK_BYTES;

/// Whether rows of `row_len` values of `ty` are packed by [`pack_q4_0`].
pub(crate) fn packable(ty: tether_gguf::GgmlType, row_len: usize) -> bool {
    ty == tether_gguf::GgmlType::Q4_0 && row_len > 0 && row_len.is_multiple_of(32)
}

/// Rewrites every whole group of eight rows of `w` (rows of `row_bytes`) into the packed
/// layout.
pub(crate) fn pack_q4_0(w: &mut [u8], row_bytes: usize) {
    let mut group = vec![0u8; PANEL_ROWS * row_bytes];
    for chunk in w.chunks_exact_mut(PANEL_ROWS * row_bytes) {
        group.copy_from_slice(chunk);
        for (b, out) in chunk.chunks_exact_mut(GROUP_BLOCK).enumerate() {
            for r in 0..PANEL_ROWS {
                let blk = &group[r * row_bytes + b * BLOCK_BYTES..][..BLOCK_BYTES];
                out[2 * r..2 * r + 2].copy_from_slice(&blk[..2]);
                for k in 0..4 {
                    let at = 16 + 32 * k + 4 * r;
                    out[at..at + 4].copy_from_slice(&blk[2 + 4 * k..6 + 4 * k]);
                }
            }
        }
    }
}

/// Row `r` of a packed matrix (`rows_bytes` each) in the file's layout, into `out`.
pub(crate) fn unpack_row(w: &[u8], row_bytes: usize, r: usize, out: &mut [u8]) {
    let group_bytes = PANEL_ROWS * row_bytes;
    let whole = w.len() / group_bytes;
    if r / PANEL_ROWS >= whole {
        out.copy_from_slice(&w[r * row_bytes..(r + 1) * row_bytes]);
        return;
    }
    let group = &w[r / PANEL_ROWS * group_bytes..][..group_bytes];
    let i = r % PANEL_ROWS;
    for (blk, src) in out
        .chunks_exact_mut(BLOCK_BYTES)
        .zip(group.chunks_exact(GROUP_BLOCK))
    {
        blk[..2].copy_from_slice(&src[2 * i..2 * i + 2]);
        for k in 0..4 {
            let at = 16 + 32 * k + 4 * i;
            blk[2 + 4 * k..6 + 4 * k].copy_from_slice(&src[at..at + 4]);
        }
    }
}

/// One packed block column as the nine vectors of a prefill panel block (eight of quants,
/// then the scales as f32), so the panels' integer and float steps apply unchanged.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn unpack_block(blk: &[u8]) -> [__m256i; 9] {
    let m4 = _mm256_set1_epi8(0x0F);
    let head = &blk[..16];
    // SAFETY: `head` is 16 bytes, one unaligned 128-bit load.
    let scales = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(head.as_ptr().cast()) });
    let load = |k: usize| {
        let s = &blk[16 + 32 * k..48 + 32 * k];
        // SAFETY: `s` is 32 bytes, one unaligned 256-bit load.
        unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
    };
    let v = [load(0), load(1), load(2), load(3)];
    let hi = |k: usize| _mm256_and_si256(_mm256_srli_epi16::<4>(v[k]), m4);
    [
        _mm256_and_si256(v[0], m4),
        _mm256_and_si256(v[1], m4),
        _mm256_and_si256(v[2], m4),
        _mm256_and_si256(v[3], m4),
        hi(0),
        hi(1),
        hi(2),
        hi(3),
        _mm256_castps_si256(scales),
    ]
}

/// Asks for the bytes a few block columns further on (the next group follows this one):
/// the hardware prefetcher alone leaves decode bandwidth unused.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn prefetch_ahead(blk: &[u8]) {
    const AHEAD: usize = 1024;
    // A prefetch never faults, so an address past the matrix is harmless; `wrapping_add`
    // keeps the pointer arithmetic defined.
    let at = blk.as_ptr().wrapping_add(AHEAD);
    _mm_prefetch::<_MM_HINT_T0>(at.cast());
    _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(64).cast());
    _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(128).cast());
}

/// The body of a packed group's product (every kernel level): lane `r` of result `j` is
/// row `r` of the group · token `xs[j]`; `$sum` is the level's panel block sum.
macro_rules! packed_dot_body {
    ($group:expr, $xs:expr, $sum:path) => {{
        let mut acc = [_mm256_setzero_ps(); N];
        for (b, blk) in $group.chunks_exact(PANEL_ROWS * 18).enumerate() {
            prefetch_ahead(blk);
            let pb = unpack_block(blk);
            for (a, x) in acc.iter_mut().zip($xs) {
                let y = &x[b];
                *a = finish(&pb, y, $sum(&pb, y), *a);
            }
        }
        acc
    }};
}
pub(super) use packed_dot_body;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn packed_dot<const N: usize>(group: &[u8], xs: [&[BlockQ8]; N]) -> [__m256; N] {
    packed_dot_body!(group, xs, block_sum)
}

/// The kernels of one level on packed Q4_0 weights.
pub(crate) trait PackedKernel: Sync {
    /// The AVX2 token (activations are quantized and tail rows multiplied with AVX2).
    fn avx2(&self) -> Avx2;
    /// Lane `r` of result `j`: row `r` of the packed `group` · token `xs[j]`.
    fn dot8<const N: usize>(&self, group: &[u8], xs: [&[BlockQ8]; N]) -> [__m256; N];
}

/// AVX2 on packed Q4_0 weights.
pub(crate) struct Avx2Packed(pub Avx2);

impl PackedKernel for Avx2Packed {
    fn avx2(&self) -> Avx2 {
        self.0
    }

    fn dot8<const N: usize>(&self, group: &[u8], xs: [&[BlockQ8]; N]) -> [__m256; N] {
        // SAFETY: `self.0` proves the CPU has the enabled features.
        unsafe { packed_dot(group, xs) }
    }
}

/// A packed group of eight rows with the level's kernel.
struct Group<'a, K>(&'a K, &'a [u8]);

impl<K: PackedKernel> EightRows for Group<'_, K> {
    type Act = BlockQ8;

    fn dot<const N: usize>(&self, xs: [&[BlockQ8]; N]) -> [__m256; N] {
        self.0.dot8(self.1, xs)
    }
}

/// `out[t][r] = Σ_c w[r][c] · x[t][c]` for the first `s.rows` rows of the packed Q4_0
/// matrix `w` (all of its bytes: whether a row is packed depends on its group being whole
/// in `w`), other sizes as for [`super::matmul`].
pub(crate) fn matmul<K: PackedKernel>(k: &K, w: &[u8], s: Shape, x: &[f32], out: &mut [f32]) {
    if s.rows == 0 || s.cols == 0 || s.n_tokens == 0 {
        out.iter_mut()
            .take(s.rows * s.n_tokens)
            .for_each(|v| *v = 0.0);
        return;
    }
    let cpu = k.avx2();
    let per_row = s.cols / 32;
    let mut acts = vec![BlockQ8::default(); per_row * s.n_tokens];
    acts.par_chunks_mut(per_row)
        .zip(x.par_chunks(s.cols))
        .for_each(|(a, xr)| quantize_row_q8(Some(cpu), xr, a));
    assert!(
        out.len() >= s.rows * s.n_tokens && w.len() >= s.rows * per_row * BLOCK_BYTES,
        "matmul sizes checked by the caller"
    );
    let out = OutPtr(out.as_mut_ptr());
    let row_bytes = per_row * BLOCK_BYTES;
    let groups = s.rows / PANEL_ROWS;
    let threads = rayon::current_num_threads().max(1);
    // Enough chunks to balance the threads; the rows past the last group are one more.
    let per_chunk = groups.div_ceil(threads * 8).max(1);
    let n_chunks = groups.div_ceil(per_chunk);
    let acts = &acts[..];
    let row = |t: usize| &acts[t * per_row..(t + 1) * per_row];
    (0..=n_chunks).into_par_iter().for_each(|c| {
        if c == n_chunks {
            for r in groups * PANEL_ROWS..s.rows {
                let mut wr = vec![0u8; row_bytes];
                unpack_row(w, row_bytes, r, &mut wr);
                for t in 0..s.n_tokens {
                    // SAFETY: `cpu` proves the CPU has AVX2, FMA and F16C.
                    let [v] = unsafe { dot_q8_blocks::<1, false>(&wr, [row(t)]) };
                    assert!(t < s.n_tokens && r < s.rows);
                    // SAFETY: inside `out` (checked above); the rows past the last group
                    // belong to this task alone.
                    unsafe { out.write(t * s.rows + r, v) };
                }
            }
            return;
        }
        for g in c * per_chunk..((c + 1) * per_chunk).min(groups) {
            let group = &w[g * PANEL_ROWS * row_bytes..(g + 1) * PANEL_ROWS * row_bytes];
            all_tokens(&Group(k, group), acts, per_row, out, s, g * PANEL_ROWS);
        }
    });
}
