//! Fused products (residual add, SwiGLU gate, norm then q/k/v) against the cpu's separate ops.

use crate::*;
use tether_compute::Weight;

/// The residual add fused into the product (matvec batches) and into the GEMM's last
/// store (GEMM batches) both equal the cpu's matmul-then-add.
/// The GEMM's fused residual add gives exactly the bits of the product written out and
/// added after, with one K split (added in the tile kernel's store) and with several
/// (added in the split reduction).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_residual_add_equals_matmul_then_add_bit_for_bit() {
    let g = gpu();
    let mut rng = Rng(11);
    // 2048 x 256 over 300 tokens fills the GPU unsplit; 67 x 512 over 20 splits K.
    for (ty, rows, cols, n) in [
        (GgmlType::Q8_0, 2048usize, 256usize, 300usize),
        (GgmlType::Q4_0, 67, 512, 20),
        (GgmlType::F16, 67, 512, 20),
    ] {
        let w = put(&g, &random_weights(&mut rng, ty, rows * cols));
        let x = put(&g, &f32_bytes(&rng.f32s(n * cols, 1.0)));
        let start = f32_bytes(&rng.f32s(n * rows, 1.0));
        let (mut fused, mut apart) = (put(&g, &start), put(&g, &start));
        let mut tmp = g.alloc(n * rows * 4).unwrap();
        g.matmul_add(Weight::new(&w, ty, rows, cols), &x, n, &mut fused, &mut tmp)
            .unwrap();
        g.matmul(Weight::new(&w, ty, rows, cols), &x, n, &mut tmp)
            .unwrap();
        g.add(&mut apart, &tmp, n * rows).unwrap();
        let (a, b) = (get(&g, &fused, n * rows), get(&g, &apart, n * rows));
        let differ = a
            .iter()
            .zip(&b)
            .filter(|(p, q)| p.to_bits() != q.to_bits())
            .count();
        assert_eq!(differ, 0, "{ty} {rows}x{cols} n={n}: outputs differ");
        assert!(a.iter().all(|v| v.is_finite()), "{ty}: non-finite output");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn matmul_add_matches_cpu() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(7);
    for ty in [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::F16] {
        let (rows, cols) = (67, 512);
        let w = pair(&g, &c, &random_weights(&mut rng, ty, rows * cols));
        for n in [1usize, 3, 8, 20] {
            let x = pair(&g, &c, &f32_bytes(&rng.f32s(n * cols, 1.0)));
            let start = f32_bytes(&rng.f32s(n * rows, 1.0));
            let mut acc = pair(&g, &c, &start);
            let mut tg = g.alloc(n * rows * 4).unwrap();
            let mut tc = c.alloc(n * rows * 4).unwrap();
            g.matmul_add(
                Weight::new(&w.g, ty, rows, cols),
                &x.g,
                n,
                &mut acc.g,
                &mut tg,
            )
            .unwrap();
            c.matmul_add(
                Weight::new(&w.c, ty, rows, cols),
                &x.c,
                n,
                &mut acc.c,
                &mut tc,
            )
            .unwrap();
            let what = format!("matmul_add {ty} {rows}x{cols} n={n}");
            let got = get(&g, &acc.g, n * rows);
            assert_close(&what, &got, &get(&c, &acc.c, n * rows), 1e-2);
            let before: Vec<f32> = start
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            assert!(got != before, "{what}: nothing was added");
        }
    }
}

/// The fused feed-forward gate (Q4_0 decode batches) and the three-step one (other types,
/// larger batches) both equal the cpu's.
#[test]
#[ignore = "needs a CUDA GPU"]
fn matmul_swiglu_matches_cpu() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(9);
    for ty in [GgmlType::Q4_0, GgmlType::Q8_0] {
        let (rows, cols) = (131, 1024);
        let wg = pair(&g, &c, &random_weights(&mut rng, ty, rows * cols));
        let wu = pair(&g, &c, &random_weights(&mut rng, ty, rows * cols));
        for n in [1usize, 3, 8, 20] {
            let x = pair(&g, &c, &f32_bytes(&rng.f32s(n * cols, 1.0)));
            let (mut og, mut g1, mut g2) = (
                g.alloc(n * rows * 4).unwrap(),
                g.alloc(n * rows * 4).unwrap(),
                g.alloc(n * rows * 4).unwrap(),
            );
            let (mut oc, mut c1, mut c2) = (
                c.alloc(n * rows * 4).unwrap(),
                c.alloc(n * rows * 4).unwrap(),
                c.alloc(n * rows * 4).unwrap(),
            );
            g.matmul_swiglu(
                [
                    Weight::new(&wg.g, ty, rows, cols),
                    Weight::new(&wu.g, ty, rows, cols),
                ],
                &x.g,
                n,
                &mut og,
                [&mut g1, &mut g2],
            )
            .unwrap();
            c.matmul_swiglu(
                [
                    Weight::new(&wg.c, ty, rows, cols),
                    Weight::new(&wu.c, ty, rows, cols),
                ],
                &x.c,
                n,
                &mut oc,
                [&mut c1, &mut c2],
            )
            .unwrap();
            let what = format!("matmul_swiglu {ty} {rows}x{cols} n={n}");
            assert_close(
                &what,
                &get(&g, &og, n * rows),
                &get(&c, &oc, n * rows),
                1e-2,
            );
        }
    }
}

/// A norm's 8-bit copy of its rows (written as it normalizes) feeds the Q4_0 products that
/// follow it; the three fused q/k/v products and a later plain one read the right rows.
#[test]
#[ignore = "needs a CUDA GPU"]
fn norm_then_fused_products_match_cpu() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(11);
    let (dim, rows) = (512usize, [96usize, 32, 32]);
    let ty = GgmlType::Q4_0;
    let ws: Vec<Pair> = rows
        .iter()
        .map(|&r| pair(&g, &c, &random_weights(&mut rng, ty, r * dim)))
        .collect();
    let norm_w = pair(&g, &c, &f32_bytes(&rng.f32s(dim, 1.0)));
    for n in [1usize, 5, 8, 12] {
        let x = pair(&g, &c, &f32_bytes(&rng.f32s(n * dim, 3.0)));
        let mut ng = g.alloc(n * dim * 4).unwrap();
        let mut nc = c.alloc(n * dim * 4).unwrap();
        g.rms_norm(&x.g, &norm_w.g, n, dim, 1e-5, &mut ng).unwrap();
        c.rms_norm(&x.c, &norm_w.c, n, dim, 1e-5, &mut nc).unwrap();
        let mut og: Vec<_> = rows.iter().map(|r| g.alloc(n * r * 4).unwrap()).collect();
        let mut oc: Vec<_> = rows.iter().map(|r| c.alloc(n * r * 4).unwrap()).collect();
        let [g0, g1, g2] = &mut og[..] else {
            unreachable!()
        };
        g.matmul3(
            [
                Weight::new(&ws[0].g, ty, rows[0], dim),
                Weight::new(&ws[1].g, ty, rows[1], dim),
                Weight::new(&ws[2].g, ty, rows[2], dim),
            ],
            &ng,
            n,
            [g0, g1, g2],
        )
        .unwrap();
        let [c0, c1, c2] = &mut oc[..] else {
            unreachable!()
        };
        c.matmul3(
            [
                Weight::new(&ws[0].c, ty, rows[0], dim),
                Weight::new(&ws[1].c, ty, rows[1], dim),
                Weight::new(&ws[2].c, ty, rows[2], dim),
            ],
            &nc,
            n,
            [c0, c1, c2],
        )
        .unwrap();
        for i in 0..3 {
            let what = format!("norm then matmul3 output {i}, n={n}");
            let got = get(&g, &og[i], n * rows[i]);
            assert_close(&what, &got, &get(&c, &oc[i], n * rows[i]), 1e-2);
        }
        // A product after another op re-quantizes its input instead of reusing stale rows.
        g.add(&mut ng, &x.g, n * dim).unwrap();
        c.add(&mut nc, &x.c, n * dim).unwrap();
        let mut pg = g.alloc(n * rows[0] * 4).unwrap();
        let mut pc = c.alloc(n * rows[0] * 4).unwrap();
        g.matmul(Weight::new(&ws[0].g, ty, rows[0], dim), &ng, n, &mut pg)
            .unwrap();
        c.matmul(Weight::new(&ws[0].c, ty, rows[0], dim), &nc, n, &mut pc)
            .unwrap();
        let what = format!("matmul after add, n={n}");
        assert_close(
            &what,
            &get(&g, &pg, n * rows[0]),
            &get(&c, &pc, n * rows[0]),
            1e-2,
        );
    }
}
