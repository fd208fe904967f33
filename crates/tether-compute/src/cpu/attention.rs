//! Causal grouped-query attention over the KV cache (f16, or Q8_0/Q4_0 blocks), and the
//! cache writes. Sizes, cell indices and block alignment were checked by the caller.

use rayon::prelude::*;
use tether_gguf::{GgmlType, dequantize, quantize_q4_0, quantize_q8_0};

use crate::backend::{AttnShape, AttnSpan, KV_BLOCK_CELLS, KvCache, Result, Scores, kv_cell};
use crate::cpu::check::shape_err;
use crate::cpu::f16_rows::{axpy_f16_heads, dot_f16_heads, store_f16};
use crate::cpu::matmul::dot_f32;
use crate::cpu::simd::Avx2;

/// Writes row `t` of `src` (`kv_dim` values) into cache row `cells[t]` as `ty` (F16, Q8_0
/// or Q4_0; for the quants `kv_dim` is a multiple of 32).
pub(crate) fn kv_store(ty: GgmlType, src: &[f32], kv_dim: usize, cells: &[u32], cache: &mut [u8]) {
    let row_bytes = kv_dim / ty.block_elems() * ty.block_bytes();
    for (t, &cell) in cells.iter().enumerate() {
        let at = cell as usize * row_bytes;
        let (row, dst) = (
            &src[t * kv_dim..(t + 1) * kv_dim],
            &mut cache[at..at + row_bytes],
        );
        match ty {
            GgmlType::Q8_0 => quantize_q8_0(row, dst),
            GgmlType::Q4_0 => quantize_q4_0(row, dst),
            _ => store_f16(row, dst),
        }
    }
}

/// Per-task scratch: scores (cell-major, `[cell][head of group]`) and one decoded row.
type Scratch = (Vec<f32>, Vec<f32>);

/// `out[t][h] = Σ_c softmax_c(cap(scale · q[t][h] · k[c][h/g])) · v[c][h/g]` over the cells of
/// `spans[t]`, with `g = n_heads / n_kv_heads`; the cache's `k`/`v` rows are
/// `[n_kv_heads][head_dim]` of its `ty`, at the cells `table` maps the spans' virtual cells
/// to when the cache is paged.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    cpu: Option<Avx2>,
    q: &[f32],
    cache: KvCache<'_, [u8]>,
    table: Option<&[u32]>,
    spans: &[AttnSpan],
    shape: AttnShape,
    Scores { scale, softcap }: Scores,
    out: &mut [f32],
) {
    let KvCache { k, v, ty, .. } = cache;
    // Gemma 2 caps each scaled score at `softcap · tanh(score / softcap)`; 0: no cap.
    let score = |s: f32| {
        let s = scale * s;
        if softcap > 0.0 {
            softcap * (s / softcap).tanh()
        } else {
            s
        }
    };
    let AttnShape {
        n_heads,
        n_kv_heads,
        head_dim,
        ring_cells,
    } = shape;
    let group = n_heads / n_kv_heads;
    let head_bytes = head_dim / ty.block_elems() * ty.block_bytes();
    let cell_bytes = n_kv_heads * head_bytes;
    // Scores of one cache row for the `group` query heads in `qs`.
    let dot_heads = |qs: &[f32], row: &[u8], buf: &mut Vec<f32>, sc: &mut [f32]| {
        if ty == GgmlType::F16 {
            return dot_f16_heads(cpu, qs, head_dim, row, sc);
        }
        decode(ty, row, buf, head_dim);
        for (s, qv) in sc.iter_mut().zip(qs.chunks_exact(head_dim)) {
            *s = dot_f32(qv, buf);
        }
    };
    // `o[g] += p[g] · row` for the group's output heads.
    let axpy_heads = |o: &mut [f32], p: &[f32], row: &[u8], buf: &mut Vec<f32>| {
        if ty == GgmlType::F16 {
            return axpy_f16_heads(cpu, o, head_dim, p, row);
        }
        decode(ty, row, buf, head_dim);
        for (og, pg) in o.chunks_exact_mut(head_dim).zip(p) {
            og.iter_mut()
                .zip(buf.iter())
                .for_each(|(a, b)| *a += pg * b);
        }
    };
    // One task per (token, KV head) serves the whole group of query heads that share it,
    // so each cache row is read from memory once, not once per query head.
    out[..spans.len() * n_heads * head_dim]
        .par_chunks_mut(group * head_dim)
        .enumerate()
        .for_each_init(Scratch::default, |(scores, buf), (i, o)| {
            let (t, kh) = (i / n_kv_heads, i % n_kv_heads);
            let kv_at = kh * head_bytes;
            let qs = &q[i * group * head_dim..(i + 1) * group * head_dim];
            let span = spans[t];
            let n = span.n_cells as usize;
            // Spans are virtual cells of a ring or a paged cache (see `kv_cell`).
            let cell_at =
                |c: usize| kv_cell(span.first_cell + c as u32, ring_cells, table) as usize;
            scores.clear();
            scores.resize(group * n, 0.0);
            for (c, sc) in scores.chunks_exact_mut(group).enumerate() {
                let at = cell_at(c) * cell_bytes + kv_at;
                dot_heads(qs, &k[at..at + head_bytes], buf, sc);
            }
            let mut inv_sums = [0.0f32; 64];
            let mut inv_heap = Vec::new();
            let inv: &mut [f32] = if group <= 64 {
                &mut inv_sums[..group]
            } else {
                inv_heap.resize(group, 0.0);
                &mut inv_heap
            };
            for (g, inv) in inv.iter_mut().enumerate() {
                // Subtracting the maximum keeps exp() finite for any score range.
                let max = scores[g..]
                    .iter()
                    .step_by(group)
                    .fold(f32::NEG_INFINITY, |m, s| m.max(score(*s)));
                let mut sum = 0.0f32;
                for s in scores[g..].iter_mut().step_by(group) {
                    // A weight under e^-46 (1e-20) changes no sum of f32 values, but weights
                    // and products in f32's subnormal range take a microcode assist per
                    // operation on Intel cores: long spans ran ~10x slower for them.
                    let x = score(*s) - max;
                    *s = if x < -46.0 { 0.0 } else { x.exp() };
                    sum += *s;
                }
                *inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
            }
            o.fill(0.0);
            for (c, p) in scores.chunks_exact(group).enumerate() {
                let at = cell_at(c) * cell_bytes + kv_at;
                axpy_heads(o, p, &v[at..at + head_bytes], buf);
            }
            for (og, inv) in o.chunks_exact_mut(head_dim).zip(inv.iter()) {
                og.iter_mut().for_each(|x| *x *= inv);
            }
        });
}

/// A paged cache's block table (little-endian u32s), checked: every entry a whole block of
/// the cache's `n_cells` cells.
pub(crate) fn block_table(op: &'static str, bytes: &[u8], n_cells: usize) -> Result<Vec<u32>> {
    let n_blocks = n_cells / KV_BLOCK_CELLS as usize;
    let table: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    match table.iter().position(|&b| b as usize >= n_blocks) {
        Some(i) => Err(shape_err(
            op,
            format!(
                "block table entry {i} names block {}, but the cache holds {n_blocks} blocks",
                table[i]
            ),
        )),
        None => Ok(table),
    }
}

/// Decodes one head's cache row into `buf` (`head_dim` values).
fn decode(ty: GgmlType, row: &[u8], buf: &mut Vec<f32>, head_dim: usize) {
    buf.resize(head_dim, 0.0);
    if dequantize(ty, row, buf).is_err() {
        // Sizes were checked before the op; poison the result rather than panic.
        buf.fill(f32::NAN);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::test_util::{Rng, random_f32, relative_error};

    fn decoded(ty: GgmlType, bytes: &[u8]) -> Vec<f64> {
        let mut out = vec![0.0f32; bytes.len() / ty.block_bytes() * ty.block_elems()];
        dequantize(ty, bytes, &mut out).unwrap();
        out.into_iter().map(f64::from).collect()
    }

    #[test]
    fn gqa_attention_matches_f64_softmax() {
        // Head sizes off and on the SIMD width, groups of 3, 4, 1 and 16 (past the grouped
        // kernel's register budget).
        for (n_heads, n_kv_heads, head_dim) in [(6, 2, 20), (8, 2, 32), (4, 4, 16), (16, 1, 16)] {
            let shape = AttnShape {
                n_heads,
                n_kv_heads,
                head_dim,
                ring_cells: 0,
            };
            check_attention(shape, GgmlType::F16);
        }
        // Block-quantized caches need heads of whole 32-blocks.
        for (n_heads, n_kv_heads, head_dim) in [(8, 2, 32), (4, 1, 64)] {
            let shape = AttnShape {
                n_heads,
                n_kv_heads,
                head_dim,
                ring_cells: 0,
            };
            check_attention(shape, GgmlType::Q8_0);
            check_attention(shape, GgmlType::Q4_0);
        }
    }

    #[test]
    fn ring_spans_read_the_cells_their_positions_wrapped_to() {
        // Two sequences of 40 positions each; a plain cache keeps them in cells
        // `40·s + p`, rings of 11 cells in `11·s + p mod 11`. A window of 9 at every
        // position must give the same output from both.
        let shape = AttnShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 32,
            ring_cells: 0,
        };
        let (ring, window, len) = (11u32, 9u32, 40u32);
        let kv_dim = shape.n_kv_heads * shape.head_dim;
        let mut rng = Rng::new(77);
        let ty = GgmlType::F16;
        let row_bytes = kv_dim * 2;
        let rows = random_f32(&mut rng, 2 * len as usize * 2 * kv_dim, 2.0);
        let (mut k, mut v) = (vec![0u8; 80 * row_bytes], vec![0u8; 80 * row_bytes]);
        let (mut kr, mut vr) = (vec![0u8; 22 * row_bytes], vec![0u8; 22 * row_bytes]);
        let q = random_f32(&mut rng, shape.n_heads * shape.head_dim, 2.0);
        let qd = shape.n_heads * shape.head_dim;
        for seq in 0..2u32 {
            for pos in 0..len {
                let at = (seq * len + pos) as usize * 2 * kv_dim;
                let (krow, vrow) = (&rows[at..at + kv_dim], &rows[at + kv_dim..at + 2 * kv_dim]);
                let plain = [seq * len + pos];
                let ringed = [seq * ring + pos % ring];
                kv_store(ty, krow, kv_dim, &plain, &mut k);
                kv_store(ty, vrow, kv_dim, &plain, &mut v);
                kv_store(ty, krow, kv_dim, &ringed, &mut kr);
                kv_store(ty, vrow, kv_dim, &ringed, &mut vr);
                // Attention of position `pos` right after it is written, as a decode does.
                let start = pos.saturating_sub(window - 1);
                let plain_span = AttnSpan {
                    first_cell: seq * len + start,
                    n_cells: pos - start + 1,
                };
                let ring_span = AttnSpan {
                    first_cell: seq * 2 * ring + start % ring,
                    n_cells: pos - start + 1,
                };
                let (mut want, mut got) = (vec![0.0; qd], vec![0.0; qd]);
                let ringed_shape = AttnShape {
                    ring_cells: ring,
                    ..shape
                };
                let simd = Avx2::detect();
                attention(
                    simd,
                    &q,
                    KvCache::new(&k, &v, ty),
                    None,
                    &[plain_span],
                    shape,
                    Scores::capped(0.3, 0.0),
                    &mut want,
                );
                attention(
                    simd,
                    &q,
                    KvCache::new(&kr, &vr, ty),
                    None,
                    &[ring_span],
                    ringed_shape,
                    Scores::capped(0.3, 0.0),
                    &mut got,
                );
                assert_eq!(got, want, "sequence {seq}, position {pos}");
            }
        }
    }

    fn check_attention(shape: AttnShape, ty: GgmlType) {
        let mut rng = Rng::new(31);
        let kv_dim = shape.n_kv_heads * shape.head_dim;
        let n_cells = 12;
        let kr = random_f32(&mut rng, n_cells * kv_dim, 2.0);
        let vr = random_f32(&mut rng, n_cells * kv_dim, 2.0);
        let row_bytes = kv_dim / ty.block_elems() * ty.block_bytes();
        let mut k = vec![0u8; n_cells * row_bytes];
        let mut v = vec![0u8; n_cells * row_bytes];
        let cells: Vec<u32> = (0..n_cells as u32).rev().collect();
        // Store rows in reverse order to check the cell indexing of kv_store.
        let rev = |x: &[f32]| -> Vec<f32> { x.chunks(kv_dim).rev().flatten().copied().collect() };
        kv_store(ty, &rev(&kr), kv_dim, &cells, &mut k);
        kv_store(ty, &rev(&vr), kv_dim, &cells, &mut v);
        let (kf, vf) = (decoded(ty, &k), decoded(ty, &v));
        // Q4_0 keeps 16 levels over ±2: a step of 0.25, so at most one step off.
        let tol = if ty == GgmlType::Q4_0 { 0.3 } else { 2e-2 };
        for (a, b) in kf.iter().zip(&kr) {
            assert!((a - f64::from(*b)).abs() < tol, "{ty}");
        }

        let spans = [
            AttnSpan {
                first_cell: 0,
                n_cells: 1,
            },
            AttnSpan {
                first_cell: 0,
                n_cells: 7,
            },
            AttnSpan {
                first_cell: 3,
                n_cells: 9,
            },
        ];
        let qd = shape.n_heads * shape.head_dim;
        // Large queries push scores to ±50, which needs the max subtraction.
        let q = random_f32(&mut rng, spans.len() * qd, 4.0);
        let scale = 0.5;
        let mut out = vec![0.0; q.len()];
        attention(
            Avx2::detect(),
            &q,
            KvCache::new(&k, &v, ty),
            None,
            &spans,
            shape,
            Scores::capped(scale, 0.0),
            &mut out,
        );

        let mut want = vec![0.0f64; q.len()];
        for (t, sp) in spans.iter().enumerate() {
            for h in 0..shape.n_heads {
                let kh = h / (shape.n_heads / shape.n_kv_heads);
                let qv = &q[t * qd + h * shape.head_dim..][..shape.head_dim];
                let cs: Vec<usize> = (sp.first_cell..sp.first_cell + sp.n_cells)
                    .map(|c| c as usize)
                    .collect();
                let s: Vec<f64> = cs
                    .iter()
                    .map(|&c| {
                        let kv = &kf[c * kv_dim + kh * shape.head_dim..][..shape.head_dim];
                        0.5 * qv
                            .iter()
                            .zip(kv)
                            .map(|(a, b)| f64::from(*a) * b)
                            .sum::<f64>()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..shape.head_dim {
                    want[t * qd + h * shape.head_dim + d] = cs
                        .iter()
                        .zip(&e)
                        .map(|(&c, p)| p / z * vf[c * kv_dim + kh * shape.head_dim + d])
                        .sum();
                }
            }
        }
        assert!(relative_error(&out, &want) < 1e-5, "{ty} {shape:?}");
        // A single visible cell returns its value row exactly (up to f16 → f32).
        for d in 0..shape.head_dim {
            assert!((f64::from(out[d]) - vf[d]).abs() < 1e-6);
        }
    }

    #[test]
    fn paged_spans_read_the_cells_their_block_table_names() {
        // Two sequences of 3 blocks of virtual cells each. A plain cache holds them in
        // order; the paged one holds the same rows in blocks scattered by the table, with
        // sequence 1's first block shared with sequence 0's. Both must give one output.
        let shape = AttnShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 32,
            ring_cells: 0,
        };
        let b = KV_BLOCK_CELLS as usize;
        let table: [u32; 6] = [4, 1, 5, 4, 0, 2];
        let kv_dim = shape.n_kv_heads * shape.head_dim;
        let row_bytes = kv_dim * 2;
        let ty = GgmlType::F16;
        let mut rng = Rng::new(78);
        let rows = random_f32(&mut rng, 6 * b * kv_dim, 2.0);
        let vrows = random_f32(&mut rng, 6 * b * kv_dim, 2.0);
        let (mut k, mut v) = (vec![0u8; 6 * b * row_bytes], vec![0u8; 6 * b * row_bytes]);
        let (mut kp, mut vp) = (k.clone(), v.clone());
        for virt in 0..6 * b {
            // Sequence 1's first block is sequence 0's: its rows are those.
            let src = if (virt / b) == 3 { virt - 3 * b } else { virt };
            let row = |r: &[f32]| r[src * kv_dim..(src + 1) * kv_dim].to_vec();
            let cell = kv_cell(virt as u32, 0, Some(&table));
            kv_store(ty, &row(&rows), kv_dim, &[virt as u32], &mut k);
            kv_store(ty, &row(&vrows), kv_dim, &[virt as u32], &mut v);
            kv_store(ty, &row(&rows), kv_dim, &[cell], &mut kp);
            kv_store(ty, &row(&vrows), kv_dim, &[cell], &mut vp);
        }
        let span = |seq: usize, pos: usize| AttnSpan {
            first_cell: (seq * 3 * b) as u32,
            n_cells: pos as u32 + 1,
        };
        let spans = [
            span(0, 0),
            span(0, 70),
            span(1, 40),
            span(1, 95),
            span(1, 20),
        ];
        let q = random_f32(&mut rng, spans.len() * shape.n_heads * shape.head_dim, 2.0);
        let run = |k: &[u8], v: &[u8], table: Option<&[u32]>| {
            let mut out = vec![0.0; q.len()];
            let cache = KvCache::new(k, v, ty);
            attention(
                None,
                &q,
                cache,
                table,
                &spans,
                shape,
                Scores::scaled(0.3),
                &mut out,
            );
            out
        };
        assert_eq!(run(&kp, &vp, Some(&table)), run(&k, &v, None));
        let bytes: Vec<u8> = table.iter().flat_map(|e| e.to_le_bytes()).collect();
        assert_eq!(block_table("attention", &bytes, 6 * b).unwrap(), table);
        let err = block_table("attention", &bytes, 5 * b).unwrap_err();
        assert!(err.to_string().contains("entry 2 names block 5"), "{err}");
    }
}

#[cfg(test)]
mod bench {
    use super::*;
    use crate::cpu::test_util::{Rng, random_f32};
    use std::time::Instant;

    /// `cargo test -p tether-compute --release bench_attention -- --ignored --nocapture`
    #[test]
    #[ignore = "benchmark; run by hand"]
    fn bench_attention() {
        let mut rng = Rng::new(8);
        let shape = AttnShape {
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 64,
            ring_cells: 0,
        };
        let cells = 4096;
        let kv_dim = shape.n_kv_heads * shape.head_dim;
        let mut k = vec![0u8; 2 * cells * kv_dim];
        let mut v = vec![0u8; 2 * cells * kv_dim];
        let rows: Vec<u32> = (0..cells as u32).collect();
        kv_store(
            GgmlType::F16,
            &random_f32(&mut rng, cells * kv_dim, 1.0),
            kv_dim,
            &rows,
            &mut k,
        );
        kv_store(
            GgmlType::F16,
            &random_f32(&mut rng, cells * kv_dim, 1.0),
            kv_dim,
            &rows,
            &mut v,
        );
        for n_tokens in [1usize, 64] {
            let spans: Vec<AttnSpan> = (0..n_tokens)
                .map(|t| AttnSpan {
                    first_cell: 0,
                    n_cells: (cells - n_tokens + t + 1) as u32,
                })
                .collect();
            let q = random_f32(&mut rng, n_tokens * 32 * 64, 1.0);
            let mut out = vec![0.0; q.len()];
            // The fastest of several runs: the machine is shared, the minimum is the signal.
            let mut best = f64::MAX;
            for _ in 0..10 {
                let start = Instant::now();
                attention(
                    Avx2::detect(),
                    &q,
                    KvCache::new(&k, &v, GgmlType::F16),
                    None,
                    &spans,
                    shape,
                    Scores::capped(0.125, 0.0),
                    &mut out,
                );
                best = best.min(start.elapsed().as_secs_f64());
            }
            eprintln!(
                "attention {cells} cells, {n_tokens} tokens: {:.3} ms",
                best * 1e3
            );
        }
    }
}
