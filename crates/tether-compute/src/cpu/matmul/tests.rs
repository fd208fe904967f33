//! Every kernel against an f64 product of the reference dequantization.

use super::*;
use crate::cpu::test_util::{Rng, random_f32, random_weights, relative_error};
use tether_gguf::dequantize;

/// Types whose activations are quantized to 8 bits by the fast kernels: uniform input
/// gives about 0.4% relative noise (step/√12 against the input's rms); with a dozen
/// outputs of very different magnitudes the measured error scatters up to ~1.5%.
const INT8_TOLERANCE: f64 = 2.5e-2;
/// Types multiplied against f32 activations.
const F32_TOLERANCE: f64 = 1e-5;

fn reference(ty: GgmlType, w: &[u8], s: Shape, x: &[f32]) -> Vec<f64> {
    let mut wf = vec![0.0f32; s.rows * s.cols];
    dequantize(ty, w, &mut wf).unwrap();
    let mut out = vec![0.0f64; s.rows * s.n_tokens];
    for t in 0..s.n_tokens {
        let xr = &x[t * s.cols..(t + 1) * s.cols];
        for r in 0..s.rows {
            let wr = &wf[r * s.cols..(r + 1) * s.cols];
            out[t * s.rows + r] = wr
                .iter()
                .zip(xr)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum();
        }
    }
    out
}

/// Column counts that exercise whole rows, several blocks and (for floats) SIMD tails.
fn col_counts(ty: GgmlType) -> &'static [usize] {
    match ty.block_elems() {
        1 => &[100, 512],
        32 => &[96, 512],
        _ => &[256, 768],
    }
}

fn check<K: RowKernel>(k: &K, ty: GgmlType, tol: f64, seed: u64) {
    let mut rng = Rng::new(seed);
    for &cols in col_counts(ty) {
        for (rows, n_tokens) in [(13, 1), (13, 7), (67, 5)] {
            let s = Shape {
                rows,
                cols,
                n_tokens,
            };
            let w = random_weights(&mut rng, ty, rows * cols);
            let x = random_f32(&mut rng, n_tokens * cols, 1.0);
            let mut out = vec![f32::NAN; rows * n_tokens];
            run(k, &w, s, &x, &mut out);
            let want = reference(ty, &w, s, &x);
            let err = relative_error(&out, &want);
            assert!(
                err < tol,
                "{ty} rows={rows} cols={cols} tokens={n_tokens}: error {err} >= {tol}"
            );
            assert!(
                want.iter().any(|v| v.abs() > 1e-3),
                "{ty}: degenerate test data"
            );
        }
    }
}

#[test]
fn generic_kernel_is_exact_up_to_f32_rounding_for_every_type() {
    for (i, ty) in GgmlType::ALL.into_iter().enumerate() {
        check(
            &generic::GenericKernel::new(ty),
            ty,
            F32_TOLERANCE,
            100 + i as u64,
        );
    }
}

#[test]
fn scalar_integer_kernels_match_reference() {
    check(&scalar::Q4_0Kernel, GgmlType::Q4_0, INT8_TOLERANCE, 1);
    check(&scalar::Q8_0Kernel, GgmlType::Q8_0, INT8_TOLERANCE, 2);
    check(&scalar::Q4KKernel, GgmlType::Q4K, INT8_TOLERANCE, 3);
    check(&scalar::Q6KKernel, GgmlType::Q6K, INT8_TOLERANCE, 4);
}

#[test]
fn dispatched_matmul_matches_reference_for_every_type() {
    for (i, ty) in GgmlType::ALL.into_iter().enumerate() {
        let mut rng = Rng::new(200 + i as u64);
        let cols = col_counts(ty)[1];
        for (rows, n_tokens) in [(1, 1), (31, 7), (130, 9)] {
            let s = Shape {
                rows,
                cols,
                n_tokens,
            };
            let w = random_weights(&mut rng, ty, rows * cols);
            let x = random_f32(&mut rng, n_tokens * cols, 2.0);
            let mut out = vec![f32::NAN; rows * n_tokens];
            matmul(CpuIsa::detect(), ty, &w, s, &x, &mut out);
            let tol = if ty.is_quantized() {
                INT8_TOLERANCE
            } else {
                F32_TOLERANCE
            };
            let err = relative_error(&out, &reference(ty, &w, s, &x));
            assert!(err < tol, "{ty} rows={rows} tokens={n_tokens}: error {err}");
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::*;
    use crate::cpu::simd::Avx2;

    #[test]
    fn avx2_kernels_match_reference() {
        let Some(cpu) = Avx2::detect() else { return };
        for (i, ty) in [GgmlType::F32, GgmlType::F16, GgmlType::BF16]
            .into_iter()
            .enumerate()
        {
            check(
                &avx2::FloatKernel::new(cpu, ty),
                ty,
                F32_TOLERANCE,
                10 + i as u64,
            );
        }
        check(&avx2::Q4_0Kernel(cpu), GgmlType::Q4_0, INT8_TOLERANCE, 20);
        check(&avx2::Q8_0Kernel(cpu), GgmlType::Q8_0, INT8_TOLERANCE, 21);
        check(
            &avx2_kquant::Q4KKernel(cpu),
            GgmlType::Q4K,
            INT8_TOLERANCE,
            22,
        );
        check(
            &avx2_kquant::Q6KKernel(cpu),
            GgmlType::Q6K,
            INT8_TOLERANCE,
            23,
        );
        check(
            &avx2_q5::Q5_0Kernel(cpu),
            GgmlType::Q5_0,
            INT8_TOLERANCE,
            24,
        );
        check(&avx2_q5::Q5KKernel(cpu), GgmlType::Q5K, INT8_TOLERANCE, 25);
    }

    /// Same quantized activations, same integer sums: only the float summation order may
    /// differ between the AVX2 kernels (one row or four) and the scalar ones.
    fn same_as_scalar<A: RowKernel, S: RowKernel<Act = A::Act>>(a: &A, s: &S, ty: GgmlType) {
        let mut rng = Rng::new(77);
        let cols = 1024;
        let w = random_weights(&mut rng, ty, 4 * cols);
        let x = random_f32(&mut rng, 4 * cols, 1.0);
        let per_row = cols / A::ACT_BLOCK;
        let mut acts = vec![A::Act::default(); 4 * per_row];
        for (xr, ar) in x.chunks(cols).zip(acts.chunks_mut(per_row)) {
            a.prepare(xr, ar);
        }
        let t: Vec<&[A::Act]> = acts.chunks(per_row).collect();
        let wr: Vec<&[u8]> = w.chunks(w.len() / 4).collect();
        let close = |got: f32, want: f32| (got - want).abs() <= 1e-5 * want.abs().max(1e-2);
        let tiles4 = a.dot4([wr[0], wr[1], wr[2], wr[3]], [t[0], t[1], t[2], t[3]]);
        let tiles1 = a.dot4([wr[0], wr[1], wr[2], wr[3]], [t[1]]);
        for r in 0..4 {
            let slow = s.dot(wr[r], [t[0], t[1], t[2], t[3]]);
            let fast = a.dot(wr[r], [t[0], t[1], t[2], t[3]]);
            for j in 0..4 {
                assert!(
                    close(fast[j], slow[j]),
                    "{ty} row {r} token {j}: {} vs {}",
                    fast[j],
                    slow[j]
                );
                assert!(close(tiles4[r][j], slow[j]), "{ty} dot4 row {r} token {j}");
            }
            assert!(close(tiles1[r][0], slow[1]), "{ty} dot4 row {r}, one token");
            assert!(
                close(a.dot(wr[r], [t[2]])[0], slow[2]),
                "{ty} row {r}, one token"
            );
        }
    }

    /// A panel path (prefill) against the scalar kernel on the same quantized
    /// activations: integer sums are exact, so only float rounding may differ. Odd row
    /// counts leave part of the last panel empty; odd token counts leave a short group.
    fn panels_match_scalar<P, S>(
        panels: &P,
        scalar: &S,
        ty: GgmlType,
        sizes: &[(usize, usize, usize)],
    ) where
        P: avx2_panel::PanelFormat,
        S: RowKernel,
    {
        let mut rng = Rng::new(78);
        for &(rows, cols, n_tokens) in sizes {
            let s = Shape {
                rows,
                cols,
                n_tokens,
            };
            let w = random_weights(&mut rng, ty, rows * cols);
            let x = random_f32(&mut rng, n_tokens * cols, 1.0);
            let mut want = vec![f32::NAN; rows * n_tokens];
            run(scalar, &w, s, &x, &mut want);
            let mut got = vec![f32::NAN; rows * n_tokens];
            avx2_panel::matmul(panels, &w, s, &x, &mut got);
            let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-5 * scale,
                    "{ty} rows={rows} cols={cols} tokens={n_tokens} at {i}: {g} vs {w}"
                );
            }
        }
    }

    #[test]
    fn avx2_panels_reproduce_the_scalar_kernels() {
        let Some(cpu) = Avx2::detect() else {
            eprintln!("skipped: this CPU lacks AVX2, FMA or F16C");
            return;
        };
        panels_match_scalar(
            &avx2_panel::Q4_0Panels(cpu),
            &scalar::Q4_0Kernel,
            GgmlType::Q4_0,
            &[(13, 96, 8), (67, 512, 11), (130, 64, 9), (8, 32, 64)],
        );
        panels_match_scalar(
            &avx2_panel_q4k::Q4KPanels(cpu),
            &scalar::Q4KKernel,
            GgmlType::Q4K,
            &[(13, 256, 8), (67, 768, 11), (130, 512, 9), (8, 256, 64)],
        );
        panels_match_scalar(
            &avx2_panel_q6k::Q6KPanels(cpu),
            &scalar::Q6KKernel,
            GgmlType::Q6K,
            &[(13, 256, 8), (67, 768, 11), (130, 512, 9), (8, 256, 64)],
        );
    }

    #[test]
    fn avx2_kernels_reproduce_the_scalar_integer_arithmetic() {
        let Some(cpu) = Avx2::detect() else { return };
        same_as_scalar(&avx2::Q4_0Kernel(cpu), &scalar::Q4_0Kernel, GgmlType::Q4_0);
        same_as_scalar(&avx2::Q8_0Kernel(cpu), &scalar::Q8_0Kernel, GgmlType::Q8_0);
        same_as_scalar(
            &avx2_kquant::Q4KKernel(cpu),
            &scalar::Q4KKernel,
            GgmlType::Q4K,
        );
        same_as_scalar(
            &avx2_kquant::Q6KKernel(cpu),
            &scalar::Q6KKernel,
            GgmlType::Q6K,
        );
    }
}

/// Activations on an exact 8-bit grid (each 32-block holds ±127 steps of 1/64), so the
/// integer kernels lose nothing to activation quantization and must match to f32 rounding.
#[test]
fn integer_kernels_are_exact_on_exactly_quantizable_activations() {
    let mut rng = Rng::new(5);
    let (rows, cols, n_tokens) = (13, 768, 6);
    let s = Shape {
        rows,
        cols,
        n_tokens,
    };
    let x: Vec<f32> = (0..n_tokens * cols)
        .map(|i| {
            let q = if i % 32 == 0 {
                127
            } else {
                (rng.next_u64() % 255) as i32 - 127
            };
            q as f32 / 64.0
        })
        .collect();
    let types = [
        GgmlType::Q4_0,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];
    for ty in types {
        let w = random_weights(&mut rng, ty, rows * cols);
        let want = reference(ty, &w, s, &x);
        let mut out = vec![f32::NAN; rows * n_tokens];
        matmul(CpuIsa::detect(), ty, &w, s, &x, &mut out);
        assert!(relative_error(&out, &want) < 1e-6, "{ty} dispatched");
        match ty {
            GgmlType::Q4_0 => run(&scalar::Q4_0Kernel, &w, s, &x, &mut out),
            GgmlType::Q8_0 => run(&scalar::Q8_0Kernel, &w, s, &x, &mut out),
            GgmlType::Q4K => run(&scalar::Q4KKernel, &w, s, &x, &mut out),
            GgmlType::Q6K => run(&scalar::Q6KKernel, &w, s, &x, &mut out),
            _ => run(&generic::GenericKernel::new(ty), &w, s, &x, &mut out),
        }
        assert!(relative_error(&out, &want) < 1e-6, "{ty} scalar");
    }
}
