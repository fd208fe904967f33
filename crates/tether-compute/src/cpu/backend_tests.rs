//! The cpu backend through the `Backend` trait: transfers, size checks, and ops end to end.

use super::*;
use crate::backend::{KvCache, Rope, RopeParams, Weight};
use crate::cpu::test_util::{Rng, random_f32, random_weights, relative_error};

fn backend() -> CpuBackend {
    CpuBackend::new(Some(2)).unwrap()
}

fn upload_f32(be: &CpuBackend, v: &[f32]) -> CpuBuffer {
    let mut b = be.alloc(v.len() * 4).unwrap();
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    be.upload(&mut b, 0, &bytes).unwrap();
    b
}

fn upload_bytes(be: &CpuBackend, v: &[u8]) -> CpuBuffer {
    let mut b = be.alloc(v.len()).unwrap();
    be.upload(&mut b, 0, v).unwrap();
    b
}

fn is_shape(r: Result<()>) -> bool {
    matches!(r, Err(ComputeError::Shape { .. }))
}

#[test]
fn transfers_are_bounds_checked_and_round_trip() {
    let be = backend();
    assert_eq!(be.threads(), 2);
    let mut b = be.alloc(16).unwrap();
    be.upload(&mut b, 4, &[1, 2, 3, 4]).unwrap();
    let mut back = [0u8; 6];
    be.download(&b, 3, &mut back).unwrap();
    assert_eq!(back, [0, 1, 2, 3, 4, 0]);
    assert!(is_shape(be.upload(&mut b, 13, &[0; 4])));
    assert!(is_shape(be.upload(&mut b, usize::MAX, &[0; 4])));
    assert!(is_shape(be.download(&b, 10, &mut [0; 7])));
    be.synchronize().unwrap();
}

#[test]
fn allocations_beyond_free_memory_are_refused() {
    let be = backend();
    let info = be.memory_info().unwrap();
    assert!(info.free > 0 && info.free <= info.total);
    let too_much = usize::try_from(info.total.saturating_mul(4)).unwrap_or(usize::MAX);
    match be.alloc(too_much) {
        Err(ComputeError::OutOfMemory {
            requested, free, ..
        }) => {
            assert_eq!(requested, too_much as u64);
            assert!(free < requested);
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
}

#[test]
fn get_rows_dequantizes_the_chosen_rows() {
    let be = backend();
    let mut rng = Rng::new(41);
    let types = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q6K,
        GgmlType::IQ4NL,
        GgmlType::IQ4XS,
    ];
    for ty in types {
        let row_len = 256;
        let table = random_weights(&mut rng, ty, 5 * row_len);
        let tb = upload_bytes(&be, &table);
        let ids = [4u32, 0, 4, 2];
        let mut out = be.alloc(ids.len() * row_len * 4).unwrap();
        be.get_rows(&tb, ty, row_len, &ids, &mut out).unwrap();
        let mut all = vec![0.0f32; 5 * row_len];
        dequantize(ty, &table, &mut all).unwrap();
        for (t, &id) in ids.iter().enumerate() {
            let id = id as usize;
            assert_eq!(
                &out.as_f32()[t * row_len..(t + 1) * row_len],
                &all[id * row_len..(id + 1) * row_len],
                "{ty} token {t}"
            );
        }
        assert!(is_shape(be.get_rows(&tb, ty, row_len, &[5], &mut out)));
        assert!(is_shape(be.get_rows(&tb, ty, row_len, &[0; 5], &mut out)));
    }
    let tb = be.alloc(18 * 4).unwrap();
    let mut out = be.alloc(1024).unwrap();
    assert!(is_shape(be.get_rows(
        &tb,
        GgmlType::Q4_0,
        33,
        &[0],
        &mut out
    )));
}

#[test]
fn matmul_through_the_backend_and_its_size_checks() {
    let be = CpuBackend::new(None).unwrap();
    let mut rng = Rng::new(42);
    let (rows, cols, n) = (33, 64, 3);
    let w = random_weights(&mut rng, GgmlType::Q8_0, rows * cols);
    let x = random_f32(&mut rng, n * cols, 1.0);
    let (wb, xb) = (upload_bytes(&be, &w), upload_f32(&be, &x));
    let mut out = be.alloc(n * rows * 4).unwrap();
    be.matmul(
        Weight::new(&wb, GgmlType::Q8_0, rows, cols),
        &xb,
        n,
        &mut out,
    )
    .unwrap();
    let mut wf = vec![0.0f32; rows * cols];
    dequantize(GgmlType::Q8_0, &w, &mut wf).unwrap();
    let want: Vec<f64> = (0..n * rows)
        .map(|i| {
            let (t, r) = (i / rows, i % rows);
            (0..cols)
                .map(|c| f64::from(wf[r * cols + c]) * f64::from(x[t * cols + c]))
                .sum()
        })
        .collect();
    assert!(relative_error(out.as_f32(), &want) < 1e-2);

    let q = GgmlType::Q8_0;
    assert!(is_shape(be.matmul(
        Weight::new(&wb, q, rows + 1, cols),
        &xb,
        n,
        &mut out
    )));
    assert!(is_shape(be.matmul(
        Weight::new(&wb, q, rows, 48),
        &xb,
        n,
        &mut out
    )));
    assert!(is_shape(be.matmul(
        Weight::new(&wb, q, rows, cols),
        &xb,
        n + 1,
        &mut out
    )));
    assert!(is_shape(be.matmul(
        Weight::new(&wb, q, usize::MAX, cols),
        &xb,
        n,
        &mut out
    )));
    let mut small = be.alloc(4).unwrap();
    assert!(is_shape(be.matmul(
        Weight::new(&wb, q, rows, cols),
        &xb,
        n,
        &mut small
    )));
}

#[test]
fn element_wise_ops_check_sizes_and_compute() {
    let be = backend();
    let a = upload_f32(&be, &[1.0, 2.0, 3.0, 4.0]);
    let b = upload_f32(&be, &[0.5, -1.0, 2.0, 0.0]);
    let mut x = upload_f32(&be, &[1.0, 2.0, 3.0, 4.0]);
    be.add(&mut x, &b, 4).unwrap();
    assert_eq!(x.as_f32(), &[1.5, 1.0, 5.0, 4.0]);
    be.add_bias(&mut x, &b, 2, 2).unwrap();
    assert_eq!(x.as_f32(), &[2.0, 0.0, 5.5, 3.0]);
    let mut out = be.alloc(16).unwrap();
    be.swiglu(&a, &b, 4, &mut out).unwrap();
    let silu = |v: f32| v / (1.0 + (-v).exp());
    assert!((out.as_f32()[1] - -silu(2.0)).abs() < 1e-6);
    be.rms_norm(&a, &b, 2, 2, 0.0, &mut out).unwrap();
    let inv = 1.0 / (2.5f32).sqrt();
    assert!((out.as_f32()[0] - inv * 0.5).abs() < 1e-6);
    be.copy(&b, &mut out, 8).unwrap();
    assert_eq!(&out.as_f32()[..2], &[0.5, -1.0]);

    assert!(is_shape(be.add(&mut x, &b, 5)));
    assert!(is_shape(be.add_bias(&mut x, &b, 3, 2)));
    assert!(is_shape(be.swiglu(&a, &b, 5, &mut out)));
    assert!(is_shape(be.rms_norm(&a, &b, 1, 5, 1e-5, &mut out)));
    assert!(is_shape(be.copy(&b, &mut out, 17)));
    let p = RopeParams {
        n_rot: 3,
        freq_base: 1e4,
        freq_scale: 1.0,
        neox: false,
        yarn: None,
    };
    assert!(is_shape(be.rope(
        &mut x,
        1,
        1,
        4,
        &[0],
        Rope::new(&p, None)
    )));
    let p = RopeParams { n_rot: 4, ..p };
    assert!(is_shape(be.rope(
        &mut x,
        2,
        1,
        4,
        &[0],
        Rope::new(&p, None)
    )));
    assert!(is_shape(be.rope(
        &mut x,
        1,
        1,
        4,
        &[0],
        Rope::new(&p, Some(&be.alloc(4).unwrap()))
    )));
    be.rope(&mut x, 1, 1, 4, &[0], Rope::new(&p, None)).unwrap();
    assert_eq!(x.as_f32(), &[2.0, 0.0, 5.5, 3.0]);
}

#[test]
fn kv_cache_and_attention_check_cells_spans_and_types() {
    let be = backend();
    let shape = AttnShape {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
        ring_cells: 0,
    };
    let kv_dim = 16;
    let mut k = be.alloc(3 * kv_dim * 2).unwrap();
    let mut v = be.alloc(3 * kv_dim * 2).unwrap();
    let row = upload_f32(&be, &(0..kv_dim).map(|i| i as f32).collect::<Vec<_>>());
    be.kv_store(&row, kv_dim, &[2], &mut k, GgmlType::F16)
        .unwrap();
    be.kv_store(&row, kv_dim, &[2], &mut v, GgmlType::F16)
        .unwrap();
    assert!(is_shape(be.kv_store(
        &row,
        kv_dim,
        &[3],
        &mut k,
        GgmlType::F16
    )));
    assert!(is_shape(be.kv_store(
        &row,
        kv_dim,
        &[0, 1],
        &mut k,
        GgmlType::F16
    )));
    assert!(matches!(
        be.kv_store(&row, kv_dim, &[0], &mut k, GgmlType::Q6K),
        Err(ComputeError::Unsupported { .. })
    ));
    // 16 values are not a whole Q8_0 block.
    assert!(is_shape(be.kv_store(
        &row,
        kv_dim,
        &[0],
        &mut k,
        GgmlType::Q8_0
    )));

    let q = upload_f32(&be, &[0.1; 32]);
    let mut out = be.alloc(32 * 4).unwrap();
    let span = |first, n| AttnSpan {
        first_cell: first,
        n_cells: n,
    };
    be.attention(
        &q,
        KvCache::new(&k, &v, GgmlType::F16),
        &[span(2, 1)],
        shape,
        1.0,
        &mut out,
    )
    .unwrap();
    // One visible cell: each head returns its KV head's value row.
    let o = out.as_f32();
    assert_eq!(&o[..8], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
    assert_eq!(&o[16..24], &[8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0]);

    let f16 = GgmlType::F16;
    assert!(is_shape(be.attention(
        &q,
        KvCache::new(&k, &v, f16),
        &[span(2, 2)],
        shape,
        1.0,
        &mut out
    )));
    assert!(is_shape(be.attention(
        &q,
        KvCache::new(&k, &v, f16),
        &[span(0, 0)],
        shape,
        1.0,
        &mut out
    )));
    assert!(is_shape(be.attention(
        &q,
        KvCache::new(&k, &v, f16),
        &[span(u32::MAX, 2)],
        shape,
        1.0,
        &mut out
    )));
    assert!(is_shape(be.attention(
        &q,
        KvCache::new(&k, &v, f16),
        &[span(0, 1); 2],
        shape,
        1.0,
        &mut out
    )));
    let none = AttnShape {
        n_heads: 0,
        ..shape
    };
    assert!(is_shape(be.attention(
        &q,
        KvCache::new(&k, &v, f16),
        &[span(0, 1)],
        none,
        1.0,
        &mut out
    )));
    let odd = AttnShape {
        n_kv_heads: 3,
        ..shape
    };
    assert!(is_shape(be.attention(
        &q,
        KvCache::new(&k, &v, f16),
        &[span(0, 1)],
        odd,
        1.0,
        &mut out
    )));
}

#[test]
fn argmax_rows_reads_each_row_in_place_and_checks_sizes() {
    let be = backend();
    let x = upload_f32(&be, &[1.0, 3.0, 3.0, f32::NAN, -0.0, 0.0]);
    let mut scratch = be.alloc(4).unwrap();
    let mut out = [u32::MAX; 2];
    be.argmax_rows(&x, 3, &mut scratch, &mut out).unwrap();
    assert_eq!(
        out,
        [1, 2],
        "ties to the lower id, NaN skipped, +0 above -0"
    );
    let mut too_many = [0u32; 3];
    assert!(is_shape(be.argmax_rows(&x, 3, &mut scratch, &mut too_many)));
}

#[test]
fn top_rows_give_each_rows_candidates_in_the_samplers_order() {
    let be = backend();
    let x = upload_f32(&be, &[1.0, 3.0, 3.0, f32::NAN, -0.0, 0.0, f32::NAN, 2.0]);
    let mut scratch = be.alloc(4).unwrap();
    let mut out = vec![Vec::new(); 2];
    be.top_rows(&x, 4, 3, &mut scratch, &mut out).unwrap();
    assert_eq!(
        out[0],
        [(1, 3.0), (2, 3.0), (0, 1.0)],
        "ties to the lower id"
    );
    let bits: Vec<_> = out[1].iter().map(|c| (c.0, c.1.to_bits())).collect();
    assert_eq!(
        bits,
        [
            (3, 2.0f32.to_bits()),
            (1, 0.0f32.to_bits()),
            (0, (-0.0f32).to_bits())
        ],
        "NaN skipped, +0 above -0"
    );
    let mut too_many = vec![Vec::new(); 3];
    assert!(is_shape(be.top_rows(&x, 4, 3, &mut scratch, &mut too_many)));
}

#[test]
fn score_rows_give_the_log_sum_exp_and_the_targets_logit() {
    let be = backend();
    let row = [1.0f32, 3.0, f32::NAN, -2.0, 0.5];
    let x = upload_f32(
        &be,
        &[
            &row[..],
            &[f32::NEG_INFINITY; 5],
            &[1e30, 1e30, 0.0, 0.0, 0.0],
        ]
        .concat(),
    );
    let mut scratch = be.alloc(4).unwrap();
    let mut out = vec![(0.0, 0.0); 3];
    be.score_rows(&x, 5, &[1, 0, 4], &mut scratch, &mut out)
        .unwrap();
    let want: f64 = [1.0f64, 3.0, -2.0, 0.5]
        .iter()
        .map(|v| v.exp())
        .sum::<f64>()
        .ln();
    assert!((f64::from(out[0].0) - want).abs() < 1e-6, "{out:?}");
    assert_eq!(out[0].1, 3.0);
    assert_eq!(
        out[1],
        (f32::NEG_INFINITY, f32::NEG_INFINITY),
        "a row of -inf"
    );
    assert!(
        (out[2].0 - (1e30 + 2f32.ln())).abs() <= 1e24,
        "no overflow: {out:?}"
    );
    let p: f64 = row
        .iter()
        .filter(|v| !v.is_nan())
        .map(|&v| (f64::from(v) - f64::from(out[0].0)).exp())
        .sum();
    assert!((p - 1.0).abs() < 1e-6, "the probabilities sum to 1: {p}");
    be.score_rows(&x, 5, &[], &mut scratch, &mut out).unwrap();
    assert!(out[0].1.is_nan(), "no target");
    assert!(is_shape(be.score_rows(
        &x,
        5,
        &[5, 0, 0],
        &mut scratch,
        &mut out
    )));
    assert!(is_shape(be.score_rows(&x, 5, &[0], &mut scratch, &mut out)));
    let mut four = vec![(0.0, 0.0); 4];
    assert!(is_shape(be.score_rows(&x, 5, &[], &mut scratch, &mut four)));
}

/// `finish_weight` packs Q4_0 weights on a backend with AVX2 (not on a portable one);
/// products and embedding rows read through the packing as through the file's layout, and
/// a packed weight refuses writes and reads as another type.
#[test]
fn finished_q4_0_weights_read_the_same_packed_or_not() {
    let mut rng = Rng::new(44);
    let (rows, cols, n_tokens) = (21, 64, 9);
    let w = random_weights(&mut rng, GgmlType::Q4_0, rows * cols);
    let x = random_f32(&mut rng, n_tokens * cols, 1.0);
    for isa in [CpuIsa::Scalar, CpuIsa::detect()] {
        let be = CpuBackend::with_isa(Some(2), isa).unwrap();
        let plain = upload_bytes(&be, &w);
        let mut finished = upload_bytes(&be, &w);
        be.finish_weight(&mut finished, GgmlType::Q4_0, cols)
            .unwrap();
        assert_eq!(finished.packed.is_some(), isa.avx2().is_some(), "{isa}");
        be.finish_weight(&mut finished, GgmlType::Q4_0, cols)
            .unwrap();
        let xb = upload_f32(&be, &x);
        for n in [1, n_tokens] {
            let mut a = be.alloc(4 * rows * n).unwrap();
            let mut b = be.alloc(4 * rows * n).unwrap();
            be.matmul(
                Weight::new(&plain, GgmlType::Q4_0, rows, cols),
                &xb,
                n,
                &mut a,
            )
            .unwrap();
            be.matmul(
                Weight::new(&finished, GgmlType::Q4_0, rows, cols),
                &xb,
                n,
                &mut b,
            )
            .unwrap();
            for (p, q) in a.as_f32().iter().zip(b.as_f32()) {
                assert!(
                    (p - q).abs() <= 1e-5 * p.abs().max(1.0),
                    "{isa} n={n}: {p} vs {q}"
                );
            }
        }
        let ids = [0u32, 7, 8, 20, 3];
        let mut a = be.alloc(4 * ids.len() * cols).unwrap();
        let mut b = be.alloc(4 * ids.len() * cols).unwrap();
        be.get_rows(&plain, GgmlType::Q4_0, cols, &ids, &mut a)
            .unwrap();
        be.get_rows(&finished, GgmlType::Q4_0, cols, &ids, &mut b)
            .unwrap();
        assert_eq!(a.as_bytes(), b.as_bytes(), "{isa}: embedding rows");
        if finished.packed.is_some() {
            assert!(is_shape(be.upload(&mut finished, 0, &[0u8; 4])));
            let mut out = be.alloc(4 * rows).unwrap();
            let as_q8 = be.matmul(
                Weight::new(&finished, GgmlType::Q8_0, rows / 2, cols),
                &xb,
                1,
                &mut out,
            );
            assert!(is_shape(as_q8));
        }
    }
}
