//! Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS weights through the 8-bit K-quant decode kernels
//! (kernels/matvec_kquant.cu; Q6_K, Q3_K and IQ4_XS packed by `finish_weight` first), the GEMM and the
//! embedding rows: every result equals the cpu backend's within the 8-bit activations'
//! error, at widths that take the kernels and widths that fall back to the f32 ones.
//!
//! GPU tests, ignored by default: `cargo test -p tether-compute --test cuda_kquant --
//! --ignored`. Without a GPU they fail.

use tether_compute::Backend;
use tether_gguf::GgmlType;

mod common;
use common::fused::{Rig, finished, relative_error};
use common::{Rng, cpu, f32_bytes, get, gpu, put, random_weights};

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
        // Whole groups of 2048, so Q6_K, Q3_K and IQ4_XS are packed and every type takes
        // the fused kernels up to 8 tokens (12 runs them one by one).
        let mut rig = Rig {
            g: &g,
            c: &c,
            rng: &mut rng,
            cols: 2048,
            expect_packed: false,
        };
        let tokens = [1usize, 5, 8, 12];
        rig.qkv([ty; 3], &tokens, 2e-2);
        // The gate/up output is heavy-tailed, so both backends' 8-bit copies of it (blocks
        // of 32 here, of 256 on the cpu) differ more in the down projection: 2.7% was seen.
        rig.gate_up_down(ty, &tokens, 2e-2, 5e-2);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn mixed_qkv_types_give_the_cpus_products() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(61);
    let mut rig = Rig {
        g: &g,
        c: &c,
        rng: &mut rng,
        cols: 2048,
        expect_packed: false,
    };
    // q and k of one type, v of another, as llama.cpp's mixes give attn_v more bits.
    for (qt, vt) in [
        (GgmlType::Q4K, GgmlType::Q6K),
        (GgmlType::Q5K, GgmlType::Q6K),
        (GgmlType::Q3K, GgmlType::Q4K),
        (GgmlType::Q3K, GgmlType::Q5K),
        (GgmlType::IQ4XS, GgmlType::Q5K),
    ] {
        rig.qkv([qt, qt, vt], &[1, 5, 8], 2e-2);
    }
}
