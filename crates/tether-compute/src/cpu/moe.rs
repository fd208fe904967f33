//! Mixture-of-experts on the cpu: routing by [`route_token`], and the expert products
//! grouped by expert, so each chosen expert's rows are read once per step whatever the
//! number of its tokens, through the same matmul kernels as dense layers.

use rayon::prelude::*;

use super::CpuBackend;
use super::buffer::CpuBuffer;
use super::check::{f32s, f32s_mut, shape_err};
use super::matmul::{Shape, matmul};
use crate::backend::Result;
use crate::moe::{MoeFfn, MoeRouting, MoeScratch, check_route, route_token};

impl CpuBackend {
    pub(super) fn moe_route_rows(
        &self,
        logits: &CpuBuffer,
        n_tokens: usize,
        routing: MoeRouting,
        ids: &mut CpuBuffer,
        weights: &mut CpuBuffer,
    ) -> Result<()> {
        const OP: &str = "moe_route";
        check_route(OP, logits, n_tokens, routing, ids, weights)?;
        let (n, k) = (routing.n_expert, routing.n_used);
        let logits = f32s(OP, "router logits", logits, n_tokens * n)?;
        let weights = f32s_mut(OP, "expert weights", weights, n_tokens * k)?;
        let mut picked = vec![0u32; n_tokens * k];
        for ((row, ids), w) in logits
            .chunks(n)
            .zip(picked.chunks_mut(k))
            .zip(weights.chunks_mut(k))
        {
            route_token(row, routing.norm_weights, ids, w);
        }
        for (dst, id) in ids.as_bytes_mut().chunks_exact_mut(4).zip(&picked) {
            dst.copy_from_slice(&id.to_le_bytes());
        }
        Ok(())
    }

    pub(super) fn moe_ffn_rows(
        &self,
        ffn: MoeFfn<'_, CpuBuffer>,
        acc: &mut CpuBuffer,
        scratch: MoeScratch<'_, CpuBuffer>,
    ) -> Result<()> {
        const OP: &str = "moe_ffn";
        let one = ffn.check(OP, acc)?;
        scratch.check(OP, &ffn)?;
        let (e, ff, k, n) = (ffn.n_embd, ffn.n_ff, ffn.routing.n_used, ffn.n_tokens);
        let picks = n * k;
        let ids: Vec<u32> = ffn.ids.as_bytes()[..picks * 4]
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= ffn.routing.n_expert) {
            return Err(shape_err(
                OP,
                format!(
                    "expert id {bad} is outside the layer's {} experts",
                    ffn.routing.n_expert
                ),
            ));
        }
        // Picks ordered by expert: `order[p]` is the pick (`t · k + j`) at row `p` of the
        // scratch, and expert `x` owns rows `starts[x]..starts[x + 1]`.
        let mut order: Vec<usize> = (0..picks).collect();
        order.sort_by_key(|&p| ids[p]);
        let mut starts = vec![0usize; ffn.routing.n_expert + 1];
        for &id in &ids {
            starts[id as usize + 1] += 1;
        }
        for x in 0..ffn.routing.n_expert {
            starts[x + 1] += starts[x];
        }
        let x = f32s(OP, "input", ffn.x, n * e)?;
        let weights = f32s(OP, "expert weights", ffn.weights, picks)?;
        let rows = f32s_mut(OP, "row scratch", scratch.rows, picks * e)?;
        let gate = f32s_mut(OP, "gate scratch", scratch.gate, picks * ff)?;
        let up = f32s_mut(OP, "up scratch", scratch.up, picks * ff)?;
        let acc = f32s_mut(OP, "accumulator", acc, n * e)?;
        let (wg, wu, wd) = (
            ffn.gate.buf.as_bytes(),
            ffn.up.buf.as_bytes(),
            ffn.down.buf.as_bytes(),
        );
        // Packed experts (Q4_0 after `finish_weight`) are read one expert's slice at a time,
        // which holds whole packed groups only when its rows are whole groups of eight.
        let packed = [
            (ffn.gate.buf.packed.is_some(), ff),
            (ffn.up.buf.packed.is_some(), ff),
            (ffn.down.buf.packed.is_some(), e),
        ];
        if let Some((_, r)) = packed.iter().find(|(p, r)| *p && r % 8 != 0) {
            return Err(shape_err(
                OP,
                format!("packed Q4_0 experts of {r} rows: the cpu needs a multiple of 8"),
            ));
        }
        let product = |p: bool, ty, w: &[u8], rows, cols, x: &[f32], n, out: &mut [f32]| {
            let s = Shape {
                rows,
                cols,
                n_tokens: n,
            };
            #[cfg(target_arch = "x86_64")]
            if p {
                return super::matmul::matmul_packed(self.isa, w, s, x, out);
            }
            let _ = p;
            matmul(self.isa, ty, w, s, x, out)
        };
        self.install(|| {
            rows.par_chunks_mut(e.max(1))
                .zip(order.par_iter())
                .for_each(|(r, &p)| r.copy_from_slice(&x[(p / k) * e..(p / k + 1) * e]));
            for xid in 0..ffn.routing.n_expert {
                let (r0, r1) = (starts[xid], starts[xid + 1]);
                if r0 == r1 {
                    continue;
                }
                let c = r1 - r0;
                let input = &rows[r0 * e..r1 * e];
                let g = &wg[xid * one.gate..(xid + 1) * one.gate];
                product(
                    packed[0].0,
                    ffn.gate.ty,
                    g,
                    ff,
                    e,
                    input,
                    c,
                    &mut gate[r0 * ff..r1 * ff],
                );
                let u = &wu[xid * one.up..(xid + 1) * one.up];
                product(
                    packed[1].0,
                    ffn.up.ty,
                    u,
                    ff,
                    e,
                    input,
                    c,
                    &mut up[r0 * ff..r1 * ff],
                );
            }
            gate.par_iter_mut()
                .zip(up.par_iter())
                .for_each(|(g, u)| *g = *g / (1.0 + (-*g).exp()) * u);
            for xid in 0..ffn.routing.n_expert {
                let (r0, r1) = (starts[xid], starts[xid + 1]);
                if r0 == r1 {
                    continue;
                }
                let d = &wd[xid * one.down..(xid + 1) * one.down];
                let act = &gate[r0 * ff..r1 * ff];
                product(
                    packed[2].0,
                    ffn.down.ty,
                    d,
                    e,
                    ff,
                    act,
                    r1 - r0,
                    &mut rows[r0 * e..r1 * e],
                );
            }
        });
        // Each token's picks added in the order the router ranked them.
        let mut row_of = vec![0usize; picks];
        for (row, &p) in order.iter().enumerate() {
            row_of[p] = row;
        }
        self.install(|| {
            acc.par_chunks_mut(e.max(1))
                .enumerate()
                .for_each(|(t, out)| {
                    for j in 0..k {
                        let p = t * k + j;
                        let w = weights[p];
                        let r = &rows[row_of[p] * e..(row_of[p] + 1) * e];
                        out.iter_mut().zip(r).for_each(|(o, v)| *o += w * v);
                    }
                });
        });
        Ok(())
    }
}
