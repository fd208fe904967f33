//! The ops Gemma and YaRN added, on the GPU against the cpu backend: the GELU-gated
//! products (the fused gate/up kernels of every family with the GELU epilogue, and the
//! unfused path for prefill-sized batches), the element-wise GELU gate, the embedding scale,
//! soft-capping, and YaRN rope in the plain and the fused rope-and-store kernels.
//!
//! Ignored by default (CI has no GPU); run with
//! `cargo test -p tether-compute --test cuda_arch_ops -- --ignored --test-threads=1`. Without a
//! GPU they fail (the backend cannot be created), they do not skip.

use tether_compute::rope::YarnParams;
use tether_compute::{AttnShape, AttnSpan, Backend, ComputeError, GateAct, RopeParams};
use tether_compute::{KvCache, KvCacheMut, Qkv, Rope, Scores, Weight};
use tether_gguf::GgmlType;

mod common;
use common::fused::{finished, relative_error, zeros};
use common::{Rng, cpu, f32_bytes, get, gpu, put, random_weights};

#[test]
#[ignore = "needs a CUDA GPU"]
fn geglu_scale_and_softcap_match_cpu() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(31);
    let n = 70_001;
    let gate = rng.f32s(n, 6.0);
    let up = rng.f32s(n, 2.0);
    let (gg, gu) = (put(&g, &f32_bytes(&gate)), put(&g, &f32_bytes(&up)));
    let (cg, cu) = (put(&c, &f32_bytes(&gate)), put(&c, &f32_bytes(&up)));
    let (mut og, mut oc) = (zeros(&g, n), zeros(&c, n));
    g.geglu(&gg, &gu, n, &mut og).unwrap();
    c.geglu(&cg, &cu, n, &mut oc).unwrap();
    let e = relative_error("geglu", &get(&g, &og, n), &get(&c, &oc, n));
    assert!(e < 1e-6, "geglu: {e}");

    let (mut xg, mut xc) = (put(&g, &f32_bytes(&gate)), put(&c, &f32_bytes(&gate)));
    g.scale(&mut xg, n, 61.97).unwrap();
    c.scale(&mut xc, n, 61.97).unwrap();
    assert_eq!(get(&g, &xg, n), get(&c, &xc, n), "scale");

    g.softcap(&mut xg, n, 30.0).unwrap();
    c.softcap(&mut xc, n, 30.0).unwrap();
    let e = relative_error("softcap", &get(&g, &xg, n), &get(&c, &xc, n));
    assert!(e < 1e-6, "softcap: {e}");
    assert!(get(&g, &xg, n).iter().all(|v| v.abs() <= 30.0));
    for bad in [0.0, -1.0, f32::NAN] {
        let err = g.softcap(&mut xg, n, bad).unwrap_err();
        assert!(matches!(err, ComputeError::Shape { .. }), "{bad}: {err}");
    }
}

/// `matmul_gated` with GELU of finished (packed where the backend packs) weights of each type that
/// has fused gate/up kernels, at decode sizes (one fused launch) and a prefill size (two
/// products and the element-wise gate), then the down projection over its output: the
/// packed kernels also write the 8-bit copy of the gated values the down product reads.
#[test]
#[ignore = "needs a CUDA GPU"]
fn matmul_gated_gelu_matches_cpu_for_every_fused_family() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(32);
    let cols = 1024;
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::F16,
    ] {
        for n in [1usize, 2, 3, 8, 20] {
            let x = rng.f32s(n * cols, 1.0);
            for rows in [256usize, 72] {
                let gate = finished(&g, &c, ty, &random_weights(&mut rng, ty, rows * cols), cols);
                let up = finished(&g, &c, ty, &random_weights(&mut rng, ty, rows * cols), cols);
                // Random weights make pre-activations of tens, where SiLU and GELU are both
                // ReLU: scale x so the gate's are about 1, where the two differ.
                let mut pre = zeros(&c, n * rows);
                let xc = put(&c, &f32_bytes(&x));
                c.matmul(Weight::new(&gate.c, ty, rows, cols), &xc, n, &mut pre)
                    .unwrap();
                let pre = get(&c, &pre, n * rows);
                let rms = (pre.iter().map(|v| v * v).sum::<f32>() / pre.len() as f32).sqrt();
                let x: Vec<f32> = x.iter().map(|v| v / rms.max(1e-6)).collect();
                let (xg, xc) = (put(&g, &f32_bytes(&x)), put(&c, &f32_bytes(&x)));
                let (mut sg, mut g1, mut g2) = (
                    zeros(&g, n * rows),
                    zeros(&g, n * rows),
                    zeros(&g, n * rows),
                );
                let (mut sc, mut c1, mut c2) = (
                    zeros(&c, n * rows),
                    zeros(&c, n * rows),
                    zeros(&c, n * rows),
                );
                g.matmul_gated(
                    GateAct::GeluTanh,
                    [
                        Weight::new(&gate.g, ty, rows, cols),
                        Weight::new(&up.g, ty, rows, cols),
                    ],
                    &xg,
                    n,
                    &mut sg,
                    [&mut g1, &mut g2],
                )
                .unwrap();
                c.matmul_gated(
                    GateAct::GeluTanh,
                    [
                        Weight::new(&gate.c, ty, rows, cols),
                        Weight::new(&up.c, ty, rows, cols),
                    ],
                    &xc,
                    n,
                    &mut sc,
                    [&mut c1, &mut c2],
                )
                .unwrap();
                let what = format!("matmul_gated GELU {ty} {rows} rows n={n}");
                let e = relative_error(&what, &get(&g, &sg, n * rows), &get(&c, &sc, n * rows));
                assert!(e < 2e-2, "{what}: relative error {e}");
                // SiLU and GELU differ: the GELU kernels must not run the SiLU epilogue.
                c.matmul_swiglu(
                    [
                        Weight::new(&gate.c, ty, rows, cols),
                        Weight::new(&up.c, ty, rows, cols),
                    ],
                    &xc,
                    n,
                    &mut c1,
                    [&mut zeros(&c, n * rows), &mut zeros(&c, n * rows)],
                )
                .unwrap();
                let silu = relative_error(&what, &get(&g, &sg, n * rows), &get(&c, &c1, n * rows));
                assert!(
                    silu > 5e-2,
                    "{what}: as close to SiLU's output ({silu}) as to GELU's"
                );
                if rows != 256 {
                    continue;
                }
                let down_rows = 48;
                let bytes = random_weights(&mut rng, ty, down_rows * rows);
                let down = finished(&g, &c, ty, &bytes, rows);
                let (mut dg, mut dc) = (zeros(&g, n * down_rows), zeros(&c, n * down_rows));
                g.matmul(Weight::new(&down.g, ty, down_rows, rows), &sg, n, &mut dg)
                    .unwrap();
                c.matmul(Weight::new(&down.c, ty, down_rows, rows), &sc, n, &mut dc)
                    .unwrap();
                let what = format!("down after matmul_gated GELU {ty} n={n}");
                let e = relative_error(
                    &what,
                    &get(&g, &dg, n * down_rows),
                    &get(&c, &dc, n * down_rows),
                );
                assert!(e < 5e-2, "{what}: relative error {e}");
            }
        }
    }
}

/// YaRN rope (Qwen3's factor 4 over 32768 positions, heads of 128) on the GPU: the plain
/// kernel at prefill size and the fused rope-and-store kernel at decode size, whose keys and
/// values land in the f16 cache, against the cpu.
#[test]
#[ignore = "needs a CUDA GPU"]
fn yarn_rope_and_the_fused_store_match_cpu() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(33);
    let params = RopeParams {
        n_rot: 128,
        freq_base: 1e6,
        freq_scale: 0.25,
        neox: true,
        yarn: Some(YarnParams {
            orig_ctx: 32768,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attn_factor: 1.0,
        }),
    };
    let shape = AttnShape {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 128,
        ring_cells: 0,
    };
    for positions in [
        vec![0u32, 1, 5000, 131_000, 7, 9, 11, 13, 20, 21],
        vec![3, 70_000, 4],
    ] {
        let n = positions.len();
        let (qd, kvd) = (n * shape.n_heads * 128, n * shape.n_kv_heads * 128);
        let (q, k, v) = (rng.f32s(qd, 1.0), rng.f32s(kvd, 1.0), rng.f32s(kvd, 1.0));
        let (mut qg, mut qc) = (put(&g, &f32_bytes(&q)), put(&c, &f32_bytes(&q)));
        let (mut kg, mut kc) = (put(&g, &f32_bytes(&k)), put(&c, &f32_bytes(&k)));
        let (vg, vc) = (put(&g, &f32_bytes(&v)), put(&c, &f32_bytes(&v)));
        let cells: Vec<u32> = (0..n as u32).map(|i| 2 * i + 1).collect();
        let cache_bytes = (2 * n + 2) * shape.n_kv_heads * 128 * 2;
        let (mut kcg, mut vcg) = (g.alloc(cache_bytes).unwrap(), g.alloc(cache_bytes).unwrap());
        let (mut kcc, mut vcc) = (c.alloc(cache_bytes).unwrap(), c.alloc(cache_bytes).unwrap());
        g.rope_and_store(
            Qkv::new(&mut qg, &mut kg, &vg),
            shape,
            &positions,
            Rope::new(&params, None),
            &cells,
            KvCacheMut::new(&mut kcg, &mut vcg, GgmlType::F16),
        )
        .unwrap();
        c.rope_and_store(
            Qkv::new(&mut qc, &mut kc, &vc),
            shape,
            &positions,
            Rope::new(&params, None),
            &cells,
            KvCacheMut::new(&mut kcc, &mut vcc, GgmlType::F16),
        )
        .unwrap();
        let what = format!("yarn rope, {n} tokens");
        let e = relative_error(&what, &get(&g, &qg, qd), &get(&c, &qc, qd));
        assert!(e < 1e-5, "{what}: queries {e}");
        let (mut cache_g, mut cache_c) = (vec![0u8; cache_bytes], vec![0u8; cache_bytes]);
        g.download(&kcg, 0, &mut cache_g).unwrap();
        c.download(&kcc, 0, &mut cache_c).unwrap();
        let halves = |b: &[u8]| -> Vec<f32> {
            b.chunks(2)
                .map(|h| half::f16::from_le_bytes([h[0], h[1]]).to_f32())
                .collect()
        };
        let e = relative_error(&what, &halves(&cache_g), &halves(&cache_c));
        assert!(e < 1e-3, "{what}: key cache {e}");
        // YaRN changed something: the plain linear rope gives other queries.
        let linear = RopeParams {
            yarn: None,
            ..params
        };
        let mut ql = put(&c, &f32_bytes(&q));
        c.rope(
            &mut ql,
            n,
            shape.n_heads,
            128,
            &positions,
            Rope::new(&linear, None),
        )
        .unwrap();
        let e = relative_error(&what, &get(&c, &ql, qd), &get(&c, &qc, qd));
        assert!(e > 1e-2, "{what}: YaRN and linear rope agree ({e})");
    }
}

/// Gemma 2's soft-capped attention on the GPU against the cpu: a prefill batch (the flash
/// kernel) and a decode step (the f16 kernel, split over blocks), with a cap small enough
/// to bend the scores; and the cap changes the result.
#[test]
#[ignore = "needs a CUDA GPU"]
fn soft_capped_attention_matches_cpu() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(34);
    for head_dim in [64usize, 128, 256] {
        let shape = AttnShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim,
            ring_cells: 0,
        };
        let kv_dim = 2 * head_dim;
        let n_cells = 300;
        let cells: Vec<u32> = (0..n_cells as u32).collect();
        let (kr, vr) = (
            rng.f32s(n_cells * kv_dim, 2.0),
            rng.f32s(n_cells * kv_dim, 1.0),
        );
        let bytes = n_cells * kv_dim * 2;
        let (mut kg, mut vg) = (g.alloc(bytes).unwrap(), g.alloc(bytes).unwrap());
        let (mut kc, mut vc) = (c.alloc(bytes).unwrap(), c.alloc(bytes).unwrap());
        for (rows, cg, cc) in [(&kr, &mut kg, &mut kc), (&vr, &mut vg, &mut vc)] {
            let (sg, sc) = (put(&g, &f32_bytes(rows)), put(&c, &f32_bytes(rows)));
            g.kv_store(&sg, kv_dim, &cells, cg, GgmlType::F16).unwrap();
            c.kv_store(&sc, kv_dim, &cells, cc, GgmlType::F16).unwrap();
        }
        let prefill: Vec<AttnSpan> = (0..40u32)
            .map(|t| AttnSpan {
                first_cell: 3 + t.saturating_sub(16),
                n_cells: 1 + t.min(16),
            })
            .collect();
        let decode = vec![AttnSpan {
            first_cell: 0,
            n_cells: 290,
        }];
        for spans in [prefill, decode] {
            let n = spans.len() * 4 * head_dim;
            let qv = rng.f32s(n, 2.0);
            let (qg, qc) = (put(&g, &f32_bytes(&qv)), put(&c, &f32_bytes(&qv)));
            let (mut og, mut oc) = (zeros(&g, n), zeros(&c, n));
            let scale = 1.0 / (head_dim as f32).sqrt();
            g.attention_capped(
                &qg,
                KvCache::new(&kg, &vg, GgmlType::F16),
                &spans,
                shape,
                Scores::capped(scale, 1.5),
                &mut og,
            )
            .unwrap();
            c.attention_capped(
                &qc,
                KvCache::new(&kc, &vc, GgmlType::F16),
                &spans,
                shape,
                Scores::capped(scale, 1.5),
                &mut oc,
            )
            .unwrap();
            let what = format!(
                "capped attention, heads of {head_dim}, {} tokens",
                spans.len()
            );
            let e = relative_error(&what, &get(&g, &og, n), &get(&c, &oc, n));
            // The prefill batch takes the flash kernel, which rounds the queries and the
            // probabilities to f16.
            let tol = if spans.len() > 1 { 4e-3 } else { 1e-4 };
            assert!(e < tol, "{what}: {e}");
            let mut plain = zeros(&c, n);
            c.attention(
                &qc,
                KvCache::new(&kc, &vc, GgmlType::F16),
                &spans,
                shape,
                scale,
                &mut plain,
            )
            .unwrap();
            let e = relative_error(&what, &get(&c, &plain, n), &get(&c, &oc, n));
            assert!(e > 1e-2, "{what}: the cap changed nothing ({e})");
        }
    }
}
