//! Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS weights through the 8-bit K-quant decode kernels
//! (kernels/matvec_kquant.cu; Q6_K, Q3_K and IQ4_XS packed by `finish_weight` first), the GEMM and the
//! embedding rows: every result equals the cpu backend's within the 8-bit activations'
//! error, at widths that take the kernels and widths that fall back to the f32 ones.
//!
//! GPU tests, ignored by default: `cargo test -p tether-compute --test cuda_kquant --
//! --ignored`. Without a GPU they fail.

use tether_compute::{Backend, CpuBackend, CudaBackend};
use tether_gguf::GgmlType;

mod common;
use common::{Rng, cpu, f32_bytes, get, gpu, put, random_weights};

/// ‖a − b‖ / ‖b‖, after checking every value is finite.
fn relative_error(what: &str, a: &[f32], b: &[f32]) -> f64 {
    assert!(a.iter().all(|v| v.is_finite()), "{what}: non-finite output");
    let d: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
        .sum();
    let n: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (d / n.max(1e-30)).sqrt()
}

/// A finished weight on both backends and whether the GPU rewrote its bytes (packed).
struct Finished {
    g: <CudaBackend as Backend>::Buffer,
    c: <CpuBackend as Backend>::Buffer,
    packed: bool,
}

fn zeros<B: Backend>(be: &B, n: usize) -> B::Buffer {
    be.alloc(n * 4).unwrap()
}

fn finished(g: &CudaBackend, c: &CpuBackend, ty: GgmlType, bytes: &[u8], cols: usize) -> Finished {
    let (mut wg, mut wc) = (put(g, bytes), put(c, bytes));
    g.finish_weight(&mut wg, ty, cols).unwrap();
    c.finish_weight(&mut wc, ty, cols).unwrap();
    let mut now = vec![0u8; bytes.len()];
    g.download(&wg, 0, &mut now).unwrap();
    Finished {
        g: wg,
        c: wc,
        packed: now != bytes,
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn kquant_weights_give_the_cpus_products() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(53);
    for ty in [
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::IQ4XS,
        GgmlType::Q3K,
    ] {
        // Q6_K, Q3_K and IQ4_XS pack whole groups of 2048 values; 768 stays in GGUF's layout
        // (f32 kernels).
        for cols in [256usize, 768, 2048, 4096, 14336] {
            let rows = 67;
            let bytes = random_weights(&mut rng, ty, rows * cols);
            let w = finished(&g, &c, ty, &bytes, cols);
            let packs = matches!(ty, GgmlType::Q6K | GgmlType::Q3K | GgmlType::IQ4XS)
                && cols.is_multiple_of(2048);
            assert_eq!(w.packed, packs, "{ty} {rows}x{cols}: packed");
            // Up to 8 tokens a launch; 13 is two launches; 17 and 64 take the GEMM.
            for n in [1usize, 2, 3, 5, 8, 13, 17, 64] {
                let x = rng.f32s(n * cols, 1.0);
                let (xg, xc) = (put(&g, &f32_bytes(&x)), put(&c, &f32_bytes(&x)));
                let mut og = g.alloc(n * rows * 4).unwrap();
                let mut oc = c.alloc(n * rows * 4).unwrap();
                g.matmul(&w.g, ty, rows, cols, &xg, n, &mut og).unwrap();
                c.matmul(&w.c, ty, rows, cols, &xc, n, &mut oc).unwrap();
                let what = format!("matmul {ty} {rows}x{cols} n={n}");
                let e = relative_error(&what, &get(&g, &og, n * rows), &get(&c, &oc, n * rows));
                // 8-bit activations (blocks of 32 here, of 256 on the cpu) against weights
                // with a min offset: about 1% on 256-wide rows of random data.
                assert!(e < 2e-2, "{what}: relative error {e}");

                // The residual add fused into the product.
                let start = f32_bytes(&rng.f32s(n * rows, 1.0));
                let (mut ag, mut ac) = (put(&g, &start), put(&c, &start));
                let mut tg = g.alloc(n * rows * 4).unwrap();
                let mut tc = c.alloc(n * rows * 4).unwrap();
                g.matmul_add(&w.g, ty, rows, cols, &xg, n, &mut ag, &mut tg)
                    .unwrap();
                c.matmul_add(&w.c, ty, rows, cols, &xc, n, &mut ac, &mut tc)
                    .unwrap();
                let what = format!("matmul_add {ty} {rows}x{cols} n={n}");
                let e = relative_error(&what, &get(&g, &ag, n * rows), &get(&c, &ac, n * rows));
                // 8-bit activations (blocks of 32 here, of 256 on the cpu) against weights
                // with a min offset: about 1% on 256-wide rows of random data.
                assert!(e < 2e-2, "{what}: relative error {e}");
            }
        }

        // Embedding rows of a (packed) table decode exactly as the cpu's.
        let cols = 2048;
        let table = finished(&g, &c, ty, &random_weights(&mut rng, ty, 7 * cols), cols);
        let ids = [6u32, 0, 3, 3, 1];
        let mut og = g.alloc(ids.len() * cols * 4).unwrap();
        let mut oc = c.alloc(ids.len() * cols * 4).unwrap();
        g.get_rows(&table.g, ty, cols, &ids, &mut og).unwrap();
        c.get_rows(&table.c, ty, cols, &ids, &mut oc).unwrap();
        let n = ids.len() * cols;
        let what = format!("get_rows {ty}");
        let e = relative_error(&what, &get(&g, &og, n), &get(&c, &oc, n));
        assert!(e < 1e-6, "{what}: relative error {e}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn kquant_weights_give_the_cpus_fused_products() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(59);
    for ty in [
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::IQ4XS,
        GgmlType::Q3K,
    ] {
        // Whole groups of 2048, so Q6_K is packed and every type takes the fused kernels.
        let cols = 2048;
        // 40 rows end inside a block of the packed q/k/v kernel.
        let rows = [96usize, 40, 40];
        let ws: Vec<Finished> = rows
            .iter()
            .map(|&r| finished(&g, &c, ty, &random_weights(&mut rng, ty, r * cols), cols))
            .collect();
        for n in [1usize, 5, 8, 12] {
            let x = rng.f32s(n * cols, 1.0);
            let (xg, xc) = (put(&g, &f32_bytes(&x)), put(&c, &f32_bytes(&x)));
            let mut og: Vec<_> = rows.iter().map(|r| g.alloc(n * r * 4).unwrap()).collect();
            let mut oc: Vec<_> = rows.iter().map(|r| c.alloc(n * r * 4).unwrap()).collect();
            let [g0, g1, g2] = &mut og[..] else {
                unreachable!()
            };
            g.matmul3(
                [&ws[0].g, &ws[1].g, &ws[2].g],
                [ty; 3],
                rows,
                cols,
                &xg,
                n,
                [g0, g1, g2],
            )
            .unwrap();
            let [c0, c1, c2] = &mut oc[..] else {
                unreachable!()
            };
            c.matmul3(
                [&ws[0].c, &ws[1].c, &ws[2].c],
                [ty; 3],
                rows,
                cols,
                &xc,
                n,
                [c0, c1, c2],
            )
            .unwrap();
            for i in 0..3 {
                let what = format!("matmul3 {ty} output {i} n={n}");
                let e = relative_error(
                    &what,
                    &get(&g, &og[i], n * rows[i]),
                    &get(&c, &oc[i], n * rows[i]),
                );
                assert!(e < 2e-2, "{what}: relative error {e}");
            }

            // Gate and up, then down over their output: 256 rows are whole 8-bit blocks, so
            // the gate/up kernel also writes the down projection's 8-bit input; 72 rows end
            // inside a block and take the plain path.
            for r in [256usize, 72] {
                let gate = finished(&g, &c, ty, &random_weights(&mut rng, ty, r * cols), cols);
                let up = finished(&g, &c, ty, &random_weights(&mut rng, ty, r * cols), cols);
                let (mut sg, mut g1, mut g2) =
                    (zeros(&g, n * r), zeros(&g, n * r), zeros(&g, n * r));
                let (mut sc, mut c1, mut c2) =
                    (zeros(&c, n * r), zeros(&c, n * r), zeros(&c, n * r));
                g.matmul_swiglu(
                    &gate.g, &up.g, ty, r, cols, &xg, n, &mut sg, &mut g1, &mut g2,
                )
                .unwrap();
                c.matmul_swiglu(
                    &gate.c, &up.c, ty, r, cols, &xc, n, &mut sc, &mut c1, &mut c2,
                )
                .unwrap();
                let what = format!("matmul_swiglu {ty} {r} rows n={n}");
                let e = relative_error(&what, &get(&g, &sg, n * r), &get(&c, &sc, n * r));
                assert!(e < 2e-2, "{what}: relative error {e}");
                if !r.is_multiple_of(256) {
                    continue;
                }
                let down_rows = 48;
                let down = finished(&g, &c, ty, &random_weights(&mut rng, ty, down_rows * r), r);
                let (mut dg, mut dc) = (zeros(&g, n * down_rows), zeros(&c, n * down_rows));
                g.matmul(&down.g, ty, down_rows, r, &sg, n, &mut dg)
                    .unwrap();
                c.matmul(&down.c, ty, down_rows, r, &sc, n, &mut dc)
                    .unwrap();
                let what = format!("down after matmul_swiglu {ty} n={n}");
                let e = relative_error(
                    &what,
                    &get(&g, &dg, n * down_rows),
                    &get(&c, &dc, n * down_rows),
                );
                // The gate/up output is heavy-tailed, so both backends' 8-bit copies of it
                // (blocks of 32 here, 256 on the cpu) differ more: 2.7% was seen.
                assert!(e < 5e-2, "{what}: relative error {e}");
            }
        }
    }
}
