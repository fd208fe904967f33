//! The CUDA backend against the cpu backend, op by op, on random inputs: products, gathers,
//! elementwise ops, rope and arg-max here; attention, fused products and device memory in
//! the files of `cuda_ops/`, in this same test binary.
//!
//! Every test needs a GPU and is ignored by default; run them with
//! `cargo test -p tether-compute --test cuda_ops -- --ignored --test-threads=1`.
//! Without a GPU they fail (the backend cannot be created), they do not skip.

use tether_compute::{
    AttnShape, AttnSpan, Backend, ComputeError, CpuBackend, CudaBackend, DeviceBuffer, RopeParams,
};
use tether_compute::{KvCacheMut, Qkv, Rope, Weight};
use tether_gguf::GgmlType;

mod common;
use common::{Rng, WEIGHT_TYPES, cpu, f32_bytes, get, gpu, put, random_weights};

mod cuda_ops {
    mod attention;
    mod fused;
    mod memory;
    mod paged_attention;
    mod ring_attention;
}

/// ‖a − b‖ / ‖b‖.
fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "compared vectors differ in length");
    let d: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
        .sum();
    let n: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    if n == 0.0 { d.sqrt() } else { (d / n).sqrt() }
}

/// Both backends' buffers for the same bytes.
struct Pair {
    g: <CudaBackend as Backend>::Buffer,
    c: <CpuBackend as Backend>::Buffer,
}

fn pair(g: &CudaBackend, c: &CpuBackend, bytes: &[u8]) -> Pair {
    Pair {
        g: put(g, bytes),
        c: put(c, bytes),
    }
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    assert!(
        got.iter().all(|v| v.is_finite()),
        "{what}: non-finite output"
    );
    let e = relative_error(got, want);
    assert!(e < tol, "{what}: relative error {e} >= {tol}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn matmul_matches_cpu_for_every_weight_type_and_batch() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(1);
    for ty in WEIGHT_TYPES {
        // Rows off the 4-rows-per-block grid; several column counts, odd ones for floats.
        let col_counts: &[usize] = if ty.block_elems() == 1 {
            &[512, 100, 4096]
        } else {
            &[512, 4096]
        };
        for &cols in col_counts {
            let rows = 67;
            let w = pair(&g, &c, &random_weights(&mut rng, ty, rows * cols));
            for n in [1usize, 2, 3, 8, 13] {
                let x = pair(&g, &c, &f32_bytes(&rng.f32s(n * cols, 1.0)));
                let mut og = g.alloc(n * rows * 4).unwrap();
                let mut oc = c.alloc(n * rows * 4).unwrap();
                g.matmul(Weight::new(&w.g, ty, rows, cols), &x.g, n, &mut og)
                    .unwrap();
                c.matmul(Weight::new(&w.c, ty, rows, cols), &x.c, n, &mut oc)
                    .unwrap();
                let what = format!("matmul {ty} {rows}x{cols} n={n}");
                assert_close(
                    &what,
                    &get(&g, &og, n * rows),
                    &get(&c, &oc, n * rows),
                    1e-2,
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn matmul_refuses_bad_sizes() {
    let g = gpu();
    let w = g.alloc(1 << 16).unwrap();
    let x = g.alloc(1 << 12).unwrap();
    let mut o = g.alloc(1 << 12).unwrap();
    // Every type is served (cuda_types.rs); rows of part of a block are not.
    let r = g.matmul(Weight::new(&w, GgmlType::Q2K, 4, 288), &x, 1, &mut o);
    assert!(matches!(r, Err(ComputeError::Shape { .. })), "{r:?}");
    let r = g.matmul(Weight::new(&w, GgmlType::Q4_0, 4, 100), &x, 1, &mut o);
    assert!(matches!(r, Err(ComputeError::Shape { .. })), "{r:?}");
    let r = g.matmul(Weight::new(&w, GgmlType::F32, 4096, 4096), &x, 1, &mut o);
    assert!(matches!(r, Err(ComputeError::Shape { .. })), "{r:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn get_rows_matches_cpu_for_every_weight_type() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(2);
    for ty in WEIGHT_TYPES {
        let row_len = 512;
        let table = pair(&g, &c, &random_weights(&mut rng, ty, 7 * row_len));
        let ids = [6u32, 0, 3, 3, 1];
        let mut og = g.alloc(ids.len() * row_len * 4).unwrap();
        let mut oc = c.alloc(ids.len() * row_len * 4).unwrap();
        g.get_rows(&table.g, ty, row_len, &ids, &mut og).unwrap();
        c.get_rows(&table.c, ty, row_len, &ids, &mut oc).unwrap();
        let n = ids.len() * row_len;
        assert_close(
            &format!("get_rows {ty}"),
            &get(&g, &og, n),
            &get(&c, &oc, n),
            1e-6,
        );
        let r = g.get_rows(&table.g, ty, row_len, &[7], &mut og);
        assert!(matches!(r, Err(ComputeError::Shape { .. })), "{ty}: {r:?}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn elementwise_ops_match_cpu() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(3);
    for (n_tokens, dim) in [(1usize, 4096usize), (5, 1000)] {
        let n = n_tokens * dim;
        let x = pair(&g, &c, &f32_bytes(&rng.f32s(n, 3.0)));
        let y = pair(&g, &c, &f32_bytes(&rng.f32s(n, 3.0)));
        let w = pair(&g, &c, &f32_bytes(&rng.f32s(dim, 1.0)));
        let (mut og, mut oc) = (g.alloc(n * 4).unwrap(), c.alloc(n * 4).unwrap());

        g.rms_norm(&x.g, &w.g, n_tokens, dim, 1e-5, &mut og)
            .unwrap();
        c.rms_norm(&x.c, &w.c, n_tokens, dim, 1e-5, &mut oc)
            .unwrap();
        assert_close("rms_norm", &get(&g, &og, n), &get(&c, &oc, n), 1e-5);

        g.swiglu(&x.g, &y.g, n, &mut og).unwrap();
        c.swiglu(&x.c, &y.c, n, &mut oc).unwrap();
        assert_close("swiglu", &get(&g, &og, n), &get(&c, &oc, n), 1e-5);

        let mut a = pair(&g, &c, &f32_bytes(&get(&c, &x.c, n)));
        g.add(&mut a.g, &y.g, n).unwrap();
        c.add(&mut a.c, &y.c, n).unwrap();
        assert_close("add", &get(&g, &a.g, n), &get(&c, &a.c, n), 1e-6);

        g.add_bias(&mut a.g, &w.g, n_tokens, dim).unwrap();
        c.add_bias(&mut a.c, &w.c, n_tokens, dim).unwrap();
        assert_close("add_bias", &get(&g, &a.g, n), &get(&c, &a.c, n), 1e-6);

        let mut copy = g.alloc(n * 4).unwrap();
        g.copy(&a.g, &mut copy, n * 4).unwrap();
        assert_eq!(get(&g, &copy, n), get(&c, &a.c, n), "copy");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn rope_matches_cpu_in_both_styles() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(4);
    let (n_tokens, n_heads, head_dim) = (6, 4, 64);
    let n = n_tokens * n_heads * head_dim;
    let positions = [0u32, 1, 7, 100, 4095, 123_456];
    let factors = pair(
        &g,
        &c,
        &f32_bytes(
            &rng.f32s(24, 1.0)
                .iter()
                .map(|v| 1.0 + v.abs() * 4.0)
                .collect::<Vec<_>>(),
        ),
    );
    for neox in [false, true] {
        for (n_rot, use_factors) in [(64, false), (48, true)] {
            let params = RopeParams {
                n_rot,
                freq_base: 500_000.0,
                freq_scale: 0.5,
                neox,
                yarn: None,
            };
            let mut x = pair(&g, &c, &f32_bytes(&rng.f32s(n, 2.0)));
            let (fg, fc) = if use_factors {
                (Some(&factors.g), Some(&factors.c))
            } else {
                (None, None)
            };
            g.rope(
                &mut x.g,
                n_tokens,
                n_heads,
                head_dim,
                &positions,
                Rope::new(&params, fg),
            )
            .unwrap();
            c.rope(
                &mut x.c,
                n_tokens,
                n_heads,
                head_dim,
                &positions,
                Rope::new(&params, fc),
            )
            .unwrap();
            let what = format!("rope neox={neox} n_rot={n_rot}");
            assert_close(&what, &get(&g, &x.g, n), &get(&c, &x.c, n), 1e-5);
        }
    }
}

/// The one-pass rotary embedding and f16 cache write equals the cpu's four ops: rotated
/// queries and keys, and the cache rows of both caches.
#[test]
#[ignore = "needs a CUDA GPU"]
fn rope_and_store_matches_cpu() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(13);
    let shape = AttnShape {
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 64,
        ring_cells: 0,
    };
    let (qd, kvd, cells_in_cache) = (8 * 64, 2 * 64, 64usize);
    for neox in [false, true] {
        let params = RopeParams {
            n_rot: 64,
            freq_base: 500000.0,
            freq_scale: 1.0,
            neox,
            yarn: None,
        };
        // 40 tokens: a decode step of 40 sequences, still one launch.
        let many = ((100u32..140).collect(), (0u32..40).rev().collect());
        let cases = [
            (vec![5u32], vec![7u32]),
            (vec![9, 10, 11], vec![2, 3, 15]),
            many,
        ];
        for (positions, cells) in cases {
            let n = positions.len();
            let mut q = pair(&g, &c, &f32_bytes(&rng.f32s(n * qd, 1.0)));
            let mut k = pair(&g, &c, &f32_bytes(&rng.f32s(n * kvd, 1.0)));
            let v = pair(&g, &c, &f32_bytes(&rng.f32s(n * kvd, 1.0)));
            let zeros = vec![0u8; cells_in_cache * kvd * 2];
            let (mut kc, mut vc) = (pair(&g, &c, &zeros), pair(&g, &c, &zeros));
            let f16 = GgmlType::F16;
            g.rope_and_store(
                Qkv::new(&mut q.g, &mut k.g, &v.g),
                shape,
                &positions,
                Rope::new(&params, None),
                &cells,
                KvCacheMut::new(&mut kc.g, &mut vc.g, f16),
            )
            .unwrap();
            c.rope_and_store(
                Qkv::new(&mut q.c, &mut k.c, &v.c),
                shape,
                &positions,
                Rope::new(&params, None),
                &cells,
                KvCacheMut::new(&mut kc.c, &mut vc.c, f16),
            )
            .unwrap();
            let what = format!("rope_and_store neox={neox} n={n}");
            assert_close(&what, &get(&g, &q.g, n * qd), &get(&c, &q.c, n * qd), 1e-5);
            assert_close(
                &what,
                &get(&g, &k.g, n * kvd),
                &get(&c, &k.c, n * kvd),
                1e-5,
            );
            for (cg, cc) in [(&kc.g, &kc.c), (&vc.g, &vc.c)] {
                let mut bg = vec![0u8; zeros.len()];
                let mut bc = vec![0u8; zeros.len()];
                g.download(cg, 0, &mut bg).unwrap();
                c.download(cc, 0, &mut bc).unwrap();
                let halves = |b: &[u8]| -> Vec<f32> {
                    b.chunks_exact(2)
                        .map(|h| half::f16::from_le_bytes([h[0], h[1]]).to_f32())
                        .collect()
                };
                let (hg, hc) = (halves(&bg), halves(&bc));
                assert!(hc.iter().any(|&x| x != 0.0), "{what}: nothing stored");
                assert_close(&format!("{what}: cache rows"), &hg, &hc, 1e-3);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn argmax_rows_picks_what_greedy_picks() {
    use tether_compute::argmax::greedy;
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(11);
    let n = 128_256;
    let mut rows: Vec<Vec<f32>> = Vec::new();
    // Random, then ties at the maximum (the lowest id wins), NaN everywhere but one value,
    // every value NaN (id 0), +0 against -0 (+0 wins), +inf late, only -inf, and a maximum
    // in the last, partial stride of the block.
    rows.push(rng.f32s(n, 8.0));
    let mut ties = rng.f32s(n, 1.0);
    for at in [90_001, 7_777, 100_000] {
        ties[at] = 5.0;
    }
    rows.push(ties);
    let mut nan = vec![f32::NAN; n];
    nan[4_242] = -3.0;
    rows.push(nan);
    rows.push(vec![f32::NAN; n]);
    let mut zeros = vec![-1.0; n];
    zeros[10] = -0.0;
    zeros[20] = 0.0;
    zeros[30] = -0.0;
    rows.push(zeros);
    let mut inf = rng.f32s(n, 1e30);
    inf[n - 2] = f32::INFINITY;
    inf[3] = f32::NAN;
    rows.push(inf);
    rows.push(vec![f32::NEG_INFINITY; n]);
    let mut last = vec![0.5; n];
    last[n - 1] = 0.75;
    rows.push(last);
    let flat: Vec<f32> = rows.concat();
    let want: Vec<u32> = rows.iter().map(|r| greedy(r)).collect();
    assert_eq!(want[1], 7_777, "the reference breaks ties to the lowest id");
    assert_eq!(want[4], 20, "the reference puts +0 above -0");
    let x = pair(&g, &c, &f32_bytes(&flat));
    let (mut sg, mut sc) = (g.alloc(rows.len() * 4).unwrap(), c.alloc(4).unwrap());
    let mut got = vec![u32::MAX; rows.len()];
    g.argmax_rows(&x.g, n, &mut sg, &mut got).unwrap();
    assert_eq!(got, want, "cuda");
    let mut got = vec![u32::MAX; rows.len()];
    c.argmax_rows(&x.c, n, &mut sc, &mut got).unwrap();
    assert_eq!(got, want, "cpu");
    // Sizes are checked before anything runs.
    let mut small = g.alloc(4).unwrap();
    assert!(
        g.argmax_rows(&x.g, n, &mut small, &mut got).is_err(),
        "scratch too small"
    );
    let mut too_many = vec![0; rows.len() + 1];
    assert!(
        g.argmax_rows(&x.g, n, &mut sg, &mut too_many).is_err(),
        "rows past the input"
    );
}
