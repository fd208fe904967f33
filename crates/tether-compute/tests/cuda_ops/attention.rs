//! KV cache stores and attention (decode, tiled prefill, long spans) against the cpu.

use crate::*;
use tether_compute::{KvCache, Scores};

/// Stores the same rows in both backends' caches of `ty`; returns the caches.
pub(crate) fn filled_caches(
    g: &CudaBackend,
    c: &CpuBackend,
    rng: &mut Rng,
    ty: GgmlType,
    kv_dim: usize,
    n_cells: usize,
) -> (Pair, Pair) {
    let row_bytes = ty.bytes_for(kv_dim as u64).unwrap() as usize;
    let mut caches = Vec::new();
    for _ in 0..2 {
        let mut cache = pair(g, c, &vec![0u8; n_cells * row_bytes]);
        // Cells in a scrambled order, to check the cell indexing.
        let cells: Vec<u32> = (0..n_cells as u32)
            .map(|i| (i * 7) % n_cells as u32)
            .collect();
        let src = pair(g, c, &f32_bytes(&rng.f32s(n_cells * kv_dim, 2.0)));
        g.kv_store(&src.g, kv_dim, &cells, &mut cache.g, ty)
            .unwrap();
        c.kv_store(&src.c, kv_dim, &cells, &mut cache.c, ty)
            .unwrap();
        caches.push(cache);
    }
    let v = caches.pop().unwrap();
    (caches.pop().unwrap(), v)
}

/// Runs attention over `spans` of the caches `k`/`v` (of `ty`, read through `table` when
/// it is given) on both backends with random queries, and checks they agree: to 1e-4 for
/// f16 decode batches, looser where the flash kernel rounds to f16 or the cache is 8/4-bit.
pub(crate) fn attention_agrees(
    (g, c): (&CudaBackend, &CpuBackend),
    rng: &mut Rng,
    (k, v, table): (&Pair, &Pair, Option<&Pair>),
    ty: GgmlType,
    shape: AttnShape,
    (what, spans): (&str, &[AttnSpan]),
) {
    let n = spans.len() * shape.n_heads * shape.head_dim;
    let q = pair(g, c, &f32_bytes(&rng.f32s(n, 2.0)));
    let (mut og, mut oc) = (g.alloc(n * 4).unwrap(), c.alloc(n * 4).unwrap());
    let scores = Scores::capped(1.0 / (shape.head_dim as f32).sqrt(), 30.0);
    let (gk, ck) = (KvCache::new(&k.g, &v.g, ty), KvCache::new(&k.c, &v.c, ty));
    let (gk, ck) = match table {
        Some(t) => (gk.paged(&t.g), ck.paged(&t.c)),
        None => (gk, ck),
    };
    g.attention_capped(&q.g, gk, spans, shape, scores, &mut og)
        .unwrap();
    c.attention_capped(&q.c, ck, spans, shape, scores, &mut oc)
        .unwrap();
    // Prefill batches may take the flash kernel, which rounds to f16.
    let tol = match ty {
        GgmlType::F16 if spans.len() <= 4 => 1e-4,
        GgmlType::F16 => 4e-3,
        _ => 1e-2,
    };
    let what = format!("{what} {ty} {shape:?}");
    assert_close(&what, &get(g, &og, n), &get(c, &oc, n), tol);
}

/// The cache bytes of both backends, decoded to f32.
fn decoded_caches(g: &CudaBackend, c: &CpuBackend, p: &Pair, ty: GgmlType) -> (Vec<f32>, Vec<f32>) {
    let bytes = p.c.bytes();
    let (mut bg, mut bc) = (vec![0u8; bytes], vec![0u8; bytes]);
    g.download(&p.g, 0, &mut bg).unwrap();
    c.download(&p.c, 0, &mut bc).unwrap();
    let n = bytes / ty.block_bytes() * ty.block_elems();
    let (mut fg, mut fc) = (vec![0.0f32; n], vec![0.0f32; n]);
    tether_gguf::dequantize(ty, &bg, &mut fg).unwrap();
    tether_gguf::dequantize(ty, &bc, &mut fc).unwrap();
    if ty == GgmlType::F16 {
        assert_eq!(bg, bc, "f16 cache bytes differ");
    }
    // Name the first block that differs much, to tell a rounding tie from a wrong write.
    let (be, bb) = (ty.block_elems(), ty.block_bytes());
    for (i, (a, b)) in fg.chunks(be).zip(fc.chunks(be)).enumerate() {
        let e = relative_error(a, b);
        assert!(
            e < 0.02,
            "{ty} cache block {i} differs (relative error {e}): gpu {:?} cpu {:?}",
            &bg[i * bb..(i + 1) * bb],
            &bc[i * bb..(i + 1) * bb]
        );
    }
    (fg, fc)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn kv_store_and_attention_match_cpu_for_every_cache_type() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(5);
    let shapes = [
        (8usize, 2usize, 64usize),
        (4, 4, 128),
        (6, 2, 32),
        (6, 3, 96),
    ];
    for ty in [GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0] {
        for (n_heads, n_kv_heads, head_dim) in shapes {
            let shape = AttnShape {
                n_heads,
                n_kv_heads,
                head_dim,
                ring_cells: 0,
            };
            let kv_dim = n_kv_heads * head_dim;
            let n_cells = 1100;
            let (k, v) = filled_caches(&g, &c, &mut rng, ty, kv_dim, n_cells);
            for cache in [&k, &v] {
                let (fg, fc) = decoded_caches(&g, &c, cache, ty);
                assert_close(&format!("kv_store {ty}"), &fg, &fc, 1e-2);
            }
            // Decode (one token over many cells) and a causal prefill of 9 tokens.
            let decode = vec![AttnSpan {
                first_cell: 5,
                n_cells: 1090,
            }];
            let prefill: Vec<AttnSpan> = (0..9)
                .map(|t| AttnSpan {
                    first_cell: 40,
                    n_cells: 200 + t,
                })
                .collect();
            for spans in [decode, prefill] {
                let n = spans.len() * n_heads * head_dim;
                let q = pair(&g, &c, &f32_bytes(&rng.f32s(n, 2.0)));
                let (mut og, mut oc) = (g.alloc(n * 4).unwrap(), c.alloc(n * 4).unwrap());
                let scale = 1.0 / (head_dim as f32).sqrt();
                g.attention(
                    &q.g,
                    KvCache::new(&k.g, &v.g, ty),
                    &spans,
                    shape,
                    scale,
                    &mut og,
                )
                .unwrap();
                c.attention(
                    &q.c,
                    KvCache::new(&k.c, &v.c, ty),
                    &spans,
                    shape,
                    scale,
                    &mut oc,
                )
                .unwrap();
                let what = format!("attention {ty} {shape:?} {} tokens", spans.len());
                // Both read their own cache; Q4_0 rounding ties may differ between them.
                // The 9-token prefill takes the flash kernel, which rounds the queries and
                // probabilities to f16.
                let tol = match ty {
                    GgmlType::F16 if spans.len() == 1 => 1e-4,
                    GgmlType::F16 => 4e-3,
                    _ => 1e-2,
                };
                assert_close(&what, &get(&g, &og, n), &get(&c, &oc, n), tol);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tiled_prefill_attention_matches_cpu() {
    // Prefill batches over an F16 cache take a tiled kernel (attention_flash.cu on the
    // tensor cores, which rounds queries and probabilities to f16; attention_prefill.cu
    // with TETHER_FLASH_ATTENTION=0) for groups of tokens of one sequence: causal spans
    // that start off a tile boundary and cross many tiles, and grouped-query heads. Then,
    // in the same call, two sequences' tokens interleaved, whose groups take the per-token
    // kernel, with a token count that leaves the last group part empty.
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(9);
    for (n_heads, n_kv_heads, head_dim) in [
        (32usize, 8usize, 128usize),
        (6, 2, 64),
        (4, 4, 128),
        (8, 8, 96),
    ] {
        let shape = AttnShape {
            n_heads,
            n_kv_heads,
            head_dim,
            ring_cells: 0,
        };
        let kv_dim = n_kv_heads * head_dim;
        let n_cells = 2000;
        let (k, v) = filled_caches(&g, &c, &mut rng, GgmlType::F16, kv_dim, n_cells);
        let spans: Vec<AttnSpan> = (0..75u32)
            .map(|t| {
                if t < 48 || t % 2 == 0 {
                    AttnSpan {
                        first_cell: 37,
                        n_cells: 600 + t,
                    }
                } else {
                    AttnSpan {
                        first_cell: 1200,
                        n_cells: 1 + 9 * t,
                    }
                }
            })
            .collect();
        let n = spans.len() * n_heads * head_dim;
        let q = pair(&g, &c, &f32_bytes(&rng.f32s(n, 2.0)));
        let (mut og, mut oc) = (g.alloc(n * 4).unwrap(), c.alloc(n * 4).unwrap());
        let scale = 1.0 / (head_dim as f32).sqrt();
        g.attention(
            &q.g,
            KvCache::new(&k.g, &v.g, GgmlType::F16),
            &spans,
            shape,
            scale,
            &mut og,
        )
        .unwrap();
        c.attention(
            &q.c,
            KvCache::new(&k.c, &v.c, GgmlType::F16),
            &spans,
            shape,
            scale,
            &mut oc,
        )
        .unwrap();
        let what = format!("tiled prefill attention {shape:?}");
        assert_close(&what, &get(&g, &og, n), &get(&c, &oc, n), 4e-3);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_over_spans_longer_than_one_block_takes_matches_cpu() {
    // 288 (token, head) blocks fill the GPU; spans of 9000+ cells still need splitting.
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(6);
    let shape = AttnShape {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 32,
        ring_cells: 0,
    };
    let kv_dim = shape.n_kv_heads * shape.head_dim;
    let n_cells = 9100;
    let (k, v) = filled_caches(&g, &c, &mut rng, GgmlType::F16, kv_dim, n_cells);
    let spans: Vec<AttnSpan> = (0..9)
        .map(|t| AttnSpan {
            first_cell: 10,
            n_cells: 9000 + t,
        })
        .collect();
    let n = spans.len() * shape.n_heads * shape.head_dim;
    let q = pair(&g, &c, &f32_bytes(&rng.f32s(n, 2.0)));
    let (mut og, mut oc) = (g.alloc(n * 4).unwrap(), c.alloc(n * 4).unwrap());
    g.attention(
        &q.g,
        KvCache::new(&k.g, &v.g, GgmlType::F16),
        &spans,
        shape,
        0.3,
        &mut og,
    )
    .unwrap();
    c.attention(
        &q.c,
        KvCache::new(&k.c, &v.c, GgmlType::F16),
        &spans,
        shape,
        0.3,
        &mut oc,
    )
    .unwrap();
    assert_close("long attention", &get(&g, &og, n), &get(&c, &oc, n), 1e-4);
}

/// A prefill batch whose split partial results outgrow the backend's fixed scratch runs
/// in groups of tokens, with the same results and no device memory taken.
#[test]
#[ignore = "needs a CUDA GPU"]
fn long_prefill_attention_runs_in_groups_without_allocating() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(8);
    // Heads of 32: the tiled prefill kernel (64 and 128 only) does not take them.
    let shape = AttnShape {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 32,
        ring_cells: 0,
    };
    let kv_dim = shape.n_kv_heads * shape.head_dim;
    let n_cells = 16_900;
    let (k, v) = filled_caches(&g, &c, &mut rng, GgmlType::F16, kv_dim, n_cells);
    // Three splits of (32 + 2) floats per head: 13 KiB a token, so 1300 tokens take two
    // groups of the 16 MiB scratch.
    let spans: Vec<AttnSpan> = (0..1300)
        .map(|t| AttnSpan {
            first_cell: 7,
            n_cells: 16_400 + t % 400,
        })
        .collect();
    let n = spans.len() * shape.n_heads * shape.head_dim;
    let q = pair(&g, &c, &f32_bytes(&rng.f32s(n, 2.0)));
    let (mut og, mut oc) = (g.alloc(n * 4).unwrap(), c.alloc(n * 4).unwrap());
    g.synchronize().unwrap();
    let (held, process) = (g.allocated_bytes(), g.process_memory());
    g.attention(
        &q.g,
        KvCache::new(&k.g, &v.g, GgmlType::F16),
        &spans,
        shape,
        0.2,
        &mut og,
    )
    .unwrap();
    g.synchronize().unwrap();
    assert_eq!(
        g.allocated_bytes(),
        held,
        "attention allocated device memory"
    );
    if let (Some(before), Some(after)) = (process, g.process_memory()) {
        assert_eq!(after, before, "the process's device memory moved");
    }
    c.attention(
        &q.c,
        KvCache::new(&k.c, &v.c, GgmlType::F16),
        &spans,
        shape,
        0.2,
        &mut oc,
    )
    .unwrap();
    assert_close(
        "grouped attention",
        &get(&g, &og, n),
        &get(&c, &oc, n),
        1e-4,
    );
}
