//! Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS weights through the 8-bit K-quant decode kernels
//! (kernels/matvec_kquant.cu; Q6_K, Q3_K and IQ4_XS packed by `finish_weight` first), the GEMM and the
//! embedding rows: every result equals the cpu backend's within the 8-bit activations'
//! error, at widths that take the kernels and widths that fall back to the f32 ones.
//!
//! GPU tests, ignored by default: `cargo test -p tether-compute --test cuda_kquant --
//! --ignored`. Without a GPU they fail.

use tether_gguf::GgmlType;

mod common;
use common::fused::{Rig, finished};
use common::{Rng, cpu, gpu, random_weights};

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
            // Up to 8 tokens a launch; 13 is two launches; from 17 the GEMM, which decodes
            // Q4_K, Q5_K and packed rows in its tiles (other rows: the products from the
            // blocks, mmq.cu, to 64, the GEMM's f16 workspace past that). 8-bit
            // activations (blocks of 32 here, of 256 on the cpu) against weights with a min
            // offset: about 1% on 256-wide rows of random data.
            let mut rig = Rig {
                g: &g,
                c: &c,
                rng: &mut rng,
                cols,
                expect_packed: false,
            };
            rig.products(&w, ty, rows, &[1, 2, 3, 5, 8, 13, 17, 64, 65, 130], 2e-2);
        }

        // Embedding rows of a (packed) table decode exactly as the cpu's.
        let mut rig = Rig {
            g: &g,
            c: &c,
            rng: &mut rng,
            cols: 2048,
            expect_packed: false,
        };
        rig.embedding_rows(ty);
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
        // the fused kernels up to 8 tokens (12 runs them one by one: the GEMM for the types
        // it decodes, matvec launches of up to 8 tokens for Q3_K).
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
