//! The CUDA backend against the cpu backend, op by op, on random inputs.
//!
//! Every test needs a GPU and is ignored by default; run them with
//! `cargo test -p tether-compute --test cuda_ops -- --ignored --test-threads=1`.
//! Without a GPU they fail (the backend cannot be created), they do not skip.

use tether_compute::{
    AttnShape, AttnSpan, Backend, ComputeError, CpuBackend, CudaBackend, DeviceBuffer, RopeParams,
};
use tether_gguf::GgmlType;

mod common;
use common::{Rng, WEIGHT_TYPES, cpu, f32_bytes, get, gpu, put, random_weights};

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
                g.matmul(&w.g, ty, rows, cols, &x.g, n, &mut og).unwrap();
                c.matmul(&w.c, ty, rows, cols, &x.c, n, &mut oc).unwrap();
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
    let r = g.matmul(&w, GgmlType::Q2K, 4, 288, &x, 1, &mut o);
    assert!(matches!(r, Err(ComputeError::Shape { .. })), "{r:?}");
    let r = g.matmul(&w, GgmlType::Q4_0, 4, 100, &x, 1, &mut o);
    assert!(matches!(r, Err(ComputeError::Shape { .. })), "{r:?}");
    let r = g.matmul(&w, GgmlType::F32, 4096, 4096, &x, 1, &mut o);
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
                &mut x.g, n_tokens, n_heads, head_dim, &positions, &params, fg,
            )
            .unwrap();
            c.rope(
                &mut x.c, n_tokens, n_heads, head_dim, &positions, &params, fc,
            )
            .unwrap();
            let what = format!("rope neox={neox} n_rot={n_rot}");
            assert_close(&what, &get(&g, &x.g, n), &get(&c, &x.c, n), 1e-5);
        }
    }
}

/// Stores the same rows in both backends' caches of `ty`; returns the caches.
fn filled_caches(
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
                g.attention(&q.g, &k.g, &v.g, ty, &spans, shape, scale, &mut og)
                    .unwrap();
                c.attention(&q.c, &k.c, &v.c, ty, &spans, shape, scale, &mut oc)
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
            &k.g,
            &v.g,
            GgmlType::F16,
            &spans,
            shape,
            scale,
            &mut og,
        )
        .unwrap();
        c.attention(
            &q.c,
            &k.c,
            &v.c,
            GgmlType::F16,
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
    g.attention(&q.g, &k.g, &v.g, GgmlType::F16, &spans, shape, 0.3, &mut og)
        .unwrap();
    c.attention(&q.c, &k.c, &v.c, GgmlType::F16, &spans, shape, 0.3, &mut oc)
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
    g.attention(&q.g, &k.g, &v.g, GgmlType::F16, &spans, shape, 0.2, &mut og)
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
    c.attention(&q.c, &k.c, &v.c, GgmlType::F16, &spans, shape, 0.2, &mut oc)
        .unwrap();
    assert_close(
        "grouped attention",
        &get(&g, &og, n),
        &get(&c, &oc, n),
        1e-4,
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn transfers_are_bounds_checked_and_round_trip() {
    let g = gpu();
    let mut b = g.alloc(16).unwrap();
    g.upload(&mut b, 4, &[1, 2, 3, 4]).unwrap();
    let mut back = [9u8; 6];
    g.download(&b, 3, &mut back).unwrap();
    assert_eq!(back, [0, 1, 2, 3, 4, 0]);
    assert!(matches!(
        g.upload(&mut b, 13, &[0; 4]),
        Err(ComputeError::Shape { .. })
    ));
    assert!(matches!(
        g.download(&b, 10, &mut [0; 7]),
        Err(ComputeError::Shape { .. })
    ));
    assert!(g.name().starts_with("cuda:0"), "{}", g.name());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn alloc_free_cycles_return_the_memory() {
    let g = gpu();
    g.synchronize().unwrap();
    let start = g.memory_info().unwrap();
    let base = g.allocated_bytes();
    assert!(start.free > 0 && start.free <= start.total);
    for i in 0..1000usize {
        let b = g.alloc((1 << 20) + i * 4096).unwrap();
        assert_eq!(g.allocated_bytes(), base + b.bytes() as u64);
        drop(b);
    }
    assert_eq!(g.allocated_bytes(), base);
    g.synchronize().unwrap();
    let end = g.memory_info().unwrap();
    let drift = start.free.abs_diff(end.free);
    assert!(drift <= 16 << 20, "free memory moved by {drift} bytes");
    let too_much = usize::try_from(start.total * 2).unwrap();
    assert!(matches!(
        g.alloc(too_much),
        Err(ComputeError::OutOfMemory { .. })
    ));
}

/// NVML's count of this process's device memory follows an allocation up and back down,
/// which is what lets a worker tell its own leaks from another process on the same GPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn process_memory_follows_allocations() {
    let g = gpu();
    g.synchronize().unwrap();
    let before = g
        .process_memory()
        .expect("NVML lists this process (libnvidia-ml present, same pid namespace)");
    let b = g.alloc(512 << 20).unwrap();
    let during = g.process_memory().expect("still listed");
    let grew = during.saturating_sub(before);
    assert!(
        (512 << 20..=(512 + 32) << 20).contains(&grew),
        "a 512 MiB buffer moved NVML's count by {grew} bytes"
    );
    drop(b);
    g.synchronize().unwrap();
    let after = g.process_memory().expect("still listed");
    assert!(
        after.abs_diff(before) <= 2 << 20,
        "NVML's count went from {before} to {after} across alloc and free"
    );
}

/// The residual add fused into the product (matvec batches) and into the GEMM's last
/// store (GEMM batches) both equal the cpu's matmul-then-add.
/// The GEMM's fused residual add gives exactly the bits of the product written out and
/// added after, with one K split (added in the tile kernel's store) and with several
/// (added in the split reduction).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_residual_add_equals_matmul_then_add_bit_for_bit() {
    let g = gpu();
    let mut rng = Rng(11);
    // 2048 x 256 over 300 tokens fills the GPU unsplit; 67 x 512 over 20 splits K.
    for (ty, rows, cols, n) in [
        (GgmlType::Q8_0, 2048usize, 256usize, 300usize),
        (GgmlType::Q4_0, 67, 512, 20),
        (GgmlType::F16, 67, 512, 20),
    ] {
        let w = put(&g, &random_weights(&mut rng, ty, rows * cols));
        let x = put(&g, &f32_bytes(&rng.f32s(n * cols, 1.0)));
        let start = f32_bytes(&rng.f32s(n * rows, 1.0));
        let (mut fused, mut apart) = (put(&g, &start), put(&g, &start));
        let mut tmp = g.alloc(n * rows * 4).unwrap();
        g.matmul_add(&w, ty, rows, cols, &x, n, &mut fused, &mut tmp)
            .unwrap();
        g.matmul(&w, ty, rows, cols, &x, n, &mut tmp).unwrap();
        g.add(&mut apart, &tmp, n * rows).unwrap();
        let (a, b) = (get(&g, &fused, n * rows), get(&g, &apart, n * rows));
        let differ = a
            .iter()
            .zip(&b)
            .filter(|(p, q)| p.to_bits() != q.to_bits())
            .count();
        assert_eq!(differ, 0, "{ty} {rows}x{cols} n={n}: outputs differ");
        assert!(a.iter().all(|v| v.is_finite()), "{ty}: non-finite output");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn matmul_add_matches_cpu() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(7);
    for ty in [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::F16] {
        let (rows, cols) = (67, 512);
        let w = pair(&g, &c, &random_weights(&mut rng, ty, rows * cols));
        for n in [1usize, 3, 8, 20] {
            let x = pair(&g, &c, &f32_bytes(&rng.f32s(n * cols, 1.0)));
            let start = f32_bytes(&rng.f32s(n * rows, 1.0));
            let mut acc = pair(&g, &c, &start);
            let mut tg = g.alloc(n * rows * 4).unwrap();
            let mut tc = c.alloc(n * rows * 4).unwrap();
            g.matmul_add(&w.g, ty, rows, cols, &x.g, n, &mut acc.g, &mut tg)
                .unwrap();
            c.matmul_add(&w.c, ty, rows, cols, &x.c, n, &mut acc.c, &mut tc)
                .unwrap();
            let what = format!("matmul_add {ty} {rows}x{cols} n={n}");
            let got = get(&g, &acc.g, n * rows);
            assert_close(&what, &got, &get(&c, &acc.c, n * rows), 1e-2);
            let before: Vec<f32> = start
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            assert!(got != before, "{what}: nothing was added");
        }
    }
}

/// The fused feed-forward gate (Q4_0 decode batches) and the three-step one (other types,
/// larger batches) both equal the cpu's.
#[test]
#[ignore = "needs a CUDA GPU"]
fn matmul_swiglu_matches_cpu() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(9);
    for ty in [GgmlType::Q4_0, GgmlType::Q8_0] {
        let (rows, cols) = (131, 1024);
        let wg = pair(&g, &c, &random_weights(&mut rng, ty, rows * cols));
        let wu = pair(&g, &c, &random_weights(&mut rng, ty, rows * cols));
        for n in [1usize, 3, 8, 20] {
            let x = pair(&g, &c, &f32_bytes(&rng.f32s(n * cols, 1.0)));
            let (mut og, mut g1, mut g2) = (
                g.alloc(n * rows * 4).unwrap(),
                g.alloc(n * rows * 4).unwrap(),
                g.alloc(n * rows * 4).unwrap(),
            );
            let (mut oc, mut c1, mut c2) = (
                c.alloc(n * rows * 4).unwrap(),
                c.alloc(n * rows * 4).unwrap(),
                c.alloc(n * rows * 4).unwrap(),
            );
            g.matmul_swiglu(
                &wg.g, &wu.g, ty, rows, cols, &x.g, n, &mut og, &mut g1, &mut g2,
            )
            .unwrap();
            c.matmul_swiglu(
                &wg.c, &wu.c, ty, rows, cols, &x.c, n, &mut oc, &mut c1, &mut c2,
            )
            .unwrap();
            let what = format!("matmul_swiglu {ty} {rows}x{cols} n={n}");
            assert_close(
                &what,
                &get(&g, &og, n * rows),
                &get(&c, &oc, n * rows),
                1e-2,
            );
        }
    }
}

/// A norm's 8-bit copy of its rows (written as it normalizes) feeds the Q4_0 products that
/// follow it; the three fused q/k/v products and a later plain one read the right rows.
#[test]
#[ignore = "needs a CUDA GPU"]
fn norm_then_fused_products_match_cpu() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(11);
    let (dim, rows) = (512usize, [96usize, 32, 32]);
    let ty = GgmlType::Q4_0;
    let ws: Vec<Pair> = rows
        .iter()
        .map(|&r| pair(&g, &c, &random_weights(&mut rng, ty, r * dim)))
        .collect();
    let norm_w = pair(&g, &c, &f32_bytes(&rng.f32s(dim, 1.0)));
    for n in [1usize, 5, 8, 12] {
        let x = pair(&g, &c, &f32_bytes(&rng.f32s(n * dim, 3.0)));
        let mut ng = g.alloc(n * dim * 4).unwrap();
        let mut nc = c.alloc(n * dim * 4).unwrap();
        g.rms_norm(&x.g, &norm_w.g, n, dim, 1e-5, &mut ng).unwrap();
        c.rms_norm(&x.c, &norm_w.c, n, dim, 1e-5, &mut nc).unwrap();
        let mut og: Vec<_> = rows.iter().map(|r| g.alloc(n * r * 4).unwrap()).collect();
        let mut oc: Vec<_> = rows.iter().map(|r| c.alloc(n * r * 4).unwrap()).collect();
        let [g0, g1, g2] = &mut og[..] else {
            unreachable!()
        };
        g.matmul3(
            [&ws[0].g, &ws[1].g, &ws[2].g],
            [ty; 3],
            rows,
            dim,
            &ng,
            n,
            [g0, g1, g2],
        )
        .unwrap();
        let [c0, c1, c2] = &mut oc[..] else {
            unreachable!()
        };
        c.matmul3(
            [&ws[0].c, &ws[1].c, &ws[2].c],
            [ty; 3],
            rows,
            dim,
            &nc,
            n,
            [c0, c1, c2],
        )
        .unwrap();
        for i in 0..3 {
            let what = format!("norm then matmul3 output {i}, n={n}");
            let got = get(&g, &og[i], n * rows[i]);
            assert_close(&what, &got, &get(&c, &oc[i], n * rows[i]), 1e-2);
        }
        // A product after another op re-quantizes its input instead of reusing stale rows.
        g.add(&mut ng, &x.g, n * dim).unwrap();
        c.add(&mut nc, &x.c, n * dim).unwrap();
        let mut pg = g.alloc(n * rows[0] * 4).unwrap();
        let mut pc = c.alloc(n * rows[0] * 4).unwrap();
        g.matmul(&ws[0].g, ty, rows[0], dim, &ng, n, &mut pg)
            .unwrap();
        c.matmul(&ws[0].c, ty, rows[0], dim, &nc, n, &mut pc)
            .unwrap();
        let what = format!("matmul after add, n={n}");
        assert_close(
            &what,
            &get(&g, &pg, n * rows[0]),
            &get(&c, &pc, n * rows[0]),
            1e-2,
        );
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
    };
    let (qd, kvd, cells_in_cache) = (8 * 64, 2 * 64, 16usize);
    for neox in [false, true] {
        let params = RopeParams {
            n_rot: 64,
            freq_base: 500000.0,
            freq_scale: 1.0,
            neox,
            yarn: None,
        };
        for (positions, cells) in [(vec![5u32], vec![7u32]), (vec![9, 10, 11], vec![2, 3, 15])] {
            let n = positions.len();
            let mut q = pair(&g, &c, &f32_bytes(&rng.f32s(n * qd, 1.0)));
            let mut k = pair(&g, &c, &f32_bytes(&rng.f32s(n * kvd, 1.0)));
            let v = pair(&g, &c, &f32_bytes(&rng.f32s(n * kvd, 1.0)));
            let zeros = vec![0u8; cells_in_cache * kvd * 2];
            let (mut kc, mut vc) = (pair(&g, &c, &zeros), pair(&g, &c, &zeros));
            let f16 = GgmlType::F16;
            g.rope_and_store(
                &mut q.g, &mut k.g, &v.g, shape, &positions, &params, None, &cells, &mut kc.g,
                &mut vc.g, f16,
            )
            .unwrap();
            c.rope_and_store(
                &mut q.c, &mut k.c, &v.c, shape, &positions, &params, None, &cells, &mut kc.c,
                &mut vc.c, f16,
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

/// Buffers reserved together share one allocation: each holds its own bytes, they do not
/// overlap, and the memory returns when the last of them is dropped.
#[test]
#[ignore = "needs a CUDA GPU"]
fn alloc_many_buffers_are_separate_and_freed_with_the_last() {
    let g = gpu();
    let base = g.allocated_bytes();
    let sizes = [100usize, 0, 5000, 1 << 20, 256];
    let mut bufs = g.alloc_many(&sizes).unwrap();
    assert_eq!(bufs.len(), sizes.len());
    for (b, &s) in bufs.iter().zip(&sizes) {
        assert_eq!(b.bytes(), s);
    }
    let held = g.allocated_bytes() - base;
    let aligned: usize = sizes.iter().map(|s| s.next_multiple_of(256)).sum();
    assert_eq!(held, aligned as u64, "one allocation of the aligned sizes");
    // Fill each with its own byte, then read all back: no buffer spills into another.
    for (i, b) in bufs.iter_mut().enumerate() {
        let fill = vec![i as u8 + 1; b.bytes()];
        g.upload(b, 0, &fill).unwrap();
    }
    for (i, b) in bufs.iter().enumerate() {
        let mut back = vec![0u8; b.bytes()];
        g.download(b, 0, &mut back).unwrap();
        assert!(back.iter().all(|&x| x == i as u8 + 1), "buffer {i}");
    }
    let last = bufs.pop().unwrap();
    drop(bufs);
    assert_eq!(
        g.allocated_bytes() - base,
        held,
        "held while one part lives"
    );
    drop(last);
    assert_eq!(g.allocated_bytes(), base, "freed with the last part");
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
