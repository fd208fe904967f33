//! Products of 9 to 256 tokens on the tensor cores straight from quantized blocks
//! (kernels/mmq.cu) for Q4_0, Q8_0, Q4_K, Q5_K, Q6_K and IQ4_XS, packed and in GGUF's
//! layout: every result equals the cpu backend's within the 8-bit activations' error, at
//! row counts that end inside a tile, token counts that end inside a tile, rows whose
//! columns end inside a 256-column chunk, and shapes that split K across blocks. 257 and
//! 512 tokens (the GEMM's) stay in the lists so both sides of the boundary are checked.
//!
//! GPU tests, ignored by default: `cargo test -p tether-compute --test cuda_mmq --
//! --ignored`. Without a GPU they fail.

use std::time::Instant;
use tether_compute::Weight;

use tether_compute::{Backend, CpuBackend, CudaBackend};
use tether_gguf::GgmlType;

mod common;
use common::fused::{Rig, finished};
use common::{Rng, cpu, f32_bytes, get, gpu, put, random_weights};

type GpuBuffer = <CudaBackend as Backend>::Buffer;

/// The GPU with the tensor-core products from quantized blocks on for 9 to 256 tokens (and
/// the GEMM that decodes weights in its tiles, which would take them from 17, off).
fn mmq_gpu() -> CudaBackend {
    gpu().with_mmq_max_tokens(256).with_fused_gemm(false)
}

/// Token counts on both sides of the tiles (64) and of the GEMM's boundary (256).
const TOKENS: [usize; 11] = [9, 16, 17, 33, 63, 64, 100, 255, 256, 257, 512];

#[test]
#[ignore = "needs a CUDA GPU"]
fn mmq_products_give_the_cpus_for_every_type_and_layout() {
    let (g, c) = (mmq_gpu(), cpu());
    let mut rng = Rng(71);
    // (type, columns, whether finish_weight packs them, tolerance). Q4_0 and Q8_0 meet the
    // cpu's own 8-bit blocks; the K-quants' activations are blocks of 256 on the cpu.
    let cases = [
        (GgmlType::Q4_0, 4096, true, 1e-2),
        (GgmlType::Q4_0, 288, false, 1e-2),
        (GgmlType::Q8_0, 2048, true, 1e-2),
        (GgmlType::Q8_0, 800, false, 1e-2),
        (GgmlType::Q4K, 2304, false, 2e-2),
        (GgmlType::Q5K, 768, false, 2e-2),
        (GgmlType::Q6K, 2048, true, 2e-2),
        (GgmlType::Q6K, 768, false, 2e-2),
        (GgmlType::IQ4XS, 2048, true, 2e-2),
        (GgmlType::IQ4XS, 1280, false, 2e-2),
    ];
    for (ty, cols, packs, tol) in cases {
        for rows in [67usize, 130] {
            let packed = products(&g, &c, &mut rng, ty, [rows, cols], &TOKENS, tol);
            assert_eq!(packed, packs, "{ty} {rows}x{cols}: packed");
        }
    }
}

/// Random `rows` x `cols` weights of `ty`, finished on both backends, times each token
/// count of random activations within `tol` of the cpu (`Rig::products`); returns whether
/// the GPU packed them.
fn products(
    g: &CudaBackend,
    c: &CpuBackend,
    rng: &mut Rng,
    ty: GgmlType,
    [rows, cols]: [usize; 2],
    tokens: &[usize],
    tol: f64,
) -> bool {
    let bytes = random_weights(rng, ty, rows * cols);
    let w = finished(g, c, ty, &bytes, cols);
    let mut rig = Rig {
        g,
        c,
        rng,
        cols,
        expect_packed: false,
    };
    rig.products(&w, ty, rows, tokens, tol);
    w.packed
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn mmq_products_split_k_and_many_tiles_give_the_cpus() {
    let (g, c) = (mmq_gpu(), cpu());
    let mut rng = Rng(73);
    // Few tiles over long rows split K across blocks (partials summed by gemm_reduce, also
    // into a residual); many tiles run unsplit.
    let cases = [
        (GgmlType::Q4_0, 67, 14336, &[17usize, 40][..]),
        (GgmlType::Q6K, 40, 14336, &[17, 100][..]),
        (GgmlType::Q4K, 1000, 4096, &[33, 200][..]),
        (GgmlType::Q8_0, 4096 + 17, 1024, &[65][..]),
    ];
    for (ty, rows, cols, tokens) in cases {
        products(&g, &c, &mut rng, ty, [rows, cols], tokens, 2e-2);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn mmq_batches_of_fused_products_give_the_cpus() {
    // q/k/v and gate/up/down over batches the fused decode kernels do not take: each runs
    // as its own product from the quantized blocks here.
    let (g, c) = (mmq_gpu(), cpu());
    let mut rng = Rng(79);
    // The down projection meets the gate/up output (wide-ranged) as f16 here and quantized
    // to 8 bits on the cpu (in blocks of 256 for Q4_K): 1.09% apart for Q4_0 at 100 tokens
    // on an H100, 2.4% for Q4_K at 17 on an H200 (when both sides took 8-bit tokens).
    for (ty, tol, down_tol) in [(GgmlType::Q4_0, 1e-2, 2e-2), (GgmlType::Q4K, 3e-2, 3e-2)] {
        let mut rig = Rig {
            g: &g,
            c: &c,
            rng: &mut rng,
            cols: 512,
            expect_packed: false,
        };
        let tokens = [17usize, 100];
        rig.qkv([ty; 3], &tokens, tol);
        rig.gate_up_down(ty, &tokens, tol, down_tol);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn mmq_products_allocate_nothing_and_repeat_their_bits() {
    let g = mmq_gpu();
    let mut rng = Rng(83);
    let (ty, rows, cols, n) = (GgmlType::Q4K, 100, 4096, 40);
    let w = put(&g, &random_weights(&mut rng, ty, rows * cols));
    let x = put(&g, &f32_bytes(&rng.f32s(n * cols, 1.0)));
    let mut o = g.alloc(n * rows * 4).unwrap();
    let before = g.allocated_bytes();
    g.matmul(Weight::new(&w, ty, rows, cols), &x, n, &mut o)
        .unwrap();
    let first = get(&g, &o, n * rows);
    g.matmul(Weight::new(&w, ty, rows, cols), &x, n, &mut o)
        .unwrap();
    g.synchronize().unwrap();
    assert_eq!(g.allocated_bytes(), before, "an 8-bit product allocated");
    let again = get(&g, &o, n * rows);
    assert!(first.iter().any(|v| *v != 0.0), "all zero");
    assert!(
        first
            .iter()
            .zip(&again)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "a second run (K split across blocks) gave other bits"
    );
}

/// Seconds per `matmul` of `w` (`rows` x `cols` of `ty`) over `n` random tokens on `g`.
fn time_matmul(g: &CudaBackend, w: &GpuBuffer, ty: GgmlType, shape: [usize; 3]) -> f64 {
    let [rows, cols, n] = shape;
    let x = put(g, &f32_bytes(&Rng(5).f32s(n * cols, 1.0)));
    let mut out = g.alloc(n * rows * 4).unwrap();
    g.matmul(Weight::new(w, ty, rows, cols), &x, n, &mut out)
        .unwrap();
    g.synchronize().unwrap();
    let iters = 20;
    let start = Instant::now();
    for _ in 0..iters {
        g.matmul(Weight::new(w, ty, rows, cols), &x, n, &mut out)
            .unwrap();
    }
    g.synchronize().unwrap();
    start.elapsed().as_secs_f64() / iters as f64
}

/// Where the 8-bit products beat the paths they replace: llama3-8b's matmuls (finished
/// weights, so Q4_0 / Q8_0 / Q6_K packed) per layer, with them (up to 512 tokens) and
/// without, by batch size.
/// Prints; asserts nothing. `cargo test -p tether-compute --release --test cuda_mmq
/// bench_ -- --ignored --nocapture`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bench_mmq_against_the_gemm() {
    let (on, off) = (
        mmq_gpu().with_mmq_max_tokens(512),
        gpu().with_mmq_max_tokens(0),
    );
    let mut rng = Rng(89);
    // q, o; k, v; gate, up; down (rows, cols, per layer).
    let shapes = [
        (4096usize, 4096usize, 2.0),
        (1024, 4096, 2.0),
        (14336, 4096, 2.0),
        (4096, 14336, 1.0),
    ];
    for ty in [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K] {
        let weights: Vec<_> = shapes
            .iter()
            .map(|&(rows, cols, _)| {
                let bytes = random_weights(&mut rng, ty, rows * cols);
                let (mut a, mut b) = (put(&on, &bytes), put(&off, &bytes));
                on.finish_weight(&mut a, ty, cols).unwrap();
                off.finish_weight(&mut b, ty, cols).unwrap();
                (a, b)
            })
            .collect();
        for n in [9usize, 12, 16, 17, 32, 48, 64, 96, 128, 192, 256, 512] {
            let (mut layer_on, mut layer_off) = (0.0, 0.0);
            for (&(rows, cols, per), (a, b)) in shapes.iter().zip(&weights) {
                layer_on += per * time_matmul(&on, a, ty, [rows, cols, n]);
                layer_off += per * time_matmul(&off, b, ty, [rows, cols, n]);
            }
            eprintln!(
                "{ty:>5} n={n:>3}: a layer's matmuls {:8.1} us with mmq, {:8.1} us without \
                 ({:.2}x); 32 layers {:.0} / {:.0} tokens/s",
                layer_on * 1e6,
                layer_off * 1e6,
                layer_off / layer_on,
                n as f64 / (32.0 * layer_on),
                n as f64 / (32.0 * layer_off)
            );
        }
    }
}
