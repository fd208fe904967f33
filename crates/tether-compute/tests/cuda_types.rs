//! Every weight type the cpu backend serves, on the cuda backend: embedding rows
//! (`get_rows`), decode products (the matvec kernels: 1, 3 and 8 tokens) and prefill products
//! (the GEMM: 64 tokens), plain and added into a residual (`matmul_add`), on 37 rows (off the
//! kernels' 4-rows-per-block grid) and, where the type's blocks allow, rows 896 wide
//! (qwen2-0.5b's width: 3.5 groups of 256).
//!
//! Each result is checked against an f64 product of the weights as tether-gguf dequantizes
//! them and against the cpu backend; a failure names the type, shape, token count, the
//! element that differs most and both values.
//!
//! Every test needs a GPU and is ignored by default; run them with
//! `cargo test -p tether-compute --test cuda_types -- --ignored --test-threads=1`.
//! Without a GPU they fail (the backend cannot be created), they do not skip.

use tether_compute::Backend;
use tether_compute::Weight;
use tether_gguf::{GgmlType, dequantize};

mod common;
use common::{Rng, WEIGHT_TYPES, cpu, f32_bytes, get, gpu, put, random_weights};

/// Rows of every product: not a multiple of the 4 rows a matvec block takes.
const ROWS: usize = 37;
/// Tokens of the products: 1, 3 and 8 run the matvec kernels, 64 the GEMM.
const TOKEN_COUNTS: [usize; 4] = [1, 3, 8, 64];
/// Relative error allowed against the cpu backend, which quantizes activations to 8 bits
/// for most quantized types.
const VS_CPU: f64 = 1e-2;

/// Row widths for `ty`: 896 wherever its blocks divide it, else 3 and 1 blocks of 256; an
/// odd width for the float types (their scalar tail).
fn widths(ty: GgmlType) -> &'static [usize] {
    match ty.block_elems() {
        1 => &[896, 99],
        32 => &[896, 64],
        _ => &[768, 256],
    }
}

/// Whether the cuda decode products of `ty` take 8-bit activations (as llama.cpp's do),
/// which costs up to about 1e-2 relative error against exact products; the others take
/// f32 activations.
fn eight_bit_decode(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0
            | GgmlType::Q8_0
            | GgmlType::Q3K
            | GgmlType::Q4K
            | GgmlType::Q5K
            | GgmlType::Q6K
            | GgmlType::IQ4XS
    )
}

/// Relative error allowed against the f64 product for `n` tokens of `ty`.
fn vs_exact(ty: GgmlType, n: usize) -> f64 {
    if n > 8 {
        // The GEMM rounds weights and activations to f16.
        5e-3
    } else if eight_bit_decode(ty) {
        2e-2
    } else {
        1e-4
    }
}

/// `‖got − want‖ / ‖want‖` must stay under `tol`, and every value must be finite; on
/// failure names the element (as `outer` `i / per`, `inner` `i % per`) that differs most.
fn check(
    what: &str,
    got: &[f32],
    want: &[f64],
    (outer, inner, per): (&str, &str, usize),
    tol: f64,
) {
    assert_eq!(got.len(), want.len(), "{what}: output length");
    let at = |i: usize| {
        format!(
            "{outer} {} {inner} {} (index {i}): got {}, want {}",
            i / per,
            i % per,
            got[i],
            want[i]
        )
    };
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("{what}: non-finite output at {}", at(i));
    }
    let (mut diff2, mut norm2, mut worst, mut worst_at) = (0f64, 0f64, -1f64, 0);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let d = (f64::from(g) - w).abs();
        if d > worst {
            (worst, worst_at) = (d, i);
        }
        diff2 += d * d;
        norm2 += w * w;
    }
    let e = if norm2 == 0.0 {
        diff2.sqrt()
    } else {
        (diff2 / norm2).sqrt()
    };
    assert!(
        e < tol,
        "{what}: relative error {e:.3e} >= {tol:e}; largest difference at {}",
        at(worst_at)
    );
}

fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

/// `acc[t][r] + Σ_c w[r][c] · x[t][c]` in f64.
fn product(w: &[f32], rows: usize, cols: usize, x: &[f32], n: usize, acc: &[f32]) -> Vec<f64> {
    let mut out = widen(acc);
    for t in 0..n {
        let xr = &x[t * cols..(t + 1) * cols];
        for r in 0..rows {
            let wr = &w[r * cols..(r + 1) * cols];
            let s: f64 = wr
                .iter()
                .zip(xr)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
            out[t * rows + r] += s;
        }
    }
    out
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn get_rows_of_every_weight_type_equal_the_dequantized_rows() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(101);
    for ty in WEIGHT_TYPES {
        for &row_len in widths(ty) {
            let n_rows = 5;
            let bytes = random_weights(&mut rng, ty, n_rows * row_len);
            let mut table = vec![0f32; n_rows * row_len];
            dequantize(ty, &bytes, &mut table).unwrap();
            let ids = [4u32, 0, 2, 2, 3, 1];
            let want: Vec<f64> = ids
                .iter()
                .flat_map(|&id| widen(&table[id as usize * row_len..][..row_len]))
                .collect();
            let n = ids.len() * row_len;
            let (tg, tc) = (put(&g, &bytes), put(&c, &bytes));
            let (mut og, mut oc) = (g.alloc(n * 4).unwrap(), c.alloc(n * 4).unwrap());
            let what = format!("get_rows {ty} rows of {row_len}");
            g.get_rows(&tg, ty, row_len, &ids, &mut og)
                .unwrap_or_else(|e| panic!("{what} on cuda: {e}"));
            c.get_rows(&tc, ty, row_len, &ids, &mut oc).unwrap();
            let shape = ("id index", "element", row_len);
            check(
                &format!("{what}, cuda"),
                &get(&g, &og, n),
                &want,
                shape,
                1e-6,
            );
            check(
                &format!("{what}, cpu"),
                &get(&c, &oc, n),
                &want,
                shape,
                1e-6,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn products_of_every_weight_type_match_exact_products_and_the_cpu() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(102);
    for ty in WEIGHT_TYPES {
        for &cols in widths(ty) {
            let bytes = random_weights(&mut rng, ty, ROWS * cols);
            let mut w = vec![0f32; ROWS * cols];
            dequantize(ty, &bytes, &mut w).unwrap();
            let (wg, wc) = (put(&g, &bytes), put(&c, &bytes));
            for n in TOKEN_COUNTS {
                let x = rng.f32s(n * cols, 1.0);
                let residual = rng.f32s(n * ROWS, 1.0);
                let (xg, xc) = (put(&g, &f32_bytes(&x)), put(&c, &f32_bytes(&x)));
                let path = if n > 8 { "gemm" } else { "matvec" };
                let what = format!("{ty} {ROWS}x{cols} n={n} ({path})");
                let shape = ("token", "row", ROWS);
                let tol = vs_exact(ty, n);

                let mut og = g.alloc(n * ROWS * 4).unwrap();
                let mut oc = c.alloc(n * ROWS * 4).unwrap();
                g.matmul(Weight::new(&wg, ty, ROWS, cols), &xg, n, &mut og)
                    .unwrap_or_else(|e| panic!("matmul {what} on cuda: {e}"));
                c.matmul(Weight::new(&wc, ty, ROWS, cols), &xc, n, &mut oc)
                    .unwrap();
                let got = get(&g, &og, n * ROWS);
                let zero = vec![0f32; n * ROWS];
                let exact = product(&w, ROWS, cols, &x, n, &zero);
                check(&format!("matmul {what} vs f64"), &got, &exact, shape, tol);
                let on_cpu = widen(&get(&c, &oc, n * ROWS));
                check(
                    &format!("matmul {what} vs cpu"),
                    &got,
                    &on_cpu,
                    shape,
                    VS_CPU,
                );

                // Added into a residual (the kernels' accumulate path).
                let mut acc = put(&g, &f32_bytes(&residual));
                let mut tmp = g.alloc(n * ROWS * 4).unwrap();
                g.matmul_add(Weight::new(&wg, ty, ROWS, cols), &xg, n, &mut acc, &mut tmp)
                    .unwrap_or_else(|e| panic!("matmul_add {what} on cuda: {e}"));
                let exact = product(&w, ROWS, cols, &x, n, &residual);
                let got = get(&g, &acc, n * ROWS);
                check(
                    &format!("matmul_add {what} vs f64"),
                    &got,
                    &exact,
                    shape,
                    tol,
                );
            }
        }
    }
}
