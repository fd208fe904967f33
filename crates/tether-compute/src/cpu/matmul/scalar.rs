//! Portable integer kernels for the common weight types (Q4_0, Q8_0, Q4_K, Q6_K) against
//! 8-bit activations. They define the arithmetic the SIMD kernels must reproduce.

use super::RowKernel;
use crate::cpu::q8::{BlockQ8, BlockQ8K, quantize_row_q8, quantize_row_q8k};

/// The little-endian f16 at byte `at` of `b`, as f32.
#[inline]
pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The eight 6-bit scales and mins of a Q4_K/Q5_K super-block from its 12 packed bytes:
/// sub-blocks 0..4 use the low 6 bits of bytes `j` (scale) and `j + 4` (min); 4..8 take
/// their low 4 bits from the nibbles of byte `j + 4` and their top 2 bits from the top bits
/// of bytes `j - 4` (scale) and `j` (min).
///
/// Done four bytes at a time on little-endian words (`(b >> 6) << 4` of each byte is
/// `(word >> 2) & 0x30` per byte), which is several times fewer operations than per byte.
/// Inlined: as a call it took an eighth of a Q4_K decode step.
#[inline(always)]
pub(crate) fn unpack_q4k_scales(q: &[u8]) -> ([u8; 8], [u8; 8]) {
    let word = |i: usize| u32::from_le_bytes([q[i], q[i + 1], q[i + 2], q[i + 3]]);
    let (w0, w1, w2) = (word(0), word(4), word(8));
    let sc_lo = w0 & 0x3F3F_3F3F;
    let mn_lo = w1 & 0x3F3F_3F3F;
    let sc_hi = (w2 & 0x0F0F_0F0F) | ((w0 >> 2) & 0x3030_3030);
    let mn_hi = ((w2 >> 4) & 0x0F0F_0F0F) | ((w1 >> 2) & 0x3030_3030);
    let join = |lo: u32, hi: u32| (u64::from(lo) | (u64::from(hi) << 32)).to_le_bytes();
    (join(sc_lo, sc_hi), join(mn_lo, mn_hi))
}

/// Q4_0 weights (`{d: f16, qs: [u8; 16]}`, `x = (q - 8)·d`) against [`BlockQ8`].
pub(crate) struct Q4_0Kernel;

impl RowKernel for Q4_0Kernel {
    type Act = BlockQ8;
    const ACT_BLOCK: usize = 32;

    fn prepare(&self, x: &[f32], out: &mut [BlockQ8]) {
        quantize_row_q8(None, x, out);
    }

    fn dot<const N: usize>(&self, w: &[u8], xs: [&[BlockQ8]; N]) -> [f32; N] {
        let mut acc = [0.0f32; N];
        for (b, blk) in w.chunks_exact(18).enumerate() {
            let d = f16_at(blk, 0);
            for (a, x) in acc.iter_mut().zip(xs) {
                let y = &x[b];
                let mut s = 0i32;
                for (i, &v) in blk[2..18].iter().enumerate() {
                    s += (i32::from(v & 0x0F) - 8) * i32::from(y.qs[i]);
                    s += (i32::from(v >> 4) - 8) * i32::from(y.qs[i + 16]);
                }
                *a += d * y.d * s as f32;
            }
        }
        acc
    }
}

/// Q8_0 weights (`{d: f16, qs: [i8; 32]}`) against [`BlockQ8`].
pub(crate) struct Q8_0Kernel;

impl RowKernel for Q8_0Kernel {
    type Act = BlockQ8;
    const ACT_BLOCK: usize = 32;

    fn prepare(&self, x: &[f32], out: &mut [BlockQ8]) {
        quantize_row_q8(None, x, out);
    }

    fn dot<const N: usize>(&self, w: &[u8], xs: [&[BlockQ8]; N]) -> [f32; N] {
        let mut acc = [0.0f32; N];
        for (b, blk) in w.chunks_exact(34).enumerate() {
            let d = f16_at(blk, 0);
            for (a, x) in acc.iter_mut().zip(xs) {
                let y = &x[b];
                let s: i32 = blk[2..34]
                    .iter()
                    .zip(y.qs)
                    .map(|(&q, v)| i32::from(q as i8) * i32::from(v))
                    .sum();
                *a += d * y.d * s as f32;
            }
        }
        acc
    }
}

/// Q4_K weights (144-byte super-blocks) against [`BlockQ8K`].
pub(crate) struct Q4KKernel;

impl RowKernel for Q4KKernel {
    type Act = BlockQ8K;
    const ACT_BLOCK: usize = 256;

    fn prepare(&self, x: &[f32], out: &mut [BlockQ8K]) {
        quantize_row_q8k(None, x, out);
    }

    fn dot<const N: usize>(&self, w: &[u8], xs: [&[BlockQ8K]; N]) -> [f32; N] {
        let mut acc = [0.0f32; N];
        for (b, blk) in w.chunks_exact(144).enumerate() {
            let d = f16_at(blk, 0);
            let dmin = f16_at(blk, 2);
            let (sc, mn) = unpack_q4k_scales(&blk[4..16]);
            let qs = &blk[16..144];
            for (a, x) in acc.iter_mut().zip(xs) {
                let y = &x[b];
                let mut sumi = 0i32;
                for g in 0..4 {
                    let (mut lo, mut hi) = (0i32, 0i32);
                    for l in 0..32 {
                        let q = qs[32 * g + l];
                        lo += i32::from(q & 0x0F) * i32::from(y.qs[64 * g + l]);
                        hi += i32::from(q >> 4) * i32::from(y.qs[64 * g + 32 + l]);
                    }
                    sumi += i32::from(sc[2 * g]) * lo + i32::from(sc[2 * g + 1]) * hi;
                }
                let summ: i32 = (0..8)
                    .map(|s| {
                        i32::from(mn[s])
                            * (i32::from(y.bsums[2 * s]) + i32::from(y.bsums[2 * s + 1]))
                    })
                    .sum();
                *a += y.d * (d * sumi as f32 - dmin * summ as f32);
            }
        }
        acc
    }
}

/// Q6_K weights (210-byte super-blocks) against [`BlockQ8K`].
pub(crate) struct Q6KKernel;

impl RowKernel for Q6KKernel {
    type Act = BlockQ8K;
    const ACT_BLOCK: usize = 256;

    fn prepare(&self, x: &[f32], out: &mut [BlockQ8K]) {
        quantize_row_q8k(None, x, out);
    }

    fn dot<const N: usize>(&self, w: &[u8], xs: [&[BlockQ8K]; N]) -> [f32; N] {
        let mut acc = [0.0f32; N];
        for (b, blk) in w.chunks_exact(210).enumerate() {
            let d = f16_at(blk, 208);
            let (ql, qh) = (&blk[0..128], &blk[128..192]);
            let sc = &blk[192..208];
            for (a, x) in acc.iter_mut().zip(xs) {
                let y = &x[b];
                // Per sub-block sums of q·y with q in 0..64; the -32 bias comes from bsums.
                let mut sub = [0i32; 16];
                for h in 0..2 {
                    for l in 0..32 {
                        let (la, lb, hb) = (ql[64 * h + l], ql[64 * h + 32 + l], qh[32 * h + l]);
                        let q = [
                            (la & 0x0F) | ((hb & 3) << 4),
                            (lb & 0x0F) | (((hb >> 2) & 3) << 4),
                            (la >> 4) | (((hb >> 4) & 3) << 4),
                            (lb >> 4) | ((hb >> 6) << 4),
                        ];
                        for (k, &qk) in q.iter().enumerate() {
                            let e = 128 * h + 32 * k + l;
                            sub[e / 16] += i32::from(qk) * i32::from(y.qs[e]);
                        }
                    }
                }
                let mut sumi = 0i32;
                for s in 0..16 {
                    let scale = i32::from(sc[s] as i8);
                    sumi += scale * (sub[s] - 32 * i32::from(y.bsums[s]));
                }
                *a += d * y.d * sumi as f32;
            }
        }
        acc
    }
}
