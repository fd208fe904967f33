//! Q4_K on the panel path (see [`super::avx2_panel`]): per super-block and eight rows,
//! the quants of each 32-element sub-block as eight row-per-lane vectors, then the
//! sub-block scales, the mins and the two f32 factors, all one row per lane.

use std::arch::x86_64::*;

use super::avx2_panel::{PANEL_ROWS, PanelFormat, broadcast4, panel_dot_subs, transpose8};
use super::scalar::unpack_q4k_scales;
use crate::cpu::q8::{BlockQ8K, quantize_row_q8k};
use crate::cpu::simd::Avx2;

/// Q4_K super-block: d, dmin (f16), 12 bytes of scales and mins, 128 bytes of nibbles.
const BLOCK_BYTES: usize = 144;
/// Sub-blocks of 32 elements in a super-block.
pub(super) const SUBS: usize = 8;
/// Where each part of a packed super-block starts, in vectors.
pub(super) const SCALES_AT: usize = SUBS * 8;
pub(super) const MINS_AT: usize = SCALES_AT + SUBS;
pub(super) const D_AT: usize = MINS_AT + SUBS / 2;
pub(super) const DMIN_AT: usize = D_AT + 1;
/// Vectors per packed super-block.
pub(super) const PACKED_BLOCK: usize = DMIN_AT + 1;

/// 32 bytes of `s` starting at `at`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load32(s: &[u8], at: usize) -> __m256i {
    let s = &s[at..at + 32];
    // SAFETY: `s` is 32 bytes, one unaligned 256-bit load.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// Eight f16 values (one per row) as f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn halves(h: [u16; PANEL_ROWS]) -> __m256i {
    let h = h.map(|v| v as i16);
    let v = _mm_set_epi16(h[7], h[6], h[5], h[4], h[3], h[2], h[1], h[0]);
    _mm256_castps_si256(_mm256_cvtph_ps(v))
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
    let m4 = _mm256_set1_epi8(0x0F);
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
        // Sub-block `s` of every row: low nibbles of bytes 32g.. for s = 2g, high for 2g + 1.
        for g in 0..SUBS / 2 {
            let mut lo = [_mm256_setzero_si256(); PANEL_ROWS];
            let mut hi = [_mm256_setzero_si256(); PANEL_ROWS];
            for r in 0..PANEL_ROWS {
                let v = load32(blk[r], 16 + 32 * g);
                lo[r] = _mm256_and_si256(v, m4);
                hi[r] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
            }
            panel.extend(transpose8(lo));
            panel.extend(transpose8(hi));
        }
        let unpacked: [([u8; 8], [u8; 8]); PANEL_ROWS] =
            std::array::from_fn(|r| unpack_q4k_scales(&blk[r][4..16]));
        // Scales as two equal i16 halves of each lane, for `madd` against i16 pair sums.
        for s in 0..SUBS {
            panel.push(lanes(std::array::from_fn(|r| {
                u32::from(unpacked[r].0[s]) * 0x1_0001
            })));
        }
        // Mins of sub-blocks 2p and 2p + 1 as the two i16 halves.
        for p in 0..SUBS / 2 {
            panel.push(lanes(std::array::from_fn(|r| {
                let mn = unpacked[r].1;
                u32::from(mn[2 * p]) | (u32::from(mn[2 * p + 1]) << 16)
            })));
        }
        let f16 = |r: usize, at: usize| u16::from_le_bytes([blk[r][at], blk[r][at + 1]]);
        panel.push(halves(std::array::from_fn(|r| f16(r, 0))));
        panel.push(halves(std::array::from_fn(|r| f16(r, 2))));
    }
}

/// Sum of eight `maddubs` outputs of at most 2·15·127 each: below 2^15, exact in i16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sub_block_sum(q: &[__m256i], qs: &[i8], at: usize) -> __m256i {
    let p = |k: usize| _mm256_maddubs_epi16(q[k], broadcast4(qs, at + 4 * k));
    let s01 = _mm256_add_epi16(p(0), p(1));
    let s23 = _mm256_add_epi16(p(2), p(3));
    let s45 = _mm256_add_epi16(p(4), p(5));
    let s67 = _mm256_add_epi16(p(6), p(7));
    _mm256_add_epi16(_mm256_add_epi16(s01, s23), _mm256_add_epi16(s45, s67))
}

/// Adds sub-block `s`'s `scale_s · Σ q·y` (quants `v`) of one packed super-block against
/// one token to `sums`, one row per lane; all eight make at most 8 · 63 · 32 · 15 · 127 <
/// 2^31.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sub_sums(pb: &[__m256i], v: &[__m256i; 8], s: usize, y: &BlockQ8K, sums: __m256i) -> __m256i {
    let s16 = sub_block_sum(v, &y.qs, 32 * s);
    _mm256_add_epi32(sums, _mm256_madd_epi16(s16, pb[SCALES_AT + s]))
}

/// `acc + d·d_y·sums - dmin·d_y·Σ_s min_s·(sum of sub-block s's activations)` for one
/// packed super-block; the mins come from the activation block's 16-sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn finish(pb: &[__m256i], y: &BlockQ8K, sums: __m256i, acc: __m256) -> __m256 {
    let d = _mm256_castsi256_ps(pb[D_AT]);
    let dmin = _mm256_castsi256_ps(pb[DMIN_AT]);
    // SAFETY: `bsums` is 32 bytes, one unaligned 256-bit load.
    let bs = unsafe { _mm256_loadu_si256(y.bsums.as_ptr().cast()) };
    let pairs = _mm_hadd_epi16(
        _mm256_castsi256_si128(bs),
        _mm256_extracti128_si256::<1>(bs),
    );
    let pairs = _mm256_castsi128_si256(pairs);
    let pick = |p: i32| _mm256_permutevar8x32_epi32(pairs, _mm256_set1_epi32(p));
    let m01 = _mm256_add_epi32(
        _mm256_madd_epi16(pb[MINS_AT], pick(0)),
        _mm256_madd_epi16(pb[MINS_AT + 1], pick(1)),
    );
    let m23 = _mm256_add_epi32(
        _mm256_madd_epi16(pb[MINS_AT + 2], pick(2)),
        _mm256_madd_epi16(pb[MINS_AT + 3], pick(3)),
    );
    let mins = _mm256_cvtepi32_ps(_mm256_add_epi32(m01, m23));
    let yd = _mm256_set1_ps(y.d);
    let with_scales = _mm256_fmadd_ps(_mm256_mul_ps(d, yd), _mm256_cvtepi32_ps(sums), acc);
    _mm256_fnmadd_ps(_mm256_mul_ps(dmin, yd), mins, with_scales)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn panel_dot<const N: usize>(panel: &[__m256i], xs: [&[BlockQ8K]; N]) -> [__m256; N] {
    panel_dot_subs!(panel, xs, PACKED_BLOCK, SUBS, sub_sums, finish)
}

/// Q4_K weights against [`BlockQ8K`] activations.
pub(crate) struct Q4KPanels(pub Avx2);

impl PanelFormat for Q4KPanels {
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
