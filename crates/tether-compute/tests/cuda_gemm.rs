//! The CUDA prefill GEMM (batches of `GEMM_MIN_TOKENS` tokens and more) against the
//! cpu backend, and its timings.
//!
//! Every test needs a GPU and is ignored by default; run them with
//! `cargo test -p tether-compute --release --test cuda_gemm -- --ignored --test-threads=1
//! --nocapture`. Without a GPU they fail (the backend cannot be created), they do not skip.

use std::time::Instant;
use tether_compute::Weight;

use tether_compute::cuda::GEMM_MIN_TOKENS;
use tether_compute::{Backend, ComputeError, CpuBackend, CudaBackend};
use tether_gguf::GgmlType;

mod common;
use common::{Rng, WEIGHT_TYPES, cpu, f32_bytes, get, gpu, put, random_weights};

/// The GPU with the 8-bit products of 17-256 tokens off, so every batch here takes the
/// GEMM (cuda_mmq.rs tests those products).
fn gemm_gpu() -> CudaBackend {
    gpu().with_mmq_max_tokens(0)
}

/// `gemm_gpu` with the weights decoded to the f16 workspace for every type, as types the
/// tile kernels cannot decode always are.
fn workspace_gemm_gpu() -> CudaBackend {
    gemm_gpu().with_fused_gemm(false)
}

/// The cpu backend's answers for one case: its matmul, and the exact (f64) product of its
/// own dequantized weights (get_rows) with the inputs. The cpu matmul rounds the inputs
/// to 8 bits: on K-quants that alone was measured up to 2.2% of a row's largest value
/// away from exact, so the GEMM (f16 operands, 0.2% from exact) is held to the exact
/// product, and only loosely to the cpu matmul.
struct Reference {
    matmul: Vec<f32>,
    exact: Vec<f32>,
}

fn reference(c: &CpuBackend, ty: GgmlType, wb: &[u8], x: &[f32], shape: [usize; 3]) -> Reference {
    let [rows, cols, n] = shape;
    let w = put(c, wb);
    let xc = put(c, &f32_bytes(x));
    let mut out = c.alloc(n * rows * 4).unwrap();
    c.matmul(Weight::new(&w, ty, rows, cols), &xc, n, &mut out)
        .unwrap();
    let matmul = get(c, &out, n * rows);
    let ids: Vec<u32> = (0..rows as u32).collect();
    let mut wf = c.alloc(rows * cols * 4).unwrap();
    c.get_rows(&w, ty, cols, &ids, &mut wf).unwrap();
    let wf = get(c, &wf, rows * cols);
    let mut exact = vec![0f32; n * rows];
    let threads = std::thread::available_parallelism().map_or(4, |t| t.get());
    let per = n.div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (i, chunk) in exact.chunks_mut(per * rows).enumerate() {
            let (wf, x) = (&wf, x);
            s.spawn(move || {
                for (j, o) in chunk.iter_mut().enumerate() {
                    let (t, r) = (i * per + j / rows, j % rows);
                    let (wr, xr) = (&wf[r * cols..][..cols], &x[t * cols..][..cols]);
                    let dot: f64 = wr
                        .iter()
                        .zip(xr)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum();
                    *o = dot as f32;
                }
            });
        }
    });
    Reference { matmul, exact }
}

/// Fails when an output row (one token) of `got` is off `want` by more than `tol` of the
/// row's largest magnitude. Rows of fewer than 16 values are measured against the whole
/// output's largest magnitude instead: one dot product can cancel to near zero, leaving
/// nothing to measure a rounding error against.
fn compare(what: &str, got: &[f32], want: &[f32], rows: usize, tol: f32) -> Result<(), String> {
    let whole_max = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (t, (gr, wr)) in got
        .chunks_exact(rows)
        .zip(want.chunks_exact(rows))
        .enumerate()
    {
        let row_max = wr.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = if rows < 16 { whole_max } else { row_max }.max(1e-6);
        // A NaN difference (a skipped tile reads the poison) counts as infinite.
        let diffs = gr.iter().zip(wr).map(|(a, b)| {
            let d = (a - b).abs();
            if d.is_nan() { f32::INFINITY } else { d }
        });
        let (worst, diff) =
            diffs.enumerate().fold(
                (0, 0f32),
                |best, (i, d)| if d > best.1 { (i, d) } else { best },
            );
        if diff > tol * scale {
            return Err(format!(
                "{what}: token {t} row {worst}: gpu {} want {} (scale {scale}, tolerance {tol})",
                gr[worst], wr[worst]
            ));
        }
    }
    Ok(())
}

/// Runs one matmul of random data on the GPU and checks it within 1e-2 of the exact
/// product and 5e-2 of the cpu matmul (see [`Reference`]), and that a second run gives
/// the same bits (split-K sums in a fixed order). Returns what failed, so one run
/// reports every case.
fn check(
    g: &CudaBackend,
    c: &CpuBackend,
    rng: &mut Rng,
    ty: GgmlType,
    shape: [usize; 3],
) -> Result<(), String> {
    let [rows, cols, n] = shape;
    let wb = random_weights(rng, ty, rows * cols);
    let x = rng.f32s(n * cols, 1.0);
    let (wg, xg) = (put(g, &wb), put(g, &f32_bytes(&x)));
    // Poison the GPU output so a tile the GEMM skips cannot pass as zeros.
    let mut og = put(g, &f32_bytes(&vec![f32::NAN; n * rows]));
    g.matmul(Weight::new(&wg, ty, rows, cols), &xg, n, &mut og)
        .unwrap();
    let got = get(g, &og, n * rows);
    let want = reference(c, ty, &wb, &x, shape);
    let what = format!("{ty} {rows}x{cols} n={n}");
    compare(&format!("{what} vs exact"), &got, &want.exact, rows, 1e-2)?;
    compare(
        &format!("{what} vs cpu matmul"),
        &got,
        &want.matmul,
        rows,
        5e-2,
    )?;
    g.matmul(Weight::new(&wg, ty, rows, cols), &xg, n, &mut og)
        .unwrap();
    let again = get(g, &og, n * rows);
    if again
        .iter()
        .zip(&got)
        .any(|(a, b)| a.to_bits() != b.to_bits())
    {
        return Err(format!("{what}: a second run gave other bits"));
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_matches_cpu_for_every_weight_type_and_edge_shape() {
    let c = cpu();
    let mut rng = Rng(11);
    let mut failures = Vec::new();
    let mut cases = 0;
    // Both ways to the tiles: decoded in them (the default where the type allows) and
    // through the f16 workspace.
    let gpus = [gemm_gpu(), workspace_gemm_gpu()];
    for (ty, g) in WEIGHT_TYPES
        .iter()
        .flat_map(|&ty| gpus.iter().map(move |g| (ty, g)))
    {
        let mut shapes = Vec::new();
        // Every (rows, tokens) pair on short rows: one row, a partial tile, a partial last
        // tile after 32 full ones; the smallest GEMM batch, a partial tile, 4 tiles.
        for rows in [1usize, 100, 4096 + 17] {
            for n in [GEMM_MIN_TOKENS, 33, 512] {
                shapes.push([rows, 256, n]);
            }
        }
        // Model-sized rows (split K), and (floats only) column counts off the K step.
        shapes.extend([
            [4096 + 17, 4096, 33],
            [100, 4096, 512],
            [1, 4096, GEMM_MIN_TOKENS],
            // Whole tiles of the narrow token tiles.
            [4096 + 17, 4096, 32],
            [300, 4096, 64],
        ]);
        if ty.block_elems() == 1 {
            shapes.extend([
                [100, 100, 33],
                [4096 + 17, 100, GEMM_MIN_TOKENS],
                [1, 100, 512],
            ]);
        }
        for shape in shapes {
            cases += 1;
            if let Err(e) = check(g, &c, &mut rng, ty, shape) {
                eprintln!("FAIL {e}");
                failures.push(e);
            }
        }
    }
    eprintln!(
        "{} of {cases} GEMM cases within 1e-2",
        cases - failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} failed: {failures:#?}",
        failures.len()
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_splits_rows_and_tokens_that_overflow_the_workspace() {
    // 65 536 columns: the 32 Mi-value weight chunk holds 512 rows and the 8 Mi-value input
    // chunk 128 tokens, so this runs 2 row chunks x 2 token chunks, both with edges.
    let (g, c) = (gemm_gpu(), cpu());
    let mut rng = Rng(12);
    check(&g, &c, &mut rng, GgmlType::Q8_0, [600, 65_536, 140]).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_allocates_nothing_and_refuses_bad_sizes() {
    let g = gemm_gpu();
    assert!(
        g.internal_bytes() >= 80 << 20,
        "the GEMM workspace (80 MiB) is missing from internal_bytes: {}",
        g.internal_bytes()
    );
    let (rows, cols, n) = (4096, 4096, 64);
    let w = g
        .alloc(GgmlType::Q4_0.bytes_for((rows * cols) as u64).unwrap() as usize)
        .unwrap();
    let x = g.alloc(n * cols * 4).unwrap();
    let mut o = g.alloc(n * rows * 4).unwrap();
    let before = g.allocated_bytes();
    g.matmul(Weight::new(&w, GgmlType::Q4_0, rows, cols), &x, n, &mut o)
        .unwrap();
    g.synchronize().unwrap();
    assert_eq!(
        g.allocated_bytes(),
        before,
        "a GEMM allocated device memory"
    );
    // Not whole blocks; an output too small for the batch; an input too small.
    let r = g.matmul(Weight::new(&w, GgmlType::Q4_0, 4, 100), &x, n, &mut o);
    assert!(matches!(r, Err(ComputeError::Shape { .. })), "{r:?}");
    let r = g.matmul(
        Weight::new(&w, GgmlType::Q4_0, rows, cols),
        &x,
        2 * n,
        &mut o,
    );
    assert!(matches!(r, Err(ComputeError::Shape { .. })), "{r:?}");
    let small = g.alloc(4).unwrap();
    let r = g.matmul(
        Weight::new(&w, GgmlType::Q4_0, rows, cols),
        &small,
        n,
        &mut o,
    );
    assert!(matches!(r, Err(ComputeError::Shape { .. })), "{r:?}");
}

/// Mean seconds per call of `f` over `iters` calls, after a warm-up.
fn time(be: &CudaBackend, iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    be.synchronize().unwrap();
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    be.synchronize().unwrap();
    start.elapsed().as_secs_f64() / iters as f64
}

/// Weights with a small f16 scale in every block, so the arithmetic stays finite.
fn bench_weights(ty: GgmlType, elems: usize) -> Vec<u8> {
    let mut w = vec![0x11u8; ty.bytes_for(elems as u64).unwrap() as usize];
    let scale = half::f16::from_f32(0.01).to_le_bytes();
    for b in w.chunks_exact_mut(ty.block_bytes()) {
        b[..2].copy_from_slice(&scale);
    }
    w
}

/// Seconds per `matmul` of a `rows x cols` weight of `ty` with `n` tokens.
fn time_matmul(g: &CudaBackend, ty: GgmlType, rows: usize, cols: usize, n: usize) -> f64 {
    let w = put(g, &bench_weights(ty, rows * cols));
    let x = put(g, &f32_bytes(&vec![0.5; n * cols]));
    let mut out = g.alloc(n * rows * 4).unwrap();
    time(g, 20, || {
        g.matmul(Weight::new(&w, ty, rows, cols), &x, n, &mut out)
            .unwrap();
    })
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bench_prefill_gemm() {
    let (g, ws) = (gemm_gpu(), workspace_gemm_gpu());
    let n = 512;
    for (ty, g, how) in [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K]
        .into_iter()
        .flat_map(|ty| {
            [
                (ty, &g, "decoded in the tiles"),
                (ty, &ws, "via the workspace"),
            ]
        })
    {
        let mut t = std::collections::HashMap::new();
        for (rows, cols) in [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)] {
            let secs = time_matmul(g, ty, rows, cols, n);
            let tflops = 2.0 * (rows * cols * n) as f64 / secs / 1e12;
            eprintln!(
                "gemm {ty:>5} {rows:>5}x{cols:<5} n={n}: {:8.1} us  {tflops:6.1} TFLOP/s",
                secs * 1e6
            );
            t.insert((rows, cols), secs);
        }
        // llama3-8b: q, o 4096x4096; k, v 1024x4096; gate, up 14336x4096; down 4096x14336.
        let layer = 2.0 * t[&(4096, 4096)]
            + 2.0 * t[&(1024, 4096)]
            + 2.0 * t[&(14336, 4096)]
            + t[&(4096, 14336)];
        eprintln!(
            "gemm {ty:>5} 8B-shape pp{n} (32 layers of matmuls only, {how}): {:.0} tokens/s",
            n as f64 / (32.0 * layer)
        );
    }
    // Where the GEMM overtakes the matvec kernels: µs per token at small batches.
    for ty in [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4K] {
        for n in [8usize, 9, 16, 17, 24, 32, 64] {
            let secs = time_matmul(&g, ty, 4096, 4096, n);
            eprintln!(
                "small {ty:>5} 4096x4096 n={n:>2}: {:8.1} us  {:6.2} us/token",
                secs * 1e6,
                secs * 1e6 / n as f64
            );
        }
    }
}
