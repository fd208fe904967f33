//! The CUDA backend's top candidates of logits rows against the host's
//! [`top_candidates`], bit for bit, on rows built to reach every path of the kernel, and its
//! log-sum-exp of rows against the cpu backend's f64 sums.
//!
//! Every test needs a GPU and is ignored by default; run them with
//! `cargo test -p tether-compute --test cuda_select -- --ignored --test-threads=1`.
//! Without a GPU they fail (the backend cannot be created), they do not skip.

use tether_compute::argmax::top_candidates;
use tether_compute::{Backend, CudaBackend, top_rows_scratch};

mod common;
use common::{Rng, cpu, f32_bytes, gpu, put};

/// Llama 3's vocabulary.
const VOCAB: usize = 128_256;

/// Rows of `n` values: random; ties straddling the k-th value (ranked in shared memory);
/// eight distinct values (far more ties than the kernel gathers, ranked tile by tile); NaN
/// everywhere but a few; all NaN; +-0 and +-inf; only -inf; logits crowded in one digit.
fn awkward_rows(rng: &mut Rng, n: usize) -> Vec<Vec<f32>> {
    let mut rows = vec![rng.f32s(n, 8.0)];
    let mut straddle = rng.f32s(n, 1.0);
    for i in 0..300 {
        straddle[(i * 409 + 17) % n] = 3.0;
    }
    rows.push(straddle);
    rows.push((0..n).map(|_| (rng.next_u64() % 8) as f32 * 0.5).collect());
    let mut nan = vec![f32::NAN; n];
    for at in [3, n / 2, n - 1] {
        nan[at.min(n - 1)] = -(at as f32);
    }
    rows.push(nan);
    rows.push(vec![f32::NAN; n]);
    let mut signs = rng.f32s(n, 1.0);
    for (i, v) in signs.iter_mut().enumerate().step_by(7) {
        *v = [0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY][i % 4];
    }
    rows.push(signs);
    rows.push(vec![f32::NEG_INFINITY; n]);
    rows.push((0..n).map(|_| 12.0 + rng.unit() as f32 * 1e-3).collect());
    rows
}

fn check(g: &CudaBackend, rows: &[Vec<f32>], n: usize, k: usize) {
    let want: Vec<Vec<(u32, f32)>> = rows
        .iter()
        .map(|r| {
            let mut out = Vec::new();
            top_candidates(r, k, &mut out);
            out
        })
        .collect();
    let x = put(g, &f32_bytes(&rows.concat()));
    let need = top_rows_scratch(rows.len(), k).unwrap();
    let mut scratch = g.alloc(need).unwrap();
    let mut got = vec![vec![(u32::MAX, 0.0f32)]; rows.len()];
    g.top_rows(&x, n, k, &mut scratch, &mut got).unwrap();
    let bits = |v: &[(u32, f32)]| v.iter().map(|c| (c.0, c.1.to_bits())).collect::<Vec<_>>();
    for (r, (got, want)) in got.iter().zip(&want).enumerate() {
        assert_eq!(bits(got), bits(want), "row {r} of {n} values, k {k}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn top_rows_equal_the_host_candidates_on_a_vocabulary() {
    let g = gpu();
    let rows = awkward_rows(&mut Rng(21), VOCAB);
    for k in [1, 2, 40, 104, 1024] {
        check(&g, &rows, VOCAB, k);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn top_rows_of_short_rows_take_every_value_that_is_not_nan() {
    let g = gpu();
    for n in [1, 5, 40, 1000, 1025] {
        let rows = awkward_rows(&mut Rng(n as u64), n);
        for k in [1, 40, 1024] {
            check(&g, &rows, n, k);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn top_rows_check_sizes_before_running() {
    let (g, c) = (gpu(), cpu());
    let x = put(&g, &f32_bytes(&vec![1.0; 2 * 64]));
    let mut small = g.alloc(top_rows_scratch(2, 8).unwrap() - 4).unwrap();
    let mut out = vec![Vec::new(); 2];
    assert!(
        g.top_rows(&x, 64, 8, &mut small, &mut out).is_err(),
        "scratch too small"
    );
    let mut scratch = g.alloc(top_rows_scratch(3, 8).unwrap()).unwrap();
    let mut three = vec![Vec::new(); 3];
    assert!(
        g.top_rows(&x, 64, 8, &mut scratch, &mut three).is_err(),
        "rows past the input"
    );
    // The cpu backend refuses the same.
    let xc = put(&c, &f32_bytes(&vec![1.0; 2 * 64]));
    let mut sc = c.alloc(4).unwrap();
    assert!(
        c.top_rows(&xc, 64, 8, &mut sc, &mut three).is_err(),
        "cpu: rows past the input"
    );
}

/// The device's log-sum-exp and target logits against the host's f64 sums: random rows of a
/// vocabulary and of odd short lengths (tails of a block's stride), with NaN, +-inf, rows
/// of one repeated value and large offsets (where a sum without the maximum would overflow).
#[test]
#[ignore = "needs a CUDA GPU"]
fn score_rows_equal_the_host_log_sum_exp() {
    let (g, c) = (gpu(), cpu());
    for n in [1, 3, 33, 1000, 1025, VOCAB] {
        let mut rng = Rng(n as u64 + 7);
        let mut rows = awkward_rows(&mut rng, n);
        rows.push(rng.f32s(n, 8.0).iter().map(|v| v + 80.0).collect());
        rows.push(vec![-3.5; n]);
        let targets: Vec<u32> = (0..rows.len())
            .map(|r| ((r * 7919 + 3) % n) as u32)
            .collect();
        let bytes = f32_bytes(&rows.concat());
        let (xg, xc) = (put(&g, &bytes), put(&c, &bytes));
        let need = tether_compute::score_rows_scratch(rows.len()).unwrap();
        let mut sg = g.alloc(need).unwrap();
        let mut sc = c.alloc(need).unwrap();
        for t in [&targets[..], &[]] {
            let mut got = vec![(0.0f32, 0.0f32); rows.len()];
            let mut want = got.clone();
            g.score_rows(&xg, n, t, &mut sg, &mut got).unwrap();
            c.score_rows(&xc, n, t, &mut sc, &mut want).unwrap();
            for (r, (got, want)) in got.iter().zip(&want).enumerate() {
                let (gl, wl) = (got.0, want.0);
                let close = if wl.is_finite() {
                    (gl - wl).abs() <= 1e-4 * wl.abs().max(1.0)
                } else {
                    gl.to_bits() == wl.to_bits()
                };
                assert!(close, "row {r} of {n}: log-sum-exp {gl} against {wl}");
                assert_eq!(
                    got.1.to_bits(),
                    want.1.to_bits(),
                    "row {r} of {n}: the target's logit"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn score_rows_refuse_targets_outside_the_row() {
    let g = gpu();
    let x = put(&g, &f32_bytes(&vec![1.0; 2 * 64]));
    let mut scratch = g
        .alloc(tether_compute::score_rows_scratch(2).unwrap())
        .unwrap();
    let mut out = vec![(0.0, 0.0); 2];
    assert!(
        g.score_rows(&x, 64, &[1, 64], &mut scratch, &mut out)
            .is_err()
    );
    assert!(g.score_rows(&x, 64, &[1], &mut scratch, &mut out).is_err());
    let mut small = g.alloc(8).unwrap();
    assert!(g.score_rows(&x, 64, &[], &mut small, &mut out).is_err());
    g.score_rows(&x, 64, &[0, 63], &mut scratch, &mut out)
        .unwrap();
    let lse = 1.0 + (64f32).ln();
    assert!((out[0].0 - lse).abs() < 1e-5 && out[1].1 == 1.0, "{out:?}");
}
