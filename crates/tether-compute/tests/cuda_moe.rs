//! Mixture-of-experts ops on the GPU against the cpu's: routing (ids equal, weights within
//! 1e-5) and the expert feed-forward over stacked weights of several types, packed ones
//! among them, for decode and prefill token counts.
//!
//! GPU tests, ignored by default: `cargo test -p tether-compute --test cuda_moe --
//! --ignored`. Without a GPU they fail.

use tether_compute::Backend;
use tether_compute::moe::{ExpertMatrix, MoeFfn, MoeRouting, MoeScratch};
use tether_gguf::GgmlType;

mod common;
use common::fused::{finished, relative_error, zeros};
use common::{Rng, cpu, f32_bytes, get, gpu, put, random_weights};

fn ids_of<B: Backend>(be: &B, buf: &B::Buffer, n: usize) -> Vec<u32> {
    get(be, buf, n).into_iter().map(f32::to_bits).collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn routing_picks_the_cpus_experts() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(71);
    for (n_expert, n_used, norm) in [
        (8, 2, true),
        (128, 8, true),
        (128, 8, false),
        (1024, 32, true),
    ] {
        let routing = MoeRouting {
            n_expert,
            n_used,
            norm_weights: norm,
        };
        for n in [1usize, 7, 64] {
            let logits = f32_bytes(&rng.f32s(n * n_expert, 4.0));
            let (lg, lc) = (put(&g, &logits), put(&c, &logits));
            let (mut ig, mut wg) = (zeros(&g, n * n_used), zeros(&g, n * n_used));
            let (mut ic, mut wc) = (zeros(&c, n * n_used), zeros(&c, n * n_used));
            g.moe_route(&lg, n, routing, &mut ig, &mut wg).unwrap();
            c.moe_route(&lc, n, routing, &mut ic, &mut wc).unwrap();
            let what = format!("{n_used} of {n_expert}, {n} tokens");
            assert_eq!(
                ids_of(&g, &ig, n * n_used),
                ids_of(&c, &ic, n * n_used),
                "{what}"
            );
            let (a, b) = (get(&g, &wg, n * n_used), get(&c, &wc, n * n_used));
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() < 1e-5, "{what}: weight {x} vs {y}");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn expert_products_give_the_cpus_results() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(73);
    // 2048-wide rows of q4_0, q8_0 and q6_k are whole packed groups: the GPU packs them.
    let (e, ff, n_expert, n_used) = (2048usize, 256usize, 8usize, 2usize);
    let routing = MoeRouting {
        n_expert,
        n_used,
        norm_weights: true,
    };
    for ty in [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        GgmlType::Q5_0,
        GgmlType::Q4K,
        GgmlType::Q6K,
    ] {
        let gate = finished(
            &g,
            &c,
            ty,
            &random_weights(&mut rng, ty, n_expert * ff * e),
            e,
        );
        let up = finished(
            &g,
            &c,
            ty,
            &random_weights(&mut rng, ty, n_expert * ff * e),
            e,
        );
        let down = finished(
            &g,
            &c,
            ty,
            &random_weights(&mut rng, ty, n_expert * e * ff),
            ff,
        );
        for n in [1usize, 3, 8, 40] {
            let x = f32_bytes(&rng.f32s(n * e, 1.0));
            let logits = f32_bytes(&rng.f32s(n * n_expert, 3.0));
            let acc0 = f32_bytes(&rng.f32s(n * e, 1.0));
            let mut results = Vec::new();
            macro_rules! run_on {
                ($be:expr, $w:ident) => {{
                    let be = $be;
                    let (xb, lb) = (put(be, &x), put(be, &logits));
                    let mut acc = put(be, &acc0);
                    let (mut ids, mut wts) = (zeros(be, n * n_used), zeros(be, n * n_used));
                    be.moe_route(&lb, n, routing, &mut ids, &mut wts).unwrap();
                    let (mut rows, mut gs, mut us) = (
                        zeros(be, n * n_used * e),
                        zeros(be, n * n_used * ff),
                        zeros(be, n * n_used * ff),
                    );
                    let ffn = MoeFfn {
                        gate: ExpertMatrix { buf: &gate.$w, ty },
                        up: ExpertMatrix { buf: &up.$w, ty },
                        down: ExpertMatrix { buf: &down.$w, ty },
                        n_embd: e,
                        n_ff: ff,
                        routing,
                        n_tokens: n,
                        x: &xb,
                        ids: &ids,
                        weights: &wts,
                    };
                    let scratch = MoeScratch {
                        rows: &mut rows,
                        gate: &mut gs,
                        up: &mut us,
                    };
                    be.moe_ffn(ffn, &mut acc, scratch).unwrap();
                    results.push(get(be, &acc, n * e));
                }};
            }
            run_on!(&g, g);
            run_on!(&c, c);
            let before: Vec<f32> = acc0
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            // Compare what each added, not the sums with the random start.
            let added = |r: &[f32]| {
                r.iter()
                    .zip(&before)
                    .map(|(a, b)| a - b)
                    .collect::<Vec<_>>()
            };
            let err = relative_error(
                &format!("{ty} {n} tokens"),
                &added(&results[0]),
                &added(&results[1]),
            );
            // The cpu quantizes activations to 8 bits for quantized weights; the GPU's
            // expert products read f32 activations.
            let tol = if ty.is_quantized() { 3e-2 } else { 1e-4 };
            assert!(err < tol, "{ty} {n} tokens: {err:e} >= {tol:e}");
        }
    }
}
