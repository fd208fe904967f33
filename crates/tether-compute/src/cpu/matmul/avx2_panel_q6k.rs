//! Q6_K on the panel path (see [`super::avx2_panel`]): per super-block and eight rows, the
//! 6-bit quants of each 32-element chunk as eight row-per-lane vectors, then the 16-element
//! sub-block scales (alone and in pairs, for the -32 bias) and the f32 factor.

use std::arch::x86_64::*;

use super::avx2_panel::{PANEL_ROWS, PanelFormat, broadcast4, panel_dot_subs, transpose8};
use crate::cpu::q8::{BlockQ8K, quantize_row_q8k};
use crate::cpu::simd::Avx2;

/// Q6_K super-block: 128 bytes of low nibbles, 64 of high bit pairs, 16 i8 scales, f16 d.
const BLOCK_BYTES: usize = 210;
/// Chunks of 32 elements (two sub-blocks of 16) in a super-block.
pub(super) const CHUNKS: usize = 8;
/// Sub-blocks of 16 elements, one scale each.
pub(super) const SUBS: usize = 16;
/// Where each part of a packed super-block starts, in vectors.
pub(super) const SCALES_AT: usize = CHUNKS * 8;
pub(super) const PAIRS_AT: usize = SCALES_AT + SUBS;
pub(super) const D_AT: usize = PAIRS_AT + SUBS / 2;
/// Vectors per packed super-block.
pub(super) const PACKED_BLOCK: usize = D_AT + 1;

/// 32 bytes of `s` starting at `at`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load32(s: &[u8], at: usize) -> __m256i {
    let s = &s[at..at + 32];
    // SAFETY: `s` is 32 bytes, one unaligned 256-bit load.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// The low 2 bits of each byte of `bits`, moved to bits 4..6 (a quant's high part).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn high2(bits: __m256i) -> __m256i {
    _mm256_slli_epi16::<4>(_mm256_and_si256(bits, _mm256_set1_epi8(3)))
}

/// The eight 32-element chunks of one row's super-block as unsigned quants `0..64`,
/// element `32c + j` in byte `j` of chunk `c` (the layout of the scalar kernel).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unpack_row(blk: &[u8]) -> [__m256i; CHUNKS] {
    let m4 = _mm256_set1_epi8(0x0F);
    let mut q = [_mm256_setzero_si256(); CHUNKS];
    for h in 0..2 {
        let qa = load32(blk, 64 * h);
        let qb = load32(blk, 64 * h + 32);
        let qh = load32(blk, 128 + 32 * h);
        q[4 * h] = _mm256_or_si256(_mm256_and_si256(qa, m4), high2(qh));
        q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(qb, m4), high2(_mm256_srli_epi16::<2>(qh)));
        q[4 * h + 2] = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(qa), m4),
            high2(_mm256_srli_epi16::<4>(qh)),
        );
        q[4 * h + 3] = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(qb), m4),
            high2(_mm256_srli_epi16::<6>(qh)),
        );
    }
    q
}

/// Eight i32 (one per row) as a vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn lanes(v: [u32; PANEL_ROWS]) -> __m256i {
    let v = v.map(|x| x as i32);
    _mm256_setr_epi32(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7])
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn pack(w: &[u8], row_bytes: usize, rows: usize, r0: usize, panel: &mut Vec<__m256i>) {
    const ZERO: [u8; BLOCK_BYTES] = [0; BLOCK_BYTES];
    let n_blocks = row_bytes / BLOCK_BYTES;
    panel.clear();
    panel.reserve(n_blocks * PACKED_BLOCK);
    for b in 0..n_blocks {
        let blk: [&[u8]; PANEL_ROWS] = std::array::from_fn(|i| {
            let r = r0 + i;
            if r < rows {
                let at = r * row_bytes + b * BLOCK_BYTES;
                &w[at..at + BLOCK_BYTES]
            } else {
                &ZERO
            }
        });
        // Chunk-major: `q[c][r]` is chunk `c` of row `r`.
        let mut q = [[_mm256_setzero_si256(); PANEL_ROWS]; CHUNKS];
        for (r, &bk) in blk.iter().enumerate() {
            for (c, v) in unpack_row(bk).into_iter().enumerate() {
                q[c][r] = v;
            }
        }
        for rows_of_chunk in q {
            panel.extend(transpose8(rows_of_chunk));
        }
        let scale = |r: usize, s: usize| u32::from(blk[r][192 + s] as i8 as i16 as u16);
        // Each scale as both i16 halves of a lane, for `madd` against i16 pair sums.
        for s in 0..SUBS {
            panel.push(lanes(std::array::from_fn(|r| scale(r, s) * 0x1_0001)));
        }
        // Scales of sub-blocks 2p and 2p + 1 as the two halves, against the 16-sums.
        for p in 0..SUBS / 2 {
            panel.push(lanes(std::array::from_fn(|r| {
                scale(r, 2 * p) | (scale(r, 2 * p + 1) << 16)
            })));
        }
        let h: [i16; PANEL_ROWS] =
            std::array::from_fn(|r| i16::from_le_bytes([blk[r][208], blk[r][209]]));
        let v = _mm_set_epi16(h[7], h[6], h[5], h[4], h[3], h[2], h[1], h[0]);
        panel.push(_mm256_castps_si256(_mm256_cvtph_ps(v)));
    }
}

/// Adds chunk `c`'s `Σ_s scale_s · Σ q·y` (quants `v`, `0..64` before the -32 bias) of one
/// packed super-block against one token to `sums`, one row per lane; all eight make at
/// most 16 · 128 · 16 · 63 · 127 < 2^31.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sub_sums(pb: &[__m256i], v: &[__m256i; 8], c: usize, y: &BlockQ8K, sums: __m256i) -> __m256i {
    let p = |k: usize| _mm256_maddubs_epi16(v[k], broadcast4(&y.qs, 32 * c + 4 * k));
    // Two maddubs outputs of at most 2·63·127 each still fit i16.
    let lo = _mm256_add_epi32(
        _mm256_madd_epi16(_mm256_add_epi16(p(0), p(1)), pb[SCALES_AT + 2 * c]),
        _mm256_madd_epi16(_mm256_add_epi16(p(2), p(3)), pb[SCALES_AT + 2 * c]),
    );
    let hi = _mm256_add_epi32(
        _mm256_madd_epi16(_mm256_add_epi16(p(4), p(5)), pb[SCALES_AT + 2 * c + 1]),
        _mm256_madd_epi16(_mm256_add_epi16(p(6), p(7)), pb[SCALES_AT + 2 * c + 1]),
    );
    _mm256_add_epi32(sums, _mm256_add_epi32(lo, hi))
}

/// `acc + d·d_y·(sums - 32·Σ_s scale_s·bsum_s)` for one packed super-block; the bias stays
/// in integers as in the scalar kernel.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn finish(pb: &[__m256i], y: &BlockQ8K, sums: __m256i, acc: __m256) -> __m256 {
    let d = _mm256_castsi256_ps(pb[D_AT]);
    // SAFETY: `bsums` is 32 bytes, one unaligned 256-bit load.
    let bs = unsafe { _mm256_loadu_si256(y.bsums.as_ptr().cast()) };
    let mut bias = _mm256_setzero_si256();
    for p in 0..SUBS / 2 {
        let pair = _mm256_permutevar8x32_epi32(bs, _mm256_set1_epi32(p as i32));
        bias = _mm256_add_epi32(bias, _mm256_madd_epi16(pb[PAIRS_AT + p], pair));
    }
    let total = _mm256_sub_epi32(sums, _mm256_slli_epi32::<5>(bias));
    let scale = _mm256_mul_ps(d, _mm256_set1_ps(y.d));
    _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(total), acc)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn panel_dot<const N: usize>(panel: &[__m256i], xs: [&[BlockQ8K]; N]) -> [__m256; N] {
    panel_dot_subs!(panel, xs, PACKED_BLOCK, CHUNKS, sub_sums, finish)
}

/// Q6_K weights against [`BlockQ8K`] activations.
pub(crate) struct Q6KPanels(pub Avx2);

impl PanelFormat for Q6KPanels {
    type Act = BlockQ8K;
    const ACT_BLOCK: usize = 256;

    fn prepare(&self, x: &[f32], out: &mut [BlockQ8K]) {
        quantize_row_q8k(Some(self.0), x, out);
    }

    fn pack(&self, w: &[u8], row_bytes: usize, rows: usize, r0: usize, panel: &mut Vec<__m256i>) {
        // SAFETY: `self.0` proves the CPU has the enabled features.
        unsafe { pack(w, row_bytes, rows, r0, panel) }
    }

    fn dot<const N: usize>(&self, panel: &[__m256i], xs: [&[BlockQ8K]; N]) -> [__m256; N] {
        // SAFETY: `self.0` proves the CPU has the enabled features.
        unsafe { panel_dot(panel, xs) }
    }
}
