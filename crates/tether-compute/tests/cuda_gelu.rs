//! Gemma's ops on the GPU against the cpu backend: the GELU-gated products (the fused
//! gate/up kernels of every family with the GELU epilogue, and the unfused path for
//! prefill-sized batches), the element-wise GELU gate, the embedding scale and soft-capping.
//!
//! Ignored by default (CI has no GPU); run with
//! `cargo test -p tether-compute --test cuda_gelu -- --ignored --test-threads=1`. Without a
//! GPU they fail (the backend cannot be created), they do not skip.

use tether_compute::{Backend, ComputeError, GateAct};
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
            let (xg, xc) = (put(&g, &f32_bytes(&x)), put(&c, &f32_bytes(&x)));
            for rows in [256usize, 72] {
                let gate = finished(&g, &c, ty, &random_weights(&mut rng, ty, rows * cols), cols);
                let up = finished(&g, &c, ty, &random_weights(&mut rng, ty, rows * cols), cols);
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
                    &gate.g,
                    &up.g,
                    ty,
                    rows,
                    cols,
                    &xg,
                    n,
                    &mut sg,
                    &mut g1,
                    &mut g2,
                )
                .unwrap();
                c.matmul_gated(
                    GateAct::GeluTanh,
                    &gate.c,
                    &up.c,
                    ty,
                    rows,
                    cols,
                    &xc,
                    n,
                    &mut sc,
                    &mut c1,
                    &mut c2,
                )
                .unwrap();
                let what = format!("matmul_gated GELU {ty} {rows} rows n={n}");
                let e = relative_error(&what, &get(&g, &sg, n * rows), &get(&c, &sc, n * rows));
                assert!(e < 2e-2, "{what}: relative error {e}");
                // SiLU and GELU differ: the GELU kernels must not run the SiLU epilogue.
                c.matmul_swiglu(
                    &gate.c,
                    &up.c,
                    ty,
                    rows,
                    cols,
                    &xc,
                    n,
                    &mut c1,
                    &mut zeros(&c, n * rows),
                    &mut zeros(&c, n * rows),
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
                g.matmul(&down.g, ty, down_rows, rows, &sg, n, &mut dg)
                    .unwrap();
                c.matmul(&down.c, ty, down_rows, rows, &sc, n, &mut dc)
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
