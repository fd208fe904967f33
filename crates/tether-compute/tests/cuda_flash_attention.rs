//! Attention on the GPU against the cpu backend where the cuda backend picks its kernels by
//! size: the tensor-core flash kernel for prefill batches (heads of 64, 96, 128 and 256;
//! F16, Q8_0 and Q4_0 caches; grouped-query heads; soft-capped scores; split over blocks
//! after a long context), the per-token kernel for decode batches, and decode split over
//! the cells of a long context.
//!
//! Every test needs a GPU and is ignored by default; run them with
//! `cargo test -p tether-compute --test cuda_flash_attention -- --ignored --test-threads=1`.
//! Setting `TETHER_FLASH_ATTENTION=0` runs the same checks on the kernels it replaced.

use tether_compute::{AttnShape, AttnSpan, Backend, CpuBackend, CudaBackend};
use tether_compute::{KvCache, Scores};
use tether_gguf::GgmlType;

mod common;
use common::fused::{relative_error, zeros};
use common::{Rng, cpu, f32_bytes, get, gpu, put, random_weights};

/// The flash kernel rounds the scaled queries and the probabilities to f16 (the cpu keeps
/// f32), so its outputs differ from the cpu's by about 1e-3 of their size.
const FLASH_TOL: f64 = 4e-3;

/// K and V caches of `n_cells` cells of `ty`, the same random bytes on both backends.
struct Caches {
    ty: GgmlType,
    k: (
        <CudaBackend as Backend>::Buffer,
        <CpuBackend as Backend>::Buffer,
    ),
    v: (
        <CudaBackend as Backend>::Buffer,
        <CpuBackend as Backend>::Buffer,
    ),
}

impl Caches {
    fn new(
        g: &CudaBackend,
        c: &CpuBackend,
        rng: &mut Rng,
        ty: GgmlType,
        kv_dim: usize,
        n_cells: usize,
    ) -> Self {
        let mut both = || {
            let bytes = random_weights(rng, ty, n_cells * kv_dim);
            (put(g, &bytes), put(c, &bytes))
        };
        let k = both();
        let v = both();
        Self { ty, k, v }
    }
}

/// Runs attention (capped when `softcap` > 0) over `spans` on both backends with random
/// queries of amplitude `q_amp`; returns the relative error of the GPU's output.
fn compare(
    (g, c): (&CudaBackend, &CpuBackend),
    rng: &mut Rng,
    caches: &Caches,
    spans: &[AttnSpan],
    shape: AttnShape,
    q_amp: f32,
    softcap: f32,
) -> f64 {
    let n = spans.len() * shape.n_heads * shape.head_dim;
    let qv = rng.f32s(n, q_amp);
    let (qg, qc) = (put(g, &f32_bytes(&qv)), put(c, &f32_bytes(&qv)));
    let (mut og, mut oc) = (zeros(g, n), zeros(c, n));
    let scale = 1.0 / (shape.head_dim as f32).sqrt();
    let ty = caches.ty;
    g.attention_capped(
        &qg,
        KvCache::new(&caches.k.0, &caches.v.0, ty),
        spans,
        shape,
        Scores::capped(scale, softcap),
        &mut og,
    )
    .unwrap();
    c.attention_capped(
        &qc,
        KvCache::new(&caches.k.1, &caches.v.1, ty),
        spans,
        shape,
        Scores::capped(scale, softcap),
        &mut oc,
    )
    .unwrap();
    let what = format!(
        "attention {ty} {shape:?} {} tokens cap {softcap}",
        spans.len()
    );
    let e = relative_error(&what, &get(g, &og, n), &get(c, &oc, n));
    println!("{what}: relative error {e:.2e}");
    e
}

/// `n_tokens` tokens of one prompt whose sequence starts at `first_cell`, the prompt's
/// first token after `past` earlier cells: token t sees `past + t + 1` cells.
fn prompt(first_cell: u32, past: u32, n_tokens: u32) -> Vec<AttnSpan> {
    (0..n_tokens)
        .map(|t| AttnSpan {
            first_cell,
            n_cells: past + t + 1,
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_flash_kernel_runs_for_every_head_size_on_this_gpu() {
    let g = gpu();
    let heads = g.flash_attention_head_dims();
    // Compute capability 8.0 and up runs 64, 96 and 128; 256 needs 165 KiB of shared
    // memory a block (an H100 has 227).
    for d in [64, 96, 128, 256] {
        assert!(
            heads.contains(&d),
            "no flash kernel for heads of {d}: {heads:?}"
        );
    }
}

/// Every head size and grouping, query counts from one token (decode) to 1000 over a cache
/// of ~5000 cells, the prompt's sequence starting mid-cache and ending on odd cells.
#[test]
#[ignore = "needs a CUDA GPU"]
fn prefill_attention_matches_cpu_for_every_head_size_grouping_and_length() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(25);
    let n_cells = 5003u32;
    for head_dim in [64usize, 96, 128, 256] {
        for group in [1usize, 4, 8] {
            // Enough KV heads that 1000 tokens fill the GPU with unsplit blocks; fewer
            // tokens are split over blocks after the long context.
            let n_kv_heads = if group == 1 { 12 } else { 4 };
            let shape = AttnShape {
                n_heads: group * n_kv_heads,
                n_kv_heads,
                head_dim,
                ring_cells: 0,
            };
            let caches = Caches::new(
                &g,
                &c,
                &mut rng,
                GgmlType::F16,
                n_kv_heads * head_dim,
                n_cells as usize,
            );
            for n_tokens in [1u32, 7, 64, 257, 1000] {
                // Past cells leave the last token at cell 4998, or 4999 for odd counts.
                let first = 611;
                let past = n_cells - 5 - first - n_tokens + (n_tokens & 1);
                let spans = prompt(first, past, n_tokens);
                let e = compare((&g, &c), &mut rng, &caches, &spans, shape, 4.0, 0.0);
                assert!(
                    e < FLASH_TOL,
                    "heads of {head_dim}, group {group}, {n_tokens} tokens: {e}"
                );
            }
        }
    }
}

/// Q8_0 and Q4_0 caches, dequantized into the kernel's tiles, for every head size.
#[test]
#[ignore = "needs a CUDA GPU"]
fn prefill_attention_over_quantized_caches_matches_cpu() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(26);
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::F16] {
        for head_dim in [64usize, 96, 128, 256] {
            let shape = AttnShape {
                n_heads: 32,
                n_kv_heads: 8,
                head_dim,
                ring_cells: 0,
            };
            let caches = Caches::new(&g, &c, &mut rng, ty, 8 * head_dim, 1700);
            // Prompts after 900 cells, from cell 77: the union starts off a tile boundary
            // and the last tile is partly past it. 600 tokens fill the GPU; 131 are split.
            for n_tokens in [600, 131] {
                let spans = prompt(77, 900, n_tokens);
                let e = compare((&g, &c), &mut rng, &caches, &spans, shape, 3.0, 0.0);
                assert!(
                    e < FLASH_TOL,
                    "{ty} heads of {head_dim}, {n_tokens} tokens: {e}"
                );
            }
        }
    }
}

/// Gemma 2's soft-cap with scores large enough to bend, and Gemma 3's sliding window
/// (spans that start later for later tokens), on the flash kernel.
#[test]
#[ignore = "needs a CUDA GPU"]
fn soft_capped_and_windowed_prefill_attention_matches_cpu() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(27);
    for head_dim in [128usize, 256] {
        let shape = AttnShape {
            n_heads: 8,
            n_kv_heads: 4,
            head_dim,
            ring_cells: 0,
        };
        let caches = Caches::new(&g, &c, &mut rng, GgmlType::F16, 4 * head_dim, 2100);
        // A window of 1024 cells over 1500 earlier cells from cell 40.
        let windowed: Vec<AttnSpan> = (0..300u32)
            .map(|t| AttnSpan {
                first_cell: 40 + 477 + t,
                n_cells: 1024,
            })
            .collect();
        for (spans, cap) in [
            (prompt(40, 1500, 300), 5.0),
            (windowed, 0.0),
            (prompt(3, 10, 65), 2.0),
        ] {
            let e = compare((&g, &c), &mut rng, &caches, &spans, shape, 16.0, cap);
            assert!(e < FLASH_TOL, "heads of {head_dim}, cap {cap}: {e}");
        }
    }
}

/// A mixed batch: a prompt chunk of one sequence and decode tokens of others in one call
/// (the chunk's groups take the flash kernel, the decode tokens the per-token kernel); and
/// a token with no cells, which is refused.
#[test]
#[ignore = "needs a CUDA GPU"]
fn mixed_prompt_and_decode_batches_match_cpu() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(28);
    let shape = AttnShape {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        ring_cells: 0,
    };
    let caches = Caches::new(&g, &c, &mut rng, GgmlType::F16, 8 * 128, 4000);
    let mut spans = prompt(1000, 700, 333);
    for s in 0..6u32 {
        spans.push(AttnSpan {
            first_cell: 2100 + 300 * s,
            n_cells: 17 + 41 * s,
        });
    }
    let e = compare((&g, &c), &mut rng, &caches, &spans, shape, 4.0, 0.0);
    assert!(e < FLASH_TOL, "mixed batch: {e}");

    // A token with no cells is refused before anything runs: the output stays as it was.
    spans.push(AttnSpan {
        first_cell: 0,
        n_cells: 0,
    });
    let n = spans.len() * 32 * 128;
    let q = put(&g, &f32_bytes(&rng.f32s(n, 1.0)));
    let mut out = put(&g, &f32_bytes(&vec![7.0; n]));
    let refused = g.attention(
        &q,
        KvCache::new(&caches.k.0, &caches.v.0, GgmlType::F16),
        &spans,
        shape,
        0.1,
        &mut out,
    );
    let err = refused.expect_err("a token without cells was accepted");
    assert!(err.to_string().contains("token 339"), "{err}");
    assert!(
        get(&g, &out, n).iter().all(|&x| x == 7.0),
        "a refused call wrote its output"
    );
}

/// A short prefill batch after a long context (the last chunk of a prompt): too few
/// flash blocks to fill the GPU, so each block's cells are split over several blocks and
/// merged, in the backend's fixed scratch.
#[test]
#[ignore = "needs a CUDA GPU"]
fn short_prefill_batches_after_a_long_context_are_split_and_match_cpu() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(30);
    for (shape, ty, n_tokens) in [
        (
            AttnShape {
                n_heads: 32,
                n_kv_heads: 8,
                head_dim: 128,
                ring_cells: 0,
            },
            GgmlType::F16,
            20u32,
        ),
        (
            AttnShape {
                n_heads: 16,
                n_kv_heads: 8,
                head_dim: 256,
                ring_cells: 0,
            },
            GgmlType::Q4_0,
            9,
        ),
        (
            AttnShape {
                n_heads: 8,
                n_kv_heads: 1,
                head_dim: 64,
                ring_cells: 0,
            },
            GgmlType::Q8_0,
            45,
        ),
    ] {
        let kv_dim = shape.n_kv_heads * shape.head_dim;
        let caches = Caches::new(&g, &c, &mut rng, ty, kv_dim, 12_000);
        let spans = prompt(900, 10_001, n_tokens);
        g.synchronize().unwrap();
        let held = g.allocated_bytes();
        let e = compare((&g, &c), &mut rng, &caches, &spans, shape, 4.0, 0.0);
        assert!(e < FLASH_TOL, "{ty} {shape:?}, {n_tokens} tokens: {e}");
        g.synchronize().unwrap();
        assert_eq!(
            g.allocated_bytes(),
            held,
            "split prefill attention kept device memory"
        );
    }
}

/// Decode at a long context: one sequence's token over 16,400 cells is split over many
/// blocks and merged, as are four sequences' tokens, without device memory taken.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_attention_split_over_a_long_context_matches_cpu() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(29);
    for (shape, ty) in [
        (
            AttnShape {
                n_heads: 32,
                n_kv_heads: 8,
                head_dim: 128,
                ring_cells: 0,
            },
            GgmlType::F16,
        ),
        (
            AttnShape {
                n_heads: 16,
                n_kv_heads: 8,
                head_dim: 256,
                ring_cells: 0,
            },
            GgmlType::Q8_0,
        ),
        (
            AttnShape {
                n_heads: 32,
                n_kv_heads: 8,
                head_dim: 128,
                ring_cells: 0,
            },
            GgmlType::Q4_0,
        ),
    ] {
        let n_cells = 16_500;
        let caches = Caches::new(
            &g,
            &c,
            &mut rng,
            ty,
            shape.n_kv_heads * shape.head_dim,
            n_cells,
        );
        let one = vec![AttnSpan {
            first_cell: 33,
            n_cells: 16_401,
        }];
        let four: Vec<AttnSpan> = (0..4u32)
            .map(|s| AttnSpan {
                first_cell: 4100 * s,
                n_cells: 4099 - 1000 * s,
            })
            .collect();
        for spans in [one, four] {
            g.synchronize().unwrap();
            let held = g.allocated_bytes();
            let e = compare((&g, &c), &mut rng, &caches, &spans, shape, 4.0, 0.0);
            // The per-token kernel keeps f32 queries: only the caches' f16 values differ.
            let tol = 1e-4;
            assert!(
                e < tol,
                "{ty} {shape:?} decode of {} tokens: {e}",
                spans.len()
            );
            g.synchronize().unwrap();
            // Its partial results live in the backend's fixed scratch.
            assert_eq!(
                g.allocated_bytes(),
                held,
                "split decode attention kept device memory"
            );
        }
    }
}
