//! Checks shared by the GPU tests of finished (possibly packed) weights: products with and
//! without the residual add, embedding rows, and the fused decode products (q/k/v in one
//! launch; gate, up and SiLU in one launch, then the down projection over its output): the
//! cuda backend's results against the cpu's on the same finished weights.

use tether_compute::Weight;
use tether_compute::{Backend, CpuBackend, CudaBackend};
use tether_gguf::GgmlType;

use super::{Rng, f32_bytes, get, put, random_weights};

/// ‖a − b‖ / ‖b‖, after checking every value is finite.
pub fn relative_error(what: &str, a: &[f32], b: &[f32]) -> f64 {
    assert!(a.iter().all(|v| v.is_finite()), "{what}: non-finite output");
    let d: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
        .sum();
    let n: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (d / n.max(1e-30)).sqrt()
}

/// A zeroed-or-not buffer of `n` f32.
pub fn zeros<B: Backend>(be: &B, n: usize) -> B::Buffer {
    be.alloc(n * 4).unwrap()
}

/// A weight on both backends, finished; `packed` says whether the GPU's bytes changed.
pub struct Finished {
    pub g: <CudaBackend as Backend>::Buffer,
    pub c: <CpuBackend as Backend>::Buffer,
    pub packed: bool,
}

pub fn finished(
    g: &CudaBackend,
    c: &CpuBackend,
    ty: GgmlType,
    bytes: &[u8],
    cols: usize,
) -> Finished {
    let (mut wg, mut wc) = (put(g, bytes), put(c, bytes));
    g.finish_weight(&mut wg, ty, cols).unwrap();
    c.finish_weight(&mut wc, ty, cols).unwrap();
    let mut now = vec![0u8; bytes.len()];
    g.download(&wg, 0, &mut now).unwrap();
    Finished {
        g: wg,
        c: wc,
        packed: now != bytes,
    }
}

/// The backends on a test's random data, and what packing to expect of `finished` weights.
pub struct Rig<'a> {
    pub g: &'a CudaBackend,
    pub c: &'a CpuBackend,
    pub rng: &'a mut Rng,
    pub cols: usize,
    /// Whether every weight must come out packed.
    pub expect_packed: bool,
}

impl Rig<'_> {
    fn weight(&mut self, ty: GgmlType, rows: usize, cols: usize) -> Finished {
        let bytes = random_weights(self.rng, ty, rows * cols);
        let w = finished(self.g, self.c, ty, &bytes, cols);
        if self.expect_packed {
            assert!(w.packed, "{ty} {rows}x{cols}: packed");
        }
        w
    }

    /// `w` (`rows` x `self.cols` of `ty`) times each token count of random activations,
    /// plain and added into a residual, within `tol` of the cpu.
    pub fn products(
        &mut self,
        w: &Finished,
        ty: GgmlType,
        rows: usize,
        tokens: &[usize],
        tol: f64,
    ) {
        let (g, c, cols) = (self.g, self.c, self.cols);
        for &n in tokens {
            let x = self.rng.f32s(n * cols, 1.0);
            let (xg, xc) = (put(g, &f32_bytes(&x)), put(c, &f32_bytes(&x)));
            let (mut og, mut oc) = (zeros(g, n * rows), zeros(c, n * rows));
            g.matmul(Weight::new(&w.g, ty, rows, cols), &xg, n, &mut og)
                .unwrap();
            c.matmul(Weight::new(&w.c, ty, rows, cols), &xc, n, &mut oc)
                .unwrap();
            let what = format!("matmul {ty} {rows}x{cols} n={n}");
            let e = relative_error(&what, &get(g, &og, n * rows), &get(c, &oc, n * rows));
            assert!(e < tol, "{what}: relative error {e}");

            // The residual add fused into the product.
            let start = f32_bytes(&self.rng.f32s(n * rows, 1.0));
            let (mut ag, mut ac) = (put(g, &start), put(c, &start));
            let (mut tg, mut tc) = (zeros(g, n * rows), zeros(c, n * rows));
            g.matmul_add(Weight::new(&w.g, ty, rows, cols), &xg, n, &mut ag, &mut tg)
                .unwrap();
            c.matmul_add(Weight::new(&w.c, ty, rows, cols), &xc, n, &mut ac, &mut tc)
                .unwrap();
            let what = format!("matmul_add {ty} {rows}x{cols} n={n}");
            let e = relative_error(&what, &get(g, &ag, n * rows), &get(c, &ac, n * rows));
            assert!(e < tol, "{what}: relative error {e}");
        }
    }

    /// Embedding rows of a finished 7-row table of `ty` decode exactly as the cpu's.
    pub fn embedding_rows(&mut self, ty: GgmlType) {
        let (g, c, cols) = (self.g, self.c, self.cols);
        let table = self.weight(ty, 7, cols);
        let ids = [6u32, 0, 3, 3, 1];
        let (mut og, mut oc) = (zeros(g, ids.len() * cols), zeros(c, ids.len() * cols));
        g.get_rows(&table.g, ty, cols, &ids, &mut og).unwrap();
        c.get_rows(&table.c, ty, cols, &ids, &mut oc).unwrap();
        let n = ids.len() * cols;
        let what = format!("get_rows {ty}");
        let e = relative_error(&what, &get(g, &og, n), &get(c, &oc, n));
        assert!(e < 1e-6, "{what}: relative error {e}");
    }

    /// q/k/v of `types` (40 rows end inside a block of the q/k/v kernels) for each token
    /// count, within `tol` of the cpu.
    pub fn qkv(&mut self, types: [GgmlType; 3], tokens: &[usize], tol: f64) {
        self.qkv_shaped(types, [96, 40, 40], tokens, tol);
    }

    /// [`Rig::qkv`] with q, k and v of `rows` rows.
    pub fn qkv_shaped(
        &mut self,
        types: [GgmlType; 3],
        rows: [usize; 3],
        tokens: &[usize],
        tol: f64,
    ) {
        let (g, c, cols) = (self.g, self.c, self.cols);
        let ws: Vec<Finished> = (0..3)
            .map(|i| self.weight(types[i], rows[i], cols))
            .collect();
        for &n in tokens {
            let x = self.rng.f32s(n * cols, 1.0);
            let (xg, xc) = (put(g, &f32_bytes(&x)), put(c, &f32_bytes(&x)));
            let mut og: Vec<_> = rows.iter().map(|r| zeros(g, n * r)).collect();
            let mut oc: Vec<_> = rows.iter().map(|r| zeros(c, n * r)).collect();
            let [g0, g1, g2] = &mut og[..] else {
                unreachable!()
            };
            let wg = [&ws[0].g, &ws[1].g, &ws[2].g];
            g.matmul3(
                [
                    Weight::new(wg[0], types[0], rows[0], cols),
                    Weight::new(wg[1], types[1], rows[1], cols),
                    Weight::new(wg[2], types[2], rows[2], cols),
                ],
                &xg,
                n,
                [g0, g1, g2],
            )
            .unwrap();
            let [c0, c1, c2] = &mut oc[..] else {
                unreachable!()
            };
            let wc = [&ws[0].c, &ws[1].c, &ws[2].c];
            c.matmul3(
                [
                    Weight::new(wc[0], types[0], rows[0], cols),
                    Weight::new(wc[1], types[1], rows[1], cols),
                    Weight::new(wc[2], types[2], rows[2], cols),
                ],
                &xc,
                n,
                [c0, c1, c2],
            )
            .unwrap();
            for i in 0..3 {
                let what = format!("matmul3 {types:?} output {i} n={n}");
                let e = relative_error(
                    &what,
                    &get(g, &og[i], n * rows[i]),
                    &get(c, &oc[i], n * rows[i]),
                );
                assert!(e < tol, "{what}: relative error {e}");
            }
        }
    }

    /// Gate and up of `ty`, then down over their output, for each token count: 256 rows
    /// are whole 8-bit blocks, so the gate/up kernel also writes the down projection's
    /// 8-bit input; 72 rows end inside a block and take the plain path. The gate/up output
    /// must be within `tol` of the cpu's and the down projection within `down_tol`.
    pub fn gate_up_down(&mut self, ty: GgmlType, tokens: &[usize], tol: f64, down_tol: f64) {
        let (g, c, cols) = (self.g, self.c, self.cols);
        for &n in tokens {
            // Small enough that the gate/up output (about the square of x's scale times the
            // weights') stays inside f16's range: batches the GEMM takes (from 9 tokens
            // for the weights it decodes) read the down projection's input as f16. With
            // x in [-1, 1), these random weights gave values past 10^6.
            let x = self.rng.f32s(n * cols, 1.0 / 32.0);
            let (xg, xc) = (put(g, &f32_bytes(&x)), put(c, &f32_bytes(&x)));
            for r in [256usize, 72] {
                let gate = self.weight(ty, r, cols);
                let up = self.weight(ty, r, cols);
                let (mut sg, mut g1, mut g2) = (zeros(g, n * r), zeros(g, n * r), zeros(g, n * r));
                let (mut sc, mut c1, mut c2) = (zeros(c, n * r), zeros(c, n * r), zeros(c, n * r));
                g.matmul_swiglu(
                    [
                        Weight::new(&gate.g, ty, r, cols),
                        Weight::new(&up.g, ty, r, cols),
                    ],
                    &xg,
                    n,
                    &mut sg,
                    [&mut g1, &mut g2],
                )
                .unwrap();
                c.matmul_swiglu(
                    [
                        Weight::new(&gate.c, ty, r, cols),
                        Weight::new(&up.c, ty, r, cols),
                    ],
                    &xc,
                    n,
                    &mut sc,
                    [&mut c1, &mut c2],
                )
                .unwrap();
                let what = format!("matmul_swiglu {ty} {r} rows n={n}");
                let e = relative_error(&what, &get(g, &sg, n * r), &get(c, &sc, n * r));
                assert!(e < tol, "{what}: relative error {e}");
                if !r.is_multiple_of(256) {
                    continue;
                }
                let down_rows = 48;
                let bytes = random_weights(self.rng, ty, down_rows * r);
                let down = finished(g, c, ty, &bytes, r);
                if self.expect_packed {
                    assert!(down.packed, "{ty}: down packed");
                }
                let (mut dg, mut dc) = (zeros(g, n * down_rows), zeros(c, n * down_rows));
                g.matmul(Weight::new(&down.g, ty, down_rows, r), &sg, n, &mut dg)
                    .unwrap();
                c.matmul(Weight::new(&down.c, ty, down_rows, r), &sc, n, &mut dc)
                    .unwrap();
                let what = format!("down after matmul_swiglu {ty} n={n}");
                let e = relative_error(
                    &what,
                    &get(g, &dg, n * down_rows),
                    &get(c, &dc, n * down_rows),
                );
                assert!(e < down_tol, "{what}: relative error {e}");
            }
        }
    }
}
