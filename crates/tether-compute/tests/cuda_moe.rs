//! Mixture-of-experts ops on the GPU against the cpu's: routing (ids equal, weights within
//! 1e-5) and the expert feed-forward over stacked weights of every type, packed ones among
//! them, mixes of types, odd widths, decode and prefill token counts, and loads where one
//! expert takes every token or half the experts get none.
//!
//! GPU tests, ignored by default: `cargo test -p tether-compute --test cuda_moe --
//! --ignored`. Without a GPU they fail.

use tether_compute::Backend;
use tether_compute::moe::{ExpertMatrix, MoeFfn, MoeRouting, MoeScratch};
use tether_gguf::GgmlType;

mod common;
use common::fused::{finished, relative_error, zeros};
use common::{Rng, WEIGHT_TYPES, cpu, f32_bytes, get, gpu, put, random_weights};

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

/// Expert shapes: widths and expert counts.
#[derive(Clone, Copy, Debug)]
struct Experts {
    e: usize,
    ff: usize,
    n_expert: usize,
    n_used: usize,
}

/// How the router's scores are made, so that every expert load is seen.
#[derive(Clone, Copy, Debug)]
enum Load {
    /// Random scores.
    Random,
    /// The last expert far ahead for every token: it takes them all.
    OneTakesAll,
    /// The upper half far behind: those experts get no token.
    HalfIdle,
}

fn router_logits(rng: &mut Rng, n: usize, n_expert: usize, load: Load) -> Vec<f32> {
    let mut logits = rng.f32s(n * n_expert, 3.0);
    for row in logits.chunks_mut(n_expert) {
        match load {
            Load::Random => {}
            Load::OneTakesAll => row[n_expert - 1] += 20.0,
            Load::HalfIdle => row[n_expert / 2..].iter_mut().for_each(|v| *v -= 20.0),
        }
    }
    logits
}

/// Token counts: decode (one item a pick) up to 8, grouped prefill beyond: the 8-bit item
/// kernels below 16 tokens, the tile kernels from 16 (items of 32 picks at 17 and 33
/// tokens, of 64 from 80, where the experts average 16 picks), with items ending inside
/// (12, 17, 33, 80, 200) and on (512) their rows.
const TOKENS: [usize; 10] = [1, 2, 5, 8, 12, 17, 33, 80, 200, 512];

/// `moe_ffn` on both backends for gate, up and down of `types` over every token count
/// (each with one of the loads in turn), within `tol` of the cpu.
fn check_experts(rng: &mut Rng, x: Experts, types: [GgmlType; 3], tokens: &[usize], tol: f64) {
    let (g, c) = (gpu(), cpu());
    let Experts {
        e,
        ff,
        n_expert,
        n_used,
    } = x;
    let routing = MoeRouting {
        n_expert,
        n_used,
        norm_weights: true,
    };
    let [tg, tu, td] = types;
    let gate = finished(&g, &c, tg, &random_weights(rng, tg, n_expert * ff * e), e);
    let up = finished(&g, &c, tu, &random_weights(rng, tu, n_expert * ff * e), e);
    let down = finished(&g, &c, td, &random_weights(rng, td, n_expert * e * ff), ff);
    let loads = [Load::Random, Load::OneTakesAll, Load::HalfIdle];
    for (i, &n) in tokens.iter().enumerate() {
        let load = loads[i % loads.len()];
        let xs = f32_bytes(&rng.f32s(n * e, 1.0));
        let logits = f32_bytes(&router_logits(rng, n, n_expert, load));
        let acc0 = f32_bytes(&rng.f32s(n * e, 1.0));
        let mut results = Vec::new();
        macro_rules! run_on {
            ($be:expr, $w:ident) => {{
                let be = $be;
                let (xb, lb) = (put(be, &xs), put(be, &logits));
                let mut acc = put(be, &acc0);
                let (mut ids, mut wts) = (zeros(be, n * n_used), zeros(be, n * n_used));
                be.moe_route(&lb, n, routing, &mut ids, &mut wts).unwrap();
                let (mut rows, mut gs, mut us) = (
                    zeros(be, n * n_used * e),
                    zeros(be, n * n_used * ff),
                    zeros(be, n * n_used * ff),
                );
                let ffn = MoeFfn {
                    gate: ExpertMatrix {
                        buf: &gate.$w,
                        ty: tg,
                    },
                    up: ExpertMatrix {
                        buf: &up.$w,
                        ty: tu,
                    },
                    down: ExpertMatrix {
                        buf: &down.$w,
                        ty: td,
                    },
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
                results.push((get(be, &acc, n * e), ids_of(be, &ids, n * n_used)));
            }};
        }
        run_on!(&g, g);
        run_on!(&c, c);
        let what = format!("{types:?} {x:?} {n} tokens {load:?}");
        assert_eq!(results[0].1, results[1].1, "{what}: expert ids");
        if let Load::OneTakesAll = load {
            let all = results[1]
                .1
                .chunks(n_used)
                .all(|p| p[0] as usize == n_expert - 1);
            assert!(all, "{what}: the last expert takes every token");
        }
        if let Load::HalfIdle = load {
            assert!(results[1].1.iter().all(|&id| (id as usize) < n_expert / 2));
        }
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
        let err = relative_error(&what, &added(&results[0].0), &added(&results[1].0));
        assert!(err < tol, "{what}: {err:e} >= {tol:e}");
    }
}

/// Both backends take 8-bit activations for quantized weights (the cpu always, the GPU on
/// its integer paths), so they differ by rounding only, as the dense 8-bit tests allow;
/// float weights meet f32 activations on both.
fn tolerance(types: [GgmlType; 3]) -> f64 {
    if types.iter().any(|t| t.is_quantized()) {
        3e-2
    } else {
        1e-4
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn expert_products_give_the_cpus_results() {
    let mut rng = Rng(73);
    // 2048-wide rows of every 8-bit-path type are whole packed groups: the GPU packs
    // Q4_0, Q8_0, Q6_K, Q3_K and IQ4_XS experts and runs every product on its integer
    // kernels; the other types take the f32 kernels.
    let x = Experts {
        e: 2048,
        ff: 2048,
        n_expert: 8,
        n_used: 2,
    };
    for ty in WEIGHT_TYPES {
        let types = [ty; 3];
        check_experts(&mut rng, x, types, &TOKENS, tolerance(types));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn expert_products_of_odd_widths_give_the_cpus_results() {
    let mut rng = Rng(79);
    // 1280 = 5 blocks of 256 (a second round of chunks ends early) and 768 = 3; Q6_K,
    // Q3_K and IQ4_XS rows this wide do not pack: Q6_K takes the 8-bit kernels in GGUF's
    // layout, Q3_K and IQ4_XS the f32 kernels.
    let x = Experts {
        e: 1280,
        ff: 768,
        n_expert: 8,
        n_used: 3,
    };
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q3K,
        GgmlType::IQ4XS,
        GgmlType::F16,
    ] {
        let types = [ty; 3];
        check_experts(&mut rng, x, types, &TOKENS, tolerance(types));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn qwen3_moe_shaped_experts_and_mixes_give_the_cpus_results() {
    let mut rng = Rng(83);
    // qwen3-30b-a3b's widths, fewer experts; llama.cpp's mixes put Q6_K in some
    // ffn_down_exps (768 wide: not packed, read in GGUF's layout).
    let x = Experts {
        e: 2048,
        ff: 768,
        n_expert: 32,
        n_used: 8,
    };
    use GgmlType::{IQ4XS, Q4_0, Q4K, Q5K, Q6K, Q8_0};
    for types in [
        [Q4K, Q4K, Q4K],
        [Q4K, Q4K, Q6K],
        [Q5K, Q5K, Q6K],
        [Q6K, Q6K, Q6K],
        [IQ4XS, IQ4XS, Q4K],
        [Q4_0, Q4_0, Q8_0],
        [Q8_0, Q8_0, Q8_0],
        [Q4K, Q5K, Q4K],
    ] {
        check_experts(&mut rng, x, types, &TOKENS, tolerance(types));
    }
}
