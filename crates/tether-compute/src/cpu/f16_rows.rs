//! Row operations between f32 vectors and little-endian f16 rows (the KV cache), with an
//! AVX2/F16C path and a portable one that gives the same results up to summation order.

use crate::cpu::simd::Avx2;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

fn f16_le(h: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([h[2 * i], h[2 * i + 1]]).to_f32()
}

/// `Σ x[i] · h[i]` over `x.len()` elements; `h` holds at least `2 · x.len()` bytes.
pub(crate) fn dot_f16(cpu: Option<Avx2>, x: &[f32], h: &[u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if cpu.is_some() {
        // SAFETY: the token proves the CPU has the enabled features.
        return unsafe { dot_f16_avx2(x, h) };
    }
    let _ = cpu;
    x.iter().enumerate().map(|(i, v)| v * f16_le(h, i)).sum()
}

/// `acc[i] += a · h[i]` over `acc.len()` elements.
pub(crate) fn axpy_f16(cpu: Option<Avx2>, acc: &mut [f32], a: f32, h: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    if cpu.is_some() {
        // SAFETY: the token proves the CPU has the enabled features.
        return unsafe { axpy_f16_avx2(acc, a, h) };
    }
    let _ = cpu;
    for (i, v) in acc.iter_mut().enumerate() {
        *v += a * f16_le(h, i);
    }
}

/// Heads per call that the grouped SIMD kernels keep in registers.
const MAX_GROUP: usize = 8;

/// `out[g] = Σ_i q[g·hd + i] · h[i]` for the `out.len()` query heads of `q` that share the
/// f16 row `h` (grouped-query attention): `h` is converted once for all of them.
pub(crate) fn dot_f16_heads(cpu: Option<Avx2>, q: &[f32], hd: usize, h: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if cpu.is_some() && hd.is_multiple_of(8) && out.len() <= MAX_GROUP {
        // SAFETY: the token proves the CPU has the enabled features.
        return unsafe { dot_f16_heads_avx2(q, hd, h, out) };
    }
    for (o, qv) in out.iter_mut().zip(q.chunks_exact(hd)) {
        *o = dot_f16(cpu, qv, h);
    }
}

/// `o[g·hd + i] += p[g] · h[i]` for the `p.len()` heads of `o` that share the f16 row `h`.
pub(crate) fn axpy_f16_heads(cpu: Option<Avx2>, o: &mut [f32], hd: usize, p: &[f32], h: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    if cpu.is_some() && hd.is_multiple_of(8) {
        // SAFETY: the token proves the CPU has the enabled features.
        return unsafe { axpy_f16_heads_avx2(o, hd, p, h) };
    }
    for (og, pg) in o.chunks_exact_mut(hd).zip(p) {
        axpy_f16(cpu, og, *pg, h);
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f16_heads_avx2(q: &[f32], hd: usize, h: &[u8], out: &mut [f32]) {
    let mut acc = [_mm256_setzero_ps(); MAX_GROUP];
    let g_n = out.len();
    let mut i = 0;
    while i + 8 <= hd {
        let hv = load_h8(h, i);
        for (g, a) in acc.iter_mut().enumerate().take(g_n) {
            let qs = &q[g * hd + i..g * hd + i + 8];
            // SAFETY: `qs` is 8 f32, one unaligned 256-bit load.
            let qv = unsafe { _mm256_loadu_ps(qs.as_ptr()) };
            *a = _mm256_fmadd_ps(qv, hv, *a);
        }
        i += 8;
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = crate::cpu::simd::hsum_ps(a);
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn axpy_f16_heads_avx2(o: &mut [f32], hd: usize, p: &[f32], h: &[u8]) {
    let mut i = 0;
    while i + 8 <= hd {
        let hv = load_h8(h, i);
        for (og, pg) in o.chunks_exact_mut(hd).zip(p) {
            let s = &mut og[i..i + 8];
            // SAFETY: `s` is 8 f32; one unaligned 256-bit load and store inside it.
            unsafe {
                let v = _mm256_fmadd_ps(_mm256_set1_ps(*pg), hv, _mm256_loadu_ps(s.as_ptr()));
                _mm256_storeu_ps(s.as_mut_ptr(), v);
            }
        }
        i += 8;
    }
}

/// Writes `src` as f16 (round to nearest even) into `dst` (`2 · src.len()` bytes).
pub(crate) fn store_f16(src: &[f32], dst: &mut [u8]) {
    for (v, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load_h8(h: &[u8], i: usize) -> __m256 {
    let s = &h[2 * i..2 * i + 16];
    // SAFETY: `s` is 16 bytes, one unaligned 128-bit load.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(s.as_ptr().cast()) })
}

#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f16_avx2(x: &[f32], h: &[u8]) -> f32 {
    let n = x.len();
    let load_x = |i: usize| {
        let xs = &x[i..i + 8];
        // SAFETY: `xs` is 8 f32, one unaligned 256-bit load.
        unsafe { _mm256_loadu_ps(xs.as_ptr()) }
    };
    // Four independent sums: head rows are short (64-128), so one FMA chain would leave
    // the dot product waiting on latency.
    let mut acc4 = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, a) in acc4.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(load_x(i + 8 * k), load_h8(h, i + 8 * k), *a);
        }
        i += 32;
    }
    let mut acc = _mm256_add_ps(
        _mm256_add_ps(acc4[0], acc4[1]),
        _mm256_add_ps(acc4[2], acc4[3]),
    );
    while i + 8 <= n {
        let xs = &x[i..i + 8];
        // SAFETY: `xs` is 8 f32, one unaligned 256-bit load.
        let xv = unsafe { _mm256_loadu_ps(xs.as_ptr()) };
        acc = _mm256_fmadd_ps(xv, load_h8(h, i), acc);
        i += 8;
    }
    let mut sum = crate::cpu::simd::hsum_ps(acc);
    for (k, v) in x.iter().enumerate().skip(i) {
        sum += v * f16_le(h, k);
    }
    sum
}

#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn axpy_f16_avx2(acc: &mut [f32], a: f32, h: &[u8]) {
    let n = acc.len();
    let av = _mm256_set1_ps(a);
    let mut i = 0;
    while i + 8 <= n {
        let s = &mut acc[i..i + 8];
        // SAFETY: `s` is 8 f32; one unaligned 256-bit load and store inside it.
        unsafe {
            let v = _mm256_fmadd_ps(av, load_h8(h, i), _mm256_loadu_ps(s.as_ptr()));
            _mm256_storeu_ps(s.as_mut_ptr(), v);
        }
        i += 8;
    }
    for (k, v) in acc.iter_mut().enumerate().skip(i) {
        *v += a * f16_le(h, k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::test_util::{Rng, random_f32};

    #[test]
    fn simd_and_portable_paths_agree_with_f64() {
        let mut rng = Rng::new(11);
        for n in [1usize, 8, 13, 64, 100] {
            let x = random_f32(&mut rng, n, 1.0);
            let hv = random_f32(&mut rng, n, 2.0);
            let mut h = vec![0u8; 2 * n];
            store_f16(&hv, &mut h);
            let hr: Vec<f64> = (0..n).map(|i| f64::from(f16_le(&h, i))).collect();
            for (i, v) in hv.iter().enumerate() {
                assert!((f64::from(*v) - hr[i]).abs() <= f64::from(v.abs()) * 1e-3 + 1e-7);
            }
            let want: f64 = x.iter().zip(&hr).map(|(a, b)| f64::from(*a) * b).sum();
            for cpu in [None, Avx2::detect()] {
                let got = dot_f16(cpu, &x, &h);
                assert!((f64::from(got) - want).abs() < 1e-5 * n as f64, "n={n}");
                let mut acc = x.clone();
                axpy_f16(cpu, &mut acc, 0.5, &h);
                for i in 0..n {
                    let w = f64::from(x[i]) + 0.5 * hr[i];
                    assert!((f64::from(acc[i]) - w).abs() < 1e-6, "n={n} i={i}");
                }
            }
        }
    }
}
