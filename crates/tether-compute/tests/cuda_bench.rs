//! Timings of the CUDA decode path (matvec, attention) and of prefill attention. Ignored by default; on a GPU:
//! `cargo test -p tether-compute --release --test cuda_bench -- --ignored --nocapture`.

use std::time::Instant;
use tether_compute::{KvCache, KvCacheMut, Qkv, Rope, Weight};

use tether_compute::{AttnShape, AttnSpan, Backend, CudaBackend, CudaTuning};
use tether_gguf::GgmlType;

fn gpu() -> CudaBackend {
    CudaBackend::with_tuning(0, &CudaTuning::from_env())
        .unwrap_or_else(|e| panic!("this benchmark needs a CUDA GPU: {e}"))
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

/// Weight bytes with a small positive f16 scale in every block (zeros elsewhere), so the
/// kernels do real arithmetic on finite values.
fn weights(ty: GgmlType, elems: usize) -> Vec<u8> {
    let mut w = vec![0x11u8; ty.bytes_for(elems as u64).unwrap() as usize];
    if ty.is_quantized() {
        let scale = half::f16::from_f32(0.01).to_le_bytes();
        let at = if ty == GgmlType::Q6K { 208 } else { 0 };
        for b in w.chunks_exact_mut(ty.block_bytes()) {
            b[at..at + 2].copy_from_slice(&scale);
        }
    }
    w
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bench_decode_matvec() {
    let g = gpu();
    let types = [
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::F32,
    ];
    for (rows, cols) in [(4096usize, 4096usize), (14336, 4096), (4096, 14336)] {
        for ty in types {
            let wb = weights(ty, rows * cols);
            let mut w = g.alloc(wb.len()).unwrap();
            g.upload(&mut w, 0, &wb).unwrap();
            for n in [1usize, 8] {
                let x = g.alloc(n * cols * 4).unwrap();
                let mut out = g.alloc(n * rows * 4).unwrap();
                let secs = time(&g, 50, || {
                    g.matmul(Weight::new(&w, ty, rows, cols), &x, n, &mut out)
                        .unwrap();
                });
                eprintln!(
                    "matvec {ty:>5} {rows:>5}x{cols:<5} n={n}: {:8.1} us  {:7.1} GB/s of weights",
                    secs * 1e6,
                    wb.len() as f64 / secs / 1e9
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bench_decode_attention() {
    let g = gpu();
    let shape = AttnShape {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        ring_cells: 0,
    };
    let kv_dim = shape.n_kv_heads * shape.head_dim;
    for cells in [512usize, 4096, 32768] {
        let k = g.alloc(cells * kv_dim * 2).unwrap();
        let v = g.alloc(cells * kv_dim * 2).unwrap();
        let q = g.alloc(shape.n_heads * shape.head_dim * 4).unwrap();
        let mut out = g.alloc(shape.n_heads * shape.head_dim * 4).unwrap();
        let spans = [AttnSpan {
            first_cell: 0,
            n_cells: cells as u32,
        }];
        let secs = time(&g, 50, || {
            g.attention(
                &q,
                KvCache::new(&k, &v, GgmlType::F16),
                &spans,
                shape,
                0.088,
                &mut out,
            )
            .unwrap();
        });
        eprintln!(
            "attention f16 decode, {cells:>6} cells: {:8.1} us  {:7.1} GB/s of cache",
            secs * 1e6,
            (2 * cells * kv_dim * 2) as f64 / secs / 1e9
        );
    }
}

/// The last 512-token chunk of a prompt of `ctx` tokens (each chunk attends to all earlier
/// cells), as `tether bench -p ctx` runs it: time per call and tensor-core throughput
/// (4 * heads * head * visible cells flops). `TETHER_FLASH_ATTENTION=0` times the kernels
/// the flash kernel replaced.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bench_prefill_attention() {
    let g = gpu();
    let chunk = 512usize;
    let shapes = [(32, 8, 128), (16, 8, 256)];
    for ((n_heads, n_kv_heads, head_dim), ty) in shapes
        .into_iter()
        .flat_map(|s| [(s, GgmlType::F16), (s, GgmlType::Q8_0)])
    {
        let shape = AttnShape {
            n_heads,
            n_kv_heads,
            head_dim,
            ring_cells: 0,
        };
        let kv_dim = n_kv_heads * head_dim;
        for ctx in [512usize, 4096, 16384] {
            let cache_bytes = ty.bytes_for((ctx * kv_dim) as u64).unwrap() as usize;
            let k = g.alloc(cache_bytes).unwrap();
            let v = g.alloc(cache_bytes).unwrap();
            let q = g.alloc(chunk * n_heads * head_dim * 4).unwrap();
            let mut out = g.alloc(chunk * n_heads * head_dim * 4).unwrap();
            let spans: Vec<AttnSpan> = (0..chunk)
                .map(|t| AttnSpan {
                    first_cell: 0,
                    n_cells: (ctx - chunk + t + 1) as u32,
                })
                .collect();
            let secs = time(&g, 20, || {
                g.attention(&q, KvCache::new(&k, &v, ty), &spans, shape, 0.088, &mut out)
                    .unwrap();
            });
            let cells: usize = spans.iter().map(|s| s.n_cells as usize).sum();
            let flops = (4 * n_heads * head_dim * cells) as f64;
            eprintln!(
                "attention {ty} heads {n_heads}/{n_kv_heads}x{head_dim}, 512 tokens after \
                 {:>5}: {:8.1} us  {:6.1} TFLOP/s",
                ctx - chunk,
                secs * 1e6,
                flops / secs / 1e12
            );
        }
    }
}

/// One llama3-8b decode layer's ops, as the model issues them, 32 times (one token's
/// layers): wall time per layer, the host's time to enqueue it, and weight bandwidth. When
/// enqueueing takes as long as running, launches bound decode, not memory.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bench_decode_layer() {
    use tether_compute::RopeParams;
    let g = gpu();
    let (e, qd, kvd, ff, cells) = (4096usize, 4096usize, 1024usize, 14336usize, 512usize);
    let shape = AttnShape {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        ring_cells: 0,
    };
    let rope = RopeParams {
        n_rot: 128,
        freq_base: 500000.0,
        freq_scale: 1.0,
        neox: false,
        yarn: None,
    };
    for ty in [GgmlType::Q4_0, GgmlType::Q8_0] {
        let upload = |rows: usize, cols: usize| {
            let wb = weights(ty, rows * cols);
            let mut w = g.alloc(wb.len()).unwrap();
            g.upload(&mut w, 0, &wb).unwrap();
            (w, wb.len())
        };
        let mats = [
            upload(qd, e),
            upload(kvd, e),
            upload(kvd, e),
            upload(e, qd),
            upload(ff, e),
            upload(ff, e),
            upload(e, ff),
        ];
        let bytes: usize = mats.iter().map(|m| m.1).sum();
        let f32buf = |n: usize| {
            let mut b = g.alloc(n * 4).unwrap();
            g.upload(&mut b, 0, &vec![0u8; n * 4]).unwrap();
            b
        };
        let (mut hidden, mut normed, norm_w) = (f32buf(e), f32buf(e), f32buf(e));
        let (mut q, mut k, mut v, mut attn) = (f32buf(qd), f32buf(kvd), f32buf(kvd), f32buf(qd));
        let (mut gate, mut up, mut act) = (f32buf(ff), f32buf(ff), f32buf(ff));
        let mut kc = g.alloc(cells * kvd * 2).unwrap();
        let mut vc = g.alloc(cells * kvd * 2).unwrap();
        let spans = [AttnSpan {
            first_cell: 0,
            n_cells: 100,
        }];
        let mut layer = || {
            let m = &mats;
            g.rms_norm(&hidden, &norm_w, 1, e, 1e-5, &mut normed)
                .unwrap();
            g.matmul3(
                [
                    Weight::new(&m[0].0, ty, qd, e),
                    Weight::new(&m[1].0, ty, kvd, e),
                    Weight::new(&m[2].0, ty, kvd, e),
                ],
                &normed,
                1,
                [&mut q, &mut k, &mut v],
            )
            .unwrap();
            g.rope_and_store(
                Qkv::new(&mut q, &mut k, &v),
                shape,
                &[99],
                Rope::new(&rope, None),
                &[99],
                KvCacheMut::new(&mut kc, &mut vc, GgmlType::F16),
            )
            .unwrap();
            g.attention(
                &q,
                KvCache::new(&kc, &vc, GgmlType::F16),
                &spans,
                shape,
                0.088,
                &mut attn,
            )
            .unwrap();
            g.matmul_add(
                Weight::new(&m[3].0, ty, e, qd),
                &attn,
                1,
                &mut hidden,
                &mut normed,
            )
            .unwrap();
            g.rms_norm(&hidden, &norm_w, 1, e, 1e-5, &mut normed)
                .unwrap();
            g.matmul_swiglu(
                [
                    Weight::new(&m[4].0, ty, ff, e),
                    Weight::new(&m[5].0, ty, ff, e),
                ],
                &normed,
                1,
                &mut act,
                [&mut gate, &mut up],
            )
            .unwrap();
            g.matmul_add(
                Weight::new(&m[6].0, ty, e, ff),
                &act,
                1,
                &mut hidden,
                &mut normed,
            )
            .unwrap();
        };
        let token = time(&g, 10, || {
            for _ in 0..32 {
                layer();
            }
        });
        g.synchronize().unwrap();
        let start = std::time::Instant::now();
        for _ in 0..32 {
            layer();
        }
        let enqueue = start.elapsed().as_secs_f64();
        g.synchronize().unwrap();
        eprintln!(
            "decode layer {ty:>5}: {:7.1} us per layer ({:5.1} us to enqueue), {:6.1} GB/s of weights; 32 layers: {:6.0} tokens/s before the head",
            token / 32.0 * 1e6,
            enqueue / 32.0 * 1e6,
            bytes as f64 / (token / 32.0) / 1e9,
            1.0 / token
        );
    }
}
